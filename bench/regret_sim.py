"""The world of bench/bench_regret.py: ComfyUI, comfy-env 0.4.46 and its
workers on one simulated card, on a virtual clock.

What is real and what is modelled
=================================

Real code (imported, run as it is):

- ComfyUI's memory manager is the mock ``comfy.model_management`` of
  tests/mockcomfy (free_memory, load_models_gpu, LoadedModel as upstream
  02b2b38 has them; upstream's load_models_gpu passes no ``keep_loaded``,
  so the models being loaded are candidates of their own pass).
- comfy-env 0.4.46's host side: ``isolation/pool.py``'s
  ``_handle_vram_budget`` (the worker's ``request_vram_budget`` callback:
  the budget arithmetic, then ``mm.free_memory(need + offset, device)``
  with no ``keep_loaded``, then ``_ask_idle_workers`` when still short),
  ``_register_new_patchers`` with ``_ingest_worker_frames`` (the node
  boundary: census through ``state_sync.apply_residency`` with its seq
  guard, then the ``eviction_deferred`` repair, ``_release_idle_workers``,
  ``_publish_reserve``, then new stand-ins from ``_new_models``, each
  written full size when its device is CUDA, after the census was
  applied: the first census of a model arrives before its stand-in
  exists), ``_release_idle_workers`` (the idle sweep, every
  ``IDLE_SWEEP_INTERVAL_SECONDS``), ``_ask_idle_workers``,
  ``_cleanup_stale_patchers``; ``isolation/model_patcher.py``'s
  ``SubprocessModelPatcher``; ``state_sync``'s ``apply_residency``,
  ``apply_echo``, ``apply_peak_raise``, ``merge_vram_report``.  Four of
  its seams are redirected to the simulation: ``pool.time`` (the virtual
  clock), ``pool._true_device_free`` (NVML's device-wide free: the card's),
  ``pool._current_prompt`` and ``model_patcher._ON_PRESSURE`` (a copy of
  ``pool._on_host_pressure``, debounce included, that runs the ask after
  the free_memory pass instead of on a thread).

Modelled here (small, cited):

- ``metadata._call_in_worker`` (``begin_call``; the call; in its
  ``finally`` the node boundary, then ``end_call``) and the web-route
  ``_routed_call`` of ``pool._register_proxy_routes`` (``call_module``;
  a peak-only ``apply_peak_raise`` of the frame's census; ``end_call``).
- The host's ``SubprocessWorker`` as comfy-env's code sees it
  (``send_command`` with its 30 s lock wait and 60 s reply timeout that
  kills a hung worker, ``send_command_no_spawn`` with ``"busy"``, the
  harvest of ``_new_models`` and ``_vram_report`` from every reply frame
  in ``_send_request``, ``begin_call``/``end_call``).
- The worker process (``isolation/workers/_persistent_worker.py``): the
  command handlers ``_handle_model_partial`` (frees whole blocks through
  the worker's own patcher, ``empty_cache``, ``seq`` bumped; a module no
  patcher holds moves whole and answers without ``seq``) and
  ``_handle_model_to_device`` (compares the FIRST parameter's device:
  a lowvram model whose first parameter is on the CPU answers
  ``moved: False`` and frees nothing); ``_residency_census``; the frame's
  ``_vram_report`` (``residency``, ``overhead``, ``held``) and
  ``_new_models`` attached only to call and release replies
  (``_attach_new_models``), never to command replies; ``_bump_seq`` at
  registration and in every command reply; the shimmed
  ``load_models_gpu`` (``_call_parent("request_vram_budget")``, then the
  worker's own ``load_models_gpu``, which evicts the worker's own other
  models for room, then ``_register_if_cuda``); auto-registration of a
  module that lands on CUDA outside the shim, into
  ``_new_models_this_call``, which the next request clears; ``full_release``
  and ``partial_release`` (``memory_manager.py``).  A paged (comfy-aimdo)
  model faults its pages in while it computes and drops them under
  pressure, with no message.
- Our stand-in as shipped (receipts; a board
  reading when valid and measured after the receipt; a detach reply with
  ``moved: False`` writes nothing), its pool's node boundary
  (``comfy_standin.pool.Pool.boundary``: a registered stand-in ComfyUI
  dropped while its figure says bytes are still there is listed again),
  and the worker-side board publisher as bench/bench_board_view.py
  measured it (a sampler thread from the first binding: each pass waits
  for the GIL while a call runs, reaches the host after the measured
  read lag, and the next starts ``SAMPLE_PERIOD`` after it ended; and
  synchronously at a binding, before ``request_vram_budget``, after the
  shim's real ``load_models_gpu`` and at every ``_bump_seq``), each
  publish stamped with the time its measurement began.
- The package's rules for what ComfyUI can reach (``Rules``), each a
  column of its own: listed again, census at creation, a publish before
  each model command's reply, unlisted bytes reclaimed from idle
  workers, never waiting on a worker in a call on another thread.
- A command from another thread to a worker in a call waits on its lock
  until the call is due to end (at most ``LOCK_WAIT``), then runs at
  once: the simulation does not hold the other thread's call back.

Truth lives on the card (``mm.sim.card()``): per process, per owner
(a model's weights, the allocator cache, activations, the CUDA context).
On Linux ``get_free_memory`` is device-wide, so ComfyUI's
``memory_to_free`` is computed from the truth in every column; what a
column changes is the sort key (``loaded_size()``), whether a stand-in
sends a command at all (nothing resident: no command), and the entries
ComfyUI still lists.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import importlib
import importlib.metadata
import logging
import math
import random
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MOCK = REPO / "tests" / "mockcomfy"
if str(MOCK) not in sys.path:
    sys.path.insert(0, str(MOCK))

import comfy.model_management as mm  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30

#: comfy-env version whose internals this module drives and models.
COMFY_ENV_VERSION = "0.4.46"
#: A worker process's CUDA context and handles (state_sync.WORKER_VRAM_FLOOR).
CONTEXT_BYTES = 300 * MiB
#: One command round trip on the worker's socket (virtual seconds).
RTT = 0.001
#: SubprocessWorker._COMMAND_LOCK_TIMEOUT: a command waits this long for a
#: worker whose lock another thread holds, then fails.
LOCK_WAIT = 30.0
#: send_command's reply timeout; on expiry comfy-env kills the worker.
REPLY_TIMEOUT = 60.0
#: The board publisher's background period and the host's heartbeat limit
#: (comfy_standin.integrations.comfy_env.SAMPLE_PERIOD / HEARTBEAT_LIMIT).
SAMPLE_PERIOD = 0.05
HEARTBEAT_LIMIT = 5.0
#: The commands that move one model's bytes (rule 3 publishes before
#: their replies).
MODEL_COMMANDS = ("model_partial_unload", "model_partial_load",
                  "model_to_device")
#: comfy-aimdo pages weights in 32 MiB pages; its default headroom.
PAGE = 32 * MiB
PAGER_HEADROOM = 256 * MiB
#: pool.IDLE_SWEEP_INTERVAL_SECONDS
IDLE_SWEEP = 10.0
#: NUM_STREAMS a worker reports with its budget request (NVIDIA default).
NUM_STREAMS = 2

#: What the board's measurement costs, as bench/bench_board_view.py
#: measured it (bench/RESULTS.md, "board vs receipts": a host polling a
#: real worker's board): from a publish to the host's first read of it,
#: median 8.4 us, p90 34.7 us, p99 1.5 ms, max 5.7 ms.  The sampler's
#: asynchronous passes reach the host after such a lag; a synchronous
#: publish is followed by a message, so it is there when the host reads.
READ_LAG = ((0.0, 0.0), (0.5, 8.4e-6), (0.9, 34.7e-6), (0.99, 1.5364e-3),
            (1.0, 5.7081e-3))
#: One sampler pass: comfy-env's census over the worker's models, then a
#: publish per slot (assumed: a census walks a few patchers in Python).
PASS_COST = 0.0005
#: sys.getswitchinterval(): while the worker's main thread runs Python (a
#: node's call), the sampler thread waits up to this long for the GIL
#: before each pass.  The sampler waits SAMPLE_PERIOD after a pass ends,
#: so its passes fall behind the period; a pack that holds the GIL for
#: longer is a "lag" event of the workload.
SWITCH_INTERVAL = 0.005


@dataclass(frozen=True)
class Rules:
    """What one column's host does.  ``view`` answers loaded_size() for a
    worker model: ``comfy-env`` (its own patcher), ``receipts`` (ours, no
    board), ``boards`` (ours, a board reading measured after the receipt
    wins, where the worker publishes one), ``oracle`` (the truth).  Each
    further flag is one of the package's rules for issue 25 (its point):

    - ``relist`` (1): at every node boundary and before every
      ``_handle_vram_budget``, every stand-in whose model is on the card by
      its newest word is listed, once; an entry whose model is off the
      card goes; a stand-in is let go only when its worker reports the
      model gone or dies;
    - ``census`` (2): a frame's census applies to the stand-ins that frame
      creates;
    - ``publish`` (3): the worker publishes its board synchronously before
      every model command's reply (shipped: only at ``_bump_seq``, which a
      plain module's move does not reach);
    - ``unlisted`` (4): when ComfyUI's free_memory leaves the card short,
      idle workers holding bytes none of their models accounts for (the
      held figure of their last frame less what their stand-ins answer),
      most first, are asked for what is still missing
      (``partial_release`` through ``send_command_no_spawn`` with no lock
      wait: a busy worker is skipped); only the bytes a receipt says came
      back count;
    - ``nowait`` (5): an eviction command to a worker in a call on another
      thread is deferred at once: nothing freed, the stand-in listed again.
    """

    view: str
    census: bool = False
    relist: bool = False
    publish: bool = False
    unlisted: bool = False
    nowait: bool = False
    #: a moved: False detach writes 0 (comfy-env's rule)
    moved_false_zero: bool = False


#: The columns, in the tables' order.  Each of relist .. no-wait is the
#: shipped stand-in with its board (column ``boards``) plus one rule;
#: ``all`` has every rule.
COLUMN_RULES = {
    "comfy-env": Rules("comfy-env", moved_false_zero=True),
    "receipts": Rules("receipts"),
    "boards": Rules("boards"),
    "relist": Rules("boards", relist=True),
    "census": Rules("boards", census=True),
    "publish": Rules("boards", publish=True),
    "unlisted": Rules("boards", unlisted=True),
    "no-wait": Rules("boards", nowait=True),
    "all": Rules("boards", census=True, relist=True, publish=True,
                 unlisted=True, nowait=True),
    "oracle": Rules("oracle"),
}
COLUMNS = tuple(COLUMN_RULES)


class SimError(RuntimeError):
    """The simulation was driven into a state it does not model."""


# ---- comfy-env 0.4.46 ------------------------------------------------------


@dataclass
class ComfyEnv:
    """comfy-env's modules, imported over the mock comfy."""

    version: str
    pool: Any
    model_patcher: Any
    state_sync: Any


