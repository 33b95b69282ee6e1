#!/usr/bin/env python
"""Benchmark the stand-in: the C type against the pure-Python reference and
against comfy-env's own ``SubprocessModelPatcher``, side by side in one run.

Run from the repository root::

    python bench/bench_standin.py            # print the table
    python bench/bench_standin.py --write    # and rewrite our section of
                                             # bench/RESULTS.md

Every figure is a cost (ns per call, bytes per stand-in, wall ns per
completed operation), so every ratio reads "times the C cost": a ratio of
5.0 in the ``ref/C`` column means the reference took five times as long.
Timings are min-of-N repeats of a timeit-style loop (the minimum is the run
least disturbed by the rest of the machine).  Nothing here asserts a time;
tests/test_bench_smoke.py only proves the bench still runs.

What is measured is listed in bench/README.md.  comfy-env is optional: when
it cannot be imported the bench says why and measures the C type and the
reference only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import inspect
import json
import os
import platform
import subprocess
import sys
import threading
import time
import tracemalloc
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import benchutil  # noqa: E402

HEADING = "## stand-in"

IMPLS = ("c", "reference", "comfy-env")
GIB = 1 << 30
MODEL_SIZE = 8 * GIB
MODELS_PER_WORKER = 8


# ---- how long to measure ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Counts:
    """How much work each measurement does.

    ``target``: seconds one timed run should take (the loop count doubles
    until it does); ``repeats``: timed runs, the minimum is kept;
    ``memory_n``: stand-ins created for the memory figures (in a child
    process per implementation, so no implementation inherits another's
    freed arenas); ``construct_n``: stand-ins built per timed construction
    run; ``thread_seconds``: how long the reader and writer threads run.
    """

    target: float
    repeats: int
    memory_n: int
    construct_n: int
    thread_seconds: float


#: Used by ``python bench/bench_standin.py``: about 30 s on 2 cores.
FULL = Counts(
    target=0.02,
    repeats=7,
    memory_n=20_000,
    construct_n=256,
    thread_seconds=1.0,
)

#: One iteration of everything; for tests/test_bench_smoke.py.
SMOKE = Counts(
    target=0.0,
    repeats=1,
    memory_n=16,
    construct_n=8,
    thread_seconds=0.1,
)

LIST_SIZES = (1, 8, 64)
CENSUS_SIZES = (8, 64)


# ---- the objects around a stand-in ------------------------------------------


class Device:
    """Stands for a torch.device: an opaque object with a str()."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"device({self.name!r})"

    def __str__(self) -> str:
        return self.name


CUDA0 = Device("cuda:0")
CPU = Device("cpu")


class Worker:
    """What every stand-in needs of a worker.  ``_mem_lock`` and
    ``_calls_in_flight`` are what comfy-env's stand-in reads off its
    SubprocessWorker; ours ignore them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._mem_lock = threading.Lock()
        self._calls_in_flight = 0

    def __repr__(self) -> str:
        return f"<bench Worker {self.name}>"

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        return {}

    def is_alive(self) -> bool:
        return True


class LoadedModelLike:
    """The part of ComfyUI's LoadedModel that free_memory's sort key reads
    (docs/comfyui.md): a weakref to the patcher P, ``model`` dereferencing
    it, and the three size methods built on P's."""

    __slots__ = ("__weakref__", "_model", "device")

    def __init__(self, patcher: Any) -> None:
        self._model = weakref.ref(patcher)
        self.device = patcher.load_device

    @property
    def model(self) -> Any:
        return self._model()

    def model_memory(self) -> int:
        return self.model.model_size()

    def model_loaded_memory(self) -> int:
        return self.model.loaded_size()

    def model_offloaded_memory(self) -> int:
        return self.model.model_size() - self.model.loaded_size()


# ---- the three implementations ---------------------------------------------


