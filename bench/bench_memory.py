"""Bytes per stand-in: the C type, the pure-Python reference and comfy-env's
own ``SubprocessModelPatcher``, side by side in one run.

Each figure comes from a fresh interpreter per implementation and per
method, making N stand-ins (default 100,000; MODELS_PER_WORKER per worker)
over one pool:

- tracemalloc: Python allocations while making them (blind to the C
  core's malloc, i.e. the ledger record of the C type);
- RSS: resident set growth while making them, tracemalloc off (sees
  everything, the ledger record included; page-granular, so only
  meaningful for large N).

Model id strings, workers and the pool are made before either measurement
starts, so an id's own bytes are not counted.  The figure that counts is
the larger of the two (goals, issue 26: at most 200 bytes alone, fewer
than comfy-env's patcher at 8 per worker).

    python bench/bench_memory.py            # print the table
    python bench/bench_memory.py --write    # and update RESULTS.md
    python bench/bench_memory.py -n 20000   # fewer stand-ins
    python bench/bench_memory.py --rounds 5 # more fresh interpreters each
    python bench/bench_memory.py --pythons PY1 PY2 ...  # under each

Each figure is measured in ``--rounds`` fresh interpreters (default 3);
the table gives the best (lowest) with the median and p90 of the rounds,
and the section the machine's load before and after.

Two layouts: MODELS_PER_WORKER stand-ins per worker (what bench_standin.py
builds: each worker's books and the pool's entry for it are shared by 8),
and all on one worker (what one stand-in costs on its own).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_standin as bs  # noqa: E402
import benchutil  # noqa: E402

METHODS = ("tracemalloc", "rss")
ALONE_GOAL = 200  # bytes per stand-in, all on one worker (issue 26)
HEADING = "## memory per stand-in"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Give free C heap pages back to the system (glibc), so the stand-ins
    cannot reuse memory freed before the measurement without it showing in
    the resident set (a one-worker run otherwise reads low: its growing
    hash table frees its old arrays into the heap)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def child(impl_name: str, method: str, n: int, per: int,
          model: bool = False) -> float:
    """Bytes per stand-in for one implementation, one method, `per`
    stand-ins per worker; with `model`, each stand-in's ``.model`` read
    once made (register() reads it: every registered stand-in has it)."""
    impls, _ = bs.load_impls()
    (impl,) = [i for i in impls if i.name == impl_name]
    pool = impl.new_pool()
    workers = [bs.Worker(f"w{i}") for i in range(-(-n // per))]
    ids = [f"model-{i}" for i in range(n)]
    keep: list[Any] = [None] * n
    base = impl.make

    def with_model(pool: Any, worker: Any, model_id: str) -> Any:
        s = base(pool, worker, model_id)
        s.model  # noqa: B018 -- register() reads it
        return s

    make = with_model if model else base
    # first-call allocations (type caches, code paths) are not per stand-in
    warm = [
        make(impl.new_pool(), bs.Worker("warm"), f"warm-{i}")
        for i in range(per)
    ]
    del warm
    gc.collect()
    gc.disable()
    if method == "tracemalloc":
        tracemalloc.start()
        t0, _ = tracemalloc.get_traced_memory()
        for i in range(n):
            keep[i] = make(pool, workers[i // per], ids[i])
        t1, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        delta = t1 - t0
    else:
        _trim()
        r0 = _rss_bytes()
        for i in range(n):
            keep[i] = make(pool, workers[i // per], ids[i])
        delta = _rss_bytes() - r0
    gc.enable()
    return delta / n


def measure(
    n: int, per: int, rounds: int = 3, model: bool = False,
    python: str = sys.executable,
) -> tuple[dict[str, dict[str, list[float]]], str | None]:
    """{impl: {method: [bytes per stand-in, one per round]}}, plus
    "max": the larger of the two methods in each round.  The
    implementations and methods take turns within each round."""
    impls, missing = bs.load_impls()
    out: dict[str, dict[str, list[float]]] = {
        impl.name: {m: [] for m in (*METHODS, "max")} for impl in impls}
    for _ in range(rounds):
        for impl in impls:
            for method in METHODS:
                cmd = [
                    python,
                    str(Path(__file__).resolve()),
                    "--child",
                    impl.name,
                    method,
                    str(n),
                    str(per),
                    "model" if model else "-",
                ]
                done = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=600,
                    check=False,
                )
                if done.returncode != 0:
                    raise RuntimeError(
                        f"child {impl.name}/{method} failed:\n{done.stderr}"
                    )
                value = json.loads(done.stdout.strip().splitlines()[-1])
                out[impl.name][method].append(value)
            out[impl.name]["max"].append(
                max(out[impl.name][m][-1] for m in METHODS))
    return out, missing


def format_table(
    results: dict[str, dict[str, list[float]]], n: int, per: int,
    model: bool = False, version: str = "",
) -> str:
    names = list(results)
    layout = "all on one worker" if per >= n else f"{per} per worker"
    made = ", each with its `.model` read (as every registered one)" \
        if model else ", as constructed"
    rounds = len(next(iter(results.values()))["max"])
    on = f"CPython {version}: " if version else ""
    lines = [
        f"{on}bytes per stand-in over {n:,} stand-ins, {layout}{made} "
        f"(model ids not counted), best (median, p90) of {rounds} rounds:",
        "",
        "| bytes per stand-in | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for row in (*METHODS, "max"):
        label = {"max": "**larger of the two**", "rss": "RSS delta"}.get(
            row, row
        )
        cells = " | ".join(benchutil.spread_text(results[name][row])
                           for name in names)
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def format_section(tables: list[str], missing: str | None, cmd: str,
                   load: str = "") -> str:
    lines = [
        f"`{cmd}` on {os.uname().machine}"
        f"{'; ' + load if load else ''}: each figure "
        "from a fresh interpreter per "
        "implementation, method and round (bench/bench_memory.py's "
        "docstring). "
        f"The figure that counts is the larger of the two; goals (issue "
        f"26): at most {ALONE_GOAL} B alone, fewer than comfy-env's at "
        f"{bs.MODELS_PER_WORKER} per worker.  C counts its ledger record "
        "(RSS only: tracemalloc is blind to the core's malloc).",
        "",
    ]
    for table in tables:
        lines += [table, ""]
    if missing:
        lines += [f"comfy-env not measured: {missing}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--pythons", nargs="*", default=None,
                        help="interpreters to measure under (each with "
                        "comfy_standin installed); default: this one")
    parser.add_argument(
        "--child", nargs=5, metavar=("IMPL", "METHOD", "N", "PER", "MODEL")
    )
    args = parser.parse_args(argv)
    if args.child:
        name, method, count, per, model = args.child
        print(json.dumps(child(name, method, int(count), int(per),
                               model == "model")))
        return 0
    tables = []
    missing = None
    load_before = benchutil.loadavg()
    for python in args.pythons or [sys.executable]:
        version = subprocess.run(
            [python, "-c", "import platform; "
             "print(platform.python_version())"],
            capture_output=True, text=True, check=True).stdout.strip()
        for model in (False, True):
            for per in (bs.MODELS_PER_WORKER, args.n):
                results, missing = measure(args.n, per, args.rounds, model,
                                           python)
                tables.append(format_table(results, args.n, per, model,
                                           version))
                print(tables[-1], "\n")
    load = benchutil.load_text(load_before, benchutil.loadavg())
    print(load)
    if missing:
        print(f"comfy-env absent: {missing}")
    if args.write:
        cmd = benchutil.command("bench/bench_memory.py", argv)
        benchutil.write_section("memory", HEADING,
                                format_section(tables, missing, cmd, load),
                                "bench/bench_memory.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
