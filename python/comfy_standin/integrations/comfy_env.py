"""Opt-in adapter: make an installed comfy-env use ``comfy_standin.StandIn``.

Call once at start-up, before any worker registers a model (for instance
from a custom node package's ``__init__``)::

    from comfy_standin.integrations import comfy_env
    comfy_env.install()

Before it touches anything it checks every name of comfy-env it
replaces, wraps or reads (``HOOKS``: presence, signature, the attributes
and locals it reads) and the version (``TESTED_COMFY_ENV``, the releases
tested with comfy-env's real worker); then it swaps all that it may, or
nothing, and says in one log line which: stand-ins and live boards,
stand-ins on receipts only, or not switched on (comfy-env as it was).

What it swaps, all reversibly (``uninstall()``):

- ``comfy_env.isolation.model_patcher.SubprocessModelPatcher`` becomes
  ``comfy_standin.StandIn``, which takes the same keywords.  comfy-env
  imports the name at each registration, so new stand-ins are C ones;
  stand-ins created before ``install()`` stay comfy-env's own.
- ``comfy_env.state_sync.apply_echo``, ``apply_residency`` and
  ``apply_peak_raise`` route comfy_standin stand-ins to the C state sync
  and pass every other patcher to comfy-env's originals.  They keep
  comfy-env's calling contract: they never raise an ``Exception``,
  whatever the worker's frame held, and ``apply_residency`` returns the
  ids whose receipt changed.  Every census entry is checked: one that is
  not a dict with a str ``id`` is skipped, as is one the C state sync
  rejects (comfy_standin itself rejects a whole census; here the valid
  entries are then applied one by one); the valid ones apply.  Skipped
  entries and ignored echoes are counted (``counters()``) and said once
  per kind, in one bounded line.

- ``comfy_env.isolation.pool._insert_loaded_model`` lists comfy_standin
  stand-ins through ``comfy_standin.register`` (so the pool holds them
  until their worker reports the model gone or dies) and other patchers
  as before; ``_register_new_patchers`` (comfy-env's node boundary) is
  followed by ``default_pool().census_at_creation(...)`` (the frame's
  census for the stand-ins it made) and ``default_pool().boundary(
  comfy.model_management)``: every stand-in ComfyUI dropped whose model is
  on the card is listed again, finished registrations are released; then
  the driver's reading of each worker's process floors its held figure
  (``Pool.update_readings``).  ``_handle_vram_budget`` (a worker's VRAM
  request) lists them again first (``default_pool().relist``), before the
  ``free_memory`` it runs.
- ``comfy.model_management.free_memory`` is followed, when the card is
  still short, by a fresh driver's reading and ``default_pool().reclaim(
  shortfall)``: idle workers give back bytes no listed model accounts for
  (docs/architecture.md, "Unlisted bytes").
- The default pool's ``on_pressure`` (unset before) forwards the shortfall
  to comfy-env's own pressure hook (``model_patcher._ON_PRESSURE``, which
  asks idle workers to release from a thread), as comfy-env's patcher
  does in its ``partially_unload``.

- Live residency boards (docs/board.md), on Linux with a comfy-env
  release tested with them (``TESTED_COMFY_ENV``), for every pack with
  nothing installed in the pack's environment.
  ``SubprocessWorker._ensure_started`` and ``workers.subprocess.
  popen_in_own_group`` (its only spawn of a worker process) are wrapped:
  each spawn gets a one-time handoff (``comfy_standin._handoff``: a
  private socket named, with a token, in that worker's environment only)
  and a private directory first on the worker's path holding one module,
  the stdlib-only publisher (``_comfy_standin_publisher``).  Once the
  worker is up, one ``call_module(..., "attach")`` has it load the board
  library of this installation with ctypes, make its board (a sealed
  memfd only it can write) and send the descriptor; the host checks the
  peer (SO_PEERCRED: the spawned process or its descendant), adopts the
  board read-only and keeps no descriptor.  At each node boundary the
  worker's new stand-ins ``attach_board`` it and the host sends their
  (model id -> slot, tag) bindings with one ``call_module(..., "bind")``;
  the worker publishes every change comfy-env's worker tracks, before it
  asks the host for VRAM, after its loads, and from a sampler thread.
  ``SubprocessWorker.shutdown`` closes the board.
  ``COMFY_STANDIN_NO_BOARD=1`` in ComfyUI's environment turns boards off.
  A worker whose board fails (its worker script is not the shape the
  publisher checks, a refused handoff) logs one line and stays on
  receipts.

comfy-env reads ``_residency_peak``, ``_residency_seq``,
``_worker_generation`` and friends off its stand-ins; ``StandIn`` answers
them read-only from the C ledger, so comfy-env's pool arithmetic runs
unchanged.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import importlib.resources
import logging
import os
import shutil
import sys
import tempfile
import threading
import weakref
from typing import Any, NamedTuple

import comfy_standin as cs

from .._handoff import ENV_VAR, PROTOCOL, Handoff, HandoffRefused
from .._text import LOG_TEXT_LIMIT, visible
from ..pool import _default_pid_of
from ._shapes import Hook, mismatch, where
from ._shapes import resolve as _resolve

__all__ = ["counters", "install", "installed", "uninstall"]

log = logging.getLogger("comfy_standin")

_PATCHER_MODULE = "comfy_env.isolation.model_patcher"
_SYNC_MODULE = "comfy_env.state_sync"
_POOL_MODULE = "comfy_env.isolation.pool"
_MM_MODULE = "comfy.model_management"
_SPAWN_MODULE = "comfy_env.isolation.workers.subprocess"
_WORKER_CLASS = _SPAWN_MODULE + ":SubprocessWorker"
# The worker-side publisher: a module name of its own (it can shadow
# nothing of a pack's), importable only from the private directory.
_PUBLISHER = "_comfy_standin_publisher"
_BOARD_LIBRARY = "libcomfy_standin_board.so"

#: The comfy-env releases the adapter was tested with (comfy-env's real
#: worker, tests/test_comfy_env_matrix.py, run by CI for each) and what
#: each gets: "full" (stand-ins and live boards) or "receipts" (stand-ins
#: on receipts: these start workers without ``popen_in_own_group``, which
#: the board's spawn hook wraps).  0.4.43 was never published.  Any other
#: version is refused, as is one in which a check of ``HOOKS`` fails.
TESTED_COMFY_ENV = {
    "0.4.40": "receipts",
    "0.4.41": "receipts",
    "0.4.42": "receipts",
    "0.4.44": "full",
    "0.4.45": "full",
    "0.4.46": "full",
}
#: Slots per worker board, the host's heartbeat limit (seconds) and the
#: worker's sampler period (seconds).
BOARD_SLOTS = 64
HEARTBEAT_LIMIT = 5.0
SAMPLE_PERIOD = 0.05

# (module, attribute) -> the original object, while installed.
# "module:Class" names a class attribute.
_originals: dict[tuple[str, str], Any] = {}


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    return bool(_originals)


def install() -> bool:
    """Swap comfy_standin into comfy-env as far as the installed comfy-env
    allows, and say in one log line what it got.  Idempotent.

    Every name in ``HOOKS`` is checked first.  Returns True when installed
    (now or before): with live boards, or with stand-ins on receipts when
    boards are off (a check of theirs failed, COMFY_STANDIN_NO_BOARD, not
    Linux, no board library).  Returns False, with comfy-env as it was,
    when this comfy-env is refused: a version not in ``TESTED_COMFY_ENV``,
    a check of the stand-in swap failed, or a swap raised (what was
    swapped before it is put back).  Raises ImportError when comfy-env (or
    the ``comfy`` package it imports) is not importable.
    """
    if _originals:
        return True
    importlib.import_module(_PATCHER_MODULE)
    version = _comfy_env_version()
    plan = _plan(version)
    if plan.verdict in ("untested", "shape"):
        _say(plan, version)
        return False
    swapped: list[tuple[Hook, Any, Any]] = []
    hook = None
    try:
        for hook in plan.hooks:
            owner = _resolve(hook.target)
            original = getattr(owner, hook.name)
            setattr(owner, hook.name, hook.wrap(original))
            swapped.append((hook, owner, original))
    except BaseException as exc:
        for done, owner, original in reversed(swapped):
            setattr(owner, done.name, original)
        if not isinstance(exc, Exception):
            raise
        log.warning(
            f"comfy_standin: not switched on: putting "
            f"{where(hook)} into comfy-env {visible(version)} failed "
            f"({type(exc).__name__}: {visible(str(exc))}); comfy-env is "
            f"as it was")
        return False
    for done, _owner, original in swapped:
        _originals[(done.target, done.name)] = original
    pool = cs.default_pool()
    if pool.on_pressure is None:
        pool.on_pressure = _forward_pressure
    _say(plan, version)
    return True


def uninstall() -> None:
    """Put comfy-env's own objects back.  Idempotent."""
    while _originals:
        (target, name), original = _originals.popitem()
        setattr(_resolve(target), name, original)
    for worker in list(_boards):
        _board_done(worker)
    pool = cs.default_pool()
    if pool.on_pressure is _forward_pressure:
        pool.on_pressure = None


