"""docs/RELIABILITY.md's and the README's generated counts are the tree's.

``python tools/counts.py --check`` collects the suite as the README's
test command does and compares the generated blocks; this test runs it,
so a tree whose counts changed fails until ``python tools/counts.py
--write`` is run and committed.  The other tests check that the check
can fail and that the README's duration is the one RELIABILITY.md
records (never a hand-written one).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "counts.py"


def load_script():
    spec = importlib.util.spec_from_file_location("counts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["counts"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["counts"]
    return module


def test_the_committed_counts_are_the_trees():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True,
        text=True, timeout=900, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_a_changed_count_is_found(tmp_path):
    counts = load_script()
    text = (ROOT / "docs" / "RELIABILITY.md").read_text()
    committed = counts.block(text, counts.COUNTS, ROOT / "docs")
    total = re.search(r"\*\*([\d,]+) tests\*\*", committed)
    assert total, committed
    doctored = committed.replace(total.group(0), "**1 tests**")
    assert doctored != committed
    # what --check compares: the committed block against a regenerated one
    assert counts.replace(text, counts.COUNTS, ROOT / "docs",
                          doctored) != text


def test_the_readme_time_comes_from_reliability():
    counts = load_script()
    reliability = (ROOT / "docs" / "RELIABILITY.md").read_text()
    readme = (ROOT / "README.md").read_text()
    recorded = counts.block(reliability, counts.SUITE_TIME, ROOT / "docs")
    if not os.environ.get(counts.TIMING):  # not the run that measures
        assert re.search(r"took \*\*\d+ min \d\d s\*\*|took \*\*\d+ s\*\*",
                         recorded), recorded
        assert ("measured by `python tools/counts.py --timed --write`"
                in recorded)
    assert counts.block(readme, counts.SUITE_TIME, ROOT) == \
        counts.readme_time(recorded)
    # a hand-edited README figure is not the recorded one
    edited = counts.readme_time(recorded).replace("about ", "about 1 + ")
    edited = edited.replace("Not timed", "Timed")
    assert edited != counts.block(readme, counts.SUITE_TIME, ROOT)


def test_the_blocks_are_built_from_what_was_collected():
    counts = load_script()
    everything = counts.Collected()
    everything.per_file.update({"tests/test_a.py": 3, "tests/test_b.py": 2})
    everything.impl["tests/test_a.py"] = counts.Counter(c=1, reference=1)
    everything.markers["tests/test_b.py"] = counts.Counter(comfy_env=2)
    default = counts.Collected()
    default.per_file.update({"tests/test_a.py": 3, "tests/test_b.py": 1})
    text = counts.counts_block(everything, default)
    assert "**4 tests** run under the README's test command" in text
    assert "5 are collected in all: 1 more, marked" in text
    assert "| `tests/test_a.py` | 3 | 1 | 1 |  |" in text
    assert "| `tests/test_b.py` | 2 |  |  | comfy_env 2 |" in text


def test_a_stale_suite_time_is_found():
    """The recorded time is stale when the number of tests moved by more
    than STALE_TESTS, when more than STALE_COMMITS commits changed the
    code since the commit it was measured at, or when that commit is not
    in the history; --timed --write is the remedy each time."""
    counts = load_script()
    head = counts.git("rev-parse", "--short=12", "HEAD")
    assert head, "tests/test_counts.py runs in a git checkout"

    def block(commit, tests):
        return counts.suite_time_block({
            "seconds": 133, "summary": f"{tests} passed", "python": "3.11",
            "machine": "Linux x86_64, a CPU, 2 CPUs", "load": "1.0 before",
            "date": "2026-01-01", "commit": commit, "tests": tests})

    assert counts.stale(block(head, 1000), 1000) == []
    assert counts.stale(block(head, 1000), 1050) == []
    (moved,) = counts.stale(block(head, 1000), 1051)
    assert "measured with 1,000 tests" in moved and "1,051" in moved
    (gone,) = counts.stale(block("0123456789ab", 1000), 1000)
    assert "not in this tree's history" in gone
    code_commits = counts.git("rev-list", "HEAD", "--", *counts.CODE)
    older = code_commits.split()[counts.STALE_COMMITS + 1]
    (behind,) = counts.stale(block(older[:12], 1000), 1000)
    since = re.search(r"; (\d+) commits have changed tests, python", behind)
    assert since and int(since.group(1)) > counts.STALE_COMMITS, behind
    for problem in (moved, gone, behind):
        assert problem.endswith("`python tools/counts.py --timed --write`")
    old = block(head, 1000).replace(f", at commit `{head}` with 1,000 "
                                    f"tests", "")
    assert counts.stale(old, 1000) == [
        "the suite time records no commit and test count: run `python "
        "tools/counts.py --timed --write`"]
    # The README says where its figure comes from.
    assert f", at commit `{head}` with 1,000 tests (" in counts.readme_time(
        block(head, 1000))
