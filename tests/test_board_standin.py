"""A stand-in reading a live residency board (docs/board.md; issue 5.3).

Both implementations, against real shared memory and a real worker
process (tests/board_worker.py) that publishes without sending a message.
"""

from __future__ import annotations

import os
import random
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from board_worker import writable
from comfy_standin import _core
from test_board import Worker, leftovers, make_pair, wait_until

Board = _core.Board
GIB = 1 << 30

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the board is a sealed memfd: Linux only"
)


class QuietWorker:
    """A comfy-env worker that is alive and never asked anything here."""

    def send_command(self, command, **kwargs):
        raise AssertionError(f"no command expected, got {command}")

    def is_alive(self):
        return True


@pytest.fixture
def boards():
    """(host, worker side) pairs made in this process; closed after the
    test, leaving nothing."""
    made = []

    def make(slots=4, **kwargs):
        host, worker_side = make_pair(slots, **kwargs)
        made.append((host, worker_side, host.name))
        return host, worker_side

    yield make
    for host, worker_side, name in made:
        worker_side.close()
        host.close()
        assert leftovers(name) == []


@pytest.fixture
def spawn():
    workers = []

    def start(slots):
        w = Worker(slots)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.close()


def make(impl, pool, size=8 * GIB, model_id="unet-0"):
    return impl.StandIn(QuietWorker(), 1, model_id, size, "cuda:0", "cpu",
                        pool=pool)


def test_reads_a_real_worker_mid_call_with_no_message(impl, pool, spawn):
    w = spawn(2)
    board = w.board
    s = make(impl, pool)
    slot = s.attach_board(board)
    assert s.board == (board, slot)
    assert board.find("unet-0") == slot
    impl.apply_echo(s, 1 * GIB, seq=1)
    assert w.ask(f"bind {slot} {board.tag(slot)}") == "ok"
    board.expected_owner = w.pid

    steps = [2 * GIB, 5 * GIB, 3 * GIB]
    w.send(f"page {slot} " + " ".join(map(str, steps)))
    for i, value in enumerate(steps):
        wait_until(lambda v=value: s.loaded_size() == v, f"{value} bytes")
        loaded, seq, age, source = s.receipt()
        assert (loaded, seq, source) == (value, 1, "board")
        assert s.current_loaded_device() == "cuda:0"
        assert s.model_loaded_weight_memory == value
        assert s.device == "cuda:0"
        if i + 1 < len(steps):
            assert not w.pending()  # mid-call: the worker said nothing
            w.send("go")
    assert w.reply() == f"done {steps[-1]}"

    # A newer receipt (a command reply) beats an older reading.
    impl.apply_echo(s, 4 * GIB, seq=2)
    assert s.loaded_size() == 4 * GIB
    assert s.receipt()[3] == "load echo"
    # ... until the worker publishes again.
    assert w.ask(f"publish {slot} {6 * GIB}") == "ok"
    assert s.loaded_size() == 6 * GIB

    # The worker is killed and reaped: the host tells its board, which
    # is ignored from then on; the receipt answers.
    w.kill()
    board.worker_gone()
    assert s.loaded_size() == 4 * GIB
    assert s.receipt()[3] == "load echo"


def test_board_values_clamp_and_zero_flips_the_device(impl, pool, boards):
    board, worker_side = boards(1)
    s = make(impl, pool, size=1000)
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    impl.apply_echo(s, 500, seq=1)
    worker_side.publish(slot, 0)
    assert s.loaded_size() == 0
    assert s.current_loaded_device() == "cpu"
    assert s.device == "cpu" and s.model_loaded_weight_memory == 0
    # the board is untrusted: a value beyond the size clamps (written as a
    # writer does, the slot's seqlock word moved by 2: the host notices a
    # slot by that word)
    mem = writable(worker_side)
    base = _core.BOARD_HEADER_SIZE + slot * _core.BOARD_SLOT_SIZE
    mem[base + 16:base + 24] = (2**63).to_bytes(8, "little")
    mem[base + 24:base + 32] = time.monotonic_ns().to_bytes(8, "little")
    seq = int.from_bytes(mem[base:base + 8], "little")
    mem[base:base + 8] = (seq + 2).to_bytes(8, "little")
    assert s.loaded_size() == 1000
    assert s.model_loaded_weight_memory == 1000 and s.device == "cuda:0"