def _is_ours(p: Any) -> bool:
    return isinstance(p, cs.StandIn)


# What the state-sync wrappers skipped, for status displays.
_counts = {
    "census_entries_skipped": 0,
    "peak_entries_skipped": 0,
    "echoes_ignored": 0,
}
_counts_lock = threading.Lock()


def counters() -> dict[str, int]:
    """What the state-sync wrappers skipped since start-up:
    ``census_entries_skipped`` (entries of ``apply_residency`` that were
    not a dict with a str id, or that the state sync rejected; a census
    that is not a list counts once), ``peak_entries_skipped``
    (``apply_peak_raise``) and ``echoes_ignored`` (``apply_echo``)."""
    with _counts_lock:
        return dict(_counts)


def _count(name: str, n: int = 1) -> None:
    with _counts_lock:
        _counts[name] += n


_MISSING = object()


def _census_entries(census: Any) -> tuple[list[tuple[str, dict[str, Any]]],
                                          int, str | None]:
    """(id, entry) for each entry of `census` that is a dict with a str
    id, in order; how many were not; the first reason.  A census that is
    not a list or tuple is one bad entry."""
    if census is None:
        return [], 0, None
    if not isinstance(census, (list, tuple)):
        return [], 1, (f"census is a {type(census).__name__}, not a list")
    entries: list[tuple[str, dict[str, Any]]] = []
    bad, reason = 0, None
    for index, entry in enumerate(list(census)):
        mid = dict.get(entry, "id", _MISSING) if isinstance(
            entry, dict) else _MISSING
        if isinstance(mid, str):
            # An exact str: a subclass's __hash__/__eq__ never runs here.
            entries.append((str.__str__(mid), entry))
            continue
        bad += 1
        if reason is None:
            what = (f"{type(entry).__name__}, not a dict"
                    if not isinstance(entry, dict) else
                    "no id" if mid is _MISSING else
                    f"id is a {type(mid).__name__}, not a str")
            reason = f"census[{index}]: {what}"
    return entries, bad, reason


