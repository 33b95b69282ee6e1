"""The pool: what every worker costs the card, and the graveyard.

One Python class shared by both implementations (docs/reserve.md,
docs/semantics.md "The pool").  All arithmetic and state of charges live
in the implementation's ``Ledger`` (the C core or the pure-Python
reference), and so does the roster of each worker's stand-ins, in the
worker's books (docs/architecture.md, "One owner for each fact").  This
class keeps the Python-object logic around them: the graveyard that keeps
stand-ins of a dead or restarted worker alive until the next node
boundary, so no ``weakref.finalize`` on their inner module fires inside
ComfyUI's index-based ``free_memory`` loop, and the registrations it
holds for ComfyUI.

An implementation binds the class to itself with a subclass::

    class Pool(pool.Pool):
        _impl = sys.modules[__name__]

or per instance with ``Pool(..., _impl=module)``.  The module must provide
``Ledger`` and ``EchoError``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

from ._text import visible

__all__ = ["DEFAULT_FLOOR", "Pool", "WorkerMap"]

#: CUDA context and handles of one worker process: comfy-env measured
#: 276-300 MiB per live worker before any model (docs/comfyui.md).
DEFAULT_FLOOR = 300 << 20

#: Two pressure notices inside this window are one event (comfy-env's
#: pool uses the same 2 s): ComfyUI's eviction loop may ask several
#: stand-ins in one pass, and each ask is the same news.
PRESSURE_DEBOUNCE_SECONDS = 2.0
#: Pressure asks in flight at once, over all workers: each asking thread
#: has at most one ask in flight, so this bounds the threads too.
PRESSURE_MAX_ASKS = 4
#: comfy-aimdo's compiled-in headroom when ComfyUI seeds none.
AIMDO_DEFAULT_HEADROOM = 256 << 20

_VALUE_MAX = 2**63 - 1
_REPORT_FIGURES = ("held", "pinned", "overhead")

log = logging.getLogger("comfy_standin")


def _is_byte_value(value: object) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and 0 <= value <= _VALUE_MAX
    )


class WorkerMap(Mapping[Any, Any]):
    """``{worker: value}`` keyed by identity, as the pool keys its books.

    What ``Pool.worker_charges()``, ``charge_details()``,
    ``update_readings()`` and ``standins()`` return: a read-only mapping
    that works for workers that cannot be hashed (a ``@dataclass`` worker)
    and never merges two distinct workers that compare equal.  Lookups,
    ``in``, ``get``, iteration and ``items()`` behave as a dict's; it
    compares equal to any mapping with the same workers (by identity) and
    equal values, so ``charges == {w: 42}`` still holds for hashable
    workers.  ``dict(m)`` works only when every worker is hashable."""

    __slots__ = ("_items",)

    def __init__(self, pairs: Iterable[tuple[Any, Any]] = ()) -> None:
        # id(worker) -> (worker, value); the worker is held, so its id
        # cannot be reused while it is here.
        self._items: dict[int, tuple[Any, Any]] = {}
        for worker, value in pairs:
            self._items[id(worker)] = (worker, value)

    def __getitem__(self, worker: Any) -> Any:
        item = self._items.get(id(worker))
        if item is None or item[0] is not worker:
            raise KeyError(worker)
        return item[1]

    def __contains__(self, worker: object) -> bool:
        item = self._items.get(id(worker))
        return item is not None and item[0] is worker

    def __iter__(self) -> Iterator[Any]:
        return iter([worker for worker, _ in self._items.values()])

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        if len(other) != len(self):
            return False
        for worker, value in other.items():
            item = self._items.get(id(worker))
            if item is None or item[0] is not worker or item[1] != value:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{w!r}: {v!r}" for w, v in self._items.values())
        return f"WorkerMap({{{inner}}})"


class Pool:
    """Per-worker charges over one ledger, and the reserve they size.

    ``on_pressure``: None or a callable taking the shortfall in bytes when
    a stand-in's ``partially_unload`` freed less than ComfyUI asked
    (comfy-env uses it to ask idle sibling workers to shrink).  It must not
    block; its exceptions are logged, never raised into ComfyUI.
    """

    _impl: ModuleType | None = None

    def __init__(
        self,
        floor: int = DEFAULT_FLOOR,
        process_local: bool | None = None,
        *,
        _impl: ModuleType | None = None,
    ) -> None:
        impl = _impl if _impl is not None else type(self)._impl
        if impl is None:
            impl = importlib.import_module("comfy_standin._core")
        if process_local is None:
            # WDDM makes mem_get_info process-local (docs/comfyui.md,
            # get_free_memory); elsewhere free memory is device-wide.
            process_local = sys.platform == "win32"
        elif not isinstance(process_local, bool):
            raise TypeError(
                f"process_local: expected None or a bool, "
                f"got {process_local!r}"
            )
        self._impl = impl
        self._ledger = impl.Ledger(floor)
        self._process_local = process_local
        # Reentrant: a finalizer (any allocation may run the collector)
        # may call back into the pool on a thread that holds the lock.  A
        # worker's stand-ins are not here: the roster lives in the worker's
        # books, in the ledger (docs/architecture.md, "One owner for each
        # fact").
        self._lock = threading.RLock()
        # Strong references to stand-ins of dead or restarted workers,
        # dropped at the next boundary().
        self._graveyard: dict[int, Any] = {}
        # Strong references to registered stand-ins (register()): ComfyUI's
        # list holds its models only weakly, so without this a stand-in
        # whose caller dropped it would leave the list with no command
        # reaching its worker.  Released at a boundary() once its worker
        # lost the model ("not registered") or is gone or restarted, never
        # because ComfyUI unloaded it (docs/semantics.md "The pool").
        self._held: dict[int, Any] = {}
        self.on_pressure: Callable[[int], object] | None = None
        # id(worker) -> (worker, the host side of its residency board).
        self._boards: dict[int, tuple[Any, Any]] = {}
        # id(worker) -> weak references to the books forget() took off
        # the ledger while some of their stand-ins were alive: worker_gone()
        # still reaches those stand-ins through their roster.  Each listed
        # stand-in holds its books, so they live exactly as long as one of
        # them does (and hold the worker, so the id stays that worker's).
        self._forgotten: dict[int, list[weakref.ref[Any]]] = {}
        # publish_reserve(): ComfyUI's own reserve, read once; the value
        # last written there and into comfy-aimdo's headroom.
        self._reserve_base: int | None = None
        self._published: int | None = None
        self._headroom_written: int | None = None
        # release_idle_on_pressure(): debounce, the last asking thread, the
        # asking threads running, and id(worker) -> worker for each worker
        # with an ask in flight (held, so the id stays that worker's).
        self._pressure_debounce = PRESSURE_DEBOUNCE_SECONDS
        self._last_pressure_ask: float | None = None
        self._pressure_thread: threading.Thread | None = None
        self._pressure_rounds = 0
        self._pressure_asking: dict[int, Any] = {}
        # reclaim(): workers that said they cannot release (once each; held
        # so the id stays that worker's).
        self._said_cannot_release: dict[int, Any] = {}

    def __repr__(self) -> str:
        return (
            f"<{type(self).__qualname__} of {self._impl.__name__}: "
            f"{len(self._ledger.keys())} workers, floor={self.floor}, "
            f"process_local={self._process_local}>"
        )

    @property
    def floor(self) -> int:
        return self._ledger.floor

    @property
    def process_local(self) -> bool:
        return self._process_local

    # ---- stand-ins --------------------------------------------------------

    def _bury(self, worker: Any, doomed: Callable[[Any], bool]) -> None:
        """Moves the worker's stand-ins that are `doomed` to the graveyard.

        The doomed stay on their roster too: it is how boundary() knows
        whether anyone still holds a stand-in of a gone worker.  The
        graveyard is a dict so burying twice keeps one reference.  The
        roster is read under the lock, as forget() drops it (the lock is
        reentrant: the snapshot allocates, and a collection may run a
        finalizer that calls back in on this thread)."""
        with self._lock:
            books = self._ledger.find(worker)
            members = [] if books is None else books.standins()
            for standin in members:
                if doomed(standin):
                    self._graveyard[id(standin)] = standin

    def standins(self) -> WorkerMap:
        """{worker: its stand-ins still alive}, those of dead or restarted
        workers included (they may sit in the graveyard until the next
        boundary).  For status displays; a snapshot, keyed by identity
        (``WorkerMap``).  A view of the rosters the workers' books keep."""
        return WorkerMap(
            (books.key, books.standins()) for books in self._ledger.books()
        )

    def graveyard_size(self) -> int:
        """Stand-ins kept alive until the next boundary()."""
        with self._lock:
            return len(self._graveyard)

    def _hold(self, standin: Any) -> None:
        """Called by ``register()``: keep `standin` alive while ComfyUI
        lists it (see ``boundary``).  Idempotent."""
        with self._lock:
            self._held[id(standin)] = standin

    def held(self) -> list[Any]:
        """Registered stand-ins the pool keeps alive; a snapshot."""
        with self._lock:
            return list(self._held.values())

    def _held_items(self) -> list[tuple[int, Any]]:
        with self._lock:
            return list(self._held.items())

    def _dead_workers_held(self) -> list[Any]:
        """Workers of live held stand-ins whose ``is_alive()`` says False
        (a raising probe counts as alive, as in the stand-in)."""
        seen: dict[int, Any] = {}
        for _, s in self._held_items():
            try:
                if not s.stale:
                    seen.setdefault(id(s.worker), s.worker)
            except Exception:  # noqa: BLE001 - a broken read: keep it
                continue
        dead = []
        for worker in seen.values():
            try:
                alive = bool(worker.is_alive())
            except Exception:  # noqa: BLE001 - undecidable: alive
                alive = True
            if not alive:
                dead.append(worker)
        return dead

    def _release_held_locked(self, doomed: Callable[[Any], bool]) -> None:
        """Moves held stand-ins to the graveyard (dropped at the next
        boundary, so no finalizer runs inside ``free_memory``)."""
        for key, standin in list(self._held.items()):
            if doomed(standin):
                del self._held[key]
                self._graveyard[key] = standin

    def relist(self, mm: Any) -> list[Any]:
        """Lists again, in ``mm.current_loaded_models`` (``comfy.
        model_management``), every live stand-in whose model is on the card
        by the newest true word (``loaded_size() > 0``: a valid board
        reading, else the receipt) that ComfyUI no longer lists: a held
        (registered) one, or one whose eviction a live worker refused
        (``eviction_deferred``).  ComfyUI pops an entry after every
        ``model_unload``, and a worker may load the model back in any later
        call with no new registration (comfy-env dedups on the module), so
        without this its bytes would sit on the card where ``free_memory``
        cannot reach them.  Each is listed once, ``currently_used`` False,
        through ``register``.  Returns them.

        Call it where ComfyUI iterates no list: at a node boundary
        (``boundary`` does) and before a ``free_memory`` run on a worker's
        behalf, never inside ``free_memory``'s loop."""
        from ._register import register

        self._ledger.reread_boards()
        listed = {id(entry.model) for entry in list(mm.current_loaded_models)}
        held = {key for key, _ in self._held_items()}
        restored: list[Any] = []
        for members in self.standins().values():
            for s in members:
                if s.stale or id(s) in listed:
                    continue
                if (id(s) in held or s.eviction_deferred) \
                        and _still_resident(s):
                    register(mm, s)
                    listed.add(id(s))
                    restored.append(s)
        return restored

    def census_at_creation(self, created: Mapping[str, Any],
                           census: object) -> int:
        """Applies a reply frame's census (its ``_vram_report``'s
        ``residency``) to the stand-ins that frame's registrations made:
        `created` maps model id -> stand-in.  comfy-env applies a frame's
        census before it makes that frame's stand-ins, and makes them at
        full size (their registration said "on cuda"); a model partly
        resident by then would register at its full size until the next
        census.  Entries of other ids are ignored, a bad entry is skipped
        (comfy-env's census never fails a boundary).  Returns the entries
        applied."""
        if not created or not isinstance(census, (list, tuple)):
            return 0
        applied = 0
        for entry in list(census):
            mid = dict.get(entry, "id") if isinstance(entry, dict) else None
            s = created.get(mid) if isinstance(mid, str) else None
            if s is None:
                continue
            try:
                applied += self._impl.apply_residency({mid: s}, [entry])
            except (self._impl.EchoError, TypeError):
                continue  # skipped, as comfy-env skips a bad entry
        return applied

    def boundary(self, mm: Any = None) -> list[Any]:
        """Node-boundary housekeeping.  Call it between nodes, never inside
        ComfyUI's ``free_memory`` (its loop pops entries by index).

        - Marks gone the workers of held stand-ins whose ``is_alive()``
          now says False (``worker_gone``).
        - With `mm` (``comfy.model_management``): ``relist(mm)``, every
          stand-in ComfyUI dropped whose model is still on the card is
          listed again.  Returns those stand-ins.
        - Releases registered stand-ins (``register()`` holds them) only
          when the worker reports the model gone: they are stale (the
          worker died or restarted) or their receipt source is "worker
          gone" (it answered "not registered").  A stand-in ComfyUI
          unloaded stays held: its worker may load the model back.
        - Drops the graveyard, then the books of gone workers nobody holds
          a stand-in of any more (a restart under a new worker object
          would otherwise keep every dead one on the books forever).
        """
        restored: list[Any] = []
        # A board whose heartbeat went stale is read as such from here on.
        self._ledger.reread_boards()
        # A worker that died since its last command: its held stand-ins
        # would otherwise stay listed until ComfyUI happens to evict them.
        for worker in self._dead_workers_held():
            self.worker_gone(worker)
        if mm is not None:
            restored = self.relist(mm)
        # Decided outside the lock: the reads may log.
        done = {
            key for key, s in self._held_items() if _registration_over(s)
        }
        with self._lock:
            self._release_held_locked(lambda s: id(s) in done)
            buried, self._graveyard = self._graveyard, {}
            # Keys first (reading them allocates nothing), then entries: a
            # finalizer run by an allocation here may call back in.
            forgotten = [
                (key, shelf) for key in list(self._forgotten)
                if (shelf := self._forgotten.get(key)) is not None
            ]
        # Finalizers (mm.cleanup_models) may run here, outside the lock.
        del buried
        for key, shelf in forgotten:
            # Read outside the lock (a roster read allocates).  Books with
            # no stand-in left never gain one (they are off the ledger), so
            # they leave the shelf in place: a forget() that shelves more
            # meanwhile appends to the same list, and keeps its entry.
            dead = [ref for ref in list(shelf) if not _has_standins(ref())]
            if not dead:
                continue
            gone = {id(ref) for ref in dead}
            with self._lock:
                shelf[:] = [ref for ref in shelf if id(ref) not in gone]
                if not shelf and self._forgotten.get(key) is shelf:
                    del self._forgotten[key]
        for books in self._ledger.books():
            if books.alive or books.standins():
                continue  # alive, or someone still holds a stand-in of it
            self.forget(books.key)
        return restored

    # ---- residency boards (docs/board.md) -----------------------------------

    def board_for(
        self,
        worker: Any,
        slots: int = 64,
        heartbeat_limit: float = 5.0,
        generation: int | None = None,
    ) -> Any:
        """The host side of `worker`'s live residency board, created on the
        first call and owned by the pool: it is closed (unmapped, its
        descriptor dropped) when the worker is gone, restarted or forgotten,
        and when the pool is.  Hand the worker ``board.fd`` (``pass_fds`` at
        spawn, or SCM_RIGHTS; ``board.name`` where boards have names),
        have each stand-in ``attach_board(board)`` and tell the worker
        ``(slot, board.tag(slot))``, and ``board.unlink()`` once the worker
        has mapped it.  `generation`: the worker process's (default: its
        books', 0 before any stand-in).  Where the worker makes its own
        board and the host adopts it, use ``own_board``."""
        from ._core import Board  # shared memory is C in both impls

        with self._lock:
            held = self._boards.get(id(worker))
            if held is not None and not held[1].closed:
                return held[1]
        if generation is None:
            books = self._ledger.find(worker)
            generation = books.generation if books is not None else 0
        board = Board.create(
            slots, generation=generation, heartbeat_limit=heartbeat_limit
        )
        with self._lock:
            held = self._boards.get(id(worker))
            if held is not None and not held[1].closed:
                raced = held[1]
            else:
                self._boards[id(worker)] = (worker, board)
                raced = None
        if raced is not None:  # another thread made one first
            board.close()
            return raced
        return board

    def own_board(self, worker: Any, board: Any) -> None:
        """Takes `board` (a host-side Board, e.g. ``Board.adopt``ed from
        the worker) as `worker`'s: closed with the worker (gone, restarted,
        forgotten) or the pool, like ``board_for``'s.  A board the pool
        held for the worker before is closed."""
        with self._lock:
            held = self._boards.get(id(worker))
            self._boards[id(worker)] = (worker, board)
        if held is not None and held[1] is not board:
            held[1].close()

    def _close_board(self, worker: Any) -> None:
        with self._lock:
            held = self._boards.pop(id(worker), None)
        if held is not None:
            held[1].close()  # unmaps, drops the fd; stand-ins fall back

    # ---- workers ----------------------------------------------------------

    def worker_gone(self, worker: Any) -> None:
        """The worker's process died: its stand-ins read 0, never raise.
        Reaches the stand-ins of a worker forgotten before it died too:
        the books and the shelf of forgotten ones are read, and every
        stand-in marked, in one locked step (as forget() moves books from
        one to the other), so a second call never returns while the first
        is still marking."""
        with self._lock:
            books = self._ledger.find(worker)
            members = []
            if books is not None:
                books.gone()
                members = books.standins()
            shelf = self._forgotten.pop(id(worker), ())
            orphans = [
                s for ref in shelf for s in _standins_of(ref(), worker)
            ]
            for standin in orphans:
                standin._worker_gone()
            for standin in (*members, *orphans):
                self._graveyard[id(standin)] = standin
            self._release_held_locked(lambda s: s.worker is worker)
        self._close_board(worker)

    def restarted(self, worker: Any, generation: int) -> None:
        """The worker was restarted under a newer `generation`."""
        with self._lock:
            books = self._ledger.find(worker)
            if books is None:
                self._ledger.worker(worker, generation)
            else:
                books.bump(generation)
        self._bury(worker, lambda s: s.worker_generation < generation)
        with self._lock:
            self._release_held_locked(
                lambda s: s.worker is worker
                and s.worker_generation < generation
            )
        self._close_board(worker)  # the old process's board

    def forget(self, worker: Any) -> None:
        """Drop the worker's books: it is no longer charged.  Its stand-ins
        still held keep their receipts and learn of the worker's death from
        ``worker_gone()`` or their own ``is_alive()`` checks.  The books
        leave the ledger with their roster in one step, so no stand-in made
        meanwhile is left on a roster the pool no longer sees; they go on
        the shelf worker_gone() reads in the same locked step, even with
        no stand-in listed (one still being made on this thread, by a
        finalizer that ran this, joins them after; boundary() drops books
        nobody holds a stand-in of)."""
        with self._lock:
            books = self._ledger.forget(worker)
            if books is not None:
                self._forgotten.setdefault(id(worker), []).append(
                    weakref.ref(books)
                )
            self._release_held_locked(lambda s: s.worker is worker)
        self._close_board(worker)

    def begin_call(self, worker: Any) -> None:
        """A call into the worker starts: it may fault in anything."""
        books = self._ledger.find(worker)
        if books is not None:
            books.begin_call()

    def end_call(self, worker: Any) -> None:
        books = self._ledger.find(worker)
        if books is not None:
            books.end_call()

    @contextlib.contextmanager
    def call(self, worker: Any) -> Iterator[None]:
        """``with pool.call(worker):`` brackets one call into the worker.

        A restart or death during the call already cleared the in-flight
        count, so the exit does not end a call the books no longer hold.
        """
        books = self._ledger.find(worker)
        if books is None:
            yield
            return
        generation = books.generation
        books.begin_call()
        try:
            yield
        finally:
            if (
                books.alive
                and books.generation == generation
                and books.in_flight > 0
            ):
                try:
                    books.end_call()
                except RuntimeError:
                    log.warning(
                        "comfy_standin: call bracket of %r ended twice",
                        worker,
                    )

    def report(self, worker: Any, vram_report: Mapping[str, Any]) -> int:
        """Apply a reply frame's ``_vram_report``; returns census entries
        applied.  The whole report is validated before anything changes;
        any problem raises ``EchoError`` and changes nothing."""
        echo_error = self._impl.EchoError
        books = self._ledger.find(worker)
        if books is None:
            raise echo_error(
                f"worker {worker!r} has no stand-ins in this pool: "
                f"register its models before applying its reports"
            )
        if not isinstance(vram_report, Mapping):
            raise echo_error(
                f"vram_report: expected a mapping, got {vram_report!r}"
            )
        figures: dict[str, int] = {}
        for name in _REPORT_FIGURES:
            value = vram_report.get(name)
            if value is None:
                continue
            if not _is_byte_value(value):
                raise echo_error(
                    f"{name}: expected an int in [0, 2**63-1], got {value!r}"
                )
            figures[name] = value
        applied = 0
        residency = vram_report.get("residency")
        if residency is not None:
            # All or nothing on its own; the figures cannot fail any more.
            applied = books.apply_census(residency)
        if figures:
            books.set_report(**figures)
        return applied

    # ---- charges ----------------------------------------------------------

    def worker_charges(self) -> WorkerMap:
        """{worker: bytes it costs the card} (docs/reserve.md), keyed by
        identity (``WorkerMap``: unhashable workers work too)."""
        charges: list[tuple[Any, int]] = []
        for worker in self._ledger.keys():
            books = self._ledger.find(worker)
            if books is not None:
                charges.append((worker, books.charge()["charge"]))
        return WorkerMap(charges)

    def charge_details(self) -> WorkerMap:
        """{worker: the charge and the figures it came from}, keyed by
        identity (``WorkerMap``).

        ``held_from_reading`` says the probe's per-pid reading (taken
        without the worker talking), not the worker's report, set the
        held figure; ``reading`` and ``held`` give both."""
        details: list[tuple[Any, dict[str, Any]]] = []
        for worker in self._ledger.keys():
            books = self._ledger.find(worker)
            if books is not None:
                details.append((worker, books.charge()))
        return WorkerMap(details)

    def update_readings(
        self,
        probe_result: Mapping[str, Any] | None = None,
        pid_of: Callable[[Any], int | None] | None = None,
    ) -> WorkerMap:
        """Floors every worker's held figure with the probe's per-pid
        reading: the VRAM the driver says the worker's process uses, summed
        over devices.  Returns {worker: reading} for the workers read
        (a ``WorkerMap``, keyed by identity).

        `probe_result` defaults to a fresh ``probe()`` of this pool's
        implementation.  `pid_of(worker)` gives a worker's process id;
        the default reads ``worker.pid``, then ``worker.process.pid`` and
        ``worker._process.pid`` (comfy-env keeps its Popen there).  A worker
        whose pid is unknown, or whose usage the driver hides, keeps its
        last reading.  Never raises for a missing GPU: no devices, no
        readings.

        A device with no per-process readings (``processes`` None: NVML
        absent, or a list the probe refused, see ``processes_error``; or
        a truncated list) cannot say what a worker holds there: a worker
        found on no readable list then loses its reading (0, no floor),
        so its charge is its own held figure, never a stale or garbled
        floor."""
        if probe_result is None:
            probe_result = _probe(self._impl)
        used: dict[int, int] = {}
        unknown = (probe_result.get("nvml") or {}).get("loaded") is False
        for device in probe_result.get("devices") or ():
            processes = device.get("processes")
            if processes is None or device.get("processes_truncated"):
                unknown = True
            for pid, value in (processes or {}).items():
                if _is_byte_value(value):
                    used[pid] = min(_VALUE_MAX, used.get(pid, 0) + value)
        readings: list[tuple[Any, int]] = []
        for worker in self._ledger.keys():
            pid = (pid_of or _default_pid_of)(worker)
            books = self._ledger.find(worker)
            if books is None:
                continue
            if pid is not None and pid in used:
                books.set_reading(used[pid])
                readings.append((worker, used[pid]))
            elif unknown and pid is not None:
                books.set_reading(0)
        return WorkerMap(readings)

    # ---- standalone parity with comfy-env's pool ---------------------------

    def publish_reserve(
        self, mm: Any, device: Any = None, total: int | None = None
    ) -> int:
        """Writes ``reserve()`` into ComfyUI's ``mm.EXTRA_RESERVED_VRAM``
        and forwards it to comfy-aimdo's pager headroom, for a pool used
        without comfy-env (which publishes its own).  Call it at a
        boundary.  ComfyUI's own reserve is read once, at the first call,
        as the base (re-reading it would add the last reserve back).

        The pager ignores EXTRA_RESERVED_VRAM, so when ComfyUI runs it the
        headroom becomes ComfyUI's seed plus what the pool added on top of
        the base (never the base again: the seed already carries it), set
        with ``set_simple_vram_headroom`` only when it changed.  Returns
        the reserve published."""
        if self._reserve_base is None:
            self._reserve_base = int(mm.EXTRA_RESERVED_VRAM)
        base = self._reserve_base
        if device is None:
            device = mm.get_torch_device()
        value = self.reserve(device, base, total)
        if value != self._published:
            mm.EXTRA_RESERVED_VRAM = value
            self._published = value
        setter = _aimdo_setter()
        if setter is not None:
            headroom = _aimdo_seed() + max(0, value - base)
            if headroom != self._headroom_written:
                try:
                    setter(int(headroom))
                    self._headroom_written = headroom
                except Exception:  # noqa: BLE001 - never fail a boundary
                    log.warning("comfy_standin: pager headroom not set",
                                exc_info=True)
        return value

    def release_idle_on_pressure(
        self, debounce: float = PRESSURE_DEBOUNCE_SECONDS
    ) -> None:
        """Sets ``on_pressure`` so that a stand-in freeing less than
        ComfyUI asked makes idle workers give VRAM back, as comfy-env's
        pool does: ``partial_release(size=...)`` to every idle worker that
        advertises it (``supports_partial_release``), largest holder
        first, each asked only for what is still missing; then
        ``release_pins(size=pinned)`` to those advertising
        ``supports_release_pins`` with pinned bytes reported.

        Notices inside `debounce` seconds of the last ask are one event.
        The stand-in calls ``on_pressure`` inside ComfyUI's
        ``free_memory``: nothing is sent there, a daemon thread asks (a
        comfy-env worker through ``send_command_no_spawn(...,
        lock_timeout=2.0)``; a busy one answers "busy" and is skipped).

        A worker that does not answer holds only its own ask: a worker
        with an ask in flight is skipped until that ask returns, and at
        most ``PRESSURE_MAX_ASKS`` threads ask at once (a notice beyond
        that is dropped).  A worker found dead while asked is marked gone
        (``worker_gone``)."""
        self._pressure_debounce = float(debounce)
        self.on_pressure = self._pressure_noticed

    def _pressure_noticed(self, shortfall: object) -> None:
        want = _shortfall_bytes(shortfall)
        if want <= 0:
            return
        now = time.monotonic()
        with self._lock:
            last = self._last_pressure_ask
            if last is not None and now - last < self._pressure_debounce:
                return
            if self._pressure_rounds >= PRESSURE_MAX_ASKS:
                return  # the asks in flight are stuck: nothing more to add
            self._last_pressure_ask = now
            self._pressure_rounds += 1
        thread = threading.Thread(
            target=self._pressure_round, args=(want,),
            name="comfy-standin-pressure", daemon=True,
        )
        self._pressure_thread = thread
        try:
            thread.start()
        except BaseException:  # no thread (RuntimeError): no round
            with self._lock:
                self._pressure_rounds -= 1
            raise

    def _pressure_round(self, shortfall: int) -> None:
        try:
            self._ask_idle_workers(shortfall)
        except Exception:  # noqa: BLE001 - a daemon thread has no caller
            log.warning("comfy_standin: pressure round failed",
                        exc_info=True)
        finally:
            with self._lock:
                self._pressure_rounds -= 1

    def _claim_for_ask(self, worker: Any) -> bool:
        """Marks `worker` as being asked; False when an ask to it is
        already in flight."""
        with self._lock:
            if id(worker) in self._pressure_asking:
                return False
            self._pressure_asking[id(worker)] = worker
            return True

    def _ask_idle_workers(self, shortfall: int) -> int:
        """Runs on the pressure thread; returns the bytes given back."""
        candidates = []
        for worker in self._ledger.keys():
            books = self._ledger.find(worker)
            if books is None or not books.alive or books.in_flight:
                continue
            charge = books.charge()
            held = max(charge.get("held", 0), charge.get("sum_loaded", 0))
            candidates.append((held, _pinned_of(books), worker))
        candidates.sort(key=lambda c: -c[0])
        remaining, freed = shortfall, 0
        for held, pinned, worker in candidates:
            wants_vram = remaining > 0 and held > 0 and getattr(
                worker, "supports_partial_release", False)
            wants_pins = pinned > 0 and getattr(
                worker, "supports_release_pins", False)
            if not (wants_vram or wants_pins):
                continue
            if not self._claim_for_ask(worker):
                continue  # its last ask has not returned: not again
            try:
                if wants_vram:
                    reply = self._pressure_ask(
                        worker, "partial_release", min(held, remaining))
                    # Read from the dicts' storage: a dict subclass's own
                    # get() never runs on this thread.
                    receipt = dict.get(reply, "receipt") if isinstance(
                        reply, dict) else None
                    got = dict.get(receipt, "freed_bytes") if isinstance(
                        receipt, dict) else None
                    if _is_byte_value(got):
                        got = min(got, held)  # no more than it held
                        freed += got
                        remaining -= min(remaining, got)
                if wants_pins:
                    self._pressure_ask(worker, "release_pins", pinned)
            finally:
                with self._lock:
                    self._pressure_asking.pop(id(worker), None)
        return freed

    # ---- unlisted bytes (docs/architecture.md, "Unlisted bytes") ----------

    def unlisted(self) -> WorkerMap:
        """{worker: bytes it holds on the card that none of its models
        accounts for}: its held figure (the worker's last report, floored
        by the probe's per-process reading) minus what its stand-ins answer
        (``sum_loaded``: receipts, or newer board readings).  Its allocator
        cache, and what it allocated past the ``.to()``/``.cuda()`` hooks
        (comfy-env registers no model for those).  0 for a gone worker."""
        out: list[tuple[Any, int]] = []
        for worker in self._ledger.keys():
            books = self._ledger.find(worker)
            if books is not None:
                out.append((worker, _unlisted_of(books.charge())))
        return WorkerMap(out)

    def reclaim(self, shortfall: object) -> int:
        """ComfyUI is still `shortfall` bytes short after its own eviction:
        asks idle workers holding unlisted bytes, most first, to give back
        what is still missing (``partial_release(size=...)``, comfy-env's
        release through the worker's own manager), on this thread, through
        ``send_command_no_spawn(..., lock_timeout=0.0)``: a worker another
        thread is in answers "busy" and is skipped, a worker in a call (its
        own budget request) is not asked.  Returns the bytes that came
        back, as each worker measured them (its receipt's ``freed_bytes``,
        no more than it held); the worker's held figure drops by them.  A
        worker with unlisted bytes that cannot release (no
        ``supports_partial_release``, an error receipt) says so once.
        Call it where ComfyUI iterates no list (after ``free_memory``)."""
        want = _shortfall_bytes(shortfall)
        got = 0
        holders = sorted(
            ((n, w) for w, n in self.unlisted().items() if n > 0),
            key=lambda item: -item[0],
        )
        for unlisted, worker in holders:
            if got >= want:
                break
            books = self._ledger.find(worker)
            if books is None or not books.alive or books.in_flight \
                    or _in_a_call(worker):
                continue
            if not getattr(worker, "supports_partial_release", False):
                self._cannot_release(worker, unlisted,
                                     "it has no partial_release")
                continue
            if not self._claim_for_ask(worker):
                continue  # a pressure ask to it is still out
            try:
                reply, dead = _ask(worker, "partial_release",
                                   min(unlisted, want - got), 0.0)
            finally:
                with self._lock:
                    self._pressure_asking.pop(id(worker), None)
            if dead:
                self.worker_gone(worker)
                continue
            freed = _freed_bytes(reply)
            if freed is None:
                if not (isinstance(reply, str)
                        and str.__eq__(reply, "busy")):
                    self._cannot_release(worker, unlisted,
                                         _release_error(reply))
                continue
            charge = books.charge()
            freed = min(freed, max(charge["held"], charge["reading"]))
            if freed:
                books.set_report(held=max(0, charge["held"] - freed))
                got += freed
        return got

    def _cannot_release(self, worker: Any, unlisted: int, why: str) -> None:
        with self._lock:
            if id(worker) in self._said_cannot_release:
                return
            self._said_cannot_release[id(worker)] = worker
        log.warning("comfy_standin: %s holds %d MiB that no listed model "
                    "accounts for and cannot release them (%s): ComfyUI "
                    "cannot reach them", visible(worker), unlisted >> 20,
                    visible(why))

    def _pressure_ask(self, worker: Any, command: str, size: int) -> object:
        """One ask; a death it reveals goes to the pool at once."""
        reply, dead = _ask(worker, command, size)
        if dead:
            books = self._ledger.find(worker)
            if books is not None and books.alive:
                log.info("comfy_standin: %s died (found during %s); "
                         "marked gone", visible(worker), command)
                self.worker_gone(worker)
            return None
        return reply

    def reserve(self, device: Any, base: int, total: int | None = None) -> int:
        """The EXTRA_RESERVED_VRAM to publish for `device`.

        `total` is the card's size (None or 0: no cap yet; the probe
        supplies it).  Device-wide free memory (Linux): `base`.
        Process-local (Windows WDDM): `base` plus every worker's charge,
        capped at 75% of the card, growing at once and shrinking only
        after a release.
        """
        if total is None and self._process_local:
            total = _card_total(self._impl, device)
        return self._ledger.reserve(
            base, 0 if total is None else total, self._process_local
        )


