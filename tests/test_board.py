"""The live residency board (docs/board.md).

In-process tests open the host and the worker side in one process (two
mappings of one segment); the process tests run tests/board_worker.py as a
real worker.  Nothing here sleeps to synchronise: a test waits on a pipe
(worker replies, sampler notifications) or polls the board itself, which
is the point of the board, under a generous deadline that only turns a
hang into a failure.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbuild import ROOT, build

# The board is POSIX shared memory; its Windows path is not written yet
# (docs/board.md), so on Windows these tests cannot run.
pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="the board is POSIX shared memory"
)

import _posixshmem  # noqa: E402  (CPython's shm_open, POSIX only)

from comfy_standin import _core  # noqa: E402

Board = _core.Board
HEADER = _core.BOARD_HEADER_SIZE
SLOT = _core.BOARD_SLOT_SIZE
GIB = 1 << 30
DEADLINE = 60.0  # seconds before a wait counts as a hang
WORKER = Path(__file__).with_name("board_worker.py")

# Offsets (docs/board.md).
OFF_MAGIC, OFF_VERSION, OFF_SLOT_SIZE, OFF_SLOT_COUNT = 0, 8, 16, 24
OFF_OWNER, OFF_HEARTBEAT = 40, 48
SLOT_SEQ, SLOT_KEY, SLOT_LOADED, SLOT_UPDATED = 0, 8, 48, 56


def name_exists(name: str) -> bool:
    try:
        fd = _posixshmem.shm_open(name, os.O_RDONLY, 0)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


def map_raw(name: str) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_RDWR, 0)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def put(mem, off: int, value: int) -> None:
    mem[off:off + 8] = value.to_bytes(8, "little")


def get(mem, off: int) -> int:
    return int.from_bytes(mem[off:off + 8], "little")


def wait_until(predicate, what: str):
    """Polls `predicate` (a board read) until it returns a true value."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        os.sched_yield()
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def boards():
    """Makes host boards; closes them after the test and checks that each
    one's segment is gone."""
    made = []

    def make(*args, **kwargs):
        board = Board.create(*args, **kwargs)
        made.append((board, board.name))
        return board

    yield make
    for board, name in made:
        board.close()
        assert not name_exists(name), f"{name} outlived its host board"


@pytest.fixture
def pair(boards):
    host = boards(4, generation=2)
    worker = Board.open(host.name)
    yield host, worker
    worker.close()


# ---- in process ----------------------------------------------------------


def test_create_is_private_and_unguessable(boards):
    a, b = boards(), boards(1)
    assert a.name != b.name
    assert a.name.startswith("/csb") and len(a.name) == 4 + 24
    fd = _posixshmem.shm_open(a.name, os.O_RDONLY, 0)
    try:
        st_ = os.fstat(fd)
    finally:
        os.close(fd)
    assert st_.st_mode & 0o777 == 0o600
    assert st_.st_size == HEADER + 64 * SLOT
    assert a.is_host and a.slots == 64 and a.linked and not a.attached
    assert a.heartbeat_limit == 5.0
    assert boards(1, heartbeat_limit=None).heartbeat_limit is None


def test_publish_then_read(pair):
    host, worker = pair
    slot = host.assign("unet-0", 8 * GIB)
    assert host.assign("unet-0", 8 * GIB) == slot
    assert host.assigned_size(slot) == 8 * GIB
    assert worker.find("unet-0") == slot and host.find("unet-0") == slot
    assert worker.find("unet-1") is None
    assert host.attached and host.owner_pid == os.getpid()
    assert host.read(slot) is None and host.status(slot) == "no reading"

    before = time.monotonic_ns()
    worker.publish(slot, 3 * GIB)
    loaded, stamp = host.read(slot)
    assert loaded == 3 * GIB
    assert before <= stamp <= time.monotonic_ns()
    assert host.status(slot) == "valid"
    # The caller's size bounds the reading, not the worker.
    worker.publish(slot, 9 * GIB)
    assert host.read(slot)[0] == 8 * GIB
    assert host.read(slot, GIB)[0] == GIB

    other = host.assign("clip-0", GIB)
    assert other != slot
    host.release(other)
    assert host.status(other) == "unassigned" and host.read(other) is None
    assert worker.find("clip-0") is None

    worker.close()
    assert not host.attached
    assert host.read(slot) is None and host.status(slot) == "not attached"