def _wrap_apply_echo(original: Any) -> Any:
    def apply_echo(
        p: Any,
        resident: int,
        seq: int | None = None,
        unmapped: bool = False,
        in_flight: bool = False,
    ) -> None:
        if not _is_ours(p):
            return original(p, resident, seq=seq, unmapped=unmapped,
                            in_flight=in_flight)
        try:
            # comfy-env's contract: clamp, never raise.
            value = 0 if unmapped else max(0, min(int(resident), p.size))
            cs.apply_echo(p, value, seq=None if seq is None else int(seq),
                          unmapped=unmapped, in_flight=in_flight)
        except Exception as exc:  # an echo must not fail an eviction
            _count("echoes_ignored")
            _note_once("echo", None,
                       f"comfy_standin: echo for model {visible(p.model_id)} "
                       f"ignored: {visible(exc)}")
        return None

    apply_echo.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_echo


def _wrap_apply_residency(original: Any) -> Any:
    def apply_residency(
        patchers: dict[str, Any],
        census: list[dict[str, Any]],
        log: Any = None,
    ) -> list[str]:
        try:
            return _apply_residency(original, patchers, census, log)
        except Exception as exc:  # comfy-env's contract: never raises
            _count("census_entries_skipped")
            _note_once("census-failed", log,
                       f"[comfy-standin] census not applied: "
                       f"{visible(exc)}")
            return []

    apply_residency.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_residency


def _apply_residency(original: Any, patchers: Any, census: Any,
                     log_fn: Any) -> list[str]:
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    for mid, p in dict(patchers or {}).items():
        (ours if _is_ours(p) else theirs)[mid] = p
    entries, bad, reason = _census_entries(census)
    changed: list[str] = []
    if theirs:
        their_entries = [e for mid, e in entries if mid in theirs]
        try:
            changed += list(original(theirs, their_entries, log=log_fn)
                            or [])
        except Exception as exc:  # comfy-env's own code, on worker data
            _note_once("census-original", log_fn,
                       f"[comfy-standin] comfy-env's census apply failed: "
                       f"{visible(exc)}")
    mine = [(mid, e) for mid, e in entries if mid in ours]
    if mine:
        before = {mid: ours[mid].loaded_size() for mid, _ in mine}
        try:
            cs.apply_residency(ours, [e for _, e in mine])
        except Exception:  # noqa: BLE001 - rejected whole: one by one
            for mid, entry in mine:
                try:
                    cs.apply_residency({mid: ours[mid]}, [entry])
                except Exception as exc:  # noqa: BLE001
                    bad += 1
                    if reason is None:
                        reason = str(exc)
        changed += [
            mid for mid in before if ours[mid].loaded_size() != before[mid]
        ]
    if bad:
        _count("census_entries_skipped", bad)
        _note_once("census-entry", log_fn, (
            f"[comfy-standin] census: {bad} bad entr"
            f"{'y' if bad == 1 else 'ies'} skipped, the valid ones applied "
            f"(first: {visible(reason)}); later ones are counted, not "
            f"logged"))
    return changed


def _wrap_apply_peak_raise(original: Any) -> Any:
    def apply_peak_raise(
        patchers: dict[str, Any], census: list[dict[str, Any]]
    ) -> None:
        try:
            _apply_peak_raise(original, patchers, census)
        except Exception:  # noqa: BLE001 - comfy-env's contract
            _count("peak_entries_skipped")

    apply_peak_raise.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_peak_raise


def _apply_peak_raise(original: Any, patchers: Any, census: Any) -> None:
    table = dict(patchers or {})
    theirs = {k: p for k, p in table.items() if not _is_ours(p)}
    entries, bad, _ = _census_entries(census)
    if theirs:
        try:
            original(theirs, [e for mid, e in entries if mid in theirs])
        except Exception:  # noqa: BLE001 - comfy-env's own code
            bad += 1
    for mid, entry in entries:
        p = table.get(mid)
        if not isinstance(p, cs.StandIn):
            continue
        try:
            resident = dict.get(entry, "resident", 0)
            if not isinstance(resident, int) or isinstance(resident, bool):
                raise TypeError("resident is not an int")
            cs.raise_peak(p, max(0, resident))
        except Exception:  # noqa: BLE001 - skipped, counted
            bad += 1
    if bad:
        _count("peak_entries_skipped", bad)


def _forward_pressure(shortfall: int) -> None:
    """A stand-in freed less than ComfyUI asked: comfy-env's hook posts
    the ask to idle workers and returns (it is debounced)."""
    hook = getattr(
        importlib.import_module(_PATCHER_MODULE), "_ON_PRESSURE", None
    )
    if hook is not None:
        hook(shortfall)


def _wrap_insert_loaded_model(original: Any) -> Any:
    def _insert_loaded_model(p: Any) -> Any:
        if not _is_ours(p):
            return original(p)
        return cs.register(
            importlib.import_module("comfy.model_management"), p
        )

    _insert_loaded_model.__wrapped__ = original  # type: ignore[attr-defined]
    return _insert_loaded_model


def _wrap_register_new_patchers(original: Any) -> Any:
    def _register_new_patchers(env_dir: Any, worker: Any,
                               generation: Any) -> Any:
        # comfy-env applies this frame's census, then makes the stand-ins
        # of the frame's registrations at full size: the census is kept
        # for them (it consumes the worker's report).
        report = getattr(worker, "_last_vram_report", None)
        known = set(_patchers_of(env_dir))
        try:
            return original(env_dir, worker, generation)
        finally:
            # comfy-env's boundary: outside free_memory by construction.
            pool = cs.default_pool()
            try:
                census = dict.get(report, "residency") if isinstance(
                    report, dict) and _census_on() else None
                if census is not None:
                    pool.census_at_creation({
                        mid: p for mid, p in _patchers_of(env_dir).items()
                        if mid not in known and _is_ours(p)
                    }, census)
                _take_report(pool, worker, report)
                _log_relisted(pool.boundary(
                    importlib.import_module("comfy.model_management")))
                _take_readings(pool)
            except Exception:
                log.exception("comfy_standin: boundary failed (ignored)")
            try:
                _sync_board(env_dir, worker)
            except Exception:
                log.exception("comfy_standin: board binding failed "
                              "(ignored)")

    _register_new_patchers.__wrapped__ = original  # type: ignore[attr-defined]
    return _register_new_patchers


