"""Pure-Python reference implementation of comfy_standin.

The same contract as the C implementation (docs/semantics.md; the ledger
mirrors include/comfy_standin/ledger.h), written for clarity rather than
speed.  The test-suite runs every test against both; the benchmarks
measure the C one against this.

Thread safety: every write to a worker's books and to its models' receipts
happens under that worker's ``threading.Lock``.  A receipt is one tuple
replaced whole, so a reader never sees a torn (loaded, seq) pair and never
takes a lock.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from . import pool as _pool
from .pool import register

__all__ = [
    "EchoError",
    "Ledger",
    "ModelRecord",
    "Pool",
    "StandIn",
    "WorkerBooks",
    "WorkerGoneError",
    "apply_echo",
    "apply_residency",
    "default_pool",
    "raise_peak",
    "register",
]

VALUE_MAX = 2**63 - 1
SATURATED = 2**64 - 1
DEFAULT_FLOOR = _pool.DEFAULT_FLOOR
SOURCES = (
    "registered",
    "load echo",
    "unload echo",
    "detach echo",
    "census",
    "board",
    "assigned",
    "worker gone",
)

_BYTES = "an int in [0, 2**63-1]"

log = logging.getLogger("comfy_standin")


class EchoError(ValueError):
    """A bad echo, census, report or command reply; nothing was applied."""


class WorkerGoneError(RuntimeError):
    """A load was asked of a worker that died or restarted."""


# ---- values ---------------------------------------------------------------


def _is_int(value: object) -> bool:
    # By the real type: isinstance() would believe a __class__ property.
    kind = type(value)
    return issubclass(kind, int) and not issubclass(kind, bool)


def _as_int(value: object) -> int | None:
    """An int (subclass or not) as an exact int read from its digits, or
    None: no __index__, __int__ or comparison of the caller's runs."""
    return int.__index__(value) if _is_int(value) else None  # type: ignore


def _is_str(value: object) -> bool:
    return issubclass(type(value), str)


def _exact_str(value: str) -> str:
    """An exact str copy of a str (subclass or not): hashing or comparing
    it never runs the caller's code."""
    return str.__str__(value)


