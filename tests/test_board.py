"""The live residency board, v2 (docs/board.md).

In-process tests make the board here (Board.make: the worker's side, whose
writable mapping the tests scribble through) and adopt it here too
(Board.adopt: the host's side, read-only); the process tests run
tests/board_worker.py as a real, sometimes hostile, worker that makes its
board and hands it over (comfy_standin._handoff).  Nothing here sleeps to
synchronise: a test waits on a pipe (worker replies) or polls the board
itself, under a generous deadline that only turns a hang into a failure.

"The host never stalls" is checked with CPU time, not wall time: every
host call a test makes under attack is timed with time.thread_time_ns()
(the calling thread's CPU), so a loaded machine that preempts the test
cannot fail it, while a host call that spins (the old 250 ms seqlock
wait with the GIL held) cannot pass.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import mmap
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from board_worker import writable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbuild import ROOT, build

# The board is a sealed memfd: Linux only (docs/board.md).
pytestmark = pytest.mark.skipif(
    sys.platform != "linux",
    reason="the board is a sealed memfd: Linux only",
)

from comfy_standin import _core  # noqa: E402
from comfy_standin._handoff import ENV_VAR, Handoff  # noqa: E402

Board = _core.Board
HEADER = _core.BOARD_HEADER_SIZE
SLOT = _core.BOARD_SLOT_SIZE
GIB = 1 << 30
DEADLINE = 60.0  # seconds before a wait counts as a hang
STALL_NS = 10_000_000  # a host call may use at most 10 ms of CPU
WORKER = Path(__file__).with_name("board_worker.py")
SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
         | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10))

# Offsets (docs/board.md).
OFF_MAGIC, OFF_OWNER, OFF_HEARTBEAT = 0, 40, 48
SLOT_SEQ, SLOT_TAG, SLOT_LOADED, SLOT_UPDATED = 0, 8, 16, 24


def put(mem, off: int, value: int) -> None:
    mem[off:off + 8] = value.to_bytes(8, "little")


def get(mem, off: int) -> int:
    return int.from_bytes(mem[off:off + 8], "little")


def label(board) -> str:
    return board.name.removeprefix("memfd:")


def leftovers(name: str) -> list[str]:
    """Descriptors and mappings of board `name` in this process."""
    want = name.removeprefix("memfd:")
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if want in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(f"fd {fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        found += [ln for ln in maps.read().splitlines() if want in ln]
    return found


def wait_until(predicate, what: str):
    """Polls `predicate` (a board read) until it returns a true value."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        os.sched_yield()
    pytest.fail(f"timed out waiting for {what}")


class CpuClock:
    """Times host calls by the calling thread's CPU; keeps the worst."""

    def __init__(self) -> None:
        self.worst = 0

    def __call__(self, fn, *args):
        start = time.thread_time_ns()
        try:
            return fn(*args)
        finally:
            self.worst = max(self.worst, time.thread_time_ns() - start)


class GilProbe:
    """A thread that wakes every millisecond and records the longest gap
    between wake-ups: what a UI thread would feel.  Reported, not
    asserted on (a loaded machine alone can make gaps)."""

    def __init__(self) -> None:
        self.worst = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter_ns()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter_ns()
            self.worst = max(self.worst, now - last)
            last = now

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        print(f"GIL probe: longest gap {self.worst / 1e6:.1f} ms")


def make_pair(slots: int, generation: int = 0, **host_kwargs):
    """(host, worker): a board made here and adopted here, as a worker
    and its host would, with no descriptor left."""
    worker, fd = Board.make(slots, generation=generation)
    try:
        host = Board.adopt(fd, slots, generation=generation, **host_kwargs)
    finally:
        os.close(fd)
    return host, worker


@pytest.fixture
def boards():
    """Makes (host, worker) pairs; closes them after the test and checks
    that no descriptor or mapping of any is left in this process."""
    made = []

    def make(*args, **kwargs):
        host, worker = make_pair(*args, **kwargs)
        made.append((host, worker, host.name))
        return host, worker

    yield make
    for host, worker, name in made:
        worker.close()
        host.close()
        gc.collect()
        assert leftovers(name) == [], f"{name} outlived its boards"


@pytest.fixture
def pair(boards):
    return boards(4, generation=2)