def test_arguments_are_checked(pair):
    host, worker = pair
    slot = host.assign("m", 100)
    with pytest.raises(ValueError, match=r"publish\(\): loaded"):
        worker.publish(slot, -1)
    with pytest.raises(ValueError, match="loaded"):
        worker.publish(slot, 1 << 63)
    with pytest.raises(TypeError, match="loaded must be an int"):
        worker.publish(slot, True)
    with pytest.raises(TypeError, match="loaded must be an int"):
        worker.publish(slot, 1.5)
    with pytest.raises(IndexError, match="slot 4 out of range"):
        worker.publish(4, 1)
    with pytest.raises(IndexError):
        host.read(-1)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        worker.publish(slot)
    with pytest.raises(RuntimeError, match="worker call"):
        host.publish(slot, 1)
    with pytest.raises(RuntimeError, match="host call"):
        worker.read(slot)
    with pytest.raises(RuntimeError, match="host call"):
        worker.assign("x", 1)
    with pytest.raises(RuntimeError, match="host call"):
        worker.unlink()
    with pytest.raises(ValueError, match="already has slot"):
        host.assign("m", 99)
    with pytest.raises(TypeError, match="model_id must be a str"):
        host.assign(b"m", 1)
    with pytest.raises(ValueError, match="slots must be in"):
        Board.create(0)
    with pytest.raises(ValueError, match="heartbeat_limit"):
        Board.create(1, heartbeat_limit=-1)
    with pytest.raises(TypeError):
        Board()
    for i in range(1, 4):
        host.assign(f"m{i}", 1)
    with pytest.raises(RuntimeError, match="every slot"):
        host.assign("one-too-many", 1)
    with pytest.raises(RuntimeError, match="already open"):
        Board.open(host.name)


def test_closed_board_raises(boards):
    host = boards(1)
    host.close()
    host.close()  # idempotent
    assert host.closed and "closed" in repr(host)
    with pytest.raises(ValueError, match="closed"):
        host.read(0)
    with pytest.raises(ValueError, match="closed"):
        host.name  # noqa: B018 (the read itself must raise)


def test_context_manager_and_weakref(boards):
    import weakref

    host = boards(1)
    with Board.open(host.name) as worker:
        ref = weakref.ref(worker)
        assert host.attached
    assert worker.closed and not host.attached
    del worker
    gc.collect()
    assert ref() is None


def test_expected_owner(pair):
    host, worker = pair
    slot = host.assign("m", 10)
    worker.publish(slot, 5)
    host.expected_owner = os.getpid() + 1
    assert host.status(slot) == "wrong owner" and host.read(slot) is None
    host.expected_owner = os.getpid()
    assert host.expected_owner == os.getpid()
    assert host.read(slot)[0] == 5
    host.expected_owner = None
    assert host.expected_owner is None


@pytest.mark.parametrize(
    "off, value, reading",
    [
        (OFF_MAGIC, 0, "bad header"),
        (OFF_VERSION, 2, "bad header"),
        (OFF_OWNER, 0, "not attached"),
        (OFF_OWNER, 1 << 40, "bad header"),
        (OFF_HEARTBEAT, 0, "stale heartbeat"),
        (OFF_HEARTBEAT, 1, "stale heartbeat"),  # older than the limit
        (OFF_HEARTBEAT, (1 << 64) - 1, "stale heartbeat"),  # the future
        (HEADER + SLOT_SEQ, 1, "torn"),  # a writer died mid-write
        (HEADER + SLOT_KEY, 7, "key mismatch"),
        (HEADER + SLOT_UPDATED, 0, "no reading"),
    ],
)
def test_untrusted_words_read_invalid(pair, off, value, reading):
    host, worker = pair
    slot = host.assign("m", 10)
    assert slot == 0
    worker.publish(slot, 5)
    mem = map_raw(host.name)
    try:
        saved = get(mem, off)
        put(mem, off, value)
        assert host.status(slot) == reading
        assert host.read(slot) is None
        put(mem, off, saved)
        assert host.read(slot)[0] == 5
    finally:
        mem.close()


def test_dead_owner_reads_invalid(boards):
    """A worker pid that is gone: a reaped child wrote it."""
    host = boards(1)
    slot = host.assign("m", 10)
    child = subprocess.run(
        [sys.executable, "-c",
         "import sys; from comfy_standin._core import Board; "
         "b = Board.open(sys.argv[1]); b.publish(0, 4); import os; "
         "os._exit(0)", host.name],
        timeout=DEADLINE,
    )
    assert child.returncode == 0
    assert host.owner_pid not in (None, os.getpid())
    assert host.status(slot) == "dead owner" and host.read(slot) is None


