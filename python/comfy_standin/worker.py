"""The residency publisher that runs inside a comfy-env worker.

The host's adapter (``comfy_standin.integrations.comfy_env``) creates a
live residency board (docs/board.md) for each worker process it spawns,
hands the worker the board's sealed descriptor (``pass_fds``) and names it
in the worker's environment (``COMFY_STANDIN_BOARD=<fd>:<host pid>``).
After each node boundary at which the worker registered models, the host
calls :func:`bind` in the worker over comfy-env's own command channel
(``SubprocessWorker.call_module``) with the slot and tag it chose for each
model.  The first call here:

- opens the board (the inherited descriptor; where a launcher in between
  closed it, ``/proc/<host pid>/fd/<fd>``, which a same-user process may
  open on Linux) and closes the inherited descriptor;
- finds comfy-env's own residency bookkeeping: ``_bump_seq``, which the
  worker calls at every site that moves a model's bytes (a cell of
  ``sys.modules["comfy_worker"].register_model``'s closure, shared by
  every closure of the worker's ``main()``), and ``_residency_census``
  and ``_model_registry`` (locals of the running ``main()`` frame);
- wraps ``_bump_seq`` in that cell, so every change comfy-env's worker
  already tracks wakes the publisher at once;
- starts a sampler thread that runs comfy-env's census every ``period``
  seconds (and at once after a bump), publishes each bound model's
  resident bytes when they changed, and beats the board's heartbeat:
  moves made between messages (a pager, a pack's thread) reach the host
  without a message.

Everything it touches of comfy-env's worker is checked first (names,
types, the census's shape); on any mismatch nothing is changed and
:func:`bind` answers ``{"ok": False, "reason": ...}``, which the host logs
once and then keeps to receipts for that worker.  Nothing here raises into
the worker, and the wrapped ``_bump_seq`` returns what comfy-env's does.

A comfy-env pack's environment normally does not see ComfyUI's
site-packages: comfy-standin must be installed into the pack's
environment too for its workers to publish (without it the host logs one
line and uses receipts).  No torch needed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import types
from typing import Any

__all__ = ["ENV_VAR", "bind", "publisher_state"]

#: The environment variable naming the board: ``<fd>:<host pid>``.
ENV_VAR = "COMFY_STANDIN_BOARD"

_lock = threading.Lock()
_publisher: _Publisher | None = None
_failed: str | None = None


def bind(
    bindings: dict[str, Any] | None = None, period: float = 0.05
) -> dict[str, Any]:
    """Host -> worker: publish `bindings` (model id -> [slot, tag]).

    The first call opens the board and installs the publisher; later calls
    add or change bindings.  Returns ``{"ok": True, "pid": ...}``, or
    ``{"ok": False, "reason": ..., "pid": ...}`` when this worker cannot
    publish (the host then keeps to receipts).  Never raises.
    """
    global _publisher, _failed
    try:
        with _lock:
            if _failed is None and _publisher is None:
                started = _start(float(period))
                if isinstance(started, str):
                    _failed = started
                else:
                    _publisher = started
            if _failed is not None:
                return {"ok": False, "reason": _failed, "pid": os.getpid()}
            assert _publisher is not None
            _publisher.bind(dict(bindings or {}))
            return {"ok": True, "pid": os.getpid(),
                    "bound": _publisher.bound()}
    except Exception as exc:  # never break the worker
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}",
                "pid": os.getpid()}


def publisher_state() -> dict[str, Any]:
    """What the publisher does in this process (for tests and debugging)."""
    pub = _publisher
    if pub is None:
        return {"running": False, "failed": _failed}
    return {"running": True, "failed": None, "bound": pub.bound(),
            "passes": pub.passes, "published": pub.published}


# ---- comfy-env 0.4.46's worker, checked -----------------------------------


def _find_shapes() -> tuple[Any, Any, Any, dict[Any, Any]] | str:
    """(the _bump_seq cell, its function, _residency_census,
    _model_registry), or why not."""
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
    if getattr(bump, "__name__", None) != "_bump_seq" or not callable(bump):
        return "_bump_seq is not comfy-env's function"
    bump_code = getattr(bump, "__code__", None)
    if bump_code is None or bump_code.co_argcount != 1:
        return "_bump_seq does not take one model id"
    frame: types.FrameType | None = sys._getframe(1)
    try:
        while frame is not None:
            if (frame.f_code.co_name == "main"
                    and "_residency_census" in frame.f_code.co_cellvars):
                break
            frame = frame.f_back
        if frame is None:
            return "the worker's main() with _residency_census is not on " \
                   "the stack"
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
    return cell, bump, census, registry


def _open_board(spec: str | None) -> Any:
    """The worker's side of the board named by `spec`, or why not (str)."""
    from ._core import Board

    if not spec:
        return f"no board ({ENV_VAR} is not set)"
    try:
        fd_text, host_text = spec.split(":")
        fd, host_pid = int(fd_text), int(host_text)
    except ValueError:
        return f"{ENV_VAR}={spec!r} is not <fd>:<host pid>"
    try:
        board = Board.open(fd)
    except Exception as inherited:
        # A launcher in between (pixi run) may have closed the descriptor;
        # the host keeps its own until we answer: open it through /proc.
        try:
            proc_fd = os.open(f"/proc/{host_pid}/fd/{fd}",
                              os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            return (f"cannot open the board (inherited fd {fd}: "
                    f"{inherited}; /proc/{host_pid}/fd/{fd}: {exc})")
        try:
            board = Board.open(proc_fd)
        except Exception as exc:
            return f"cannot open the board: {exc}"
        finally:
            os.close(proc_fd)
        return board
    os.close(fd)  # mapped: the inherited descriptor is no longer needed
    return board


def _start(period: float) -> _Publisher | str:
    if not 0.001 <= period <= 3600.0:
        return f"period {period!r} out of range"
    shapes = _find_shapes()
    if isinstance(shapes, str):
        return f"comfy-env's worker is not the shape checked: {shapes}"
    board = _open_board(os.environ.get(ENV_VAR))
    if isinstance(board, str):
        return board
    cell, bump, census, registry = shapes
    pub = _Publisher(board, census, registry, period)

    def _bump_seq(mid: Any, _original: Any = bump) -> Any:
        seq = _original(mid)
        pub.wake()
        return seq

    _bump_seq.__wrapped__ = bump  # type: ignore[attr-defined]
    cell.cell_contents = _bump_seq
    pub.start()
    atexit.register(pub.stop)
    return pub


class _Publisher:
    def __init__(self, board: Any, census: Any, registry: dict[Any, Any],
                 period: float) -> None:
        self._board = board
        self._census = census
        self._registry = registry
        self.period = period
        self._mu = threading.Lock()
        self._slots: dict[str, tuple[int, int]] = {}
        self._last: dict[str, int] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.published = 0

    def bound(self) -> dict[str, list[int]]:
        with self._mu:
            return {m: list(v) for m, v in self._slots.items()}

    def bind(self, bindings: dict[str, Any]) -> None:
        clean: dict[str, tuple[int, int]] = {}
        for mid, pair in bindings.items():
            slot, tag = (int(x) for x in pair)
            clean[str(mid)] = (slot, tag)
        with self._mu:
            for mid, (slot, tag) in clean.items():
                for other, (s, _) in list(self._slots.items()):
                    if s == slot and other != mid:
                        del self._slots[other]
                        self._last.pop(other, None)
                self._board.bind(slot, tag)
                self._slots[mid] = (slot, tag)
                self._last.pop(mid, None)  # publish it at the next pass
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="comfy-standin-board", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        try:
            self._board.close()
        except Exception:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self._pass()
            except Exception:
                pass  # the census never raises; a board error: next pass
            self._wake.wait(self.period)

    def _pass(self) -> None:
        resident: dict[str, int] = {}
        for entry in self._census():
            try:
                resident[str(entry["id"])] = max(0, int(entry["resident"]))
            except (KeyError, TypeError, ValueError):
                continue
        with self._mu:
            for mid, (slot, _tag) in self._slots.items():
                if mid in resident:
                    value = resident[mid]
                elif mid not in self._registry:
                    value = 0  # collected: comfy-env forgot it
                else:
                    continue  # unknown this pass (missing is not zero)
                if self._last.get(mid) != value:
                    self._board.publish(slot, value)
                    self._last[mid] = value
                    self.published += 1
            self._board.heartbeat()
        self.passes += 1