def bound(host, worker, model_id: str, size: int) -> int:
    slot = host.assign(model_id, size)
    worker.bind(slot, host.tag(slot))
    return slot


# ---- in process ----------------------------------------------------------


def test_make_is_a_memfd_only_its_maker_can_write():
    worker, fd = Board.make(2)
    try:
        assert not worker.is_host and worker.slots == 2
        assert worker.attached and worker.owner_pid == os.getpid()
        assert worker.name.startswith("memfd:csb-")
        assert not any(label(worker) in n for n in os.listdir("/dev/shm"))
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:csb-")
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        # Defect 1: a worker could shrink the segment under the host,
        # whose next read died of SIGBUS.  Nobody can resize it now...
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)
        assert os.fstat(fd).st_size == HEADER + 2 * SLOT
        # ...nor write it except through the maker's own mapping.
        with pytest.raises(PermissionError):
            mmap.mmap(fd, HEADER + 2 * SLOT)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        # Close-on-exec: only a process it is sent to gets it.
        assert not os.get_inheritable(fd)
        host = Board.adopt(fd, 2)
    finally:
        os.close(fd)
    try:
        assert host.is_host and host.name == worker.name
        assert not [x for x in leftovers(host.name) if x.startswith("fd ")]
    finally:
        host.close()
        worker.close()


def test_publish_then_read(pair):
    host, worker = pair
    slot = host.assign("unet-0", 8 * GIB)
    assert host.assign("unet-0", 8 * GIB) == slot
    assert host.find("unet-0") == slot and host.find("nope") is None
    assert host.read(slot) is None
    assert host.status(slot) == "no reading"
    with pytest.raises(RuntimeError, match="bind"):
        worker.publish(slot, GIB)  # no tag yet
    worker.bind(slot, host.tag(slot))
    before = time.monotonic_ns()
    worker.publish(slot, 3 * GIB)
    loaded, stamp = host.read(slot)
    assert loaded == 3 * GIB
    assert before <= stamp <= time.monotonic_ns() + 10_000_000
    assert host.status(slot) == "valid"
    assert host.read(slot, GIB)[0] == GIB  # the caller's size clamps
    assert host.assigned_size(slot) == 8 * GIB
    # Host-only and worker-only calls stay on their side.
    with pytest.raises(RuntimeError):
        host.publish(slot, 1)
    with pytest.raises(RuntimeError):
        worker.read(slot)
    with pytest.raises(RuntimeError):
        worker.assign("x", 1)
    with pytest.raises(RuntimeError):
        worker.tag(slot)
    with pytest.raises(ValueError, match="already has slot"):
        host.assign("unet-0", 7)


def test_tags_never_repeat_and_fit_an_int64(boards):
    host, _ = boards(1)
    seen = set()
    for i in range(200):
        slot = host.assign(f"m{i % 3}", 10)
        tag = host.tag(slot)
        assert 0 < tag < 2**63 and tag not in seen
        seen.add(tag)
        host.release(slot)
        assert host.tag(slot) == 0 and host.status(slot) == "unassigned"