def _stub_comfy() -> dict[str, types.ModuleType]:
    """A stub ``comfy`` package with the ``model_management`` functions
    comfy-env's stand-in calls at import and in its VRAM logging.  A bench
    harness, not the test suite's faithful mock: it answers a CPU box."""
    comfy = types.ModuleType("comfy")
    comfy.__path__ = []  # a package, so "import comfy.x" resolves x
    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    mm.get_torch_device = lambda: CPU
    mm.get_total_memory = lambda dev=None, torch_total_too=False: 24 * GIB
    mm.get_free_memory = lambda dev=None, torch_free_too=False: 16 * GIB
    mm.cleanup_models = lambda: None
    mm.EXTRA_RESERVED_VRAM = 400 << 20
    comfy.model_management = mm
    return {"comfy": comfy, "comfy.model_management": mm}


@contextlib.contextmanager
def _comfy_on_path() -> Iterator[None]:
    """Put the stub comfy in sys.modules for the import, then take it out
    again, so a process that imports this bench (the test suite) is left
    as it was.  A real comfy already imported is used as is."""
    if "comfy" in sys.modules:
        yield
        return
    stub = _stub_comfy()
    sys.modules.update(stub)
    try:
        yield
    finally:
        for name in stub:
            sys.modules.pop(name, None)


@dataclasses.dataclass
class Impl:
    """One implementation behind one interface.

    ``make(pool, worker, model_id)`` builds a stand-in of MODEL_SIZE;
    ``echo_stmt``/``census_stmt`` are the loop bodies timed for an echo and
    a census, written out so the timed loop holds exactly the call the
    implementation's caller makes (no adapter function in between)."""

    name: str
    label: str
    make: Callable[[Any, Worker, str], Any]
    new_pool: Callable[[], Any]
    echo: Callable[..., Any]
    census: Callable[..., Any]
    echo_stmt: str
    module: Any = None
    #: ``make`` exactly as comfy-env calls its patcher: keywords, no pool
    #: (ours: the default pool); the pool argument is ignored.
    make_as_comfy_env: Callable[[Any, Worker, str], Any] | None = None
    #: Forgets a worker made for a construction round (the default pool's).
    forget: Callable[[Worker], Any] = lambda worker: None


def _ours(name: str, module: Any) -> Impl:
    # Called as comfy-env calls its own (positional, then kind=), so the
    # construction rows compare the same call.
    def make(pool: Any, worker: Worker, model_id: str) -> Any:
        return module.StandIn(
            worker, 1, model_id, MODEL_SIZE, CUDA0, CPU, kind="unet", pool=pool
        )

    def make_as_comfy_env(pool: Any, worker: Worker, model_id: str) -> Any:
        return module.StandIn(
            worker=worker, worker_generation=1, model_id=model_id,
            model_size=MODEL_SIZE, load_device=CUDA0, offload_device=CPU,
            kind="unet",
        )

    return Impl(
        name=name,
        label=f"{module.__name__}.StandIn",
        make=make,
        make_as_comfy_env=make_as_comfy_env,
        forget=lambda worker: module.default_pool().forget(worker),
        new_pool=module.Pool,
        echo=module.apply_echo,
        census=module.apply_residency,
        # ours takes its own lock inside apply_echo
        echo_stmt="echo(s, resident=r, seq=7)",
        module=module,
    )


