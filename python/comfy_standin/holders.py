"""Memory holders: outside holders of memory that ComfyUI can ask.

The stand-in (``StandIn``) makes a worker's model look like one of
ComfyUI's own, and pays for it with three inaccuracies
(docs/architecture.md, "The three inaccuracies").  A *memory holder* is
the other way: an object that says how much memory it holds and gives
memory back when asked, with no object pretending to be a model.  This
module has

- the protocol (``MemoryHolder``): ``release_memory(device, size) -> int``
  (synchronous; frees up to `size` bytes on `device` and returns the bytes
  really freed, possibly 0; must not raise), ``held_memory(device) ->
  int`` (bytes held there now) and, optionally, ``reserved_memory(device)
  -> int`` (bytes ComfyUI should keep free for the holder on top of its
  own reserve).  Device "cpu" means pinned host RAM;
- a thread-safe ``Registry`` (``register`` / ``unregister``, each holder
  held strongly or weakly by choice) that asks its holders and never lets
  one break the caller: a holder raising an ``Exception`` or answering
  something that is not a byte count is logged and counted as 0
  (``BaseException`` such as KeyboardInterrupt propagates);
- ``PoolHolder``: a ``Pool`` as a holder.  It releases by asking its idle
  workers to shrink with comfy-env's worker commands (``partial_release``,
  ``full_release``, ``release_pins``), counts their pinned host RAM for
  device "cpu", and never asks a worker that is in a call;
- ``install(mm)`` / ``uninstall(mm)``: an opt-in shim that gives a running
  ComfyUI's ``comfy.model_management`` the calls the upstream proposal
  (docs/upstream/comfyui.md) would add: holders are asked after ComfyUI's
  own models in ``free_memory`` when it is still short (all of them, fully,
  for the free-everything request of ``unload_all_models``), their
  reserves are added where ``load_models_gpu`` sizes its budget
  (``extra_reserved_memory``), and they are asked for pinned host RAM when
  ComfyUI's own pin ladder (``ensure_pin_budget``) comes up short.

With holders and no stand-in registered, ComfyUI's list holds only its own
models: inaccuracy 1 (worker pinned RAM outside the host's pin ladder) and
inaccuracy 3 (bytes counted twice on Linux) are gone by construction;
tests/test_holders.py measures both modes on the same scenarios.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ._text import visible
from .pool import _alive, _card_total, _pinned_of

__all__ = [
    "ALL",
    "InstallError",
    "MemoryHolder",
    "PoolHolder",
    "Registry",
    "default_registry",
    "install",
    "installed",
    "register",
    "uninstall",
    "unregister",
]

log = logging.getLogger("comfy_standin.holders")

#: The size that asks a holder for everything it holds on a device.
ALL = 2**63 - 1
#: ComfyUI's "free everything" request: ``unload_all_models`` and
#: ``unload_model_and_clones`` call ``free_memory(1e30, ...)``.
FREE_ALL_THRESHOLD = 1e29

#: What a future ComfyUI with the hook would expose (our proposal,
#: docs/upstream/comfyui.md); ``install`` refuses to shim over it.
UPSTREAM_HOOK_NAMES = ("register_memory_holder", "memory_holders")


@runtime_checkable
class MemoryHolder(Protocol):
    """What a holder of memory outside ComfyUI's list must answer.

    ``reserved_memory(device) -> int`` is optional and not part of the
    runtime check."""

    def release_memory(self, device: Any, size: int) -> int: ...

    def held_memory(self, device: Any) -> int: ...


def _byte_count(value: object) -> int | None:
    """An int in [0, 2**63-1] (subclasses read by their int value, with no
    Python of theirs run), else None."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    value = int.__index__(value)
    if value < 0:
        return None
    return min(value, ALL)


def _request_bytes(size: object) -> int:
    """A request size from ComfyUI (often a float: ``1.1 * x``) as bytes."""
    if isinstance(size, bool):
        return 0
    if isinstance(size, int):
        return max(0, min(int.__index__(size), ALL))
    if isinstance(size, float):
        if math.isnan(size) or size <= 0:
            return 0
        if size >= ALL:
            return ALL
        return math.ceil(size)
    return 0