def test_arguments_are_checked(pair):
    host, worker = pair
    slot = bound(host, worker, "m", 100)
    for bad in (-1, 4, 2**64, True):
        with pytest.raises((IndexError, TypeError)):
            host.read(bad)
    with pytest.raises(TypeError):
        worker.publish(slot, 1.5)
    with pytest.raises(ValueError):
        worker.publish(slot, -1)
    with pytest.raises(ValueError):
        worker.publish(slot, 2**63)
    with pytest.raises(TypeError):
        worker.bind(slot, True)
    with pytest.raises(ValueError):
        worker.bind(slot, -1)
    with pytest.raises(TypeError):
        host.assign(b"m", 1)
    with pytest.raises(ValueError, match="period"):
        worker.period = 0
    with pytest.raises(TypeError):
        Board.adopt(3.0, 1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"slots": 2**32 + 3}, "slots"),  # was 3 slots
        ({"slots": 0}, "slots"),
        ({"slots": 4097}, "slots"),
        ({"generation": -1}, "generation"),  # was 2**64 - 1
        ({"generation": 2**64 + 7}, "generation"),  # was 7
    ],
)
def test_make_refuses_integers_out_of_range(kwargs, field):
    """Issue 8, defect 5: out-of-range inputs were silently truncated."""
    with pytest.raises(ValueError, match=field):
        Board.make(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"fd": -1}, "fd"),
        ({"slots": 2**32 + 1}, "slots"),
        ({"slots": 0}, "slots"),
        ({"generation": -1}, "generation"),
        ({"generation": 2**64 + 7}, "generation"),
        ({"heartbeat_limit": 1e-10}, "heartbeat_limit"),  # was "never"
        ({"heartbeat_limit": 0}, "heartbeat_limit"),
        ({"heartbeat_limit": -1.0}, "heartbeat_limit"),
        ({"heartbeat_limit": float("nan")}, "heartbeat_limit"),
        ({"heartbeat_limit": float("inf")}, "heartbeat_limit"),
        ({"heartbeat_limit": 0.001}, "heartbeat_limit"),
    ],
)
def test_adopt_refuses_integers_out_of_range(boards, kwargs, field):
    worker, fd = Board.make(1)
    try:
        with pytest.raises(ValueError, match=field):
            Board.adopt(**{"fd": fd, "slots": 1, **kwargs})
    finally:
        os.close(fd)
        worker.close()


@pytest.mark.parametrize(
    "make, kwargs",
    [(True, {"slots": True}), (True, {"generation": False}),
     (True, {"slots": 2.0}), (False, {"heartbeat_limit": True}),
     (False, {"heartbeat_limit": "5"}), (False, {"slots": 1.0}),
     (False, {"fd": True})],
)
def test_bools_and_non_numbers_are_refused(make, kwargs):
    if make:
        with pytest.raises(TypeError):
            Board.make(**kwargs)
        return
    worker, fd = Board.make(1)
    try:
        with pytest.raises(TypeError):
            Board.adopt(**{"fd": fd, "slots": 1, **kwargs})
    finally:
        os.close(fd)
        worker.close()


def test_the_edges_are_accepted(boards):
    assert boards(1)[0].slots == 1
    assert boards(4096)[0].slots == 4096
    assert boards(1, generation=2**63 - 1)[0].generation == 2**63 - 1
    assert boards(1, heartbeat_limit=None)[0].heartbeat_limit is None
    assert boards(1, heartbeat_limit=0.01)[0].heartbeat_limit == 0.01


def test_closed_board_raises(boards):
    host, _ = boards(1)
    host.close()
    assert host.closed
    with pytest.raises(ValueError, match="closed"):
        host.read(0)
    host.close()  # idempotent


def test_worker_close_detaches(boards):
    host, worker = boards(2)
    slot = bound(host, worker, "m", 10)
    worker.publish(slot, 5)
    assert host.attached and host.owner_pid == os.getpid()
    worker.close()
    assert not host.attached and host.status(slot) == "not attached"


def test_adopt_refuses_what_is_not_a_sealed_board():
    def memfd(size: int, seals: int = 0, data: bytes = b"") -> int:
        fd = os.memfd_create("not-a-board", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        os.pwrite(fd, data, 0)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd

    worker, fd = Board.make(1)
    header = os.pread(fd, HEADER, 0)
    worker.close()
    os.close(fd)
    size = HEADER + SLOT
    cases = [
        # Not sealed: the maker could shrink it, or anyone write it.
        (memfd(size, 0, header), "sealed"),
        (memfd(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, header),
         "sealed"),
        (memfd(size, SEALS & ~fcntl.F_SEAL_SEAL, header), "sealed"),
        # Sealed, but not a board, or not of this size.
        (memfd(size, SEALS), "magic"),
        (memfd(size + SLOT, SEALS, header), "size"),
    ]
    for fd, reason in cases:
        try:
            with pytest.raises(ValueError, match=reason):
                Board.adopt(fd, 1)
        finally:
            os.close(fd)
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError):
            Board.adopt(r, 1)
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(OSError):
        Board.adopt(999_999, 1)


def test_expected_owner_and_worker_gone(pair):
    host, worker = pair
    slot = bound(host, worker, "m", 10)
    worker.publish(slot, 7)
    host.expected_owner = os.getpid() + 1
    assert host.status(slot) == "wrong owner"
    host.expected_owner = os.getpid()
    assert host.read(slot) == (7, host.read(slot)[1])
    host.worker_gone()
    assert host.owner_is_gone and host.status(slot) == "dead owner"
    assert host.read(slot) is None


