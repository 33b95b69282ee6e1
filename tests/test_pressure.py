"""``Pool.release_idle_on_pressure`` against workers that do not answer.

A stand-in that freed less than ComfyUI asked calls ``on_pressure``; the
pool then asks idle workers from a daemon thread.  A worker stuck in
``partial_release`` (its lock held, its reply never coming) must not
collect a thread per notice: at most one ask is in flight per worker, a
bound holds on all asks in flight, and a stuck worker is asked again only
after its ask has returned.  A worker found dead while asked is marked
gone in the pool at once.
"""

from __future__ import annotations

import threading
import time

import fakes
import pytest

from comfy_standin import pool as pool_module

MiB = 1 << 20
GiB = 1 << 30
THREAD = "comfy-standin-pressure"


class Releasing(fakes.FakeWorker):
    """Advertises comfy-env's release commands; ``stuck`` makes
    ``partial_release`` block until the test lets go."""

    supports_partial_release = True
    supports_release_pins = True

    def __init__(self, name: str, *, stuck: bool = False,
                 give_back: int = 0) -> None:
        super().__init__(name)
        self.stuck = stuck
        self.give_back = give_back
        self.let_go = threading.Event()
        self.asks: list[tuple[str, int]] = []
        self.asks_lock = threading.Lock()
        self.answer: object = None

    def send_command_no_spawn(self, command, size, lock_timeout):
        with self.asks_lock:
            self.asks.append((command, size))
        if self.stuck and command == "partial_release":
            # Bounded so that a broken run ends; the test releases it.
            self.let_go.wait(120)
        if self.answer is not None:
            answer = self.answer
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return {"receipt": {"freed_bytes": min(size, self.give_back)}}

    def partial_asks(self) -> int:
        with self.asks_lock:
            return sum(1 for c, _ in self.asks if c == "partial_release")


def pressure_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


def wait_for(predicate, what: str, limit: float = 60.0) -> None:
    """Polls until `predicate()` holds; the limit bounds a broken run
    only, it is not a speed claim."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.005)


@pytest.fixture
def setup(impl, mm):
    made: list[Releasing] = []
    keep = []
    pool = impl.Pool(floor=0, process_local=False)
    pool.release_idle_on_pressure(debounce=0)
    assert pressure_threads() == [], "a pressure thread of another test"

    def worker(name, held, **kw):
        w = Releasing(name, **kw)
        w.add_model(f"{name}-m", held, resident=held)
        s = impl.StandIn(w, 1, f"{name}-m", held, "cuda:0", "cpu",
                         pool=pool)
        impl.apply_residency({f"{name}-m": s}, w.census())
        made.append(w)
        keep.append(s)
        return w

    yield pool, worker
    for w in made:
        w.let_go.set()
    for t in pressure_threads():
        t.join(timeout=120)
    assert pressure_threads() == []


def test_a_stuck_worker_is_asked_once_and_others_still_are(setup):
    pool, worker = setup
    stuck = worker("stuck", 4 * GiB, stuck=True)  # the largest: asked first
    healthy = worker("healthy", 1 * GiB, give_back=1 * GiB)
    pool.on_pressure(6 * GiB)
    wait_for(lambda: stuck.partial_asks() == 1, "the stuck worker asked")
    for _ in range(20):
        pool.on_pressure(6 * GiB)
        assert len(pressure_threads()) <= pool_module.PRESSURE_MAX_ASKS
    # Every round but the stuck one ends; the stuck worker was never asked
    # again while its ask was in flight, and the others were still asked.
    wait_for(lambda: len(pressure_threads()) == 1, "the rounds ending")
    assert stuck.partial_asks() == 1
    assert healthy.partial_asks() >= 2
    # Its ask returns: from then on it is asked again.
    stuck.let_go.set()
    wait_for(lambda: pressure_threads() == [], "the stuck round ending")
    stuck.stuck = False
    pool.on_pressure(6 * GiB)
    wait_for(lambda: stuck.partial_asks() == 2, "a new ask")


def test_a_bound_on_all_asks_in_flight(setup):
    pool, worker = setup
    stuck = [worker(f"s{i}", (i + 1) * MiB, stuck=True) for i in range(10)]
    for _ in range(20):
        pool.on_pressure(64 * GiB)
    bound = pool_module.PRESSURE_MAX_ASKS
    wait_for(lambda: sum(w.partial_asks() for w in stuck) == bound,
             "the bound reached")
    assert len(pressure_threads()) == bound
    for _ in range(20):
        pool.on_pressure(64 * GiB)
    assert len(pressure_threads()) == bound
    assert sum(w.partial_asks() for w in stuck) == bound
    assert max(w.partial_asks() for w in stuck) == 1


@pytest.mark.parametrize("how", ["dead sentinel", "raises and is dead"])
def test_a_death_seen_by_the_pressure_thread_reaches_the_pool(setup, how):
    pool, worker = setup
    w = worker("w", 2 * GiB)
    w.kill()
    w.answer = "dead" if how == "dead sentinel" else ConnectionError(
        "worker went away")
    assert pool._ask_idle_workers(1 * GiB) == 0
    books = pool._ledger.find(w)
    assert books is not None and not books.alive
    assert pool.worker_charges()[w] == 0


def test_shortfalls_that_are_not_byte_counts_ask_nobody(setup):
    pool, worker = setup
    w = worker("w", 2 * GiB, give_back=2 * GiB)
    for bad in (None, "lots", float("nan"), -5, True, [1]):
        pool.on_pressure(bad)
    assert pressure_threads() == [] and w.asks == []


def test_a_reply_that_is_a_dict_subclass_is_read_from_its_storage(setup):
    class Sly(dict):
        def get(self, *args):
            raise RuntimeError("the worker's get ran in the host")

    pool, worker = setup
    w = worker("w", 2 * GiB)
    w.answer = Sly(receipt=Sly(freed_bytes=1 * GiB))
    assert pool._ask_idle_workers(1 * GiB) == 1 * GiB