def _utf8_ok(value: str) -> bool:
    try:
        str.encode(value, "utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _host_bytes(field: str, value: object) -> int:
    """A byte value given by the host: TypeError / ValueError."""
    number = _as_int(value)
    if number is None:
        raise TypeError(f"{field}: expected {_BYTES}, got {value!r}")
    if not 0 <= number <= VALUE_MAX:
        raise ValueError(f"{field}: expected {_BYTES}, got {value!r}")
    return number


#: The longest model id, in bytes of UTF-8 (the C core's CS_MODEL_ID_MAX).
MODEL_ID_MAX = 65535


def _host_id(field: str, value: object) -> str:
    if not _is_str(value):
        raise TypeError(f"{field}: expected a non-empty str, got {value!r}")
    if str.__len__(value) == 0:  # type: ignore[arg-type]
        raise ValueError(f"{field}: expected a non-empty str, got {value!r}")
    # The id travels as UTF-8 (the C core's table, the board, the worker's
    # transport): a lone surrogate has no UTF-8 form.
    if not _utf8_ok(value):  # type: ignore[arg-type]
        raise ValueError(
            f"{field}: expected a str encodable as UTF-8 (no lone "
            f"surrogates), got {value!r}"
        )
    if str.__len__(value) > MODEL_ID_MAX // 4:  # type: ignore[arg-type]
        size = len(str.encode(value, "utf-8"))  # type: ignore[arg-type]
        if size > MODEL_ID_MAX:
            raise ValueError(f"{field}: {size} bytes of UTF-8, longer than "
                             f"a model id may be ({MODEL_ID_MAX})")
    return _exact_str(value)  # type: ignore[arg-type]


def _echo_bytes(field: str, value: object, size: int | None = None) -> int:
    """A byte value that came from a worker: EchoError."""
    number = _as_int(value)
    if number is None or not 0 <= number <= VALUE_MAX:
        raise EchoError(f"{field}: expected {_BYTES}, got {value!r}")
    if size is not None and number > size:
        raise EchoError(
            f"{field}: expected an int in [0, {size}] (the model's size), "
            f"got {value!r}"
        )
    return number


def _echo_seq(field: str, value: object) -> int | None:
    if value is None:
        return None
    number = _as_int(value)
    if number is None or not 0 <= number <= VALUE_MAX:
        raise EchoError(f"{field}: expected None or {_BYTES}, got {value!r}")
    return number


def _live(weak: Any) -> list[Any]:
    """The live objects of a WeakValueDictionary or a WeakSet, read as
    _snapshot() reads a dict: one list of its weak references, made in one
    C-level step, then dereferenced.  Iterating the weak container itself
    runs Python between entries (its generator), where CPython 3.12+ may
    run a collection whose finalizer adds an entry: "changed size during
    iteration"."""
    data = weak.data
    refs = list(data.values()) if isinstance(data, dict) else list(data)
    return [obj for obj in (ref() for ref in refs) if obj is not None]


def _snapshot(table: dict[Any, Any]) -> list[Any]:
    """The values of `table` as a new list, whatever a collection does to
    the table meanwhile.  ``list(d.values())`` allocates the list and the
    iterator before it reads the table and nothing while it does, so a
    finalizer that adds or removes entries (any allocation may run the
    collector) runs before the read or after it; ``d.copy()`` is not safe
    (on 3.10 and 3.11 it reads the table's size after an allocation)."""
    return list(table.values())


def _saturate(value: int) -> int:
    return min(value, SATURATED)


def _request(value: object, limit: int) -> int:
    """Bytes to ask a worker for: `limit` for 0, None, negative, NaN,
    infinite, unusable or >= `limit` (ComfyUI passes 1e32 for "all");
    otherwise the value rounded UP: ComfyUI keeps an entry only when
    ``freed >= memory_to_free``, and load_models_gpu's targets are floats,
    so a worker asked for the truncated figure would always fall short."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return limit
    if isinstance(value, int):
        return limit if value <= 0 or value >= limit else value
    try:
        number = float(value)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 -- an unreadable amount: everything
        return limit
    if math.isnan(number) or math.isinf(number):
        return limit
    if number <= 0 or number >= limit:
        return limit
    return min(limit, math.ceil(number))


def _describe(exc: BaseException) -> str:
    """"TimeoutError: worker busy" (the type alone for an empty message):
    the cause every log line of the command paths carries."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 -- a log line must not raise
        text = "<str() failed>"
    return f"{name}: {text}" if text else name


def _bad_type(field: str, expected: str, value: object) -> NoReturn:
    raise TypeError(f"{field}: expected {expected}, got {value!r}")


# ---- the ledger -----------------------------------------------------------


class ModelRecord:
    """One worker model's receipt, shared by every stand-in of that
    (worker, generation, id).  Written only under its books' lock."""

    __slots__ = (
        "__weakref__",
        "_bad_replies",
        "_deferred",
        "_peak",
        "_receipt",
        "_writes",
        "books",
        "generation",
        "model_id",
        "size",
    )

    def __init__(
        self,
        books: WorkerBooks,
        model_id: str,
        size: int,
        generation: int,
        source: str,
    ) -> None:
        self.books = books
        self.model_id = model_id
        self.size = size
        self.generation = generation
        # (loaded bytes, worker seq or None, monotonic ns, source)
        self._receipt: tuple[int, int | None, int, str] = (
            0,
            None,
            time.monotonic_ns(),
            source,
        )
        self._peak = 0
        self._deferred = False
        self._writes = 0
        # Malformed replies about this model, whichever of its stand-ins
        # got them (the C record counts them the same way).
        self._bad_replies = 0

    def __repr__(self) -> str:
        loaded, seq, _, source = self.read()
        return (
            f"<ModelRecord {self.model_id!r} gen {self.generation}: "
            f"{loaded}/{self.size} bytes, seq {seq}, {source}>"
        )

    @property
    def stale(self) -> bool:
        """The model's generation is over, or its worker is gone."""
        books = self.books
        return self.generation < books.generation or not books.alive

    @property
    def loaded(self) -> int:
        return 0 if self.stale else self._receipt[0]

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def eviction_deferred(self) -> bool:
        return self._deferred

    @property
    def write_count(self) -> int:
        return self._writes

    def read(self) -> tuple[int, int | None, int, str]:
        """(loaded, seq or None, monotonic ns, source); 0 when stale."""
        loaded, seq, written, source = self._receipt
        if self.stale:
            loaded = 0
        return loaded, seq, written, source

    def _write_locked(
        self,
        loaded: int,
        seq: int | None,
        source: str,
        peak: int,
    ) -> None:
        before, kept_seq, _, _ = self._receipt
        self._receipt = (
            loaded,
            kept_seq if seq is None else seq,
            time.monotonic_ns(),
            source,
        )
        self._peak = peak
        self._deferred = False
        self._writes += 1
        if loaded < before:
            self.books._released()

    def _peak_for(self, loaded: int, unmapped: bool, in_flight: bool) -> int:
        if unmapped:
            return 0
        if in_flight:
            return max(self._peak, loaded)
        return loaded

    def echo(
        self,
        loaded: int,
        seq: int | None,
        source: str | None,
        unmapped: bool,
        in_flight: bool | None,
    ) -> bool:
        """Write a command echo (validated by the caller).  `source` None
        derives it; `in_flight` None asks the worker's in-flight count.
        An echo whose seq is strictly older than the receipt's writes
        nothing (two replies applied out of order: the newer is written
        already); a tie, a receipt with no seq, or no seq writes."""
        with self.books._lock:
            if self.stale:
                return False
            kept = self._receipt[1]
            if seq is not None and kept is not None and seq < kept:
                return False
            if source is None:
                if unmapped:
                    source = "detach echo"
                elif loaded < self._receipt[0]:
                    source = "unload echo"
                else:
                    source = "load echo"
            if in_flight is None:
                in_flight = self.books._in_flight > 0
            peak = self._peak_for(loaded, unmapped, in_flight)
            self._write_locked(loaded, seq, source, peak)
            return True

    def lost(self) -> bool:
        """The worker no longer knows the model ("not registered")."""
        with self.books._lock:
            if self.stale:
                return False
            self._write_locked(0, None, "worker gone", 0)
            return True

    @property
    def bad_replies(self) -> int:
        return self._bad_replies

    def add_bad_reply(self) -> None:
        with self.books._lock:
            self._bad_replies += 1

    def set_deferred(self, value: bool = True) -> None:
        with self.books._lock:
            self._deferred = value

    def gone(self) -> None:
        """This model's process died, whether or not its books still hold
        it in their table (a forgotten worker's do not): receipt 0 /
        "worker gone" (seq kept), peak 0, not deferred.  Idempotent."""
        with self.books._lock:
            loaded, _, _, source = self._receipt
            if source != "worker gone" or loaded or self._peak:
                self._write_locked(0, None, "worker gone", 0)


class WorkerBooks:
    """One worker's books: generation, liveness, calls in flight, its last
    report, and the table of its current generation's models."""

    __slots__ = (
        "__weakref__",
        "_alive",
        "_floor",
        "_generation",
        "_held",
        "_in_flight",
        "_ledger",
        "_lock",
        "_orphans",
        "_overhead",
        "_pinned",
        "_reading",
        "_roster",
        "_table",
        "key",
    )

    def __init__(self, ledger: Ledger, key: Any, generation: int) -> None:
        self.key = key
        self._ledger: Ledger | None = ledger
        self._floor = ledger.floor
        # Reentrant: any allocation made under it may run the collector,
        # and a finalizer may register a model of this worker.
        self._lock = threading.RLock()
        self._generation = generation
        self._alive = True
        self._in_flight = 0
        self._held = 0
        self._pinned = 0
        self._overhead = 0
        self._reading = 0
        # A model leaves the table when no stand-in holds it any more
        # (cs_model_release_handle), at a restart, or when forgotten.
        self._table: weakref.WeakValueDictionary[str, ModelRecord] = (
            weakref.WeakValueDictionary()
        )
        # The table's models when the pool forgot the worker: off the
        # table (no census finds them), still this process's models, so
        # its death zeroes them as it does the table's.
        self._orphans: weakref.WeakSet[ModelRecord] = weakref.WeakSet()
        # The roster: the worker's live stand-ins in adoption order, as
        # {id(stand-in): weak reference}.  Each change is one dict
        # operation and a snapshot is one list(values()), all atomic under
        # the GIL and safe against a collection (and its finalizers)
        # running in the middle (_snapshot), so it needs no lock a
        # finalizer could find held.
        self._roster: dict[int, weakref.ref[StandIn]] = {}

    def __repr__(self) -> str:
        state = "alive" if self._alive else "gone"
        return (
            f"<WorkerBooks of {self.key!r}: gen {self._generation}, "
            f"{state}, {self._in_flight} in flight, "
            f"{len(self._table)} models>"
        )

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _released(self) -> None:
        ledger = self._ledger
        if ledger is not None:
            ledger._released = True

    def _clear_locked(self) -> None:
        """What a dead process leaves: no calls, no report, no reading."""
        self._in_flight = 0
        self._held = self._pinned = self._overhead = 0
        self._reading = 0

    def register(
        self, model_id: str, size: int, generation: int
    ) -> ModelRecord:
        model_id = _host_id("model_id", model_id)
        size = _host_bytes("size", size)
        generation = _host_bytes("generation", generation)
        with self._lock:
            if generation < self._generation:
                # A stand-in of a generation already over: it still
                # answers, reading 0, outside the table.
                return ModelRecord(
                    self, model_id, size, generation, "worker gone"
                )
            if generation > self._generation:
                self._bump_locked(generation)
            record = self._table.get(model_id)
            if record is not None:
                if record.size != size:
                    raise ValueError(
                        f"model {model_id!r} is registered with size "
                        f"{record.size}; cannot register it again with "
                        f"size {size}"
                    )
                return record
            record = ModelRecord(
                self, model_id, size, generation, "registered"
            )
            self._table[model_id] = record
            return record

    def find(self, model_id: str) -> ModelRecord | None:
        if not _is_str(model_id) or not _utf8_ok(model_id):
            return None
        return self._table.get(_exact_str(model_id))

    def _bump_locked(self, generation: int) -> None:
        for record in _live(self._table):
            seq = record._receipt[1]
            record._write_locked(0, seq, "worker gone", 0)
        self._table.clear()
        self._generation = generation
        self._alive = True
        self._clear_locked()
        self._released()

    def bump(self, generation: int) -> None:
        """A restart under a newer `generation`."""
        generation = _host_bytes("generation", generation)
        with self._lock:
            if generation <= self._generation:
                raise ValueError(
                    f"generation: a restart needs a generation above "
                    f"{self._generation}, got {generation!r}"
                )
            self._bump_locked(generation)

    def gone(self) -> None:
        """The worker's process died.  Idempotent."""
        with self._lock:
            if not self._alive:
                return
            self._alive = False
            for record in [*_live(self._table), *_live(self._orphans)]:
                record._write_locked(0, None, "worker gone", 0)
            self._orphans = weakref.WeakSet()
            self._clear_locked()
            self._released()

    def begin_call(self) -> None:
        with self._lock:
            if self._alive:
                self._in_flight += 1

    def end_call(self) -> None:
        with self._lock:
            if not self._alive:
                return
            if self._in_flight == 0:
                raise RuntimeError(
                    f"end_call on worker {self.key!r} with no call in "
                    f"flight (begin_call missing)"
                )
            self._in_flight -= 1

    def set_report(
        self,
        held: int | None = None,
        pinned: int | None = None,
        overhead: int | None = None,
    ) -> None:
        figures = (
            None if held is None else _echo_bytes("held", held),
            None if pinned is None else _echo_bytes("pinned", pinned),
            None if overhead is None else _echo_bytes("overhead", overhead),
        )
        new_held, new_pinned, new_overhead = figures
        with self._lock:
            if not self._alive:
                return  # a dead process's figures mean nothing (like gone)
            if new_held is not None:
                if new_held < self._held:
                    self._released()
                self._held = new_held
            if new_pinned is not None:
                self._pinned = new_pinned
            if new_overhead is not None:
                self._overhead = new_overhead

    def set_reading(self, used: int) -> None:
        used = _host_bytes("used", used)
        with self._lock:
            if used < self._reading:
                self._released()  # a measured drop is a release receipt
            self._reading = used

    def apply_census(self, census: object) -> int:
        # Read and checked whole before the lock: the caller's code (a
        # mapping entry's get()) may call back into these books.
        snapshot = _census_snapshot(census)
        with self._lock:
            entries = _census_targets(
                snapshot,
                self._table.get,
                " (no stand-in is registered for it on this worker)",
            )
            if not self._alive:
                return 0
            in_flight = self._in_flight > 0
            return sum(
                _apply_entry_locked(record, resident, seq, in_flight)
                for record, resident, seq in entries
            )

    def _figures(self) -> dict[int, int]:
        """{id(record): figure} for the models whose stand-ins read a board:
        what their loaded_size() answers (a newer board reading wins over
        the receipt), so the charge and the stand-ins agree."""
        figures: dict[int, int] = {}
        for standin in self.standins():
            if standin._board is not None:
                figures.setdefault(id(standin._record), standin._loaded())
        return figures

    def charge(self) -> dict[str, Any]:
        figures = self._figures()  # the board reads take no lock
        with self._lock:
            if not self._alive:
                return {
                    "charge": 0,
                    "sum_sizes": 0,
                    "sum_loaded": 0,
                    "sum_peak": 0,
                    "held": 0,
                    "reading": 0,
                    "floor": 0,
                    "in_flight": 0,
                    "models": 0,
                    "alive": False,
                    "held_from_reading": False,
                }
            records = _live(self._table)
            sum_sizes = _saturate(sum(r.size for r in records))
            sum_loaded = _saturate(
                sum(figures.get(id(r), r._receipt[0]) for r in records)
            )
            sum_peak = _saturate(sum(r._peak for r in records))
            # The driver's reading counts the CUDA context the floor
            # stands for.
            beyond = max(0, self._reading - self._floor)
            if self._in_flight > 0:
                charge = _saturate(sum_sizes + self._floor)
            else:
                charge = _saturate(
                    max(sum_loaded, sum_peak, self._held, beyond)
                    + self._floor
                )
            return {
                "charge": charge,
                "sum_sizes": sum_sizes,
                "sum_loaded": sum_loaded,
                "sum_peak": sum_peak,
                "held": self._held,
                "reading": self._reading,
                "floor": self._floor,
                "in_flight": self._in_flight,
                "models": len(records),
                "alive": True,
                "held_from_reading": beyond > self._held,
            }

    def standins(self) -> list[StandIn]:
        """The worker's live stand-ins (its roster), in adoption order."""
        refs = _snapshot(self._roster)
        return [s for s in (ref() for ref in refs) if s is not None]

    def _enlist(self, standin: StandIn) -> None:
        """Lists `standin` on the roster until it dies."""
        key = id(standin)
        roster = self._roster

        def gone(ref: weakref.ref[StandIn]) -> None:
            if roster.get(key) is ref:
                del roster[key]

        roster[key] = weakref.ref(standin, gone)

    def _forgotten(self) -> None:
        with self._lock:
            if self._alive:
                self._orphans.update(_live(self._table))
            self._table.clear()
            self._ledger = None


class Ledger:
    """Every worker's books, and the reserve they size."""

    __slots__ = ("_books", "_floor", "_lock", "_published", "_released")

    def __init__(self, floor: int = DEFAULT_FLOOR) -> None:
        self._floor = _host_bytes("floor", floor)
        self._lock = threading.Lock()
        # id(key) -> books (the books hold the key, so the id stays valid).
        self._books: dict[int, WorkerBooks] = {}
        self._released = False
        self._published: int | None = None

    def __repr__(self) -> str:
        return f"<Ledger: {len(self._books)} workers, floor={self._floor}>"

    @property
    def floor(self) -> int:
        return self._floor

    def worker(self, key: Any, generation: int) -> WorkerBooks:
        """Get-or-create the books of `key` (compared by identity)."""
        generation = _host_bytes("generation", generation)
        books = self._books.get(id(key))
        if books is None:
            # Made first, then filed with one atomic dict operation: the
            # making may run the collector, and a finalizer may file this
            # worker's books meanwhile (then those are the books).
            fresh = WorkerBooks(self, key, generation)
            books = self._books.setdefault(id(key), fresh)
            if books is fresh:
                return books
        with books._lock:
            if generation > books._generation:
                books._bump_locked(generation)
        return books

    def find(self, key: Any) -> WorkerBooks | None:
        return self._books.get(id(key))

    def forget(self, key: Any) -> WorkerBooks | None:
        """Takes the books of `key` off the ledger, roster and all, in one
        step; returns them (None when there were none)."""
        books = self._books.pop(id(key), None)
        if books is not None:
            books._forgotten()
        return books

    def books(self) -> list[WorkerBooks]:
        """Every worker's books, oldest first (a snapshot)."""
        return _snapshot(self._books)

    def keys(self) -> list[Any]:
        return [books.key for books in self.books()]

    def total_charge(self) -> int:
        return _saturate(sum(b.charge()["charge"] for b in self.books()))

    def reread_boards(self) -> None:
        """Nothing to do: this implementation reads a board in full on
        every call (docs/semantics.md, "Which word wins")."""

    def reserve(self, base: int, total: int, process_local: bool) -> int:
        base = _host_bytes("base", base)
        total = _host_bytes("total", total)
        if not isinstance(process_local, bool):
            _bad_type("process_local", "a bool", process_local)
        if not process_local:
            return base
        with self._lock:
            # Swap the mark first: a release racing this call is either
            # seen now or kept for the next call, never lost.
            released, self._released = self._released, False
            books = self.books()
            total_charge = _saturate(sum(b.charge()["charge"] for b in books))
            target = _saturate(base + total_charge)
            cap = total * 3 // 4 if total > 0 else None
            if cap is not None:
                target = min(target, cap)
            target = max(target, base)
            last = self._published
            if last is None or target >= last or released:
                value = target
            else:
                value = last
            if cap is not None:
                # The cap holds for a kept value too (the card's size may
                # arrive after the first call, or the base may drop): a
                # reserve above 75% of the card would starve ComfyUI.
                value = max(min(value, cap), base)
            self._published = value
            return value


# ---- receipts -------------------------------------------------------------


def _census_snapshot(
    census: object, path: str = "census"
) -> list[tuple[str, int, int | None]]:
    """Read a whole census, then check it whole: [(exact id, resident,
    seq)] or EchoError naming the first bad field.

    The caller's code (a mapping entry's ``get``, a str-subclass key's
    ``__eq__``) runs only while reading, before anything is checked, looked
    up or applied; the ids returned are exact strs."""
    if isinstance(census, list):
        items = tuple(list.__iter__(census))  # not an overridden __iter__
    elif isinstance(census, tuple):
        items = tuple(tuple.__iter__(census))
    else:
        raise EchoError(
            f"{path}: expected a list or tuple of mappings, got {census!r}"
        )
    read = []
    for index, entry in enumerate(items):
        if type(entry) is not dict and not isinstance(entry, Mapping):
            raise EchoError(
                f"{path}[{index}]: expected a mapping, got {entry!r}"
            )
        read.append(tuple(entry.get(key) for key in _CENSUS_KEYS))
    seen: dict[str, int] = {}
    entries = []
    for index, (model_id, resident, seq, device) in enumerate(read):
        where = f"{path}[{index}]"
        if not _is_str(model_id) or str.__len__(model_id) == 0:
            raise EchoError(
                f"{where}['id']: expected a non-empty str, got {model_id!r}"
            )
        resident = _echo_bytes(f"{where}['resident']", resident)
        seq = _echo_seq(f"{where}['seq']", seq)
        if device is not None and not _is_str(device):
            raise EchoError(
                f"{where}['device']: expected None or a str, got {device!r}"
            )
        model_id = _exact_str(model_id)
        if not _utf8_ok(model_id):
            raise EchoError(
                f"{where}['id']: not encodable as UTF-8 (a lone "
                f"surrogate), so no stand-in has it: {model_id!r}"
            )
        if model_id in seen:
            raise EchoError(
                f"{where}['id']: duplicate model id {model_id!r} "
                f"(also {path}[{seen[model_id]}])"
            )
        seen[model_id] = index
        entries.append((model_id, resident, seq))
    return entries


_CENSUS_KEYS = ("id", "resident", "seq", "device")


def _census_targets(
    snapshot: list[tuple[str, int, int | None]],
    lookup: Callable[[str], Any],
    where: str,
    path: str = "census",
) -> list[tuple[Any, int, int | None]]:
    """[(target, resident, seq)] for a checked census; `lookup(id)` (by
    exact str) finds the target, None when unknown (EchoError)."""
    entries = []
    for index, (model_id, resident, seq) in enumerate(snapshot):
        target = lookup(model_id)
        if target is None:
            raise EchoError(
                f"{path}[{index}]['id']: unknown model id {model_id!r}"
                f"{where}"
            )
        entries.append((target, resident, seq))
    return entries


def _apply_entry_locked(
    record: ModelRecord, resident: int, seq: int | None, in_flight: bool
) -> bool:
    """One validated census entry; the books' lock is held."""
    if record.stale:
        return False
    kept = record._receipt[1]
    if seq is not None and kept is not None and seq < kept:
        return False  # strictly older: dropped (a tie goes to the census)
    loaded = min(resident, record.size)
    peak = record._peak_for(loaded, False, in_flight)
    record._write_locked(loaded, seq, "census", peak)
    return True


def apply_echo(
    standin: StandIn,
    resident: int,
    seq: int | None = None,
    unmapped: bool = False,
    in_flight: bool = False,
) -> bool:
    """Write a command echo: the worker's word after a command.

    Written unless its seq is strictly older than the receipt's (then
    False: the newer word is written already); ``seq=None`` keeps the
    receipt's seq.  Returns False, writing nothing, for a stale stand-in
    or a gone worker too."""
    unmapped = bool(unmapped)  # the caller's __bool__ runs first, as in C
    in_flight = bool(in_flight)
    if not isinstance(standin, StandIn):
        _bad_type("standin", f"a StandIn of {__name__}", standin)
    record = standin._record
    resident = _echo_bytes("resident", resident, record.size)
    seq = _echo_seq("seq", seq)
    # The source compares with the receipt the echo replaces, never with a
    # board reading (docs/semantics.md, "Receipts").
    return record.echo(resident, seq, None, unmapped, in_flight)


def raise_peak(standin: StandIn, resident: object) -> bool:
    """Raises the admission peak only (never lowers, never writes the
    receipt): comfy-env's peak pass for calls with no node boundary.
    False when stale."""
    if not isinstance(standin, StandIn):
        raise TypeError(
            f"standin: expected a comfy_standin._reference.StandIn, "
            f"got {standin!r}"
        )
    value = _echo_bytes("resident", resident)
    record = standin._record
    with record.books._lock:
        if record.stale:
            return False
        record._peak = max(record._peak, min(value, record.size))
        return True


def _standins_table(standins: object) -> dict[str, StandIn]:
    """The map read once through its ``items()`` (the only code of the
    map's that runs) into {exact id: stand-in}.  Every value must be a
    stand-in filed under its own id, named by the census or not."""
    if not isinstance(standins, Mapping):
        _bad_type("standins", "a mapping of model id to StandIn", standins)
    table: dict[str, StandIn] = {}
    for pair in tuple(standins.items()):
        if type(pair) is not tuple or len(pair) != 2:
            raise TypeError(
                f"standins.items(): expected (key, value) pairs, got {pair!r}"
            )
        key, standin = pair
        if not isinstance(standin, StandIn):
            raise EchoError(
                f"standins[{key!r}]: expected a StandIn of {__name__}, "
                f"got {standin!r}"
            )
        model_id = standin._record.model_id
        # Compares the characters: no __eq__ of a str subclass runs.
        if not _is_str(key) or not str.__eq__(key, model_id):
            raise EchoError(
                f"standins[{key!r}]: the stand-in is for model {model_id!r}"
            )
        table[_exact_str(key)] = standin
    return table


def apply_residency(standins: Mapping[str, StandIn], census: object) -> int:
    """Apply a node-boundary census to stand-ins; returns entries applied.

    Call it at a node boundary, never inside ComfyUI's ``free_memory``
    (which snapshots sort keys, then re-reads them).  All or nothing: any
    problem raises EchoError and changes nothing.  Ids the census lacks
    keep their receipts (missing means unknown, not zero).  The map and
    the census are each read once, before anything is looked up: the map
    is never indexed, so a defaultdict gains no key."""
    table = _standins_table(standins)
    entries = _census_targets(
        _census_snapshot(census), table.get, " (no stand-in for it in the "
        "mapping)"
    )
    applied = 0
    for standin, resident, seq in entries:
        record = standin._record
        books = record.books
        with books._lock:
            if _apply_entry_locked(
                record, resident, seq, books._in_flight > 0
            ):
                applied += 1
    return applied


# ---- the stand-in ---------------------------------------------------------

_CONTRACT = (
    "the upstream contract changed: comfy_standin answers only the "
    "members ComfyUI is known to touch"
)


def _no_attribute(owner: str, name: str) -> NoReturn:
    if name.startswith("__") and name.endswith("__"):
        # Plain, so copy/pickle/weakref probes and getattr(x, n, default)
        # behave as they do for any object.
        raise AttributeError(name)
    raise AttributeError(f"{owner} has no attribute {name!r}; {_CONTRACT}")


def _no_pickling(obj: object) -> NoReturn:
    raise TypeError(
        f"cannot pickle {type(obj).__name__!r} object: it stands for a "
        f"model held by a live worker process"
    )


class _CloneBaseSentinel:
    """A stand-in's ``clone_base_uuid``: equal only to itself, so it never
    matches a real uuid, None or another stand-in (docs/comfyui.md,
    unload_model_and_clones and multigpu.py)."""

    __slots__ = ("_model_id",)

    def __init__(self, model_id: str) -> None:
        self._model_id = model_id

    def __repr__(self) -> str:
        return (
            f"<comfy_standin private clone_base_uuid of model "
            f"{self._model_id!r} (never equals a uuid)>"
        )

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        _no_pickling(self)


class StandIn:
    """Stands in ComfyUI's loaded-model list for a model a worker holds.

    Drop-in for comfy-env's SubprocessModelPatcher (docs/semantics.md)."""

    __slots__ = (
        "__weakref__",
        "_assigned",
        "_board",
        "_generation",
        "_kind",
        "_load_device",
        "_offload_device",
        "_pool",
        "_record",
        "_uuid",
        "_worker",
    )

    def __init__(
        self,
        worker: Any,
        worker_generation: int,
        model_id: str,
        model_size: int,
        load_device: Any,
        offload_device: Any,
        kind: str = "other",
        pool: Any = None,
    ) -> None:
        if not callable(getattr(worker, "send_command", None)) or not (
            callable(getattr(worker, "is_alive", None))
        ):
            _bad_type(
                "worker",
                "an object with callable send_command() and is_alive()",
                worker,
            )
        generation = _host_bytes("worker_generation", worker_generation)
        model_id = _host_id("model_id", model_id)
        size = _host_bytes("model_size", model_size)
        if not isinstance(kind, str):
            _bad_type("kind", "a str", kind)
        if pool is None:
            pool = default_pool()
        elif not isinstance(pool, _pool.Pool) or pool._impl is not _this:
            _bad_type("pool", f"None or a Pool of {__name__}", pool)
        ledger = pool._ledger
        known = ledger.find(worker)
        if known is not None and generation > known.generation:
            # The worker restarted, and this registration is how the host
            # learns it: the pool's restart runs first, as for any.
            pool.restarted(worker, generation)
        self._worker = worker
        self._generation = generation
        self._kind = kind
        self._load_device = load_device
        self._offload_device = offload_device
        self._pool = pool
        self._uuid = _CloneBaseSentinel(model_id)
        # (device, receipt write count when assigned) or None.
        self._assigned: tuple[Any, int] | None = None
        # (Board, slot, tag) when a live residency board is attached: the
        # tag is the host's name for this model's use of the slot, so a
        # slot given to another model since never reads as this one.
        self._board: tuple[Any, int, int] | None = None
        while True:
            books = ledger.worker(worker, generation)
            # Registered and listed on the roster the books own (the pool
            # keeps it from there for its graveyard) in one step under the
            # books' lock, and only while they are on the ledger: forget()
            # takes them off under the same lock, so no stand-in lands on
            # a roster the pool has dropped.  Forgotten meanwhile: the next
            # books are this worker's.
            with books._lock:
                if books._ledger is not ledger:
                    continue
                record = books.register(model_id, size, generation)
                self._record = record
                books._enlist(self)
                break

    def __repr__(self) -> str:
        loaded, seq, _, source = self._record.read()
        return (
            f"<StandIn {self._record.model_id!r} ({self._kind}) of worker "
            f"gen {self._generation}: {loaded}/{self._record.size} bytes, "
            f"seq {seq}, {source}>"
        )

    def __getattr__(self, name: str) -> NoReturn:
        _no_attribute("StandIn", name)

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        _no_pickling(self)

    # ---- what ComfyUI reads ----------------------------------------------

    @property
    def load_device(self) -> Any:
        return self._load_device

    @property
    def offload_device(self) -> Any:
        return self._offload_device

    @property
    def parent(self) -> None:
        return None

    @property
    def model(self) -> StandIn:
        """The stand-in itself: it is its own inner module (``M``)."""
        return self

    @property
    def clone_base_uuid(self) -> object:
        return self._uuid

    @property
    def size(self) -> int:
        return self._record.size

    def model_size(self) -> int:
        return self._record.size

    def loaded_size(self) -> int:
        return self._loaded()

    def current_loaded_device(self) -> Any:
        return self.device

    def is_dynamic(self) -> bool:
        return False  # docs/architecture.md, inaccuracy 1

    def is_clone(self, other: object) -> bool:
        return (
            isinstance(other, StandIn)
            and other._worker is self._worker
            and other._generation == self._generation
            and other._record.model_id == self._record.model_id
        )

    def model_dtype(self) -> None:
        return None

    def model_patches_to(self, device: Any) -> None:
        return None

    def model_patches_models(self) -> list[Any]:
        return []

    def get_nested_additional_models(self) -> list[Any]:
        return []

    def lowvram_patch_counter(self) -> int:
        return 0

    def clone(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            "StandIn.clone: a worker-held model has no clone semantics the "
            "host could use (its weights live in another process)"
        )

    def add_patches(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            "StandIn.add_patches: a worker-held model cannot be patched "
            "from the host (its weights live in another process)"
        )

    def add_hook_patches(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            "StandIn.add_hook_patches: a worker-held model cannot be "
            "patched from the host (its weights live in another process)"
        )

    # ---- what ComfyUI reads as the inner module (``model`` is self) -------

    def _read(self) -> tuple[int, int | None, int, str]:
        """The receipt, or the board's reading when one is attached, valid
        and newer than the receipt (source "board")."""
        record = self._record
        receipt = record.read()
        board = self._board
        if board is None or record.stale:
            return receipt
        try:
            reading = board[0].read(board[1], record.size, board[2])
        except (ValueError, OSError):  # closed since: receipts only
            return receipt
        if reading is None or reading[1] <= receipt[2]:
            return receipt
        return reading[0], receipt[1], reading[1], "board"

    def _loaded(self) -> int:
        if self._board is None:
            return self._record.loaded
        return self._read()[0]

    @property
    def device(self) -> Any:
        """The last assigned device until a receipt is written, then
        load_device while loaded > 0, offload_device at 0."""
        assigned = self._assigned
        if assigned is not None and assigned[1] == self._record._writes:
            return assigned[0]
        if self._loaded() > 0:
            return self._load_device
        return self._offload_device

    @device.setter
    def device(self, value: Any) -> None:
        self._assigned = (value, self._record._writes)

    @device.deleter
    def device(self) -> NoReturn:
        raise AttributeError("device cannot be deleted")

    @property
    def model_loaded_weight_memory(self) -> int:
        return self._loaded()

    @model_loaded_weight_memory.setter
    def model_loaded_weight_memory(self, value: int) -> None:
        record = self._record
        value = _host_bytes("model_loaded_weight_memory", value)
        if value > record.size:
            raise ValueError(
                f"model_loaded_weight_memory: expected an int in "
                f"[0, {record.size}] (the model's size), got {value!r}"
            )
        record.echo(value, None, "assigned", False, False)

    @model_loaded_weight_memory.deleter
    def model_loaded_weight_memory(self) -> NoReturn:
        raise AttributeError("model_loaded_weight_memory cannot be deleted")

    @property
    def model_lowvram(self) -> bool:
        return False

    @property
    def current_weight_patches_uuid(self) -> None:
        return None

    @property
    def model_offload_buffer_memory(self) -> int:
        return 0

    # ---- introspection ---------------------------------------------------

    @property
    def worker(self) -> Any:
        return self._worker

    @property
    def worker_generation(self) -> int:
        return self._generation

    @property
    def model_id(self) -> str:
        return self._record.model_id

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def pool(self) -> Any:
        return self._pool

    @property
    def stale(self) -> bool:
        return self._record.stale

    @property
    def eviction_deferred(self) -> bool:
        return self._record.eviction_deferred

    @eviction_deferred.setter
    def eviction_deferred(self, value: bool) -> None:
        # comfy-env's boundary writes False once it listed a refused
        # stand-in again (docs/semantics.md, "eviction_deferred").
        if type(value) is not bool:
            raise TypeError(
                f"eviction_deferred: expected a bool, got {value!r}"
            )
        self._record.set_deferred(value)

    @eviction_deferred.deleter
    def eviction_deferred(self) -> None:
        raise TypeError("eviction_deferred cannot be deleted")

    @property
    def bad_replies(self) -> int:
        return self._record.bad_replies

    def receipt(self) -> tuple[int, int | None, float, str]:
        """(loaded bytes, worker seq or None, age in seconds, source)."""
        loaded, seq, written, source = self._read()
        age = max(0, time.monotonic_ns() - written) / 1e9
        return loaded, seq, age, source

    # ---- comfy-env compatibility (read-only views of the ledger) ----------

    @property
    def _worker_generation(self) -> int:
        return self._generation

    @property
    def _model_id(self) -> str:
        return self._record.model_id

    @property
    def _residency_peak(self) -> int:
        return self._record.peak

    @property
    def _residency_seq(self) -> int:
        seq = self._record.read()[1]
        return -1 if seq is None else seq

    # ---- the live residency board ----------------------------------------

    @property
    def board(self) -> tuple[Any, int] | None:
        """(board, slot) when a residency board is attached, else None."""
        board = self._board
        return None if board is None else (board[0], board[1])

    def attach_board(self, board: Any, slot: int | None = None) -> int:
        """Reads residency from a live board (host side): loaded_size()
        then returns the board's reading when valid and newer than the
        receipt.  `slot` None finds or assigns the model's slot."""
        from . import _core  # the Board type is C: shared memory

        model_id, size = self._record.model_id, self._record.size
        if not isinstance(board, _core.Board):
            raise TypeError(
                f"attach_board: expected a comfy_standin Board, got {board!r}"
            )
        if not board.is_host:
            raise ValueError(
                f"attach_board: model {model_id!r} needs the host's side of "
                f"the board (Board.adopt), got a worker's handle"
            )
        if slot is None:
            slot = board.find(model_id)
            if slot is None:
                try:
                    slot = board.assign(model_id, size)
                except (ValueError, RuntimeError) as exc:
                    raise ValueError(
                        f"attach_board: no slot for model {model_id!r}: {exc}"
                    ) from exc
        else:
            if not _is_int(slot) or not 0 <= slot <= 2**32 - 1:
                raise (ValueError if _is_int(slot) else TypeError)(
                    f"attach_board: slot: expected an int in "
                    f"[0, {2**32 - 1}], got {slot!r}"
                )
            if board.find(model_id) != slot:
                raise ValueError(
                    f"attach_board: slot {slot!r} of the board does not carry "
                    f"model {model_id!r}"
                )
        assigned = board.assigned_size(slot)
        if assigned != size:
            raise ValueError(
                f"attach_board: slot {slot} is assigned {assigned} bytes, "
                f"model {model_id!r} has {size}"
            )
        self._board = (board, slot, board.tag(slot))
        return slot

    def detach_board(self) -> None:
        """Back to receipts only."""
        self._board = None

    # ---- commands --------------------------------------------------------

    def _is_alive(self) -> bool:
        """An is_alive() that raises an Exception counts as alive, on every
        path (the send decides); a BaseException propagates."""
        try:
            return bool(self._worker.is_alive())
        except Exception as exc:  # an undecidable probe: treat as alive
            log.warning(
                "comfy_standin: is_alive() of the worker of model %r "
                "raised %s; treating it as alive",
                self._record.model_id,
                _describe(exc),
            )
            return True

    def _evict_send(self, command: str, **params: Any) -> Any:
        """An eviction's send: through ``send_command_no_spawn(command,
        lock_timeout=0.0, ...)`` when the worker has it (comfy-env's), so
        ComfyUI's thread never waits on a worker that cannot take it now;
        its sentinels "busy" and "dead" are raised as a RuntimeError for
        the refusal paths.  Else ``send_command``."""
        try:
            no_spawn = self._worker.send_command_no_spawn
        except AttributeError:
            no_spawn = None
        if not callable(no_spawn):
            return self._worker.send_command(command, **params)
        reply = no_spawn(command, lock_timeout=0.0, **params)
        if isinstance(reply, str):
            if str.__eq__(reply, "busy"):
                raise RuntimeError(BUSY_TEXT)
            if str.__eq__(reply, "dead"):
                raise RuntimeError(DEAD_TEXT)
        return reply

    def _worker_gone(self) -> None:
        """For the pool: the worker's process died (``Pool.worker_gone``,
        also after ``Pool.forget``); this stand-in reads 0 and is stale
        from now on.  No call back into the pool; idempotent."""
        record = self._record
        if not record.stale:  # never a newer generation's books
            record.books.gone()
            record.gone()

    def _gone_error(self) -> WorkerGoneError:
        record = self._record
        return WorkerGoneError(
            f"model {record.model_id!r} (worker generation "
            f"{record.generation}) is gone: its worker process died or "
            f"restarted; reload the node"
        )

    def _gone_path(self) -> None:
        """The worker died: its VRAM went with the process."""
        record = self._record
        if record.stale:
            return  # never touch the worker's newer generation
        # The model's own record and books first: they hold whatever the
        # pool does, even when the pool forgot the worker already.  Then
        # the line (what it reports is written before it).
        record.books.gone()
        record.gone()
        log.warning(
            "comfy_standin: the worker of model %r is gone",
            record.model_id,
        )
        try:
            self._pool.worker_gone(self._worker)
        except Exception as exc:  # noqa: BLE001 -- receipts zeroed anyway
            log.warning(
                "comfy_standin: pool.worker_gone() for model %r raised %s; "
                "receipts zeroed anyway",
                record.model_id,
                _describe(exc),
            )

    def _deferred_path(self, what: str, cause: str) -> None:
        """The eviction is deferred (the receipt kept), then logged with
        `cause` (an exception's description)."""
        self._record.set_deferred()
        log.warning(
            "comfy_standin: %s of model %r deferred: %s",
            what,
            self._record.model_id,
            cause,
        )

    def _bad_reply(self, exc: EchoError, deferring: str | None) -> None:
        """Counted, the eviction marked deferred when `deferring` names the
        command, then logged (the line after what it reports)."""
        self._record.add_bad_reply()
        if deferring is not None:
            self._record.set_deferred()
        log.warning(
            "comfy_standin: bad reply for model %r: %s",
            self._record.model_id,
            _describe(exc),
        )
        if deferring is not None:
            log.warning(
                "comfy_standin: %s of model %r deferred: %s",
                deferring,
                self._record.model_id,
                _describe(exc),
            )

    def _pressure(self, wanted: int, freed: int) -> None:
        if freed >= wanted:
            return
        try:
            callback = getattr(self._pool, "on_pressure", None)
        except Exception:  # noqa: BLE001 -- no usable callback
            return
        if callback is None:
            return
        try:
            callback(wanted - freed)
        except Exception as exc:  # noqa: BLE001 -- logged, never raised
            log.warning(
                "comfy_standin: on_pressure(%d) raised %s (ignored)",
                wanted - freed,
                _describe(exc),
            )

    def partially_load(
        self,
        device_to: Any,
        extra_memory: float = 0,
        force_patch_weights: bool = False,
    ) -> int:
        """Ask the worker to load up to `extra_memory` more bytes; returns
        the bytes it loaded.  A dead worker raises WorkerGoneError."""
        record = self._record
        if record.stale:
            raise self._gone_error()
        if not self._is_alive():
            self._gone_path()
            raise self._gone_error()
        size = record.size
        if size == 0:
            return 0
        want = _request(extra_memory, size)
        before = self._loaded()
        command = "model_partial_load"
        try:
            reply = self._worker.send_command(
                command,
                model_id=record.model_id,
                extra_bytes=want,
                device=str(device_to),
            )
        except Exception as exc:
            if not self._is_alive():
                self._gone_path()
                raise self._gone_error() from exc
            raise
        try:
            loaded, resident, seq, measured = _decode_load_reply(
                reply, size, before
            )
        except EchoError as exc:
            self._bad_reply(exc, None)
            raise
        _apply_reply(record, loaded > 0, measured, resident, seq, "load echo")
        return loaded

    def partially_unload(self, *args: Any, **kwargs: Any) -> int:
        """partially_unload(device_to=None, memory_to_free=0,
        force_patch_weights=False)

        Ask the worker to free up to `memory_to_free` bytes; returns the
        bytes freed, exactly.  Never raises an Exception, not even for bad
        arguments (it runs inside ComfyUI's free_memory loop): those free
        nothing.  A BaseException propagates."""
        try:
            memory_to_free = _unload_arguments(*args, **kwargs)
        except TypeError as exc:
            log.warning(
                "comfy_standin: partially_unload of model %r called with "
                "bad arguments: %s; freed nothing",
                self._record.model_id,
                _describe(exc),
            )
            return 0
        try:
            return self._partially_unload(memory_to_free)
        except Exception as exc:  # noqa: BLE001 -- eviction never raises
            log.warning(
                "comfy_standin: partially_unload of model %r failed in the "
                "host: %s; freed nothing",
                self._record.model_id,
                _describe(exc),
            )
            return 0

    def _partially_unload(self, memory_to_free: object) -> int:
        record = self._record
        before = self._loaded()
        if before == 0:
            return 0
        want = _request(memory_to_free, before)
        if not self._is_alive():
            self._gone_path()
            return before
        try:
            reply = self._evict_send(
                "model_partial_unload",
                model_id=record.model_id,
                bytes_to_free=want,
            )
        except Exception as exc:  # noqa: BLE001 -- eviction never raises
            if not self._is_alive():
                self._gone_path()
                return before
            self._deferred_path("model_partial_unload", _describe(exc))
            self._pressure(want, 0)
            return 0
        try:
            freed, resident, seq, measured = _decode_unload_reply(
                reply, record.size, before
            )
        except EchoError as exc:
            self._bad_reply(exc, "model_partial_unload")
            self._pressure(want, 0)
            return 0
        # The bytes freed are returned whatever was written: an echo older
        # than the receipt still freed them.
        _apply_reply(record, freed > 0, measured, resident, seq,
                     "unload echo")
        self._pressure(want, freed)
        return freed

    def detach(self, *args: Any, **kwargs: Any) -> StandIn:
        """detach(unpatch_all=True)

        Full offload.  Idempotent; returns ``model``, the stand-in.  Its
        arguments (``unpatch_all``, ``unpatch_weights``) mean nothing for a
        worker-held model and are ignored, whatever they are.  Never raises
        an Exception; a BaseException propagates."""
        try:
            self._detach()
        except Exception as exc:  # noqa: BLE001 -- detach never raises
            log.warning(
                "comfy_standin: detach of model %r failed in the host: %s; "
                "receipt kept",
                self._record.model_id,
                _describe(exc),
            )
        return self

    def _detach(self) -> None:
        record = self._record
        if record.stale or self._loaded() == 0:
            return
        if not self._is_alive():
            self._gone_path()
            return
        command = "model_to_device"
        try:
            reply = self._evict_send(
                command,
                model_id=record.model_id,
                device=str(self._offload_device),
            )
        except Exception as exc:  # noqa: BLE001 -- detach never raises
            if not self._is_alive():
                self._gone_path()
            elif "not registered" in _describe(exc):
                # The worker restarted and lost the model: nothing of it
                # is on the card any more.
                record.lost()
            else:
                self._deferred_path(command, _describe(exc))
            return
        try:
            if not issubclass(type(reply), dict):
                raise EchoError(
                    f"reply from {command}: expected a dict, got {reply!r}"
                )
            seq = _echo_seq(
                f"reply['seq'] from {command}",
                _reply_value(reply, "seq", command),
            )
            moved = _reply_moved(reply, command)
        except EchoError as exc:
            self._bad_reply(exc, command)
            return
        if moved:
            record.echo(0, seq, "detach echo", True, None)
            return
        # Nothing moved (comfy-env answers so when the model's first
        # parameter is already on the offload device, whatever else is on
        # the card): no byte was freed, none is written, and the eviction
        # is deferred so the pool lists the model again.
        self._deferred_path(command, NOTHING_MOVED)


def _unload_arguments(
    device_to: Any = None,
    memory_to_free: object = 0,
    force_patch_weights: object = False,
) -> object:
    """partially_unload's arguments, as ComfyUI passes them
    (``partially_unload(offload_device, memory_to_free)``); TypeError for
    anything else."""
    return memory_to_free


def _decode_reply(
    reply: object, command: str, required: str, size: int
) -> tuple[int, int | None, int | None]:
    """(required figure, resident or None, seq or None) or EchoError.

    Read as a plain dict: a dict subclass's overridden methods are not
    called (the C type reads the dict's storage)."""
    if not issubclass(type(reply), dict):
        raise EchoError(
            f"reply from {command}: expected a dict, got {reply!r}"
        )
    value = _reply_value(reply, required, command)  # type: ignore[arg-type]
    if value is None:
        raise EchoError(
            f"reply[{required!r}] from {command}: missing ({_BYTES})"
        )
    value = _echo_bytes(f"reply[{required!r}] from {command}", value, size)
    resident = _reply_value(reply, "resident", command)  # type: ignore
    if resident is not None:
        resident = _echo_bytes(
            f"reply['resident'] from {command}", resident, size
        )
    seq = _echo_seq(
        f"reply['seq'] from {command}",
        _reply_value(reply, "seq", command),  # type: ignore[arg-type]
    )
    return value, resident, seq


def _reply_value(reply: dict[str, Any], key: str, command: str) -> Any:
    """dict.get(reply, key): the dict's own lookup.  It may still run
    __eq__ of a str-subclass key in the reply: an Exception from it is a
    bad reply (EchoError from it); a BaseException propagates."""
    try:
        return dict.get(reply, key)
    except Exception as exc:
        raise EchoError(
            f"reply[{key!r}] from {command}: looking it up raised {exc!r}"
        ) from exc


def _decode_load_reply(
    reply: object, size: int, before: int
) -> tuple[int, int, int | None, bool]:
    """(loaded, resident, seq, whether the worker measured resident)."""
    loaded, resident, seq = _decode_reply(
        reply, "model_partial_load", "loaded", size
    )
    if resident is None:  # an old worker: derive it
        return loaded, min(before + loaded, size), seq, False
    return loaded, resident, seq, True


def _decode_unload_reply(
    reply: object, size: int, before: int
) -> tuple[int, int, int | None, bool]:
    """(freed, resident, seq, whether the worker measured resident)."""
    freed, resident, seq = _decode_reply(
        reply, "model_partial_unload", "freed", size
    )
    if resident is None:  # an old worker: derive it
        return freed, max(0, before - freed), seq, False
    return freed, resident, seq, True


def _reply_moved(reply: dict[str, Any], command: str) -> bool:
    """reply['moved'] of a detach: True when something moved (True, a byte
    count above 0, or absent: an older worker that does not say), False
    when nothing did (False, or 0)."""
    value = _reply_value(reply, "moved", command)
    if value is None or value is True:
        return True
    if value is False:
        return False
    number = _as_int(value)
    if number is None or not 0 <= number <= VALUE_MAX:
        raise EchoError(
            f"reply['moved'] from {command}: expected a bool or a byte "
            f"count, got {value!r}"
        )
    return number > 0


#: The cause a deferred detach logs when its worker moved nothing.
NOTHING_MOVED = "the worker moved nothing (moved: False)"
#: What a no-spawn eviction's sentinels say (the C type's are the same).
BUSY_TEXT = ("the worker is busy: another thread holds its command lock "
             "(send_command_no_spawn answered 'busy')")
DEAD_TEXT = ("the worker's process is gone (send_command_no_spawn answered "
             "'dead')")


def _apply_reply(
    record: ModelRecord,
    moved: bool,
    measured: bool,
    resident: int,
    seq: int | None,
    source: str,
) -> None:
    """Writes what a good reply says (docs/semantics.md, "Which word
    wins"): a reply that says something moved writes its resident figure;
    one that says nothing moved writes only a resident figure above 0 that
    the worker measured, never 0."""
    if moved or (measured and resident > 0):
        record.echo(resident, seq, source, False, None)


# ---- the pool -------------------------------------------------------------

_this = sys.modules[__name__]


class Pool(_pool.Pool):
    __doc__ = _pool.Pool.__doc__
    _impl = _this


_default_pool: Pool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> Pool:
    """The process-wide pool of this implementation (created on first
    use, detecting process_local)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = Pool()
        return _default_pool
