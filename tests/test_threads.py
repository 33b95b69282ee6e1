"""Threads: no lost updates, no torn reads (ledger.h: per-worker writer
lock, seqlocked receipts).  Every writer writes ``resident = 3 * seq`` so
a reader can tell a torn (loaded, seq) pair; threads start together on a
Barrier; nothing sleeps."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

WRITERS = 4
READERS = 3
ROUNDS = 3000
SIZE = 3 * WRITERS * ROUNDS + 3


@pytest.fixture(autouse=True)
def fast_switching():
    """Switch threads often so interleavings actually happen."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(previous)


def run_threads(
    writers: list[Callable[[], None]],
    readers: list[Callable[[], None]],
    done: threading.Event,
) -> list[BaseException]:
    """Start all together; `done` is set once the writers are done (or
    any thread failed), which is when readers stop."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(writers) + len(readers))

    def wrap(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait()
                body()
            except BaseException as exc:  # noqa: BLE001 -- reported below
                errors.append(exc)
                done.set()

        return run

    writer_threads = [threading.Thread(target=wrap(w)) for w in writers]
    reader_threads = [threading.Thread(target=wrap(r)) for r in readers]
    for t in writer_threads + reader_threads:
        t.start()
    for t in writer_threads:
        t.join()
    done.set()
    for t in reader_threads:
        t.join()
    return errors


def consistent_reader(
    standins: list[Any], done: threading.Event, monotonic: bool
) -> Callable[[], None]:
    def read() -> None:
        last = {id(s): -1 for s in standins}
        reads = 0
        while not done.is_set() or reads < 100:
            for s in standins:
                loaded, seq, _age, source = s.receipt()
                if seq is None:
                    assert loaded == 0 and source == "registered"
                else:
                    assert loaded == 3 * seq, (loaded, seq, source)
                    if monotonic:
                        assert seq >= last[id(s)], (seq, last[id(s)])
                    last[id(s)] = seq
                assert 0 <= s.loaded_size() <= s.size
            reads += 1

    return read


def test_census_writers_lose_nothing(impl, pool, make_worker):
    w = make_worker()
    s = impl.StandIn(w, 1, "unet", SIZE, "cuda:0", "cpu", pool=pool)
    done = threading.Event()

    def writer(index: int) -> Callable[[], None]:
        def write() -> None:
            # A census never moves a seq backwards: this writer must never
            # see an older seq than one it already saw (its own included).
            newest = -1
            for k in range(ROUNDS):
                seq = index + k * WRITERS
                entry = {"id": "unet", "seq": seq, "resident": 3 * seq}
                current = s.receipt()[1]
                current = -1 if current is None else current
                assert current >= newest, (current, newest)
                if index % 2:
                    pool.report(w, {"residency": [entry]})
                else:
                    impl.apply_residency({"unet": s}, [entry])
                current = s.receipt()[1]
                assert current >= max(newest, seq), (current, newest, seq)
                newest = current

        return write

    readers = [consistent_reader([s], done, True) for _ in range(READERS)]
    errors = run_threads([writer(i) for i in range(WRITERS)], readers, done)
    assert errors == []
    top = WRITERS * ROUNDS - 1
    loaded, seq, _age, source = s.receipt()
    assert (loaded, seq, source) == (3 * top, top, "census")


def test_echo_writers_never_tear(impl, pool, make_worker):
    w = make_worker()
    standins = [
        impl.StandIn(w, 1, f"m{i}", SIZE, "cuda:0", "cpu", pool=pool)
        for i in range(2)
    ]
    written: list[set[int]] = [set() for _ in range(WRITERS)]
    done = threading.Event()

    def writer(index: int) -> Callable[[], None]:
        def write() -> None:
            for k in range(ROUNDS):
                seq = index + k * WRITERS
                s = standins[k % 2]
                impl.apply_echo(s, 3 * seq, seq=seq, in_flight=bool(k % 3))
                written[index].add(seq)

        return write

    errors = run_threads(
        [writer(i) for i in range(WRITERS)],
        [consistent_reader(standins, done, False) for _ in range(READERS)],
        done,
    )
    assert errors == []
    everything = set().union(*written)
    for s in standins:
        loaded, seq, _age, _source = s.receipt()
        assert seq in everything and loaded == 3 * seq


def test_one_writer_per_model_loses_nothing(impl, pool, make_worker):
    w = make_worker()
    standins = [
        impl.StandIn(w, 1, f"m{i}", SIZE, "cuda:0", "cpu", pool=pool)
        for i in range(WRITERS)
    ]
    books = pool._ledger.find(w)
    done = threading.Event()

    def writer(index: int) -> Callable[[], None]:
        def write() -> None:
            s = standins[index]
            for seq in range(ROUNDS):
                if seq % 2:
                    impl.apply_echo(s, 3 * seq, seq=seq)
                else:
                    books.apply_census(
                        [{"id": s.model_id, "seq": seq, "resident": 3 * seq}]
                    )

        return write

    def charge_reader() -> None:
        reads = 0
        while not done.is_set() or reads < 100:
            charge = books.charge()
            assert 0 <= charge["sum_loaded"] <= charge["sum_sizes"]
            assert charge["sum_sizes"] == WRITERS * SIZE
            assert charge["models"] == WRITERS
            reads += 1

    readers = [consistent_reader(standins, done, True), charge_reader]
    errors = run_threads([writer(i) for i in range(WRITERS)], readers, done)
    assert errors == []
    for s in standins:
        loaded, seq, _age, _source = s.receipt()
        assert (loaded, seq) == (3 * (ROUNDS - 1), ROUNDS - 1)
    assert books.charge()["sum_loaded"] == WRITERS * 3 * (ROUNDS - 1)


def test_calls_in_flight_balance(impl, pool, make_worker):
    w = make_worker()
    keep = impl.StandIn(w, 1, "m", 100, "cuda:0", "cpu", pool=pool)
    books = pool._ledger.find(w)
    done = threading.Event()

    def caller() -> None:
        for k in range(ROUNDS):
            if k % 2:
                with pool.call(w):
                    assert books.in_flight >= 1
            else:
                books.begin_call()
                books.end_call()

    def reader() -> None:
        reads = 0
        while not done.is_set() or reads < 100:
            in_flight = books.charge()["in_flight"]
            assert 0 <= in_flight <= WRITERS
            reads += 1

    errors = run_threads([caller] * WRITERS, [reader], done)
    assert errors == []
    assert books.in_flight == 0
    assert books.charge()["charge"] == books.charge()["floor"]
    with pytest.raises(RuntimeError):
        books.end_call()
    assert keep.size == 100


def test_concurrent_registration_shares_one_record(impl, pool, make_worker):
    w = make_worker()
    results: list[Any] = []
    lock = threading.Lock()

    def register() -> None:
        mine = [
            impl.StandIn(w, 1, "unet", 5000, "cuda:0", "cpu", pool=pool)
            for _ in range(50)
        ]
        with lock:
            results.extend(mine)

    errors = run_threads([register] * WRITERS, [], threading.Event())
    assert errors == []
    assert len(results) == 50 * WRITERS
    assert pool._ledger.find(w).charge()["models"] == 1
    impl.apply_echo(results[0], 1234, seq=1)
    assert {s.loaded_size() for s in results} == {1234}


def test_reserve_under_concurrent_writes(impl, make_worker):
    pool = impl.Pool(floor=0, process_local=True)
    w = make_worker()
    s = impl.StandIn(w, 1, "unet", SIZE, "cuda:0", "cpu", pool=pool)
    total = 4 * SIZE // 3
    cap = total * 3 // 4
    done = threading.Event()
    seen: list[int] = []

    def writer() -> None:
        for k in range(ROUNDS):
            impl.apply_echo(s, (k * 7919) % SIZE)
            pool.report(w, {"held": (k * 104729) % SIZE})

    def reserver() -> None:
        reads = 0
        while not done.is_set() or reads < 100:
            value = pool.reserve(None, 100, total)
            assert 100 <= value <= cap
            seen.append(value)
            reads += 1

    errors = run_threads([writer, writer], [reserver, reserver], done)
    assert errors == []
    assert seen
    # Quiet again: the reserve settles on exactly base + charge.
    impl.apply_echo(s, 0)
    pool.report(w, {"held": 0})
    assert pool.reserve(None, 100, total) == 100


FORK_SCRIPT = """
import os, sys, threading, time, warnings
warnings.simplefilter("ignore")  # 3.12+: fork() of a threaded process
import comfy_standin as cs

