#!/usr/bin/env python
"""What ComfyUI's calls on a stand-in cost against the same call on a
built-in, on each CPython the package supports.

ComfyUI calls ``loaded_size()``, ``model_size()`` and ``is_dynamic()`` on
every candidate of every eviction pass (``LoadedModel.model_memory``,
``model_loaded_memory``, the ``free_memory`` sort key), as
``s.loaded_size()``: the attribute lookup is part of the call.  Each is
timed as ComfyUI writes it, beside ``n.bit_length()`` on an int (a
built-in type's METH_NOARGS method, the cheapest method call CPython
has), in one process, in many short rounds that take turns, with the bare
loop of the same round subtracted.  Reported per Python: the median and
the 95th percentile over the rounds, their ratio to the built-in's, and
the machine's load average while it ran.  Nothing here asserts a time.

Run from the repository root::

    python bench/bench_method_calls.py              # this interpreter
    python bench/bench_method_calls.py --pythons PY1 PY2 ... [--write]

``--pythons`` runs the measurement under each interpreter given (each
with comfy_standin installed, e.g. a virtual environment's ``python``)
and prints one table; ``--write`` also rewrites the section of
bench/RESULTS.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "RESULTS.md"
BEGIN_MARKER = "<!-- method-calls:begin -->"
END_MARKER = "<!-- method-calls:end -->"
HEADING = "## method calls"

#: (row, loop, target): the built-in first, then the stand-in calls; a
#: stand-in holding a part of its model (the figure ComfyUI's sort key
#: and model_unload read most), all of it, and none.
ROWS = (
    ("bit_length", "bit_length", "int"),
    ("loaded_size", "loaded_size", "part"),
    ("loaded_size, all loaded", "loaded_size", "all"),
    ("loaded_size, none loaded", "loaded_size", "none"),
    ("model_size", "model_size", "part"),
    ("is_dynamic", "is_dynamic", "part"),
)
CALLS = tuple(row for row, _, _ in ROWS)
GOAL = 1.5

LOOPS = """
def empty(x, n):
    for _ in range(n):
        pass

def bit_length(x, n):
    for _ in range(n):
        x.bit_length()

def loaded_size(x, n):
    for _ in range(n):
        x.loaded_size()

def model_size(x, n):
    for _ in range(n):
        x.model_size()

def is_dynamic(x, n):
    for _ in range(n):
        x.is_dynamic()
"""


class _Worker:
    def send_command(self, command: str, **kwargs: Any) -> dict:
        return {}

    def is_alive(self) -> bool:
        return True


def measure(rounds: int, per_round: int) -> dict[str, Any]:
    """This interpreter's figures: per call, ns, bare loop subtracted."""
    import comfy_standin as cs

    pool = cs.Pool(process_local=False)
    worker = _Worker()
    size = 8 << 30
    targets: dict[str, Any] = {"int": 1 << 40}
    for name, loaded in (("part", 5 << 30), ("all", size), ("none", 0)):
        s = cs.StandIn(worker, 1, name, size, "cuda:0", "cpu", pool=pool)
        cs.apply_echo(s, loaded, seq=1)
        targets[name] = s
    namespace: dict[str, Any] = {}
    exec(compile(LOOPS, "<loops>", "exec"), namespace)  # noqa: S102
    for _, loop, target in ROWS:  # warm-up: specialisation on 3.11+
        namespace[loop](targets[target], 5000)
    namespace["empty"](None, 5000)
    load_before = os.getloadavg()
    samples: dict[str, list[float]] = {row: [] for row in CALLS}
    clock = time.perf_counter_ns
    for r in range(rounds):
        order = list(ROWS)
        order = order[r % len(order):] + order[:r % len(order)]
        t0 = clock()
        namespace["empty"](None, per_round)
        empty = clock() - t0
        for row, name, target in order:
            loop, obj = namespace[name], targets[target]
            t0 = clock()
            loop(obj, per_round)
            elapsed = clock() - t0
            samples[row].append(max(0.0, (elapsed - empty) / per_round))
    load_after = os.getloadavg()
    figures = {}
    for name, values in samples.items():
        values.sort()
        figures[name] = {
            "median": statistics.median(values),
            "p95": values[int(0.95 * (len(values) - 1))],
        }
    return {
        "python": platform.python_implementation() + " "
        + platform.python_version(),
        "rounds": rounds,
        "per_round": per_round,
        "load": [load_before[0], load_after[0]],
        "figures": figures,
    }


