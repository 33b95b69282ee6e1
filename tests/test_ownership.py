"""One owner for each fact (docs/architecture.md): the roster of a
worker's stand-ins lives in the worker's books, made with them in one
step and taken off the ledger with them in one step.

Each test drives one way the roster or the books used to have two owners:
a collection inside an allocation (on 3.10 and 3.11 any allocation of a
tracked object may run the collector, hence finalizers, hence any Python)
or a thread switch between two steps of the pool.  The collection cases
run in a fresh interpreter: when they fail, they fail by crashing it.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import pytest

import comfy_standin._reference as reference
from comfy_standin import pool as pool_module

PRELUDE = """
import gc, sys
import importlib
impl = importlib.import_module(
    "comfy_standin" if sys.argv[1] == "c" else "comfy_standin._reference")

class Worker:
    def send_command(self, command, **kwargs):
        return {}
    def is_alive(self):
        return True

def make(pool, worker, model_id, generation=1):
    return impl.StandIn(worker, generation, model_id, 10, "cuda:0", "cpu",
                        pool=pool)
"""


def run(impl_name: str, body: str, timeout: float = 120) -> str:
    """Runs PRELUDE + body in a fresh interpreter; returns its stdout.  A
    crash, a hang (a lock taken twice) or an exception fails the test."""
    code = PRELUDE + textwrap.dedent(body)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, impl_name],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung (a lock taken twice?): {exc.stdout!r}")
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stderr == "", done.stderr[-3000:]
    return done.stdout


# A chain of garbage: every collection finds one link, whose finalizer
# makes the next (so every later collection finds one too) and lets go of
# `per_link` stand-ins from `reserve` (they die with the link) and, when
# `adds`, makes `adds` new stand-ins of the same worker (kept alive).  The
# link holds its stand-ins in a tuple and has no __dict__, so its death
# frees no list: the list free list stays empty, and every list the pool
# makes is a fresh allocation of a tracked object, which collects.
CHAIN = """
class Link:
    __slots__ = ("me", "items")

def link(per_link, adds):
    c = Link()
    c.me = c
    c.items = tuple(reserve.pop() for _ in range(per_link) if reserve)
    for _ in range(adds):
        born.append(make(pool, worker, "born%d" % len(born)))

links = []

def finalizer(self):
    links.append(1)
    if reserve:
        link(PER_LINK, ADDS)

Link.__del__ = finalizer
"""


@pytest.mark.parametrize("adds", [0, 2], ids=["frees", "adds"])
@pytest.mark.parametrize("op", ["standins", "worker_gone", "forget"])
@pytest.mark.parametrize("impl_name", ["c", "reference"])
def test_a_roster_read_survives_a_collection_in_its_allocation(
    impl_name, op, adds
):
    """pool.standins(), worker_gone() and forget() read a roster: a list
    sized from the roster's count before it was allocated was left with
    empty slots when the allocation's collection freed listed stand-ins
    (iterating it crashed the host), and was written past its end when a
    finalizer made new ones."""
    out = run(impl_name, CHAIN + f"""
PER_LINK, ADDS = 1, {adds}
pool = impl.Pool()
worker = Worker()
keep = [make(pool, worker, "keep%d" % i) for i in range(3)]
reserve = [make(pool, worker, "r%d" % i) for i in range(1500)]
born = []
gc.disable()
link(PER_LINK, 0)
gc.set_threshold(1)
gc.enable()
rounds = 0
while reserve and rounds < 200:
    rounds += 1
    hold = None
    hold = [[] for _ in range(100)]  # empties the list free list
    if "{op}" == "standins":
        names = [s.model_id for s in pool.standins().get(worker, [])]
        assert len(names) == len(set(names))
    elif "{op}" == "worker_gone":
        pool.worker_gone(worker)
    else:
        pool.forget(worker)
        pool.worker_gone(worker)
gc.set_threshold(700)
gc.collect()
alive = {{s.model_id for s in keep + reserve + born}}
listed = {{s.model_id for s in pool.standins().get(worker, [])}}
if "{op}" == "standins":
    assert listed == alive, (sorted(listed ^ alive))
    assert not any(s.stale for s in keep + reserve + born)
else:
    assert all(s.stale for s in keep + reserve), "a stand-in missed"