def _wrap_handle_vram_budget(original: Any) -> Any:
    def _handle_vram_budget(request: Any, worker_key: Any = None) -> Any:
        # A worker asks for room: ComfyUI's free_memory is about to run on
        # its behalf, and must reach every worker model on the card.
        try:
            _log_relisted(cs.default_pool().relist(
                importlib.import_module("comfy.model_management")))
        except Exception:
            log.exception("comfy_standin: listing before a worker's VRAM "
                          "request failed (ignored)")
        return original(request, worker_key=worker_key)

    _handle_vram_budget.__wrapped__ = original  # type: ignore[attr-defined]
    return _handle_vram_budget


def _wrap_free_memory(original: Any) -> Any:
    def free_memory(memory_required: Any, device: Any, *args: Any,
                    **kwargs: Any) -> Any:
        unloaded = original(memory_required, device, *args, **kwargs)
        # Past ComfyUI's own loop (no list is iterated here): bytes workers
        # hold that no listed model accounts for are asked back, measured.
        try:
            mm = sys.modules.get(_MM_MODULE)
            if mm is not None and device is not None \
                    and getattr(device, "type", None) not in ("cpu", "mps"):
                short = memory_required - mm.get_free_memory(device)
                if short > 0:
                    pool = cs.default_pool()
                    _take_readings(pool)  # what workers hold right now
                    pool.reclaim(short)
        except Exception:
            log.exception("comfy_standin: reclaiming unlisted bytes failed "
                          "(ignored)")
        return unloaded

    free_memory.__wrapped__ = original  # type: ignore[attr-defined]
    return free_memory


def _take_report(pool: Any, worker: Any, report: Any) -> None:
    """The frame's ``held``, ``pinned`` and ``overhead`` into the pool
    (comfy-env keeps its own copies): ``Pool.unlisted`` is measured from
    them."""
    if not isinstance(report, dict) or pool._ledger.find(worker) is None:
        return
    fields = {name: dict.get(report, name) for name in
              ("held", "pinned", "overhead") if name in report}
    try:
        pool.report(worker, fields)
    except cs.EchoError:
        pass  # a value out of range: comfy-env's copy stands alone


# Set once the probe found no NVML: it loads its libraries once per
# process, so a failed load is final and no later probe is made.
_no_readings = False


def _take_readings(pool: Any) -> None:
    """Floors each worker's held figure with the driver's reading of its
    process (``Pool.update_readings``), taken with no message: bytes a
    worker allocated since its last frame count.  Nothing with no worker
    on the pool, or once the probe found no NVML."""
    global _no_readings
    if _no_readings or not pool._ledger.keys():
        return
    # GIL released; the first call loads NVML, later ones are a few
    # driver calls per device.
    result = cs.probe()
    nvml = result.get("nvml")
    if not isinstance(nvml, dict) or nvml.get("loaded") is not True:
        _no_readings = True
        return
    pool.update_readings(result, _driver_pid)


def _driver_pid(worker: Any) -> int | None:
    """The pid the driver lists for `worker`'s memory: the worker Python
    that made its board (under a launcher such as pixi, the process
    comfy-env started is the launcher), else that process."""
    spawned = _default_pid_of(worker)
    try:
        with _boards_lock:
            state = _boards.get(worker)
    except TypeError:  # unhashable: not a worker of comfy-env's
        state = None
    if state is not None and state.spawned == spawned:
        return state.owner
    return spawned


def _patchers_of(env_dir: Any) -> dict[str, Any]:
    table = getattr(sys.modules.get(_POOL_MODULE), "_WORKER_PATCHERS", None)
    return dict(table.get(str(env_dir)) or {}) if isinstance(
        table, dict) else {}


def _census_on() -> bool:
    """comfy-env's own switch for applying censuses
    (``state_sync.RESIDENCY_ENV_VAR``: off or command-only means no)."""
    name = getattr(sys.modules.get(_SYNC_MODULE), "RESIDENCY_ENV_VAR", None)
    mode = os.environ.get(name, "boundary") if isinstance(name, str) \
        else "boundary"
    return mode.lower() not in ("off", "command", "0", "false")


def _log_relisted(restored: list[Any]) -> None:
    for s in restored:
        log.info("comfy_standin: listed model %s again: its worker holds "
                 "it on the card and ComfyUI no longer listed it",
                 visible(s.model_id))


#: Characters of one adapter log line; a longer one keeps its start and
#: its last ``_LINE_TAIL`` characters (the adapter's own closing words).
_LINE_LIMIT = 4 * LOG_TEXT_LIMIT
_LINE_TAIL = LOG_TEXT_LIMIT // 2


def _line(message: str) -> str:
    return visible(message, _LINE_LIMIT, tail=_LINE_TAIL)


def _note(log_fn: Any, message: str) -> None:
    """One bounded line through comfy-env's log function when given (it
    prints where comfy-env's own census warnings go), else ours."""
    line = _line(message)
    if log_fn is not None:
        try:
            log_fn(line)
            return
        except Exception:  # noqa: BLE001 - a broken log: ours
            pass
    log.warning("%s", line)


def _note_once(kind: str, log_fn: Any, message: str) -> None:
    """``_note`` the first time for `kind`; later ones at debug level."""
    if _first_time(kind):
        _note(log_fn, message)
    else:
        log.debug("%s", _line(message))


# ---- live residency boards (docs/board.md) ---------------------------------


