"""The counts docs/RELIABILITY.md and the README give, from the tree.

    python tools/counts.py            print the generated blocks
    python tools/counts.py --write    rewrite them in the docs
    python tools/counts.py --check    exit 1 when the docs disagree
    python tools/counts.py --timed --write
                                      also run the whole suite once and
                                      record how long it took, and on what

The counts are those of pytest's collection with the README's test
command (every test, the default marker selection), per test file, per
implementation (the ``impl`` fixture's ``c`` and ``reference``) and per
marker, plus the C sources and fuzz harnesses.  They are the same on any
machine for a given tree, so ``--check`` (tests/test_counts.py runs it)
compares them exactly.

Durations differ by machine: only ``--timed`` writes one, measured here,
with the machine, the commit and the number of tests it was measured on;
``--check`` requires that there is one, that the README's figure is the
one docs/RELIABILITY.md records, and that it is not stale (``stale()``:
the number of tests moved by more than STALE_TESTS, or more than
STALE_COMMITS commits changed the code it measures, since); inside the
suite a timing run measures, only the README's figure is checked.

A merge that conflicts inside a generated block: take either side, then
``python tools/counts.py --write``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELIABILITY = ROOT / "docs" / "RELIABILITY.md"
README = ROOT / "README.md"

COUNTS = "counts"
SUITE_TIME = "suite time"
#: A recorded suite time is stale when the README's test command runs
#: more than this share of tests more or fewer than it measured...
STALE_TESTS = 0.05
#: ... or when more than this many commits changed what the suite runs
#: (CODE) since the commit it was measured at.
STALE_COMMITS = 40
CODE = ("tests", "python", "src", "include", "meson.build", "pyproject.toml")
MARKERS = ("comfy_env", "network", "torch_worker", "comfyui")

#: What the suite's collection is asked: the README's test command.
COLLECT = [sys.executable, "-m", "pytest", "--collect-only", "-q",
           "-p", "no:cacheprovider"]
#: Every test, torch_worker and comfyui ones too (deselected by default).
EVERYTHING = ["-m", "torch_worker or comfyui or not (torch_worker or "
              "comfyui)"]


def begin(name: str) -> str:
    return f"<!-- BEGIN GENERATED: {name} (python tools/counts.py) -->"


def end(name: str) -> str:
    return f"<!-- END GENERATED: {name} -->"


@dataclass
class Collected:
    per_file: Counter = field(default_factory=Counter)
    impl: dict[str, Counter] = field(default_factory=dict)
    markers: dict[str, Counter] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.per_file.values())


#: A pytest plugin (a file written next to nothing: loaded by path) that
#: prints one JSON line per collected test: node id, impl, markers.
PLUGIN = '''
import json


def pytest_collection_finish(session):
    for item in session.items:
        spec = getattr(item, "callspec", None)
        impl = spec.params.get("impl") if spec is not None else None
        print("COUNTS " + json.dumps({
            "file": item.nodeid.split("::", 1)[0],
            "impl": impl if impl in ("c", "reference") else None,
            "markers": sorted({m.name for m in item.iter_markers()}),
        }))
'''


def collect(selection: list[str], plugin_dir: Path) -> Collected:
    (plugin_dir / "counts_plugin.py").write_text(PLUGIN)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(plugin_dir), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [*COLLECT, "-p", "counts_plugin", *selection],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )
    if done.returncode != 0:
        sys.exit(f"tools/counts.py: pytest's collection failed "
                 f"(exit {done.returncode}):\n{done.stdout[-4000:]}"
                 f"{done.stderr[-2000:]}")
    found = Collected()
    for line in done.stdout.splitlines():
        if not line.startswith("COUNTS "):
            continue
        item = json.loads(line[len("COUNTS "):])
        name = item["file"]
        found.per_file[name] += 1
        if item["impl"]:
            found.impl.setdefault(name, Counter())[item["impl"]] += 1
        for marker in item["markers"]:
            if marker in MARKERS:
                found.markers.setdefault(name, Counter())[marker] += 1
    return found


def number(n: int) -> str:
    return f"{n:,}"


def counts_block(everything: Collected, default: Collected) -> str:
    c = sum(v["c"] for v in everything.impl.values())
    ref = sum(v["reference"] for v in everything.impl.values())
    marked = {m: sum(v[m] for v in everything.markers.values())
              for m in MARKERS}
    sources = sorted(p.name for p in (ROOT / "src").glob("*.c"))
    harnesses = sorted(p.stem for p in
                       (ROOT / "tests" / "fuzz").glob("fuzz_*.c"))
    lines = [
        begin(COUNTS),
        "",
        f"- **{number(default.total)} tests** run under the README's test "
        f"command (`python -m pytest`); "
        f"{number(everything.total)} are collected in all: "
        f"{number(everything.total - default.total)} more, marked "
        f"`torch_worker` or `comfyui`, run in CI steps of their own.",
        f"- {number(c)} run on the C type and {number(ref)} on the "
        f"pure-Python reference (the `impl` fixture); the rest are "
        f"C programs, tooling, the command line, typing and docs checks.",
        f"- Marked `comfy_env` (left out by `-m \"not comfy_env\"`): "
        f"{number(marked['comfy_env'])}; `network`: "
        f"{number(marked['network'])}; `torch_worker`: "
        f"{number(marked['torch_worker'])}; `comfyui`: "
        f"{number(marked['comfyui'])}.",
        f"- {len(sources)} C source files in `src/` (static analysis); "
        f"{len(harnesses)} libFuzzer harnesses in `tests/fuzz/` "
        f"({', '.join(harnesses)}).",
        "",
        "| test file | tests | on C | on the reference | marked |",
        "|---|---:|---:|---:|---|",
    ]
    for name in sorted(everything.per_file):
        impl = everything.impl.get(name, Counter())
        marks = everything.markers.get(name, Counter())
        shown = ", ".join(f"{m} {marks[m]}" for m in MARKERS if marks[m])
        lines.append(
            f"| `{name}` | {number(everything.per_file[name])} | "
            f"{number(impl['c']) if impl['c'] else ''} | "
            f"{number(impl['reference']) if impl['reference'] else ''} | "
            f"{shown} |")
    lines += ["", end(COUNTS)]
    return "\n".join(lines)


def block(text: str, name: str, path: Path) -> str:
    pattern = re.compile(re.escape(begin(name)) + r".*?" + re.escape(
        end(name)), re.S)
    found = pattern.search(text)
    if found is None:
        sys.exit(f"tools/counts.py: {path.relative_to(ROOT)} has no "
                 f"'{begin(name)}' ... '{end(name)}' block")
    return found.group(0)


def replace(text: str, name: str, path: Path, new: str) -> str:
    old = block(text, name, path)
    return text.replace(old, new, 1)


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{platform.system()} {platform.machine()}, {model}, "
            f"{os.cpu_count()} CPUs")


def git(*args: str) -> str | None:
    """git's output in this tree, or None (no git, not a checkout, an
    unknown commit)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def timed_run(tests: int) -> dict[str, object]:
    """Runs the README's test command once; its duration and what it ran
    on (the load average says what else was running), the commit and the
    number of `tests` collected."""
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, TIMING: "1"},
    )
    seconds = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"tools/counts.py: the suite failed (exit "
                 f"{done.returncode}); no time recorded:\n"
                 f"{done.stdout[-4000:]}")
    return {
        "seconds": round(seconds),
        "machine": machine(),
        "python": platform.python_version(),
        "load": f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "date": time.strftime("%Y-%m-%d"),
        "summary": done.stdout.strip().splitlines()[-1].strip("= "),
        "commit": git("rev-parse", "--short=12", "HEAD") or "unknown",
        "tests": tests,
    }


