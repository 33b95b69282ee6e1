"""The eviction regret bench still runs (bench/bench_regret.py).

One scenario with real worker processes in each mode, and a free_memory
pass over N = 1 and 16 stand-ins, no plot.  No time is asserted (speed is
measured by running the bench, bench/README.md).  The regret figures are
asserted where they hold by construction: the demo worker publishes each
change on its board before it replies, and the scenario's boards cannot go
stale (an hour's heartbeat limit), so a stand-in reading the board sees
the same residency as the oracle (the worker's own report) at every
decision and must decide as it does; and in "paging in" B/unet's receipt
(0.5 GiB) is 2.5 GiB behind what B paged in, so receipts alone must show
regret.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# The workers get their board as an inherited memfd (Linux).
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="the bench hands boards to workers as memfd descriptors",
)

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_regret.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    assert BENCH.exists(), f"{BENCH} is missing"
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("bench_regret", BENCH)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    for name in set(sys.modules) - before:
        if name == spec.name or name.startswith("comfy_env"):
            del sys.modules[name]


@pytest.fixture(scope="module")
def regret(bench: Any) -> Any:
    return bench.measure_regret(smoke=True)


def test_every_mode_ran_the_scenario(bench: Any, regret: Any) -> None:
    results, missing, _ = regret
    modes = [r.mode for r in results]
    expected = [m for m in bench.MODES if m != "comfy-env" or not missing]
    assert modes == expected
    for r in results:
        assert r.error is None, (r.mode, r.error)
        assert len(r.passes) == 2, r.mode


def test_boards_decide_as_the_oracle(regret: Any) -> None:
    results, _, _ = regret
    (boards,) = [r for r in results if r.mode == "boards"]
    for p in boards.passes:
        assert p.evicted == p.oracle_evicted
        assert p.free_after == p.oracle_free_after
    assert (boards.excess, boards.wrong, boards.short) == (0, 0, 0)


def test_receipts_show_the_regret_the_board_removes(regret: Any) -> None:
    results, _, _ = regret
    (receipts,) = [r for r in results if r.mode == "receipts"]
    assert receipts.excess > 0 or receipts.wrong > 0
    first = receipts.passes[0]
    # B paged its unet in with no message: receipts took all 3 GiB of it
    assert first.evicted["B/unet"] == 3 << 30
    assert first.oracle_evicted["B/unet"] == 0


def test_comfy_env_runs_or_its_absence_is_explained(regret: Any) -> None:
    results, missing, _ = regret
    ran = any(r.mode == "comfy-env" for r in results)
    assert ran == (missing is None)
    if missing is not None:
        assert missing


def test_pass_timing_has_a_number_per_impl_and_n(bench: Any) -> None:
    timings = bench.measure_pass((1, 16), rounds=1, min_batch=0.0)
    assert {"c", "reference", "mock HostModel"} <= set(timings)
    for name, points in timings.items():
        assert sorted(points) == [1, 16], name
        for n, t in points.items():
            assert math.isfinite(t) and t > 0, (name, n, t)
    table = bench.pass_table(timings)
    assert "| 16 |" in table


def test_write_replaces_only_its_own_section(
    bench: Any, regret: Any, tmp_path: Path
) -> None:
    results, missing, label = regret
    timings = {"c": {1: 1e-6, 16: 1.6e-5}}
    path = tmp_path / "RESULTS.md"
    path.write_text(
        "# Benchmark results\n\n## probe\n\nprobe figures\n\n"
        f"{bench.HEADING}\n\n{bench.BEGIN_MARKER}\nold\n{bench.END_MARKER}\n"
        "\n## board\n\nboard figures\n"
    )
    section = bench.format_section(
        results, missing, label, timings, "no plot here", "the command", 1.0
    )
    bench.write_section(path, section)
    text = path.read_text()
    assert "probe figures" in text and "board figures" in text
    assert "\nold\n" not in text
    assert text.count(bench.BEGIN_MARKER) == 1
    assert "`the command`" in text and "No plots: no plot here" in text
