"""Stress modes for the C-layer tests (docs/RELIABILITY.md, "Stress modes").

``python -m pytest --stress=gc`` (or ``COMFY_STANDIN_STRESS=gc``) runs the
tests with a collection at every allocation of a tracked object
(``gc.set_threshold(1, 1, 1)``) and a finalizer in every collection: on
CPython 3.10 and 3.11 a collection, so any Python, can run inside any
allocation the C layer makes, and this mode makes every one of them do.

``--stress=threads`` switches threads as often as CPython allows
(``sys.setswitchinterval(1e-6)``) while two other threads mutate a pool of
each implementation for the whole session; a collection at every
allocation here too (``COMFY_STANDIN_STRESS_THRESHOLD`` sets another), each
one letting another thread run and running a finalizer that mutates the
pools, so switches land inside the C layer's allocations.

``--stress=walker`` collects at every allocation too, with a
``gc.callbacks`` hook that walks the young generations of
``gc.get_objects()`` (the whole heap when the oldest is collected) and
uses every object of the C module it finds (tests/walker.py), as memory
profilers and leak hunters do: none may be reachable before its
invariants hold.  It crashes or passes; it checks nothing else.

``--stress=gc,threads`` does both.  In either mode a *churn* works on pools
of its own (the tests' pools and workers are never touched, so their
assertions hold): it makes and drops stand-ins of three workers (a dropped
one waits for the collector in a cycle whose finalizer acts on the churn
again), forgets workers, marks them gone, and reads the rosters, checking
after each step what the one owner of each fact guarantees:

- a roster read lists each live stand-in of that worker once, never
  another worker's (a snapshot sized before its allocation and changed by
  the collection inside it lists a hole or writes past its end);
- ``worker_gone(w)`` reaches every stand-in of ``w`` made before it (one
  made while ``forget(w)`` ran must not land on a roster the pool dropped);
- once every worker is forgotten, nothing is charged (a worker whose books
  were made twice keeps one floor charged for good).

In gc mode the churn also runs a burst before and after every test and
settles (forgets everything and checks the charge) after it; in threads
mode it settles when the session ends.  A broken guarantee fails the test
it happened in (at its teardown), or the session; a crash ends the run.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

MODES = ("gc", "threads", "walker")
#: The modes this session runs under (empty: no stress).
ACTIVE: frozenset[str] = frozenset()
#: The session's churn, when a mode is active.
CHURN: Churn | None = None
#: The walker mode's hook, when active.
WALKER: Any = None

ENV = "COMFY_STANDIN_STRESS"



def parse_modes(text: str) -> frozenset[str]:
    modes = frozenset(m.strip() for m in text.split(",") if m.strip())
    unknown = modes - set(MODES)
    if unknown:
        raise pytest.UsageError(
            f"--stress / {ENV}: unknown mode(s) {sorted(unknown)}; "
            f"expected a comma-separated list of {', '.join(MODES)}"
        )
    return modes


def gc_stress() -> bool:
    return "gc" in ACTIVE


class ChurnWorker:
    """A worker that is alive and answers every command with {}."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<ChurnWorker {self.name}>"

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        return {}

    def is_alive(self) -> bool:
        return True


class Holder:
    """Where a dropped stand-in waits for the collector: a cycle (as a
    model and its patcher make), whose finalizer acts on the churn again,
    wherever the collection that frees it runs."""

    __slots__ = ("me", "standin", "churn")

    def __del__(self) -> None:
        self.churn.finalizer_action(chained=self.standin is None)


_real_collect = gc.collect


#: The thread of each collection under way (gc.callbacks' start and stop; list
#: operations are atomic under the GIL, `+= 1` is not).  Between its start
#: and its stop a collection clears weak references, runs finalizers (whose
#: Python lets other threads run) and only then frees the garbage: a check
#: that reads rosters and charges meanwhile sees a stand-in half gone.
_COLLECTING: list[int] = []


def _count_collection(phase: str, info: dict[str, int]) -> None:
    me = threading.get_ident()
    if phase == "start":
        _COLLECTING.append(me)
    elif me in _COLLECTING:
        _COLLECTING.remove(me)