class _BoardState:
    """The host's side of one worker process's board."""

    __slots__ = ("board", "spawned", "owner", "sent", "off")

    def __init__(self, board: Any, spawned: int, owner: int) -> None:
        self.board = board
        self.spawned = spawned  # the pid comfy-env spawned (maybe pixi's)
        self.owner = owner  # the worker process that made the board
        self.sent: dict[str, tuple[int, int]] = {}  # bindings it has
        self.off = False


# worker -> its current process's board (weakly: comfy-env owns workers).
_boards: weakref.WeakKeyDictionary[Any, _BoardState] = (
    weakref.WeakKeyDictionary()
)
_boards_lock = threading.Lock()
# The worker being started on this thread, and the handoff made for it
# (set by _ensure_started and popen_in_own_group).
_spawning = threading.local()
# One log line per kind, per process.  Kinds are fixed words
# ("version", "create", "worker"); the set never holds worker text.
_warned: set[str] = set()
_warned_lock = threading.Lock()
#: Distinct kinds remembered; past this every kind counts as said.
_WARNED_MAX = 64
# The directory holding this process's copy of the publisher, and only it.
_private_dir: str | None = None


def _kind_key(kind: str) -> str:
    """The fixed part of a kind: what precedes a ':' (a caller may append
    detail, "worker:<reason>"), at most 40 characters."""
    return visible(str(kind).partition(":")[0], 40)


def _first_time(kind: str) -> bool:
    key = _kind_key(kind)
    with _warned_lock:
        if key in _warned or len(_warned) >= _WARNED_MAX:
            return False
        _warned.add(key)
        return True


def _warn_once(kind: str, message: str, **worker_text: object) -> None:
    """Logs `message` once per kind, as one bounded line.

    `kind` is keyed by its fixed part (see ``_kind_key``), never by text
    a worker supplied.  With `worker_text`, `message` is a ``str.format``
    template and each value is made safe (``visible``) and bounded before
    it is put in; without, the whole message is bounded and keeps its
    last words."""
    if not _first_time(kind):
        return
    if worker_text:
        try:
            message = message.format(**{
                name: visible(value) for name, value in worker_text.items()
            })
        except Exception:  # noqa: BLE001 - a bad template: say it raw
            pass
    log.warning("%s", _line(message))


def _board_library() -> str | None:
    """The board writer shipped in this installation (a plain shared
    library a worker of any Python loads with ctypes), or None."""
    try:
        path = importlib.resources.files("comfy_standin").joinpath(
            "_lib", _BOARD_LIBRARY)
        text = os.fspath(path)  # a real file (wheel or editable build)
    except (TypeError, OSError, ModuleNotFoundError):
        return None
    return text if os.path.isfile(text) else None


def _board_layout(library: str) -> int | None:
    """The layout version the board library writes (read once)."""
    global _layout
    if _layout is None:
        try:
            import ctypes

            _layout = int(ctypes.CDLL(library).cs_board_layout_version())
        except (OSError, AttributeError, ValueError):
            return None
    return _layout


_layout: int | None = None


def _publisher_dir() -> str:
    """A private directory (mode 0700) holding a copy of the publisher and
    nothing else, made once per process and removed at exit: what goes
    first on a worker's path.  Never the host's site-packages, so the
    worker imports nothing else of this installation, and the bytecode
    its Python writes stays out of it."""
    global _private_dir
    with _boards_lock:
        if _private_dir is not None and os.path.isfile(
                os.path.join(_private_dir, _PUBLISHER + ".py")):
            return _private_dir
        source = importlib.resources.files("comfy_standin").joinpath(
            "_worker_side", _PUBLISHER + ".py").read_bytes()
        directory = tempfile.mkdtemp(prefix="comfy-standin-worker-")
        path = os.path.join(directory, _PUBLISHER + ".py")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                     | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(source)
        atexit.register(shutil.rmtree, directory, True)
        _private_dir = directory
        return directory


def _wrap_ensure_started(original: Any) -> Any:
    def _ensure_started(self: Any) -> Any:
        previous = getattr(_spawning, "worker", None)
        _spawning.worker = self
        _spawning.handoff = None
        _spawning.no_board = False
        restore = _put_publisher_on_path(self)
        try:
            result = original(self)
        except BaseException:
            _close_pending_handoff()
            raise
        finally:
            if restore is not None:
                self.sys_path = restore
            _spawning.worker = previous
        handoff = getattr(_spawning, "handoff", None)
        _spawning.handoff = None
        if handoff is not None:  # this call spawned a process
            _attach(self, handoff)
        return result

    _ensure_started.__wrapped__ = original  # type: ignore[attr-defined]
    return _ensure_started


def _put_publisher_on_path(worker: Any) -> list[Any] | None:
    """For the spawn `worker` may make now: comfy-env sends its `sys_path`
    to the worker, which puts each entry first, in order: the private
    directory, last, ends up first.  Returns the list to put back."""
    current = getattr(worker, "sys_path", None)
    if not isinstance(current, list):
        return None
    try:
        directory = _publisher_dir()
    except (OSError, ModuleNotFoundError) as exc:
        _spawning.no_board = True
        _warn_once("private-dir", (
            f"comfy_standin: cannot make the publisher's directory "
            f"({type(exc).__name__}: {exc}): no boards, stand-ins use "
            f"receipts only"))
        return None
    worker.sys_path = [*current, directory]
    return current


def _close_pending_handoff() -> None:
    handoff = getattr(_spawning, "handoff", None)
    _spawning.handoff = None
    if handoff is not None:
        handoff.close()