def _aimdo_setter() -> Callable[[int], object] | None:
    """comfy-aimdo's ``set_simple_vram_headroom`` when ComfyUI runs the
    pager (``comfy.memory_management.aimdo_enabled``), else None.  The
    module-level wrapper first, then the C export on ``control.lib``
    (older wheels ship only that), as comfy-env 0.4.46 looks it up.

    Only modules ComfyUI has already imported are read (``sys.modules``):
    ComfyUI imports both before it turns the pager on, and an import from
    here would scan ``sys.path`` on every call outside ComfyUI (and
    allocate as it fails) or run a module's import-time code."""
    try:
        cmm = sys.modules.get("comfy.memory_management")
        if cmm is None or not getattr(cmm, "aimdo_enabled", False):
            return None
        control = sys.modules.get("comfy_aimdo.control")
        if control is None:
            return None
        setter = getattr(control, "set_simple_vram_headroom", None)
        if setter is None:
            setter = getattr(getattr(control, "lib", None),
                             "set_simple_vram_headroom", None)
    except Exception:  # noqa: BLE001 - a broken module: nothing to forward
        return None
    return setter if callable(setter) else None


def _aimdo_seed() -> int:
    """The headroom ComfyUI seeded the pager with: ``--reserve-vram`` GiB
    in bytes, else comfy-aimdo's default.  ``comfy.cli_args`` is read from
    ``sys.modules`` only: importing it parses ``sys.argv``."""
    try:
        cli_args = sys.modules.get("comfy.cli_args")
        value = getattr(getattr(cli_args, "args", None), "reserve_vram",
                        None)
        if value is not None:
            return max(0, int(float(value) * (1 << 30)))
    except Exception:  # noqa: BLE001 - unreadable args: the default
        pass
    return AIMDO_DEFAULT_HEADROOM


