"""What every bench in bench/ reports the same way: the spread of its
rounds beside the best, the machine's load while it ran, and the command
that reproduces it (built from the arguments it really ran with).

Timings are of a statement as a caller writes it (``s.loaded_size()``:
the name looked up, the attribute looked up, the call), compiled into a
loop the way ``timeit`` does, never of a method bound once before the
loop: the attribute lookup is part of what ComfyUI pays.
"""

from __future__ import annotations

import math
import os
import shlex
import statistics
import timeit
from collections.abc import Sequence
from typing import Any


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (zeros where unknown)."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return (0.0, 0.0, 0.0)


def load_text(before: Sequence[float], after: Sequence[float]) -> str:
    """'load average 1.20, 1.00, 0.90 before, 2.10, 1.30, 1.00 after on
    2 CPUs'"""
    return (f"load average {', '.join(f'{x:.2f}' for x in before)} before, "
            f"{', '.join(f'{x:.2f}' for x in after)} after on "
            f"{os.cpu_count()} CPUs")


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(len(ordered), rank) - 1]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(best, median, p90) of a cost measured over rounds."""
    return min(values), statistics.median(values), pct(values, 0.9)


def spread_text(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    """'best (median, p90)'"""
    best, median, p90 = spread(values)
    return f"{fmt.format(best)} ({fmt.format(median)}, {fmt.format(p90)})"


def statement_ns(statement: str, namespace: dict[str, Any], number: int,
                 rounds: int) -> list[float]:
    """ns per execution of `statement` in each of `rounds` rounds of
    `number` executions (timeit: the collector is off while it runs)."""
    timer = timeit.Timer(statement, globals=namespace)
    return [t / number * 1e9 for t in timer.repeat(rounds, number)]


def command(script: str, argv: Sequence[str]) -> str:
    """The command line that reproduces a run."""
    return shlex.join(["python", script, *argv])


# ---- sections of bench/RESULTS.md, stamped with the commit they measured ----

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "RESULTS.md")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What each bench measures (git pathspecs from the repository root):
#: its section is stale once a commit after its stamp changed one of
#: these, the bench itself or bench/benchutil.py
#: (tests/test_bench_results.py).
_STANDIN = ("src", "include", "meson.build", "python/comfy_standin/pool.py",
            "python/comfy_standin/_reference.py",
            "python/comfy_standin/__init__.py")
MEASURES: dict[str, tuple[str, ...]] = {
    "bench/bench_probe.py": ("src/probe*", "include/comfy_standin/probe.h"),
    "bench/bench_standin.py": _STANDIN,
    "bench/bench_memory.py": (*_STANDIN, "bench/bench_standin.py"),
    "bench/bench_method_calls.py": _STANDIN,
    "bench/bench_board.py": ("src/board*", "include/comfy_standin/board.h",
                             "python/comfy_standin/_worker_side"),
    "bench/bench_board_view.py": (*_STANDIN,
                                  "python/comfy_standin/_worker_side",
                                  "bench/busy_worker.py"),
    "bench/bench_edges.py": ("python/comfy_standin", "src"),
    "bench/bench_regret.py": ("bench/regret_sim.py",
                              "bench/regret_workloads.py", "bench/traces",
                              "python/comfy_standin/pool.py",
                              "python/comfy_standin/integrations", "src"),
}


def _git(*args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True,
                          text=True, check=True).stdout.strip()


def stamp(script: str) -> str:
    """The commit a section of `script` measures: HEAD, refused (SystemExit)
    when the tree differs from it in anything the bench measures."""
    paths = (script, "bench/benchutil.py", *MEASURES[script])
    dirty = _git("status", "--porcelain", "--", *paths)
    if dirty:
        raise SystemExit(
            f"{script} --write: the tree differs from HEAD in what it "
            f"measures; commit first, so that the section names the code "
            f"it measured:\n{dirty}")
    return _git("rev-parse", "--short=12", "HEAD")


def write_section(name: str, heading: str, body: str, script: str) -> None:
    """Writes `body` as section `name` of bench/RESULTS.md, under
    `heading`, stamped with the commit it measured (``stamp``)."""
    commit = stamp(script)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = (f"{begin}\n<!-- measured: {script} at {commit} -->\n\n"
             f"Measured at commit `{commit}` by `{script}`.\n\n"
             f"{body.strip()}\n\n{end}")
    with open(RESULTS) as f:
        text = f.read()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = f"{text.rstrip()}\n\n{heading}\n\n{block}\n"
    with open(RESULTS, "w") as f:
        f.write(text)
