"""bench/RESULTS.md describes the code as it is: each bench's section names
the commit it measured (``benchutil.write_section``), a clean one, and no
commit since has changed what that bench measures (``benchutil.MEASURES``).
Without git (a tree from the sdist) only the stamps are checked."""

from __future__ import annotations

import re
import subprocess

from pathlib import Path

from benchload import load_bench

ROOT = Path(__file__).resolve().parents[1]
benchutil = load_bench("benchutil")

STAMP = re.compile(r"<!-- measured: (\S+) at ([0-9a-f]{7,40}) -->")
BLOCK = re.compile(r"<!-- ([\w-]+):begin -->(.*?)<!-- \1:end -->", re.S)


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args],
                          capture_output=True, text=True)


def stamps() -> dict[str, tuple[str, str]]:
    """{section name: (script, commit)} of every section of
    bench/RESULTS.md."""
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    found = {}
    for name, body in BLOCK.findall(text):
        got = STAMP.findall(body)
        assert len(got) == 1, f"section {name}: {len(got)} stamps"
        found[name] = got[0]
    return found


def test_every_bench_has_one_stamped_section():
    scripts = sorted(script for script, _ in stamps().values())
    assert scripts == sorted(benchutil.MEASURES), scripts


def test_no_section_is_older_than_the_code_it_measures():
    if git("rev-parse", "--git-dir").returncode != 0:
        return  # not a checkout: the stamps alone (above)
    shallow = git("rev-parse", "--is-shallow-repository").stdout.strip()
    stale = []
    for name, (script, commit) in stamps().items():
        if shallow == "true" and git("cat-file", "-e",
                                     f"{commit}^{{commit}}").returncode:
            continue  # a shallow clone that stops before it: unjudged
        if git("merge-base", "--is-ancestor", commit, "HEAD").returncode:
            stale.append(f"{name}: {commit} is not in this history")
            continue
        paths = (script, "bench/benchutil.py", *benchutil.MEASURES[script])
        since = git("log", "--format=%h %s", f"{commit}..HEAD", "--",
                    *paths).stdout.splitlines()
        if since:
            stale.append(f"{name} ({script} at {commit}): changed since by "
                         + "; ".join(since[:3]))
    assert stale == [], (
        "bench/RESULTS.md sections older than what they measure; rerun "
        "each with --write on a clean tree:\n" + "\n".join(stale))


def test_a_stamp_refuses_a_tree_that_differs(tmp_path, monkeypatch):
    """--write on a tree with uncommitted changes to what the bench
    measures stops, saying so, instead of stamping HEAD."""
    if git("rev-parse", "--git-dir").returncode != 0:
        return
    calls = []

    def fake_git(*args: str) -> str:
        calls.append(args)
        return " M src/standin.c" if args[0] == "status" else "abc123"

    monkeypatch.setattr(benchutil, "_git", fake_git)
    try:
        benchutil.stamp("bench/bench_standin.py")
    except SystemExit as exc:
        assert "commit first" in str(exc) and "src/standin.c" in str(exc)
    else:
        raise AssertionError("a dirty tree was stamped")
    assert calls[0][:2] == ("status", "--porcelain")
    assert "src" in calls[0]