def test_reads_make_no_liveness_system_call(pair):
    """Defect 6: reads paid a kill(pid, 0) each, which also names the
    wrong process across PID namespaces.  A worker in another namespace
    writes its own pid; the host, told that pid, reads valid although no
    process of that pid exists here."""
    host, worker = pair
    slot = bound(host, worker, "m", 10)
    worker.publish(slot, 7)
    mem = writable(worker)
    ghost = 4_194_000  # above any pid_max default: no such process
    put(mem, OFF_OWNER, ghost)
    host.expected_owner = ghost
    assert host.status(slot) == "valid"
    put(mem, OFF_OWNER, os.getpid())  # so the worker can detach


def test_heartbeat_limit(boards):
    host, worker = boards(1, heartbeat_limit=0.05)
    mem = writable(worker)
    slot = bound(host, worker, "m", 10)
    worker.publish(slot, 3)
    assert host.status(slot) == "valid"
    put(mem, OFF_HEARTBEAT, time.monotonic_ns() - 10**9)
    assert host.status(slot) == "stale heartbeat"
    put(mem, OFF_HEARTBEAT, time.monotonic_ns() + 10 * 10**9)
    assert host.status(slot) == "stale heartbeat"  # from the future
    put(mem, OFF_HEARTBEAT, 0)
    assert host.status(slot) == "stale heartbeat"
    worker.heartbeat()
    assert host.status(slot) == "valid"


def test_future_stamp_is_clamped(pair):
    host, worker = pair
    slot = bound(host, worker, "m", 10)
    worker.publish(slot, 3)
    mem = writable(worker)
    put(mem, HEADER + slot * SLOT + SLOT_UPDATED, 2**63 - 1)
    loaded, stamp = host.read(slot)
    assert stamp <= time.monotonic_ns() + 50_000_000


def test_a_reused_slot_never_reports_another_models_bytes(pair):
    """Defect 2: the host released a slot and gave it to model B; model
    A's reader then took B's bytes for A's."""
    host, worker = pair
    a = bound(host, worker, "A", 10 * GIB)
    tag_a = host.tag(a)
    worker.publish(a, 2 * GIB)
    assert host.read(a, 10 * GIB, tag_a)[0] == 2 * GIB
    host.release(a)
    b = host.assign("B", 10 * GIB)
    assert b == a and host.tag(b) != tag_a
    # The worker has not heard yet: its A reading must not count for B.
    assert host.status(b) == "tag mismatch"
    worker.bind(b, host.tag(b))
    worker.publish(b, 9 * GIB)
    assert host.read(b)[0] == 9 * GIB
    # A reader still holding A's tag gets nothing, never B's bytes.
    assert host.read(a, 10 * GIB, tag_a) is None
    assert host.status(a, 10 * GIB, tag_a) == "unassigned"


def test_stuck_odd_slot_never_stalls_the_host(pair):
    """Defect 4: a slot whose seqlock word stayed odd made assign and
    release spin 250 ms each with the GIL held, and the stuck slot stayed
    the lowest free one, so every later assign failed."""
    host, worker = pair
    mem = writable(worker)
    clock = CpuClock()
    slot = bound(host, worker, "stuck", 100)
    worker.publish(slot, 50)
    put(mem, HEADER + slot * SLOT + SLOT_SEQ, 7)  # odd forever
    for _ in range(20):
        assert clock(host.status, slot) == "torn"
        assert clock(host.read, slot) is None
        clock(host.release, slot)
        assert clock(host.assign, "next", 100) == slot  # reusable
        clock(host.release, slot)
        assert clock(host.assign, "stuck", 100) == slot
    assert clock.worst < STALL_NS, clock.worst
    put(mem, HEADER + slot * SLOT + SLOT_SEQ, 8)


def test_host_never_writes_the_segment(pair):
    host, worker = pair
    mem = writable(worker)
    before = bytes(mem)
    for i in range(4):
        host.assign(f"m{i}", 100)
    host.release(1)
    host.assign("again", 5)
    for i in range(4):
        host.read(i)
        host.status(i)
    host.expected_owner = 1
    host.worker_gone()
    assert bytes(mem) == before