def _wrap_popen(original: Any) -> Any:
    def popen_in_own_group(cmd: Any, **kw: Any) -> Any:
        worker = getattr(_spawning, "worker", None)
        handoff = None
        if worker is not None and not getattr(_spawning, "no_board", False):
            _board_done(worker)  # a new process gets a new board
            try:
                handoff = Handoff()
            except OSError as exc:
                _warn_once("handoff", (
                    f"comfy_standin: cannot make a board handoff socket "
                    f"({exc}): stand-ins use receipts only"))
        env = kw.get("env")
        base = os.environ if env is None else env
        if handoff is not None or ENV_VAR in base:
            env = dict(base)
            if handoff is not None:
                env[ENV_VAR] = handoff.spec  # this worker's environment only
            else:
                del env[ENV_VAR]  # never hand on a handoff not made for it
            kw["env"] = env
        try:
            proc = original(cmd, **kw)
        except BaseException:
            if handoff is not None:
                handoff.close()
            raise
        if handoff is not None:
            handoff.spawned_pid = proc.pid
            _close_pending_handoff()  # a spawn that did not get that far
            _spawning.handoff = handoff
        return proc

    popen_in_own_group.__wrapped__ = original  # type: ignore[attr-defined]
    return popen_in_own_group


def _wrap_shutdown(original: Any) -> Any:
    def shutdown(self: Any) -> Any:
        try:
            return original(self)
        finally:
            _board_done(self)

    shutdown.__wrapped__ = original  # type: ignore[attr-defined]
    return shutdown


def _generation_of(worker: Any) -> int:
    """comfy-env's generation for the process `worker` is starting: its
    pool record's, or, on a first spawn (inside _get_or_create_worker,
    before the record exists), the one that call chose."""
    pool_module = sys.modules.get(_POOL_MODULE)
    records = getattr(pool_module, "_WORKER_POOL", None)
    for record in list(records.values() if isinstance(records, dict)
                       else ()):
        try:
            if record[0] is worker and isinstance(record[1], int):
                return int(record[1])
        except (TypeError, IndexError, KeyError):
            continue
    frame = sys._getframe(1)
    try:
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_get_or_create_worker" and code.co_filename \
                    == getattr(pool_module, "__file__", None):
                gen = frame.f_locals.get("gen")
                if isinstance(gen, int) and not isinstance(gen, bool) \
                        and gen >= 0:
                    return gen
            frame = frame.f_back
    finally:
        del frame
    gen = getattr(pool_module, "_WORKER_GENERATION", 0)
    return gen if isinstance(gen, int) and gen >= 0 else 0


def _attach(worker: Any, handoff: Handoff) -> None:
    """Right after comfy-env started `worker`'s process: the worker makes
    its board and hands it over; the host adopts it.  Never raises; on
    any failure one log line per kind and receipts for that worker."""
    name = getattr(worker, "name", "?")
    try:
        library = _board_library()
        layout = _board_layout(library) if library else None
        if library is None or layout is None:
            _warn_once(
                "library",
                "comfy_standin: the board library of this installation "
                "cannot be loaded: stand-ins of worker {name} use receipts "
                "only",
                name=name)
            return
        generation = _generation_of(worker)
        try:
            reply = worker.call_module(
                module=_PUBLISHER, func="attach", timeout=30.0,
                library=library, slots=BOARD_SLOTS, generation=generation,
                layout=layout, protocol=PROTOCOL, period=SAMPLE_PERIOD,
            )
        except Exception as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            _warn_once(
                "worker-import",
                "comfy_standin: worker {name} could not run the board "
                "publisher ({publisher}.attach: {error}): its stand-ins use "
                "receipts only",
                name=name, publisher=_PUBLISHER, error=first)
            return
        if not isinstance(reply, dict) or dict.get(reply, "ok") is not True:
            reason = visible(dict.get(reply, "reason")
                             if isinstance(reply, dict) else reply)
            _warn_once(
                _refusal_kind(reason),
                "comfy_standin: worker {name} does not publish a live board "
                "({reason}); its stand-ins use receipts only",
                name=name, reason=reason)
            return
        try:
            board, owner, strangers = handoff.collect(
                handoff.spawned_pid,
                lambda fd: cs.Board.adopt(
                    fd, BOARD_SLOTS, generation=generation,
                    heartbeat_limit=HEARTBEAT_LIMIT),
            )
        except HandoffRefused as exc:
            kinds = sorted({r.kind for r in exc.refusals}) or ["none"]
            _warn_once(
                "handoff-" + "-".join(kinds),
                "comfy_standin: worker {name}'s board was refused: "
                "{error}; its stand-ins use receipts only",
                name=name, error=str(exc))
            return
        for refusal in strangers:
            _warn_once(
                "handoff-" + refusal.kind,
                "comfy_standin: refused a connection to worker {name}'s "
                "board handoff ({detail})",
                name=name, detail=refusal.detail)
        board.expected_owner = owner
        cs.default_pool().own_board(worker, board)
        with _boards_lock:
            _boards[worker] = _BoardState(board, handoff.spawned_pid, owner)
    except Exception:
        log.exception("comfy_standin: board handoff failed (ignored); "
                      "stand-ins use receipts only")
    finally:
        handoff.close()


def _refusal_kind(reason: Any) -> str:
    """A fixed word for a worker's refusal (the log-once key: never the
    worker's own text)."""
    text = str(reason)
    for marker, kind in (("layout", "layout"), ("protocol", "protocol"),
                         ("shape", "worker-shape"), ("handoff", "handoff"),
                         ("board library", "library"),
                         ("make a board", "make")):
        if marker in text:
            return "worker-" + kind
    return "worker-other"


def _board_done(worker: Any) -> None:
    """Forget and close `worker`'s board; its stand-ins use receipts."""
    with _boards_lock:
        state = _boards.pop(worker, None)
    pool = cs.default_pool()
    pool._close_board(worker)  # the pool owns the board
    if state is not None and not state.board.closed:
        state.board.close()