def _ratio(figures: dict[str, Any], name: str, key: str) -> float:
    base = figures["bit_length"][key]
    return figures[name][key] / base if base > 0 else float("nan")


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| Python | call | median ns | p95 ns | median / built-in "
        "| p95 / built-in | load (1 min) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        figures = result["figures"]
        load = "{:.2f} to {:.2f}".format(*result["load"])
        for name in CALLS:
            method, _, state = name.partition(", ")
            call = ("`n.bit_length()` (built-in)" if name == "bit_length"
                    else f"`s.{method}()`" + (f", {state}" if state else ""))
            lines.append(
                f"| {result['python']} | {call} "
                f"| {figures[name]['median']:.1f} "
                f"| {figures[name]['p95']:.1f} "
                f"| {_ratio(figures, name, 'median'):.2f} "
                f"| {_ratio(figures, name, 'p95'):.2f} | {load} |"
            )
    return "\n".join(lines)


def verdict(results: list[dict[str, Any]]) -> str:
    def call(name: str) -> str:
        method, _, state = name.partition(", ")
        return f"s.{method}()" + (f", {state}" if state else "")

    worst = max(
        (_ratio(r["figures"], name, "median"), r["python"], call(name))
        for r in results for name in CALLS if name != "bit_length"
    )
    within = worst[0] <= GOAL
    return (
        f"Largest median ratio: {worst[0]:.2f} (`{worst[2]}` on "
        f"{worst[1]}); the goal, at most {GOAL}x the built-in's call on "
        f"each Python, is {'met' if within else 'NOT met'}."
    )


def run_children(pythons: list[str], rounds: int,
                 per_round: int) -> list[dict[str, Any]]:
    results = []
    for python in pythons:
        done = subprocess.run(
            [python, str(Path(__file__).resolve()), "--child",
             "--rounds", str(rounds), "--per-round", str(per_round)],
            capture_output=True, text=True, check=True,
            cwd=str(HERE.parent),
        )
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def format_section(results: list[dict[str, Any]], command: str) -> str:
    first = results[0]
    return "\n".join([
        BEGIN_MARKER,
        f"Command: `{command}` (each path a virtual environment's python "
        "with comfy_standin installed).  Each Python in its own process: "
        f"{first['rounds']} rounds of {first['per_round']:,} calls of each, "
        "taking turns, the bare loop of the same round subtracted; the "
        "median and the 95th percentile over the rounds, each as a ratio "
        "to `n.bit_length()` (a built-in type's method, called the same "
        "way).  The calls are written as ComfyUI writes them, attribute "
        "lookup included.  Load: the 1-minute load average before and "
        "after the Python's run (the machine has "
        f"{os.cpu_count()} cores, shared).",
        "",
        f"- CPU: {platform.processor() or platform.machine()}; "
        f"{platform.system()} {platform.release()}",
        "",
        format_table(results),
        "",
        verdict(results),
        END_MARKER,
    ])


def write_section(section: str) -> None:
    text = RESULTS_PATH.read_text()
    if BEGIN_MARKER in text:
        head, rest = text.split(BEGIN_MARKER, 1)
        _, tail = rest.split(END_MARKER, 1)
        text = head + section + tail
    else:
        text = text.rstrip("\n") + f"\n\n{HEADING}\n\n{section}\n"
    RESULTS_PATH.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pythons", nargs="*", default=None)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--per-round", type=int, default=20_000)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--child", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.rounds, args.per_round)))
        return 0
    if args.pythons:
        results = run_children(args.pythons, args.rounds, args.per_round)
    else:
        results = [measure(args.rounds, args.per_round)]
    print(format_table(results))
    print(verdict(results))
    if args.write:
        command = "python bench/bench_method_calls.py"
        if args.pythons:
            command += " --pythons " + " ".join(args.pythons)
        command += " --write"
        write_section(format_section(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