def load_comfy_env() -> ComfyEnv:
    """comfy-env 0.4.46's host modules.  Another version (or none) is an
    error that says what to do: this module drives its internals."""
    try:
        version = importlib.metadata.version("comfy-env")
    except importlib.metadata.PackageNotFoundError as exc:
        raise SimError(
            "comfy-env is not installed: pip install comfy-env=="
            f"{COMFY_ENV_VERSION} (the faithful column runs its own code)"
        ) from exc
    if version != COMFY_ENV_VERSION:
        raise SimError(
            f"bench/regret_sim.py drives comfy-env {COMFY_ENV_VERSION}'s "
            f"internals (pool._handle_vram_budget, _register_new_patchers, "
            f"the worker protocol); this environment has {version}.  "
            f"Re-check them against {version} and update COMFY_ENV_VERSION."
        )
    pool = importlib.import_module("comfy_env.isolation.pool")
    patcher = importlib.import_module("comfy_env.isolation.model_patcher")
    state_sync = importlib.import_module("comfy_env.state_sync")
    # comfy_standin's adapter may have swapped its own in: take the originals
    adapter = sys.modules.get("comfy_standin.integrations.comfy_env")
    if adapter is not None and getattr(adapter, "installed", lambda: 0)():
        raise SimError(
            "comfy_standin's comfy-env adapter is installed in this process; "
            "the bench needs comfy-env's own classes (uninstall() it first)"
        )
    return ComfyEnv(version, pool, patcher, state_sync)


# ---- the virtual clock -----------------------------------------------------


