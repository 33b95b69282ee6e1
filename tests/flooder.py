"""A local user flooding every board handoff socket it can find, for the
handoff tests (tests/test_handoff.py, tests/test_pack_env_board.py).

Run as a script (``python flooder.py [--same-user]``) it plays another
local user: started as root, it imports all it needs, drops to uid and gid
65534 (nobody) with no supplementary groups, checks it cannot get root
back, then does what any local user can: it reads /proc/net/unix over and
over and, for every listening socket whose name holds ``comfy-standin``
(an abstract name or a path), connects as often as it can, non-blocking,
keeping every connection it gets open so that the socket's listen backlog
stays full.  ``--same-user`` does the same without dropping anything (a
process of the host's own user).

Its stdout, one JSON object a line: ``{"ready": uid}`` once it floods;
``{"address": A, "connected": n, "error": E}`` when it has first flooded
address A (n connections made, then the error E that stopped it, an errno
name); and, after a line on its stdin, ``{"summary": {A: {"attempts": n,
"connected": n, "errors": {E: n}}}}``, then it exits 0.

:class:`Flooder` runs it from a test.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import subprocess
import sys
import time

NOBODY = 65534
MARKER = "comfy-standin"
LISTENING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags column
HELD_MAX = 512  # connections kept open, whatever their sockets


def listening_sockets() -> list[str]:
    """Every listening Unix socket named with MARKER, as /proc/net/unix
    lists it (an abstract name with a leading '@')."""
    with open("/proc/net/unix") as f:
        lines = f.read().splitlines()[1:]
    found = []
    for line in lines:
        fields = line.split(None, 7)
        if len(fields) == 8 and int(fields[3], 16) & LISTENING \
                and MARKER in fields[7]:
            found.append(fields[7])
    return found


def _address(listed: str) -> str:
    return "\0" + listed[1:] if listed.startswith("@") else listed


def _say(what: dict) -> None:
    sys.stdout.write(json.dumps(what) + "\n")
    sys.stdout.flush()


def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise SystemExit("flooder: still able to become root after setuid")


def _flood(listed: str, stats: dict, held: list) -> tuple[int, str]:
    """Connects to `listed` until a connect fails: (connections made, the
    errno name that stopped it)."""
    entry = stats.setdefault(listed, {"attempts": 0, "connected": 0,
                                      "errors": {}})
    made = 0
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        entry["attempts"] += 1
        try:
            sock.connect(_address(listed))
        except OSError as exc:
            sock.close()
            name = errno.errorcode.get(exc.errno, str(exc.errno))
            entry["errors"][name] = entry["errors"].get(name, 0) + 1
            return made, name
        entry["connected"] += 1
        made += 1
        if len(held) >= HELD_MAX:
            sock.close()
            return made, "held enough"
        held.append(sock)


def main() -> int:
    if "--same-user" not in sys.argv[1:]:
        try:
            _drop_to_nobody()
        except PermissionError as exc:
            sys.stderr.write(
                f"flooder: cannot become uid {NOBODY} (nobody): {exc}; this "
                f"test plays another local user and needs root (or "
                f"CAP_SETUID and CAP_SETGID), as in CI\n")
            return 2
    stats: dict = {}
    held: list = []
    reported: set = set()
    _say({"ready": os.getuid()})
    while not select.select([sys.stdin], [], [], 0)[0]:
        for listed in listening_sockets():
            made, error = _flood(listed, stats, held)
            if listed not in reported:
                reported.add(listed)
                _say({"address": listed, "connected": made, "error": error})
        time.sleep(0.001)
    _say({"summary": stats})
    for sock in held:
        sock.close()
    return 0


class Flooder:
    """The flooder as a child process of a test: `flooded(listed)` waits
    until it has flooded that socket and returns its first report;
    `stop()` returns the summary.  A context manager."""

    #: Bounds a broken run only; never a speed claim.
    LIMIT = 60.0

    def __init__(self, same_user: bool = False) -> None:
        args = [sys.executable, os.path.abspath(__file__)]
        if same_user:
            args.append("--same-user")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0)
        self._buffer = b""
        self.reports: dict[str, dict] = {}
        ready = self._next()
        expected = os.getuid() if same_user else NOBODY
        assert ready == {"ready": expected}, ready

    def _next(self) -> dict:
        deadline = time.monotonic() + self.LIMIT
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                raise AssertionError("the flooder said nothing for "
                                     f"{self.LIMIT} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait(timeout=self.LIMIT)
                error = self.proc.stderr.read().decode(errors="replace")
                self.close()
                raise AssertionError(f"the flooder exited "
                                     f"{self.proc.returncode}: {error}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def flooded(self, listed: str) -> dict:
        """The flooder's first report on `listed` (as /proc/net/unix lists
        it), once it has flooded it."""
        while listed not in self.reports:
            report = self._next()
            self.reports[report["address"]] = report
        return self.reports[listed]

    def stop(self) -> dict:
        """Stops it: its summary, address -> attempts, connections made and
        errors by errno name."""
        self.proc.stdin.write(b"stop\n")
        while True:
            report = self._next()
            if "summary" in report:
                break
            self.reports[report["address"]] = report
        self.close()
        return report["summary"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=self.LIMIT)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()

    def __enter__(self) -> Flooder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