# ---- fork ----------------------------------------------------------------


def _fork(child) -> int:
    """Runs child() in a fork()ed child; its exit code (1 on exception)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child() or 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_fork_child_closing_a_host_board_leaves_the_parent_alone(pair):
    """Defect 3: a child's close or dealloc acted on the parent's board."""
    host, worker = pair
    slot = bound(host, worker, "m", 100)
    worker.publish(slot, 42)

    def child():
        if host.status(slot) != "other process":
            return 3
        try:
            host.assign("x", 1)
        except RuntimeError:
            pass
        else:
            return 4
        host.close()
        return 0

    assert _fork(child) == 0
    assert host.read(slot)[0] == 42 and host.attached


def test_fork_child_closing_a_worker_board_does_not_detach(pair):
    host, worker = pair
    slot = bound(host, worker, "m", 100)
    worker.publish(slot, 42)

    def child():
        try:
            worker.publish(slot, 99)
        except RuntimeError:
            pass
        else:
            return 3
        worker.close()
        return 0

    assert _fork(child) == 0
    assert host.attached and host.owner_pid == os.getpid()
    assert host.read(slot)[0] == 42


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
    for name in ("hold",):
        getattr(lib, f"test_sampler_{name}").argtypes = [ctypes.c_void_p,
                                                         ctypes.c_int]
    for name in ("holding", "held_out"):
        getattr(lib, f"test_sampler_{name}").argtypes = [ctypes.c_void_p]
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
    slot = bound(host, worker, "paged", 100)
    r, w = os.pipe()
    os.set_blocking(w, False)
    ctx = sampler_lib.test_sampler_new(11, w)
    fn = ctypes.cast(sampler_lib.test_sampler_sample, ctypes.c_void_p).value
    try:
        worker.period = 0.001
        with pytest.raises(RuntimeError):
            host.add_sampler(slot, fn, ctx)
        with pytest.raises(TypeError, match="addresses"):
            worker.add_sampler(slot, "fn", ctx)
        worker.add_sampler(slot, fn, ctx)
        wait_calls(r, 2)
        assert host.read(slot)[0] == 11
        sampler_lib.test_sampler_set(ctx, 250)
        drain(r)
        wait_calls(r, 3)
        assert host.read(slot)[0] == 100  # clamped to the host's size
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


# Forking with the sampler thread running is the point of the test: the
# child only closes and exits, which is the case that warning is about.
@pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning")
def test_fork_with_a_sampler_running(pair, sampler_lib):
    """Defect 3: with a sampler running, a child's close() joined a
    thread the child does not have, and hung."""
    host, worker = pair
    slot = bound(host, worker, "paged", 100)
    r, w = os.pipe()
    os.set_blocking(w, False)
    ctx = sampler_lib.test_sampler_new(33, w)
    fn = ctypes.cast(sampler_lib.test_sampler_sample, ctypes.c_void_p).value
    try:
        worker.period = 0.001
        worker.add_sampler(slot, fn, ctx)
        wait_calls(r, 2)
        def child():
            worker.close()  # must not join the parent's thread
            host.close()
            return 0

        for _ in range(20):  # fork at random points of the sampler pass
            pid = os.fork()
            if pid == 0:
                os._exit(child())
            end = time.monotonic() + DEADLINE
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > end:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    pytest.fail("the child's close() hung")
                time.sleep(0.001)
            assert os.waitstatus_to_exitcode(status) == 0
        passes = worker.sampler_passes
        wait_until(lambda: worker.sampler_passes > passes + 2,
                   "the parent's sampler to keep running")
        assert host.attached and host.read(slot)[0] == 33
    finally:
        worker.close()
        sampler_lib.test_sampler_free(ctx)
        os.close(r)
        os.close(w)


# ---- random segments (in process) ----------------------------------------


SIZES = [1000, 5000]


@pytest.fixture(scope="module")
def scribble_board():
    host, worker = make_pair(2, heartbeat_limit=None)
    for i, size in enumerate(SIZES):
        slot = host.assign(f"m{i}", size)
        worker.bind(slot, host.tag(slot))
        worker.publish(slot, size // 2)
    mem = writable(worker)
    yield host, mem
    del mem
    worker.close()
    host.close()


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(patches=st.lists(
    st.tuples(st.integers(0, HEADER + 2 * SLOT - 1),
              st.binary(min_size=1, max_size=24)),
    max_size=12))
def test_random_bytes_never_escape_the_size(scribble_board, patches):
    host, mem = scribble_board
    pristine = bytes(mem)
    try:
        for off, data in patches:
            data = data[: len(mem) - off]
            mem[off:off + len(data)] = data
        for slot in (0, 1):
            reading = host.read(slot)
            assert host.status(slot) in (
                "valid", "torn", "tag mismatch", "no reading",
                "not attached", "stale heartbeat", "wrong owner")
            if reading is not None:
                assert 0 <= reading[0] <= SIZES[slot]
                assert reading[1] <= time.monotonic_ns() + 50_000_000
    finally:
        mem[:] = pristine


# ---- a real worker process -----------------------------------------------


class Worker:
    """tests/board_worker.py as a subprocess, driven over its pipes: it
    makes its board and hands it over; `board` is the host's side."""

    def __init__(self, slots: int, generation: int = 0, **host_kwargs):
        with Handoff() as handoff:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), str(slots)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                bufsize=1, env={**os.environ, ENV_VAR: handoff.spec},
            )
            self.board = None
            words = self.reply().split()
            assert words[0] == "ready", words
            self.pid = int(words[1])
            self.board, _, _ = handoff.collect(self.proc.pid, lambda fd: (
                Board.adopt(fd, slots, generation=generation,
                            **host_kwargs)))

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
        if self.board is not None:
            self.board.close()


