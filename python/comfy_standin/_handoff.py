"""The host's end of a board handoff: a worker's board reaches its host, and
nobody else's board does (docs/board.md, "The handoff").

One handoff per spawned worker process:

1. Before the spawn, :class:`Handoff` makes a fresh directory of mode 0700
   (``mkdtemp`` under the user's runtime directory, else the temporary
   directory), binds a Unix socket of type SOCK_SEQPACKET in it and makes
   a one-time token (256 bits).  No other user can enter the directory, so
   none can connect, fill the listen backlog or see what goes over it;
   the socket's path (listed in /proc/net/unix for everyone) is no way
   in.  :attr:`Handoff.spec` goes into that worker's environment only
   (``COMFY_STANDIN_BOARD=<protocol>:<socket path>:<token>``); the
   worker-side publisher removes it from its own environment once read.
2. The worker makes its board (a memfd only it can write) and sends the
   descriptor with the token, in one message, then closes its copy.
3. After the worker answered, :meth:`Handoff.collect` removes the socket's
   path and directory (no connection can start after that) and takes
   every connection waiting on the socket, without waiting for any: the
   first whose peer (SO_PEERCRED, taken by the kernel at connect time)
   runs as this user and is the spawned process or one of its descendants
   (a launcher such as ``pixi run`` sits in between), that sent exactly
   the token and exactly one descriptor, is adopted (``Board.adopt``:
   seals, length and layout checked, mapped read-only, the descriptor
   closed at once).  Everything else -- another process, a wrong token, a
   second connection, one that sent nothing yet, extra descriptors -- is
   refused and its descriptors closed.  Then the socket is closed: no
   thread, no descriptor, no file and no directory are left, whatever
   happened (a handoff dropped without collect() or close() goes with
   its last reference, or at exit).

The token is not what keeps processes of this user out (one can read
another's environment through /proc/<pid>/environ): the peer check is.  The
token makes the handoff one-shot and ties a message to this spawn.
"""

from __future__ import annotations

import array
import dataclasses
import hmac
import os
import secrets
import socket
import stat
import struct
import tempfile
import weakref
from typing import Any, Callable

__all__ = ["ENV_VAR", "Handoff", "HandoffRefused", "PROTOCOL"]

