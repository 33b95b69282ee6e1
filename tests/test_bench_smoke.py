"""The stand-in benchmark still runs (bench/bench_standin.py).

One iteration of every measurement with tiny counts, so CI catches a
broken bench.  Nothing here asserts a time or a ratio: speed is measured
by running the bench (bench/README.md), never by tests (docs/architecture.md).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from benchload import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_standin.py"


def _is_comfy_module(name: str) -> bool:
    return name in ("comfy", "comfy_env") or name.startswith(
        ("comfy.", "comfy_env.")
    )


@pytest.fixture(scope="module")
def bench() -> Any:
    before = set(sys.modules)
    module = load_bench("bench_standin", register=True)
    yield module
    # The bench imports comfy-env (when installed) over a stub comfy; leave
    # no module behind that another test might take for the real one.
    for name in set(sys.modules) - before:
        if name == "bench_standin" or _is_comfy_module(name):
            del sys.modules[name]


@pytest.fixture(scope="module")
def results(bench: Any) -> Any:
    return bench.run(bench.SMOKE)


def test_every_row_has_a_number_for_every_implementation(
    bench: Any, results: Any
) -> None:
    assert [row.key for row in results.rows] == [
        key for key, _, _ in bench.row_names()
    ]
    assert results.impls[:2] == ["c", "reference"]
    for row in results.rows:
        assert set(row.values) == set(results.impls), row.key
        for name, value in row.values.items():
            assert math.isfinite(value), (row.key, name, value)
            if row.key == "mem-rss":
                # page-granular: a handful of stand-ins may not grow RSS
                assert value >= 0, (row.key, name, value)
            else:
                assert value > 0, (row.key, name, value)


def test_table_has_every_row_and_a_ratio_column_per_other_impl(
    bench: Any, results: Any
) -> None:
    table = bench.format_table(results)
    for _, label, unit in bench.row_names():
        assert f"| {label} | {unit} |" in table
    assert "| ref/C |" in table
    if "comfy-env" in results.impls:
        assert "| comfy-env/C |" in table


def test_comfy_env_is_measured_or_its_absence_explained(
    results: Any,
) -> None:
    assert ("comfy-env" in results.impls) == (results.missing is None)
    if results.missing is not None:
        assert results.missing  # says why


def test_notes_cover_every_implementation(results: Any) -> None:
    for notes in (results.graph_notes, results.thread_notes):
        assert [note.split(":", 1)[0] for note in notes] == results.impls


def test_the_section_says_what_ran(bench: Any, results: Any) -> None:
    text = bench.format_section(results, "the command")
    assert text.startswith("Command: `the command`")


METHOD_CALLS = BENCH.parent / "bench_method_calls.py"


def test_the_method_call_bench_runs_and_writes_its_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """bench/bench_method_calls.py, with tiny counts, in this interpreter
    and in a child of it (--pythons), into a copy of bench/RESULTS.md."""
    spec = importlib.util.spec_from_file_location(
        "bench_method_calls", METHOD_CALLS
    )
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n")
    monkeypatch.setattr(module.benchutil, "RESULTS", str(results))
    monkeypatch.setattr(module.benchutil, "stamp", lambda script: "abc")
    assert module.main(["--rounds", "2", "--per-round", "50"]) == 0
    assert module.main(["--pythons", sys.executable, "--rounds", "2",
                        "--per-round", "50", "--write"]) == 0
    out = capsys.readouterr().out
    for call in ("n.bit_length()", "s.loaded_size()", "s.model_size()",
                 "s.is_dynamic()"):
        assert call in out
    text = results.read_text()
    assert "<!-- method-calls:begin -->" in text
    assert "<!-- method-calls:end -->" in text
    assert "--pythons" in text and "goal" in text