def _has_standins(books: Any) -> bool:
    return books is not None and bool(books.standins())


def _standins_of(books: Any, worker: Any) -> list[Any]:
    """The stand-ins on forgotten `books` of `worker` (none once the books
    are gone)."""
    if books is None or books.key is not worker:
        return []
    return list(books.standins())


def _still_resident(s: Any) -> bool:
    """Whether the stand-in's model is on the card by the newest true word
    (``loaded_size()``: a valid board reading, else the receipt) and its
    worker has not reported it gone."""
    try:
        return s.loaded_size() > 0 and s.receipt()[3] != "worker gone"
    except Exception:  # noqa: BLE001 - unreadable: leave it be
        return False


def _registration_over(s: Any) -> bool:
    """Whether a registered stand-in may be let go (see boundary()): its
    worker died or restarted (stale), or reported the model gone."""
    try:
        return bool(s.stale or s.receipt()[3] == "worker gone")
    except Exception:  # noqa: BLE001 - a broken read keeps the hold
        log.warning("comfy_standin: could not read %r", s, exc_info=True)
        return False


def _unlisted_of(charge: Mapping[str, Any]) -> int:
    if not charge.get("alive", True):
        return 0
    held = max(charge.get("held", 0), charge.get("reading", 0))
    return max(0, held - charge.get("sum_loaded", 0))


