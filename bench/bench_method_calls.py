#!/usr/bin/env python
"""What ComfyUI's calls on a stand-in cost against the cheapest method call
CPython has, on each CPython the package supports.

ComfyUI calls ``loaded_size()``, ``model_size()`` and ``is_dynamic()`` on
every candidate of every eviction pass (``LoadedModel.model_memory``,
``model_loaded_memory``, the ``free_memory`` sort key), as
``s.loaded_size()``: the attribute lookup is part of the call.  The floor
is the same call on a tiny C type this bench compiles for the Python it
runs in (``floor.value()``: a ``METH_NOARGS`` method returning a cached
int with ``Py_NewRef``; the C compiler and the Python headers are all it
needs), beside ``n.bit_length()`` on an int (a built-in type's method).
Each is timed as ComfyUI writes it, in one process, in many short rounds
that take turns, with the bare loop of the same round subtracted.
Reported per Python: the median and the 95th percentile over the rounds,
their ratio to the floor's, and the machine's load average while it ran.
Nothing here asserts a time.

The stand-ins: one holding part of its model (the figure ComfyUI's sort
key and model_unload read most), all of it, none of it, and one whose
receipt is older than a live residency board's reading (the board wins;
the worker's side of the board, in this process, beats its heartbeat
between rounds as its sampler thread would).

Run from the repository root::

    python bench/bench_method_calls.py              # this interpreter
    python bench/bench_method_calls.py --pythons PY1 PY2 ... [--write]

``--pythons`` runs the measurement under each interpreter given (each
with comfy_standin installed, e.g. a virtual environment's ``python``)
and prints one table; ``--write`` also rewrites the section of
bench/RESULTS.md.
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
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import benchutil  # noqa: E402

HEADING = "## method calls"

#: (row, loop, target): the floor and the built-in first, then the
#: stand-in calls.
ROWS = (
    ("floor", "floor", "floor"),
    ("bit_length", "bit_length", "int"),
    ("loaded_size", "loaded_size", "part"),
    ("loaded_size, all loaded", "loaded_size", "all"),
    ("loaded_size, none loaded", "loaded_size", "none"),
    ("loaded_size, board", "loaded_size", "board"),
    ("model_size", "model_size", "part"),
    ("is_dynamic", "is_dynamic", "part"),
)
CALLS = tuple(row for row, _, _ in ROWS)
#: The goal per row, as a ratio to the floor (issue 26).
GOALS = {"loaded_size": 1.2, "loaded_size, all loaded": 1.2,
         "loaded_size, none loaded": 1.2, "loaded_size, board": 1.5}

LOOPS = """
def empty(x, n):
    for _ in range(n):
        pass

def floor(x, n):
    for _ in range(n):
        x.value()

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

#: The floor: a type whose one method returns the int it keeps.
FLOOR_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *value;
} FloorObject;

static PyObject *
floor_value(FloorObject *self, PyObject *unused)
{
    Py_INCREF(self->value);
    return self->value;
}

static PyObject *
floor_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *value;
    if (!PyArg_ParseTuple(args, "O", &value)) {
        return NULL;
    }
    FloorObject *self = (FloorObject *)type->tp_alloc(type, 0);
    if (self != NULL) {
        Py_INCREF(value);
        self->value = value;
    }
    return (PyObject *)self;
}

