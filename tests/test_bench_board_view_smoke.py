"""Smoke test of bench/bench_board_view.py: its functions run, with tiny
counts and durations, and produce numbers.  No timing is asserted (speed
lives in bench/RESULTS.md); the one comparison is a scripted lockstep
call in which the board's view is right by construction and the receipt
is the start echo, so the board's error cannot exceed the receipt's.
Nothing sleeps to synchronise: the scripted call waits on the worker's
pipe and on the board itself."""

from __future__ import annotations

import argparse
import math
import sys

import pytest

from benchload import load_bench

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the board is a sealed memfd: Linux only"
)



@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_board_view")


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def test_reads_produce_numbers(bench):
    reads = bench.bench_reads(50, repeats=2)
    assert len(reads["empty"]) == 2 and all(map(finite, reads["empty"]))
    for name in ("C", "reference"):
        for case in ("receipts", "board"):
            rounds = reads[name][case]
            assert len(rounds) == 2, (name, case)
            assert all(finite(t) and t > 0 for t in rounds), (name, case)


class CountingStandIn:
    """Counts every lookup of its loaded_size attribute."""

    lookups = 0

    def __getattribute__(self, name):
        if name == "loaded_size":
            type(self).lookups += 1
        return object.__getattribute__(self, name)

    def loaded_size(self):
        return 0


def test_reads_look_the_method_up_on_every_call(bench):
    # ComfyUI calls s.loaded_size(): a bound method made once before the
    # loop would leave the attribute lookup out of the figure
    s = CountingStandIn()
    rounds = bench.read_ns(s, 100, 3)
    assert len(rounds) == 3
    assert CountingStandIn.lookups == 300


def test_header_and_command_are_what_was_run(bench):
    reads = {"empty": [20.0, 21.0], "n": 1234, "repeats": 2,
             "C": {"receipts": [25.0, 26.0], "board": [30.0, 31.0]},
             "reference": {"receipts": [250.0, 260.0],
                           "board": [600.0, 610.0]}}
    errors = {"size": bench.SIZE, "samples": 10, "changes": 5,
              "receipts": {"mean": 5.0, "p95": 6.0, "max": 7.0,
                           "exact": 0.1},
              "board": {"mean": 1.0, "p95": 0.0, "max": 2.0, "exact": 0.9}}
    stale = {"changes": 5, "missed": 1, "median_us": 1.0, "p90_us": 2.0,
             "p99_us": 3.0, "max_us": 4.0}
    args = argparse.Namespace(
        duration=0.02, step_min_us=500, step_max_us=2000, period_us=500,
        stale_duration=0.02, n=1234, repeats=2,
        argv=["-n", "1234", "--repeats", "2"])
    text = bench.report(reads, errors, stale, args, "a machine",
                        (0.5, 0.5, 0.5))
    assert "best (median, p90) of 2 rounds x 1,234" in text
    assert "`python bench/bench_board_view.py -n 1234 --repeats 2`" in text
    assert "load average 0.50, 0.50, 0.50 before" in text


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
        stale_duration=0.02, argv=[])
    reads = bench.bench_reads(10, repeats=1)
    text = bench.report(reads, errors, stale, args, None, (0.0, 0.0, 0.0))
    assert text.startswith("Command: `python bench/bench_board_view.py")