def _in_a_call(worker: Any) -> bool:
    """comfy-env's own in-flight count (``_calls_in_flight``): a worker
    in a call serves only the commands its call loop interleaves, and
    partial_release is not one of them."""
    count = getattr(worker, "_calls_in_flight", 0)
    return isinstance(count, int) and count > 0


def _freed_bytes(reply: object) -> int | None:
    """A release reply's measured ``receipt['freed_bytes']``, or None."""
    receipt = dict.get(reply, "receipt") if isinstance(reply, dict) else None
    got = dict.get(receipt, "freed_bytes") if isinstance(
        receipt, dict) else None
    return got if _is_byte_value(got) else None


def _release_error(reply: object) -> str:
    receipt = dict.get(reply, "receipt") if isinstance(reply, dict) else None
    errors = dict.get(receipt, "errors") if isinstance(receipt, dict) \
        else None
    if isinstance(errors, list) and errors:
        return f"its receipt says {errors[0]!r}"
    return f"it answered {reply!r}"


def _pinned_of(books: Any) -> int:
    """The pinned bytes of the worker's last report (C: ``report``;
    the reference keeps it as ``_pinned``)."""
    report = getattr(books, "report", None)
    if isinstance(report, tuple) and len(report) == 3:
        return int(report[1])
    value = getattr(books, "_pinned", 0)
    return value if _is_byte_value(value) else 0