def minutes(seconds: int) -> str:
    whole, rest = divmod(seconds, 60)
    return f"{whole} min {rest:02d} s" if whole else f"{rest} s"


def suite_time_block(run: dict[str, object]) -> str:
    return "\n".join([
        begin(SUITE_TIME),
        f"The suite (`python -m pytest`, the README's test command once "
        f"installed) took **{minutes(run['seconds'])}** "
        f"({run['seconds']} s; {run['summary']}) on {run['machine']}, "
        f"CPython {run['python']}, load average {run['load']}, "
        f"{run['date']}, at commit `{run['commit']}` with "
        f"{number(int(str(run['tests'])))} tests: measured by `python "
        f"tools/counts.py --timed --write`. Other jobs on the machine "
        f"make it longer.",
        end(SUITE_TIME),
    ])


#: Set for the suite a timing run measures: inside it, the record being
#: made cannot be required to exist yet (the counts are still checked).
TIMING = "COMFY_STANDIN_COUNTS_TIMING"
NOT_TIMED = ("Not timed on this tree yet: run `python tools/counts.py "
             "--timed --write`.")


def measured(reliability_block: str) -> re.Match | None:
    return re.search(r"took \*\*(.+?)\*\* \((\d+) s; (.+?)\) on (.+?), "
                     r"CPython", reliability_block)


def stamp(reliability_block: str) -> tuple[str, int] | None:
    """(commit, tests) a recorded suite time was measured at."""
    got = re.search(r"at commit `([0-9a-f]+|unknown)` with ([\d,]+) tests",
                    reliability_block)
    return None if got is None else (got.group(1),
                                     int(got.group(2).replace(",", "")))