static void
floor_dealloc(FloorObject *self)
{
    Py_DECREF(self->value);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef floor_methods[] = {
    {"value", (PyCFunction)floor_value, METH_NOARGS, NULL},
    {NULL},
};

static PyTypeObject FloorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bench_floor.Floor",
    .tp_basicsize = sizeof(FloorObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = floor_new,
    .tp_dealloc = (destructor)floor_dealloc,
    .tp_methods = floor_methods,
};

static struct PyModuleDef floor_module = {
    PyModuleDef_HEAD_INIT, "bench_floor", NULL, -1, NULL,
};

PyMODINIT_FUNC
PyInit_bench_floor(void)
{
    if (PyType_Ready(&FloorType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&floor_module);
    if (module != NULL &&
        PyModule_AddObject(module, "Floor", (PyObject *)&FloorType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&FloorType);
    return module;
}
"""


def build_floor(directory: str) -> Any:
    """Compiles FLOOR_SOURCE for this Python into `directory` and imports
    it (``cc -shared -fPIC -O2`` with this Python's headers)."""
    import importlib.util
    import shlex
    import sysconfig

    source = Path(directory) / "bench_floor.c"
    source.write_text(FLOOR_SOURCE)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = Path(directory) / f"bench_floor{suffix}"
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[:1]
    subprocess.run(
        [*compiler, "-shared", "-fPIC", "-O2",
         "-I" + sysconfig.get_paths()["include"], str(source), "-o",
         str(target)],
        check=True, capture_output=True,
    )
    spec = importlib.util.spec_from_file_location("bench_floor", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Worker:
    def send_command(self, command: str, **kwargs: Any) -> dict:
        return {}

    def is_alive(self) -> bool:
        return True


#: Target sets the rounds take turns with: each round calls methods of
#: objects at other addresses, so no coincidence of one layout (a load
#: that aliases a store of the interpreter's, seen to cost either method
#: 5 ns in some processes and not in others) decides a row.
SETS = 16


def measure(rounds: int, per_round: int) -> dict[str, Any]:
    """This interpreter's figures: per call, ns, bare loop subtracted."""
    import tempfile

    import comfy_standin as cs

    pool = cs.Pool(process_local=False)
    size = 8 << 30
    with tempfile.TemporaryDirectory() as directory:
        floor_type = build_floor(directory).Floor
    worker_side, fd = cs.Board.make(SETS, generation=1)
    board = cs.Board.adopt(fd, SETS, generation=1)
    os.close(fd)
    sets: list[dict[str, Any]] = []
    for k in range(SETS):
        worker = _Worker()
        targets: dict[str, Any] = {"int": (1 << 40) + k,
                                   "floor": floor_type(5 << 30)}
        for name, loaded in (("part", 5 << 30), ("all", size),
                             ("none", 0), ("board", 2 << 30)):
            s = cs.StandIn(worker, 1, f"{name}-{k}", size, "cuda:0", "cpu",
                           pool=pool)
            cs.apply_echo(s, loaded, seq=1)
            targets[name] = s
        slot = targets["board"].attach_board(board)
        worker_side.bind(slot, board.tag(slot))
        worker_side.publish(slot, 5 << 30)  # newer than the receipt: it wins
        sets.append(targets)
    if any(t["board"].receipt()[3] != "board" for t in sets):
        raise RuntimeError("the board's reading does not win")
    namespace: dict[str, Any] = {}
    exec(compile(LOOPS, "<loops>", "exec"), namespace)  # noqa: S102
    for targets in sets:  # warm-up: specialisation on 3.11+
        for _, loop, target in ROWS:
            namespace[loop](targets[target], 5000 // SETS + 1)
    namespace["empty"](None, 5000)
    load_before = os.getloadavg()
    samples: dict[str, list[float]] = {row: [] for row in CALLS}
    clock = time.perf_counter_ns
    for r in range(rounds):
        worker_side.heartbeat()  # what the worker's sampler thread does
        targets = sets[r % SETS]
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
    if any(t["board"].receipt()[3] != "board" for t in sets):
        raise RuntimeError("the board's reading stopped winning")
    worker_side.close()
    board.close()
    return {
        "python": platform.python_implementation() + " "
        + platform.python_version(),
        "rounds": rounds,
        "per_round": per_round,
        "load": [load_before[0], load_after[0]],
        "samples": samples,
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One Python's figures from its processes' rounds, pooled: the median
    and the 95th percentile of every round of every process."""
    figures = {}
    for name in CALLS:
        values = sorted(v for run in runs for v in run["samples"][name])
        figures[name] = {
            "median": statistics.median(values),
            "p95": values[int(0.95 * (len(values) - 1))],
        }
    return {
        "python": runs[0]["python"],
        "rounds": sum(run["rounds"] for run in runs),
        "processes": len(runs),
        "per_round": runs[0]["per_round"],
        "load": [runs[0]["load"][0], runs[-1]["load"][1]],
        "figures": figures,
    }


def _ratio(figures: dict[str, Any], name: str, key: str,
           base: str = "floor") -> float:
    value = figures[base][key]
    return figures[name][key] / value if value > 0 else float("nan")


def _call(name: str) -> str:
    if name == "floor":
        return "`floor.value()` (tiny C type)"
    if name == "bit_length":
        return "`n.bit_length()` (built-in)"
    method, _, state = name.partition(", ")
    return f"`s.{method}()`" + (f", {state}" if state else "")


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| Python | call | median ns | p95 ns | median / floor "
        "| p95 / floor | median / bit_length | load (1 min) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        figures = result["figures"]
        load = "{:.2f} to {:.2f}".format(*result["load"])
        for name in CALLS:
            lines.append(
                f"| {result['python']} | {_call(name)} "
                f"| {figures[name]['median']:.1f} "
                f"| {figures[name]['p95']:.1f} "
                f"| {_ratio(figures, name, 'median'):.2f} "
                f"| {_ratio(figures, name, 'p95'):.2f} "
                f"| {_ratio(figures, name, 'median', 'bit_length'):.2f} "
                f"| {load} |"
            )
    return "\n".join(lines)


def verdict(results: list[dict[str, Any]]) -> str:
    lines = []
    for name, goal in GOALS.items():
        worst = max((_ratio(r["figures"], name, "median"), r["python"])
                    for r in results)
        met = "met" if worst[0] <= goal else "NOT met"
        lines.append(
            f"{_call(name)}: largest median ratio to the floor "
            f"{worst[0]:.2f} (on {worst[1]}); the goal, at most {goal}x, "
            f"is {met}.")
    return "\n".join(lines)


def run_children(pythons: list[str], rounds: int, per_round: int,
                 processes: int) -> list[dict[str, Any]]:
    """Each Python's figures, from `processes` processes of it taking
    turns, `rounds` rounds in all: where a process's code and objects
    land decides a few ns of one call or another (a load aliasing a store,
    a branch target another's), seen to flip between processes, so no one
    process speaks for the interpreter."""
    runs: dict[str, list[dict[str, Any]]] = {python: [] for python in pythons}
    share = max(1, rounds // processes)
    for _ in range(processes):
        for python in pythons:
            done = subprocess.run(
                [python, str(Path(__file__).resolve()), "--child",
                 "--rounds", str(share), "--per-round", str(per_round)],
                capture_output=True, text=True, check=True,
                cwd=str(HERE.parent),
            )
            runs[python].append(
                json.loads(done.stdout.strip().splitlines()[-1]))
    return [pooled(runs[python]) for python in pythons]


def format_section(results: list[dict[str, Any]], command: str) -> str:
    first = results[0]
    return "\n".join([
        f"Command: `{command}` (each path a virtual environment's python "
        "with comfy_standin installed).  Each Python in "
        f"{first['processes']} processes of it, {first['rounds']} rounds in "
        f"all of {first['per_round']:,} calls of each, "
        "taking turns, the bare loop of the same round subtracted; the "
        "median and the 95th percentile over the rounds, each as a ratio "
        "to the floor: `floor.value()`, a METH_NOARGS method of a tiny C "
        "type the bench compiles, returning a cached int with Py_NewRef "
        "(`n.bit_length()`, a built-in type's method, for reference).  The "
        "calls are written as ComfyUI writes them, attribute lookup "
        "included; `board`: a stand-in whose live board's reading is newer "
        "than its receipt.  Load: the 1-minute load average before and "
        "after the Python's run (the machine has "
        f"{os.cpu_count()} cores, shared).",
        "",
        f"- CPU: {platform.processor() or platform.machine()}; "
        f"{platform.system()} {platform.release()}",
        "",
        format_table(results),
        "",
        verdict(results),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pythons", nargs="*", default=None)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--per-round", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--child", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.rounds, args.per_round)))
        return 0
    results = run_children(args.pythons or [sys.executable], args.rounds,
                           args.per_round, args.processes)
    print(format_table(results))
    print(verdict(results))
    if args.write:
        command = "python bench/bench_method_calls.py"
        if args.pythons:
            command += " --pythons " + " ".join(args.pythons)
        if args.processes != 8:
            command += f" --processes {args.processes}"
        command += " --write"
        benchutil.write_section("method-calls", HEADING,
                                format_section(results, command),
                                "bench/bench_method_calls.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