def _board_off(worker: Any, state: _BoardState, patchers: dict[str, Any],
               kind: str, reason: str) -> None:
    _warn_once(
        kind,
        "comfy_standin: worker {name} does not publish a live board "
        "({reason}); its stand-ins use receipts only",
        name=getattr(worker, "name", "?"), reason=reason)
    state.off = True
    for s in patchers.values():
        attached = s.board if _is_ours(s) else None
        if attached is not None and attached[0] is state.board:
            s.detach_board()
    _board_done(worker)


def _sync_board(env_dir: Any, worker: Any) -> None:
    """At comfy-env's node boundary: attach the worker's new stand-ins to
    its board and send the worker their bindings (one call_module)."""
    with _boards_lock:
        state = _boards.get(worker)
    if state is None or state.off or state.board.closed:
        return
    board = state.board
    process = getattr(worker, "_process", None)
    if getattr(process, "pid", None) != state.spawned \
            or not worker.is_alive():
        return  # another process now: its own board, its own bindings
    if board.poll_owner():
        return  # exited: the pool's boundary marks it gone
    patchers = dict(importlib.import_module(_POOL_MODULE)
                    ._WORKER_PATCHERS.get(str(env_dir), {}))
    for mid in [m for m in state.sent if m not in patchers]:
        slot = board.find(mid)  # the host no longer tracks it
        if slot is not None:
            board.release(slot)
        del state.sent[mid]
    pending: dict[str, list[int]] = {}
    for mid, s in patchers.items():
        if not _is_ours(s) or s.worker is not worker or s.stale:
            continue
        attached = s.board
        if attached is None or attached[0] is not board:
            try:
                slot = s.attach_board(board)
            except (TypeError, ValueError) as exc:  # out of slots
                log.debug("comfy_standin: %r not on the board: %s", mid, exc)
                continue
        else:
            slot = attached[1]
        binding = (slot, board.tag(slot))
        if state.sent.get(mid) != binding:
            pending[mid] = list(binding)
    if not pending:
        return
    lock = getattr(worker, "_lock", None)
    if lock is not None and not lock.acquire(timeout=0.25):
        return  # another thread is in the worker: the next boundary
    try:
        process = getattr(worker, "_process", None)
        if getattr(process, "pid", None) != state.spawned \
                or not worker.is_alive():
            return
        reply = worker.call_module(
            module=_PUBLISHER, func="bind", timeout=60.0, bindings=pending,
        )
    except Exception as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        if type(exc).__name__ != "WorkerError":  # the worker died or hung
            log.debug("comfy_standin: binding not sent: %s", first)
            state.off = True
            _board_done(worker)
            return
        _board_off(worker, state, patchers, "worker-bind",
                   f"{_PUBLISHER}.bind failed in the worker: {first}")
        return
    finally:
        if lock is not None:
            lock.release()
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        reason = reply.get("reason") if isinstance(reply, dict) else reply
        _board_off(worker, state, patchers, "worker-bind", str(reason))
        return
    if reply.get("pid") != state.owner:
        _board_off(worker, state, patchers, "owner",
                   "another process answered for the worker that made "
                   "the board")
        return
    state.sent.update({m: (b[0], b[1]) for m, b in pending.items()})


# ---- what install() touches, and what it checks first -----------------------

#: What comfy-env's ``SubprocessModelPatcher`` defines (0.4.40 to 0.4.46
#: define the same): what comfy-env and ComfyUI may read off a patcher,
#: each of which ``StandIn`` answers ...
_PATCHER_SURFACE = frozenset({
    "_kind", "_model_id", "_residency_peak", "_residency_seq", "_worker",
    "_worker_gone", "_worker_generation", "add_hook_patches", "add_patches",
    "clone", "clone_base_uuid", "current_loaded_device", "detach",
    "eviction_deferred", "get_nested_additional_models", "is_clone",
    "is_dynamic", "load_device", "loaded_size", "lowvram_patch_counter",
    "model", "model_dtype", "model_patches_models", "model_patches_to",
    "model_size", "offload_device", "parent", "partially_load",
    "partially_unload", "size",
})
#: ... and its own helpers, which only its own methods use.
_PATCHER_OWN = frozenset({"COMFY_SURFACE", "_in_flight", "_mark_offloaded",
                          "_send"})
#: Likewise its ``SubprocessModel`` (a patcher's ``model``), which a
#: stand-in answers itself (``StandIn.model`` is the stand-in).  One name
#: differs in kind: ``lowvram_patch_counter`` is an int there and
#: ``StandIn``'s method here, which only ModelPatcher's own methods read
#: off ``model``, and they never run on a stand-in.
_MODULE_SURFACE = frozenset({
    "current_weight_patches_uuid", "device", "lowvram_patch_counter",
    "model_loaded_weight_memory", "model_lowvram",
    "model_offload_buffer_memory",
})
_MODULE_OWN = frozenset({"_size"})

