"""bench/benchutil.py: what every bench reports the same way."""

from __future__ import annotations

import pytest

from benchload import load_bench


@pytest.fixture(scope="module")
def benchutil():
    return load_bench("benchutil")


def test_spread_is_best_median_and_nearest_rank_p90(benchutil):
    rounds = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 8.0, 7.0, 6.0, 10.0]
    assert benchutil.pct(rounds, 0.9) == 9.0
    assert benchutil.pct(rounds, 0.5) == 5.0
    assert benchutil.pct([3.0], 0.99) == 3.0
    assert benchutil.spread(rounds) == (1.0, 5.5, 9.0)
    assert benchutil.spread_text([1.0, 2.0, 30.0], "{:.1f}") == \
        "1.0 (2.0, 30.0)"


def test_statement_is_timed_as_written(benchutil):
    class Counter:
        lookups = 0

        def __getattribute__(self, name):
            if name == "method":
                type(self).lookups += 1
            return object.__getattribute__(self, name)

        def method(self):
            return None

    rounds = benchutil.statement_ns("s.method()", {"s": Counter()}, 50, 3)
    assert len(rounds) == 3 and all(t > 0 for t in rounds)
    assert Counter.lookups == 150


def test_command_and_load(benchutil):
    assert benchutil.command("bench/x.py", ["--write", "-n", "5"]) == \
        "python bench/x.py --write -n 5"
    assert benchutil.command("bench/x.py", ["a b"]) == \
        "python bench/x.py 'a b'"
    text = benchutil.load_text((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))
    assert text.startswith("load average 1.00, 2.00, 3.00 before, "
                           "4.00, 5.00, 6.00 after on ")
    assert len(benchutil.loadavg()) == 3


def test_a_section_is_written_stamped_and_replaces_only_its_own(
        benchutil, tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## probe\n\n"
                       "<!-- probe:begin -->\nold probe\n<!-- probe:end -->"
                       "\n\n## board\n\nboard figures\n")
    monkeypatch.setattr(benchutil, "RESULTS", str(results))
    monkeypatch.setattr(benchutil, "stamp", lambda script: "0123456789ab")
    benchutil.write_section("probe", "## probe", "new probe\n",
                            "bench/bench_probe.py")
    benchutil.write_section("edges", "## edges", "edges figures",
                            "bench/bench_edges.py")
    text = results.read_text()
    assert "old probe" not in text and "board figures" in text
    assert text.count("<!-- probe:begin -->") == 1
    assert ("<!-- probe:begin -->\n<!-- measured: bench/bench_probe.py at "
            "0123456789ab -->\n\nMeasured at commit `0123456789ab` by "
            "`bench/bench_probe.py`.\n\nnew probe\n\n<!-- probe:end -->"
            ) in text
    assert text.endswith("## edges\n\n<!-- edges:begin -->\n<!-- measured: "
                         "bench/bench_edges.py at 0123456789ab -->\n\n"
                         "Measured at commit `0123456789ab` by "
                         "`bench/bench_edges.py`.\n\nedges figures\n\n"
                         "<!-- edges:end -->\n")


def test_every_bench_that_writes_says_what_it_measures(benchutil):
    from pathlib import Path

    bench = Path(benchutil.__file__).parent
    writers = sorted(f"bench/{p.name}" for p in bench.glob("bench_*.py")
                     if "write_section(" in p.read_text())
    assert writers == sorted(benchutil.MEASURES)