def stale(reliability_block: str, tests: int) -> list[str]:
    """Why the recorded suite time no longer describes this tree (empty:
    it does).  Without git history only the number of tests is judged."""
    remedy = "run `python tools/counts.py --timed --write`"
    got = stamp(reliability_block)
    if got is None:
        return [f"the suite time records no commit and test count: "
                f"{remedy}"]
    commit, then = got
    problems = []
    if abs(tests - then) > STALE_TESTS * then:
        problems.append(
            f"the suite time was measured with {number(then)} tests, the "
            f"README's command now runs {number(tests)} (more than "
            f"{STALE_TESTS:.0%} apart): {remedy}")
    if git("rev-parse", "--git-dir") is None:
        return problems  # not a checkout (an unpacked sdist)
    if git("rev-parse", "--is-shallow-repository") == "true" and \
            git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return problems  # a shallow clone that stops before the commit
    if commit == "unknown" or git("merge-base", "--is-ancestor", commit,
                                  "HEAD") is None:
        problems.append(f"the suite time was measured at commit "
                        f"{commit}, which is not in this tree's history: "
                        f"{remedy}")
        return problems
    since = int(git("rev-list", "--count", f"{commit}..HEAD", "--", *CODE)
                or 0)
    if since > STALE_COMMITS:
        problems.append(
            f"the suite time was measured at commit {commit}; {since} "
            f"commits have changed {', '.join(CODE)} since (more than "
            f"{STALE_COMMITS}): {remedy}")
    return problems


def readme_time(reliability_block: str) -> str:
    """The README's sentence, derived from RELIABILITY.md's record."""
    got = measured(reliability_block)
    if got is None:
        return "\n".join([begin(SUITE_TIME), NOT_TIMED, end(SUITE_TIME)])
    shown, _, _, where = got.groups()
    at = stamp(reliability_block)
    when = (f", at commit `{at[0]}` with {number(at[1])} tests"
            if at is not None else "")
    return "\n".join([
        begin(SUITE_TIME),
        f"The tests (`python -m pytest`) take about {shown} on {where}"
        f"{when} (measured by "
        f"`tools/counts.py`: [docs/RELIABILITY.md](docs/RELIABILITY.md)).",
        end(SUITE_TIME),
    ])


def untracked() -> list[str]:
    """Files git does not track under the folders tests scan: they
    change the collection (tests parametrized over the tree's files)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--others",
             "--exclude-standard"], capture_output=True, text=True,
            check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [n for n in out.splitlines() if n.split("/", 1)[0] in (
        "docs", "src", "include", "tests", "bench", "python", "examples",
        "tools") or "/" not in n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/counts.py",
        description="Counts for docs/RELIABILITY.md and the README.")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true",
                        help="rewrite the generated blocks")
    action.add_argument("--check", action="store_true",
                        help="exit 1 when a committed block disagrees")
    parser.add_argument("--timed", action="store_true",
                        help="also run the whole suite and record its time")
    args = parser.parse_args(argv)
    if args.timed and args.check:
        parser.error("--timed measures; --check compares: pick one")

    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        everything = collect(EVERYTHING, Path(scratch))
        default = collect([], Path(scratch))
    new_counts = counts_block(everything, default)
    run = timed_run(default.total) if args.timed else None
    if not (args.write or args.check):
        print(new_counts)
        if run is not None:
            print()
            print(suite_time_block(run))
        return 0

    reliability = RELIABILITY.read_text()
    readme = README.read_text()
    time_block = block(reliability, SUITE_TIME, RELIABILITY)
    if run is not None:
        time_block = suite_time_block(run)
    wanted_reliability = replace(
        replace(reliability, COUNTS, RELIABILITY, new_counts),
        SUITE_TIME, RELIABILITY, time_block)
    wanted_readme = replace(readme, SUITE_TIME, README,
                            readme_time(time_block))

    if args.check:
        problems = []
        if not os.environ.get(TIMING):
            if measured(time_block) is None:
                problems.append("docs/RELIABILITY.md records no suite "
                                "time: run `python tools/counts.py "
                                "--timed --write`")
            else:
                problems += stale(time_block, default.total)
        for path, have, want in ((RELIABILITY, reliability,
                                  wanted_reliability),
                                 (README, readme, wanted_readme)):
            if have != want:
                problems += difflib.unified_diff(
                    have.splitlines(), want.splitlines(),
                    f"{path.relative_to(ROOT)} (committed)",
                    f"{path.relative_to(ROOT)} (from the tree)",
                    lineterm="", n=1)
        if problems:
            print("\n".join(problems))
            print("\nThe docs' generated blocks are out of date: run "
                  "`python tools/counts.py --write` (a stale suite time: "
                  "`--timed --write`) and commit.")
            stray = untracked()
            if stray:
                print("Untracked files count too (tests are parametrized "
                      "over the tree's files): " + ", ".join(stray))
            return 1
        print("docs/RELIABILITY.md and README.md: counts up to date")
        return 0
    RELIABILITY.write_text(wanted_reliability)
    README.write_text(wanted_readme)
    print("wrote docs/RELIABILITY.md and README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
