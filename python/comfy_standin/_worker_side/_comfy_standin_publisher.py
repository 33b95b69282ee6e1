"""The live residency board's publisher, inside a comfy-env worker.

This one file is all of comfy_standin that a worker process ever imports.
It needs nothing but the standard library, so it runs in the pack
environment's own Python (any CPython from 3.8 on; comfy-env runs each pack
in an environment of its own, often another minor version than ComfyUI's)
with nothing installed there.  The host's adapter
(``comfy_standin.integrations.comfy_env``) copies it into a private
directory and puts that directory first on the worker's ``sys.path``
through comfy-env's own ``sys_paths``; the directory holds this module and
nothing else, and its name cannot shadow any module of the pack's.  The
board writer is the host's own C board core, built as a plain shared
library (``comfy_standin/_lib/libcomfy_standin_board.so``: libc and
pthreads only) and loaded here with ctypes by the absolute path the host
gives.  ctypes releases the GIL around every call; the seqlock and its
fences stay in C.

What the host calls, over comfy-env's command channel
(``SubprocessWorker.call_module``):

- :func:`attach`, once, right after the worker started: checks that the
  worker is the comfy-env worker this was written against (the closures
  named below), loads the library and checks its layout version against
  the host's, makes the board (a sealed memfd only this process can write,
  ``cs_board_make``) and sends its descriptor to the host over the private
  Unix socket named in ``COMFY_STANDIN_BOARD`` (a path in a directory only
  this user can enter, which it checks first; with that variable's
  one-time token; the host checks the peer with SO_PEERCRED), then closes
  its own copy of the descriptor and deletes the variable;
- :func:`bind`, at node boundaries: the (slot, tag) the host chose for each
  model.

From then on every bound model's resident bytes are published, each with
the time its measurement began (the host takes a reading over its receipt
only when the reading's stamp is newer):

- synchronously, before the worker asks the host for VRAM (its shimmed
  ``load_models_gpu`` calls ``_call_parent("request_vram_budget")``, and the
  host then runs ComfyUI's ``free_memory`` reading this board), after that
  shim's real load, and at every ``_bump_seq`` (each site where comfy-env's
  worker moves a model's bytes: command replies, registrations);
- every ``period`` seconds from a thread of its own, which also beats the
  heartbeat: moves made with no message (a pager, a pack's own thread)
  reach the host within a period.

Readings come from comfy-env's own census (``_residency_census``: the same
number it sends at every node boundary).  Nothing here raises into the
worker: every entry point answers ``{"ok": False, "reason": ...}`` instead,
and the wrapped functions return what comfy-env's return.
"""

from __future__ import annotations

import array
import atexit
import ctypes
import os
import re
import socket
import stat
import sys
import threading
import time

__all__ = ["ENV_VAR", "PROTOCOL", "attach", "bind", "state"]

#: The variable naming the host's handoff:
#: ``<protocol>:<socket path>:<token>`` (the path may hold ':').
ENV_VAR = "COMFY_STANDIN_BOARD"
#: What this module and the host's adapter agree on (the calls, their
#: arguments, the handoff message).  The host sends its own; a mismatch is
#: refused with a reason, which the host logs once.
PROTOCOL = 2

# The host's socket path (comfy_standin._handoff): <parent>/<DIR_PREFIX +
# mkdtemp's letters>/board, at most 107 bytes.
_HANDOFF_DIR = re.compile(r"^comfy-standin-handoff-[A-Za-z0-9_]+$")
_HANDOFF_SOCKET = "board"
_SUN_PATH_MAX = 107
_TOKEN = re.compile(r"^[0-9a-f]{64}$")
_HANDOFF_TIMEOUT = 5.0
# A synchronous pass waits this long for a pass of the sampler thread to
# finish; past it the sampler's own pass (or the next) publishes instead.
_SYNC_WAIT = 0.5
_VALUE_MAX = (1 << 63) - 1

