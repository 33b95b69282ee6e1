"""Eviction regret and the cost of a free_memory pass.

Does ComfyUI evict the right model?  This bench runs scenarios in the mock
``comfy.model_management`` (tests/mockcomfy: free_memory's candidate
filter, its sort key and ``memory_to_free`` recomputed from the simulated
card before every candidate) with host models and real worker processes
(``comfy_standin._demo_worker`` behind ``comfy_standin._demo.PipeWorker``,
publishing on a board, docs/board.md) whose residency changes between and
*during* free_memory passes: paging in, paging out, a worker killed, a
worker refusing.

At each free_memory it compares what ComfyUI did with an **oracle**: the
same rule (the same candidates, the same sort key with each model's *true*
resident bytes in its first term, the same ``memory_to_free`` loop, the
same partial-unload block sizes, the same events at the same candidate),
fed every model's true residency at every decision.  So the regret is what
wrong residency figures cost, never ComfyUI's policy itself:

- ``excess``: bytes the run took off the card beyond what the oracle took
  (the oracle takes what is needed plus its unavoidable block rounding);
- ``wrong``: models the run evicted (took bytes of) that the oracle left
  alone;
- ``short``: passes that ended with less free than asked where the oracle's
  did not.

Three columns: ``receipts`` (comfy_standin's C stand-in, no board: it
knows what the worker's last reply said), ``boards`` (the same with the
worker's board attached) and ``comfy-env`` (comfy-env's own
SubprocessModelPatcher, receipts only) when it can be imported.  Truth on
the simulated card: a host model's loaded bytes, and for a worker model
the worker's own word on its state (its ``report`` census, asked by the
bench alone and never given to a stand-in), or 0 once the worker is dead
(the driver took it back).

The second part times one whole free_memory pass over N registered
stand-ins (N = 1, 16, 256, 4096) that need no eviction, so every pass is
the same: the candidate filter, the sort key, the loop.  The implementations
take turns; each keeps its best.

    python bench/bench_regret.py            # print both tables
    python bench/bench_regret.py --write    # and RESULTS.md + the PNGs
    python bench/bench_regret.py --smoke    # tiny, no plot

The plots need matplotlib (``pip install matplotlib``); without it the bench
says so and writes the tables only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import random
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MOCK = REPO / "tests" / "mockcomfy"
if str(MOCK) not in sys.path:
    sys.path.insert(0, str(MOCK))

import comfy.model_management as mm  # noqa: E402

import comfy_standin  # noqa: E402
import comfy_standin._reference as reference  # noqa: E402
from comfy_standin._core import Board  # noqa: E402
from comfy_standin._demo import PipeWorker  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
TOTAL = 16 * GiB
#: the demo worker frees whole blocks of this size (a layer at a time)
WORKER_BLOCK = 64 * MiB

RESULTS_PATH = HERE / "RESULTS.md"
REGRET_PNG = HERE / "regret.png"
PASS_PNG = HERE / "free_memory_pass.png"
BEGIN_MARKER = "<!-- regret:begin -->"
END_MARKER = "<!-- regret:end -->"
HEADING = "## eviction regret"

MODES = ("receipts", "boards", "comfy-env")
PASS_SIZES = (1, 16, 256, 4096)
SMOKE_PASS_SIZES = (1, 16)
RANDOM_SEEDS = (1, 2, 3)


# ---- comfy-env's stand-in -----------------------------------------------


def load_comfy_env() -> tuple[Any, Any, str]:
    """(SubprocessModelPatcher, state_sync, label) or (None, None, why).

    Imported over the mock ``comfy.model_management`` (already in
    ``sys.modules``), which is the one it then calls."""
    try:
        patcher_module = importlib.import_module(
            "comfy_env.isolation.model_patcher"
        )
        state_sync = importlib.import_module("comfy_env.state_sync")
    except Exception as exc:  # noqa: BLE001 - any failure means "absent"
        return None, None, f"{type(exc).__name__}: {exc}"
    patcher_type = patcher_module.SubprocessModelPatcher
    if patcher_type.__module__ != patcher_module.__name__:
        # comfy_standin's adapter swapped ours in: measure comfy-env's own
        adapter = sys.modules.get("comfy_standin.integrations.comfy_env")
        originals = getattr(adapter, "_originals", {})
        patcher_type = originals.get(
            (patcher_module.__name__, "SubprocessModelPatcher")
        )
        if patcher_type is None:
            return None, None, "SubprocessModelPatcher was replaced"
    try:
        from importlib.metadata import version

        ver = version("comfy-env")
    except Exception:  # noqa: BLE001
        ver = "unknown version"
    return patcher_type, state_sync, f"comfy_env {ver}"


# ---- the worker processes -----------------------------------------------


class Worker(PipeWorker):
    """The demo's pipe worker plus the two attributes comfy-env's stand-in
    reads off its SubprocessWorker (ours ignore them)."""

    def __init__(self, name: str, board: Any) -> None:
        super().__init__(name, board)
        self._mem_lock = threading.Lock()
        self._calls_in_flight = 0


@dataclass
class Model:
    name: str
    size: int
    worker: str | None  # None: a host model
    patcher: Any
    slot: int | None = None


@dataclass
class PassResult:
    required: int
    extra: int
    free_after: int
    evicted: dict[str, int]
    oracle_evicted: dict[str, int]
    oracle_free_after: int

    @property
    def excess(self) -> int:
        return max(
            0, sum(self.evicted.values()) - sum(self.oracle_evicted.values())
        )

    @property
    def wrong(self) -> list[str]:
        took = {m for m, n in self.evicted.items() if n > 0}
        oracle = {m for m, n in self.oracle_evicted.items() if n > 0}
        return sorted(took - oracle)

    @property
    def short(self) -> bool:
        return (
            self.free_after < self.required
            and self.oracle_free_after >= self.required
        )


@dataclass
class ScenarioResult:
    scenario: str
    mode: str
    passes: list[PassResult] = field(default_factory=list)
    error: str | None = None

    @property
    def excess(self) -> int:
        return sum(p.excess for p in self.passes)

    @property
    def wrong(self) -> int:
        return sum(len(p.wrong) for p in self.passes)

    @property
    def short(self) -> int:
        return sum(p.short for p in self.passes)


# Worker models of every scenario: worker -> [(id, size, kind)]
WORKERS = {
    "A": [("A/unet", 4 * GiB, "unet"), ("A/lora", GiB // 2, "lora")],
    "B": [("B/unet", 3 * GiB, "unet")],
    "C": [("C/clip", 2 * GiB, "clip")],
}
HOSTS = [("clip", 3 * GiB // 2), ("vae", GiB // 2)]


class Run:
    """One scenario in one mode: fresh mock, fresh workers and boards."""

    def __init__(
        self,
        mode: str,
        comfy_env: Any = None,
        state_sync: Any = None,
        heartbeat_limit: float = 3600.0,
    ) -> None:
        self.mode = mode
        self.comfy_env = comfy_env
        self.state_sync = state_sync
        self.heartbeat_limit = heartbeat_limit
        mm.reset(total=TOTAL)
        self.card = mm.sim.card()
        self.card.strict = False  # the workers' bytes are synced in
        self.pool = comfy_standin.Pool(floor=0, process_local=False)
        self.workers: dict[str, Worker] = {}
        self.boards: list[Any] = []
        self.models: dict[str, Model] = {}
        self.refusing: set[str] = set()
        self.in_pass = False
        self.pass_events: dict[int, list[tuple]] = {}
        self.n_candidates = 0
        self.query = 0
        self.snapshots: list[tuple[dict, dict]] = []
        mm.sim.on_query.append(self._on_query)

    # -- set-up --------------------------------------------------------

    def start(self) -> None:
        for name, specs in WORKERS.items():
            board = Board.create(
                8, generation=1, heartbeat_limit=self.heartbeat_limit
            )
            self.boards.append(board)
            worker = Worker(name, board)
            self.workers[name] = worker
            worker.wait_ready()
            board.expected_owner = worker.pid
            worker.send_command(
                "make_models",
                models=[
                    {"id": i, "size": s, "kind": k} for i, s, k in specs
                ],
            )
            for model_id, size, kind in specs:
                patcher = self._standin(worker, model_id, size, kind)
                if self.mode == "boards":
                    slot = patcher.attach_board(board)
                else:
                    slot = board.assign(model_id, size)
                worker.send_command(
                    "board_bind",
                    model_id=model_id,
                    slot=slot,
                    tag=board.tag(slot),
                )
                self.models[model_id] = Model(
                    model_id, size, name, patcher, slot
                )
            if board.attached:
                board.unlink()  # both have it mapped: drop the descriptor
        for name, size in HOSTS:
            host = mm.HostModel(name, size)
            self.models[name] = Model(name, size, None, host)

    def _standin(self, worker, model_id, size, kind) -> Any:
        if self.mode == "comfy-env":
            return self.comfy_env(
                worker, 1, model_id, size, mm.CUDA0, mm.CPU, kind=kind
            )
        return comfy_standin.StandIn(
            worker=worker,
            worker_generation=1,
            model_id=model_id,
            model_size=size,
            load_device=mm.CUDA0,
            offload_device=mm.CPU,
            kind=kind,
            pool=self.pool,
        )

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            mm.sim.on_query.remove(self._on_query)
        for worker in self.workers.values():
            with contextlib.suppress(Exception):
                worker.shut_down()
        for board in self.boards:
            board.close()
        self.pool.boundary()
        mm.reset()

    # -- truth ---------------------------------------------------------

    def truth(self) -> dict[str, int]:
        """Every model's true resident bytes: a host model's loaded bytes;
        for a worker model the worker's own word (its ``report`` census,
        which the bench reads and never gives to a stand-in), 0 once the
        worker is dead (the driver took its memory back)."""
        out = {}
        said: dict[str, int] = {}
        for worker in self.workers.values():
            if not worker.is_alive():
                continue
            report = worker.send_command("report")["_vram_report"]
            for entry in report["residency"]:
                said[entry["id"]] = int(entry["resident"])
        for m in self.models.values():
            if m.worker is None:
                out[m.name] = m.patcher.loaded_size()
            elif self.workers[m.worker].is_alive():
                out[m.name] = said[m.name]
            else:
                out[m.name] = 0
        return out

    def sync(self) -> None:
        """Put every worker model's true bytes on the simulated card."""
        truth = self.truth()
        for m in self.models.values():
            if m.worker is None:
                continue
            key = (m.worker, m.name)
            if truth[m.name]:
                self.card.allocations[key] = truth[m.name]
            else:
                self.card.allocations.pop(key, None)
        if self.card.used() > self.card.total:
            raise RuntimeError("scenario over-commits the card")

    def listed(self, m: Model) -> bool:
        return mm.loaded_entry(m.patcher) is not None

    # -- steps ---------------------------------------------------------

    def load(self, name: str, nbytes: int) -> None:
        """A node loads the model (ComfyUI lists it and loads bytes)."""
        m = self.models[name]
        self.sync()
        if m.worker is None:
            if not self.listed(m):
                entry = mm.LoadedModel(m.patcher)
                entry.model_load(nbytes)
                mm.current_loaded_models.insert(0, entry)
            else:
                m.patcher.partially_load(mm.CUDA0, nbytes)
        else:
            if not self.listed(m):
                comfy_standin.register(mm, m.patcher)
            m.patcher.partially_load(mm.CUDA0, nbytes)
        self.sync()

    def page(self, name: str, resident: int) -> None:
        """The worker's call pages the model to `resident` bytes; no reply
        says so (only its board)."""
        m = self.models[name]
        worker = self.workers[m.worker]
        if not worker.is_alive():
            return
        if not self.in_pass and not self.listed(m):
            # the node that calls it had ComfyUI list it (never inside
            # free_memory: its loop pops entries by index)
            comfy_standin.register(mm, m.patcher)
        worker.send_command("call_begin", model_id=name, resident=resident)
        worker.send_command("call_end")

    def kill(self, worker_name: str) -> None:
        self.workers[worker_name].kill()

    def refuse(self, worker_name: str, on: bool) -> None:
        worker = self.workers[worker_name]
        if worker.is_alive():
            worker.send_command("refuse", on=on)
        (self.refusing.add if on else self.refusing.discard)(worker_name)

    def census(self, worker_name: str) -> None:
        """The worker's census at the end of its call (comfy-env's
        ``_vram_report``) reaches the stand-ins."""
        worker = self.workers[worker_name]
        report = worker.send_command("report")["_vram_report"]
        if self.mode == "comfy-env":
            mine = {
                m.name: m.patcher
                for m in self.models.values()
                if m.worker == worker_name
            }
            with worker._mem_lock:
                self.state_sync.apply_residency(mine, report["residency"])
        else:
            self.pool.report(worker, report)

    def boundary(self) -> None:
        """A node boundary: ours put back what a refusing worker kept;
        for comfy-env the bench does what its boundary does
        (eviction_deferred -> listed again)."""
        if self.mode == "comfy-env":
            for m in self.models.values():
                p = m.patcher
                if (
                    m.worker is not None
                    and getattr(p, "eviction_deferred", False)
                    and not self.listed(m)
                    and self.workers[m.worker].is_alive()
                ):
                    comfy_standin.register(mm, p)
                    p.eviction_deferred = False
        else:
            self.pool.boundary(mm)

    def apply_event(self, event: tuple) -> None:
        what = event[0]
        if what == "page":
            self.page(event[1], event[2])
        elif what == "kill":
            self.kill(event[1])
        elif what == "refuse":
            self.refuse(event[1], event[2])
        else:
            raise ValueError(f"unknown event {event!r}")

    def _on_query(self, card: Any) -> None:
        if not self.in_pass:
            self.sync()
            return
        k = self.query
        self.query += 1
        pre = self.truth()
        if k < self.n_candidates:
            for event in self.pass_events.get(k, ()):
                self.apply_event(event)
        self.sync()
        self.snapshots.append((pre, self.truth()))

    def free(self, extra: int, events: dict[int, list[tuple]]) -> PassResult:
        """ComfyUI's free_memory for `extra` bytes more than are free now;
        `events` happen just before candidate k's memory_to_free."""
        self.sync()
        start = self.truth()
        required = self.card.free() + extra
        refusing = set(self.refusing)
        dead = {n for n, w in self.workers.items() if not w.is_alive()}
        self.n_candidates = sum(
            1
            for e in mm.current_loaded_models
            if e.device == mm.CUDA0 and not e.is_dead()
        )
        self.pass_events = events
        self.query = 0
        self.snapshots = []
        self.in_pass = True
        try:
            mm.free_memory(required, mm.CUDA0)
        finally:
            self.in_pass = False
        self.sync()
        end = self.truth()
        evicted = dict.fromkeys(self.models, 0)
        before = start
        for pre, post in [*self.snapshots, (end, end)]:
            for name in evicted:
                evicted[name] += max(0, before[name] - pre[name])
            before = post
        record = mm.free_memory_log[-1]
        oracle_evicted, oracle_free = self.oracle(
            record, start, required, events, refusing, dead
        )
        return PassResult(
            required=required,
            extra=extra,
            free_after=self.card.free(),
            evicted=evicted,
            oracle_evicted=oracle_evicted,
            oracle_free_after=oracle_free,
        )

    # -- the oracle ----------------------------------------------------

    def oracle(self, record, start, required, events, refusing, dead):
        """free_memory's rule on the true residency (module docstring)."""
        by_patcher = {id(m.patcher): m for m in self.models.values()}
        order = []
        for key, entry in record["candidates"]:
            m = by_patcher[id(entry.model)]
            true_key = (-(m.size - start[m.name]), *key[1:])
            order.append((true_key, m))
        order.sort(key=lambda item: item[0])
        truth = dict(start)
        evicted = dict.fromkeys(truth, 0)
        refusing, dead = set(refusing), set(dead)
        for k, (_, m) in enumerate(order):
            for event in events.get(k, ()):
                what = event[0]
                if what == "page":
                    w = self.models[event[1]].worker
                    if w not in dead:
                        truth[event[1]] = min(
                            event[2], self.models[event[1]].size
                        )
                elif what == "kill":
                    dead.add(event[1])
                    for other in self.models.values():
                        if other.worker == event[1]:
                            truth[other.name] = 0
                elif what == "refuse":
                    (refusing.add if event[2] else refusing.discard)(
                        event[1]
                    )
            free = TOTAL - sum(truth.values())
            to_free = required - free
            if to_free <= 0:
                continue
            if m.worker in refusing or m.worker in dead:
                continue  # frees nothing, whoever asks
            loaded = truth[m.name]
            if to_free < loaded:
                if m.worker is None:
                    grain = m.patcher.granularity
                else:
                    grain = WORKER_BLOCK
                blocks = max(1, math.ceil(to_free / grain))
                freed = min(loaded, blocks * grain)
                truth[m.name] -= freed
                evicted[m.name] += freed
                if freed >= to_free:
                    continue
            evicted[m.name] += truth[m.name]
            truth[m.name] = 0
        return evicted, TOTAL - sum(truth.values())