class Clock:
    """Virtual seconds.  ``pool.time`` is redirected here, so comfy-env's
    idle clocks run on it too."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    # the subset of the time module comfy-env's pool reads
    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        raise SimError("comfy-env slept on the simulated clock")


# ---- the worker process ----------------------------------------------------


@dataclass
class WModel:
    """One model inside a worker process (the truth)."""

    name: str
    size: int
    #: "legacy": a ComfyUI ModelPatcher loaded through load_models_gpu;
    #: "paged": a comfy-aimdo model (dynamic), pages faulted in while it
    #: computes; "plain": a module the pack moves itself with .to().
    mode: str
    kind: str = "other"
    #: bytes that move together (a module; a page for "paged")
    block: int = 64 * MiB
    #: where a partially loaded legacy model's FIRST parameter sits
    #: (_handle_model_to_device compares it): True on the card
    first_param_on_card: bool = True
    resident: int = 0
    mid: str | None = None  # comfy-env's model id once registered
    high: int = 0  # high-water of resident, for reload accounting
    #: a paged model's weights are mapped (on the card's virtual range,
    #: its parameters CUDA tensors) while the worker's own list holds it
    mapped: bool = False

    @property
    def first_param_cuda(self) -> bool:
        if self.mode == "paged":
            return self.mapped
        if self.resident <= 0:
            return False
        if self.resident >= self.size or self.mode != "legacy":
            return True
        return self.first_param_on_card


class SimWorker:
    """One comfy-env worker process, and the host's ``SubprocessWorker``
    facade of it (the surface comfy-env's pool and the stand-ins touch)."""

    def __init__(self, run: Run, name: str, generation: int,
                 models: list[dict], publishes: bool,
                 torch_cuda: bool = True) -> None:
        self.run = run
        self.name = name  # the process name on the card
        self.key = f"/envs/{name}"
        self.generation = generation
        # -- facade state (SubprocessWorker) --
        self._mem_lock = threading.Lock()
        self._calls_in_flight = 0
        self._last_vram_report: dict | None = None
        self._last_new_models: list[dict] = []
        self._last_held_bytes: int | None = None
        self._pin_release_deferred = None
        #: the held figure of the worker's last frame, and the bytes rule
        #: 4's reclaim took since
        self.held_report = 0
        self.reclaimed = 0
        self.supports_full_release = True
        self.supports_partial_release = True
        self.supports_release_pins = True
        # -- the process --
        #: torch sees a CUDA device (a recorded CPU-torch worker does not:
        #: its frames carry no overhead, its held figure is 0, and no
        #: allocator cache stays behind)
        self.torch_cuda = torch_cuda
        self.alive = True
        self.call_owner: str | None = None  # thread holding the lock
        self.models: dict[str, WModel] = {}
        for spec in models:
            m = WModel(**spec)
            self.models[m.name] = m
        self.by_mid: dict[str, WModel] = {}
        self.seq: dict[str, int] = {}
        self.counter = 0
        self.own_list: list[str] = []  # the worker's current_loaded_models
        self.new_models_this_call: list[dict] = []
        self.extra_reserved = 400 * MiB
        self.cache = 0
        self.act = 0
        self.hangs: list[tuple[float, float, bool]] = []
        # -- the board (worker side) --
        self.publishes = publishes
        self.blocked: list[tuple[float, float]] = []  # sampler not running
        #: the sampler's passes (stamp, visible to the host, end), newest
        #: last; the thread starts at the first binding
        self.sampler: collections.deque = collections.deque()
        self.next_pass = math.inf
        self.rng = random.Random(
            f"{run.workload.get('name', '')}:{name}:{generation}")
        #: this process's node calls, (start, end): the sampler waits for
        #: the GIL inside them
        self.calls: list[list[float]] = []
        #: when the call in flight is due to end (its computes), for the
        #: lock wait of a command from another thread
        self.call_end = -math.inf
        self.bound: dict[str, tuple[int, float]] = {}  # mid -> (tag, since)
        self.sync: dict[str, tuple[int, float]] = {}  # mid -> (value, stamp)
        self.sync_heartbeat = -math.inf
        self.history: dict[str, tuple[list[float], list[int]]] = {}
        run.set_bytes(self.name, "ctx", CONTEXT_BYTES)

    def __repr__(self) -> str:
        return f"<SimWorker {self.name} gen {self.generation}>"

    # -- facade -------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.alive

    def begin_call(self) -> None:
        with self._mem_lock:
            self._calls_in_flight += 1

    def end_call(self) -> None:
        with self._mem_lock:
            self._calls_in_flight = max(0, self._calls_in_flight - 1)

    def hung(self, now: float) -> tuple[float, float, bool] | None:
        for hang in self.hangs:
            if hang[0] <= now < hang[1]:
                return hang
        return None

    def _reach(self, method: str, lock_wait: float) -> None:
        """What a command meets before the worker reads it."""
        run = self.run
        if not self.alive:
            raise RuntimeError(f"{self.name}: worker process is dead")
        thread = run.thread
        if self.call_owner is not None and self.call_owner != thread:
            # the lock is free when the call ends: the command waits for
            # that, or `lock_wait` and fails (it then runs at once here:
            # the simulation does not hold the other thread's call back)
            left = self.call_end - run.clock.now
            if left >= lock_wait:
                run.stall(lock_wait, f"{method} to {self.name} (busy)",
                          "busy")
                raise RuntimeError(
                    f"{self.name}: timed out after {lock_wait}s waiting for "
                    f"the worker lock to send '{method}'"
                )
            run.stall(max(0.0, left), f"{method} to {self.name} (busy)",
                      "busy")
        if self.hung(run.clock.now) is not None:
            run.stall(REPLY_TIMEOUT, f"{method} to {self.name} (hung)",
                      "hung")
            self.kill()  # _send_request: timeout -> _kill_tree()
            raise TimeoutError(
                f"{self.name}: {method} timed out after {REPLY_TIMEOUT}s"
            )
        run.advance(RTT)

    def send_command(self, method: str, **params: Any) -> dict:
        self._reach(method, LOCK_WAIT)
        reply = self.handle(method, params)
        if self.run.rules.publish and method in MODEL_COMMANDS:
            self.publish_sync()  # rule 3: before the reply is sent
        self.harvest(reply)
        if reply.get("status") == "error":
            raise RuntimeError(
                f"{self.name}: Command '{method}' failed: {reply['error']}"
            )
        return reply

    def send_command_no_spawn(self, method: str, lock_timeout: float = 2.0,
                              **params: Any) -> Any:
        if not self.alive:
            return "dead"
        if self.call_owner is not None and self.call_owner != self.run.thread:
            self.run.stall(lock_timeout, f"{method} to {self.name} (busy)",
                           "ask")
            return "busy"
        return self.send_command(method, **params)

    def harvest(self, frame: dict) -> None:
        """_send_request: _new_models accumulate, _vram_report merges per
        field, on every reply path."""
        new = frame.get("_new_models")
        if new:
            self._last_new_models.extend(new)
        report = frame.get("_vram_report")
        if report is not None:
            if "held" in report:
                # the adapter keeps each frame's held figure (rule 4)
                self.held_report = int(report["held"])
                self.reclaimed = 0
            self._last_vram_report = self.run.ce.state_sync.merge_vram_report(
                self._last_vram_report, report
            )

    # -- the process: bytes -------------------------------------------------

    def set_resident(self, m: WModel, value: int) -> None:
        value = max(0, min(int(value), m.size))
        if value == m.resident:
            return
        if value > m.resident:
            self.run.account_load(value - m.resident, m.resident, m.high)
            m.high = max(m.high, value)
        m.resident = value
        self.run.set_bytes(self.name, "w:" + m.name, value)
        if m.mid is not None:
            self.note(m.mid, self.census_value(m))

    def set_cache(self, value: int) -> None:
        self.cache = max(0, int(value))
        self.run.set_bytes(self.name, "cache", self.cache)

    def set_act(self, value: int) -> None:
        self.act = max(0, int(value))
        self.run.set_bytes(self.name, "act", self.act)

    def empty_cache(self) -> None:
        self.set_cache(0)

    def list_model(self, m: WModel) -> None:
        """The worker's own current_loaded_models takes `m` (index 0)."""
        if m.name in self.own_list:
            self.own_list.remove(m.name)
        self.own_list.insert(0, m.name)
        m.mapped = True
        if m.mid is not None:
            self.note(m.mid, self.census_value(m))

    def unlist_model(self, m: WModel) -> None:
        if m.name in self.own_list:
            self.own_list.remove(m.name)
        m.mapped = False
        if m.mid is not None:
            self.note(m.mid, self.census_value(m))

    def kill(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.call_owner = None
        self.run.card.release_process(self.name)
        for m in self.models.values():
            m.resident = 0

    # -- the process: registry and census -----------------------------------

    def bump(self, mid: str) -> int:
        """_bump_seq; the board publisher publishes at every bump site."""
        self.seq[mid] = self.seq.get(mid, 0) + 1
        self.publish_sync()
        return self.seq[mid]

    def register(self, m: WModel) -> None:
        """_register_cuda_module / _register_model: a fresh id, appended to
        _new_models_this_call, seq bumped."""
        if m.mid is not None:
            return
        self.counter += 1
        m.mid = f"{m.name}_{self.counter}"
        self.by_mid[m.mid] = m
        self.new_models_this_call.append(
            {"id": m.mid, "size": m.size, "kind": m.kind}
        )
        self.note(m.mid, self.census_value(m))
        self.bump(m.mid)

    def census_value(self, m: WModel) -> int:
        """_residency_census for one model: its patcher's loaded_size()
        when the worker's own list holds it, else size-or-nothing by its
        first parameter."""
        if m.name in self.own_list:
            return m.resident
        return m.size if m.first_param_cuda else 0

    def census(self) -> list[dict]:
        out = []
        for mid, m in self.by_mid.items():
            out.append({
                "id": mid, "seq": self.seq.get(mid, 0),
                "resident": self.census_value(m),
                "device": "cuda:0" if m.first_param_cuda else "cpu",
            })
        return out

    def frame(self, status: str = "ok") -> dict:
        """_attach_new_models: one VRAM report per frame, then the new
        models with their device resolved now."""
        report: dict[str, Any] = {}
        census = self.census() if self.by_mid else None
        if census is not None:
            report["residency"] = census
        torch_reserved = self.torch_reserved() if self.torch_cuda else 0
        resident_sum = sum(e["resident"] for e in census or [])
        if self.torch_cuda:
            report["overhead"] = max(0, torch_reserved - resident_sum)
        paged = sum(m.resident for m in self.models.values()
                    if m.mode == "paged")
        report["held"] = max(paged, torch_reserved)
        frame: dict[str, Any] = {"status": status, "_vram_report": report}
        if self.new_models_this_call:
            new = []
            for entry in self.new_models_this_call:
                m = self.by_mid.get(entry["id"])
                device = "cuda:0" if m is not None and m.first_param_cuda \
                    else "cpu"
                new.append({**entry, "device": device})
            frame["_new_models"] = new
        return frame

    def torch_reserved(self) -> int:
        return (sum(m.resident for m in self.models.values()
                    if m.mode != "paged") + self.cache + self.act)

    # -- the process: command handlers --------------------------------------

    def handle(self, method: str, params: dict) -> dict:
        if method == "model_partial_unload":
            return self._partial_unload(params)
        if method == "model_partial_load":
            return self._partial_load(params)
        if method == "model_to_device":
            return self._to_device(params)
        if method == "full_release":
            return self._full_release()
        if method == "partial_release":
            return self._partial_release(int(params.get("size", 0)))
        if method == "board_bind":
            return {"status": "ok"}
        return {"status": "error", "error": f"unknown method {method}"}

    def _model(self, params: dict) -> WModel | None:
        return self.by_mid.get(params.get("model_id"))

    def _partial_unload(self, params: dict) -> dict:
        m = self._model(params)
        if m is None:
            return {"status": "error",
                    "error": f"Model '{params.get('model_id')}' not "
                             "registered"}
        if m.name in self.own_list:
            before = m.resident
            want = int(params.get("bytes_to_free", 0)) or before
            self.own_unload(m, want)
            self.empty_cache()
            after = m.resident
            return {"status": "ok", "freed": max(0, before - after),
                    "resident": after, "seq": self.bump(m.mid)}
        # a module no patcher holds: a whole-model move, no seq
        if not m.first_param_cuda:
            return {"status": "ok", "freed": 0, "resident": 0}
        self.set_resident(m, 0)
        self.empty_cache()
        return {"status": "ok", "freed": m.size, "resident": 0}

    def _partial_load(self, params: dict) -> dict:
        m = self._model(params)
        if m is None:
            return {"status": "error",
                    "error": f"Model '{params.get('model_id')}' not "
                             "registered"}
        before = m.resident
        want = int(params.get("extra_bytes", 0))
        self.set_resident(m, before + min(want, self.run.card.free()))
        if m.name not in self.own_list:
            self.list_model(m)
        return {"status": "ok", "loaded": m.resident - before,
                "resident": m.resident, "seq": self.bump(m.mid)}

    def _to_device(self, params: dict) -> dict:
        m = self._model(params)
        if m is None:
            return {"status": "error",
                    "error": f"Model '{params.get('model_id')}' not "
                             "registered"}
        target = str(params.get("device", "cpu"))
        on_cuda = m.first_param_cuda
        if (target == "cpu") == (not on_cuda):
            # "already on cpu": compared by the first parameter only
            return {"status": "ok", "device": target, "moved": False,
                    "seq": self.bump(m.mid)}
        if target == "cpu":
            self.set_resident(m, 0)
            self.unlist_model(m)
            self.empty_cache()
        else:
            self.set_resident(m, m.size)
        return {"status": "ok", "device": target, "moved": True,
                "seq": self.bump(m.mid)}

    def _full_release(self) -> dict:
        """memory_manager.full_release: the worker's own unload_all_models
        (its listed models; a pack's plain module stays), then caches."""
        before = self.run.card.used(self.name)
        for name in list(self.own_list):
            self.set_resident(self.models[name], 0)
            self.unlist_model(self.models[name])
        self.empty_cache()
        freed = before - self.run.card.used(self.name)
        frame = self.frame()
        frame["receipt"] = {"freed_bytes": freed}
        return frame

    def _partial_release(self, size: int) -> dict:
        """memory_manager.partial_release: the worker's own free_memory for
        what is free plus `size`, then empty_cache."""
        free_before = self.run.card.free()
        self.own_free(free_before + max(0, size), for_dynamic=False)
        self.empty_cache()
        free_after = self.run.card.free()
        frame = self.frame()
        frame["receipt"] = {"freed_bytes": max(0, free_after - free_before),
                            "free_before": free_before,
                            "free_after": free_after}
        return frame

    # -- the process: its own ComfyUI manager --------------------------------

    def own_unload(self, m: WModel, want: int) -> int:
        """The worker's patcher partially_unload: whole blocks until at
        least `want` is freed."""
        blocks = max(1, math.ceil(want / m.block))
        freed = min(m.resident, blocks * m.block)
        self.set_resident(m, m.resident - freed)
        return freed

    def own_free(self, required: float, for_dynamic: bool,
                 exclude: tuple[str, ...] = ()) -> None:
        """The worker's own free_memory: its listed models, most offloaded
        first; a paged model under for_dynamic is counted, not unloaded."""
        card = self.run.card
        candidates = []
        for i, name in enumerate(self.own_list):
            if name in exclude:
                continue
            m = self.models[name]
            candidates.append((-(m.size - m.resident), m.size, i, name))
        for *_, name in sorted(candidates):
            m = self.models[name]
            if m.mode == "paged" and for_dynamic:
                required -= m.resident
                continue
            to_free = required - card.free()
            if to_free <= 0:
                continue
            if to_free < m.resident:
                if self.own_unload(m, math.ceil(to_free)) >= to_free:
                    continue
            self.set_resident(m, 0)
            self.unlist_model(m)
        self.empty_cache()  # soft_empty_cache after an unload

    def own_load(self, names: list[str], memory_required: int) -> None:
        """The worker's own (real, unshimmed) load_models_gpu."""
        card = self.run.card
        reserve = self.extra_reserved
        inference = 0.8 * GiB + reserve
        extra_mem = max(inference, memory_required + reserve)
        models = [self.models[n] for n in names]
        needed = sum(
            (m.size - m.resident) if m.resident else m.size for m in models
        )
        for_dynamic = all(m.mode == "paged" for m in models)
        self.own_free(needed * 1.1 + extra_mem, for_dynamic)
        if card.free() < extra_mem:
            self.own_free(extra_mem, for_dynamic)
        for m in models:
            if m.mode == "plain":
                continue  # not a ModelPatcher: the pack moves it itself
            self.list_model(m)
            if m.mode == "paged":
                continue  # pages fault in at compute (ModelPatcherDynamic)
            free_now = card.free() + m.resident
            budget = max(0, free_now - extra_mem) - m.resident
            if budget >= m.size - m.resident:
                self.set_resident(m, m.size)
            elif budget > 0:
                grow = budget // m.block * m.block
                self.set_resident(m, m.resident + grow)

    def pager_step(self, used: list[WModel], fraction: float) -> None:
        """comfy-aimdo while a paged model computes: fault `fraction` of
        the missing pages in while the card has room above the pager's
        headroom, dropping the worker's other paged models' pages first."""
        card = self.run.card
        for m in used:
            if m.mode != "paged" or m.resident >= m.size:
                continue
            want = math.ceil((m.size - m.resident) * fraction / PAGE) * PAGE
            room = card.free() - PAGER_HEADROOM
            if room < want:
                for other in self.models.values():
                    if other is m or other.mode != "paged" or other in used:
                        continue
                    drop = min(other.resident, want - room)
                    drop = drop // PAGE * PAGE
                    if drop > 0:
                        self.set_resident(other, other.resident - drop)
                        room += drop
            grow = max(0, min(want, room)) // PAGE * PAGE
            if grow > 0:
                self.set_resident(m, m.resident + grow)

    # -- the board (worker side) ---------------------------------------------

    def note(self, mid: str, value: int) -> None:
        """The census value of `mid` changed now (what a sampler would
        read from now on)."""
        times, values = self.history.setdefault(mid, ([], []))
        now = self.run.clock.now
        if times and times[-1] == now:
            values[-1] = value
        elif not values or values[-1] != value:
            times.append(now)
            values.append(value)

    def bind(self, mid: str) -> int | None:
        """The host's binding of `mid` to a slot (the adapter sends a
        boundary's bindings in one call_module; the publisher's ``bind``
        then publishes synchronously and starts its sampler thread).
        None when the worker publishes nothing."""
        if not self.publishes or not self.alive:
            return None
        tag = len(self.bound) + 1
        self.bound[mid] = (tag, self.run.clock.now)
        if self.next_pass == math.inf:
            self.next_pass = self.run.clock.now
        return tag

    def publish_sync(self) -> None:
        """A synchronous publish on the worker's main thread: a message
        follows it, so the host reads it at once."""
        if not self.publishes or not self.alive or not self.bound:
            return
        now = self.run.clock.now
        for mid in self.bound:
            m = self.by_mid.get(mid)
            if m is not None:
                self.sync[mid] = (self.census_value(m), now)
        self.sync_heartbeat = now

    def in_call(self, t: float) -> bool:
        for a, b in reversed(self.calls):
            if a <= t < b:
                return True
            if b <= t:
                return False
        return False

    def _read_lag(self) -> float:
        u = self.rng.random()
        for (p0, v0), (p1, v1) in zip(READ_LAG, READ_LAG[1:], strict=False):
            if u <= p1:
                return v0 + (v1 - v0) * (u - p0) / (p1 - p0)
        return READ_LAG[-1][1]

    def _sample_until(self, now: float) -> None:
        """The sampler thread's passes up to `now`: each waits for the GIL
        while a call runs, takes PASS_COST, reaches the host after a read
        lag drawn from READ_LAG, and the next starts SAMPLE_PERIOD after
        it ended; none starts inside a blocked window.  Passes more than a
        second before `now` are stepped over at the nominal period (only
        the newest decide a reading)."""
        t = self.next_pass
        passes = self.sampler
        while t <= now:
            for a, b in self.blocked:
                if a <= t < b:
                    t = b
            if t > now:
                break
            limit = now - 1.0
            if t < limit:
                starts = [a for a, _ in self.blocked if t < a <= limit]
                target = min(starts) if starts else limit
                step = SAMPLE_PERIOD + PASS_COST
                t += max(1, math.floor((target - t) / step)) * step
                continue
            wait = (self.rng.uniform(0.0, SWITCH_INTERVAL)
                    if self.in_call(t) else 0.0)
            stamp = t + wait
            end = stamp + PASS_COST
            passes.append((stamp, end + self._read_lag(), end))
            t = end + SAMPLE_PERIOD
        self.next_pass = t
        while len(passes) > 64:
            passes.popleft()

    def value_at(self, mid: str, t: float) -> int:
        times, values = self.history.get(mid, ([], []))
        i = bisect.bisect_right(times, t) - 1
        return values[i] if i >= 0 else 0

    def board_read(self, mid: str, tag: int,
                   now: float) -> tuple[int, float] | None:
        """What the host's Board.read gives for `mid`: (value, measurement
        stamp), or None when the reading is not valid (worker gone, no
        publisher, tag not bound, heartbeat older than the limit)."""
        if not self.alive or not self.publishes:
            return None
        binding = self.bound.get(mid)
        if binding is None or binding[0] != tag:
            return None
        since = binding[1]
        self._sample_until(now)
        last = None
        for stamp, visible, end in reversed(self.sampler):
            if visible <= now:
                last = (stamp, end)
                break
        best: tuple[int, float] | None = None
        if last is not None and last[0] >= since:
            best = (self.value_at(mid, last[0]), last[0])
        heartbeat = max(last[1] if last is not None else -math.inf,
                        self.sync_heartbeat)
        if now - heartbeat > HEARTBEAT_LIMIT:
            return None
        synced = self.sync.get(mid)
        if synced is not None and synced[1] >= since and (
                best is None or synced[1] > best[1]):
            best = synced
        return best


# ---- our stand-in (receipts / boards / oracle) ------------------------------


class _Inner:
    """The stand-in's inner module (ComfyUI weak-references it).  It
    reaches its stand-in through a weak reference, so a stand-in's
    reference count (free_memory's second sort term) is comfy-env's
    patcher's: ties break alike in every column."""

    __slots__ = ("__weakref__", "_ref", "device", "model_lowvram",
                 "lowvram_patch_counter", "current_weight_patches_uuid",
                 "model_offload_buffer_memory")

    def __init__(self, s: OurStandIn, device: Any) -> None:
        self._ref = weakref.ref(s)
        self.device = device
        self.model_lowvram = False
        self.lowvram_patch_counter = 0
        self.current_weight_patches_uuid = None
        self.model_offload_buffer_memory = 0

    @property
    def _s(self) -> OurStandIn:
        s = self._ref()
        if s is None:
            raise SimError("a stand-in's module outlived it")
        return s

    @property
    def model_loaded_weight_memory(self) -> int:
        return self._s._loaded

    @model_loaded_weight_memory.setter
    def model_loaded_weight_memory(self, value: int) -> None:
        self._s._write(int(value), self._s._seq, "assigned")


class OurStandIn:
    """comfy_standin's stand-in (docs/semantics.md, "Receipts" and its
    commands; docs/board.md, "Trust rules") with the change that a
    board's reading wins when it was measured after the receipt was
    written and a moved: False detach writes nothing, in the view of one
    column:

    - ``receipts``: ``loaded_size()`` is the receipt (last echo, census or
      registration);
    - ``boards``: the board's reading when valid and measured after the
      receipt was written, else the receipt;
    - ``oracle``: the truth (the worker's own resident bytes).

    Its eviction paths act on that same figure: nothing resident, no
    command.  A detach reply with ``moved: False`` writes nothing (column
    ``before``: it writes 0, as the type did before docs/semantics.md's
    "Which word wins")."""

    def __init__(self, run: Run, worker: SimWorker, worker_generation: int,
                 model_id: str, model_size: int, load_device: Any,
                 offload_device: Any, kind: str = "other") -> None:
        self._run = run
        self._worker = worker
        self._worker_generation = worker_generation
        self._model_id = model_id
        self.size = int(model_size)
        self.load_device = load_device
        self.offload_device = offload_device
        self.parent = None
        self.clone_base_uuid = object()
        self.eviction_deferred = False
        self.kind = kind
        self.model = _Inner(self, offload_device)
        self._loaded = 0
        self._seq: int | None = None
        self._stamp = run.clock.now
        self._source = "registered"
        self._peak = 0
        self._gone = False
        self._tag: int | None = None

    def __repr__(self) -> str:
        return f"<OurStandIn {self._model_id} {self._source}>"

    # comfy-env's pool reads these off every stand-in
    @property
    def _residency_peak(self) -> int:
        return self._peak

    @property
    def _residency_seq(self) -> int:
        return -1 if self._seq is None else self._seq

    # -- receipts -------------------------------------------------------------

    def _write(self, loaded: int, seq: int | None, source: str) -> None:
        self._loaded = max(0, min(int(loaded), self.size))
        self._seq = seq
        self._stamp = self._run.clock.now
        self._source = source
        self._peak = self._loaded
        self.model.device = (self.load_device if self._loaded
                             else self.offload_device)

    def census(self, resident: int, seq: int | None) -> bool:
        """One census entry: a strictly older seq is dropped; a tie goes
        to the census."""
        if self._gone:
            return False
        if seq is not None and self._seq is not None and seq < self._seq:
            return False
        self._write(resident, self._seq if seq is None else seq, "census")
        return True

    def _gone_path(self) -> None:
        self._gone = True
        self._write(0, self._seq, "worker gone")

    def receipt(self) -> tuple[int, int | None, float, str]:
        return self._loaded, self._seq, self._stamp, self._source

    # -- what ComfyUI reads ---------------------------------------------------

    def loaded_size(self) -> int:
        run = self._run
        if run.view == "oracle":
            return run.true_resident(self._worker, self._model_id)
        if self._gone:
            return 0
        if run.view == "boards" and self._tag is not None:
            reading = self._worker.board_read(self._model_id, self._tag,
                                              run.clock.now)
            if reading is not None and reading[1] > self._stamp:
                return max(0, min(reading[0], self.size))
        return self._loaded

    def model_size(self) -> int:
        return self.size

    def current_loaded_device(self) -> Any:
        return self.model.device

    def is_dynamic(self) -> bool:
        return False

    def is_clone(self, other: Any) -> bool:
        return (isinstance(other, OurStandIn)
                and other._worker is self._worker
                and other._model_id == self._model_id)

    def model_dtype(self) -> None:
        return None

    def model_patches_to(self, *args: Any, **kwargs: Any) -> None:
        return None

    def model_patches_models(self) -> list:
        return []

    def get_nested_additional_models(self) -> list:
        return []

    def lowvram_patch_counter(self) -> int:
        return 0

    # -- commands -------------------------------------------------------------

    def _alive(self) -> bool:
        return self._worker.is_alive()

    def partially_load(self, device_to: Any, extra_memory: float = 0,
                       force_patch_weights: bool = False) -> int:
        if not self._alive():
            raise RuntimeError(f"worker of {self._model_id} is gone")
        want = self.size if not extra_memory or extra_memory >= self.size \
            else int(extra_memory)
        reply = self._worker.send_command(
            "model_partial_load", model_id=self._model_id, extra_bytes=want,
            device=str(device_to))
        self._echo(int(reply.get("resident", 0)), reply.get("seq"))
        return int(reply.get("loaded", 0))

    def _echo(self, resident: int, seq: int | None) -> None:
        self._write(resident, self._seq if seq is None else int(seq),
                    "echo")
        self.eviction_deferred = False

    def partially_unload(self, device_to: Any, memory_to_free: float = 0,
                         force_patch_weights: bool = False) -> int:
        before = self.loaded_size()
        if before <= 0:
            return 0
        if (not memory_to_free or memory_to_free >= before
                or memory_to_free != memory_to_free):
            want = before
        else:
            want = min(before, math.ceil(memory_to_free))
        if not self._alive():
            self._gone_path()
            return before
        if self._run.cannot_take(self._worker):
            self.eviction_deferred = True
            self._pressure(want, 0)
            return 0
        try:
            reply = self._worker.send_command(
                "model_partial_unload", model_id=self._model_id,
                bytes_to_free=want)
        except Exception:  # noqa: BLE001 - the stand-in's eviction contract
            if not self._alive():
                self._gone_path()
                return before
            self.eviction_deferred = True
            self._pressure(want, 0)
            return 0
        freed = int(reply.get("freed", 0))
        resident = reply.get("resident")
        if resident is None:
            resident = max(0, before - freed)
        self._echo(int(resident), reply.get("seq"))
        self._pressure(want, freed)
        return freed

    def _pressure(self, wanted: int, freed: int) -> None:
        if freed < wanted:
            self._run.on_pressure(wanted - freed)

    def detach(self, unpatch_all: bool = True) -> Any:
        if self._gone or self.loaded_size() == 0:
            return self.model
        if not self._alive():
            self._gone_path()
            return self.model
        if self._run.cannot_take(self._worker):
            self.eviction_deferred = True
            return self.model
        try:
            reply = self._worker.send_command(
                "model_to_device", model_id=self._model_id,
                device=str(self.offload_device))
        except Exception as exc:  # noqa: BLE001 - never raises
            if not self._alive():
                self._gone_path()
            elif "not registered" in str(exc):
                self._write(0, self._seq, "worker gone")
            else:
                self.eviction_deferred = True
            return self.model
        if reply.get("moved", True) is False \
                and not self._run.moved_false_zero:
            return self.model  # nothing moved: nothing written
        self._echo(0, reply.get("seq"))
        return self.model

    def clone(self) -> Any:
        raise NotImplementedError("a worker model has no clone")


class OurPool:
    """The parts of comfy_standin.pool.Pool the columns differ by: it holds
    a registered stand-in until ComfyUI unloads it, and at a node boundary
    lists again one ComfyUI dropped while its figure says bytes are there
    (or its eviction was deferred); a dead worker's stand-ins read 0."""

    def __init__(self, run: Run) -> None:
        self.run = run
        # Held through comfy-env's _WORKER_PATCHERS (which keeps every
        # stand-in alive here); weak, so reference counts stay comfy-env's.
        self.held: dict[int, weakref.ref] = {}

    def register(self, s: OurStandIn) -> None:
        insert_loaded(s)
        self.held[id(s)] = weakref.ref(s)

    def _held(self) -> list[OurStandIn]:
        out = []
        for key, ref in list(self.held.items()):
            s = ref()
            if s is None:
                del self.held[key]
            else:
                out.append(s)
        return out

    def boundary(self) -> None:
        for s in self._held():
            if not s._worker.is_alive() and not s._gone:
                s._gone_path()
        listed = {id(e.model) for e in mm.current_loaded_models}
        for s in self._held():
            if s._gone or id(s) in listed:
                continue
            if s.eviction_deferred or s.loaded_size() > 0:
                insert_loaded(s)
                s.eviction_deferred = False
        listed = {id(e.model) for e in mm.current_loaded_models}
        for s in self._held():
            if s._gone or id(s) not in listed:
                del self.held[id(s)]


def insert_loaded(p: Any) -> None:
    """comfy-env's _insert_loaded_model (and comfy_standin.register)."""
    import weakref

    entry = mm.LoadedModel(p)
    entry.currently_used = False
    entry.real_model = weakref.ref(p.model)
    entry.model_finalizer = weakref.finalize(p.model, mm.cleanup_models)
    entry.model_finalizer.atexit = False
    mm.current_loaded_models.insert(0, entry)


# ---- passes and costs -------------------------------------------------------


@dataclass
class Candidate:
    key: str  # "host/NAME" or "WORKER/NAME"
    sort_key: tuple
    seen: int  # loaded_size() the run sorted by (size - offloaded)
    truth: int  # true resident bytes at the pass start
    size: int
    #: why the figure is what it is: "host", or the worker model's
    #: receipt source / "board", and "in call" when its worker was
    #: mid-call, "no board"/"board stale"/"board older" when a board
    #: could not answer
    why: str = ""


@dataclass
class PassResult:
    """One free_memory pass that had to evict, against the oracle: free
    memory's own rule, same candidates and tie-breaks, fed the truth."""

    time: float
    thread: str
    required: float
    free_before: int
    free_after: int
    evicted: dict[str, int]
    oracle_evicted: dict[str, int]
    oracle_free_after: int
    candidates: list[Candidate]
    stalled: float = 0.0
    #: bytes on the card that the pass cannot reach at its start, whoever
    #: read what: weights of worker models no entry lists and the workers'
    #: allocator caches, less (rule 4) what the reclaim after it reaches:
    #: of an idle worker, its cache and its own list's models, up to the
    #: worker's measured unlisted figure (not a module a pack moved
    #: itself)
    unlisted: int = 0
    #: the same, of workers that publish a board
    unlisted_board: int = 0
    #: unlisted_board's bytes by why no entry reached them
    unlisted_why: collections.Counter = field(
        default_factory=collections.Counter)
    #: bytes rule 4's reclaim got back after the pass
    reclaimed: int = 0

    @property
    def excess(self) -> int:
        return max(0, sum(self.evicted.values())
                   - sum(self.oracle_evicted.values()))

    @property
    def short_bytes(self) -> int:
        """What the pass left unfreed that the oracle freed."""
        target = min(self.required, self.oracle_free_after)
        return int(max(0, target - self.free_after))

    @property
    def wrong(self) -> list[str]:
        took = {k for k, n in self.evicted.items() if n > 0}
        oracle = {k for k, n in self.oracle_evicted.items() if n > 0}
        return sorted(took - oracle)

    @property
    def short(self) -> bool:
        return (self.free_after < self.required
                and self.oracle_free_after >= self.required)

    @property
    def regret(self) -> int:
        """Bytes: taken off the card beyond the oracle, plus left unfreed
        where the oracle freed them."""
        return self.excess + self.short_bytes

    @property
    def regrets(self) -> bool:
        return bool(self.regret or self.wrong)


@dataclass
class Costs:
    reload_bytes: int = 0
    cold_bytes: int = 0
    ooms: list[str] = field(default_factory=list)
    stall_prompt: float = 0.0
    stall_other: float = 0.0
    #: eviction commands waiting on a worker in a call on another thread,
    #: on ComfyUI's threads (the prompt's, a route's)
    stall_busy: float = 0.0
    #: commands waiting on a hung worker's reply
    stall_hung: float = 0.0
    stalls: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    column: str
    passes: list[PassResult]
    costs: Costs
    end_time: float
    commands: int = 0


# ---- one run of a workload in one column ------------------------------------


class Run:
    """A workload (bench/regret_workloads.py) played in one column."""

    def __init__(self, workload: dict, column: str, ce: ComfyEnv) -> None:
        if column not in COLUMNS:
            raise SimError(f"unknown column {column!r}")
        self.workload = workload
        self.column = column
        self.ce = ce
        self.rules = COLUMN_RULES[column]
        self.view = self.rules.view
        self.moved_false_zero = self.rules.moved_false_zero
        self.clock = Clock()
        self.thread = "prompt"
        self.prompt_id: str | None = None
        self.costs = Costs()
        self.passes: list[PassResult] = []
        self.pending_asks: list[int] = []
        self.last_ask = -math.inf
        self.logs: list[str] = []
        self.in_pass = False
        self.pass_steps: list[tuple[dict, dict]] = []
        self.pass_stall = 0.0
        self.timed: list[tuple[float, int, dict]] = []
        self.timed_seq = 0
        self.workers: dict[str, SimWorker] = {}
        self.generation = 0
        self.hosts: dict[str, Any] = {}
        self.host_high: dict[str, int] = {}
        self.our_pool = OurPool(self) if column != "comfy-env" else None
        self.next_sweep = self.clock.now + IDLE_SWEEP
        self._stack = contextlib.ExitStack()

    # -- set-up and tear-down -------------------------------------------------

    def __enter__(self) -> Run:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        old = getattr(obj, name)
        setattr(obj, name, value)
        self._stack.callback(setattr, obj, name, old)

    def open(self) -> None:
        card_total = int(self.workload["card"])
        mm.reset(total=card_total, extra_reserved=400 * MiB)
        self.card = mm.sim.card()
        self.card.strict = False
        self._stack.callback(mm.reset)
        original_allocate = self.card.allocate

        def allocate(owner: str, nbytes: int, process: str = "host") -> None:
            if process == "host" and owner in self.hosts and nbytes > 0:
                have = self.card.held(owner)
                high = self.host_high.get(owner, 0)
                self.account_load(int(nbytes), have, high)
                self.host_high[owner] = max(high, have + int(nbytes))
            original_allocate(owner, nbytes, process)

        self.card.allocate = allocate  # type: ignore[method-assign]
        mm.sim.on_query.append(self._on_query)
        self._patch(mm, "free_memory", self._wrap_free_memory(mm.free_memory))
        pool, patcher, sync = self.ce.pool, self.ce.model_patcher, \
            self.ce.state_sync
        for name in ("_WORKER_POOL", "_WORKER_PATCHERS", "_OVERHEAD_REPORTS",
                     "_PIN_REPORTS", "_PIN_REGRESSION_SEEN"):
            getattr(pool, name).clear()
        del pool._STALE_PATCHERS[:]
        self._patch(pool, "_RESERVE_BASE", None)
        self._patch(pool, "_RESERVE_PUBLISHED", 0)
        self._patch(pool, "_OVERHEAD_SEQ", 0)
        self._patch(pool, "time", self.clock)
        self._patch(pool, "_true_device_free", lambda device: self.card.free())
        self._patch(pool, "_current_prompt", lambda: self.prompt_id)
        self._patch(pool, "_log", self.logs.append)
        self._patch(pool, "_forward_reserve_to_aimdo", lambda value: False)
        self._patch(patcher, "_ON_PRESSURE", self.on_pressure)
        quiet = logging.getLogger("comfy_env")
        self._stack.callback(quiet.setLevel, quiet.level)
        quiet.setLevel(logging.CRITICAL)
        if self.column != "comfy-env":
            run = self

            def factory(**kwargs: Any) -> OurStandIn:
                return OurStandIn(run, **kwargs)

            self._patch(patcher, "SubprocessModelPatcher", factory)
            self._patch(sync, "apply_residency", self._our_census)
            self._patch(sync, "apply_peak_raise", lambda p, c: None)
            self._patch(pool, "_insert_loaded_model",
                        self.our_pool.register)
            if self.rules.relist:
                budget = pool._handle_vram_budget

                def handle_vram_budget(*args: Any, **kwargs: Any) -> Any:
                    run.list_again()  # rule 1: before its free_memory
                    return budget(*args, **kwargs)

                self._patch(pool, "_handle_vram_budget", handle_vram_budget)
        self._stack.callback(self._clear_pool)
        self._spawn_all()

    def _clear_pool(self) -> None:
        pool = self.ce.pool
        for name in ("_WORKER_POOL", "_WORKER_PATCHERS", "_OVERHEAD_REPORTS",
                     "_PIN_REPORTS", "_PIN_REGRESSION_SEEN"):
            getattr(pool, name).clear()
        del pool._STALE_PATCHERS[:]

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            mm.sim.on_query.remove(self._on_query)
        for entry in mm.current_loaded_models:
            if entry.model_finalizer is not None:
                entry.model_finalizer.detach()
        del mm.current_loaded_models[:]
        self._stack.close()

    def _spawn_all(self) -> None:
        """ComfyUI's models; workers start at their first call (comfy-env's
        _get_or_create_worker)."""
        for spec in self.workload["hosts"]:
            self.hosts[spec["name"]] = mm.HostModel(
                spec["name"], int(spec["size"]),
                granularity=int(spec.get("granularity", 64 * MiB)))
        for ev in self.workload["events"]:
            if ev["ev"] in ("route", "background", "kill") or (
                    ev["ev"] == "host" and ev.get("thread")):
                self._schedule(ev["t"], ev)

    def _spawn(self, name: str) -> SimWorker:
        spec = next(s for s in self.workload["workers"] if s["name"] == name)
        self.generation += 1
        old = self.workers.get(name)
        worker = SimWorker(self, name, self.generation,
                           [dict(m) for m in spec["models"]],
                           bool(spec.get("publishes", True)),
                           bool(spec.get("torch_cuda", True)))
        pool = self.ce.pool
        if old is not None:
            pool._cleanup_stale_patchers(old.key, old)
        self.workers[name] = worker
        pool._WORKER_POOL[worker.key] = pool.WorkerRecord(
            worker, worker.generation)
        for ev in self.workload["events"]:
            if ev.get("worker") != name:
                continue
            if ev["ev"] == "lag":  # the pack keeps the sampler's thread off
                worker.blocked.append((ev["t"], ev["until"]))
            elif ev["ev"] == "hang" and old is None:
                # a hang is this process's; a new one starts sound
                beats = bool(ev.get("heartbeat", True))
                worker.hangs.append((ev["t"], ev["until"], beats))
                if not beats:
                    worker.blocked.append((ev["t"], ev["until"]))
        return worker

    # -- bytes, time, costs ---------------------------------------------------

    def set_bytes(self, process: str, owner: str, value: int) -> None:
        key = (process, owner)
        if value > 0:
            self.card.allocations[key] = int(value)
        else:
            self.card.allocations.pop(key, None)

    def account_load(self, n: int, have: int, high: int) -> None:
        """`n` bytes of a model come onto the card where it had `have`:
        the part above its high-water `high` is a first load, the rest
        came back over the bus (a reload)."""
        cold = max(0, have + n - max(high, have))
        self.costs.cold_bytes += cold
        self.costs.reload_bytes += n - cold

    def advance(self, seconds: float) -> None:
        """Time spent by the current thread.  Only the prompt thread
        moves the shared clock: other threads run beside it."""
        if self.thread == "prompt":
            self.clock.now += seconds

    def stall(self, seconds: float, why: str, kind: str = "call") -> None:
        """The current thread waits `seconds` on a worker: ``busy`` (an
        eviction command on a worker's lock), ``hung`` (a reply that never
        comes), ``ask`` (comfy-env's idle ask), ``call`` (a node call)."""
        if kind == "busy" and self.thread in ("prompt", "route"):
            self.costs.stall_busy += seconds
        elif kind == "hung":
            self.costs.stall_hung += seconds
        if self.thread == "prompt":
            self.costs.stall_prompt += seconds
            self.clock.now += seconds
        else:
            self.costs.stall_other += seconds
        if self.in_pass:
            self.pass_stall += seconds
        self.costs.stalls.append(f"{self.clock.now:.1f}s {self.thread}: "
                                 f"{why} {seconds:g}s")

    def oom(self, what: str) -> None:
        self.costs.ooms.append(f"{self.clock.now:.1f}s {what}")

    @contextlib.contextmanager
    def on_thread(self, name: str) -> Iterator[None]:
        old, self.thread = self.thread, name
        try:
            yield
        finally:
            self.thread = old

    # -- truth ----------------------------------------------------------------

    def true_resident(self, worker: SimWorker, mid: str) -> int:
        if not worker.alive:
            return 0
        m = worker.by_mid.get(mid)
        return 0 if m is None else m.resident

    def entry_key(self, p: Any) -> tuple[str, int, int]:
        """(model key, size, true resident) of a listed patcher."""
        if isinstance(p, mm.HostModel):
            return f"host/{p.name}", p.size, p.loaded_size()
        worker = p._worker
        m = worker.by_mid.get(p._model_id)
        name = m.name if m is not None else p._model_id
        proc = worker.name
        if self.workers.get(worker.name) is not worker:
            proc = f"{worker.name}~{worker.generation}"  # a dead process
        return (f"{proc}/{name}", p.size,
                self.true_resident(worker, p._model_id))

    def why(self, p: Any) -> str:
        """What a listed patcher's figure comes from (Candidate.why)."""
        if isinstance(p, mm.HostModel):
            return "host"
        worker = p._worker
        parts = []
        if isinstance(p, OurStandIn):
            parts.append(p._source)
            if self.view == "boards":
                if p._tag is None:
                    parts.append("no board")
                else:
                    reading = worker.board_read(p._model_id, p._tag,
                                                self.clock.now)
                    if reading is None:
                        parts.append("board stale")
                    elif reading[1] <= p._stamp:
                        parts.append("board older")
                    else:
                        parts.append("board")
        else:
            parts.append("comfy-env")
        if worker._calls_in_flight:
            parts.append("in call")
        if worker.hung(self.clock.now) is not None:
            parts.append("hung")
        return ", ".join(parts)

    # -- the pressure hook (pool._on_host_pressure, no thread) ----------------

    def on_pressure(self, shortfall: int) -> None:
        now = self.clock.now
        if now - self.last_ask < self.ce.pool.PRESSURE_DEBOUNCE_SECONDS:
            return
        self.last_ask = now
        self.pending_asks.append(int(shortfall))

    def _run_asks(self) -> None:
        asks, self.pending_asks = self.pending_asks, []
        for shortfall in asks:
            with self.on_thread("pressure"):
                self.ce.pool._ask_idle_workers(shortfall)

    # -- our census (state_sync.apply_residency, routed as the adapter does)

    def _our_census(self, patchers: dict, census: list, log: Any = None
                    ) -> list[str]:
        changed = []
        for entry in census or []:
            p = patchers.get(entry.get("id"))
            if not isinstance(p, OurStandIn):
                continue
            before = p._loaded
            if p.census(int(entry.get("resident", 0)), entry.get("seq")) \
                    and p._loaded != before:
                changed.append(entry["id"])
        return changed

    # -- free_memory passes ---------------------------------------------------

    def _snapshot(self) -> dict:
        return dict(self.card.allocations)

    def _on_query(self, card: Any) -> None:
        if not self.in_pass:
            return
        pre = self._snapshot()
        self.pump_residency()
        self.pass_steps.append((pre, self._snapshot()))

    def _wrap_free_memory(self, original: Callable) -> Callable:
        run = self

        def free_memory(memory_required, device, keep_loaded=[],  # noqa: B006
                        for_dynamic=False, pins_required=0, ram_required=0):
            if run.in_pass:
                raise SimError("free_memory inside free_memory")
            start = run._snapshot()
            free0 = run.card.free()
            # No local may keep a patcher during the pass: a reference is
            # free_memory's second sort term.  The list holds every listed
            # one alike, which changes no order.
            listed = [e.model for e in mm.current_loaded_models
                      if e.model is not None and e.device == device
                      and e not in keep_loaded]
            infos = {id(p): (*run.entry_key(p), run.why(p)) for p in listed}
            states = {w.name: _clone_state(w) for w in run.workers.values()}
            reach = {w.name: run.unlisted_of(w) for w in run.workers.values()
                     if run.rules.unlisted and not w._calls_in_flight}
            run.in_pass, run.pass_steps, run.pass_stall = True, [], 0.0
            t0 = run.clock.now
            del mm.free_memory_log[:]
            try:
                out = original(memory_required, device, keep_loaded,
                               for_dynamic, pins_required, ram_required)
            finally:
                run.in_pass = False
            record = mm.free_memory_log[-1]
            judged = None
            if memory_required > free0 and record["candidates"]:
                judged = run._judge(record, memory_required, free0, start,
                                    infos, states, reach, t0)
                run.passes.append(judged)
            short = memory_required - run.card.free()
            if run.rules.unlisted and short > 0:
                got = run.reclaim(short)
                if judged is not None:
                    judged.reclaimed = got
            for log_list in (mm.free_memory_log, mm.unload_log, mm.pins_log,
                             mm.load_log, mm.pin_requests):
                del log_list[:]
            run._run_asks()
            return out

        return free_memory

    def _judge(self, record: dict, required: float, free0: int, start: dict,
               infos: dict, states: dict, reach: dict[str, int], t0: float
               ) -> PassResult:
        end = self._snapshot()
        candidates = []
        by_key = {}
        for sort_key, entry in record["candidates"]:
            p = entry.model
            key, size, truth, why = infos[id(p)]
            seen = size + sort_key[0]
            candidates.append(Candidate(key, sort_key, seen, truth, size,
                                        why))
            by_key[key] = p
        # what the run took: weight bytes that left the card between
        # queries (events happen only inside queries)
        evicted = dict.fromkeys(by_key, 0)
        before = start
        for pre, post in [*self.pass_steps, (end, end)]:
            for (proc, owner), n in before.items():
                if not owner.startswith("w:") and proc != "host":
                    continue
                key = _weight_key(proc, owner)
                if key in evicted:
                    evicted[key] += max(0, n - pre.get((proc, owner), 0))
            before = post
        oracle_evicted, oracle_free = _oracle(
            self, record, candidates, by_key, required, start, states)
        listed_keys = {info[0] for info in infos.values()}
        unlisted = unlisted_board = 0
        why: collections.Counter = collections.Counter()
        for name, worker in self.workers.items():
            if not worker.alive:
                continue
            budget = reach.get(name, 0)
            for n, reason, releasable in self._unreached(
                    worker, start, listed_keys):
                if releasable:  # rule 4's reclaim, up to its figure
                    cut = min(n, budget)
                    budget -= cut
                    n -= cut
                if n <= 0:
                    continue
                unlisted += n
                if worker.publishes:
                    unlisted_board += n
                    why[reason] += n
        return PassResult(
            time=t0, thread=self.thread, required=required,
            free_before=free0, free_after=self.card.free(),
            evicted=evicted, oracle_evicted=oracle_evicted,
            oracle_free_after=oracle_free, candidates=candidates,
            stalled=self.pass_stall, unlisted=unlisted,
            unlisted_board=unlisted_board, unlisted_why=why)

    def _unreached(self, worker: SimWorker, start: dict,
                   listed_keys: set[str]) -> Iterator[tuple[int, str, bool]]:
        """(bytes, why, a release command reaches them) for each of the
        worker's allocations at a pass start that no entry lists."""
        mid_call = worker.call_owner is not None
        patchers = self.ce.pool._WORKER_PATCHERS.get(worker.key, {})
        for (proc, owner), n in start.items():
            if proc != worker.name or n <= 0:
                continue
            if owner == "cache":
                yield n, ("allocator cache, worker in a call" if mid_call
                          else "allocator cache"), True
                continue
            if not owner.startswith("w:") or \
                    _weight_key(proc, owner) in listed_keys:
                continue
            m = worker.models[owner[2:]]
            releasable = m.name in worker.own_list
            p = patchers.get(m.mid) if m.mid is not None else None
            if m.mid is None:
                reason = "never registered"
            elif p is None:
                reason = ("registered in the call in flight: no stand-in "
                          "until its boundary" if mid_call else
                          "registered by a pack's thread or a route: no "
                          "stand-in until the worker's next boundary")
            elif p.loaded_size() > 0:
                reason = "dropped, its figure above 0: not listed again yet"
            else:
                reason = "dropped, its figure 0"
            if not releasable:
                reason += " (a module the pack moves itself)"
            yield n, reason, releasable

    # -- timed events (other threads, residency that moves by itself) ---------

    def _schedule(self, t: float, ev: dict) -> None:
        self.timed_seq += 1
        bisect.insort(self.timed, (float(t), self.timed_seq, ev))

    def pump(self, until: float | None = None) -> None:
        """Run timed events due by `until` (default: now), in order: route
        calls, pack threads, kills, the idle sweep."""
        until = self.clock.now if until is None else until
        while True:
            t_sweep = self.next_sweep
            t_ev = self.timed[0][0] if self.timed else math.inf
            if min(t_sweep, t_ev) > until:
                return
            if t_sweep <= t_ev:
                self.next_sweep += IDLE_SWEEP
                self.clock.now = max(self.clock.now, t_sweep)
                with self.on_thread("sweep"):
                    self.ce.pool._release_idle_workers()
                continue
            t, _, ev = self.timed.pop(0)
            # another thread acts at its own time, beside the prompt's
            self.clock.now = max(self.clock.now, t)
            self._timed_event(ev)

    def pump_residency(self) -> None:
        """Inside a free_memory pass only residency steps run (a pack's
        thread, a pager): nothing that takes ComfyUI's list."""
        now = self.clock.now
        keep = []
        while self.timed and self.timed[0][0] <= now:
            item = self.timed.pop(0)
            if item[2]["ev"] == "step":
                self._timed_event(item[2])
            else:
                keep.append(item)
        for item in keep:
            bisect.insort(self.timed, item)

    def _timed_event(self, ev: dict) -> None:
        what = ev["ev"]
        if what == "route":
            with self.on_thread("route"):
                self.worker_call(ev, route=True)
        elif what == "background":
            t = ev["t"]
            for step in ev["steps"]:
                t += float(step.get("dt", 0.0))
                self._schedule(t, {"ev": "step", "worker": ev["worker"],
                                   "step": step, "t": t})
        elif what == "step":
            worker = self.workers.get(ev["worker"])
            if worker is not None and worker.alive \
                    and worker.hung(self.clock.now) is None:
                with self.on_thread("pack"):
                    self.pack_step(worker, ev["step"], background=True)
        elif what == "kill":
            worker = self.workers.get(ev["worker"])
            if worker is not None:
                worker.kill()
        elif what == "host":
            # ComfyUI's load_models_gpu on another thread (a web route, a
            # second prompt thread); it computes nothing here
            with self.on_thread(ev["thread"]):
                mm.load_models_gpu(
                    [self.hosts[n] for n in ev["models"]],
                    memory_required=int(ev.get("memory_required", 0)))
        else:
            raise SimError(f"unknown timed event {ev!r}")

    # -- the prompt thread ----------------------------------------------------

    def play(self) -> RunResult:
        for ev in self.workload["events"]:
            what = ev["ev"]
            if what in ("route", "background", "kill", "lag", "hang") or (
                    what == "host" and ev.get("thread")):
                continue
            self.wait_until(float(ev["t"]))
            if what == "prompt":
                self.prompt_id = ev["id"]
            elif what == "host":
                self.host_node(ev)
            elif what == "call":
                self.worker_call(ev, route=False)
            elif what == "end":
                pass
            else:
                raise SimError(f"unknown event {ev!r}")
        self.pump()
        return RunResult(self.column, self.passes, self.costs,
                         self.clock.now)

    def wait_until(self, t: float) -> None:
        if t > self.clock.now:
            self.pump(t)
            self.clock.now = t
        self.pump()

    def compute(self, duration: float, act: int, process: str,
                worker: SimWorker | None = None,
                used: list[WModel] | None = None) -> None:
        """A node computes: activations on the card for `duration`, the
        pager faulting pages of `used` paged models in as it goes."""
        if act > 0:
            if worker is not None and self.card.free() < act:
                for m in worker.models.values():
                    if self.card.free() >= act:
                        break
                    if m.mode == "paged" and m.resident:
                        drop = min(m.resident, act - self.card.free())
                        worker.set_resident(m, m.resident - drop)
            if self.card.free() < act:
                self.oom(f"{process}: activations {act / GiB:.2f} GiB, "
                         f"{self.card.free() / GiB:.2f} free")
                act = 0
            if worker is not None:
                worker.set_act(act)
            else:
                self.set_bytes("host", "act", act)
        steps = 8 if (worker is not None and used and any(
            m.mode == "paged" for m in used)) else 1
        end = self.clock.now + duration
        for i in range(steps):
            t = self.clock.now + (end - self.clock.now) / (steps - i)
            self.pump(t)
            self.clock.now = max(self.clock.now, t)
            if worker is not None and used and worker.alive:
                worker.pager_step(used, 1.0 / (steps - i))
        self.pump()
        if worker is not None:
            if worker.alive:
                if worker.torch_cuda:  # the caching allocator keeps it
                    worker.set_cache(worker.cache + worker.act)
                worker.set_act(0)
        else:
            self.set_bytes("host", "act", 0)

    def host_node(self, ev: dict) -> None:
        models = [self.hosts[n] for n in ev["models"]]
        mm.load_models_gpu(models,
                           memory_required=int(ev.get("memory_required", 0)))
        self.compute(float(ev.get("duration", 1.0)), int(ev.get("act", 0)),
                     "host")
        mm.soft_empty_cache()

    def worker_for(self, name: str) -> SimWorker:
        """_get_or_create_worker: a dead worker is replaced (a new
        generation) before its next call."""
        worker = self.workers.get(name)
        if worker is None or not worker.alive:
            worker = self._spawn(name)
        return worker

    def worker_call(self, ev: dict, route: bool) -> None:
        """metadata._call_in_worker (route=False) or the web route's
        _routed_call (route=True)."""
        worker = self.worker_for(ev["worker"])
        hang = worker.hung(self.clock.now)
        if hang is not None:
            self.stall(hang[1] - self.clock.now, f"call to {worker.name} "
                       "(hung)")
        if worker.call_owner is not None:
            # another thread is in a call on this worker: the lock waits
            self.stall(LOCK_WAIT, f"call to {worker.name} (busy)")
            return
        pool, sync = self.ce.pool, self.ce.state_sync
        worker.begin_call()
        worker.call_owner = self.thread
        worker.call_end = self.clock.now + RTT + sum(
            float(step.get("compute", 0.0)) for step in ev["steps"])
        window = [self.clock.now, math.inf]
        worker.calls.append(window)
        worker.new_models_this_call.clear()
        try:
            self.advance(RTT)
            for step in ev["steps"]:
                if not worker.alive:
                    break
                self.worker_step(worker, step)
            if worker.alive:
                if ev.get("empty_cache"):
                    worker.empty_cache()
                worker.harvest(worker.frame())
        finally:
            worker.call_owner = None
            window[1] = self.clock.now
            if not route:
                self.boundary(worker)
            else:
                census = (worker._last_vram_report or {}).get("residency")
                live = dict(pool._WORKER_PATCHERS.get(worker.key, {}))
                with worker._mem_lock:
                    sync.apply_peak_raise(live, census)
            worker.end_call()

    def boundary(self, worker: SimWorker) -> None:
        """comfy-env's node boundary; for our columns followed by the
        pool's (as comfy_standin's adapter wraps it)."""
        pool = self.ce.pool
        report = worker._last_vram_report or {}
        before = {id(p) for p in pool._WORKER_PATCHERS.get(worker.key,
                                                          {}).values()}
        pool._register_new_patchers(worker.key, worker, worker.generation)
        if self.our_pool is None:
            return
        if self.rules.census and report.get("residency"):
            created = {
                mid: p for mid, p in
                pool._WORKER_PATCHERS.get(worker.key, {}).items()
                if id(p) not in before}
            self._our_census(created, report["residency"])
        if self.view == "boards":
            bound = False
            for p in pool._WORKER_PATCHERS.get(worker.key, {}).values():
                if isinstance(p, OurStandIn) and p._tag is None \
                        and p._worker is worker:
                    p._tag = worker.bind(p._model_id)
                    bound = bound or p._tag is not None
            if bound:  # one call_module; the publisher publishes at once
                self.advance(RTT)
                worker.publish_sync()
        self.our_pool.boundary()
        self.list_again()

    def cannot_take(self, worker: SimWorker) -> bool:
        """Rule 5: the worker is in a call on another thread (a command
        would wait on its lock)."""
        if not self.rules.nowait:
            return False
        owner = worker.call_owner
        return worker.alive and owner is not None and owner != self.thread

    def list_again(self) -> None:
        """Rule 1, at a node boundary and before a budget request's
        free_memory: every live stand-in whose model is on the card by its
        newest word that ComfyUI does not list is listed, once."""
        if not self.rules.relist:
            return
        listed = {id(e.model) for e in mm.current_loaded_models}
        for patchers in list(self.ce.pool._WORKER_PATCHERS.values()):
            for p in list(patchers.values()):
                if (isinstance(p, OurStandIn) and id(p) not in listed
                        and not p._gone and p._alive()
                        and p.loaded_size() > 0):
                    self.our_pool.register(p)
                    p.eviction_deferred = False
                    listed.add(id(p))

    def unlisted_of(self, worker: SimWorker) -> int:
        """Rule 4's figure: the held bytes of the worker's last frame less
        what its stand-ins answer."""
        if not worker.alive:
            return 0
        held = worker.held_report
        answered = sum(p.loaded_size() for p in self.ce.pool._WORKER_PATCHERS
                       .get(worker.key, {}).values()
                       if isinstance(p, OurStandIn) and p._worker is worker)
        return max(0, held - answered - worker.reclaimed)

    def reclaim(self, shortfall: float) -> int:
        """Rule 4, after a free_memory that left the card `shortfall`
        bytes short: idle workers with unlisted bytes, most first, each
        asked for what is still missing; a busy one answers "busy" at once.
        Returns the bytes the receipts say came back."""
        want = math.ceil(shortfall)
        got = 0
        holders = sorted(((self.unlisted_of(w), w.name, w)
                          for w in self.workers.values()), reverse=True)
        for unlisted, _, w in holders:
            if got >= want or unlisted <= 0:
                break
            if w._calls_in_flight:
                continue  # a worker in a call serves no release
            try:
                reply = w.send_command_no_spawn(
                    "partial_release", lock_timeout=0.0,
                    size=min(unlisted, want - got))
            except Exception:  # noqa: BLE001 - an ask is best effort
                continue  # a hung worker: comfy-env killed it
            if not isinstance(reply, dict):
                continue
            freed = int((reply.get("receipt") or {}).get("freed_bytes", 0))
            freed = max(0, min(freed, unlisted))
            w.reclaimed += freed
            got += freed
        return got

    def worker_step(self, worker: SimWorker, step: dict) -> None:
        if "load" in step:
            self.shim_load(worker, step["load"],
                           int(step.get("memory_required", 0)))
        elif "compute" in step:
            used = [worker.models[n] for n in step.get("use", [])]
            self.compute(float(step["compute"]), int(step.get("act", 0)),
                         worker.name, worker, used)
        else:
            self.pack_step(worker, step, background=False)

    def pack_step(self, worker: SimWorker, step: dict,
                  background: bool) -> None:
        """What a pack's code does to a module itself (no message)."""
        if "to" in step:
            m = worker.models[step["to"]]
            if step.get("device", "cuda") == "cpu":
                worker.set_resident(m, 0)
                worker.unlist_model(m)
                return
            need = m.size - m.resident
            if need > self.card.free():
                self.oom(f"{worker.name}: {m.name}.to(cuda) "
                         f"{need / GiB:.2f} GiB, "
                         f"{self.card.free() / GiB:.2f} free")
                return
            worker.set_resident(m, m.size)
            worker.register(m)  # the Module.to hook (any thread)
        elif "page" in step:
            m = worker.models[step["page"]]
            if m.name not in worker.own_list:
                worker.list_model(m)  # a forward maps it through its patcher
            target = int(step["bytes"])
            if target > m.resident:
                room = max(0, self.card.free() - PAGER_HEADROOM)
                target = min(target, m.resident + room // PAGE * PAGE)
            worker.set_resident(m, target)
        elif "offload" in step:
            m = worker.models[step["offload"]]
            worker.set_resident(m, 0)
            worker.unlist_model(m)
            worker.empty_cache()
        else:
            raise SimError(f"unknown pack step {step!r}")

    def shim_load(self, worker: SimWorker, names: list[str],
                  memory_required: int) -> None:
        """The worker's shimmed load_models_gpu."""
        pool = self.ce.pool
        models = [worker.models[n] for n in names]
        worker.publish_sync()  # before request_vram_budget
        request = {
            "model_info": [{"size": m.size, "key": m.name,
                            "largest_tensor": m.block} for m in models],
            "total_size": sum(m.size for m in models),
            "pin_state": None,
            "num_streams": self.workload.get("num_streams", NUM_STREAMS),
        }
        self.advance(RTT)
        reply = pool._handle_vram_budget(request, worker_key=worker.key)
        if not worker.alive:
            return
        extra = int(reply.get("extra_reserved_vram") or 0)
        free_dev = reply.get("device_free_bytes")
        if free_dev is not None:
            # the blindness correction: zero on a device-wide platform
            extra += max(0, self.card.free() - int(free_dev))
        worker.extra_reserved = extra
        worker.own_load(names, memory_required)
        for m in models:
            if m.first_param_cuda:
                worker.register(m)  # _register_if_cuda after the shim
        worker.publish_sync()  # after the real load_models_gpu returns


# ---- the oracle -------------------------------------------------------------


def _weight_key(proc: str, owner: str) -> str:
    if proc == "host":
        return f"host/{owner}"
    return f"{proc}/{owner[2:]}"


def _clone_state(w: SimWorker) -> dict:
    """What the oracle needs of a worker to replay commands to it."""
    return {
        "alive": w.alive,
        "busy_owner": w.call_owner,
        "busy_left": w.call_end - w.run.clock.now,
        "hung": w.hung(w.run.clock.now) is not None,
        "own_list": set(w.own_list),
        "models": {m.name: (m.mode, m.block, m.first_param_on_card, m.size)
                   for m in w.models.values()},
    }


def _oracle(run: Run, record: dict, candidates: list[Candidate],
            by_key: dict, required: float, start: dict, states: dict
            ) -> tuple[dict[str, int], int]:
    """free_memory's rule (same candidates, tie-breaks and memory_to_free
    loop) on the true residency, with the same exogenous changes at the
    same step, and each command's effect as the worker would have it."""
    alloc = dict(start)
    total = run.card.total
    order = sorted(
        ((-(c.size - c.truth), *c.sort_key[1:]), c) for c in candidates)
    evicted = dict.fromkeys(by_key, 0)
    steps = run.pass_steps
    busy_thread = run.thread
    dead: set[str] = {n for n, s in states.items() if not s["alive"]}
    cache_freed: set[str] = set()

    def exogenous(k: int) -> None:
        if k >= len(steps):
            return
        pre, post = steps[k]
        for key in set(pre) | set(post):
            delta = post.get(key, 0) - pre.get(key, 0)
            if delta:
                alloc[key] = max(0, alloc.get(key, 0) + delta)
                if alloc[key] == 0:
                    del alloc[key]

    def take(proc: str, owner: str, n: int, key: str) -> int:
        have = alloc.get((proc, owner), 0)
        n = min(have, n)
        if n <= 0:
            return 0
        if have - n:
            alloc[(proc, owner)] = have - n
        else:
            del alloc[(proc, owner)]
        evicted[key] = evicted.get(key, 0) + n
        return n

    def command(proc: str) -> str:
        """'ok', 'fail' (nothing happens) or 'killed' (all bytes go)."""
        st = states.get(proc)
        if st is None or proc in dead:
            return "fail"
        if st["busy_owner"] is not None and st["busy_owner"] != busy_thread \
                and (run.rules.nowait or st["busy_left"] >= LOCK_WAIT):
            return "fail"  # deferred, or the lock wait timed out
        if st["hung"]:
            dead.add(proc)
            for key in [k for k in alloc if k[0] == proc]:
                owner = key[1]
                if owner.startswith("w:"):
                    take(proc, owner, alloc[key], _weight_key(proc, owner))
                else:
                    del alloc[key]
            return "killed"
        if proc not in cache_freed:
            cache_freed.add(proc)
        return "ok"

    def empty_cache(proc: str) -> None:
        alloc.pop((proc, "cache"), None)

    for k, (_, c) in enumerate(order):
        exogenous(k)
        proc, _, name = c.key.partition("/")
        owner = name if proc == "host" else "w:" + name
        loaded = alloc.get((proc, owner), 0)
        free = total - sum(alloc.values())
        to_free = required - free
        if to_free <= 0 or loaded <= 0:
            continue
        if proc == "host":
            grain = by_key[c.key].granularity
            if to_free < loaded:
                blocks = max(1, math.ceil(to_free / grain))
                if take(proc, owner, blocks * grain, c.key) >= to_free:
                    continue
            take(proc, owner, alloc.get((proc, owner), 0), c.key)
            continue
        mode, block, first_on_card, size = states[proc]["models"][name]
        listed = name in states[proc]["own_list"]
        if to_free < loaded:
            outcome = command(proc)
            if outcome == "killed":
                continue
            if outcome == "fail":
                continue  # nothing freed; ComfyUI tries detach: same
            if listed:
                want = math.ceil(to_free)
                blocks = max(1, math.ceil(want / block))
                freed = take(proc, owner, blocks * block, c.key)
                empty_cache(proc)
            else:
                freed = take(proc, owner, loaded, c.key)
                empty_cache(proc)
            if freed >= to_free:
                continue
        loaded = alloc.get((proc, owner), 0)
        if loaded <= 0:
            continue
        outcome = command(proc)
        if outcome != "ok":
            continue
        on_card_first = (loaded >= size or mode != "legacy" or first_on_card)
        if not on_card_first:
            continue  # moved: False
        take(proc, owner, loaded, c.key)
        empty_cache(proc)
    exogenous(len(order))
    return evicted, total - sum(alloc.values())


def run_workload(workload: dict, column: str, ce: ComfyEnv) -> RunResult:
    with Run(workload, column, ce) as run:
        return run.play()