_lock = threading.Lock()
_publisher = None  # the _Publisher, once attached
_failed = None  # why not, once refused


def attach(library=None, slots=64, generation=0, layout=None,
           protocol=None, period=0.05, **_ignored):
    """Host -> worker, once per process: make the board and hand it over.

    Returns ``{"ok": True, "pid": ...}`` or ``{"ok": False, "reason": ...,
    "pid": ...}``.  Never raises.
    """
    global _publisher, _failed
    try:
        with _lock:
            if _publisher is not None:
                return _refused("this worker already has a board")
            if _failed is not None:
                return _refused(_failed)
            started = _start(library, slots, generation, layout, protocol,
                             period)
            if isinstance(started, str):
                _failed = started
                return _refused(started)
            _publisher = started
            return {"ok": True, "pid": os.getpid(), "protocol": PROTOCOL,
                    "hooks": sorted(started.hooks)}
    except Exception as exc:  # never break the worker
        return _refused(f"{type(exc).__name__}: {exc}")


def bind(bindings=None, **_ignored):
    """Host -> worker: publish `bindings` (model id -> [slot, tag]).

    Returns ``{"ok": True, "pid": ..., "bound": {...}}`` or a refusal.
    Never raises.
    """
    try:
        pub = _publisher
        if pub is None:
            return _refused(_failed or "no board attached")
        pub.bind(bindings or {})
        return {"ok": True, "pid": os.getpid(), "bound": pub.bound()}
    except Exception as exc:
        return _refused(f"{type(exc).__name__}: {exc}")


def state():
    """What the publisher does in this process (tests, debugging)."""
    pub = _publisher
    if pub is None:
        return {"running": False, "failed": _failed}
    return {"running": pub.running(), "failed": None, "bound": pub.bound(),
            "hooks": sorted(pub.hooks), "passes": pub.passes,
            "published": pub.published, "synced": dict(pub.synced),
            "library": pub.library_path}


def _refused(reason):
    return {"ok": False, "reason": str(reason), "pid": os.getpid()}


# ---- the board library, through ctypes --------------------------------------