print(rounds, len(links))
""")
    rounds, collections = map(int, out.split())
    # Over a hundred collections ran inside the reads (on 3.12+, where a
    # collection runs at the next bytecode boundary, the reference's
    # Python may drain the reserve within the first round's reads).
    assert rounds >= 1 and collections > 100


@pytest.mark.parametrize("impl_name", ["c", "reference"])
def test_books_made_once_when_a_collection_reenters_for_the_worker(
    impl_name,
):
    """Making a worker's books allocates; a collection in that allocation
    may run a finalizer that makes a stand-in of the same worker, and so
    asks for the same books.  One worker must end with one set of books:
    the C binding used to add the worker's C record to the ledger before
    allocating its Python books, so the reentrant call added a second
    record, and the worker was charged two floors, one of them for good
    (forget() could no longer reach it)."""
    out = run(impl_name, """
pool_box = []
inner = []

class Armed(impl.Pool):
    # The pool hands the constructor its ledger just before the books are
    # made: arm a collection for the next allocation there.
    armed = False

    @property
    def _ledger(self):
        if self.armed:
            self.armed = False
            trap = Trap()
            trap.me = trap
            del trap
            gc.set_threshold(1)
        return self.__dict__["_ledger_"]

    @_ledger.setter
    def _ledger(self, value):
        self.__dict__["_ledger_"] = value

class Trap:
    def __del__(self):
        gc.set_threshold(700)
        inner.append(make(pool_box[0], worker, "inner"))

gc.disable()
pool = Armed(floor=1000)
pool_box.append(pool)
worker = Worker()
pool.armed = True
gc.enable()
outer = make(pool, worker, "outer")
gc.set_threshold(700)
gc.collect()
floor = pool.floor
assert pool._ledger.keys() == [worker]
assert sorted(s.model_id for s in pool.standins()[worker]) == sorted(
    s.model_id for s in [outer] + inner)