def _switch_in_collection(phase: str, info: dict[str, int]) -> None:
    """At the start of every collection: let another thread run (a sleep
    releases the GIL), as a finalizer's Python would."""
    if phase == "start":
        time.sleep(0)


class Churn:
    WORKERS = 3
    FLOOR = 1000
    KEEP = 24  # live stand-ins kept at most; beyond, one is dropped

    def __init__(self, impls: list[Any], seed: int) -> None:
        self.impls = impls
        self.pools = [
            impl.Pool(floor=self.FLOOR, process_local=True) for impl in impls
        ]
        self.workers = [ChurnWorker(f"churn-{i}") for i in range(self.WORKERS)]
        # (pool index, worker index, stand-in, seq once made)
        self.kept: list[tuple[int, int, Any, int]] = []
        self.seq = itertools.count()
        self.names = itertools.count()
        self.rng = random.Random(seed)
        self.errors: list[str] = []
        self.quiet = 0  # finalizers do nothing while > 0 (a settle runs)
        self.arming = False  # the chain's link leaves the next (burst())
        self.fired = 0
        # The running step's (pool, worker), per thread: a finalizer runs
        # on the thread whose allocation collected, and acts on its step.
        self.local = threading.local()
        # (pool, worker) -> [forgets started, forgets ended]
        self.forgets: dict[tuple[int, int], list[int]] = {}
        self.forgetting = threading.RLock()
        self.stop = threading.Event()
        self.paused = threading.Event()  # collect(): the threads wait
        self.resumed = threading.Event()
        self.idle = 0  # threads waiting for `resumed`
        self.idle_lock = threading.Lock()
        self.pauses = 0  # pause() depth
        self.pause_lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    # ---- the steps ---------------------------------------------------------

    def pick(self) -> tuple[int, int]:
        """A (pool, worker) for a step; the finalizers that run inside the
        step mostly act on the same one (as a model's finalizer touches
        its own worker's stand-ins)."""
        self.local.target = (self.rng.randrange(len(self.pools)),
                             self.rng.randrange(len(self.workers)))
        return self.local.target

    def make(self, p: int, w: int, check: bool = False) -> None:
        """Makes a stand-in; with `check`, it must then be on its worker's
        books in the ledger unless the worker was forgotten meanwhile (a
        side path onto books the pool dropped would list it where no
        roster read, burial or charge finds it)."""
        if check:
            with self.forgetting:
                started, ended = self.forgets.get((p, w), (0, 0))
        pool, worker = self.pools[p], self.workers[w]
        standin = self.impls[p].StandIn(
            worker, 1, f"churn-{next(self.names)}", 10, "cuda:0", "cpu",
            pool=pool,
        )
        self.kept.append((p, w, standin, next(self.seq)))
        if check and started == ended:
            listed = any(
                s is standin for s in pool.standins().get(worker, ()))
            with self.forgetting:
                now = self.forgets.get((p, w), (0, 0))[0]
            if not listed and now == started:
                self.errors.append(
                    f"pool {p}: {standin!r} was made on books that are not "
                    f"{worker!r}'s in the ledger (no forget ran meanwhile)")
        if len(self.kept) > self.KEEP:
            self.drop()

    def forget(self, p: int, *workers: int) -> None:
        """Forgets workers (all of the pool's when none given, as a
        boundary may), counted for make()'s check."""
        keys = [(p, w) for w in (workers or range(len(self.workers)))]
        with self.forgetting:
            for key in keys:
                self.forgets.setdefault(key, [0, 0])[0] += 1
        try:
            if workers:
                for w in workers:
                    self.pools[p].forget(self.workers[w])
            else:
                self.pools[p].boundary()
        finally:
            with self.forgetting:
                for key in keys:
                    self.forgets[key][1] += 1

    def drop(self, target: tuple[int, int] | None = None) -> None:
        """Lets go of a kept stand-in (of `target` when it has one): it
        waits in a cycle, and dies in the next collection."""
        kept = self.kept
        at = [i for i, e in enumerate(kept) if e[:2] == target]
        try:
            entry = kept.pop(self.rng.choice(at) if at
                             else self.rng.randrange(len(kept)))
        except (IndexError, ValueError):  # emptied by another thread
            return
        holder = Holder()
        holder.me, holder.standin, holder.churn = holder, entry[2], self

    def arm(self) -> None:
        """Leaves one link of garbage whose finalizer runs at the next
        collection (and, while arming, leaves the next link)."""
        holder = Holder()
        holder.me, holder.standin, holder.churn = holder, None, self

    def finalizer_action(self, chained: bool) -> None:
        """A finalizer's step, on the running step's (pool, worker) nine
        times in ten: make a stand-in or drop one.  A chain link acts
        nearly always; a dropped stand-in's holder less often, so the
        garbage stays bounded (each holder leaves under one on average)."""
        self.fired += 1
        try:
            roll = self.rng.random() * (1.0 if chained else 3.0)
            if self.quiet == 0 and roll < 0.9:
                target = getattr(self.local, "target", (0, 0))
                if self.rng.random() < 0.1:
                    target = (self.rng.randrange(len(self.pools)),
                              self.rng.randrange(len(self.workers)))
                if roll < 0.45:
                    self.make(*target)
                else:
                    self.drop(target)
            if chained and self.arming:
                self.arm()
        except Exception as exc:  # noqa: BLE001 -- reported, not printed
            self.errors.append(f"in a finalizer: {exc!r}")

    def check_roster(self, p: int) -> None:
        """Reads every roster of the pool (``standins()``: each worker's
        is copied as the pool's burials copy it): each lists a stand-in
        once, and only its worker's.  Public calls only, so the churn
        checks the contract whatever owns the roster."""
        for key, members in self.pools[p].standins().items():
            if len({id(s) for s in members}) != len(members):
                self.errors.append(f"pool {p}: {key!r} lists a stand-in twice")
            # A stand-in the collector is clearing reads worker None: a
            # thread switch inside that collection (a weakref callback's
            # Python) may let a read take it before its clear runs.
            strangers = [
                s for s in members if s.worker not in (key, None)
            ]
            if strangers:
                self.errors.append(
                    f"pool {p}: {key!r} lists others' stand-ins {strangers!r}")

    def check_listing(self) -> None:
        """Each worker the pool charges lists exactly the stand-ins whose
        models its books charge (every churn stand-in has a model of its
        own): a stand-in charged on one roster's books but listed on
        another, or on none, breaks it.  Read with the collector off and
        no churn step running (in gc mode between steps; in threads mode
        with the threads paused), so nothing changes between the reads."""
        with self.quiesced():
            for p, pool in enumerate(self.pools):
                details = pool.charge_details()
                listed = pool.standins()
                for worker, figures in details.items():
                    members = listed.get(worker, [])
                    if figures["alive"] and figures["models"] != len(members):
                        self.errors.append(
                            f"pool {p}: {worker!r} is charged for "
                            f"{figures['models']} models but lists "
                            f"{len(members)} stand-ins: a stand-in is "
                            f"listed apart from the books that charge it")

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """The collector off, and no collection under way on another
        thread (one that started before stays under way with the collector
        off: its finalizers let this thread run)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            deadline = time.monotonic() + 30
            me = threading.get_ident()

            def others() -> bool:
                return any(ident != me for ident in list(_COLLECTING))

            while others() and time.monotonic() < deadline:
                time.sleep(0.0005)
            if others():
                self.errors.append(
                    "a collection on another thread did not end within "
                    "30 s (a hang?)")
            yield
        finally:
            if collecting:
                gc.enable()

    def gone(self, p: int, w: int) -> None:
        """worker_gone() must reach every stand-in made before it began."""
        pool, worker = self.pools[p], self.workers[w]
        begin = next(self.seq)
        pool.worker_gone(worker)
        missed = [
            s.model_id for pp, ww, s, made in list(self.kept)
            if pp == p and ww == w and made < begin and not s.stale
        ]
        if missed:
            self.errors.append(
                f"pool {p}: worker_gone({worker!r}) missed live stand-ins "
                f"{missed}: they were on a roster the pool no longer saw")
        self.forget(p, w)  # the next stand-in starts fresh books

    def settle(self) -> None:
        """Forgets every worker: nothing may stay charged."""
        self.quiet += 1
        try:
            for p, pool in enumerate(self.pools):
                self.forget(p, *range(len(self.workers)))
                self.forget(p)  # boundary()
                charge = pool._ledger.total_charge()
                if charge != 0 or pool._ledger.keys():
                    self.errors.append(
                        f"pool {p}: {charge} bytes charged and workers "
                        f"{pool._ledger.keys()!r} listed after every worker "
                        f"was forgotten")
        finally:
            self.quiet -= 1

    def step(self, kind: str) -> None:
        p, w = self.pick()
        if kind == "make":
            self.make(p, w, check=True)
        elif kind == "drop":
            self.drop((p, w))
        elif kind == "forget":
            self.forget(p, w)
        elif kind == "renew":  # forgotten, and at once a new stand-in
            self.forget(p, w)
            self.make(p, w, check=True)
        elif kind == "gone":
            self.gone(p, w)
        elif kind == "roster":
            self.check_roster(p)
        else:  # "boundary": the graveyard lets go (and forgets the dead)
            self.forget(p)

    READS = ("roster", "gone")
    MAKER = ("make",) * 4 + ("renew",) * 2 + ("drop",) * 3 + ("roster",)
    KEEPER = ("forget",) * 3 + ("gone",) * 3 + ("roster",) * 3 + ("boundary",)

    def burst(self, steps: int) -> None:
        """`steps` random steps with the finalizer chain armed: in gc mode
        every allocation in them collects and runs a finalizer."""
        was, self.arming = self.arming, True
        self.arm()
        try:
            for _ in range(steps):
                self.guarded(self.rng.choice(self.MAKER + self.KEEPER))
        finally:
            # The last link dies without a successor (unless the threads
            # keep the chain armed).
            self.arming = was
        self.check_listing()

    def guarded(self, kind: str) -> None:
        # CPython keeps freed lists and dicts for reuse (up to 80 each),
        # and a reused one is no allocation, so no collection: holding a
        # hundred of each through a roster read empties those free lists,
        # and the lists it makes are fresh allocations.  (Other steps keep
        # them: a collection in every list would let the finalizers make
        # the books a step is about to make.)
        drained = [([], {}) for _ in range(100)] if kind in self.READS else []
        try:
            self.step(kind)
        except Exception as exc:  # noqa: BLE001 -- reported, not printed
            self.errors.append(f"{kind}: {exc!r}")
        del drained

    # ---- threads -----------------------------------------------------------

    def start_threads(self) -> None:
        """Two threads, each making, dropping, forgetting, marking gone and
        reading the same workers' rosters; and a switch in every
        collection, where the C layer runs Python inside an allocation."""
        gc.callbacks.append(_count_collection)
        gc.callbacks.append(_switch_in_collection)
        gc.collect = self.collect
        # The finalizer chain stays armed for the session: every collection
        # (every few allocations, pytest_configure) runs a finalizer that
        # acts on the rosters, whichever thread it interrupted.
        self.arming = True
        self.arm()
        for n in range(2):
            rng = random.Random(self.rng.random())
            thread = threading.Thread(
                target=self._loop, args=(self.MAKER + self.KEEPER, rng),
                daemon=True, name=f"stress-churn-{n}",
            )
            thread.start()
            self.threads.append(thread)

    def _loop(self, kinds: tuple[str, ...], rng: random.Random) -> None:
        while not self.stop.is_set():
            if self.paused.is_set():
                with self.idle_lock:
                    self.idle += 1
                self.resumed.wait()
                with self.idle_lock:
                    self.idle -= 1
                continue
            self.guarded(rng.choice(kinds))

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """The churn's threads wait, out of any step, while the body runs
        (reentrant)."""
        with self.pause_lock:
            self.pauses += 1
            if self.pauses == 1:
                self.resumed.clear()
                self.paused.set()
        try:
            deadline = time.monotonic() + 30
            while self.idle < len(self.threads):
                if time.monotonic() > deadline:
                    self.errors.append(
                        "the churn's threads did not pause within 30 s "
                        "(a hang?)")
                    break
                time.sleep(0.0005)
            yield
        finally:
            with self.pause_lock:
                self.pauses -= 1
                if self.pauses == 0:
                    self.paused.clear()
                    self.resumed.set()

    def collect(self, *args: Any) -> int:
        """gc.collect() in threads mode.  CPython skips a collection asked
        for while another thread is inside one (its finalizer's Python let
        this thread run), so a test's gc.collect() could free nothing: the
        churn's threads wait, out of any step, while it collects (a churn
        thread's own call collects at once: it cannot wait for itself)."""
        if threading.current_thread() in self.threads:
            return _real_collect(*args)
        with self.pause(), self.quiesced():
            return _real_collect(*args)

    def checkpoint(self) -> None:
        """Threads mode, after each test: with the threads paused, the
        listing check and a settle (every worker forgotten, nothing
        charged)."""
        with self.pause(), self.quiesced():
            self.check_listing()
            self.settle()

    def stop_threads(self) -> None:
        self.arming = False
        self.stop.set()
        self.resumed.set()
        for thread in self.threads:
            thread.join(60)
            if thread.is_alive():
                self.errors.append(f"{thread.name} did not stop (a hang?)")
        for callback in (_switch_in_collection, _count_collection):
            if callback in gc.callbacks:
                gc.callbacks.remove(callback)
        gc.collect = _real_collect

    def take_errors(self) -> list[str]:
        errors, self.errors[:] = list(self.errors), []
        return errors