def load_comfy_env() -> tuple[Impl | None, str]:
    """comfy-env's stand-in, or (None, why not)."""
    try:
        with _comfy_on_path():
            patcher_module = importlib.import_module(
                "comfy_env.isolation.model_patcher"
            )
            state_sync = importlib.import_module("comfy_env.state_sync")
    except Exception as exc:  # noqa: BLE001 - any failure means "absent"
        return None, f"{type(exc).__name__}: {exc}"
    # comfy_standin's opt-in adapter (integrations.comfy_env.install())
    # swaps our type and wrappers into comfy-env; measure comfy-env's own.
    patcher_type = patcher_module.SubprocessModelPatcher
    if patcher_type.__module__ != patcher_module.__name__:
        adapter = sys.modules.get("comfy_standin.integrations.comfy_env")
        originals = getattr(adapter, "_originals", {})
        patcher_type = originals.get(
            (patcher_module.__name__, "SubprocessModelPatcher")
        )
        if patcher_type is None:
            return None, (
                "comfy_env's SubprocessModelPatcher has been replaced in "
                "this process and its original is not reachable"
            )
    echo = inspect.unwrap(state_sync.apply_echo)
    census = inspect.unwrap(state_sync.apply_residency)
    try:
        from importlib.metadata import version

        ver = version("comfy-env")
    except Exception:  # noqa: BLE001
        ver = "unknown version"

    def make(pool: Any, worker: Worker, model_id: str) -> Any:
        return patcher_type(
            worker, 1, model_id, MODEL_SIZE, CUDA0, CPU, kind="unet"
        )

    def make_as_comfy_env(pool: Any, worker: Worker, model_id: str) -> Any:
        # comfy_env/isolation/pool.py, _register_new_patchers
        return patcher_type(
            worker=worker, worker_generation=1, model_id=model_id,
            model_size=MODEL_SIZE, load_device=CUDA0, offload_device=CPU,
            kind="unet",
        )

    return (
        Impl(
            name="comfy-env",
            label=f"comfy_env {ver} SubprocessModelPatcher",
            make=make,
            make_as_comfy_env=make_as_comfy_env,
            new_pool=lambda: None,
            echo=echo,
            census=census,
            # comfy-env's model_patcher holds the worker's _mem_lock around
            # every apply_echo; that lock is part of its echo's cost.
            echo_stmt="with lock: echo(s, r, seq=7)",
            module=patcher_module,
        ),
        f"comfy-env {ver}",
    )


def load_impls() -> tuple[list[Impl], str | None]:
    """The implementations to measure, and why comfy-env is missing (or
    None when it is there)."""
    import comfy_standin
    import comfy_standin._reference as reference

    impls = [_ours("c", comfy_standin), _ours("reference", reference)]
    comfy_env, why = load_comfy_env()
    if comfy_env is None:
        return impls, why
    impls.append(comfy_env)
    return impls, None