class _Library:
    """The host's board core (plain C), loaded by absolute path."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        c = ctypes
        signatures = {
            "cs_board_layout_version": ([], c.c_int),
            "cs_board_status_message": ([c.c_int], c.c_char_p),
            "cs_board_make": ([c.c_uint32, c.c_uint64,
                               c.POINTER(c.c_void_p), c.POINTER(c.c_int),
                               c.POINTER(c.c_int)], c.c_int),
            "cs_board_bind": ([c.c_void_p, c.c_uint32, c.c_uint64],
                              c.c_int),
            "cs_board_publish_at": ([c.c_void_p, c.c_uint32, c.c_uint64,
                                     c.c_uint64], c.c_int),
            "cs_board_heartbeat": ([c.c_void_p], c.c_int),
            "cs_board_close": ([c.c_void_p], None),
        }
        for name, (argtypes, restype) in signatures.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = restype
        self.lib = lib
        self.path = path

    def message(self, status):
        text = self.lib.cs_board_status_message(status)
        return text.decode("ascii", "replace") if text else str(status)

    def make(self, slots, generation):
        """(handle, fd) or why not (str)."""
        handle = ctypes.c_void_p()
        fd = ctypes.c_int(-1)
        error = ctypes.c_int(0)
        status = self.lib.cs_board_make(slots, generation,
                                        ctypes.byref(handle),
                                        ctypes.byref(fd),
                                        ctypes.byref(error))
        if status != 0:
            detail = os.strerror(error.value) if error.value else ""
            return "cannot make a board: " + self.message(status) + (
                f" ({detail})" if detail else "")
        return handle, fd.value


def _load_library(path, layout):
    if not isinstance(path, str) or not os.path.isabs(path):
        return f"the board library path {path!r} is not absolute"
    if not os.path.isfile(path):
        return f"no board library at {path}"
    try:
        library = _Library(path)
    except (OSError, AttributeError) as exc:
        return f"cannot load the board library {path}: {exc}"
    have = library.lib.cs_board_layout_version()
    if not isinstance(layout, int) or isinstance(layout, bool) \
            or have != layout:
        return (f"board layout mismatch: the host reads layout {layout!r}, "
                f"the library {path} writes layout {have}")
    return library


# ---- the handoff ------------------------------------------------------------


def _parse_spec(spec):
    """(socket path, token) from the variable, or why not (str)."""
    if not spec:
        return f"no board handoff ({ENV_VAR} is not set)"
    protocol, _, rest = spec.partition(":")
    path, _, token = rest.rpartition(":")
    directory, name = os.path.split(path)
    if protocol != str(PROTOCOL) or not _TOKEN.match(token) \
            or not os.path.isabs(path) or name != _HANDOFF_SOCKET \
            or not _HANDOFF_DIR.match(os.path.basename(directory)) \
            or len(os.fsencode(path)) > _SUN_PATH_MAX:
        return f"{ENV_VAR} is not a handoff of protocol {PROTOCOL}"
    return path, token


def _not_private(directory):
    """Why `directory` is not a directory of this user's that nobody else
    may enter, or None.  The board goes only into a socket there: one in a
    directory another user could enter (or had swapped in) is theirs."""
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return f"cannot see the handoff directory {directory}: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"the handoff directory {directory} is not a directory"
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return (f"the handoff directory {directory} is not this user's "
                f"alone (uid {st.st_uid}, mode "
                f"{oct(stat.S_IMODE(st.st_mode))})")
    return None


def _send_board(path, token, fd):
    """Sends `fd` with the token to the host's socket, or says why not."""
    why = _not_private(os.path.dirname(path))
    if why is not None:
        return f"cannot hand the board to the host: {why}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(_HANDOFF_TIMEOUT)
        sock.connect(path)
        rights = array.array("i", [fd]).tobytes()
        sock.sendmsg([token.encode("ascii")],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
    except OSError as exc:
        return f"cannot hand the board to the host: {exc}"
    finally:
        sock.close()
    return None


# ---- comfy-env 0.4.46's worker, checked before anything is touched ----------


def _main_frame():
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "main"
                and "_residency_census" in frame.f_code.co_cellvars):
            return frame
        frame = frame.f_back
    return None


def _find_shapes():
    """What the publisher hooks into, or why not (str): the cell of
    ``_bump_seq`` and its function, ``_residency_census``,
    ``_model_registry``, and the load shim's cells (None when the worker
    has no ComfyUI to shim)."""
    cw = sys.modules.get("comfy_worker")
    reg = getattr(cw, "register_model", None)
    code = getattr(reg, "__code__", None)
    closure = getattr(reg, "__closure__", None)
    if code is None or not closure:
        return "comfy_worker.register_model is not comfy-env's closure"
    names = code.co_freevars
    if "_bump_seq" not in names:
        return "comfy_worker.register_model does not call _bump_seq"
    cell = closure[names.index("_bump_seq")]
    try:
        bump = cell.cell_contents
    except ValueError:
        return "_bump_seq is not set"
    bump_code = getattr(bump, "__code__", None)
    if getattr(bump, "__name__", None) != "_bump_seq" or bump_code is None \
            or bump_code.co_argcount != 1:
        return "_bump_seq is not comfy-env's function of one model id"
    frame = _main_frame()
    try:
        if frame is None:
            return ("the worker's main() with _residency_census is not on "
                    "the stack")
        scope = frame.f_locals
        census = scope.get("_residency_census")
        registry = scope.get("_model_registry")
        same_bump = scope.get("_bump_seq") is bump
    finally:
        del frame
    if not callable(census):
        return "_residency_census is not callable"
    if not isinstance(registry, dict):
        return "_model_registry is not a dict"
    if not same_bump:
        return "register_model's _bump_seq is not main()'s"
    out = census()
    if not isinstance(out, list) or not all(
        isinstance(e, dict) and isinstance(e.get("id"), str)
        and isinstance(e.get("resident"), int) for e in out
    ):
        return "_residency_census does not return [{id, resident}, ...]"
    return cell, bump, census, registry, _find_load_shim()


