"""The board handoff (comfy_standin._handoff): a board reaches its host only
from the spawned worker or its descendants, with the one-time token, once;
everything else is refused, and nothing is left behind.

Every peer is a real process: a child of this one plays the spawned worker
(its own child plays a worker under a launcher), another child plays a
stranger of the same user.  Boards are real (Board.make in the peer,
Board.adopt here).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from comfy_standin import Board
from comfy_standin._handoff import Handoff, HandoffRefused, in_tree

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="boards are memfds: Linux"
)

# A peer: connects to the handoff and sends what `mode` says, prints
# "sent", then waits for a line on stdin (so it is alive when the host
# looks at it).  Mode "launcher" starts a grandchild that does "good".
PEER = textwrap.dedent('''
    import array, os, socket, subprocess, sys
    from comfy_standin import Board

    name, token, mode = sys.argv[1:4]

    def send(message, fds):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect("\\0" + name)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                array.array("i", fds).tobytes())] if fds else []
        s.sendmsg([message], anc)
        return s

    keep = []
    if mode == "launcher":
        child = subprocess.Popen([sys.executable, __file__, name, token,
                                  "good"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        print(child.stdout.readline().strip(), flush=True)
        sys.stdin.readline()
        child.stdin.write("\\n")
        child.stdin.flush()
        child.wait()
        sys.exit(0)
    board, fd = Board.make(4)
    if mode == "good":
        keep.append(send(token.encode(), [fd]))
    elif mode == "twice":
        keep.append(send(token.encode(), [fd]))
        other, fd2 = Board.make(4)
        keep.append(send(token.encode(), [fd2]))
    elif mode == "wrong-token":
        keep.append(send(b"0" * len(token), [fd]))
    elif mode == "silent":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect("\\0" + name)
        keep.append(s)
    elif mode == "two-fds":
        keep.append(send(token.encode(), [fd, os.dup(fd)]))
    elif mode == "no-fd":
        keep.append(send(token.encode(), []))
    elif mode == "long":
        keep.append(send(token.encode() + b"x" * 100, [fd]))
    elif mode == "unsealed":
        forged = os.memfd_create("forged", os.MFD_ALLOW_SEALING)
        os.ftruncate(forged, 64 + 64 * 4)
        keep.append(send(token.encode(), [forged]))
    os.close(fd)
    print("sent", flush=True)
    sys.stdin.readline()
''')


def _adopt(fd: int) -> Board:
    return Board.adopt(fd, 4)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def clean():
    """Nothing of a handoff is left: no descriptor, no thread."""
    fds, threads = _fds(), threading.active_count()
    yield
    assert _fds() == fds
    assert threading.active_count() == threads


@pytest.fixture
def peers(tmp_path, clean):
    """peers(handoff, mode) -> a live peer process that has sent.  Asks
    for `clean` so that its check runs after the peers are gone."""
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    started: list[subprocess.Popen] = []

    def start(handoff: Handoff, mode: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(script), handoff.name, handoff.token, mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout.readline().strip() == "sent"
        return proc

    try:
        yield start
    finally:
        for proc in started:
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
            except OSError:
                pass
            proc.wait(timeout=60)
            proc.stdout.close()
            proc.stdin.close()


def test_the_spawned_worker_hands_its_board_over(peers, clean):
    with Handoff() as handoff:
        worker = peers(handoff, "good")
        board, pid, refusals = handoff.collect(worker.pid, _adopt)
    assert pid == worker.pid and refusals == []
    assert board.owner_pid == worker.pid and board.fd is None
    board.close()
    assert handoff.closed


def test_a_descendant_of_the_spawned_process_is_the_worker(peers, clean):
    """pixi run starts the worker's Python as its child."""
    with Handoff() as handoff:
        launcher = peers(handoff, "launcher")
        board, pid, _ = handoff.collect(launcher.pid, _adopt)
    assert pid != launcher.pid and in_tree(pid, launcher.pid)
    board.close()


def test_a_stranger_with_the_token_is_refused(peers, clean):
    """Another process of the same user that read the token from the
    worker's environment, connecting first: refused by the peer check; the
    worker's board is still taken."""
    with Handoff() as handoff:
        stranger = peers(handoff, "good")
        worker = peers(handoff, "good")
        board, pid, refusals = handoff.collect(worker.pid, _adopt)
    assert pid == worker.pid
    assert [r.kind for r in refusals] == ["peer"]
    assert str(stranger.pid) in refusals[0].detail
    board.close()


@pytest.mark.parametrize("mode, kind", [
    ("wrong-token", "token"),
    ("silent", "silent"),
    ("two-fds", "malformed"),
    ("no-fd", "malformed"),
    ("long", "malformed"),
    ("unsealed", "board"),
])
def test_a_bad_handoff_is_refused_and_leaves_nothing(peers, clean, mode,
                                                      kind):
    with Handoff() as handoff:
        worker = peers(handoff, mode)
        with pytest.raises(HandoffRefused) as caught:
            handoff.collect(worker.pid, _adopt)
    assert [r.kind for r in caught.value.refusals] == [kind]


def test_a_second_connection_is_refused(peers, clean):
    with Handoff() as handoff:
        worker = peers(handoff, "twice")
        board, pid, refusals = handoff.collect(worker.pid, _adopt)
    assert pid == worker.pid
    assert [r.kind for r in refusals] == ["second"]
    board.close()


def test_nothing_connected(clean):
    with Handoff() as handoff:
        with pytest.raises(HandoffRefused, match="nothing connected"):
            handoff.collect(os.getpid(), _adopt)


def test_after_the_handoff_nobody_can_connect(peers, clean):
    handoff = Handoff()
    worker = peers(handoff, "good")
    board, _, _ = handoff.collect(worker.pid, _adopt)
    board.close()
    late = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with late, pytest.raises(ConnectionRefusedError):
        late.connect("\0" + handoff.name)


def test_names_and_tokens_are_fresh_and_private():
    first, second = Handoff(), Handoff()
    try:
        assert first.name != second.name and first.token != second.token
        assert len(first.token) == 64 and first.name.startswith(
            "comfy-standin-")
        assert first.spec == f"1:{first.name}:{first.token}"
        # Abstract: no file anyone could find or open.
        assert not os.path.exists(first.name)
    finally:
        first.close()
        second.close()
