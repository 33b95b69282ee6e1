"""The host's end of a board handoff: a worker's board reaches its host, and
nobody else's board does (docs/board.md, "The handoff").

One handoff per spawned worker process:

1. Before the spawn, :class:`Handoff` binds a Unix socket of type
   SOCK_SEQPACKET under a random abstract name (128 bits; no file, so no
   directory anyone could enter) and makes a one-time token (256 bits).
   :attr:`Handoff.spec` goes into that worker's environment only
   (``COMFY_STANDIN_BOARD=<protocol>:<name>:<token>``); the worker-side
   publisher removes it from its own environment once read.
2. The worker makes its board (a memfd only it can write) and sends the
   descriptor with the token, in one message, then closes its copy.
3. After the worker answered, :meth:`Handoff.collect` takes every
   connection waiting on the socket, without waiting for any: the first
   whose peer (SO_PEERCRED, taken by the kernel at connect time) runs as
   this user and is the spawned process or one of its descendants (a
   launcher such as ``pixi run`` sits in between), that sent exactly the
   token and exactly one descriptor, is adopted (``Board.adopt``: seals,
   length and layout checked, mapped read-only, the descriptor closed at
   once).  Everything else -- another process, a wrong token, a second
   connection, one that sent nothing yet, extra descriptors -- is refused
   and its descriptors closed.  Then the socket is closed: no thread, no
   descriptor and no name are left, whatever happened.

The token is not what keeps strangers out (a same-user process can read
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
import struct
from typing import Any, Callable

__all__ = ["Handoff", "HandoffRefused", "PROTOCOL"]

#: Must equal the publisher's PROTOCOL
#: (python/comfy_standin/_worker_side/_comfy_standin_publisher.py).
PROTOCOL = 1
# How many processes up from the peer the spawned one may be (python under
# pixi run under ...): a bound on the walk, not a policy.
_MAX_DEPTH = 8
_TOKEN_BYTES = 32
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


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


class Handoff:
    """A one-shot, private socket for one spawned worker's board."""

    def __init__(self) -> None:
        self.name = f"comfy-standin-{secrets.token_hex(16)}"
        self.token = secrets.token_hex(_TOKEN_BYTES)
        self.spec = f"{PROTOCOL}:{self.name}:{self.token}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind("\0" + self.name)
            sock.listen(16)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock: socket.socket | None = sock

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Closes the socket; connections still queued are refused by the
        kernel.  Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

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
