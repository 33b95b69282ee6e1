"""Smoke test of bench/bench_board_view.py: its functions run, with tiny
counts and durations, and produce numbers.  No timing is asserted (speed
lives in bench/RESULTS.md); the one comparison is a scripted lockstep
call in which the board's view is right by construction and the receipt
is the start echo, so the board's error cannot exceed the receipt's.
Nothing sleeps to synchronise: the scripted call waits on the worker's
pipe and on the board itself."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest

# The board is POSIX shared memory; its Windows path is not written yet
# (docs/board.md), so on Windows these tests cannot run.
pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="the board is POSIX shared memory"
)

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_board_view.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_board_view", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def test_reads_produce_numbers(bench):
    reads = bench.bench_reads(50, repeats=1)
    assert finite(reads["empty"])
    for name in ("C", "reference"):
        assert finite(reads[name]["receipts"]) and reads[name]["receipts"] > 0
        assert finite(reads[name]["board"]) and reads[name]["board"] > 0


def test_scripted_call_board_error_not_above_receipt(bench):
    gib = bench.GIB
    values = [2 * gib, 5 * gib, 1 * gib, 7 * gib, 0, 3 * gib]
    with bench.Host() as host:
        timeline, samples = bench.script_call(host, values)
    assert [v for _, v in timeline] == values
    errors = bench.summarize_errors(timeline, samples, bench.SIZE)
    assert errors["samples"] == len(values) + 1
    r, b = errors["receipts"], errors["board"]
    # Between the echoes the receipt is the start value; the board shows
    # each value before the host samples it.
    assert b["mean"] <= r["mean"] and b["max"] <= r["max"]
    assert b["max"] == 0 and r["max"] == 7 * gib - 2 * gib


def test_busy_call_and_staleness_produce_numbers(bench):
    with bench.Host() as host:
        timeline, samples = bench.sample_call(host, 0.02, 500, seed=3)
        errors = bench.summarize_errors(timeline, samples, host.size)
        stale = bench.staleness(*bench.poll_call(host, 0.02, seed=4))
    assert errors["samples"] > 0 and len(timeline) >= 1
    for view in ("receipts", "board"):
        for key in ("mean", "p95", "max", "exact"):
            assert finite(errors[view][key])
    assert stale["changes"] >= 0 and stale["missed"] >= 0
    args = argparse.Namespace(
        duration=0.02, step_min_us=500, step_max_us=2000, period_us=500,
        stale_duration=0.02)
    reads = bench.bench_reads(10, repeats=1)
    text = bench.report(reads, errors, stale, args)
    assert text.startswith(bench.SECTION)


def test_write_section_replaces_only_its_own(bench, tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## board\n\nold board\n\n"
                    f"{bench.SECTION}\n\nold view\n\n## probe\n\nprobe\n")
    bench.write_section(f"{bench.SECTION}\n\nnew view\n", path)
    text = path.read_text()
    assert "old view" not in text and "new view" in text
    assert "## board\n\nold board" in text and "## probe\n\nprobe" in text
    bench.write_section(f"{bench.SECTION}\n\nnewer\n", path)
    assert path.read_text().count(bench.SECTION) == 1