def make_segment(name: str, size: int, words: dict[int, int]) -> None:
    fd = _posixshmem.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL,
                              0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mem:
            for off, value in words.items():
                put(mem, off, value)
    finally:
        os.close(fd)


GOOD = {OFF_MAGIC: _core.BOARD_MAGIC, OFF_VERSION: 1, OFF_SLOT_SIZE: 64,
        OFF_SLOT_COUNT: 2}


@pytest.mark.parametrize(
    "size, change, message",
    [
        (HEADER + 2 * SLOT, {OFF_MAGIC: 0}, "wrong magic"),
        (HEADER + 2 * SLOT, {OFF_VERSION: 2}, "another layout version"),
        (HEADER + 2 * SLOT, {OFF_SLOT_SIZE: 32}, "size is inconsistent"),
        (HEADER + 2 * SLOT, {OFF_SLOT_COUNT: 3}, "size is inconsistent"),
        (HEADER + 3 * SLOT, {}, "size is inconsistent"),
        (16, {}, "size is inconsistent"),
    ],
)
def test_open_refuses_what_is_not_a_board(size, change, message):
    name = f"/csb-test-{os.getpid()}-{os.urandom(4).hex()}"
    words = dict(GOOD) if size >= HEADER else {}
    words.update(change if size >= HEADER else {})
    make_segment(name, size, words)
    try:
        with pytest.raises(ValueError, match=message) as info:
            Board.open(name)
        assert name in str(info.value)
        # The right words open fine: the test can tell the difference.
        if size == HEADER + 2 * SLOT:
            with map_raw(name) as mem:
                for off, value in GOOD.items():
                    put(mem, off, value)
            Board.open(name).close()
    finally:
        _posixshmem.shm_unlink(name)


def test_open_refuses_bad_names():
    with pytest.raises(FileNotFoundError):
        Board.open("/csb-no-such-board")
    for bad in ("no-slash", "/a/b", "/", "/a b"):
        with pytest.raises(ValueError, match="not a board name"):
            Board.open(bad)


def test_unlink_close_and_dealloc_remove_the_name(boards):
    host = boards(1)
    name = host.name
    worker = Board.open(name)
    host.unlink()
    host.unlink()
    assert not host.linked and not name_exists(name)
    slot = host.assign("m", 10)
    worker.publish(slot, 3)  # the mappings outlive the name
    assert host.read(slot)[0] == 3
    worker.close()

    other = Board.create(1)
    name = other.name
    assert name_exists(name)
    del other
    gc.collect()
    assert not name_exists(name)