def make_standins(impl: Impl, n: int, pool: Any = None) -> list[Any]:
    """n stand-ins, MODELS_PER_WORKER per worker, each half loaded."""
    if pool is None:
        pool = impl.new_pool()
    out = []
    worker = None
    for i in range(n):
        if i % MODELS_PER_WORKER == 0:
            worker = Worker(f"w{i // MODELS_PER_WORKER}")
        s = impl.make(pool, worker, f"model-{i}")
        _echo(impl, s, MODEL_SIZE // 2, 1)
        out.append(s)
    # the pool must outlive the timing: ours keep it, comfy-env has none
    return out


def _echo(impl: Impl, s: Any, resident: int, seq: int) -> None:
    if impl.name == "comfy-env":
        with s._worker._mem_lock:
            impl.echo(s, resident, seq=seq)
    else:
        impl.echo(s, resident=resident, seq=seq)


# ---- timing ----------------------------------------------------------------


@dataclasses.dataclass
class Timed:
    """One implementation's loop to time: ``stmt`` run in ``namespace``
    performs ``ops`` operations."""

    stmt: str
    namespace: dict[str, Any]
    ops: int


def _compile(timed: Timed) -> Callable[[int, Callable[[], float]], float]:
    src = (
        "def _timed(_n, _clock):\n"
        "    _t0 = _clock()\n"
        "    for _ in range(_n):\n"
        + "".join(f"        {line}\n" for line in timed.stmt.splitlines())
        + "    return _clock() - _t0\n"
    )
    code_ns = dict(timed.namespace)
    # timeit does the same: the loop body is compiled in, not called
    exec(compile(src, "<bench>", "exec"), code_ns)  # noqa: S102
    return code_ns["_timed"]


def time_side_by_side(
    loops: dict[str, Timed], counts: Counts
) -> dict[str, float]:
    """ns per operation of each implementation's loop.

    Each loop's count doubles until one run takes ``counts.target``; then
    the implementations take turns, ``counts.repeats`` rounds in rotating
    order, and each keeps its minimum.  Taking turns means a slow patch of
    the machine (other jobs on 2 cores) hits every implementation alike,
    so the ratios hold even when the absolute figures wobble."""
    clock = time.perf_counter
    functions = {name: _compile(t) for name, t in loops.items()}
    numbers = {}
    for name, fn in functions.items():
        number = 1
        while counts.target > 0 and number < 1 << 24:
            if fn(number, clock) >= counts.target:
                break
            number *= 2
        numbers[name] = number
    best = {name: float("inf") for name in functions}
    names = list(functions)
    for round_ in range(counts.repeats):
        k = round_ % len(names)
        for name in names[k:] + names[:k]:
            elapsed = functions[name](numbers[name], clock)
            best[name] = min(best[name], elapsed)
    return {
        name: best[name] / (numbers[name] * loops[name].ops) * 1e9
        for name in functions
    }


# The four reads free_memory makes per candidate, and the key it sorts by.
READ_STMTS = {
    "loaded_size()": "for s in L: s.loaded_size()",
    "model_size()": "for s in L: s.model_size()",
    "current_loaded_device()": "for s in L: s.current_loaded_device()",
    "is_dynamic()": "for s in L: s.is_dynamic()",
}
# ComfyUI's key (model_management.py free_memory): offloaded bytes first,
# then the patcher's refcount, then its size, then the index; then sorted.
SORT_STMT = (
    "keys = [(-e.model_offloaded_memory(), getrefcount(e.model),"
    " e.model_memory(), i) for i, e in enumerate(E)]\n"
    "keys.sort()"
)
# The loop over the list alone: subtract it to see the call by itself.
BASELINE_STMT = "for s in L: pass"


@dataclasses.dataclass
class Row:
    key: str
    label: str
    unit: str
    values: dict[str, float]


def row_names() -> list[tuple[str, str, str]]:
    """(key, label, unit) of every row, in table order."""
    rows = []
    for n in LIST_SIZES:
        rows.append((f"loop-{n}", f"list of {n}: bare loop", "ns/item"))
        for call in READ_STMTS:
            rows.append((f"{call}-{n}", f"list of {n}: {call}", "ns/call"))
        rows.append(
            (f"sortkey-{n}", f"list of {n}: sort key + sort", "ns/cand")
        )
    rows.append(("apply_echo", "apply_echo", "ns/call"))
    for n in CENSUS_SIZES:
        rows.append((f"census-{n}", f"census of {n}", "ns/census"))
        rows.append(
            (f"census-{n}-entry", f"census of {n}, per entry", "ns/entry")
        )
    rows.append(("construct", "construction", "ns/stand-in"))
    rows.append(
        (
            "construct-comfy-env",
            "construction as comfy-env calls it (keywords, no pool)",
            "ns/stand-in",
        )
    )
    rows.append(
        (
            "construct-known",
            "construction, workers known to the pool",
            "ns/stand-in",
        )
    )
    rows.append(("mem-tracemalloc", "memory: tracemalloc", "B/stand-in"))
    rows.append(("mem-getsizeof", "memory: getsizeof graph", "B/stand-in"))
    rows.append(("mem-rss", "memory: RSS delta", "B/stand-in"))
    rows.append(
        ("thread-reader", "threads: reader loaded_size()", "ns/op wall")
    )
    rows.append(("thread-writer", "threads: writer apply_echo", "ns/op wall"))
    return rows


Measured = dict[str, dict[str, float]]  # row key -> impl name -> value


def measure_reads(impls: list[Impl], counts: Counts) -> Measured:
    out: Measured = {}
    for n in LIST_SIZES:
        namespaces = {}
        for impl in impls:
            standins = make_standins(impl, n)
            namespaces[impl.name] = {
                "L": standins,
                "E": [LoadedModelLike(s) for s in standins],
                "getrefcount": sys.getrefcount,
            }
        stmts = {f"loop-{n}": BASELINE_STMT, f"sortkey-{n}": SORT_STMT}
        stmts.update({f"{c}-{n}": s for c, s in READ_STMTS.items()})
        for key, stmt in stmts.items():
            out[key] = time_side_by_side(
                {name: Timed(stmt, ns, n) for name, ns in namespaces.items()},
                counts,
            )
    return out


def measure_echo(impls: list[Impl], counts: Counts) -> Measured:
    # alternate two values so every echo really moves the receipt
    residents = [MODEL_SIZE // 4, MODEL_SIZE // 2] * 16
    loops = {}
    for impl in impls:
        (s,) = make_standins(impl, 1)
        ns = {
            "s": s,
            "echo": impl.echo,
            "lock": s._worker._mem_lock if impl.name == "comfy-env" else None,
            "R": residents,
        }
        loops[impl.name] = Timed(
            f"for r in R:\n    {impl.echo_stmt}", ns, len(residents)
        )
    return {"apply_echo": time_side_by_side(loops, counts)}


def measure_census(impls: list[Impl], counts: Counts) -> Measured:
    out: Measured = {}
    for n in CENSUS_SIZES:
        # Two censuses with the same seq and different bytes, alternated:
        # every entry applies (a tie goes to the census in both
        # implementations) and every entry changes the receipt.
        censuses = [
            [
                {
                    "id": f"model-{i}",
                    "seq": 1,
                    "resident": resident,
                    "device": "cuda:0",
                }
                for i in range(n)
            ]
            for resident in (MODEL_SIZE // 4, MODEL_SIZE // 2)
        ]
        loops = {}
        for impl in impls:
            pool = impl.new_pool()
            worker = Worker("census")
            standins = {}
            for i in range(n):
                s = impl.make(pool, worker, f"model-{i}")
                _echo(impl, s, MODEL_SIZE // 2, 1)
                standins[f"model-{i}"] = s
            ns = {"apply": impl.census, "M": standins, "C": censuses}
            loops[impl.name] = Timed("for c in C: apply(M, c)", ns, 2)
        per_census = time_side_by_side(loops, counts)
        out[f"census-{n}"] = per_census
        out[f"census-{n}-entry"] = {k: v / n for k, v in per_census.items()}
    return out


def measure_construction(impls: list[Impl], counts: Counts) -> Measured:
    """Build construct_n stand-ins (MODELS_PER_WORKER per worker) over a
    fresh pool; the pool, workers and ids are made before the clock
    starts and the stand-ins are dropped after it stops.  Implementations
    take turns, as in time_side_by_side.

    ``construct-comfy-env``: the call comfy-env makes
    (``SubprocessModelPatcher(worker=..., worker_generation=..., ...)``,
    keywords, no pool: ours use the default pool, whose books for the
    round's workers are forgotten after the clock stops).

    ``construct-known``: the same as ``construct``, on workers the pool
    already keeps books for (one stand-in each was made before the clock
    started), so the per-worker bookkeeping a first stand-in pays -- paid
    once per worker process, whose spawn costs far more -- is left out."""
    n = counts.construct_n
    keys = ("construct", "construct-comfy-env", "construct-known")
    out: Measured = {key: {} for key in keys}
    for key in keys:
        best = {impl.name: float("inf") for impl in impls}
        # Many short rounds: the minimum of each is what the type costs,
        # whatever else this (virtual) machine runs meanwhile.
        for round_ in range(max(counts.repeats, 1) * 15):
            k = round_ % len(impls)
            for impl in impls[k:] + impls[:k]:
                pool = impl.new_pool()
                workers = [
                    Worker(f"w{i}") for i in range(-(-n // MODELS_PER_WORKER))
                ]
                plan = [
                    (workers[i // MODELS_PER_WORKER], f"model-{i}")
                    for i in range(n)
                ]
                made: list[Any] = []
                make = impl.make
                if key == "construct-comfy-env":
                    assert impl.make_as_comfy_env is not None
                    make = impl.make_as_comfy_env
                append = made.append
                if key == "construct-known":
                    made += [make(pool, w, f"known-{w.name}")
                             for w in workers]
                t0 = time.perf_counter()
                for worker, model_id in plan:
                    append(make(pool, worker, model_id))
                elapsed = time.perf_counter() - t0
                best[impl.name] = min(best[impl.name], elapsed)
                del made, pool
                if key == "construct-comfy-env":
                    for worker in workers:
                        impl.forget(worker)
        out[key] = {name: t / n * 1e9 for name, t in best.items()}
    return out


# ---- threads ---------------------------------------------------------------


THREAD_ROUNDS = 4


def _thread_round(s: Any, impl: Impl, seconds: float) -> dict[str, float]:
    """One reader and one writer on ``s`` for ``seconds``."""
    a, b = MODEL_SIZE // 4, MODEL_SIZE // 2
    stop = threading.Event()
    start = threading.Barrier(3)
    result = {"reads": 0, "writes": 0, "torn": 0}
    batch = 100

    def reader() -> None:
        read = s.loaded_size
        reads = torn = 0
        start.wait()
        while not stop.is_set():
            for _ in range(batch):
                v = read()
            if v != a and v != b:
                torn += 1
            reads += batch
        result["reads"] = reads
        result["torn"] = torn

    def writer() -> None:
        echo = impl.echo
        writes = 0
        start.wait()
        if impl.name == "comfy-env":
            lock = s._worker._mem_lock
            while not stop.is_set():
                for _ in range(batch // 2):
                    with lock:
                        echo(s, a, seq=7)
                    with lock:
                        echo(s, b, seq=7)
                writes += batch
        else:
            while not stop.is_set():
                for _ in range(batch // 2):
                    echo(s, resident=a, seq=7)
                    echo(s, resident=b, seq=7)
                writes += batch
        result["writes"] = writes

    threads = [threading.Thread(target=f) for f in (reader, writer)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    result["wall"] = time.perf_counter() - t0
    return result


def measure_threads(
    impls: list[Impl], counts: Counts
) -> tuple[Measured, list[str]]:
    """A reader calling loaded_size() while a writer applies echoes to the
    same stand-in, thread_seconds per implementation, split into rounds
    the implementations take in turn.  Under the GIL the two threads take
    turns (sys.getswitchinterval() apart), so neither runs in parallel
    with the other; the figure is wall time per completed operation of
    each thread (1 / throughput).  The reader also counts values it saw
    that no echo wrote (torn reads)."""
    standins = {impl.name: make_standins(impl, 1)[0] for impl in impls}
    totals = {
        impl.name: {"reads": 0, "writes": 0, "torn": 0, "wall": 0.0}
        for impl in impls
    }
    for round_ in range(THREAD_ROUNDS):
        k = round_ % len(impls)
        for impl in impls[k:] + impls[:k]:
            got = _thread_round(
                standins[impl.name],
                impl,
                counts.thread_seconds / THREAD_ROUNDS,
            )
            for key, value in got.items():
                totals[impl.name][key] += value
    out: Measured = {"thread-reader": {}, "thread-writer": {}}
    notes = []
    for name, t in totals.items():
        out["thread-reader"][name] = t["wall"] / max(t["reads"], 1) * 1e9
        out["thread-writer"][name] = t["wall"] / max(t["writes"], 1) * 1e9
        notes.append(
            f"{name}: {t['reads']:,} reads and {t['writes']:,} echoes in "
            f"{t['wall']:.2f} s ({t['reads'] / t['wall'] / 1e6:.2f} M "
            f"reads/s, {t['writes'] / t['wall'] / 1e6:.2f} M echoes/s); "
            f"torn reads seen: {t['torn']}"
        )
    return out, notes


# ---- memory (in a child process per implementation) ------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def graph_size(
    root: Any, shared: list[Any], skip_types: tuple
) -> dict[str, int]:
    """sys.getsizeof per type over the objects reachable from ``root``
    (gc.get_referents), not entering what is not the stand-in's own:
    ``shared`` objects (the worker, the pool, devices), instances of
    ``skip_types`` (per-worker books), types, modules, functions, cached
    small ints and strings (literals such as a receipt's source are shared
    constants; the one string a stand-in owns, its model id, is added by
    the caller, because the C type's traverse does not visit it)."""
    shared_ids = {id(x) for x in shared}
    seen: set[int] = set()
    sizes: dict[str, int] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in shared_ids:
            continue
        seen.add(id(obj))
        if isinstance(
            obj,
            (
                type,
                types.ModuleType,
                types.FunctionType,
                types.BuiltinFunctionType,
                bool,
                str,
                type(None),
                *skip_types,
            ),
        ):
            continue
        if isinstance(obj, int) and -5 <= obj <= 256:
            continue
        name = type(obj).__name__
        sizes[name] = sizes.get(name, 0) + sys.getsizeof(obj)
        todo.extend(gc.get_referents(obj))
    return sizes


def memory_child(impl_name: str, n: int) -> dict[str, float]:
    """Runs in a fresh interpreter: memory per stand-in three ways.

    - tracemalloc: every Python allocation while making n stand-ins
      (including what the pool keeps per stand-in); blind to the C core's
      malloc (the C type's receipt record).
    - getsizeof graph: one stand-in's own object graph (see graph_size);
      blind to C memory behind pointers too.
    - RSS delta: resident set growth for n stand-ins; sees everything,
      page-granular, so only meaningful for large n.
    """
    impls, _ = load_impls()
    (impl,) = [i for i in impls if i.name == impl_name]
    pool = impl.new_pool()
    workers = [Worker(f"w{i}") for i in range(-(-n // MODELS_PER_WORKER))]
    keep: list[Any] = [None] * n
    # warm up the code paths (first-call allocations are not per stand-in)
    warm = [
        impl.make(impl.new_pool(), Worker("warm"), f"warm-{i}")
        for i in range(MODELS_PER_WORKER)
    ]
    del warm
    gc.collect()
    gc.disable()
    rss0 = _rss_bytes()
    tracemalloc.start()
    t0, _ = tracemalloc.get_traced_memory()
    for i in range(n):
        keep[i] = impl.make(
            pool, workers[i // MODELS_PER_WORKER], f"model-{i}"
        )
    t1, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = _rss_bytes()
    gc.enable()

    # the graph of one stand-in, built fresh outside tracemalloc
    s = impl.make(pool, Worker("graph"), "model-graph-0")
    skip: tuple = ()
    if impl.module is not None and hasattr(impl.module, "WorkerBooks"):
        skip = (impl.module.WorkerBooks, impl.module.Ledger)
    shared = [pool, CUDA0, CPU, "unet", impl.module]
    worker = getattr(s, "worker", None) or getattr(s, "_worker", None)
    shared.append(worker)
    if impl.name == "comfy-env":
        # comfy-env shares one module-level object() as every patcher's
        # clone_base_uuid; ours make one per stand-in (docs/semantics.md)
        shared.append(impl.module._NOT_A_CLONE)
    model_id = getattr(s, "model_id", None) or getattr(s, "_model_id", None)
    sizes = graph_size(s, shared, skip)
    sizes["str (model id)"] = sys.getsizeof(model_id)
    graph = sum(sizes.values())
    return {
        "mem-tracemalloc": (t1 - t0) / n,
        "mem-getsizeof": float(graph),
        "mem-rss": (rss1 - rss0) / n,
        "_graph": sizes,
    }


def measure_memory(
    impls: list[Impl], counts: Counts
) -> tuple[Measured, list[str]]:
    out: Measured = {}
    notes = []
    for impl in impls:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--memory-child",
            impl.name,
            str(counts.memory_n),
        ]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"memory child for {impl.name} failed "
                f"({done.returncode}):\n{done.stderr}"
            )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        graph = got.pop("_graph")
        for key, value in got.items():
            out.setdefault(key, {})[impl.name] = value
        notes.append(
            f"{impl.name}: "
            + " + ".join(f"{k} {v}" for k, v in graph.items())
            + f" = {sum(graph.values())} B"
        )
    return out, notes


# ---- the run ---------------------------------------------------------------


@dataclasses.dataclass
class Results:
    rows: list[Row]
    impls: list[str]
    labels: dict[str, str]
    missing: str | None  # why comfy-env is absent, or None
    graph_notes: list[str]  # the getsizeof graph of one stand-in, by type
    thread_notes: list[str]  # throughput of the reader and writer threads
    counts: Counts
    seconds: float


def run(
    counts: Counts = FULL, progress: Callable[[str], None] | None = None
) -> Results:
    started = time.perf_counter()
    impls, missing = load_impls()
    values: Measured = {}
    for step in (
        measure_reads,
        measure_echo,
        measure_census,
        measure_construction,
    ):
        if progress:
            progress(f"{step.__name__} ...")
        gc.collect()
        values.update(step(impls, counts))
    if progress:
        progress("measure_memory ...")
    memory, graph_notes = measure_memory(impls, counts)
    values.update(memory)
    if progress:
        progress("measure_threads ...")
    threads, thread_notes = measure_threads(impls, counts)
    values.update(threads)
    rows = [
        Row(
            key,
            label,
            unit,
            {impl.name: values[key][impl.name] for impl in impls},
        )
        for key, label, unit in row_names()
    ]
    return Results(
        rows=rows,
        impls=[i.name for i in impls],
        labels={i.name: i.label for i in impls},
        missing=missing,
        graph_notes=graph_notes,
        thread_notes=thread_notes,
        counts=counts,
        seconds=time.perf_counter() - started,
    )


def _fmt(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.1f}"


def format_table(results: Results) -> str:
    """A Markdown table: one row per measurement, one column per
    implementation, then the ratios to C."""
    others = [name for name in results.impls if name != "c"]
    short = {"reference": "ref", "comfy-env": "comfy-env"}
    header = [
        "measurement",
        "unit",
        *results.impls,
        *(f"{short.get(n, n)}/C" for n in others),
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    for row in results.rows:
        cells = [row.label, row.unit]
        cells += [_fmt(row.values[name]) for name in results.impls]
        c = row.values.get("c", 0.0)
        for name in others:
            cells.append(f"{row.values[name] / c:.2f}" if c > 0 else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> list[str]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    nproc = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count()
    )
    return [
        f"- CPU: {cpu}; nproc: {nproc}",
        (
            f"- Python: {platform.python_implementation()} "
            f"{platform.python_version()} ({sys.platform}, "
            f"GIL {'off' if _gil_disabled() else 'on'}); "
            f"switch interval {sys.getswitchinterval() * 1e3:g} ms"
        ),
    ]


def _gil_disabled() -> bool:
    check = getattr(sys, "_is_gil_enabled", None)
    return check is not None and not check()


def format_section(results: Results, command: str) -> str:
    impl_lines = [
        f"- `{name}`: {results.labels[name]}" for name in results.impls
    ]
    if results.missing:
        impl_lines.append(
            f"- comfy-env: **not measured** ({results.missing}); only the "
            f"C type and the reference are compared."
        )
    parts = [
        (
            f"Command: `{command}` (took {results.seconds:.0f} s). "
            "Every figure is a cost, so every ratio is *times the C cost* "
            "(above 1: C is cheaper). Timings are the minimum of "
            f"{results.counts.repeats} repeats, implementations taking "
            "turns; `list of n` rows are per stand-in and include the "
            "Python loop (the `bare loop` row is that loop alone). Memory: "
            f"{results.counts.memory_n:,} stand-ins, "
            f"{MODELS_PER_WORKER} per worker, one fresh interpreter per "
            "implementation. What each row means: bench/README.md."
        ),
        "",
        *machine(),
        "",
        "Implementations:",
        "",
        *impl_lines,
        "",
        format_table(results),
        "",
        (
            "getsizeof graph of one stand-in, by type (bytes; the C type's "
            "receipt record is C memory behind a pointer, seen only by RSS):"
        ),
        "",
        *[f"- {note}" for note in results.graph_notes],
        "",
        (
            "Threads (one reader thread, one writer thread, same stand-in; "
            "under the GIL they take turns, so these are shares of one "
            "core):"
        ),
        "",
        *[f"- {note}" for note in results.thread_notes],
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--memory-child"]:
        print(json.dumps(memory_child(argv[1], int(argv[2]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write",
        action="store_true",
        help="rewrite our section of bench/RESULTS.md",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one iteration of everything (proves it runs)",
    )
    args = parser.parse_args(argv)
    counts = SMOKE if args.smoke else FULL
    results = run(counts, progress=lambda m: print(m, file=sys.stderr))
    if results.missing:
        print(f"comfy-env not measured: {results.missing}", file=sys.stderr)
    print(format_table(results))
    for note in results.graph_notes + results.thread_notes:
        print(note)
    print(f"({results.seconds:.1f} s)")
    if args.write:
        command = "python bench/bench_standin.py " + " ".join(argv)
        benchutil.write_section("standin", HEADING,
                                format_section(results, command.strip()),
                                "bench/bench_standin.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