assert pool._ledger.total_charge() == floor, pool._ledger.total_charge()
pool.forget(worker)
assert pool._ledger.total_charge() == 0, pool._ledger.total_charge()
print(len(inner))
""")
    # On 3.12+ the collector runs between bytecodes, not inside the
    # allocation: the finalizer then makes its stand-in after the outer
    # one, which the same checks cover.
    assert out.split() == ["1"]


class _HookLock:
    """The pool's lock, running `hook` the first time it is entered (from
    a frame `where` accepts, when given)."""

    def __init__(self, lock, hook, where=None) -> None:
        self._inner, self._hook, self._where = lock, hook, where

    def __enter__(self):
        if self._where is None or self._where(sys._getframe(1)):
            hook, self._hook = self._hook, None
            if hook is not None:
                hook()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def acquire(self, *args, **kwargs):
        return self._inner.acquire(*args, **kwargs)

    def release(self):
        return self._inner.release()


@pytest.mark.parametrize("moment", ["as_it_locks", "after_the_books_left"])
def test_a_stand_in_made_while_the_pool_forgets_its_worker_is_seen(
    impl, make_worker, moment
):
    """forget() used to drop the worker's books and its roster in two
    steps, with a lock-free way onto the roster in between: a stand-in made
    by another thread at that moment landed on the roster the pool was
    about to drop, while its charge went to new books.  The pool then
    charged a worker whose stand-in standins(), restarted() and
    worker_gone() never saw.  Here the other thread's construction runs as
    forget() takes the pool's lock, or once the books have left the
    ledger: either way the stand-in is listed exactly when its worker is
    charged, and worker_gone() reaches it."""
    pool = impl.Pool()
    worker = make_worker()
    first = impl.StandIn(worker, 1, "first", 10, "cuda:0", "cpu", pool=pool)
    made: list = []

    def construct() -> None:
        made.append(
            impl.StandIn(worker, 1, "late", 10, "cuda:0", "cpu", pool=pool)
        )

    if moment == "as_it_locks":
        pool._lock = _HookLock(pool._lock, construct)
    else:
        release = pool._release_held_locked

        def released(*args, **kwargs):
            if not made:
                construct()
            return release(*args, **kwargs)

        pool._release_held_locked = released
    pool.forget(worker)
    (late,) = made
    listed = any(s is late for s in pool.standins().get(worker, []))
    assert listed == (worker in pool.worker_charges())
    pool.restarted(worker, 2)
    assert late.stale == listed and first.stale is False
    pool.worker_gone(worker)
    assert first.stale and late.stale
    assert first.loaded_size() == late.loaded_size() == 0


# ---- the pool's locked steps, each whole to the others -------------------


def make(impl, pool, worker, model_id):
    return impl.StandIn(worker, 1, model_id, 10, "cuda:0", "cpu", pool=pool)


def test_worker_gone_between_the_steps_of_forget_reaches_the_stand_ins(
    impl, make_worker
):
    """forget() takes the books off the ledger and shelves them for
    worker_gone() in one locked step.  Here worker_gone() runs as forget()
    takes the lock (as another thread's would): it used to find the books
    neither on the ledger nor on the shelf, and the stand-in never read
    the worker's death."""
    pool = impl.Pool()
    worker = make_worker()
    s = make(impl, pool, worker, "s")
    pool._lock = _HookLock(pool._lock, lambda: pool.worker_gone(worker))
    pool.forget(worker)
    assert s.stale and s.loaded_size() == 0


def test_a_second_worker_gone_returns_after_every_stand_in_is_marked(
    impl, make_worker, monkeypatch
):
    """Two threads told the worker died: the second must not return while
    the first is still marking the stand-ins of its forgotten books (it
    used to find the shelf emptied by the first and return at once)."""
    pool = impl.Pool()
    worker = make_worker()
    s = make(impl, pool, worker, "s")
    pool.forget(worker)  # s's books on the shelf
    seen: list = []
    threads: list = []
    real = pool_module._standins_of

    def second_call_meanwhile(books, key):
        if key is worker and not threads:  # this test's call, no other
            def second() -> None:
                pool.worker_gone(worker)
                seen.append(s.stale)

            thread = threading.Thread(target=second, daemon=True)
            threads.append(thread)
            thread.start()
            thread.join(0.5)  # blocks on the pool's lock, or returns
        return real(books, key)

    monkeypatch.setattr(pool_module, "_standins_of", second_call_meanwhile)
    pool.worker_gone(worker)
    threads[0].join(30)
    assert seen == [True]


def test_boundary_keeps_the_books_forget_shelves_while_it_prunes(
    impl, make_worker
):
    """boundary() drops shelved books nobody holds a stand-in of.  A
    forget() between its read of the shelf and its write (here: as it takes
    the lock to write) shelves more books; they used to be dropped with the
    dead ones, and worker_gone() missed their stand-ins."""
    pool = impl.Pool()
    worker = make_worker()
    first = make(impl, pool, worker, "first")
    pool.forget(worker)
    del first
    gc.collect()  # the shelved books have no stand-in left
    second = make(impl, pool, worker, "second")

    def pruning(frame) -> bool:  # boundary(), past its read of the shelf
        return frame.f_code.co_name == "boundary" and (
            "forgotten" in frame.f_locals)

    pool._lock = _HookLock(
        pool._lock, lambda: pool.forget(worker), where=pruning)
    pool.boundary()
    assert pool._lock._hook is None, "the hook never ran"
    pool.worker_gone(worker)
    assert second.stale and second.loaded_size() == 0


def _forget_in_construction(monkeypatch, forget) -> None:
    """Runs `forget` once, inside the reference's constructor, between its
    taking the worker's books and listing the stand-in on them."""
    real = reference.WorkerBooks.register
    done: list = []

    def hooked(books, model_id, *args, **kwargs):
        record = real(books, model_id, *args, **kwargs)
        if not done and model_id == "s":  # the test's stand-in
            done.append(True)
            forget()
        return record

    monkeypatch.setattr(reference.WorkerBooks, "register", hooked)


def test_reference_stand_in_made_while_another_thread_forgets_is_reached(
    make_worker, monkeypatch
):
    """The reference made a stand-in's books and listed it on them in two
    steps: another thread's forget() between them took the books off the
    ledger with an empty roster (not shelved), and the stand-in then
    joined them, where worker_gone() never looked.  (The C type runs no
    Python between the two.)"""
    pool = reference.Pool()
    worker = make_worker()
    threads: list = []

    def other_thread() -> None:
        thread = threading.Thread(target=pool.forget, args=(worker,))
        threads.append(thread)
        thread.start()
        thread.join(0.5)  # blocks on the books' lock, or returns

    _forget_in_construction(monkeypatch, other_thread)
    s = make(reference, pool, worker, "s")
    threads[0].join(30)
    pool.worker_gone(worker)
    assert s.stale and s.loaded_size() == 0


def test_reference_stand_in_made_while_a_finalizer_forgets_is_reached(
    make_worker, monkeypatch
):
    """The same, with forget() run on the constructing thread (by a
    finalizer a collection ran there): no lock can hold it off, so
    forget() shelves the books even with an empty roster."""
    pool = reference.Pool()
    worker = make_worker()
    _forget_in_construction(monkeypatch, lambda: pool.forget(worker))
    s = make(reference, pool, worker, "s")
    pool.worker_gone(worker)
    assert s.stale and s.loaded_size() == 0