@pytest.fixture
def spawn():
    """Starts workers; ends them after the test and checks that nothing
    of their boards is left in this process."""
    workers = []

    def start(slots: int, **kwargs) -> Worker:
        w = Worker(slots, **kwargs)
        workers.append((w, w.board.name))
        return w

    yield start
    for w, name in workers:
        w.close()
        gc.collect()
        assert leftovers(name) == [], f"{name} outlived its host board"


def attach(w: Worker, model_id: str, size: int) -> int:
    slot = w.board.assign(model_id, size)
    assert w.ask(f"bind {slot} {w.board.tag(slot)}") == "ok"
    return slot


def test_host_reads_changes_made_mid_call(spawn):
    w = spawn(2, generation=1)
    host = w.board
    slot = attach(w, "unet-0", 8 * GIB)
    host.expected_owner = w.pid
    assert host.attached and host.owner_pid == w.pid
    steps = [GIB, 3 * GIB, 2 * GIB, 0, 8 * GIB]
    w.send(f"page {slot} " + " ".join(map(str, steps)))
    for i, value in enumerate(steps):
        wait_until(lambda v=value: (r := host.read(slot)) is not None
                   and r[0] == v, f"the board to show {value}")
        if i + 1 < len(steps):
            assert not w.pending()  # mid-call: the worker said nothing
            w.send("go")
    assert w.reply() == f"done {steps[-1]}"


def test_hostile_workers_never_stall_or_crash_the_host(spawn):
    clock = CpuClock()
    with GilProbe():
        for attack in ("scribble", "odd", "storm"):
            w = spawn(2, heartbeat_limit=1.0)
            host = w.board
            slots = [attach(w, f"m{i}", 1000) for i in range(2)]
            host.expected_owner = w.pid
            cmd = f"storm {slots[0]} 1000" if attack == "storm" else attack
            assert w.ask(cmd) in ("scribbling", "odd", "storming")
            seen = set()
            for i in range(3000):
                slot = slots[i % 2]
                reading = clock(host.read, slot)
                seen.add(clock(host.status, slot))
                if reading is not None:
                    assert 0 <= reading[0] <= 1000
                if i % 500 == 0:  # the host's own table stays usable
                    clock(host.release, slots[1])
                    slots[1] = clock(host.assign, "again", 1000)
            w.kill()
            host.worker_gone()
            assert host.status(slots[0]) == "dead owner"
            if attack == "odd":
                assert "torn" in seen, seen
            print(attack, sorted(seen))
    assert clock.worst < STALL_NS, clock.worst