class Worker:
    def send_command(self, command, **kwargs):
        return {}
    def is_alive(self):
        return True

pool = cs.Pool(process_local=True)
ledger = pool._ledger
keep = []
for w in range(20000):
    s = cs.StandIn(Worker(), 1, "m", 1000, "cuda:0", "cpu", pool=pool)
    cs.apply_echo(s, 500)
    keep.append(s)
stop = threading.Event()

def reserve():
    # Holds the ledger's lock (and each worker's in turn) with the GIL
    # released, most of the time.
    while not stop.is_set():
        ledger.reserve(10, 1 << 40, True)

thread = threading.Thread(target=reserve)
thread.start()
hung = 0
for _ in range(100):
    pid = os.fork()
    if pid == 0:
        # The child's only thread: each lock must be free.
        ledger.total_charge()
        ledger.reserve(10, 1 << 40, True)
        keep[0].loaded_size()
        os._exit(0)
    deadline = time.monotonic() + 3
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.001)
stop.set()
thread.join()
print(hung)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_fork_while_another_thread_holds_the_ledgers_locks():
    """A fork() from one thread while another is inside the ledger (its
    reserve() holds the ledger's lock with the GIL released): the child
    must find every lock free.  Without the ledger's pthread_atfork
    handlers the child inherited a locked mutex and hung on its first
    reserve()."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0"], "children hung on a held lock"