def _find_load_shim():
    """(cell of _call_parent, cell of _original_load_models_gpu) of the
    worker's shimmed ``comfy.model_management.load_models_gpu``, or None."""
    mm = sys.modules.get("comfy.model_management")
    shim = getattr(mm, "load_models_gpu", None)
    code = getattr(shim, "__code__", None)
    closure = getattr(shim, "__closure__", None)
    if code is None or not closure:
        return None
    names = code.co_freevars
    if "_call_parent" not in names \
            or "_original_load_models_gpu" not in names:
        return None
    parent = closure[names.index("_call_parent")]
    load = closure[names.index("_original_load_models_gpu")]
    try:
        if not callable(parent.cell_contents) \
                or not callable(load.cell_contents):
            return None
    except ValueError:
        return None
    return parent, load


# ---- start ------------------------------------------------------------------


def _start(library_path, slots, generation, layout, protocol, period):
    if protocol != PROTOCOL:
        return (f"publisher protocol mismatch: the host speaks "
                f"{protocol!r}, this publisher {PROTOCOL}")
    spec = os.environ.pop(ENV_VAR, None)  # the worker's children: none
    handoff = _parse_spec(spec)
    if isinstance(handoff, str):
        return handoff
    for name, value, low, high in (("slots", slots, 1, 4096),
                                   ("generation", generation, 0,
                                    _VALUE_MAX)):
        if not isinstance(value, int) or isinstance(value, bool) \
                or not low <= value <= high:
            return f"{name} {value!r} out of range"
    if not isinstance(period, (int, float)) or not 0.001 <= period <= 3600:
        return f"period {period!r} out of range"
    shapes = _find_shapes()
    if isinstance(shapes, str):
        return f"comfy-env's worker is not the shape checked: {shapes}"
    library = _load_library(library_path, layout)
    if isinstance(library, str):
        return library
    made = library.make(slots, generation)
    if isinstance(made, str):
        return made
    handle, fd = made
    try:
        refused = _send_board(handoff[0], handoff[1], fd)
    finally:
        os.close(fd)  # the mapping keeps the board; no descriptor left
    if refused is not None:
        library.lib.cs_board_close(handle)
        return refused
    cell, bump, census, registry, shim = shapes
    pub = _Publisher(library, handle, census, registry, float(period))
    pub.hook(cell, bump, shim)
    atexit.register(pub.stop)
    return pub