def test_worker_fork_and_close_in_the_child(spawn):
    w = spawn(1)
    host = w.board
    slot = attach(w, "m", 100)
    assert w.ask(f"publish {slot} 70") == "ok"
    assert w.ask("forkclose") == "forked 0"
    assert host.attached and host.owner_pid == w.pid
    assert host.read(slot)[0] == 70
    assert w.ask(f"publish {slot} 71") == "ok"
    assert host.read(slot)[0] == 71


def test_worker_reuses_slots(spawn):
    w = spawn(1)
    host = w.board
    for i in range(20):
        slot = attach(w, f"model-{i}", 1000 + i)
        old_tag = host.tag(slot)
        assert w.ask(f"publish {slot} {500 + i}") == "ok"
        assert host.read(slot)[0] == 500 + i
        host.release(slot)
        new = host.assign(f"model-{i}-next", 1000)
        # Until the worker is told, the old model's bytes never show.
        assert host.read(new) is None
        assert host.read(slot, 1000 + i, old_tag) is None
        host.release(new)


def test_a_closed_worker_reads_not_attached(spawn):
    w = spawn(1)
    slot = attach(w, "m", 100)
    assert w.ask(f"publish {slot} 5") == "ok"
    assert w.ask("close") == "closed"
    assert not w.board.attached
    assert w.board.status(slot) == "not attached"


# ---- SIGKILL at random points --------------------------------------------

KILL_BATCH = 25
KILL_BATCHES = 4  # 100 trials

# One process per batch forks a worker per board in turn: the worker makes
# its board, hands it over (its handoff's spec in argv), reads its tag on
# stdin, binds it and publishes in a tight loop until its parent kills it
# at a random point.
KILLER = r"""
import os, random, signal, sys, time
from comfy_standin._demo_worker import make_and_send

rng = random.Random(int(sys.argv[1]))
for i, spec in enumerate(sys.argv[2:]):
    r, w = os.pipe()
    os.environ["COMFY_STANDIN_BOARD"] = spec
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            b = make_and_send(1, 0)
            print("sent", i, flush=True)
            b.bind(0, int(sys.stdin.readline()))
            os.write(w, b"x")
            publish, values = b.publish, random.Random(i)
            while True:
                publish(0, values.randrange(4000))
        finally:
            os._exit(1)
    os.close(w)
    os.read(r, 1)  # publishing (or, on b"", gone)
    os.close(r)
    end = time.monotonic() + rng.uniform(0.0005, 0.01)
    while time.monotonic() < end:
        pass
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("killed", i, flush=True)
print("done", flush=True)
"""


