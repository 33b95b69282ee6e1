"""The board handoff (comfy_standin._handoff): a board reaches its host only
from the spawned worker or its descendants, with the one-time token, once;
everything else is refused, no other user can reach or block it, and
nothing is left behind.

Every peer is a real process: a child of this one plays the spawned worker
(its own child plays a worker under a launcher), another child plays a
stranger of the same user, and tests/flooder.py plays another local user
(uid 65534) or this one flooding every handoff socket it can find.  Boards
are real (Board.make in the peer, Board.adopt here); the worker's side of
the connection is the publisher's own (_send_board).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

import comfy_standin
from comfy_standin import Board
from comfy_standin import _handoff
from comfy_standin._handoff import PROTOCOL, Handoff, HandoffRefused, in_tree

from flooder import Flooder

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="boards are memfds: Linux"
)

PUBLISHER_DIR = os.path.join(os.path.dirname(comfy_standin.__file__),
                             "_worker_side")

# A peer: connects to the handoff named by the spec and sends what `mode`
# says, prints "sent" (or, in mode "publisher", why the publisher could
# not send), then waits for a line on stdin (so it is alive when the host
# looks at it).  Mode "launcher" starts a grandchild that does "good";
# mode "publisher" hands the board over as the worker-side publisher does.
PEER = textwrap.dedent('''
    import array, os, socket, subprocess, sys
    from comfy_standin import Board

    spec, mode, publisher_dir = sys.argv[1:4]
    sys.path.insert(0, publisher_dir)
    import _comfy_standin_publisher as publisher

    path, token = publisher._parse_spec(spec)

    def send(message, fds):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                array.array("i", fds).tobytes())] if fds else []
        s.sendmsg([message], anc)
        return s

    keep = []
    if mode == "launcher":
        child = subprocess.Popen([sys.executable, __file__, spec, "good",
                                  publisher_dir], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        print(child.stdout.readline().strip(), flush=True)
        sys.stdin.readline()
        child.stdin.write("\\n")
        child.stdin.flush()
        child.wait()
        sys.exit(0)
    board, fd = Board.make(4)
    said = "sent"
    if mode == "publisher":
        said = publisher._send_board(path, token, fd) or "sent"
    elif mode == "good":
        keep.append(send(token.encode(), [fd]))
    elif mode == "twice":
        keep.append(send(token.encode(), [fd]))
        other, fd2 = Board.make(4)
        keep.append(send(token.encode(), [fd2]))
    elif mode == "wrong-token":
        keep.append(send(b"0" * len(token), [fd]))
    elif mode == "silent":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
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
    print(said, flush=True)
    sys.stdin.readline()
''')


def publisher():
    """The worker-side publisher, loaded from its file as a worker loads
    it (it is no module of the comfy_standin package)."""
    spec = importlib.util.spec_from_file_location(
        "_comfy_standin_publisher",
        os.path.join(PUBLISHER_DIR, "_comfy_standin_publisher.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
            [sys.executable, str(script), handoff.spec, mode, PUBLISHER_DIR],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        said = proc.stdout.readline().strip()
        assert said == "sent", said
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
    assert board.owner_pid == worker.pid
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


def test_a_stranger_of_this_user_without_the_token_is_refused(peers, clean):
    """A process of the same user can enter the directory and connect (it
    is this user's): what refuses it is the peer check."""
    with Handoff() as handoff:
        stranger = peers(handoff, "wrong-token")
        worker = peers(handoff, "good")
        board, pid, refusals = handoff.collect(worker.pid, _adopt)
    assert pid == worker.pid
    assert [r.kind for r in refusals] == ["peer"]
    assert str(stranger.pid) in refusals[0].detail
    board.close()


@pytest.mark.other_uid
def test_another_user_flooding_the_handoff_cannot_keep_the_board_out(
        peers, clean):
    """A process of another uid (nobody) reads /proc/net/unix, finds the
    handoff socket there and connects to it as often as it can, from
    before the worker starts until the board is taken.  It never gets a
    connection (EACCES: it cannot enter the directory), and the worker
    hands its board over through the publisher's own connect.  (An
    abstract socket let it fill the backlog: the worker's connect failed
    at once with EAGAIN.)"""
    with Flooder() as flooder, Handoff() as handoff:
        first = flooder.flooded(handoff.path)
        assert first == {"address": handoff.path, "connected": 0,
                         "error": "EACCES"}
        worker = peers(handoff, "publisher")
        board, pid, refusals = handoff.collect(worker.pid, _adopt)
        summary = flooder.stop()
    assert pid == worker.pid and refusals == []
    assert board.owner_pid == worker.pid
    board.close()
    # Every attempt failed: EACCES, or ENOENT once collect() had removed
    # the path (the socket stays listed until it is closed).
    stats = summary[handoff.path]
    assert stats["attempts"] >= 1 and stats["connected"] == 0
    assert "EACCES" in stats["errors"], stats
    assert set(stats["errors"]) <= {"EACCES", "ENOENT"}, stats


def test_a_flood_by_this_user_is_refused_by_the_peer_check(tmp_path, clean):
    """The same flood by a process of this user does fill the backlog (a
    process of the same user can as well kill the worker: what it cannot
    do is have its board or its bytes taken for the worker's).  The
    publisher says why it could not hand the board over, every queued
    connection is refused as a peer outside the spawned tree, and nothing
    is left."""
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    with Flooder(same_user=True) as flooder, Handoff() as handoff:
        first = flooder.flooded(handoff.path)
        assert first["connected"] > 0 and first["error"] == "EAGAIN", first
        worker = subprocess.Popen(
            [sys.executable, str(script), handoff.spec, "publisher",
             PUBLISHER_DIR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        said, _ = worker.communicate("\n", timeout=60)
        with pytest.raises(HandoffRefused) as caught:
            handoff.collect(worker.pid, _adopt)
        flooder.stop()
    assert said.startswith("cannot hand the board to the host: "), said
    assert "Resource temporarily unavailable" in said
    kinds = {r.kind for r in caught.value.refusals}
    assert kinds == {"peer"}, caught.value.refusals
    assert len(caught.value.refusals) == first["connected"]
    assert str(flooder.proc.pid) in caught.value.refusals[0].detail


def test_after_the_handoff_nobody_can_connect(peers, clean):
    handoff = Handoff()
    worker = peers(handoff, "good")
    board, _, _ = handoff.collect(worker.pid, _adopt)
    board.close()
    assert not os.path.exists(handoff.directory)
    late = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with late, pytest.raises(FileNotFoundError):
        late.connect(handoff.path)


def test_paths_and_tokens_are_fresh_and_private(clean):
    """A socket in a fresh directory of this user's that no one else may
    enter, named with the token in the spec; removed on close."""
    first, second = Handoff(), Handoff()
    try:
        assert first.path != second.path and first.token != second.token
        assert len(first.token) == 64
        assert first.spec == f"{PROTOCOL}:{first.path}:{first.token}"
        directory = os.lstat(first.directory)
        assert stat.S_ISDIR(directory.st_mode)
        assert stat.S_IMODE(directory.st_mode) == 0o700
        assert directory.st_uid == os.geteuid()
        assert os.path.dirname(first.path) == first.directory
        assert os.path.basename(first.directory).startswith(
            _handoff.DIR_PREFIX)
        assert stat.S_ISSOCK(os.lstat(first.path).st_mode)
        assert len(os.fsencode(first.path)) <= _handoff.SUN_PATH_MAX
        assert publisher()._parse_spec(first.spec) == (first.path,
                                                       first.token)
    finally:
        first.close()
        second.close()
    for handoff in (first, second):
        assert not os.path.exists(handoff.directory)
    first.close()  # idempotent


def test_a_handoff_nobody_closed_leaves_nothing(clean):
    """Dropped without close(): its socket and directory go with it; one
    still open at exit goes at exit; a fork() child's exit leaves its
    parent's."""
    handoff = Handoff()
    directory = handoff.directory
    del handoff
    gc.collect()
    assert not os.path.exists(directory)

    code = textwrap.dedent("""
        import os, sys
        from comfy_standin._handoff import Handoff
        kept = Handoff()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs the child's exit handlers
        os.waitpid(pid, 0)
        print(kept.directory, os.path.exists(kept.path), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    directory, after_fork = done.stdout.split()
    assert after_fork == "True"
    assert not os.path.exists(directory)


def test_a_private_runtime_directory_is_used_first(tmp_path, monkeypatch,
                                                   clean):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with Handoff() as handoff:
        assert os.path.dirname(handoff.directory) == str(runtime)
    runtime.chmod(0o755)  # not this user's alone: not used
    with Handoff() as handoff:
        assert os.path.dirname(handoff.directory) != str(runtime)
    assert os.listdir(runtime) == []


def test_a_path_too_long_for_a_socket_falls_back_then_says_so(
        tmp_path, monkeypatch, clean):
    """sun_path holds 107 bytes and a NUL: a runtime directory too deep
    for that is passed over for the next; when every one is, the handoff
    is not made and the error says why for each."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    with Handoff() as handoff:
        assert len(os.fsencode(handoff.path)) <= _handoff.SUN_PATH_MAX
        assert not handoff.directory.startswith(str(deep))
    monkeypatch.setattr(_handoff, "_parents", lambda: [str(deep)])
    with pytest.raises(OSError, match=r"no private directory for the "
                       r"handoff socket \(.*: a socket path there has "
                       r"\d+ bytes, more than 107\)"):
        Handoff()
    assert os.listdir(deep) == []


@pytest.mark.parametrize("spec", [
    "",
    "1:comfy-standin-" + "0" * 32 + ":" + "0" * 64,  # protocol 1's name
    f"{PROTOCOL}:relative/comfy-standin-handoff-x/board:" + "0" * 64,
    f"{PROTOCOL}:/tmp/comfy-standin-handoff-x/other:" + "0" * 64,
    f"{PROTOCOL}:/tmp/elsewhere/board:" + "0" * 64,
    f"{PROTOCOL}:/tmp/comfy-standin-handoff-x/board:" + "0" * 63,
    f"{PROTOCOL}:/{'d' * 90}/comfy-standin-handoff-x/board:" + "0" * 64,
    "9:/tmp/comfy-standin-handoff-x/board:" + "0" * 64,
])
def test_the_publisher_refuses_a_spec_that_is_not_a_handoff(spec):
    assert isinstance(publisher()._parse_spec(spec), str)


def test_the_publisher_takes_a_path_with_colons():
    spec = f"{PROTOCOL}:/a:b/comfy-standin-handoff-x_1/board:" + "0" * 64
    assert publisher()._parse_spec(spec) == (
        "/a:b/comfy-standin-handoff-x_1/board", "0" * 64)


@pytest.mark.parametrize("mode", [0o755, 0o710])
def test_the_publisher_sends_into_a_private_directory_only(tmp_path, mode,
                                                          clean):
    """A socket in a directory another user may enter (or one swapped in)
    gets nothing: the publisher says why and never connects."""
    directory = tmp_path / "comfy-standin-handoff-open"
    directory.mkdir()
    directory.chmod(mode)
    path = str(directory / "board")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with listener:
        listener.bind(path)
        listener.listen(4)
        listener.setblocking(False)
        board, fd = Board.make(4)
        try:
            said = publisher()._send_board(path, "0" * 64, fd)
        finally:
            os.close(fd)
            board.close()
        assert said == (f"cannot hand the board to the host: the handoff "
                        f"directory {directory} is not this user's alone "
                        f"(uid {os.geteuid()}, mode {oct(mode)})")
        with pytest.raises(BlockingIOError):
            listener.accept()