#: Must equal the publisher's PROTOCOL and ENV_VAR
#: (python/comfy_standin/_worker_side/_comfy_standin_publisher.py): the
#: variable naming a worker's handoff (its environment only).
PROTOCOL = 2
ENV_VAR = "COMFY_STANDIN_BOARD"
# How many processes up from the peer the spawned one may be (python under
# pixi run under ...): a bound on the walk, not a policy.
_MAX_DEPTH = 8
_TOKEN_BYTES = 32
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: The handoff directory's name begins with this; the socket in it is
#: SOCKET_NAME.  The publisher checks both.
DIR_PREFIX = "comfy-standin-handoff-"
SOCKET_NAME = "board"
#: The longest socket path: sizeof(sun_path) on Linux (108) less the
#: terminating NUL that C clients expect.
SUN_PATH_MAX = 107


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One refused connection: `kind` is a fixed word (for log-once keys),
    `detail` says what was seen."""

    kind: str
    detail: str


class HandoffRefused(Exception):
    """No board was handed over; `refusals` says what was refused."""

    def __init__(self, message: str, refusals: list[Refusal]):
        super().__init__(message)
        self.refusals = refusals


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` from /proc, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(8192).splitlines():
                if line.startswith(b"PPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def in_tree(pid: int, root: int) -> bool:
    """Whether `pid` is `root` or one of its descendants."""
    for _ in range(_MAX_DEPTH):
        if pid == root:
            return True
        if pid <= 1:
            return False
        parent = parent_pid(pid)
        if parent is None:
            return False
        pid = parent
    return False


def _parents() -> list[str]:
    """Where a handoff directory may go, best first: the user's runtime
    directory when it is this user's alone, the temporary directory, and
    /tmp (short where TMPDIR is long)."""
    found = []
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        try:
            st = os.stat(runtime)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) \
                and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            found.append(runtime)
    try:
        found.append(tempfile.gettempdir())
    except OSError:
        pass
    if "/tmp" not in found:
        found.append("/tmp")
    return found


def _private_directory() -> tuple[str, str]:
    """(directory, socket path): a fresh directory of mode 0700 whose
    socket path fits in sun_path, or OSError saying why not for every
    place tried."""
    why = []
    for parent in _parents():
        try:
            directory = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=parent)
        except OSError as exc:
            why.append(f"{parent}: {exc.strerror or exc}")
            continue
        path = os.path.join(directory, SOCKET_NAME)
        length = len(os.fsencode(path))
        if length <= SUN_PATH_MAX:
            return directory, path
        _remove(path, directory, os.getpid())
        why.append(f"{parent}: a socket path there has {length} bytes, "
                   f"more than {SUN_PATH_MAX}")
    raise OSError("no private directory for the handoff socket ("
                  + "; ".join(why) + ")")


def _remove(path: str, directory: str, maker: int) -> None:
    """Removes the socket's path and its directory, in the process that
    made them only (a fork() child's copy of a handoff leaves them)."""
    if os.getpid() != maker:
        return
    for remove, name in ((os.unlink, path), (os.rmdir, directory)):
        try:
            remove(name)
        except OSError:
            pass  # gone already; nothing here may raise into a close


def _close(sock: socket.socket, path: str, directory: str,
           maker: int) -> None:
    sock.close()
    _remove(path, directory, maker)


class Handoff:
    """A one-shot, private socket for one spawned worker's board."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(_TOKEN_BYTES)
        self.directory, self.path = _private_directory()
        self.spec = f"{PROTOCOL}:{self.path}:{self.token}"
        self._maker = maker = os.getpid()
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except BaseException:
            _remove(self.path, self.directory, maker)
            raise
        try:
            sock.bind(self.path)
            sock.listen(16)
            sock.setblocking(False)
        except BaseException:
            _close(sock, self.path, self.directory, maker)
            raise
        self._sock: socket.socket | None = sock
        # Closes the socket and removes its path, once: on close(), when
        # the last reference goes, or at exit.
        self._finalizer = weakref.finalize(self, _close, sock, self.path,
                                           self.directory, maker)

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Closes the socket (connections still queued are refused by the
        kernel) and removes its path and directory.  Idempotent."""
        self._sock = None
        self._finalizer()

    def __enter__(self) -> Handoff:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def collect(
        self, spawned_pid: int, adopt: Callable[[int], Any]
    ) -> tuple[Any, int, list[Refusal]]:
        """Takes the board the spawned worker sent: ``(adopt(fd), peer pid,
        refusals)``, or raises :class:`HandoffRefused`.  Never waits: call
        it after the worker said it sent.  Closes the socket."""
        refusals: list[Refusal] = []
        adopted: tuple[Any, int] | None = None
        sock = self._sock
        try:
            # No connection can start once the path is gone: what is
            # queued now is all there is.
            _remove(self.path, self.directory, self._maker)
            while sock is not None:
                try:
                    conn, _ = sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                with conn:
                    if adopted is not None:
                        # Closed unread: descriptors it queued are
                        # released by the kernel, never received here.
                        refusals.append(Refusal(
                            "second", "a second connection after the "
                                      "board was handed over"))
                        continue
                    try:
                        adopted = self._take(conn, spawned_pid, adopt)
                    except _Refused as refused:
                        refusals.append(refused.refusal)
        finally:
            self.close()
        if adopted is None:
            what = "; ".join(f"{r.kind}: {r.detail}" for r in refusals)
            raise HandoffRefused(
                "the worker's board did not arrive"
                + (f" ({what})" if what else " (nothing connected)"),
                refusals,
            )
        return adopted[0], adopted[1], refusals

    def _take(self, conn: socket.socket, spawned_pid: int,
              adopt: Callable[[int], Any]) -> tuple[Any, int]:
        try:
            pid, uid, _gid = _UCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                _UCRED.size))
        except OSError as exc:
            raise _Refused("peer", f"no peer credentials ({exc})") from None
        if uid != os.getuid():
            raise _Refused("peer", f"pid {pid} runs as uid {uid}")
        if not in_tree(pid, spawned_pid):
            raise _Refused("peer", f"pid {pid} is not the spawned worker "
                                   f"{spawned_pid} or its descendant")
        fds: list[int] = []
        try:
            try:
                message, ancillary, flags, _ = conn.recvmsg(
                    len(self.token) + 1,
                    socket.CMSG_SPACE(array.array("i").itemsize),
                    socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC,
                )
            except (BlockingIOError, InterruptedError):
                raise _Refused("silent", f"pid {pid} connected and sent "
                                         f"nothing") from None
            except OSError as exc:
                raise _Refused("malformed", f"pid {pid}: {exc}") from None
            fds = _descriptors(ancillary)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise _Refused("malformed", f"pid {pid} sent more than a "
                                            f"token and one descriptor")
            if not hmac.compare_digest(message,
                                       self.token.encode("ascii")):
                raise _Refused("token", f"pid {pid} sent a wrong token")
            if len(fds) != 1:
                raise _Refused("malformed", f"pid {pid} sent {len(fds)} "
                                            f"descriptors, not one")
            try:
                board = adopt(fds[0])
            except (ValueError, OSError, RuntimeError) as exc:
                raise _Refused("board", f"pid {pid}'s board refused: "
                                        f"{exc}") from None
            return board, pid
        finally:
            for fd in fds:
                os.close(fd)


class _Refused(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.refusal = Refusal(kind, detail)


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """Every descriptor received, whatever the message claimed to be."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % array.array("i").itemsize
            fds.extend(array.array("i", data[:usable]))
    return fds