# ---- the scenarios --------------------------------------------------------

Step = tuple


def _setup() -> list[Step]:
    return [
        ("load", "clip", 0),
        ("load", "vae", 0),
        ("load", "A/unet", 1 * GiB),
        ("load", "A/lora", GiB // 2),
        ("load", "B/unet", GiB // 2),
        ("load", "C/clip", 2 * GiB),
    ]


def scenario_paging_in() -> list[Step]:
    """B/unet pages itself in to 3 GiB during a call; its receipt still
    says 0.5 GiB, so receipts sort it as mostly offloaded, take it first
    and, asked for more than that 0.5 GiB, detach all 3 GiB where the
    oracle took 1 GiB of other models.  Then A/unet pages in while free_memory
    runs (after the sort)."""
    return [
        *_setup(),
        ("page", "B/unet", 3 * GiB),
        ("free", 2 * GiB, {}),
        ("boundary",),
        ("load", "B/unet", 3 * GiB),
        ("free", 1 * GiB, {1: [("page", "A/unet", 4 * GiB)]}),
    ]


def scenario_paging_out() -> list[Step]:
    """A/unet is fully loaded per its receipt, then pages itself down to
    0.5 GiB in a call: receipts sort it last and take another model
    instead of the 0.5 GiB the oracle takes first.  Then C/clip pages
    out while free_memory runs."""
    return [
        *_setup(),
        ("load", "A/unet", 4 * GiB),
        ("page", "A/unet", GiB // 2),
        ("free", 1 * GiB, {}),
        ("boundary",),
        ("free", 1 * GiB, {0: [("page", "C/clip", GiB // 4)]}),
    ]


def scenario_killed() -> list[Step]:
    """B is killed between two passes, then C in the middle of one.  A
    dead worker's bytes are back on the card before memory_to_free is
    computed, and it frees nothing wherever it sorts, so the order of
    the others is unchanged: no regret in any column."""
    return [
        *_setup(),
        ("page", "B/unet", 2 * GiB),
        ("kill", "B"),
        ("free", 1 * GiB, {}),
        ("boundary",),
        ("free", 2 * GiB, {1: [("kill", "C")]}),
    ]


def scenario_refusing() -> list[Step]:
    """A refuses (its lock is busy), then starts refusing in the middle
    of a pass, then answers again after a boundary.  A refusing worker
    frees nothing whoever asks and ComfyUI moves on to the next
    candidate; the boundary lists the model again, so the next pass
    can take it."""
    return [
        *_setup(),
        ("load", "A/unet", 4 * GiB),
        ("refuse", "A", True),
        ("free", 3 * GiB, {}),
        ("refuse", "A", False),
        ("boundary",),
        ("free", 1 * GiB, {0: [("refuse", "A", True)]}),
        ("refuse", "A", False),
        ("boundary",),
        ("free", 1 * GiB, {}),
    ]


def scenario_stale() -> list[Step]:
    """B pages its unet in during a call that ends with no census, then
    is quiet longer than its board's heartbeat limit (0.2 s here): the
    board reads stale, the stand-in falls back to its receipt, and
    boards regret exactly what receipts do.  A live pager publishes on
    every change, so its board goes stale only when it is idle, which is
    when a census at the end of its call has made the receipt right."""
    return [
        ("heartbeat_limit", 0.2),
        *_setup(),
        ("page", "B/unet", 3 * GiB),
        ("wait", 0.3),
        ("free", 2 * GiB, {}),
    ]


def scenario_census() -> list[Step]:
    """As "board gone stale", but B's call ends with a census (the
    `_vram_report` comfy-env's worker sends at a node boundary): every
    receipt is right again, no regret in any column."""
    return [
        ("heartbeat_limit", 0.2),
        *_setup(),
        ("page", "B/unet", 3 * GiB),
        ("census", "B"),
        ("wait", 0.3),
        ("free", 2 * GiB, {}),
    ]


def scenario_random(seed: int, steps: int = 10) -> list[Step]:
    """Seeded: pages in and out between and during passes, boundaries,
    reloads, no census.  Receipts' regret here is a model that paged
    itself in with no message: its receipt is behind, so it sorts too
    early and is detached whole (excess); or its receipt says 0 (it was
    evicted, then paged back in), so the stand-in skips the detach as if
    nothing were loaded and the pass ends short."""
    rng = random.Random(seed)
    names = [i for specs in WORKERS.values() for i, _, _ in specs]
    sizes = {i: s for specs in WORKERS.values() for i, s, _ in specs}
    out = list(_setup())
    for _ in range(steps):
        r = rng.random()
        if r < 0.35:
            name = rng.choice(names)
            out.append(("page", name, _chunk(rng, sizes[name])))
        elif r < 0.45:
            name = rng.choice(names + [h for h, _ in HOSTS])
            size = sizes.get(name) or dict(HOSTS)[name]
            out.append(("load", name, _chunk(rng, size)))
        elif r < 0.55:
            out.append(("boundary",))
        else:
            events: dict[int, list[tuple]] = {}
            if rng.random() < 0.6:
                name = rng.choice(names)
                k = rng.randrange(3)
                events[k] = [("page", name, _chunk(rng, sizes[name]))]
            out.append(("free", rng.randrange(1, 9) * GiB // 2, events))
    return out


def _chunk(rng: random.Random, size: int) -> int:
    return rng.randrange(0, 9) * size // 8


def scenarios(smoke: bool = False) -> dict[str, Callable[[], list[Step]]]:
    if smoke:
        return {"paging in": scenario_paging_in}
    out = {
        "paging in": scenario_paging_in,
        "paging out": scenario_paging_out,
        "worker killed": scenario_killed,
        "worker refusing": scenario_refusing,
        "board gone stale": scenario_stale,
        "census at call end": scenario_census,
    }
    for seed in RANDOM_SEEDS:
        out[f"random, seed {seed}"] = (
            lambda seed=seed: scenario_random(seed)
        )
    return out


def run_scenario(
    name: str,
    steps: list[Step],
    mode: str,
    comfy_env: Any = None,
    state_sync: Any = None,
) -> ScenarioResult:
    result = ScenarioResult(name, mode)
    limit = 3600.0
    if steps and steps[0][0] == "heartbeat_limit":
        limit = steps[0][1]
        steps = steps[1:]
    run = Run(mode, comfy_env, state_sync, limit)
    try:
        run.start()
        for step in steps:
            what = step[0]
            if what == "load":
                run.load(step[1], step[2])
            elif what == "page":
                run.page(step[1], step[2])
            elif what == "free":
                result.passes.append(run.free(step[1], step[2]))
            elif what == "boundary":
                run.boundary()
            elif what == "census":
                run.census(step[1])
            elif what == "wait":
                time.sleep(step[1])
            elif what == "kill":
                run.kill(step[1])
            elif what == "refuse":
                run.refuse(step[1], step[2])
            else:
                raise ValueError(f"unknown step {step!r}")
    except Exception as exc:  # noqa: BLE001 - reported in the table
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        run.close()
    return result


def measure_regret(smoke: bool = False, progress=None):
    patcher_type, state_sync, label = load_comfy_env()
    modes = [m for m in MODES if m != "comfy-env" or patcher_type]
    results: list[ScenarioResult] = []
    for name, make in scenarios(smoke).items():
        steps = make()
        for mode in modes:
            if progress:
                progress(f"regret: {name}, {mode}")
            results.append(
                run_scenario(name, steps, mode, patcher_type, state_sync)
            )
    missing = None if patcher_type else label
    return results, missing, label


# ---- a whole free_memory pass with N stand-ins ----------------------------


class InertWorker:
    """A worker that is never asked anything (no eviction in the pass)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._mem_lock = threading.Lock()
        self._calls_in_flight = 0

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        return {}

    def is_alive(self) -> bool:
        return True


def _pass_impls() -> list[tuple[str, Callable[[int], list]]]:
    size = 2 * GiB
    patcher_type, state_sync, _ = load_comfy_env()

    def ours(module):
        def make(n: int) -> list:
            pool = module.Pool(floor=0, process_local=False)
            out = []
            for i in range(n):
                if i % 8 == 0:
                    worker = InertWorker(f"w{i // 8}")
                s = module.StandIn(
                    worker=worker, worker_generation=1, model_id=f"m{i}",
                    model_size=size, load_device=mm.CUDA0,
                    offload_device=mm.CPU, kind="unet", pool=pool,
                )
                module.apply_echo(s, resident=size // 2, seq=1)
                out.append(s)
            return [pool, *out]

        return make

    def host(n: int) -> list:
        out = []
        for i in range(n):
            h = mm.HostModel(f"h{i}", size)
            h.model._loaded = size // 2  # no card bytes: nothing evicted
            out.append(h)
        return out

    impls = [("c", ours(comfy_standin)), ("reference", ours(reference))]
    if patcher_type is not None:

        def theirs(n: int) -> list:
            out = []
            for i in range(n):
                if i % 8 == 0:
                    worker = InertWorker(f"w{i // 8}")
                s = patcher_type(
                    worker, 1, f"m{i}", size, mm.CUDA0, mm.CPU, kind="unet"
                )
                state_sync.apply_echo(s, size // 2, seq=1)
                out.append(s)
            return out

        impls.append(("comfy-env", theirs))
    impls.append(("mock HostModel", host))
    return impls


def _entries(objects: list) -> list:
    entries = []
    for obj in objects:
        if not hasattr(obj, "model_size"):
            continue  # the pool
        entry = mm.LoadedModel(obj)
        entry.currently_used = False
        entry.real_model = weakref.ref(obj.model)  # is_dead() reads it
        entries.append(entry)
    return entries


def measure_pass(sizes=PASS_SIZES, rounds: int = 9, min_batch=0.05,
                 progress=None):
    """{impl: {n: seconds per pass}}: free_memory(0) over n entries."""
    impls = _pass_impls()
    out: dict[str, dict[int, float]] = {name: {} for name, _ in impls}
    mm.reset(total=TOTAL)
    try:
        for n in sizes:
            if progress:
                progress(f"free_memory pass: n = {n}")
            keep = {name: make(n) for name, make in impls}
            entries = {name: _entries(keep[name]) for name, _ in impls}
            loops = {}
            for name, _ in impls:
                mm.current_loaded_models[:] = entries[name]
                k = 1
                while True:
                    t = _time_passes(k)
                    if t >= min_batch or k >= 1 << 16:
                        break
                    k *= 2
                loops[name] = k
            best = dict.fromkeys(out, math.inf)
            for _ in range(rounds):
                for name, _ in impls:
                    mm.current_loaded_models[:] = entries[name]
                    t = _time_passes(loops[name]) / loops[name]
                    best[name] = min(best[name], t)
            for name in out:
                out[name][n] = best[name]
            del mm.current_loaded_models[:]
            del keep, entries
            gc.collect()
    finally:
        mm.reset()
    return out


def _time_passes(k: int) -> float:
    free_memory = mm.free_memory
    dev = mm.CUDA0
    clock = time.perf_counter
    enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection is not the pass's cost
    try:
        t0 = clock()
        for _ in range(k):
            free_memory(0, dev)
        t = clock() - t0
    finally:
        if enabled:
            gc.enable()
    del mm.free_memory_log[:]
    return t


# ---- report ---------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def regret_table(results: list[ScenarioResult]) -> str:
    modes = list(dict.fromkeys(r.mode for r in results))
    names = list(dict.fromkeys(r.scenario for r in results))
    by = {(r.scenario, r.mode): r for r in results}
    head = "| scenario | passes | " + " | ".join(
        f"{m}: excess GiB / wrong / short" for m in modes
    ) + " |"
    rule = "|---|---:|" + "---:|" * len(modes)
    lines = [head, rule]
    totals = {m: [0, 0, 0] for m in modes}
    for name in names:
        cells = []
        passes = ""
        for m in modes:
            r = by[(name, m)]
            if r.error:
                cells.append(f"error: {r.error}")
                continue
            passes = str(len(r.passes))
            cells.append(f"{gib(r.excess)} / {r.wrong} / {r.short}")
            t = totals[m]
            t[0] += r.excess
            t[1] += r.wrong
            t[2] += r.short
        lines.append(f"| {name} | {passes} | " + " | ".join(cells) + " |")
    lines.append(
        "| **all** | | "
        + " | ".join(
            f"**{gib(t[0])} / {t[1]} / {t[2]}**" for t in totals.values()
        )
        + " |"
    )
    return "\n".join(lines)


def regret_details(results: list[ScenarioResult]) -> str:
    """Each pass that had regret: what was taken, what the oracle took."""
    lines = []
    for r in results:
        for i, p in enumerate(r.passes):
            if not (p.excess or p.wrong or p.short):
                continue
            took = ", ".join(
                f"{m} {gib(n)}" for m, n in p.evicted.items() if n
            ) or "nothing"
            oracle = ", ".join(
                f"{m} {gib(n)}" for m, n in p.oracle_evicted.items() if n
            ) or "nothing"
            lines.append(
                f"- {r.scenario}, {r.mode}, pass {i + 1} (asked "
                f"{gib(p.extra)} GiB more than free): took {took}; the "
                f"oracle took {oracle}"
                + ("; ended short" if p.short else "")
            )
    return "\n".join(lines)


def pass_table(timings: dict[str, dict[int, float]]) -> str:
    names = list(timings)
    sizes = sorted(next(iter(timings.values())))
    head = "| N | " + " | ".join(
        f"{n}: us/pass (ns/cand)" for n in names
    )
    if "c" in names:
        head += " | " + " | ".join(
            f"{n}/c" for n in names if n != "c"
        )
    head += " |"
    rule = "|---:|" + "---:|" * len(names)
    if "c" in names:
        rule += "---:|" * (len(names) - 1)
    lines = [head, rule]
    for n in sizes:
        cells = [
            f"{timings[name][n] * 1e6:,.1f} "
            f"({timings[name][n] / n * 1e9:,.0f})"
            for name in names
        ]
        if "c" in names:
            c = timings["c"][n]
            cells += [
                f"{timings[name][n] / c:.2f}" for name in names if name != "c"
            ]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slope(points: dict[int, float]) -> float:
    """Least-squares exponent b of t = a * N**b (1: linear)."""
    xs = [math.log(n) for n in points]
    ys = [math.log(t) for t in points.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def marginal(points: dict[int, float]) -> tuple[float, float]:
    """Between the two largest N: (ns per added candidate, exponent)."""
    lo, hi = sorted(points)[-2:]
    per = (points[hi] - points[lo]) / (hi - lo) * 1e9
    return per, math.log(points[hi] / points[lo]) / math.log(hi / lo)


def plot(results, timings) -> str | None:
    """Write the two PNGs; None, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return (
            f"matplotlib is missing ({type(exc).__name__}: {exc}); "
            f"pip install matplotlib to get the plots"
        )
    fig, (ax, per) = plt.subplots(1, 2, figsize=(9.6, 4.2), dpi=80)
    for name, points in timings.items():
        ns = sorted(points)
        per.plot(ns, [points[n] / n * 1e9 for n in ns], marker="o",
                 label=name)
        ns = sorted(points)
        ax.plot(ns, [points[n] * 1e6 for n in ns], marker="o",
                label=f"{name} (slope {slope(points):.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("N registered models")
    ax.set_ylabel("us per free_memory pass")
    ax.set_title("time per pass")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    per.set_xscale("log")
    per.set_ylim(bottom=0)
    per.set_xlabel("N registered models")
    per.set_ylabel("ns per candidate (flat: linear)")
    per.set_title("time per candidate")
    per.grid(True, which="both", alpha=0.3)
    fig.suptitle("One free_memory pass (no eviction), mock ComfyUI")
    fig.tight_layout()
    fig.savefig(PASS_PNG)
    plt.close(fig)

    modes = list(dict.fromkeys(r.mode for r in results))
    names = list(dict.fromkeys(r.scenario for r in results))
    by = {(r.scenario, r.mode): r for r in results}
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.2), dpi=80)
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width
              for i in range(len(names))]
        axes[0].bar(xs, [by[(n, mode)].excess / GiB for n in names],
                    width, label=mode)
        axes[1].bar(xs, [by[(n, mode)].wrong + by[(n, mode)].short
                         for n in names], width, label=mode)
    for ax, title in zip(axes, ("excess GiB", "wrong + short"), strict=True):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Eviction regret against the oracle, per scenario")
    fig.tight_layout()
    fig.savefig(REGRET_PNG)
    plt.close(fig)
    return None


def format_section(results, missing, label, timings, plot_note, command,
                   seconds) -> str:
    slopes = ", ".join(f"{n} {slope(p):.2f}" for n, p in timings.items())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    margins = ", ".join(
        f"{n} {marginal(p)[0]:,.0f} ns, {marginal(p)[1]:.2f}"
        for n, p in timings.items()
    )
    lines = [
        BEGIN_MARKER,
        f"Command: `{command}` (took {seconds:.0f} s). What the columns "
        "and the oracle are: bench/README.md and the bench's docstring.",
        "",
        "Eviction regret, summed over each scenario's free_memory passes "
        "(excess: GiB taken off the card beyond what the oracle took; "
        "wrong: models evicted that the oracle left; short: passes that "
        "ended short where the oracle's did not). `receipts` and `boards` "
        "are comfy_standin's C stand-in without and with the worker's "
        f"board; `comfy-env` is {label}'s SubprocessModelPatcher.",
        "",
    ]
    if missing:
        lines += [f"comfy-env not run: {missing}", ""]
    lines += [regret_table(results), ""]
    lines += ["Scenarios (what happens, and why a column regrets):", ""]
    for name, make in scenarios().items():
        if not name.startswith("random"):
            doc = " ".join((make.__doc__ or "").split())
            lines.append(f"- **{name}**: {doc}")
    seeds = ", ".join(str(x) for x in RANDOM_SEEDS)
    doc = " ".join((scenario_random.__doc__ or "").split())
    lines.append(f"- **random, seeds {seeds}**: {doc}")
    lines.append("")
    details = regret_details(results)
    if details:
        lines += ["Passes with regret:", "", details, ""]
    lines += [
        "One whole free_memory pass over N registered models that need no "
        "eviction (filter, sort key, loop), best of 9 rounds, the "
        "implementations taking turns; in brackets per candidate. "
        "`mock HostModel` is the mock's own model, the floor of the loop.",
        "",
        pass_table(timings),
        "",
        f"Fitted exponent of time against N over all N (1 is linear; "
        f"the fixed cost of a pass pulls it below 1): {slopes}. Between "
        f"the two largest N, ns per added candidate and exponent: "
        f"{margins}. "
        f"Load average when the bench ended: {load} on {os.cpu_count()} "
        "CPUs (a shared machine: the columns wobble from run to run, and "
        "most of a candidate's cost is the loop itself, as the mock's own "
        "model shows).",
        "",
    ]
    if plot_note:
        lines += [f"No plots: {plot_note}", ""]
    else:
        lines += [
            f"![regret per scenario]({REGRET_PNG.name}) "
            f"![cost of a pass against N]({PASS_PNG.name})",
            "",
        ]
    lines.append(END_MARKER)
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(
        re.escape(BEGIN_MARKER) + r".*?" + re.escape(END_MARKER), re.DOTALL
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = f"{text.rstrip()}\n\n{HEADING}\n\n{section}\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite our section of RESULTS.md and the PNGs")
    parser.add_argument("--smoke", action="store_true",
                        help="one scenario, N = 1 and 16, no plot")
    args = parser.parse_args(argv)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr)

    if not args.smoke:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib is missing: no plots will be written "
                  "(pip install matplotlib)", file=sys.stderr)
    t0 = time.monotonic()
    results, missing, label = measure_regret(args.smoke, progress)
    timings = measure_pass(
        SMOKE_PASS_SIZES if args.smoke else PASS_SIZES,
        rounds=1 if args.smoke else 9,
        min_batch=0.0 if args.smoke else 0.05,
        progress=progress,
    )
    seconds = time.monotonic() - t0
    if missing:
        print(f"comfy-env not run: {missing}", file=sys.stderr)
    print(regret_table(results))
    details = regret_details(results)
    if details:
        print(details)
    print()
    print(pass_table(timings))
    print("exponent:", ", ".join(
        f"{n} {slope(p):.2f}" for n, p in timings.items()
    ))
    if args.write:
        note = None if args.smoke else plot(results, timings)
        if note:
            print(note, file=sys.stderr)
        command = ("python bench/bench_regret.py " + " ".join(argv)).strip()
        write_section(
            RESULTS_PATH,
            format_section(results, missing, label, timings, note, command,
                           seconds),
        )
        print(f"wrote {RESULTS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
