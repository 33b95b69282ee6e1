"""Opt-in adapter: make an installed comfy-env use ``comfy_standin.StandIn``.

Call once at start-up, before any worker registers a model (for instance
from a custom node package's ``__init__``)::

    from comfy_standin.integrations import comfy_env
    comfy_env.install()

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
  on the card is listed again, finished registrations are released.
  ``_handle_vram_budget`` (a worker's VRAM request) lists them again first
  (``default_pool().relist``), before the ``free_memory`` it runs.
- ``comfy.model_management.free_memory`` is followed, when the card is
  still short, by ``default_pool().reclaim(shortfall)``: idle workers give
  back bytes no listed model accounts for (docs/architecture.md,
  "Unlisted bytes").
- The default pool's ``on_pressure`` (unset before) forwards the shortfall
  to comfy-env's own pressure hook (``model_patcher._ON_PRESSURE``, which
  asks idle workers to release from a thread), as comfy-env's patcher
  does in its ``partially_unload``.

- Live residency boards (docs/board.md), on Linux with a comfy-env
  version the board was checked against (``SUPPORTED_COMFY_ENV``), for
  every pack with nothing installed in the pack's environment.
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
  On any mismatch (another comfy-env version, a changed internal, a
  refused handoff) one log line says so and that worker stays on
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
from typing import Any

import comfy_standin as cs

from .._handoff import PROTOCOL, Handoff, HandoffRefused
from .._text import LOG_TEXT_LIMIT, visible

#: The variable naming a worker's board handoff (its environment only).
ENV_VAR = "COMFY_STANDIN_BOARD"

__all__ = ["counters", "install", "installed", "uninstall"]

log = logging.getLogger("comfy_standin")

_PATCHER_MODULE = "comfy_env.isolation.model_patcher"
_SYNC_MODULE = "comfy_env.state_sync"
_SYNC_NAMES = ("apply_echo", "apply_residency", "apply_peak_raise")
_POOL_MODULE = "comfy_env.isolation.pool"
_POOL_NAMES = ("_insert_loaded_model", "_register_new_patchers",
               "_handle_vram_budget")
_MM_MODULE = "comfy.model_management"
_SPAWN_MODULE = "comfy_env.isolation.workers.subprocess"
_WORKER_CLASS = _SPAWN_MODULE + ":SubprocessWorker"
# The worker-side publisher: a module name of its own (it can shadow
# nothing of a pack's), importable only from the private directory.
_PUBLISHER = "_comfy_standin_publisher"
_BOARD_LIBRARY = "libcomfy_standin_board.so"

#: comfy-env versions whose internals the board wiring was checked against
#: (the worker's ``main()`` closures, ``call_module``, the spawn call).
SUPPORTED_COMFY_ENV = ("0.4.46",)
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
    """Swap comfy_standin into comfy-env.  Idempotent.

    Returns True when installed (now or before).  Raises ImportError when
    comfy-env (or the ``comfy`` package it imports) is not importable, so
    an opt-in that cannot take effect is never silent.
    """
    if _originals:
        return True
    patcher_module = importlib.import_module(_PATCHER_MODULE)
    sync_module = importlib.import_module(_SYNC_MODULE)
    originals = {
        (_PATCHER_MODULE, "SubprocessModelPatcher"): (
            patcher_module.SubprocessModelPatcher
        )
    }
    for name in _SYNC_NAMES:
        if hasattr(sync_module, name):
            originals[(_SYNC_MODULE, name)] = getattr(sync_module, name)
    wrappers = {
        "apply_echo": _wrap_apply_echo,
        "apply_residency": _wrap_apply_residency,
        "apply_peak_raise": _wrap_apply_peak_raise,
    }
    pool_module = importlib.import_module(_POOL_MODULE)
    for name in _POOL_NAMES:
        if hasattr(pool_module, name):
            originals[(_POOL_MODULE, name)] = getattr(pool_module, name)
    wrappers["_insert_loaded_model"] = _wrap_insert_loaded_model
    wrappers["_register_new_patchers"] = _wrap_register_new_patchers
    wrappers["_handle_vram_budget"] = _wrap_handle_vram_budget
    mm = importlib.import_module(_MM_MODULE)
    if callable(getattr(mm, "free_memory", None)):
        originals[(_MM_MODULE, "free_memory")] = mm.free_memory
        wrappers["free_memory"] = _wrap_free_memory
    patcher_module.SubprocessModelPatcher = cs.StandIn
    for (module_name, name), original in originals.items():
        if module_name == _SYNC_MODULE:
            setattr(sync_module, name, wrappers[name](original))
        elif module_name == _POOL_MODULE:
            setattr(pool_module, name, wrappers[name](original))
        elif module_name == _MM_MODULE:
            setattr(mm, name, wrappers[name](original))
    pool = cs.default_pool()
    if pool.on_pressure is None:
        pool.on_pressure = _forward_pressure
    _originals.update(originals)
    _install_boards()
    log.info("comfy_standin: installed into comfy-env")
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
                _take_figures(pool, worker, report)
                _log_relisted(pool.boundary(
                    importlib.import_module("comfy.model_management")))
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
                    cs.default_pool().reclaim(short)
        except Exception:
            log.exception("comfy_standin: reclaiming unlisted bytes failed "
                          "(ignored)")
        return unloaded

    free_memory.__wrapped__ = original  # type: ignore[attr-defined]
    return free_memory


def _take_figures(pool: Any, worker: Any, report: Any) -> None:
    """The frame's held, pinned and overhead figures for the pool's books
    of `worker` (comfy-env keeps its own copies): what the worker holds
    beyond its models (``Pool.unlisted``) is measured from them."""
    if not isinstance(report, dict) or pool._ledger.find(worker) is None:
        return
    figures = {name: dict.get(report, name) for name in
               ("held", "pinned", "overhead") if name in report}
    try:
        pool.report(worker, figures)
    except cs.EchoError:
        pass  # a figure out of range: comfy-env's copy stands alone


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


def _resolve(target: str) -> Any:
    module_name, _, class_name = target.partition(":")
    obj = importlib.import_module(module_name)
    return getattr(obj, class_name) if class_name else obj


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


def _install_boards() -> None:
    """Wrap comfy-env's worker spawn and shutdown, when this comfy-env is
    one the board wiring was checked against; otherwise say why once and
    leave every worker on receipts."""
    if os.environ.get("COMFY_STANDIN_NO_BOARD", "") not in ("", "0"):
        log.info("comfy_standin: live boards turned off "
                 "(COMFY_STANDIN_NO_BOARD); stand-ins use receipts")
        return
    if not sys.platform.startswith("linux"):
        log.info("comfy_standin: no live boards here (sealed descriptors "
                 "are Linux only); stand-ins use receipts")
        return
    try:
        version = importlib.metadata.version("comfy-env")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version not in SUPPORTED_COMFY_ENV:
        _warn_once("version", (
            f"comfy_standin: comfy-env {version} is not a version the live "
            f"board was checked against ({', '.join(SUPPORTED_COMFY_ENV)}): "
            f"no boards, stand-ins use receipts only"))
        return
    if _board_library() is None:
        _warn_once("library", (
            f"comfy_standin: this installation has no board library "
            f"(comfy_standin/_lib/{_BOARD_LIBRARY}): no boards, stand-ins "
            f"use receipts only"))
        return
    try:
        spawn = importlib.import_module(_SPAWN_MODULE)
        worker_cls = spawn.SubprocessWorker
        pool_module = importlib.import_module(_POOL_MODULE)
        missing = [
            name for name, ok in (
                ("popen_in_own_group", callable(
                    getattr(spawn, "popen_in_own_group", None))),
                ("SubprocessWorker._ensure_started", callable(
                    getattr(worker_cls, "_ensure_started", None))),
                ("SubprocessWorker.shutdown", callable(
                    getattr(worker_cls, "shutdown", None))),
                ("SubprocessWorker.call_module", callable(
                    getattr(worker_cls, "call_module", None))),
                ("pool._WORKER_PATCHERS", isinstance(
                    getattr(pool_module, "_WORKER_PATCHERS", None), dict)),
                ("pool._WORKER_POOL", isinstance(
                    getattr(pool_module, "_WORKER_POOL", None), dict)),
            ) if not ok
        ]
    except (ImportError, AttributeError) as exc:
        missing = [str(exc)]
    if missing:
        _warn_once("host-shape", (
            f"comfy_standin: comfy-env {version} lacks what the live board "
            f"needs ({', '.join(missing)}): no boards, stand-ins use "
            f"receipts only"))
        return
    wrapped = {
        (_SPAWN_MODULE, "popen_in_own_group"): _wrap_popen,
        (_WORKER_CLASS, "_ensure_started"): _wrap_ensure_started,
        (_WORKER_CLASS, "shutdown"): _wrap_shutdown,
    }
    for (target, name), wrap in wrapped.items():
        owner = _resolve(target)
        original = getattr(owner, name)
        _originals[(target, name)] = original
        setattr(owner, name, wrap(original))


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