#: Every name of comfy-env that install() replaces, wraps or reads, with
#: what is checked before anything is touched (integrations/_shapes.py).
#: A wrapper added later is one row here.
HOOKS = (
    # The stand-in swap: one check failing refuses the whole install.
    Hook(_PATCHER_MODULE, "SubprocessModelPatcher",
         "(worker, worker_generation, model_id, model_size, load_device, "
         "offload_device, kind='other')",
         wrap=lambda _own: cs.StandIn,
         only=_PATCHER_SURFACE | _PATCHER_OWN),
    Hook(_PATCHER_MODULE, "SubprocessModel", "(size_bytes, device)",
         only=_MODULE_SURFACE | _MODULE_OWN),
    Hook(_PATCHER_MODULE, "_ON_PRESSURE", "present"),  # _forward_pressure
    Hook(_SYNC_MODULE, "apply_echo",
         "(p, resident, seq=None, unmapped=False, in_flight=False)",
         wrap=_wrap_apply_echo),
    Hook(_SYNC_MODULE, "apply_residency", "(patchers, census, log=None)",
         wrap=_wrap_apply_residency),
    Hook(_SYNC_MODULE, "apply_peak_raise", "(patchers, census)",
         wrap=_wrap_apply_peak_raise),
    Hook(_POOL_MODULE, "_insert_loaded_model", "(p)",
         wrap=_wrap_insert_loaded_model),
    Hook(_POOL_MODULE, "_register_new_patchers",
         "(env_dir, worker, generation)", wrap=_wrap_register_new_patchers),
    Hook(_POOL_MODULE, "_handle_vram_budget", "(request, worker_key=None)",
         wrap=_wrap_handle_vram_budget),
    # ComfyUI's own (its signature varies by ComfyUI version; the wrapper
    # passes every argument on): after its eviction, what only a worker
    # can give back (Pool.reclaim).
    Hook(_MM_MODULE, "free_memory", "present", wrap=_wrap_free_memory),
    # The frame's report (census at creation, unlisted bytes) and the
    # in-flight count (Pool.reclaim asks idle workers only).
    Hook(_SPAWN_MODULE, "SubprocessWorker", "class",
         reads=("_last_vram_report", "_calls_in_flight")),
    # What a stand-in calls on its worker (src/commands.c, pool.py).
    Hook(_WORKER_CLASS, "send_command", "(self, method, **params)"),
    Hook(_WORKER_CLASS, "send_command_no_spawn",
         "(self, method, lock_timeout=2.0, **params)"),
    Hook(_WORKER_CLASS, "is_alive", "(self)"),
    # The live board: one check failing leaves stand-ins on receipts.
    Hook(_SPAWN_MODULE, "popen_in_own_group", "(cmd, **kw)",
         wrap=_wrap_popen, board=True),
    Hook(_WORKER_CLASS, "_ensure_started", "(self)",
         wrap=_wrap_ensure_started, board=True),
    Hook(_WORKER_CLASS, "shutdown", "(self)", wrap=_wrap_shutdown,
         board=True),
    Hook(_WORKER_CLASS, "call_module",
         "(self, module, func, timeout=None, **kwargs)", board=True),
    Hook(_SPAWN_MODULE, "SubprocessWorker", "class", board=True,
         reads=("name", "sys_path", "_process", "_lock")),
    Hook(_POOL_MODULE, "_get_or_create_worker", "present", board=True,
         reads=("gen",)),  # _generation_of
    Hook(_POOL_MODULE, "_WORKER_POOL", "dict", board=True),
    Hook(_POOL_MODULE, "_WORKER_PATCHERS", "dict", board=True),
)


def _comfy_env_version() -> str:
    try:
        return importlib.metadata.version("comfy-env")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _Plan(NamedTuple):
    #: "full"; "off" (receipts: boards off by choice or platform);
    #: "receipts" (no boards for another reason); refused: "untested",
    #: "shape".
    verdict: str
    #: What install() swaps, in order.
    hooks: tuple[Hook, ...] = ()
    #: Why not full.
    why: str = ""


def _mismatches(hooks: Any) -> str:
    """The failed checks of `hooks`, one clause per reason: "a, b: why"."""
    by_reason: dict[str, list[str]] = {}
    for hook in hooks:
        reason = mismatch(hook)
        if reason is not None:
            by_reason.setdefault(reason, []).append(where(hook))
    return "; ".join(f"{', '.join(names)}: {reason}"
                     for reason, names in by_reason.items())


def _plan(version: str) -> _Plan:
    """What install() does with comfy-env `version`, installed here."""
    failed = _mismatches(h for h in HOOKS if not h.board)
    if failed:
        return _Plan("shape", why=failed)
    tested = TESTED_COMFY_ENV.get(version)
    if tested is None:
        return _Plan("untested")
    swap = tuple(h for h in HOOKS if h.wrap is not None and not h.board)
    failed = _mismatches(h for h in HOOKS if h.board)
    if os.environ.get("COMFY_STANDIN_NO_BOARD", "") not in ("", "0"):
        return _Plan("off", swap, "COMFY_STANDIN_NO_BOARD is set")
    if not sys.platform.startswith("linux"):
        return _Plan("off", swap, "sealed descriptors are Linux only")
    if failed:
        return _Plan("receipts", swap, failed)
    if tested != "full":
        return _Plan("receipts", swap, f"tested with comfy-env {version} "
                     f"on receipts only")
    if _board_library() is None:
        return _Plan("receipts", swap, (
            f"this installation has no board library "
            f"(comfy_standin/_lib/{_BOARD_LIBRARY})"))
    board = tuple(h for h in HOOKS if h.wrap is not None and h.board)
    return _Plan("full", swap + board)


def _say(plan: _Plan, version: str) -> None:
    """install()'s one line."""
    version, why = visible(version), visible(plan.why, _LINE_LIMIT)
    if plan.verdict == "full":
        log.info(f"comfy_standin: switched on for comfy-env {version}: "
                 f"stand-ins and live boards")
    elif plan.verdict == "off":
        log.info(f"comfy_standin: switched on for comfy-env {version}: "
                 f"stand-ins use receipts (live boards off: {why})")
    elif plan.verdict == "receipts":
        log.warning(f"comfy_standin: switched on for comfy-env {version}: "
                    f"stand-ins use receipts only, no live boards ({why})")
    elif plan.verdict == "untested":
        tested = ", ".join(TESTED_COMFY_ENV)
        log.warning(f"comfy_standin: not switched on: comfy-env {version} "
                    f"is not a version comfy_standin was tested with "
                    f"({tested}); comfy-env keeps its own stand-ins")
    else:
        log.warning(f"comfy_standin: not switched on: comfy-env {version} "
                    f"is not the shape comfy_standin checked ({why}); "
                    f"comfy-env keeps its own stand-ins")