# ---- pytest hooks ----------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress", default=os.environ.get(ENV, ""),
        help=f"run under stress: gc, threads, walker, or a comma-separated "
             f"list of them (also {ENV}); "
             "see tests/stress.py",
    )


_saved: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    global ACTIVE, CHURN
    ACTIVE = parse_modes(config.getoption("--stress"))
    if not ACTIVE:
        return
    impls = [importlib.import_module("comfy_standin"),
             importlib.import_module("comfy_standin._reference")]
    CHURN = Churn(impls, seed=int(os.environ.get(ENV + "_SEED", "0")))
    if ACTIVE & {"gc", "walker"}:
        _saved["threshold"] = gc.get_threshold()
        gc.set_threshold(1, 1, 1)
    if "walker" in ACTIVE:
        global WALKER
        from walker import Walker

        WALKER = Walker(young=True)
        WALKER.install()
    if "threads" in ACTIVE and not ACTIVE & {"gc", "walker"}:
        # A collection every few allocations: each one lets another thread
        # run (_switch_in_collection), so a switch lands inside the C
        # layer's allocations too, not only between bytecodes.
        _saved["threshold"] = gc.get_threshold()
        gc.set_threshold(int(os.environ.get(ENV + "_THRESHOLD", "1")), 1, 1)
    if "threads" in ACTIVE:
        _saved["switch"] = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        CHURN.start_threads()