def test_closed_or_detached_board_falls_back_to_the_receipt(
    impl, pool, boards
):
    board, worker_side = boards(1)
    s = make(impl, pool, size=1000)
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    impl.apply_echo(s, 100, seq=1)
    worker_side.publish(slot, 900)
    assert s.loaded_size() == 900
    s.detach_board()
    assert s.board is None and s.loaded_size() == 100
    s.attach_board(board, slot)
    assert s.loaded_size() == 900
    worker_side.close()  # detached from the board: ignored
    assert s.loaded_size() == 100
    board.close()
    assert s.loaded_size() == 100
    assert s.receipt()[3] == "load echo"


def test_a_stale_heartbeat_counts_until_the_next_boundary(impl, pool,
                                                           boards):
    """A worker whose heartbeat went stale (killed before the host
    noticed) stops counting at the next point where ComfyUI decides, the
    pool's boundary() or relist(), at the latest (docs/semantics.md,
    "Which word wins"): the C type keeps a board's verdict while nothing
    it was decided from moved but the clock."""
    board, worker_side = boards(1, heartbeat_limit=0.05)
    s = make(impl, pool, size=1000)
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    impl.apply_echo(s, 100, seq=1)
    worker_side.publish(slot, 900)
    assert s.loaded_size() == 900
    time.sleep(0.2)  # no beat since: the heartbeat is stale
    pool.boundary()
    assert s.loaded_size() == 100
    assert s.receipt()[3] == "load echo"
    worker_side.heartbeat()  # alive again: its reading counts again
    assert s.loaded_size() == 900
    time.sleep(0.2)
    pool.relist(NoModels())
    assert s.loaded_size() == 100


class NoModels:
    """A model_management that lists no model."""

    current_loaded_models: list = []


def test_stale_standin_ignores_the_board(impl, pool, boards):
    board, worker_side = boards(1)
    s = make(impl, pool, size=1000)
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    worker_side.publish(slot, 700)
    assert s.loaded_size() == 700
    pool.worker_gone(s.worker)
    assert s.loaded_size() == 0
    assert s.receipt()[3] == "worker gone"


def test_attach_refuses_what_does_not_fit(impl, pool, boards):
    board, worker_side = boards(2)
    s = make(impl, pool, size=1000)
    other = board.assign("someone-else", 1000)
    with pytest.raises(ValueError, match="does not carry"):
        s.attach_board(board, other)
    mine = board.assign("unet-0", 1000)
    with pytest.raises(TypeError):
        s.attach_board(object())
    with pytest.raises((TypeError, ValueError), match="slot"):
        s.attach_board(board, -1)
    with pytest.raises(ValueError, match="host"):
        s.attach_board(worker_side)
    assert s.board is None
    assert s.attach_board(board, mine) == mine
    # another size under the same id: the board refuses at attach
    t = impl.StandIn(QuietWorker(), 1, "unet-0", 999, "cuda:0", "cpu",
                     pool=impl.Pool())
    with pytest.raises(ValueError, match="1000|999"):
        t.attach_board(board)
    assert t.board is None


def test_a_reused_slot_never_reads_as_the_old_model(impl, pool, boards):
    """Defect 2 (issue 9): stand-in A kept reading its slot after the host
    released it and gave it to model B, and reported B's bytes (clamped to
    A's size) as its own loaded_size(), source "board"."""
    board, worker_side = boards(1)
    a = make(impl, pool, size=4 * GIB, model_id="A")
    slot = a.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    impl.apply_echo(a, 1 * GIB, seq=1)
    worker_side.publish(slot, 3 * GIB)
    assert a.loaded_size() == 3 * GIB
    board.release(slot)  # A is done with it (its stand-in is not)
    assert a.loaded_size() == 1 * GIB
    b = make(impl, pool, size=4 * GIB, model_id="B")
    assert b.attach_board(board) == slot  # the same slot, reused
    worker_side.bind(slot, board.tag(slot))
    worker_side.publish(slot, 2 * GIB)
    assert b.loaded_size() == 2 * GIB
    assert b.receipt()[3] == "board"
    # A never takes B's bytes for its own.
    assert a.loaded_size() == 1 * GIB
    assert a.receipt()[3] == "load echo"


def test_the_hosts_view_changing_is_read_at_once(impl, pool, boards):
    """What the host decides of a board between two reads (the owner it
    expects, the owner marked gone) counts at the very next read, with no
    boundary between: the C type keeps a verdict only while nothing it was
    decided from moved (cs_board_changes)."""
    board, worker_side = boards(1)
    s = make(impl, pool, size=4 * GIB)
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    impl.apply_echo(s, 1 * GIB, seq=1)
    worker_side.publish(slot, 3 * GIB)
    board.expected_owner = os.getpid()  # the worker side is this process
    assert s.loaded_size() == s.loaded_size() == 3 * GIB
    board.expected_owner = os.getpid() + 1  # not the header's owner
    assert s.loaded_size() == 1 * GIB
    board.expected_owner = os.getpid()
    assert s.loaded_size() == 3 * GIB
    board.worker_gone()
    assert s.loaded_size() == 1 * GIB
    assert s.receipt()[3] == "load echo"


