"""The pool (what every worker costs the card) and ``register``.

One class over either implementation's ``Ledger`` (the C core or the
pure-Python reference; docs/reserve.md, docs/semantics.md "The pool").
The ledger keeps each worker's ``WorkerBooks``: its charge figures and the
list of its live stand-ins.  The pool adds what needs Python objects: the
stand-ins it holds for ComfyUI, whose list holds them only weakly, and
those of dead or restarted workers kept until the next node boundary, so
no ``weakref.finalize`` fires inside ComfyUI's ``free_memory`` loop.

An implementation binds the class with a subclass whose ``_impl`` is the
implementation's module (which provides ``Ledger`` and ``EchoError``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

from ._text import visible

__all__ = ["DEFAULT_FLOOR", "Pool", "WorkerMap", "register"]

#: CUDA context and handles of one worker process: comfy-env measured
#: 276-300 MiB per live worker before any model (docs/comfyui.md).
DEFAULT_FLOOR = 300 << 20

_VALUE_MAX = 2**63 - 1
_REPORT_FIELDS = ("held", "pinned", "overhead")

log = logging.getLogger("comfy_standin")


def _is_byte_value(value: object) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and 0 <= value <= _VALUE_MAX
    )


class WorkerMap(Mapping[Any, Any]):
    """A read-only ``{worker: value}`` keyed by identity, as the ledger keys
    workers: an unhashable worker works, and two workers that compare
    equal stay two.  It compares equal to any mapping with the same
    workers (by identity) and equal values."""

    __slots__ = ("_items",)

    def __init__(self, pairs: Iterable[tuple[Any, Any]] = ()) -> None:
        # id(worker) -> (worker, value): holding the worker keeps its id.
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

    ``on_pressure``: None, or a callable a stand-in calls with the
    shortfall in bytes when its ``partially_unload`` freed less than
    ComfyUI asked (comfy-env asks idle workers to shrink).  It must not
    block; its exceptions are logged, never raised into ComfyUI.
    """

    _impl: ModuleType | None = None

    def __init__(
        self, floor: int = DEFAULT_FLOOR, process_local: bool | None = None
    ) -> None:
        impl = type(self)._impl
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
        # Reentrant: any allocation may run the collector, and a finalizer
        # may call back in on the thread that holds the lock.
        self._lock = threading.RLock()
        # Stand-ins of dead or restarted workers, dropped at boundary().
        self._graveyard: dict[int, Any] = {}
        # Registered stand-ins (ComfyUI's list holds them only weakly),
        # released once the worker lost the model, died or restarted.
        self._held: dict[int, Any] = {}
        self.on_pressure: Callable[[int], object] | None = None
        # id(worker) -> (worker, the host side of its residency board).
        self._boards: dict[int, tuple[Any, Any]] = {}
        # id(worker) -> weak references to books forget() took off the
        # ledger, so worker_gone() still reaches their stand-ins.  Each
        # stand-in holds its books, and books hold their worker (the id
        # stays that worker's).
        self._forgotten: dict[int, list[weakref.ref[Any]]] = {}
        # reclaim(): the workers being asked, and those that said they
        # cannot release (held, so each id stays that worker's).
        self._asking: dict[int, Any] = {}
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
        """Moves the worker's `doomed` stand-ins to the graveyard.

        They stay on their books' list too: boundary() reads it to know
        whether anyone still holds a stand-in of a gone worker.  The list
        is read under the lock, as forget() drops it."""
        with self._lock:
            books = self._ledger.find(worker)
            members = [] if books is None else books.standins()
            for standin in members:
                if doomed(standin):
                    self._graveyard[id(standin)] = standin

    def standins(self) -> WorkerMap:
        """{worker: its live stand-ins}, dead or restarted workers
        included; a snapshot, for status displays."""
        return WorkerMap(
            (books.key, books.standins()) for books in self._ledger.books()
        )

    def graveyard_size(self) -> int:
        """Stand-ins kept alive until the next boundary()."""
        with self._lock:
            return len(self._graveyard)

    def _hold(self, standin: Any) -> None:
        """Keeps a registered `standin` alive (see ``boundary``)."""
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
        """Workers of held stand-ins whose ``is_alive()`` says False (one
        that raises counts as alive, as in the stand-in)."""
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
        """Moves `doomed` held stand-ins to the graveyard."""
        for key, standin in list(self._held.items()):
            if doomed(standin):
                del self._held[key]
                self._graveyard[key] = standin

    def relist(self, mm: Any) -> list[Any]:
        """Registers again every held or ``eviction_deferred`` stand-in
        that ComfyUI no longer lists and whose model is on the card
        (``loaded_size() > 0``); returns them.

        ComfyUI pops an entry after every ``model_unload``, and a worker
        may load the model back in any later call without registering it
        again (comfy-env dedups on the module): unlisted, its bytes would be
        out of ``free_memory``'s reach.  Call it at a node boundary or
        before a ``free_memory`` run on a worker's behalf, never inside
        ``free_memory``'s loop."""
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
        """Applies a reply frame's census to the stand-ins that frame made
        (`created`: model id -> stand-in); returns the entries applied.

        comfy-env applies the census before it makes the frame's stand-ins,
        at full size: a partly resident model would otherwise read its full
        size until the next census.  Other ids are ignored and a bad entry
        is skipped, as comfy-env's census never fails a boundary."""
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
        """Housekeeping between two nodes, never inside ComfyUI's
        ``free_memory`` (its loop pops entries by index).

        Marks gone the workers of held stand-ins that are no longer alive;
        with `mm` (``comfy.model_management``), ``relist(mm)`` and returns
        what it listed; releases held stand-ins whose worker reported the
        model gone ("not registered"), died or restarted (one ComfyUI
        unloaded stays held: its worker may load the model back); drops the
        graveyard, then the books of gone workers nobody holds a stand-in
        of."""
        restored: list[Any] = []
        # A board whose heartbeat went stale is read as such from here on.
        self._ledger.reread_boards()
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
            # Keys first, then entries: a finalizer run by an allocation
            # here may call back in.
            forgotten = [
                (key, refs) for key in list(self._forgotten)
                if (refs := self._forgotten.get(key)) is not None
            ]
        del buried  # finalizers (mm.cleanup_models) run here, unlocked
        for key, refs in forgotten:
            # Read unlocked (reading the stand-ins allocates).  Books off the
            # ledger never gain a stand-in, so they leave in place: a
            # forget() meanwhile appends to the same list.
            dead = [ref for ref in list(refs) if not _has_standins(ref())]
            if not dead:
                continue
            gone = {id(ref) for ref in dead}
            with self._lock:
                refs[:] = [ref for ref in refs if id(ref) not in gone]
                if not refs and self._forgotten.get(key) is refs:
                    del self._forgotten[key]
        for books in self._ledger.books():
            if books.alive or books.standins():
                continue  # alive, or someone still holds a stand-in of it
            self.forget(books.key)
        return restored

    # ---- residency boards (docs/board.md) -----------------------------------

    def own_board(self, worker: Any, board: Any) -> None:
        """Takes `board` (the host's side, ``Board.adopt``ed from the
        board the worker made) as `worker`'s: it is closed (unmapped) when
        the worker is gone, restarted or forgotten, and when the pool is.
        A board the pool held for the worker before is closed."""
        with self._lock:
            held = self._boards.get(id(worker))
            self._boards[id(worker)] = (worker, board)
        if held is not None and held[1] is not board:
            held[1].close()

    def _close_board(self, worker: Any) -> None:
        with self._lock:
            held = self._boards.pop(id(worker), None)
        if held is not None:
            held[1].close()  # unmaps; its stand-ins fall back to receipts

    # ---- workers ----------------------------------------------------------

    def worker_gone(self, worker: Any) -> None:
        """The worker's process died: its stand-ins read 0, never raise.

        Those of books forget() took off the ledger too.  The books are
        read and every stand-in marked in one locked step (forget() moves
        books in one), so a second call never returns before the first has
        marked them all."""
        with self._lock:
            books = self._ledger.find(worker)
            members = []
            if books is not None:
                books.gone()
                members = books.standins()
            refs = self._forgotten.pop(id(worker), ())
            orphans = [
                s for ref in refs for s in _standins_of(ref(), worker)
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
        """Drops the worker's books: it is no longer charged.

        Its stand-ins keep their receipts; ``worker_gone()`` still reaches
        them.  The books leave the ledger with their stand-ins in one step
        and are kept, weakly, in the same locked step, even with no
        stand-in yet (one a finalizer is making on this thread joins them
        after); boundary() drops those nobody holds a stand-in of."""
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
        count: the exit then ends nothing."""
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
        """Applies a reply frame's ``_vram_report``; returns the census
        entries applied.  Validated whole first: any problem raises
        ``EchoError`` and changes nothing."""
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
        fields: dict[str, int] = {}
        for name in _REPORT_FIELDS:
            value = vram_report.get(name)
            if value is None:
                continue
            if not _is_byte_value(value):
                raise echo_error(
                    f"{name}: expected an int in [0, 2**63-1], got {value!r}"
                )
            fields[name] = value
        applied = 0
        residency = vram_report.get("residency")
        if residency is not None:
            # All or nothing; the fields, checked above, cannot fail.
            applied = books.apply_census(residency)
        if fields:
            books.set_report(**fields)
        return applied

    # ---- charges ----------------------------------------------------------

    def worker_charges(self) -> WorkerMap:
        """{worker: bytes it costs the card} (docs/reserve.md)."""
        charges: list[tuple[Any, int]] = []
        for worker in self._ledger.keys():
            books = self._ledger.find(worker)
            if books is not None:
                charges.append((worker, books.charge()["charge"]))
        return WorkerMap(charges)

    def charge_details(self) -> WorkerMap:
        """{worker: ``books.charge()``}: the charge and what it came from
        (``held_from_reading``: the probe's per-process reading, not the
        worker's report, set the held figure)."""
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
        """Floors every worker's held figure with the VRAM the driver says
        its process uses, summed over devices; returns {worker: reading}
        for the workers read.

        `probe_result` defaults to a fresh ``probe()``; `pid_of(worker)`
        defaults to ``worker.pid``, ``worker.process.pid`` or
        ``worker._process.pid`` (comfy-env's Popen).  A worker whose pid is
        unknown or hidden keeps its last reading.  Where a device has no
        readable per-process list (NVML absent, a refused or truncated
        list), a worker found on no list reads 0: its charge is then its
        own held figure, never a stale floor."""
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

    # ---- unlisted bytes (docs/architecture.md, "Unlisted bytes") ----------

    def unlisted(self) -> WorkerMap:
        """{worker: bytes it holds on the card that none of its models
        accounts for}: its held figure (its report, or the driver's reading
        less the floor, which stands for the CUDA context the reading
        counts) less what its stand-ins answer (its allocator cache,
        allocations past comfy-env's ``.to()`` hooks); 0 for a gone
        worker."""
        out: list[tuple[Any, int]] = []
        for worker in self._ledger.keys():
            books = self._ledger.find(worker)
            if books is not None:
                out.append((worker, _unlisted_of(books.charge())))
        return WorkerMap(out)

    def reclaim(self, shortfall: object) -> int:
        """Asks idle workers with unlisted bytes, most first, to give back
        the `shortfall` ComfyUI's own eviction left (comfy-env's
        ``partial_release``); returns the bytes that came back, as each
        worker measured them and no more than it held.

        Asks run on this thread and never wait: a worker another thread is
        in answers "busy" and is skipped, a worker in a call is not asked.
        A worker that cannot release says so once.  Call it after
        ``free_memory``, never inside its loop."""
        want = _shortfall_bytes(shortfall)
        got = 0
        candidates = sorted(
            ((n, w) for w, n in self.unlisted().items() if n > 0),
            key=lambda item: -item[0],
        )
        for unlisted, worker in candidates:
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
            if not self._claim(worker):
                continue  # another thread is asking it
            try:
                reply, dead = _ask(worker, "partial_release",
                                   min(unlisted, want - got))
            finally:
                with self._lock:
                    self._asking.pop(id(worker), None)
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
            freed = min(freed, _holding(charge))
            if freed:
                books.set_report(held=max(0, charge["held"] - freed))
                got += freed
        return got

    def _claim(self, worker: Any) -> bool:
        """Marks `worker` as being asked; False when another thread is."""
        with self._lock:
            if id(worker) in self._asking:
                return False
            self._asking[id(worker)] = worker
            return True

    def _cannot_release(self, worker: Any, unlisted: int, why: str) -> None:
        with self._lock:
            if id(worker) in self._said_cannot_release:
                return
            self._said_cannot_release[id(worker)] = worker
        log.warning("comfy_standin: %s holds %d MiB that no listed model "
                    "accounts for and cannot release them (%s): ComfyUI "
                    "cannot reach them", visible(worker), unlisted >> 20,
                    visible(why))

    def reserve(self, device: Any, base: int, total: int | None = None) -> int:
        """The EXTRA_RESERVED_VRAM to publish for `device`.

        Where free memory is device-wide (Linux): `base`.  Where it is
        per process (WDDM): `base` plus every worker's charge, capped at
        75% of `total` (the card's size; None: the probe's), growing at
        once and shrinking only after a release."""
        if total is None and self._process_local:
            total = _card_total(self._impl, device)
        return self._ledger.reserve(
            base, 0 if total is None else total, self._process_local
        )


def register(mm: Any, s: Any) -> Any:
    """Insert stand-in `s` into ``mm.current_loaded_models`` (``comfy.
    model_management`` or a faithful mock) and return its ``LoadedModel``.

    A stand-in already listed gets its entry back, ``currently_used``
    reset to False, instead of a second one.  ``currently_used`` is False
    unconditionally: six of the seven readers of the list outside
    model_management filter on it, which keeps the stand-in's size out of
    their arithmetic (docs/architecture.md, inaccuracy 3).  The entry gets
    ``real_model`` and a ``model_finalizer`` as ``LoadedModel.model_load``
    would set them, because ``model_unload`` detaches the finalizer
    unconditionally; its ``atexit`` is off, since at interpreter exit
    ``cleanup_models`` may find model_management half torn down.

    ComfyUI's entry holds its model only weakly, so the stand-in's pool
    holds it from here on, lists it again at each ``boundary()`` while its
    model is on the card, and lets it go at the first boundary after its
    worker lost the model, died or restarted; never inside
    ``free_memory`` (docs/semantics.md, "The pool").  A patcher that is not
    a comfy_standin stand-in is kept by whoever made it.
    """
    try:
        owner = getattr(s, "pool", None)
    except Exception:  # noqa: BLE001 - a foreign patcher's __getattr__
        owner = None
    if isinstance(owner, Pool):
        owner._hold(s)
    for entry in list(mm.current_loaded_models):
        if getattr(entry, "model", None) is s:
            entry.currently_used = False
            return entry
    inner = s.model
    entry = mm.LoadedModel(s)
    entry.currently_used = False
    entry.real_model = weakref.ref(inner)
    finalizer = weakref.finalize(inner, mm.cleanup_models)
    finalizer.atexit = False
    entry.model_finalizer = finalizer
    mm.current_loaded_models.insert(0, entry)
    return entry


def _has_standins(books: Any) -> bool:
    return books is not None and bool(books.standins())


def _standins_of(books: Any, worker: Any) -> list[Any]:
    """The stand-ins on `worker`'s forgotten `books`, if still alive."""
    if books is None or books.key is not worker:
        return []
    return list(books.standins())


def _still_resident(s: Any) -> bool:
    """Whether `s`'s model is on the card (``loaded_size() > 0``) and its
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


def _holding(charge: Mapping[str, Any]) -> int:
    """What a worker holds beyond its CUDA context: its report, or the
    driver's reading of its process less the floor (the reading counts
    the context, which no release gives back)."""
    reading = charge.get("reading", 0) - charge.get("floor", 0)
    return max(charge.get("held", 0), reading)


def _unlisted_of(charge: Mapping[str, Any]) -> int:
    if not charge.get("alive", True):
        return 0
    return max(0, _holding(charge) - charge.get("sum_loaded", 0))


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


def _shortfall_bytes(value: object) -> int:
    """A shortfall as bytes: an int (not a bool) or a finite float; else 0."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(0, min(int.__index__(value), _VALUE_MAX))
    if isinstance(value, float) and math.isfinite(value) and value > 0:
        return min(math.ceil(value), _VALUE_MAX)
    return 0


def _ask(worker: Any, command: str, size: int) -> tuple[object, bool]:
    """One release ask that never waits for the worker's command lock:
    (reply, the worker is dead).  Never raises an ``Exception``."""
    try:
        no_spawn = getattr(worker, "send_command_no_spawn", None)
        if callable(no_spawn):
            reply = no_spawn(command, size=int(size), lock_timeout=0.0)
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
    """The implementation's GPU probe; the C one for the reference, which
    has none of its own."""
    probe = getattr(impl, "probe", None)
    if probe is None:
        probe = importlib.import_module("comfy_standin._core").probe
    return probe()


_PID_PATHS = (("pid",), ("process", "pid"), ("_process", "pid"),
              ("proc", "pid"))


def _default_pid_of(worker: Any) -> int | None:
    """comfy-env's SubprocessWorker and plain Popen-like objects."""
    # Literal (interned) names: 3.10 and 3.11's attribute cache keeps a
    # reference to every name it caches, so a name built per call leaks.
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