class Registry:
    """Registered holders, asked in a way that cannot break the asker.

    Thread-safe: the list is changed and copied under a lock, and holders
    are called outside it (a holder may take its own locks, or register
    another).  A holder asked while it is being asked in the same thread
    (its release ran ComfyUI's ``free_memory`` again) is not asked twice:
    a nested ask returns 0.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (holder or weakref to it, weak); registration order.
        self._entries: list[tuple[Any, bool]] = []
        self._local = threading.local()
        #: counters for status displays: holders that raised or answered
        #: something that is not a byte count.
        self.failures = 0

    def __repr__(self) -> str:
        return f"<holders.Registry: {len(self)} holders>"

    def __len__(self) -> int:
        return len(self.holders())

    # ---- registration -----------------------------------------------------

    def register(self, holder: Any, *, weak: bool = False) -> None:
        """Add `holder`; `weak` keeps only a weak reference (the holder
        leaves the registry when its owner drops it).  Registering a
        holder again changes only how it is held."""
        for name in ("release_memory", "held_memory"):
            if not callable(getattr(holder, name, None)):
                raise TypeError(
                    f"register: {holder!r} has no {name}() method; a "
                    f"memory holder answers release_memory(device, size) "
                    f"and held_memory(device)"
                )
        entry = (weakref.ref(holder) if weak else holder, weak)
        with self._lock:
            for i, (ref, was_weak) in enumerate(self._entries):
                if (ref() if was_weak else ref) is holder:
                    self._entries[i] = entry
                    return
            self._entries.append(entry)

    def unregister(self, holder: Any) -> bool:
        """Remove `holder`; False when it was not registered."""
        with self._lock:
            for i, (ref, weak) in enumerate(self._entries):
                if (ref() if weak else ref) is holder:
                    del self._entries[i]
                    return True
        return False

    def holders(self) -> list[Any]:
        """The live holders, in registration order (a snapshot)."""
        with self._lock:
            live = []
            kept = []
            for ref, weak in self._entries:
                holder = ref() if weak else ref
                if holder is not None:
                    live.append(holder)
                    kept.append((ref, weak))
            self._entries = kept  # dead weak entries go here, not in a
            # weakref callback (which could run inside this lock)
            return live

    # ---- asking -----------------------------------------------------------

    def _ask(self, holder: Any, name: str, *args: Any) -> int:
        try:
            method = getattr(holder, name, None)
            if method is None:
                return 0
            value = method(*args)
        except Exception:  # noqa: BLE001 - a holder never breaks ComfyUI
            self._failed()
            log.warning(
                "comfy_standin: memory holder %s raised in %s; counted as "
                "0", visible(holder), name, exc_info=True,
            )
            return 0
        count = _byte_count(value)
        if count is None:
            self._failed()
            log.warning(
                "comfy_standin: memory holder %s answered %s with %s, not "
                "a byte count; counted as 0", visible(holder), name,
                visible(value),
            )
            return 0
        return count

    def _failed(self) -> None:
        with self._lock:
            self.failures += 1

    def _asking(self) -> bool:
        return bool(getattr(self._local, "depth", 0))

    def held(self, device: Any) -> int:
        """The sum of every holder's ``held_memory(device)``."""
        return min(ALL, sum(
            self._ask(h, "held_memory", device) for h in self.holders()))

    def reserved(self, device: Any) -> int:
        """The sum of ``reserved_memory(device)`` over the holders that
        have it."""
        return min(ALL, sum(
            self._ask(h, "reserved_memory", device) for h in self.holders()))

    def release(self, device: Any, size: object) -> int:
        """Asks holders, largest ``held_memory(device)`` first, until
        `size` bytes were freed; returns the bytes freed."""
        want = _request_bytes(size)
        if want <= 0 or self._asking():
            return 0
        self._local.depth = 1
        try:
            ranked = []
            for order, holder in enumerate(self.holders()):
                held = self._ask(holder, "held_memory", device)
                if held > 0:
                    ranked.append((-held, order, holder))
            ranked.sort(key=lambda item: item[:2])
            freed = 0
            for _, _, holder in ranked:
                if freed >= want:
                    break
                freed += self._ask(
                    holder, "release_memory", device, want - freed)
            return min(freed, ALL)
        finally:
            self._local.depth = 0

    def release_all(self, device: Any) -> int:
        """Asks every holder for everything it holds on `device` (the
        free-everything path); returns the bytes freed."""
        if self._asking():
            return 0
        self._local.depth = 1
        try:
            return min(ALL, sum(
                self._ask(h, "release_memory", device, ALL)
                for h in self.holders()))
        finally:
            self._local.depth = 0


