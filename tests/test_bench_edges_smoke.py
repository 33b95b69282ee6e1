"""bench/bench_edges.py still runs: one tiny round of every row.  No time
or ratio is asserted (speed lives in bench/RESULTS.md); the memory row's
direction is, because it is a byte count, not a time."""

from __future__ import annotations

import logging
import math

import pytest

from benchload import load_bench

# The census rows run comfy-env's state_sync through the adapter.
pytestmark = pytest.mark.comfy_env



def test_every_row_has_numbers_and_the_section_is_whole():
    module = load_bench("bench_edges")
    level = logging.getLogger("comfy_standin").level
    results = module.run(module.SMOKE)
    assert logging.getLogger("comfy_standin").level == level  # left as found
    assert len(results["rows"]) == 3
    for job, _, a, _, b in results["rows"]:
        assert len(a) == len(b) == module.SMOKE["rounds"], job
        for t in (*a, *b):
            assert math.isfinite(t) and t > 0, job
    _, now, before = results["memory"]
    assert 0 <= now < before  # the reasons are not kept
    text = module.section(results, ["--smoke"], (0.5, 0.5, 0.5))
    assert text.startswith("Command:")
    assert "`python bench/bench_edges.py --smoke`" in text
    assert "load average 0.50, 0.50, 0.50 before" in text
    assert "best (median, p90)" in text