SIZE = 10_000


@pytest.fixture(scope="module")
def scribbled():
    board, worker_side = make_pair(2, heartbeat_limit=None)
    yield board, worker_side, writable(worker_side)
    worker_side.close()
    board.close()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), receipt=st.integers(0, SIZE))
def test_random_bytes_never_escape_the_size(impl, scribbled, seed, receipt):
    board, worker_side, mem = scribbled
    pool = impl.Pool(floor=0)
    s = impl.StandIn(QuietWorker(), 1, f"m-{seed % 2}", SIZE, "cuda:0",
                     "cpu", pool=pool)
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    worker_side.publish(slot, seed % (2 * SIZE))
    impl.apply_echo(s, receipt, seq=1)
    rng = random.Random(seed)
    pristine = bytes(mem)
    try:
        for _ in range(8):
            off = rng.randrange(len(mem))
            data = rng.randbytes(rng.randint(1, 16))[: len(mem) - off]
            mem[off:off + len(data)] = data
            loaded = s.loaded_size()
            assert 0 <= loaded <= SIZE
            assert s.receipt()[3] in ("board", "load echo", "unload echo")
            assert s.current_loaded_device() in ("cuda:0", "cpu")
    finally:
        mem[:] = pristine
    s.detach_board()
    assert s.loaded_size() == receipt
    assert slot in (0, 1)
    assert os.getpid() > 0


# ---- the pool owns each worker's board -----------------------------------


@pytest.mark.parametrize("end", ["gone", "restarted", "forget"])
def test_pool_owned_board_never_outlives_worker_or_pool(impl, end):
    pool = impl.Pool(floor=0)
    worker = QuietWorker()
    s = impl.StandIn(worker, 3, "m", 1000, "cuda:0", "cpu", pool=pool)
    first, first_side = make_pair(2, generation=3)
    pool.own_board(worker, first)
    board, worker_side = make_pair(2, generation=3)
    pool.own_board(worker, board)  # one per worker: the first is closed
    assert first.closed and not board.closed
    first_side.close()
    name = board.name
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    try:
        worker_side.publish(slot, 600)
        assert s.loaded_size() == 600
        if end == "gone":
            pool.worker_gone(worker)
        elif end == "restarted":
            pool.restarted(worker, 4)
        else:
            pool.forget(worker)
        assert board.closed
        # the board is ignored from now on: the receipt answers (never
        # written here, so 0; gone and restart zero it anyway)
        assert s.receipt()[3] != "board"
        assert s.loaded_size() == 0
    finally:
        worker_side.close()
    assert leftovers(name) == []


def test_board_goes_with_the_pool(impl):
    import gc

    pool = impl.Pool(floor=0)
    worker = QuietWorker()
    s = impl.StandIn(worker, 1, "m", 1000, "cuda:0", "cpu", pool=pool)
    board, worker_side = make_pair(1)
    worker_side.close()  # only the host's mapping is left
    name = board.name
    pool.own_board(worker, board)
    s.attach_board(board)
    del board
    assert leftovers(name)
    del s, pool  # the stand-in held the pool and the board
    gc.collect()
    assert leftovers(name) == []


def test_pool_boards_are_per_worker(impl):
    pool = impl.Pool(floor=0)
    a, b = QuietWorker(), QuietWorker()
    (board_a, side_a), (board_b, side_b) = make_pair(1), make_pair(1)
    pool.own_board(a, board_a)
    pool.own_board(b, board_b)
    pool.worker_gone(a)
    assert board_a.closed and not board_b.closed
    again, side_again = make_pair(1)  # a new process of it, a new board
    pool.own_board(a, again)
    assert not again.closed
    pool.forget(a)
    pool.forget(b)
    assert again.closed and board_b.closed
    for side in (side_a, side_b, side_again):
        side.close()


def test_attach_in_a_fork_child_is_refused(impl, pool, boards):
    """A board handle inherited across fork() belongs to the parent: the
    child can neither attach to it nor read it (both implementations)."""
    board, worker_side = boards(1)
    s = make(impl, pool, size=1000)
    t = make(impl, pool, size=1000, model_id="other")
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    impl.apply_echo(s, 100, seq=1)
    worker_side.publish(slot, 700)
    assert s.loaded_size() == 700
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if s.loaded_size() != 100:  # the receipt, not the board
                code = 2
            try:
                t.attach_board(board)
                code = 3
            except RuntimeError:
                pass
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