def test_exit_removes_names_no_object_freed():
    """A board leaked past interpreter exit (never deallocated) is still
    removed: the core's C atexit handler does it."""
    code = textwrap.dedent("""
        import ctypes
        from comfy_standin._core import Board
        b = Board.create(1)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(b))  # leak it
        print(b.name, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=DEADLINE, check=True)
    name = out.stdout.strip()
    assert name.startswith("/csb")
    assert not name_exists(name)


# ---- the sampler ---------------------------------------------------------


@pytest.fixture(scope="module")
def sampler_lib(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampler") / "libsampler.so"
    build([ROOT / "tests" / "c" / "sampler_lib.c"], path, shared=True)
    lib = ctypes.CDLL(str(path))
    lib.test_sampler_new.restype = ctypes.c_void_p
    lib.test_sampler_new.argtypes = [ctypes.c_uint64, ctypes.c_int]
    lib.test_sampler_free.argtypes = [ctypes.c_void_p]
    lib.test_sampler_set.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.test_sampler_set_fail.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.test_sampler_calls.restype = ctypes.c_uint64
    lib.test_sampler_calls.argtypes = [ctypes.c_void_p]
    return lib


def wait_calls(fd: int, n: int) -> None:
    """Waits for n sampler calls (one byte each on the pipe)."""
    for _ in range(n):
        ready, _, _ = select.select([fd], [], [], DEADLINE)
        assert ready, "the sampler thread never called the sampler"
        assert os.read(fd, 1) == b"\x01"


def drain(fd: int) -> None:
    while select.select([fd], [], [], 0)[0]:
        os.read(fd, 4096)


def test_sampler_publishes_from_native_code(pair, sampler_lib):
    host, worker = pair
    slot = host.assign("paged", 100)
    r, w = os.pipe()
    os.set_blocking(w, False)
    ctx = sampler_lib.test_sampler_new(11, w)
    fn = ctypes.cast(sampler_lib.test_sampler_sample, ctypes.c_void_p).value
    try:
        worker.period = 0.001
        assert worker.period == 0.001
        with pytest.raises(RuntimeError, match="worker call"):
            host.add_sampler(slot, fn, ctx)
        with pytest.raises(TypeError, match="addresses"):
            worker.add_sampler(slot, "fn", ctx)
        with pytest.raises(ValueError, match="NULL"):
            worker.add_sampler(slot, 0, ctx)
        worker.add_sampler(slot, fn, ctx)
        # The third call after a change starts after the call that saw
        # the change has published.
        wait_calls(r, 2)
        assert host.read(slot)[0] == 11
        assert worker.sampler_passes >= 1

        sampler_lib.test_sampler_set(ctx, 250)
        drain(r)
        wait_calls(r, 3)
        assert host.read(slot)[0] == 100  # clamped to the host's size

        sampler_lib.test_sampler_set(ctx, 40)
        sampler_lib.test_sampler_set_fail(ctx, 1)
        drain(r)
        wait_calls(r, 3)
        assert host.read(slot)[0] == 100  # a declining sampler: nothing

        sampler_lib.test_sampler_set_fail(ctx, 0)
        drain(r)
        wait_calls(r, 3)
        assert host.read(slot)[0] == 40

        worker.remove_sampler(slot)
        calls = sampler_lib.test_sampler_calls(ctx)
        passes = worker.sampler_passes
        wait_until(lambda: worker.sampler_passes >= passes + 2,
                   "two sampler passes")
        assert sampler_lib.test_sampler_calls(ctx) == calls

        worker.add_sampler(slot, fn, ctx)
        wait_calls(r, 1)
        worker.close()  # stops and joins the thread
        calls = sampler_lib.test_sampler_calls(ctx)
        drain(r)
        assert sampler_lib.test_sampler_calls(ctx) == calls
    finally:
        worker.close()
        sampler_lib.test_sampler_free(ctx)
        os.close(r)
        os.close(w)


# ---- the board is untrusted: random bytes --------------------------------

SIZES = [0, 1, 100, GIB, (1 << 63) - 1]


@pytest.fixture(scope="module")
def scribble_board():
    host = Board.create(len(SIZES), heartbeat_limit=None)
    worker = Board.open(host.name)
    for i, size in enumerate(SIZES):
        host.assign(f"m{i}", size)
        worker.publish(i, size // 2)
    mem = map_raw(host.name)
    pristine = bytes(mem)
    yield host, mem, pristine
    mem.close()
    worker.close()
    host.close()


def check_reads(host) -> None:
    for i, size in enumerate(SIZES):
        reading = host.read(i)
        status = host.status(i)
        assert isinstance(status, str)
        if reading is not None:
            loaded, stamp = reading
            assert 0 <= loaded <= size
            assert 0 < stamp <= time.monotonic_ns()
        clamped = host.read(i, 3)
        if clamped is not None:
            assert 0 <= clamped[0] <= 3


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(patches=st.lists(
    st.tuples(st.integers(0, HEADER + len(SIZES) * SLOT - 1),
              st.binary(min_size=1, max_size=24)),
    max_size=12))
def test_random_bytes_never_escape_the_size(scribble_board, patches):
    host, mem, pristine = scribble_board
    mem[:] = pristine
    for off, data in patches:
        data = data[:len(mem) - off]
        mem[off:off + len(data)] = data
        check_reads(host)
    mem[:] = pristine
    assert host.read(1) == host.read(1) is not None  # restored: valid


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slot=st.integers(0, len(SIZES) - 1),
       value=st.integers(0, (1 << 64) - 1),
       stamp=st.integers(0, (1 << 64) - 1))
def test_any_slot_value_clamps(scribble_board, slot, value, stamp):
    host, mem, pristine = scribble_board
    mem[:] = pristine
    base = HEADER + slot * SLOT
    put(mem, base + SLOT_LOADED, value)
    put(mem, base + SLOT_UPDATED, stamp)
    reading = host.read(slot)
    if stamp == 0:
        assert reading is None
    else:
        assert reading is not None
        assert reading[0] == min(value, SIZES[slot])
        assert 0 < reading[1] <= time.monotonic_ns()
    mem[:] = pristine


# ---- a real worker process -----------------------------------------------


class Worker:
    """tests/board_worker.py as a subprocess, driven over its pipes."""

    def __init__(self, name: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            bufsize=1,
        )
        words = self.reply().split()
        assert words[0] == "ready", words
        self.pid = int(words[1])

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def pending(self) -> bool:
        """Whether the worker wrote anything (without waiting)."""
        return bool(select.select([self.proc.stdout], [], [], 0)[0])

    def reply(self) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], DEADLINE)
        assert ready, "the worker did not answer"
        line = self.proc.stdout.readline()
        assert line, f"the worker died (rc {self.proc.poll()})"
        return line.strip()

    def ask(self, line: str) -> str:
        self.send(line)
        return self.reply()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(DEADLINE)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def spawn():
    workers = []

    def start(name: str) -> Worker:
        w = Worker(name)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.close()


def test_host_reads_changes_made_mid_call(boards, spawn):
    host = boards(2, generation=1)
    slot = host.assign("unet-0", 8 * GIB)
    w = spawn(host.name)
    host.expected_owner = w.pid
    assert host.attached and host.owner_pid == w.pid
    host.unlink()  # the worker has it open: the name may go now

    steps = [GIB, 3 * GIB, 2 * GIB, 0, 8 * GIB]
    w.send(f"page {slot} " + " ".join(map(str, steps)))
    for i, value in enumerate(steps):
        seen = wait_until(
            lambda v=value: (r := host.read(slot)) is not None
            and r[0] == v and r,
            f"the board to show {value}",
        )
        assert seen[0] == value
        if i + 1 < len(steps):
            # Mid-call: the worker has said nothing, yet the host knows.
            assert not w.pending()
            w.send("go")
    assert w.reply() == f"done {steps[-1]}"


def test_sigkill_mid_publish_invalidates_and_leaks_nothing(spawn):
    for unlink_early in (True, False):
        host = Board.create(1, generation=1)
        name = host.name
        slot = host.assign("unet-0", GIB)
        w = spawn(name)
        host.expected_owner = w.pid
        if unlink_early:
            host.unlink()
        assert w.ask(f"storm {slot} {GIB}") == "storming"
        wait_until(lambda h=host, s=slot: h.read(s) is not None,
                   "a valid reading")
        w.kill()  # SIGKILL, mid-publish, and reaped
        assert host.read(slot) is None
        assert host.status(slot) in ("dead owner", "torn")
        assert name_exists(name) is (not unlink_early)
        host.close()
        assert not name_exists(name)


def test_worker_close_detaches(boards, spawn):
    host = boards(1)
    slot = host.assign("m", 10)
    w = spawn(host.name)
    assert w.ask(f"publish {slot} 7") == "ok"
    assert host.read(slot)[0] == 7
    assert w.ask("close") == "closed"
    assert not host.attached and host.read(slot) is None
    assert w.ask(f"publish {slot} 7").startswith("error ValueError")


def test_two_workers_do_not_see_each_other(boards, spawn):
    a, b = boards(2, generation=1), boards(2, generation=1)
    slot_a = a.assign("model-a", 100)
    slot_b = b.assign("model-b", 100)
    wa, wb = spawn(a.name), spawn(b.name)
    a.expected_owner, b.expected_owner = wa.pid, wb.pid
    assert wa.ask("find model-a") == f"slot {slot_a}"
    assert wa.ask("find model-b") == "slot none"
    assert wb.ask("find model-a") == "slot none"
    # A worker cannot take over another worker's board.
    assert wa.ask(f"open {b.name}") == "refused RuntimeError"
    assert wa.ask(f"publish {slot_a} 60") == "ok"
    assert wb.ask(f"publish {slot_b} 30") == "ok"
    assert a.read(slot_a)[0] == 60 and b.read(slot_b)[0] == 30
    # The same slot index on the other board is another model's.
    assert wa.ask(f"publish {slot_b} 99") == "ok"
    assert b.read(slot_b)[0] == 30
    a.unlink()
    b.unlink()
    assert wb.ask(f"open {a.name}") == "refused FileNotFoundError"


def test_concurrent_scribbler_process(spawn):
    """A second process writes random bytes over the board while the host
    reads: no crash, and nothing outside [0, size]."""
    host = Board.create(len(SIZES), heartbeat_limit=None)
    name = host.name
    try:
        for i, size in enumerate(SIZES):
            host.assign(f"m{i}", size)
        w = spawn(name)
        for i, size in enumerate(SIZES):
            assert w.ask(f"publish {i} {size // 2}") == "ok"
        assert w.ask("scribble") == "scribbling"
        for _ in range(20000):
            check_reads(host)
        w.kill()
    finally:
        host.close()
    assert not name_exists(name)