_default_registry = Registry()


def default_registry() -> Registry:
    """The process-wide registry ``install`` uses when given none."""
    return _default_registry


def register(holder: Any, *, weak: bool = False) -> None:
    """``default_registry().register(holder, weak=weak)``."""
    _default_registry.register(holder, weak=weak)


def unregister(holder: Any) -> bool:
    """``default_registry().unregister(holder)``."""
    return _default_registry.unregister(holder)


# ---- the pool as a holder ---------------------------------------------------


def _device_kind(device: Any) -> tuple[str, int | None]:
    """("cuda", 0) for torch.device("cuda", 0), "cuda:0", a mock device;
    ("cuda", None) for "cuda" (the current device)."""
    kind = getattr(device, "type", None)
    index = getattr(device, "index", None)
    if not isinstance(kind, str):
        text = str(device)
        kind, _, rest = text.partition(":")
        # ASCII digits only: "²".isdigit() is true and int("²") raises.
        index = int(rest) if rest.isascii() and rest.isdigit() else None
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda", device
    return kind, index if isinstance(index, int) else None


def _is_cpu(device: Any) -> bool:
    return _device_kind(device)[0] == "cpu"


def _same_device(a: Any, b: Any) -> bool:
    """`a` and `b` name the same card; an unknown (None) or index-less
    device matches any card of its type."""
    if a is None or b is None:
        return True
    kind_a, index_a = _device_kind(a)
    kind_b, index_b = _device_kind(b)
    if kind_a != kind_b:
        return False
    return index_a is None or index_b is None or index_a == index_b


def _receipt_of(reply: object) -> dict[str, Any]:
    """The reply's receipt, read from the dicts' storage (a dict
    subclass's own ``get`` never runs)."""
    if isinstance(reply, dict):
        receipt = dict.get(reply, "receipt")
        if isinstance(receipt, dict):
            return receipt
    return {}


