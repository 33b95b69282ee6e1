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