def pytest_report_header(config: pytest.Config) -> str | None:
    if not ACTIVE:
        return None
    return f"stress: {', '.join(sorted(ACTIVE))} (tests/stress.py)"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global CHURN
    if CHURN is None:
        return
    churn, CHURN = CHURN, None
    walks = ""
    if WALKER is not None:
        WALKER.remove()
        walks = (f"; the walker walked {WALKER.walks} collections and used "
                 f"{WALKER.touched} objects")
    churn.stop_threads()
    churn.settle()
    churn.quiet += 1  # leftover garbage dies quietly, at exit too
    if "threshold" in _saved:
        gc.set_threshold(*_saved.pop("threshold"))
    if "switch" in _saved:
        sys.setswitchinterval(_saved.pop("switch"))
    errors = churn.take_errors()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"stress: the churn's finalizers ran {churn.fired} times; "
            f"{len(errors)} broken guarantee(s) at the end{walks}"
        )
        for line in errors[:20]:
            reporter.write_line(f"stress: {line}")
    if errors:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _stress_churn() -> Iterator[None]:
    """Under a stress mode: the churn's bursts around the test (gc mode),
    and the test fails at its teardown if a guarantee broke meanwhile."""
    churn = CHURN
    if churn is None:
        yield
        return
    if gc_stress():
        churn.burst(20)
    yield
    if gc_stress():
        churn.burst(20)
        churn.settle()
    if churn.threads:
        churn.checkpoint()
    errors = churn.take_errors()
    if errors:
        pytest.fail(
            "stress: " + "\n".join(errors[:10]), pytrace=False
        )