def _shortfall_bytes(value: object) -> int:
    """A shortfall as bytes: an int (not a bool) or a finite float, else
    0 (nothing to ask for)."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(0, min(int.__index__(value), _VALUE_MAX))
    if isinstance(value, float) and math.isfinite(value) and value > 0:
        return min(math.ceil(value), _VALUE_MAX)
    return 0


def _ask(worker: Any, command: str, size: int,
         lock_timeout: float = 2.0) -> tuple[object, bool]:
    """One release ask: (reply, the worker is dead).  Never raises an
    ``Exception``."""
    try:
        no_spawn = getattr(worker, "send_command_no_spawn", None)
        if callable(no_spawn):
            reply = no_spawn(command, size=int(size),
                             lock_timeout=lock_timeout)
        else:
            reply = worker.send_command(command, size=int(size))
    except Exception as exc:  # noqa: BLE001 - an ask is best effort
        log.info("comfy_standin: %s to %s failed: %s", command,
                 visible(worker), visible(exc))
        return None, not _alive(worker)
    # comfy-env's no-spawn sentinels: "busy" (lock not won) and "dead".
    return reply, isinstance(reply, str) and str.__str__(reply) == "dead"


def _alive(worker: Any) -> bool:
    """``worker.is_alive()``; a probe that raises counts as alive."""
    try:
        return bool(worker.is_alive())
    except Exception:  # noqa: BLE001 - undecidable: alive
        return True


def _probe(impl: ModuleType) -> Mapping[str, Any]:
    """The GPU probe: the implementation's, else the C one (the probe is
    dlopen and driver calls; the pure-Python reference has no other)."""
    probe = getattr(impl, "probe", None)
    if probe is None:
        probe = importlib.import_module("comfy_standin._core").probe
    return probe()


_PID_PATHS = (("pid",), ("process", "pid"), ("_process", "pid"),
              ("proc", "pid"))


def _default_pid_of(worker: Any) -> int | None:
    """comfy-env's SubprocessWorker and plain Popen-like objects."""
    # The names are literals (interned): a name built at run time (a
    # split) is a fresh str each call, and Python 3.10/3.11's attribute
    # cache keeps a reference to every name it caches.
    for path in _PID_PATHS:
        obj = worker
        try:
            for name in path:
                obj = getattr(obj, name)
        except AttributeError:
            continue
        if isinstance(obj, int) and not isinstance(obj, bool):
            return obj
    return None


def _device_index(device: Any) -> int | None:
    """0 for torch.device("cuda", 0), "cuda:0", "cuda" or 0."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    index = getattr(device, "index", None)
    if isinstance(index, int):
        return index
    text = str(device)
    if text.startswith("cuda"):
        _, _, rest = text.partition(":")
        return int(rest) if rest.isdigit() else 0
    return None


def _card_total(impl: ModuleType, device: Any) -> int | None:
    """The card's total bytes from the probe, or None (no cap)."""
    index = _device_index(device)
    if index is None:
        return None
    for entry in _probe(impl).get("devices") or ():
        if entry.get("index") == index and _is_byte_value(entry.get("total")):
            return int(entry["total"])
    return None