class _Publisher:
    def __init__(self, library, handle, census, registry, period):
        self._library = library
        self._lib = library.lib
        self.library_path = library.path
        self._handle = handle
        self._census = census
        self._registry = registry
        self.period = period
        self._mu = threading.Lock()  # the bindings
        self._pass_lock = threading.Lock()  # one pass at a time
        self._in_pass = threading.local()
        self._slots = {}  # model id -> (slot, tag)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = None
        self._closed = False
        self.hooks = set()
        self.passes = 0
        self.published = 0
        self.synced = {}  # reason -> synchronous passes made

    # -- comfy-env's hooks --

    def hook(self, bump_cell, bump, shim):
        pub = self

        def _bump_seq(mid, _original=bump):
            seq = _original(mid)
            pub.sync("bump")
            return seq

        _bump_seq.__wrapped__ = bump
        bump_cell.cell_contents = _bump_seq
        self.hooks.add("bump")
        if shim is None:
            return
        parent_cell, load_cell = shim
        call_parent = parent_cell.cell_contents
        load = load_cell.cell_contents

        def _call_parent(method, *args, _original=call_parent, **params):
            if method == "request_vram_budget":
                pub.sync("request_vram_budget")
            return _original(method, *args, **params)

        def _original_load_models_gpu(*args, _original=load, **kwargs):
            try:
                return _original(*args, **kwargs)
            finally:
                pub.sync("load")

        _call_parent.__wrapped__ = call_parent
        _original_load_models_gpu.__wrapped__ = load
        parent_cell.cell_contents = _call_parent
        load_cell.cell_contents = _original_load_models_gpu
        cw = sys.modules.get("comfy_worker")
        if getattr(cw, "call_parent", None) is call_parent:
            cw.call_parent = _call_parent
        self.hooks.update(("request_vram_budget", "load"))

    # -- bindings --

    def bound(self):
        with self._mu:
            return {m: list(v) for m, v in self._slots.items()}

    def bind(self, bindings):
        clean = {}
        for mid, pair in dict(bindings).items():
            slot, tag = (int(x) for x in pair)
            if not 0 <= slot < 4096 or not 0 <= tag <= _VALUE_MAX:
                raise ValueError(f"binding {mid!r}: {pair!r} out of range")
            clean[str(mid)] = (slot, tag)
        with self._mu:
            for mid, (slot, tag) in clean.items():
                for other, (held, _tag) in list(self._slots.items()):
                    if held == slot and other != mid:
                        del self._slots[other]
                status = self._lib.cs_board_bind(self._handle, slot, tag)
                if status != 0:
                    raise ValueError(f"bind {mid!r}: "
                                     f"{self._library.message(status)}")
                self._slots[mid] = (slot, tag)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="comfy-standin-board", daemon=True)
            self._thread.start()
        self.sync("bind")

    # -- passes --

    def running(self):
        thread = self._thread
        return thread is not None and thread.is_alive()

    def sync(self, reason):
        """One pass now, on this thread (never raises, never waits long)."""
        if getattr(self._in_pass, "active", False) or self._closed:
            return
        try:
            if not self._pass_lock.acquire(timeout=_SYNC_WAIT):
                return
            try:
                self._pass()
            finally:
                self._pass_lock.release()
            self.synced[reason] = self.synced.get(reason, 0) + 1
        except Exception:
            pass

    def _run(self):
        while not self._stop.is_set():
            with self._pass_lock:
                if self._stop.is_set():
                    break
                try:
                    self._pass()
                except Exception:
                    pass  # the census never raises; a board error: next pass
            self._wake.wait(self.period)

    def _pass(self):
        self._in_pass.active = True
        try:
            # The stamp is taken before the census runs: a reading never
            # claims to be newer than the moment it was measured.
            measured = time.monotonic_ns()
            resident = {}
            for entry in self._census():
                try:
                    value = int(entry["resident"])
                    resident[str(entry["id"])] = min(max(value, 0),
                                                     _VALUE_MAX)
                except (KeyError, TypeError, ValueError):
                    continue
            with self._mu:
                slots = list(self._slots.items())
            if self._closed:
                return
            for mid, (slot, _tag) in slots:
                if mid in resident:
                    value = resident[mid]
                elif mid not in self._registry:
                    value = 0  # collected: comfy-env forgot it
                else:
                    continue  # unknown this pass (missing is not zero)
                if self._lib.cs_board_publish_at(self._handle, slot, value,
                                                 measured) == 0:
                    self.published += 1
            self._lib.cs_board_heartbeat(self._handle)
            self.passes += 1
        finally:
            self._in_pass.active = False

    def stop(self):
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        # A pass stuck in the census must not hang the worker's exit: then
        # the board goes with the process (the host reads "not attached"
        # or a stale heartbeat, and uses receipts).
        if not self._pass_lock.acquire(timeout=2.0):
            self._closed = True
            return
        try:
            if not self._closed:
                self._closed = True
                self._lib.cs_board_close(self._handle)
        finally:
            self._pass_lock.release()