class PoolHolder:
    """A ``Pool`` (python/comfy_standin/pool.py) as a memory holder.

    - ``held_memory(device)``: for a card, what its live workers on that
      card are known to hold (per worker the largest of its reported
      ``held``, its receipts and the probe's reading; the CUDA-context
      floor is not counted: no ask can free it); for "cpu", their
      reported pinned host RAM.
    - ``release_memory(device, size)``: asks idle workers (no call in
      flight), largest first, each for what is still missing: a card by
      ``partial_release(size=...)`` (escalating to ``full_release`` when a
      worker frees less than asked, as ComfyUI escalates a short
      ``partially_unload`` to ``detach``; ``full_release`` at once when
      everything it holds is asked), "cpu" by ``release_pins(size=...)``.
      A worker is in a call when the pool's books say so (``Pool.call``)
      or comfy-env's own count (``_calls_in_flight``) does.
      Each command goes only to a worker that advertises it
      (``supports_partial_release`` / ``supports_full_release`` /
      ``supports_release_pins``, as comfy-env's workers do), through
      ``send_command_no_spawn(..., lock_timeout=...)`` when the worker has
      it (a worker whose lock is taken answers "busy" and is skipped).
      One call waits on its workers for at most `deadline` seconds in
      all: each ask runs on a helper thread, and a worker that has not
      answered when the time is up counts 0 and is not asked again until
      that ask returns (its late reply still updates the books).
      Freed bytes are the worker's measured receipt (``freed_bytes``,
      ``freed``, the drop of its reported ``held`` or pinned figure), at
      most what the books say it held.  A worker found dead while asked
      (the ask raised and ``is_alive()`` says False, or comfy-env's
      ``"dead"`` answer) is marked gone in the pool at once
      (``Pool.worker_gone``): the first asker to see the death counts
      what it held as freed, every later one 0, and ``held_memory`` no
      longer counts it.  A reply's ``_vram_report`` is applied to the
      pool (``Pool.report``).  Never raises.
    - ``reserved_memory(device)``: where free memory is process-local
      (Windows), the charges of the workers on that card, capped at 75%
      of the card; on Linux 0, because their bytes are already missing
      from free memory (docs/reserve.md).

    A worker with no stand-in (the hook's mode: nothing registered in
    ComfyUI's list) enters the pool's books with ``track(worker,
    device)``.
    """

    def __init__(self, pool: Any = None, *, lock_timeout: float = 0.1,
                 deadline: float = 5.0):
        if pool is None:
            from . import default_pool

            pool = default_pool()
        self.pool = pool
        self.lock_timeout = float(lock_timeout)
        self.deadline = float(deadline)
        self._lock = threading.Lock()
        # The end of the current release_memory() call, per thread.
        self._local = threading.local()
        # id(worker) -> worker, while an ask to it is in flight (held, so
        # the id stays that worker's).
        self._asking: dict[int, Any] = {}
        # id(worker) -> (worker, device) for tracked workers.
        self._devices: dict[int, tuple[Any, Any]] = {}
        self._totals: dict[str, int | None] = {}

    def __repr__(self) -> str:
        return f"<PoolHolder of {self.pool!r}>"

    def track(self, worker: Any, device: Any, generation: int = 1) -> None:
        """Books `worker` (on `device`) in the pool, stand-in or not."""
        ledger = self.pool._ledger
        if ledger.find(worker) is None:
            ledger.worker(worker, generation)
        with self._lock:
            self._devices[id(worker)] = (worker, device)

    def untrack(self, worker: Any) -> None:
        with self._lock:
            self._devices.pop(id(worker), None)

    # ---- reading the books -------------------------------------------------

    def _worker_devices(self) -> dict[int, Any]:
        devices: dict[int, Any] = {}
        for worker, members in self.pool.standins().items():
            for s in members:
                devices.setdefault(id(worker), s.load_device)
        ledger = self.pool._ledger
        with self._lock:
            # A tracked worker the pool forgot (gone, then dropped at a
            # boundary) leaves: the holder keeps no dead worker alive.
            for key, (worker, _) in list(self._devices.items()):
                if ledger.find(worker) is None:
                    del self._devices[key]
            for key, (_, device) in self._devices.items():
                devices[key] = device
        return devices

    def _workers(self, device: Any) -> list[tuple[Any, Any, dict[str, Any]]]:
        """(worker, books, charge) of the live workers on `device` (every
        live worker for "cpu")."""
        devices = self._worker_devices()
        out = []
        for worker in self.pool._ledger.keys():
            books = self.pool._ledger.find(worker)
            if books is None or not books.alive:
                continue
            if not _is_cpu(device):
                where = devices.get(id(worker))
                if where is None:
                    where = getattr(worker, "load_device", None)
                if not _same_device(where, device):
                    continue
            out.append((worker, books, books.charge()))
        return out

    @staticmethod
    def _busy(worker: Any, books: Any) -> bool:
        """In a call by the pool's books, or by comfy-env's own count."""
        if books.in_flight:
            return True
        count = getattr(worker, "_calls_in_flight", 0)
        return isinstance(count, int) and count > 0

    @staticmethod
    def _held(charge: dict[str, Any]) -> int:
        return max(charge.get("held", 0), charge.get("sum_loaded", 0),
                   charge.get("reading", 0))

    def held_memory(self, device: Any) -> int:
        try:
            if _is_cpu(device):
                return sum(_pinned_of(books)
                           for _, books, _ in self._workers(device))
            return sum(self._held(c) for _, _, c in self._workers(device))
        except Exception:  # noqa: BLE001 - never raise into ComfyUI
            log.warning("comfy_standin: PoolHolder.held_memory failed",
                        exc_info=True)
            return 0

    def reserved_memory(self, device: Any) -> int:
        try:
            if not self.pool.process_local or _is_cpu(device):
                return 0
            total = sum(c["charge"] for _, _, c in self._workers(device))
            key = str(device)
            if key not in self._totals:
                self._totals[key] = _card_total(self.pool._impl, device)
            card = self._totals[key]
            if card:
                total = min(total, card * 3 // 4)
            return total
        except Exception:  # noqa: BLE001
            log.warning("comfy_standin: PoolHolder.reserved_memory failed",
                        exc_info=True)
            return 0

    # ---- releasing ---------------------------------------------------------

    def release_memory(self, device: Any, size: int) -> int:
        try:
            want = _request_bytes(size)
            if want <= 0:
                return 0
            self._local.until = time.monotonic() + self.deadline
            if _is_cpu(device):
                return self._release_pins(want)
            return self._release_vram(device, want)
        except Exception:  # noqa: BLE001 - never raise into ComfyUI
            log.warning("comfy_standin: PoolHolder.release_memory failed",
                        exc_info=True)
            return 0
        finally:
            self._local.until = None

    def _send(self, worker: Any, command: str, **params: Any) -> object:
        """One ask: the reply, or comfy-env's "busy" / "dead" answer."""
        no_spawn = getattr(worker, "send_command_no_spawn", None)
        if callable(no_spawn):
            reply = no_spawn(command, lock_timeout=self.lock_timeout,
                             **params)
        else:
            reply = worker.send_command(command, **params)
        if isinstance(reply, dict):
            report = dict.get(reply, "_vram_report")
            if isinstance(report, dict):
                try:
                    self.pool.report(worker, report)
                except Exception:  # noqa: BLE001 - a bad report: figures
                    # A census naming models with no stand-in (a tracked
                    # worker) rejects the report whole; keep its figures.
                    figures = {k: v for k, v in report.items()
                               if k != "residency"}
                    try:
                        self.pool.report(worker, figures)
                    except Exception as exc:  # noqa: BLE001
                        log.info("comfy_standin: report of %s ignored: %s",
                                 visible(worker), visible(exc))
        return reply

    def _gone(self, worker: Any, books: Any, before: int) -> int:
        """`worker` was found dead: the first to see it marks it gone in
        the pool and counts what it held (`before`) as freed; 0 after."""
        with self._lock:
            if not books.alive:
                return 0  # someone else saw it first and counted it
            log.info("comfy_standin: %s died while asked; marked gone",
                     visible(worker))
            try:
                self.pool.worker_gone(worker)
            except Exception:  # noqa: BLE001 - the books at least
                log.warning("comfy_standin: worker_gone(%s) failed",
                            visible(worker), exc_info=True)
                books.gone()
            self._devices.pop(id(worker), None)
        return before

    def _ask(self, worker: Any, books: Any, command: str, before: int,
             figure: str, **params: Any) -> int | None:
        """Sends `command` from a helper thread and waits for the answer
        until this call's deadline: the bytes it freed by the worker's
        receipt, else by the drop of the worker's own figure (`figure`:
        "held" or "pinned") from `before`.  None when the worker gave no
        answer (busy, dead before the ask, the ask failed, not in time,
        or an earlier ask to it is still in flight)."""
        if self._busy(worker, books):  # a call started since we looked
            return None
        if not books.alive:  # marked gone since we looked: counted there
            return None
        until = getattr(self._local, "until", None)
        left = self.deadline if until is None else until - time.monotonic()
        if left <= 0:
            return None
        with self._lock:
            if id(worker) in self._asking:
                return None  # its last ask has not returned: not again
            self._asking[id(worker)] = worker
        outcome: list[int | None] = []
        done = threading.Event()

        def ask() -> None:
            try:
                outcome.append(self._ask_now(worker, books, command, before,
                                             figure, **params))
            except Exception:  # noqa: BLE001 - a helper thread has no caller
                log.warning("comfy_standin: %s to %s failed in the host",
                            command, visible(worker), exc_info=True)
            finally:
                with self._lock:
                    self._asking.pop(id(worker), None)
                done.set()

        helper = threading.Thread(target=ask, daemon=True,
                                  name="comfy-standin-holder-ask")
        try:
            helper.start()
        except RuntimeError:  # no thread to be had: no ask
            with self._lock:
                self._asking.pop(id(worker), None)
            return None
        if not done.wait(left):
            log.info("comfy_standin: %s did not answer %s in time; not "
                     "asked again until it does", visible(worker), command)
            return None
        return outcome[0] if outcome else None

    def _ask_now(self, worker: Any, books: Any, command: str, before: int,
                 figure: str, **params: Any) -> int | None:
        """The ask itself, on the helper thread; never raises an
        ``Exception``."""
        try:
            reply = self._send(worker, command, **params)
        except Exception as exc:  # noqa: BLE001
            if not _alive(worker):  # its bytes went back with it
                return self._gone(worker, books, before)
            log.info("comfy_standin: %s to %s failed: %s", command,
                     visible(worker), visible(exc))
            return None
        if isinstance(reply, str):  # comfy-env's no-spawn answers
            if str.__str__(reply) == "dead":
                return self._gone(worker, books, before)
            return None  # "busy": its lock was not won in time
        if not isinstance(reply, dict):
            return None
        return min(before, self._freed(reply, before, figure))

    @staticmethod
    def _freed(reply: dict[str, Any], before: int, figure: str) -> int:
        receipt = _receipt_of(reply)
        for key in ("freed_bytes", "freed"):
            got = _byte_count(dict.get(receipt, key))
            if got is not None:
                return got
        if figure == "pinned":
            after = _byte_count(dict.get(receipt, "pinned_after"))
            start = _byte_count(dict.get(receipt, "pinned_before"))
            if after is not None and start is not None:
                return max(0, start - after)
            return 0
        report = dict.get(reply, "_vram_report")
        after = _byte_count(dict.get(report, "held")) if isinstance(
            report, dict) else None
        if after is not None:
            return max(0, before - after)
        return 0

    def _release_vram(self, device: Any, want: int) -> int:
        candidates = [
            (self._held(charge), worker, books)
            for worker, books, charge in self._workers(device)
            if not self._busy(worker, books)
        ]
        candidates.sort(key=lambda c: -c[0])
        freed = 0
        for held, worker, books in candidates:
            remaining = want - freed
            if remaining <= 0:
                break
            if held <= 0:
                continue
            partial = getattr(worker, "supports_partial_release", False)
            full = getattr(worker, "supports_full_release", False)
            if full and (remaining >= held or not partial):
                freed += self._ask(worker, books, "full_release", held,
                                   "held") or 0
                continue
            if not partial:
                continue
            ask = min(remaining, held)
            got = self._ask(worker, books, "partial_release", held, "held",
                            size=int(ask))
            if got is None:  # busy or gone: no escalation either
                continue
            freed += got
            if got < ask and full and books.alive:
                # as ComfyUI follows a short partially_unload with detach
                rest = max(0, held - got)
                freed += self._ask(worker, books, "full_release", rest,
                                   "held") or 0
        return freed

    def _release_pins(self, want: int) -> int:
        candidates = [
            (_pinned_of(books), worker, books)
            for worker, books, _ in self._workers("cpu")
            if not self._busy(worker, books)
            and getattr(worker, "supports_release_pins", False)
        ]
        candidates.sort(key=lambda c: -c[0])
        freed = 0
        for pinned, worker, books in candidates:
            remaining = want - freed
            if remaining <= 0:
                break
            if pinned <= 0:
                continue
            freed += self._ask(worker, books, "release_pins", pinned,
                               "pinned", size=int(min(pinned, remaining))) or 0
        return freed


# ---- the installer ----------------------------------------------------------


class InstallError(RuntimeError):
    """``install`` refused: the ComfyUI it met is not the one it was
    written against (or already has the hook)."""


#: Parameter names each wrapped function was written against: ComfyUI
#: releases before dynamic VRAM (2025) and with it (2026).
_KNOWN_SIGNATURES: dict[str, tuple[tuple[str, ...], ...]] = {
    "free_memory": (
        ("memory_required", "device", "keep_loaded"),
        ("memory_required", "device", "keep_loaded", "for_dynamic",
         "pins_required", "ram_required"),
    ),
    "extra_reserved_memory": ((),),
    "unload_all_models": ((),),
    "ensure_pin_budget": (("size", "evict_active", "loaded"),),
}
#: Functions the shim needs; the rest are wrapped when present.
_REQUIRED = ("free_memory", "extra_reserved_memory", "unload_all_models")
_MARK = "__comfy_standin_holders__"
_STATE = "_comfy_standin_holders"
_install_lock = threading.Lock()


def _signature_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """Parameter names of a plain signature, None for *args/**kwargs or
    keyword-only parameters (not what the shim was written against)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = []
    for p in sig.parameters.values():
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return None
        names.append(p.name)
    return tuple(names)


class _Installation:
    def __init__(self, mm: Any, registry: Registry) -> None:
        self.mm = mm
        self.registry = registry
        self.active = True
        self.local = threading.local()
        self.originals: dict[str, Callable[..., Any]] = {}
        self.wrappers: dict[str, Callable[..., Any]] = {}

    def status(self) -> dict[str, bool]:
        return {name: name in self.wrappers for name in _KNOWN_SIGNATURES}


def installed(mm: Any) -> dict[str, bool] | None:
    """{function: wrapped?} when the shim is installed on `mm`, else
    None."""
    state = getattr(mm, _STATE, None)
    return state.status() if isinstance(state, _Installation) else None


def _cpu_device(mm: Any) -> Any:
    """ComfyUI's own "cpu" device object (torch.device), else "cpu"."""
    torch = getattr(mm, "torch", None)
    try:
        if torch is not None:
            return torch.device("cpu")
        make = getattr(mm, "device", None)
        if callable(make):
            return make("cpu")
    except Exception:  # noqa: BLE001
        pass
    return "cpu"


def _dynamic_loaded(mm: Any, device: Any, keep_loaded: Any) -> int:
    """Bytes of dynamic (paged) entries on `device`: ComfyUI counts them as
    available to a dynamic load instead of evicting them."""
    total = 0
    for entry in list(mm.current_loaded_models):
        model = entry.model
        if model is None or entry.device != device:
            continue
        if keep_loaded and entry in keep_loaded:
            continue
        if model.is_dynamic():
            total += model.loaded_size()
    return total


def _after_free_memory(state: _Installation, bound: Any) -> None:
    mm = state.mm
    args = bound.arguments
    memory_required = args.get("memory_required")
    device = args.get("device")
    keep_loaded = args.get("keep_loaded") or []
    if device is None or _is_cpu(device):
        return
    if not isinstance(memory_required, (int, float)) or isinstance(
        memory_required, bool
    ):
        return
    if memory_required >= FREE_ALL_THRESHOLD:
        # Everything: the holders' too only on unload_all_models' path
        # (the Free button); unload_model_and_clones asks the same 1e30
        # for a few models of ComfyUI's own.
        if getattr(state.local, "unloading_all", False):
            state.registry.release_all(device)
        return
    need = memory_required
    if args.get("for_dynamic"):
        need = need - _dynamic_loaded(mm, device, keep_loaded)
    short = need - mm.get_free_memory(device)
    if short > 0:
        state.registry.release(device, short)


def _wrap_free_memory(state: _Installation, original: Any) -> Any:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def free_memory(*args: Any, **kwargs: Any) -> Any:
        unloaded = original(*args, **kwargs)
        if state.active:
            try:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                _after_free_memory(state, bound)
            except Exception:  # noqa: BLE001 - the shim never breaks it
                log.warning("comfy_standin: asking memory holders failed",
                            exc_info=True)
        return unloaded

    return free_memory


def _wrap_extra_reserved_memory(state: _Installation, original: Any) -> Any:
    @functools.wraps(original)
    def extra_reserved_memory() -> Any:
        base = original()
        if not state.active:
            return base
        try:
            extra = state.registry.reserved(state.mm.get_torch_device())
        except Exception:  # noqa: BLE001
            log.warning("comfy_standin: holder reserves not read",
                        exc_info=True)
            return base
        return base + extra if extra else base

    return extra_reserved_memory


def _wrap_unload_all_models(state: _Installation, original: Any) -> Any:
    @functools.wraps(original)
    def unload_all_models() -> Any:
        state.local.unloading_all = True
        try:
            return original()
        finally:
            state.local.unloading_all = False

    return unload_all_models


def _wrap_ensure_pin_budget(state: _Installation, original: Any) -> Any:
    @functools.wraps(original)
    def ensure_pin_budget(size: Any, evict_active: Any = False,
                          loaded: Any = False) -> Any:
        ok = original(size, evict_active, loaded)
        if ok or not state.active:
            return ok
        try:
            freed = state.registry.release(_cpu_device(state.mm), size)
        except Exception:  # noqa: BLE001
            log.warning("comfy_standin: asking holders for pinned RAM "
                        "failed", exc_info=True)
            return ok
        if freed <= 0:
            return ok
        # ComfyUI's own ladder decides again with the RAM given back.
        return original(size, evict_active, loaded)

    return ensure_pin_budget


_WRAPPERS = {
    "free_memory": _wrap_free_memory,
    "extra_reserved_memory": _wrap_extra_reserved_memory,
    "unload_all_models": _wrap_unload_all_models,
    "ensure_pin_budget": _wrap_ensure_pin_budget,
}


def _check(mm: Any) -> dict[str, Callable[..., Any]]:
    """The functions to wrap, or InstallError saying why not."""
    for name in UPSTREAM_HOOK_NAMES:
        if hasattr(mm, name):
            raise InstallError(
                f"{getattr(mm, '__name__', mm)} already has the memory-holder "
                f"hook ({name}); register holders with it directly, the "
                f"comfy_standin shim is not needed"
            )
    found = {}
    for name, known in _KNOWN_SIGNATURES.items():
        fn = getattr(mm, name, None)
        if fn is None:
            if name in _REQUIRED:
                raise InstallError(
                    f"{getattr(mm, '__name__', mm)}.{name} is missing: "
                    f"this ComfyUI is not one the holder shim was written "
                    f"against"
                )
            continue
        if getattr(fn, _MARK, False):
            raise InstallError(
                f"{name} is already wrapped by another holder shim "
                f"installation"
            )
        names = _signature_names(fn)
        if names not in known:
            try:
                shown = str(inspect.signature(fn))
            except (TypeError, ValueError):
                shown = "(unreadable)"
            expected = " or ".join(f"({', '.join(k)})" for k in known)
            raise InstallError(
                f"{name}{shown} differs from what the holder shim was "
                f"written against: {name}{expected}; not installed"
            )
        found[name] = fn
    return found


def install(mm: Any = None, registry: Registry | None = None
            ) -> dict[str, bool]:
    """Give a running ComfyUI the memory-holder calls; returns {function:
    wrapped?}.  Idempotent: installing again on the same `mm` with the
    same registry changes nothing.  Raises ``InstallError`` (nothing
    changed) when `mm` already has the upstream hook, lacks a function or
    one's signature is not one this shim was written against.

    `mm` defaults to ``comfy.model_management``; `registry` to
    ``default_registry()``."""
    if mm is None:
        import importlib

        mm = importlib.import_module("comfy.model_management")
    registry = _default_registry if registry is None else registry
    with _install_lock:
        state = getattr(mm, _STATE, None)
        if isinstance(state, _Installation):
            if state.registry is not registry:
                raise InstallError(
                    "the holder shim is already installed with another "
                    "registry; uninstall it first"
                )
            return state.status()
        found = _check(mm)
        state = _Installation(mm, registry)
        for name, original in found.items():
            wrapper = _WRAPPERS[name](state, original)
            setattr(wrapper, _MARK, True)
            state.originals[name] = original
            state.wrappers[name] = wrapper
        for name, wrapper in state.wrappers.items():
            setattr(mm, name, wrapper)
        setattr(mm, _STATE, state)
        log.info("comfy_standin: memory holders installed (%s)",
                 ", ".join(state.wrappers))
        return state.status()


def uninstall(mm: Any = None) -> bool:
    """Restores the originals; False when nothing was installed.  A
    function someone wrapped again after ``install`` keeps their wrapper,
    and ours in it turns into a plain pass-through."""
    if mm is None:
        import importlib

        mm = importlib.import_module("comfy.model_management")
    with _install_lock:
        state = getattr(mm, _STATE, None)
        if not isinstance(state, _Installation):
            return False
        state.active = False
        for name, wrapper in state.wrappers.items():
            if getattr(mm, name, None) is wrapper:
                setattr(mm, name, state.originals[name])
            else:
                log.warning(
                    "comfy_standin: %s was wrapped again after the holder "
                    "shim; ours stays inside as a pass-through", name)
        delattr(mm, _STATE)
        return True