def test_sigkill_at_random_points_leaves_nothing():
    clock = CpuClock()
    names = []
    with GilProbe():
        for batch in range(KILL_BATCHES):
            handoffs = [Handoff() for _ in range(KILL_BATCH)]
            proc = subprocess.Popen(
                [sys.executable, "-c", KILLER, str(batch),
                 *(h.spec for h in handoffs)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                bufsize=1,
            )
            hosts = []
            try:
                for handoff in handoffs:
                    assert proc.stdout.readline().split()[:1] == ["sent"]
                    h, _, _ = handoff.collect(proc.pid, lambda fd: (
                        Board.adopt(fd, 1, heartbeat_limit=5.0)))
                    hosts.append(h)
                    names.append(h.name)
                    h.assign("m", 1000)
                    proc.stdin.write(f"{h.tag(0)}\n")
                    proc.stdin.flush()
                    assert proc.stdout.readline().split()[:1] == [
                        "killed"]
                    # Killed at a random point, maybe inside a publish:
                    # the host reads at once, bounded, never more than
                    # the size.
                    for _ in range(50):
                        r = clock(h.read, 0)
                        assert r is None or 0 <= r[0] <= 1000
                        assert clock(h.status, 0) in (
                            "valid", "torn", "no reading")
                    h.worker_gone()  # reaped: the pool tells the board
                    assert clock(h.status, 0) == "dead owner"
                assert proc.stdout.readline().strip() == "done"
                assert proc.wait(DEADLINE) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdin.close()
                proc.stdout.close()
                for h in hosts:
                    h.close()
                for handoff in handoffs:
                    handoff.close()
    assert clock.worst < STALL_NS, clock.worst
    gc.collect()
    for name in names:
        assert leftovers(name) == [], name


def test_exit_leaves_no_segment():
    """A worker that never closes its board leaves nothing: a memfd has
    no name, and the kernel frees it with the process."""
    code = textwrap.dedent("""
        import ctypes, os
        from comfy_standin._core import Board
        b, fd = Board.make(1)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(b))  # leak it
        print(b.name, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=DEADLINE, check=True)
    assert out.stdout.startswith("memfd:csb-")
    # its label, not a diff of the folder: other runs make files there
    label = out.stdout.strip().removeprefix("memfd:")
    assert not any(label in n for n in os.listdir("/dev/shm"))


def test_poll_owner_sees_an_exited_worker_through_a_pidfd(spawn):
    w = spawn(1)
    host = w.board
    slot = attach(w, "m", 100)
    assert w.ask(f"publish {slot} 40") == "ok"
    host.expected_owner = w.pid
    assert host.poll_owner() is False
    assert host.status(slot) == "valid"
    w.kill()  # the pidfd turns readable at exit: no reaping needed
    assert host.poll_owner() is True
    assert host.owner_is_gone and host.status(slot) == "dead owner"
    pidfds = [fd for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}")
              and "pidfd" in os.readlink(f"/proc/self/fd/{fd}")]
    host.close()
    left = [fd for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")
            and "pidfd" in os.readlink(f"/proc/self/fd/{fd}")]
    assert len(left) == len(pidfds) - 1  # close() dropped the pidfd


# ---- no wait with the GIL held -------------------------------------------


def test_publish_waits_for_another_writer_without_the_gil():
    """Board.publish waited up to 100 ms for a slot another writer held,
    with the GIL held: no other thread of the host could run meanwhile.
    Here the writer inside is finished by a second Python thread, which
    can run only if publish lets go of the GIL while it waits."""
    host, worker = make_pair(1)
    slot = host.assign("m", 100)
    worker.bind(slot, host.tag(slot))
    mem = writable(worker)
    seq = HEADER + slot * SLOT + SLOT_SEQ
    put(mem, seq, 1)  # a writer is inside
    ran = []
    go = threading.Lock()
    go.acquire()

    def finish_the_write() -> None:
        with go:  # waits without the GIL until the main thread is ready
            ran.append(get(mem, seq))
            put(mem, seq, 2)

    thread = threading.Thread(target=finish_the_write)
    thread.start()
    interval = sys.getswitchinterval()
    # From here the main thread keeps the GIL unless it lets go of it.
    sys.setswitchinterval(1000.0)
    try:
        go.release()  # the thread now needs only the GIL
        worker.publish(slot, 42)
    finally:
        sys.setswitchinterval(interval)
        thread.join()
        worker.close()
        host.close()
    assert ran == [1]  # it ran while publish waited


@pytest.mark.parametrize("call", ["add_sampler", "remove_sampler"])
def test_sampler_calls_wait_for_a_pass_without_the_gil(sampler_lib, call):
    """add_sampler and remove_sampler wait for a running sampler pass (the
    samplers run under the board's lock), and waited with the GIL held.
    Here the pass is held until a second Python thread lets it go, which
    it can do only if the call lets go of the GIL while it waits."""
    host, worker = make_pair(2)
    ctx = sampler_lib.test_sampler_new(5, -1)
    fn = ctypes.cast(sampler_lib.test_sampler_sample, ctypes.c_void_p).value
    go = threading.Lock()
    go.acquire()

    def let_go() -> None:
        with go:  # waits without the GIL until the main thread is ready
            sampler_lib.test_sampler_hold(ctx, 0)

    try:
        sampler_lib.test_sampler_hold(ctx, 1)
        worker.add_sampler(0, fn, ctx)
        wait_until(lambda: sampler_lib.test_sampler_holding(ctx),
                   "the sampler to hold its pass")
        thread = threading.Thread(target=let_go)
        thread.start()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1000.0)  # as in the publish test above
        try:
            go.release()
            if call == "add_sampler":
                worker.add_sampler(1, fn, ctx)
            else:
                worker.remove_sampler(0)
        finally:
            sys.setswitchinterval(interval)
            thread.join()
        assert not sampler_lib.test_sampler_held_out(ctx)
    finally:
        worker.close()
        host.close()
        sampler_lib.test_sampler_free(ctx)
