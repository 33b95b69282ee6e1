"""``python -m comfy_standin demo``: stand-ins under pressure, end to end.

Everything is real except the GPU: two worker processes
(``comfy_standin._demo_worker``) hold fake models and speak comfy-env's
command protocol over pipes; each publishes its models' residency on a
live residency board it made and handed to this process, as a comfy-env
worker does (comfy_standin._handoff); a small ComfyUI-like memory
manager (:class:`MiniModelManagement`, written for the demo, not
ComfyUI's code) lists host models and stand-ins side by side and evicts
with ComfyUI's sort key; a simulated card (:class:`SimCard`) keeps the
bytes.  The card plays the driver: it learns a worker's bytes from what
the worker publishes on its board (every change is published before the
worker replies) and takes back everything of a process that died, so
``get_free_memory`` moves exactly as much as an eviction really returned.

The demo checks its own claims (:class:`Checks`) and exits 0 only when
every one held, including that no board segment and no worker process
outlives it.  It names each glossary term (docs/glossary.md) the first
time it uses it, and explains its own surprising lines.  ``mode="json"``
prints one JSON document instead (each step, each stand-in's answers,
each check); ``mode="quiet"`` only the verdict.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from ._handoff import ENV_VAR, Handoff
from ._text import json_text

MiB = 1 << 20
GiB = 1 << 30

CUDA = "cuda:0"
CPU = "cpu"

#: Seconds a worker may take to answer one request.  A reply that does
#: not come in time is a transport failure on a live worker ("send
#: failed"), never a reason to hang the demo.
REPLY_TIMEOUT = 15.0

#: The board's heartbeat limit.  Generous: the demo's boards must not go
#: stale between two scenes on a slow machine (a stale board only means
#: "use the receipt", but the demo's claims about the board would flap).
HEARTBEAT_LIMIT = 120.0


#: The glossary terms the demo uses, each explained the first time it
#: comes up (the full entries are in docs/glossary.md).
GLOSSARY = {
    "receipt": "what the worker last said a model has on the card; "
               "loaded_size() answers it",
    "board": "a shared-memory page per worker where it publishes its "
             "models' resident bytes; the host reads it without a message",
    "echo": "the residency a command's reply carries; it is written to "
            "the receipt at once",
    "generation": "a worker's restart count; stand-ins of an older "
                  "generation read 0",
    "charge": "what one worker costs the card, as the pool counts it",
    "supremum": "the sum of a worker's model sizes: everything it could "
                "fault in during a call",
    "floor": "a worker process's VRAM before any model (CUDA context), "
             "300 MiB here",
    "census": "a worker's list of its models' resident bytes, sent at a "
              "node boundary; it replaces receipts",
    "reserve": "EXTRA_RESERVED_VRAM: what ComfyUI keeps free on top of "
               "what a load needs",
}

_ANSI = {"ok": "32", "fail": "31;1", "title": "1", "term": "36"}


def paint(text: str, what: str, color: bool) -> str:
    """ANSI colour for a terminal (the caller decides: never with
    NO_COLOR, never when piped)."""
    return f"\033[{_ANSI[what]}m{text}\033[0m" if color else text


def gib(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB"


# ---------------------------------------------------------------------------
# The simulated card


class SimOutOfMemory(RuntimeError):
    pass


class SimCard:
    """One simulated GPU: a total and bytes per (process, owner).

    Host models allocate and release directly.  A worker's bytes are read
    from its board (``track``): the worker publishes each change before it
    replies, so after any reply the card holds what the worker holds, and
    in between (a busy call paging weights in) the card sees what no
    message said.  A dead process's bytes go back to the card at once, as
    the driver takes back a killed process's memory.
    """

    def __init__(self, device: str, total: int) -> None:
        self.device = device
        self.total = total
        self.allocations: dict[tuple[str, str], int] = {}
        # process -> (is_alive, [(owner, board, slot)])
        self._tracked: dict[str, tuple[Callable[[], bool], list]] = {}
        #: process -> bytes the card took back when it died
        self.released_at_exit: dict[str, int] = {}

    def used(self) -> int:
        self.sync()
        return sum(self.allocations.values())

    def free(self) -> int:
        return self.total - self.used()

    def allocate(self, process: str, owner: str, nbytes: int) -> None:
        if nbytes > self.free():
            raise SimOutOfMemory(
                f"{self.device}: {process}/{owner} asked {gib(nbytes)}, "
                f"{gib(self.free())} free"
            )
        key = (process, owner)
        self.allocations[key] = self.allocations.get(key, 0) + nbytes

    def release(self, process: str, owner: str, nbytes: int) -> int:
        key = (process, owner)
        have = self.allocations.get(key, 0)
        n = min(have, nbytes)
        self.allocations[key] = have - n
        return n

    def track(
        self, process: str, is_alive: Callable[[], bool], owner: str,
        board: Any, slot: int,
    ) -> None:
        entry = self._tracked.setdefault(process, (is_alive, []))
        entry[1].append((owner, board, slot))

    def sync(self) -> None:
        for process, (is_alive, owners) in list(self._tracked.items()):
            if not is_alive():
                freed = 0
                for key in [k for k in self.allocations if k[0] == process]:
                    freed += self.allocations.pop(key)
                self.released_at_exit[process] = (
                    self.released_at_exit.get(process, 0) + freed
                )
                del self._tracked[process]
                continue
            for owner, board, slot in owners:
                reading = board.read(slot)
                if reading is not None:
                    self.allocations[(process, owner)] = reading[0]


# ---------------------------------------------------------------------------
# A worker process behind a pipe


class WorkerError(RuntimeError):
    """The worker replied with an error (comfy-env's send_command raises)."""


class PipeWorker:
    """The host's handle on one worker process: comfy-env's
    ``send_command(method, **params) -> dict``, ``is_alive()`` and
    ``send_command_no_spawn(method, lock_timeout, **params)`` (``"busy"``
    when another thread's command holds the pipe, ``"dead"``)."""

    def __init__(self, name: str, handoff: Handoff) -> None:
        self.name = name
        self.board: Any = None
        self._buffer = b""
        # One command on the pipe at a time (comfy-env's _lock: an RLock).
        self._lock = threading.RLock()
        #: Called with (method, params, reply or error) for each command
        #: when the demo runs with --verbose.
        self.trace: Callable[[str, dict, Any], None] | None = None
        # The worker makes its board (a memfd only it can write) and sends
        # it over the handoff named in its environment only.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "comfy_standin._demo_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            # Its own session: Ctrl-C at the terminal reaches the host
            # only, which then ends the worker itself (no second
            # traceback from the worker).
            start_new_session=True,
            env={**os.environ, ENV_VAR: handoff.spec},
        )

    def wait_ready(self) -> None:
        """The worker's greeting: it has sent its board."""
        hello = self._read_reply()
        if hello.get("pid") != self.process.pid:
            raise WorkerError(
                f"worker {self.name}: unexpected greeting {hello!r}"
            )

    def __repr__(self) -> str:
        return f"<demo worker {self.name} pid {self.pid}>"

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def _read_reply(self) -> dict[str, Any]:
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + REPLY_TIMEOUT
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"worker {self.name}: no reply within {REPLY_TIMEOUT} s"
                )
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ConnectionError(f"worker {self.name}: pipe closed")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def send_command(self, method: str, **params: Any) -> dict[str, Any]:
        with self._lock:
            return self._send(method, params)

    def send_command_no_spawn(self, method: str, lock_timeout: float = 2.0,
                              **params: Any) -> Any:
        if not self.is_alive():
            return "dead"
        if not self._lock.acquire(timeout=lock_timeout):
            return "busy"
        try:
            return self._send(method, params)
        finally:
            self._lock.release()

    def _send(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if not self.is_alive():
            raise ConnectionError(f"worker {self.name} is not running")
        request = json.dumps({"method": method, "params": params}) + "\n"
        try:
            self.process.stdin.write(request.encode())
        except (BrokenPipeError, OSError) as exc:
            raise ConnectionError(f"worker {self.name}: {exc}") from exc
        reply = self._read_reply()
        if self.trace is not None:
            self.trace(method, params, reply)
        if reply.get("status") != "ok":
            raise WorkerError(
                f"worker {self.name}: {method}: {reply.get('error')}"
            )
        return reply

    def kill(self) -> int:
        """SIGKILL and reap: afterwards ``is_alive()`` is False."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        code = self.process.wait(timeout=REPLY_TIMEOUT)
        # Reaped: the host knows it is dead, so its board says so at once
        # (reads do no liveness system call of their own).
        if self.board is not None:
            self.board.worker_gone()
        return code

    def shut_down(self) -> None:
        """Ask it to exit, and make sure it did."""
        if self.process.poll() is None:
            with contextlib.suppress(Exception):
                self.send_command("exit")
            try:
                self.process.wait(timeout=REPLY_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()


# ---------------------------------------------------------------------------
# Host models: a fake ComfyUI ModelPatcher


class HostModule:
    """The inner module of a host model (weak-referenceable)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.device = CPU
        self.model_loaded_weight_memory = 0


class HostModel:
    """A model that lives in this process: its bytes are on the card."""

    BLOCK = 64 * MiB

    def __init__(self, name: str, size: int, kind: str, card: SimCard):
        self.name = name
        self.size = size
        self.kind = kind
        self.card = card
        self.load_device = CUDA
        self.offload_device = CPU
        self.parent = None
        self.clone_base_uuid = uuid.uuid4()
        self.model = HostModule(name)
        self._loaded = 0

    def __repr__(self) -> str:
        return f"<HostModel {self.name}>"

    def _set(self, n: int) -> None:
        self._loaded = n
        self.model.model_loaded_weight_memory = n
        self.model.device = self.load_device if n else self.offload_device

    def model_size(self) -> int:
        return self.size

    def loaded_size(self) -> int:
        return self._loaded

    def current_loaded_device(self) -> str:
        return self.model.device

    def is_dynamic(self) -> bool:
        return False

    def is_clone(self, other: object) -> bool:
        return other is self

    def model_dtype(self) -> None:
        return None

    def model_patches_to(self, device: Any) -> None:
        return None

    def model_patches_models(self) -> list:
        return []

    def get_nested_additional_models(self) -> list:
        return []

    def partially_load(self, device_to, extra_memory=0, force=False) -> int:
        want = int(min(self.size - self._loaded, extra_memory))
        self.card.allocate("host", self.name, want)
        self._set(self._loaded + want)
        return want

    def partially_unload(self, device_to, memory_to_free=0, force=False):
        blocks = -(-int(memory_to_free) // self.BLOCK)
        freed = self.card.release(
            "host", self.name, min(self._loaded, blocks * self.BLOCK)
        )
        self._set(self._loaded - freed)
        return freed

    def detach(self, unpatch_all=True):
        self.card.release("host", self.name, self._loaded)
        self._set(0)
        return self.model


# ---------------------------------------------------------------------------
# A ComfyUI-like memory manager (the demo's own, not ComfyUI's code)


@dataclass
class Eviction:
    """One ``model_unload`` call inside ``free_memory``."""

    name: str
    memory_to_free: int
    steps: list[tuple[str, int]] = field(default_factory=list)
    left_list: bool = False
    card_got_back: int = 0
    error: str | None = None
    #: What happened while this eviction ran, in order: ("log", a line
    #: comfy_standin logged) and, with --verbose, ("wire", a command).
    notes: list[tuple[str, str]] = field(default_factory=list)

    @property
    def log(self) -> list[str]:
        return [text for kind, text in self.notes if kind == "log"]

    @property
    def returned(self) -> int:
        return sum(n for _, n in self.steps)


@dataclass
class Candidate:
    """What ComfyUI saw of one entry when it sorted."""

    name: str
    kind: str
    size: int
    receipt: int
    board: int | None
    board_status: str
    key: tuple
    receipt_key: tuple


@dataclass
class FreeMemoryRun:
    memory_required: int
    free_before: int
    candidates: list[Candidate]
    evictions: list[Eviction]
    free_after: int = 0
    errors: list[str] = field(default_factory=list)


class LoadedModel:
    """An entry of ``current_loaded_models``, as ComfyUI's LoadedModel:
    a weak reference to the patcher, ``currently_used``, the finalizer
    on the inner module, and model_unload's partial-then-detach ladder."""

    def __init__(self, mm: MiniModelManagement, model: Any) -> None:
        self._mm = mm
        self._model = weakref.ref(model)
        self.device = model.load_device
        self.real_model = None
        self.currently_used = True
        self.model_finalizer = None

    @property
    def model(self) -> Any:
        return self._model()

    def model_memory(self) -> int:
        return self.model.model_size()

    def model_loaded_memory(self) -> int:
        return self.model.loaded_size()

    def model_offloaded_memory(self) -> int:
        return self.model.model_size() - self.model.loaded_size()

    def model_load(self, budget: float = 0) -> Any:
        patcher = self.model
        patcher.model_patches_to(self.device)
        patcher.model_patches_to(patcher.model_dtype())
        patcher.partially_load(self.device, budget or 1e32)
        inner = patcher.model
        self.real_model = weakref.ref(inner)
        self.model_finalizer = weakref.finalize(inner, self._mm.cleanup_models)
        self.model_finalizer.atexit = False
        return inner

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        patcher = self.model
        record = self._mm._current_eviction
        loaded = patcher.loaded_size()
        if memory_to_free is not None and memory_to_free < loaded:
            freed = patcher.partially_unload(
                patcher.offload_device, memory_to_free
            )
            if record is not None:
                record.steps.append(("partially_unload", freed))
            if freed >= memory_to_free:
                return False
        before = patcher.loaded_size()
        patcher.detach(unpatch_weights)
        if record is not None:
            record.steps.append(("detach", before - patcher.loaded_size()))
        # ComfyUI detaches the finalizer unconditionally and the entry
        # leaves the list even when detach freed nothing.
        self.model_finalizer.detach()
        self.model_finalizer = None
        self.real_model = None
        return True

    def is_dead(self) -> bool:
        return (
            self.real_model is not None
            and self.real_model() is not None
            and self.model is None
        )


class MiniModelManagement:
    """What ``comfy_standin.register`` and the demo need of
    ``comfy.model_management``: ``LoadedModel``, ``current_loaded_models``,
    ``cleanup_models``, ``get_free_memory`` and ``free_memory`` with
    ComfyUI's candidate sort key and ``memory_to_free`` recomputed from
    the card before every candidate."""

    def __init__(self, card: SimCard, describe: Callable[[Any], tuple]):
        self.card = card
        self.current_loaded_models: list[LoadedModel] = []
        self.EXTRA_RESERVED_VRAM = 400 * MiB
        self._describe = describe
        self._current_eviction: Eviction | None = None

    # Named like upstream's class: register() calls mm.LoadedModel(s).
    def LoadedModel(self, model: Any) -> LoadedModel:  # noqa: N802
        return LoadedModel(self, model)

    def cleanup_models(self) -> None:
        self.current_loaded_models[:] = [
            e for e in self.current_loaded_models
            if e.real_model is None or e.real_model() is not None
        ]

    def minimum_inference_memory(self) -> int:
        return int(0.8 * GiB) + self.EXTRA_RESERVED_VRAM

    def get_free_memory(self, device: str) -> int:
        return self.card.free()

    def load_host_model(self, patcher: HostModel, budget: int = 0) -> None:
        entry = self.LoadedModel(patcher)
        entry.model_load(budget)
        self.current_loaded_models.insert(0, entry)

    def free_memory(
        self, memory_required: int, device: str, keep_loaded: Iterable = ()
    ) -> FreeMemoryRun:
        keep = list(keep_loaded)
        run = FreeMemoryRun(
            memory_required, self.get_free_memory(device), [], []
        )
        can_unload = []
        for i, entry in enumerate(self.current_loaded_models):
            if entry.device != device or entry in keep or entry.is_dead():
                continue
            entry.currently_used = False
            # ComfyUI's key, ascending: the most-offloaded model first
            # (cheapest to finish), then the fewest references, then size.
            key = (
                -entry.model_offloaded_memory(),
                sys.getrefcount(entry.model),
                entry.model_memory(),
                i,
            )
            can_unload.append(key)
            name, kind, receipt, board, status = self._describe(entry.model)
            run.candidates.append(
                Candidate(
                    name, kind, key[2], receipt, board, status, key,
                    (-(key[2] - receipt),) + key[1:],
                )
            )
        unloaded = []
        for key in sorted(can_unload):
            i = key[-1]
            memory_to_free = memory_required - self.get_free_memory(device)
            if memory_to_free <= 0:
                continue
            entry = self.current_loaded_models[i]
            record = Eviction(self._describe(entry.model)[0], memory_to_free)
            self._current_eviction = record
            before = self.card.free()
            try:
                if entry.model_unload(memory_to_free):
                    unloaded.append(i)
                    record.left_list = True
            except Exception as exc:  # noqa: BLE001 - the demo's check
                record.error = f"{type(exc).__name__}: {exc}"
                run.errors.append(record.error)
                traceback.print_exc()
            finally:
                self._current_eviction = None
            record.card_got_back = self.card.free() - before
            run.evictions.append(record)
        for i in sorted(unloaded, reverse=True):
            self.current_loaded_models.pop(i)
        run.free_after = self.get_free_memory(device)
        return run


# ---------------------------------------------------------------------------
# Checks


class Checks:
    def __init__(self, out: TextIO, color: bool = False) -> None:
        self.out = out
        self.color = color
        self.results: list[tuple[bool, str]] = []
        #: Every check with the step it was made in (``--json``).
        self.records: list[dict[str, Any]] = []
        self.step = ""

    def check(self, ok: bool, claim: str) -> bool:
        self.results.append((bool(ok), claim))
        self.records.append({"ok": bool(ok), "claim": claim,
                             "step": self.step})
        mark = (paint("ok  ", "ok", self.color) if ok
                else paint("FAIL", "fail", self.color))
        print(f"  [{mark}] {claim}", file=self.out)
        return bool(ok)

    @property
    def failed(self) -> list[str]:
        return [claim for ok, claim in self.results if not ok]


# ---------------------------------------------------------------------------
# The scenario


def _version() -> str:
    return importlib.import_module("comfy_standin").__version__


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside are delivered on the way
    out, to whatever handler was in place (in the main thread only)."""
    pending: list[int] = []
    wanted = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {s: signal.signal(s, lambda n, f: pending.append(n))
                    for s in wanted}
    except ValueError:  # not the main thread: signals are not ours
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])


def _board_leftovers(names: list[str]) -> list[str]:
    """Boards of this demo still reachable: on Linux a descriptor or a
    mapping of one of its memfds in this process; elsewhere a name in
    /dev/shm."""
    left = []
    if sys.platform.startswith("linux"):
        labels = {n.removeprefix("memfd:") for n in names}
        seen = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                seen.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
        with open("/proc/self/maps") as maps:
            seen.extend(maps.read().splitlines())
        for label in labels:
            if any(label in line for line in seen):
                left.append(label)
        return left
    return [n for n in names if os.path.exists("/dev/shm/" + n.lstrip("/"))]


class Demo:
    def __init__(self, impl_name: str, out: TextIO,
                 color: bool = False, verbose: bool = False) -> None:
        self.impl_name = impl_name
        self.impl = (
            importlib.import_module("comfy_standin")
            if impl_name == "c"
            else importlib.import_module("comfy_standin._reference")
        )
        self.board_type = importlib.import_module("comfy_standin._core").Board
        self.out = out
        self.color = color
        self.verbose = verbose
        self.checks = Checks(out, color)
        #: What ``--json`` prints: one entry per step (scene).
        self.steps: list[dict[str, Any]] = []
        self.defined: set[str] = set()
        self.card = SimCard(CUDA, 12 * GiB)
        self.mm = MiniModelManagement(self.card, self.describe)
        self.pool = self.impl.Pool(process_local=False)
        self.pressure_calls: list[int] = []
        self.pool.on_pressure = self.pressure_calls.append
        self.workers: dict[str, PipeWorker] = {}
        self.boards: list[Any] = []
        self.board_names: list[str] = []
        # One strong reference per model, so ComfyUI's refcount term in
        # the sort key is the same for every entry.
        self.models: dict[str, Any] = {}
        self.kinds: dict[str, str] = {}

    # -- printing -------------------------------------------------------

    def say(self, text: str = "") -> None:
        print(text, file=self.out)
        if self.steps and text:
            self.steps[-1]["lines"].append(text)

    def title(self, text: str) -> None:
        self.steps.append({"title": text, "lines": [], "glossary": {},
                           "models": [], "free_memory": []})
        self.checks.step = text
        print(file=self.out)
        print(paint(f"== {text} ==", "title", self.color), file=self.out)

    def trace_command(self, method: str, params: dict, reply: Any) -> None:
        """--verbose: each command to a worker and its reply (inside an
        eviction, printed under its row, as ``log`` does)."""
        shown = {k: v for k, v in params.items() if k != "models"}
        line = f"{method} {shown} -> {reply}"
        eviction = self.mm._current_eviction
        if eviction is not None:
            eviction.notes.append(("wire", line))
        else:
            self.say(f"    [wire] {line}")

    def define(self, *terms: str) -> None:
        """Names a glossary term the first time the demo uses it."""
        for term in terms:
            if term in self.defined:
                continue
            self.defined.add(term)
            if self.steps:
                self.steps[-1]["glossary"][term] = GLOSSARY[term]
            print(f"  {paint(term, 'term', self.color)} "
                  f"(docs/glossary.md): {GLOSSARY[term]}", file=self.out)

    def log(self, message: str) -> None:
        """A line comfy_standin logged.  Written inside an eviction, it
        belongs to that eviction and is printed under its row in the
        table of what ComfyUI chose (after the table, as it happened
        during the choice); anywhere else, at once."""
        eviction = self.mm._current_eviction
        if eviction is not None:
            eviction.notes.append(("log", message))
        else:
            self.say(f"  [log] {message}")

    # -- views ----------------------------------------------------------

    def name_of(self, patcher: Any) -> str:
        if isinstance(patcher, HostModel):
            return patcher.name
        return patcher.model_id

    def receipt_of(self, s: Any) -> tuple:
        """The stand-in's receipt alone (what the worker last *said*):
        the board is set aside for the read, then put back."""
        attached = s.board
        if attached is None:
            return s.receipt()
        s.detach_board()
        try:
            return s.receipt()
        finally:
            s.attach_board(*attached)

    def board_of(self, s: Any) -> tuple[int | None, str]:
        attached = s.board
        if attached is None:
            return None, "no board"
        board, slot = attached
        status = board.status(slot, s.size)
        reading = board.read(slot, s.size)
        return (None if reading is None else reading[0]), status

    def describe(self, patcher: Any) -> tuple:
        """(name, kind, loaded per receipt, per board, board status)."""
        if isinstance(patcher, HostModel):
            return (patcher.name, patcher.kind, patcher.loaded_size(),
                    None, "host")
        board, status = self.board_of(patcher)
        return (patcher.model_id, "worker " + patcher.kind,
                self.receipt_of(patcher)[0], board, status)

    def print_models(self) -> None:
        self.say(
            f"  card {CUDA}: {gib(self.card.total)} total, "
            f"{gib(self.card.free())} free"
        )
        self.say(f"  {'model':<10} {'kind':<12} {'size':>10} "
                 f"{'receipt':>10} {'board':>12}  loaded_size()  source")
        table = []
        for name, patcher in self.models.items():
            _, kind, receipt, board, status = self.describe(patcher)
            if isinstance(patcher, HostModel):
                source = "host"
            else:
                source = patcher.receipt()[3]
            table.append({
                "model": name, "kind": kind, "host": isinstance(
                    patcher, HostModel),
                "model_size": patcher.model_size(),
                "loaded_size": patcher.loaded_size(),
                "current_loaded_device": str(
                    patcher.current_loaded_device()),
                "receipt": receipt, "board": board,
                "board_status": status, "source": source,
            })
            shown = gib(board) if board is not None else f"({status})"
            if isinstance(patcher, HostModel):
                shown = "-"
            self.say(
                f"  {name:<10} {kind:<12} {gib(patcher.model_size()):>10} "
                f"{gib(receipt):>10} {shown:>12}  "
                f"{gib(patcher.loaded_size()):>13}  {source}"
            )
        if self.steps:
            self.steps[-1]["models"].append({
                "card_total": self.card.total,
                "card_free": self.card.free(), "models": table,
            })

    def print_run(self, run: FreeMemoryRun, short_because: str = "") -> None:
        """Prints what ComfyUI saw and chose; `short_because` says why,
        when free_memory ends short of its request."""
        self.say(
            f"  free_memory({gib(run.memory_required)}, {CUDA}): "
            f"{gib(run.free_before)} free before"
        )
        self.say("  what ComfyUI saw (sorted ascending by key):")
        self.say(f"    {'entry':<10} {'kind':<12} {'size':>10} "
                 f"{'receipt':>10} {'board':>12}  "
                 f"key (-offloaded, refcount, size, index)")
        for c in sorted(run.candidates, key=lambda c: c.key):
            off, refs, size, index = c.key
            board = gib(c.board) if c.board is not None else (
                "-" if c.board_status == "host" else f"({c.board_status})")
            self.say(
                f"    {c.name:<10} {c.kind:<12} {gib(c.size):>10} "
                f"{gib(c.receipt):>10} {board:>12}  "
                f"({gib(off)}, {refs}, {gib(size)}, {index})"
            )
        first = min(run.candidates, key=lambda c: c.key, default=None)
        first_r = min(run.candidates, key=lambda c: c.receipt_key,
                      default=None)
        if first is not None and first_r is not None and first is not first_r:
            self.say(
                f"  with receipts only, ComfyUI would have taken "
                f"{first_r.name} first (it looked "
                f"{gib(-first_r.receipt_key[0])} offloaded); the board "
                f"put {first.name} first"
            )
        self.say("  what it chose:")
        if not run.evictions:
            self.say("    nothing (enough was free)")
        for e in run.evictions:
            steps = ", ".join(f"{what} -> {gib(n)}" for what, n in e.steps)
            self.say(
                f"    {e.name:<10} asked {gib(e.memory_to_free):>10}: "
                f"{steps or 'nothing sent'}; "
                f"{'left the list' if e.left_list else 'stays listed'}; "
                f"card got back {gib(e.card_got_back)}"
                + (f"; RAISED {e.error}" if e.error else "")
            )
            for kind, text in e.notes:
                self.say(f"      [{kind}] {text}")
        self.say(f"  free after: {gib(run.free_after)}")
        short = run.free_after < run.memory_required
        if short:
            self.say(
                f"  free_memory ended short of its request: "
                f"{gib(run.free_after)} free of {gib(run.memory_required)} "
                f"asked. It evicts only what its candidates give back, then "
                f"stops (ComfyUI's load_models_gpu then asks once more for "
                f"just its minimum and loads what fits, a partial low-VRAM "
                f"load). Here: {short_because or 'see above'}"
            )
        if self.steps:
            self.steps[-1]["free_memory"].append({
                "memory_required": run.memory_required,
                "free_before": run.free_before,
                "free_after": run.free_after,
                "ended_short": short,
                "candidates": [
                    {"name": c.name, "kind": c.kind, "size": c.size,
                     "receipt": c.receipt, "board": c.board,
                     "board_status": c.board_status, "key": list(c.key)}
                    for c in sorted(run.candidates, key=lambda c: c.key)
                ],
                "evictions": [
                    {"name": e.name, "memory_to_free": e.memory_to_free,
                     "steps": [list(step) for step in e.steps],
                     "returned": e.returned, "left_list": e.left_list,
                     "card_got_back": e.card_got_back, "error": e.error,
                     "log": e.log}
                    for e in run.evictions
                ],
            })

    # -- building blocks ------------------------------------------------

    def start_worker(self, name: str) -> PipeWorker:
        # Ctrl-C or SIGTERM between spawning a worker and recording it
        # would leave a process nobody ends: they wait for the record.
        with Handoff() as handoff:
            with signals_deferred():
                worker = PipeWorker(name, handoff)
                self.workers[name] = worker  # cleaned up even if never greets
            if self.verbose:
                worker.trace = self.trace_command
            worker.wait_ready()
            # It greeted after sending: the board is waiting on the socket.
            board, _, _ = handoff.collect(worker.pid, lambda fd: (
                self.board_type.adopt(fd, 8, generation=1,
                                      heartbeat_limit=HEARTBEAT_LIMIT)))
        self.boards.append(board)
        self.board_names.append(board.name)
        worker.board = board
        board.expected_owner = worker.pid
        if self.verbose:
            self.say(f"    [board] {board.name} for {name}")
        return worker

    def add_worker_models(self, worker: PipeWorker, specs: list) -> None:
        reply = worker.send_command("make_models", models=specs)
        for new in reply["_new_models"]:
            s = self.impl.StandIn(
                worker=worker, worker_generation=1, model_id=new["id"],
                model_size=new["size"], load_device=CUDA,
                offload_device=CPU, kind=new["kind"], pool=self.pool,
            )
            slot = s.attach_board(worker.board)
            # The slot's tag is the host's: the worker publishes under it.
            worker.send_command("board_bind", model_id=s.model_id,
                                slot=slot, tag=worker.board.tag(slot))
            self.card.track(worker.name, worker.is_alive, s.model_id,
                            worker.board, slot)
            self.impl.register(self.mm, s)
            self.models[s.model_id] = s

    def add_host_model(self, name: str, size: int, kind: str,
                       budget: int = 0) -> HostModel:
        model = HostModel(name, size, kind, self.card)
        self.models[name] = model
        self.mm.load_host_model(model, budget)
        return model

    def entry_of(self, patcher: Any) -> LoadedModel | None:
        for entry in self.mm.current_loaded_models:
            if entry.model is patcher:
                return entry
        return None

    def others_than(self, worker: PipeWorker) -> list:
        return [e for e in self.mm.current_loaded_models
                if getattr(e.model, "worker", None) is not worker]

    def check_run(self, run: FreeMemoryRun, label: str) -> None:
        c = self.checks
        c.check(not run.errors, f"{label}: no exception escaped free_memory")
        for e in run.evictions:
            c.check(
                e.returned == e.card_got_back,
                f"{label}: {e.name} said {gib(e.returned)} freed, the card "
                f"got back {gib(e.card_got_back)}",
            )

    # -- the scenes -----------------------------------------------------

    def run(self) -> None:
        """The story, one method per section."""
        self.introduce()
        a, b = self.load()
        self.busy_call(b)
        self.pressure(b)
        self.worker_killed(b)
        self.worker_refuses(a)

    def introduce(self) -> None:
        self.say(
            f"comfy_standin {_version()}"
            f" demo, implementation: {self.impl_name} "
            f"({self.impl.__name__}.StandIn), simulated card "
            f"{gib(self.card.total)}"
        )
        self.say("Each term of docs/glossary.md is explained the first "
                 "time it comes up.")

    def load(self) -> tuple[PipeWorker, PipeWorker]:
        """1: host models, and two workers whose stand-ins load."""
        c = self.checks
        self.title("1. load: host models, and two workers over pipes")
        a = self.start_worker("A")
        b = self.start_worker("B")
        self.say(f"  worker A pid {a.pid}, board {a.board.name}; "
                 f"worker B pid {b.pid}, board {b.board.name} "
                 f"(made by each worker, sealed so only it can write, sent "
                 f"to the host and mapped read-only there)")
        self.add_host_model("clip", 2 * GiB, "clip")
        self.add_host_model("vae", 1 * GiB, "vae")
        self.add_worker_models(a, [
            {"id": "A/unet", "size": 4 * GiB, "kind": "unet"},
            {"id": "A/lora", "size": GiB // 2, "kind": "lora"},
        ])
        self.add_worker_models(b, [
            {"id": "B/unet", "size": 3 * GiB, "kind": "unet"},
        ])
        loaded = {
            "A/unet": self.models["A/unet"].partially_load(CUDA, 2.5 * GiB),
            "A/lora": self.models["A/lora"].partially_load(CUDA, 1e32),
            "B/unet": self.models["B/unet"].partially_load(CUDA, 1 * GiB),
        }
        self.say("  each worker's stand-ins are registered for its "
                 "generation 1 (a restarted worker's old ones read 0)")
        self.define("generation")
        self.say("  the table: size = model_size(); receipt = what the "
                 "worker's last reply (an echo) said; board = what it "
                 "publishes now; loaded_size() = what ComfyUI reads")
        self.define("receipt", "echo", "board")
        self.print_models()
        for name, n in loaded.items():
            c.check(self.models[name].loaded_size() == n,
                    f"{name}: partially_load returned {gib(n)} and the "
                    f"receipt says so")
        return a, b

    def busy_call(self, b: PipeWorker) -> None:
        """2: a call pages B's unet in; only the board says so."""
        c = self.checks
        self.title("2. a busy call: B pages its unet in, no message says so")
        unet_b = self.models["B/unet"]
        receipt_before = self.receipt_of(unet_b)[0]
        with self.pool.call(b):
            frame = b.send_command("call_begin", model_id="B/unet",
                                   resident=3 * GiB)
            self.say(f"  B replied with a progress frame: {frame!r}")
            self.print_models()
            board_now, status = self.board_of(unet_b)
            c.check(
                board_now == 3 * GiB and self.receipt_of(unet_b)[0]
                == receipt_before and board_now != receipt_before,
                f"during the call the board says {gib(board_now)} "
                f"({status}), the receipt still {gib(receipt_before)}",
            )
            c.check(unet_b.loaded_size() == 3 * GiB,
                    "loaded_size() reads the board during the call")
            charge = self.pool.worker_charges()[b]
            self.define("charge", "supremum", "floor")
            c.check(
                charge == unet_b.size + self.pool.floor,
                f"in flight, B is charged its supremum (every byte it "
                f"could fault in) plus the floor: {gib(charge)}",
            )
            end = b.send_command("call_end")
        self.say(f"  the call returned {end!r}: no census (an older "
                 f"worker), so the receipt stays behind the board")
        self.define("census")

    def pressure(self, b: PipeWorker) -> None:
        """3: free_memory for an upscaler, sorted with the board's help."""
        c = self.checks
        unet_b = self.models["B/unet"]
        self.title("3. pressure: ComfyUI needs room for a 6 GiB upscaler")
        need = 6 * GiB + self.mm.minimum_inference_memory()
        self.say(f"  ComfyUI asks for 6 GiB + 0.8 GiB for inference + its "
                 f"reserve ({self.mm.EXTRA_RESERVED_VRAM >> 20} MiB); "
                 f"free_memory "
                 f"sorts candidates by key, most offloaded first")
        self.define("reserve")
        run = self.mm.free_memory(need, CUDA)
        self.print_run(run)
        self.check_run(run, "pressure")
        c.check(run.free_after >= need,
                f"enough came back: {gib(run.free_after)} free >= "
                f"{gib(need)}")
        first = min(run.candidates, key=lambda x: x.key)
        c.check(first.name != "B/unet",
                "the board kept B/unet (really resident) from being sorted "
                "as the most offloaded")
        self.add_host_model("upscaler", 6 * GiB, "upscale")
        self.say("  loaded the upscaler.")
        # Node boundary: a census from B brings its receipts level with
        # the board; the pool's graveyard is emptied here, never inside
        # free_memory.
        report = b.send_command("report")["_vram_report"]
        applied = self.pool.report(b, report)
        self.pool.boundary()
        self.say(f"  node boundary: B's census applied ({applied} entry), "
                 f"receipt now {gib(self.receipt_of(unet_b)[0])}")
        self.print_models()

    def worker_killed(self, b: PipeWorker) -> None:
        """4: B is killed mid-call; its stand-in returns what it held."""
        c = self.checks
        unet_b = self.models["B/unet"]
        self.title("4. worker B is killed (SIGKILL) in the middle of a call")
        self.pool.begin_call(b)
        b.send_command("call_begin", model_id="B/unet", resident=3 * GiB)
        held_by_b = self.receipt_of(unet_b)[0]
        code = b.kill()
        free_after_kill = self.card.free()
        self.say(f"  B exited with {code}; the card took back "
                 f"{gib(self.card.released_at_exit.get('B', 0))} at once; "
                 f"{gib(free_after_kill)} free")
        need = free_after_kill + 1 * GiB
        run = self.mm.free_memory(need, CUDA, keep_loaded=self.others_than(b))
        self.print_run(
            run,
            "its only candidate was B/unet (every other entry was in "
            "keep_loaded), and B's bytes were back on the card before it "
            "ran",
        )
        back = self.card.released_at_exit.get("B", 0)
        self.say(
            f"  why 'partially_unload -> {gib(held_by_b)}' yet 'card got "
            f"back 0.00 GiB': the card took B's {gib(back)} back when B "
            f"died, before free_memory ran (they are in the free figure "
            f"it started from). The stand-in returns what B held, so "
            f"ComfyUI's arithmetic sees the model gone; that call itself "
            f"could return nothing more."
        )
        c.check(not run.errors, "kill: no exception escaped free_memory")
        returned = sum(e.returned for e in run.evictions)
        c.check(
            returned == held_by_b
            == self.card.released_at_exit.get("B", -1),
            f"kill: B/unet counted {gib(returned)} as freed, what it held "
            f"and what the card took back when B died",
        )
        r = unet_b.receipt()
        c.check(r[0] == 0 and r[3] == "worker gone",
                f"kill: B/unet now reads {gib(r[0])} ({r[3]})")
        c.check(self.pool.worker_charges().get(b) == 0,
                "kill: B costs the card nothing any more")
        self.pool.boundary()

    def worker_refuses(self, a: PipeWorker) -> None:
        """5: A's lock is busy: its eviction is deferred, not made up."""
        c = self.checks
        self.title("5. worker A refuses (its lock is busy): eviction deferred")
        unet_a = self.models["A/unet"]
        if self.entry_of(unet_a) is None:
            # Detached in section 3, it left ComfyUI's list; a node of A's
            # uses it again, so it is listed and loaded again.
            self.impl.register(self.mm, unet_a)
            self.say("  A/unet left ComfyUI's list when section 3 detached "
                     "it; a node of A's needs it again: its stand-in is "
                     "registered again (index 0)")
        reloaded = unet_a.partially_load(CUDA, 2 * GiB)
        self.say(f"  ComfyUI loads 2 GiB of it: partially_load -> "
                 f"{gib(reloaded)} (a load echo)")
        self.print_models()
        c.check(reloaded == 2 * GiB == unet_a.loaded_size(),
                f"A/unet: partially_load returned {gib(reloaded)} and the "
                f"receipt says so")
        self.say("  then a long call of A's holds its command lock: A "
                 "answers every other command 'busy'")
        a.send_command("refuse", on=True)
        kept = unet_a.loaded_size()
        need = self.card.free() + 1 * GiB
        run = self.mm.free_memory(need, CUDA, keep_loaded=self.others_than(a))
        self.print_run(
            run,
            "A refused, so its weights are still on the card and nothing "
            "came back; the stand-in returned 0 (never a made-up figure), "
            "kept its receipt and told the pool the shortfall "
            "(on_pressure)",
        )
        self.check_run(run, "refusing")
        c.check(unet_a.eviction_deferred,
                "refusing: A/unet says eviction_deferred")
        c.check(unet_a.loaded_size() == kept,
                f"refusing: its receipt is kept ({gib(kept)}: the weights "
                f"are still there)")
        asked = [e.memory_to_free for e in run.evictions
                 if e.name == "A/unet"]
        c.check(
            bool(asked) and asked[0] in self.pressure_calls,
            f"refusing: pool.on_pressure got the shortfall "
            f"({', '.join(gib(n) for n in self.pressure_calls) or 'nothing'})",
        )
        a.send_command("refuse", on=False)
        # Node boundary: the pool lists again what ComfyUI dropped while
        # the worker still holds it (LoadedModel.model_unload pops an
        # entry even when detach freed nothing).
        restored = self.pool.boundary(self.mm)
        names = sorted(s.model_id for s in restored)
        self.say(f"  node boundary: pool.boundary(mm) lists again what A "
                 f"still holds ({', '.join(names) or 'nothing'}; "
                 f"currently_used False, index 0)")
        c.check(
            names == ["A/lora", "A/unet"]
            and all(self.entry_of(s) is not None for s in restored),
            "refusing: the refused models are listed again at the "
            "boundary",
        )

    def shut_down(self) -> None:
        """Workers exit or are killed and reaped; boards closed."""
        for worker in self.workers.values():
            try:
                worker.shut_down()
            except Exception:  # noqa: BLE001 - keep cleaning up
                traceback.print_exc()
        for board in self.boards:
            board.close()

    def abort(self) -> None:
        """Interrupted (Ctrl-C, SIGTERM): end every worker at once (kill,
        do not ask) and close the boards, printing nothing."""
        for worker in self.workers.values():
            with contextlib.suppress(Exception):
                worker.kill()
            for stream in (worker.process.stdin, worker.process.stdout):
                with contextlib.suppress(Exception):
                    stream.close()
        for board in self.boards:
            with contextlib.suppress(Exception):
                board.close()

    def check_nothing_left(self) -> None:
        c = self.checks
        left = _board_leftovers(self.board_names)
        c.check(not left, "no board segment, descriptor or mapping left"
                + (f" (left: {left})" if left else ""))
        running = [w.name for w in self.workers.values()
                   if w.process.returncode is None]
        c.check(not running, "every worker process exited and was reaped"
                + (f" (running: {running})" if running else ""))


class _StoryLog(logging.Handler):
    """Hands comfy_standin's log records to the demo (``Demo.log``)."""

    def __init__(self, demo: Demo) -> None:
        super().__init__()
        self.demo = demo

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.demo.log(record.getMessage())
        except Exception:  # noqa: BLE001 - logging's own rule
            self.handleError(record)


def run_demo(impl_name: str = "c", out: TextIO | None = None,
             show_status: bool = True, mode: str = "text",
             color: bool = False, verbose: bool = False) -> int:
    """Run the scenario; returns the exit code (0: every check held).

    mode "text" tells the story; "quiet" prints only the verdict (and
    the failed checks); "json" prints one JSON document.  A
    KeyboardInterrupt (Ctrl-C, or SIGTERM as the command line raises
    it) kills the workers and closes the boards before it propagates."""
    out = sys.stdout if out is None else out
    story = out if mode == "text" else io.StringIO()
    demo = Demo(impl_name, story, color=color and mode == "text",
                verbose=verbose)
    crashed: str | None = None
    interrupted = False
    # What the stand-ins log (deferred evictions, a gone worker) is part
    # of the story: shown next to what it belongs to, not on stderr.
    logger = logging.getLogger("comfy_standin")
    handler = _StoryLog(demo)
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.addHandler(handler)
    try:
        demo.run()
        if show_status:
            from . import _status

            demo.title("status of the demo's pool")
            status = _status.collect(demo.pool)
            demo.steps[-1]["status"] = status
            print(_status.render(status, probe=False), file=story)
    except KeyboardInterrupt:
        interrupted = True
        raise
    except Exception as exc:  # noqa: BLE001 - reported, then exit 1
        crashed = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        try:
            if interrupted:
                demo.abort()
            else:
                demo.title("clean-up")
                demo.shut_down()
                demo.check_nothing_left()
        except KeyboardInterrupt:
            demo.abort()
            raise
        finally:
            logger.removeHandler(handler)
    checks = demo.checks
    if crashed:
        checks.results.append((False, f"the demo crashed: {crashed}"))
        checks.records.append({"ok": False, "step": checks.step,
                               "claim": f"the demo crashed: {crashed}"})
    held = sum(ok for ok, _ in checks.results)
    total = len(checks.results)
    if checks.failed:
        verdict = (f"demo ({impl_name}): FAILED {total - held} of {total} "
                   f"checks: {'; '.join(checks.failed)}")
    else:
        verdict = (f"demo ({impl_name}): all {total} checks held; no "
                   f"segment, no process left")
    if mode == "json":
        print(json_text({
            "implementation": impl_name,
            "module": demo.impl.__name__,
            "ok": not checks.failed,
            "verdict": verdict,
            "steps": demo.steps,
            "checks": checks.records,
            "crashed": crashed,
        }, indent=2), file=out)
    else:
        if mode == "text":
            print(file=out)
        print(verdict, file=out)
    return 1 if checks.failed else 0
