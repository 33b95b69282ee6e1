"""Garbage collection (docs/semantics.md "The stand-in", garbage
collection): a cycle through any object a stand-in, its module or its
sentinel holds is collected, and with it the model's charge on its
worker's books."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest
import walker

SIZE = 10_000
FLOOR = 300 << 20


class Worker:
    def __init__(self) -> None:
        self.alive = True

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        return {}

    def is_alive(self) -> bool:
        return self.alive


class Text(str):
    """A str subclass that can carry a reference back to its stand-in."""


class Device:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


def collected(ref: weakref.ref) -> bool:
    for _ in range(3):
        gc.collect()
    return ref() is None


def build(impl, pool, worker, field: str) -> weakref.ref:
    """A stand-in with 500 bytes loaded and a cycle through `field`;
    returns a weak reference to it (no strong one is left)."""
    model_id: Any = "m"
    kind: Any = "unet"
    load: Any = "cuda:0"
    offload: Any = "cpu"
    if field == "model_id":
        model_id = Text("m")
        back = model_id
    elif field == "kind":
        kind = Text("unet")
        back = kind
    elif field == "load_device":
        load = Device("cuda:0")
        back = load
    else:
        offload = Device("cpu")
        back = offload
    s = impl.StandIn(worker, 1, model_id, SIZE, load, offload, kind=kind,
                     pool=pool)
    back.standin = s  # the cycle
    impl.apply_echo(s, 500)
    return weakref.ref(s)


@pytest.mark.parametrize(
    "field", ["model_id", "kind", "load_device", "offload_device"]
)
def test_cycle_through_a_field_is_collected_and_uncharged(impl, field):
    pool = impl.Pool(process_local=True)
    worker = Worker()
    ref = build(impl, pool, worker, field)
    if field != "model_id":
        # (both keep an exact str copy of the id: no cycle there)
        assert ref() is not None
        assert pool.worker_charges()[worker] == 500 + FLOOR
    assert collected(ref)
    # The model left its worker's books with the last stand-in.
    details = pool.charge_details()[worker]
    assert details["models"] == 0
    assert details["charge"] == FLOOR
    assert pool._ledger.find(worker).find("m") is None


def test_cycle_through_model_id_and_the_sentinel(impl):
    """The sentinel holds the id too: a sentinel the collector cannot see
    keeps the id, and so the stand-in, alive forever."""
    pool = impl.Pool(process_local=True)
    worker = Worker()
    model_id = Text("m")
    s = impl.StandIn(worker, 1, model_id, SIZE, "cuda:0", "cpu", pool=pool)
    model_id.sentinel = s.clone_base_uuid
    model_id.standin = s
    ref, sentinel_ref = weakref.ref(s), None
    try:
        sentinel_ref = weakref.ref(s.clone_base_uuid)
    except TypeError:
        pass  # not weak-referenceable; the stand-in's ref is enough
    del s, model_id
    assert collected(ref)
    if sentinel_ref is not None:
        assert sentinel_ref() is None
    assert pool.charge_details()[worker]["models"] == 0


def test_cycle_through_the_worker(impl):
    """worker -> stand-in -> worker: the pool keeps the worker on its books
    (by design), so the cycle is garbage once the pool forgets it."""
    pool = impl.Pool(process_local=True)
    worker = Worker()
    s = impl.StandIn(worker, 1, "m", SIZE, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, 500)
    worker.standin = s
    ref, worker_ref = weakref.ref(s), weakref.ref(worker)
    del s, worker
    assert not collected(ref)  # the pool's books hold the worker
    pool.forget(worker_ref())
    assert collected(ref)
    assert worker_ref() is None
    assert pool.worker_charges() == {}


def test_cycle_through_the_pool(impl):
    """pool -> stand-in -> pool, with the worker in it too: all freed."""
    pool = impl.Pool(process_local=True)
    worker = Worker()
    s = impl.StandIn(worker, 1, "m", SIZE, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, 500)
    pool.keep = s
    worker.standin = s
    s.device = s  # its assigned device: one more edge of the cycle
    refs = [weakref.ref(x) for x in (s, pool, worker)]
    del s, pool, worker
    for ref in refs:
        assert collected(ref)


def test_cycles_free_the_c_core():
    """No C worker or model outlives a collected cycle (the C core's
    counters; the reference's objects are plain Python)."""
    import comfy_standin as impl
    from comfy_standin import _core as core

    gc.collect()
    before = core._live_counts()
    for field in ("model_id", "kind", "load_device", "offload_device"):
        pool = impl.Pool(process_local=True)
        build(impl, pool, Worker(), field)
        del pool
    gc.collect()
    gc.collect()
    assert core._live_counts() == before


# ---- a collection inside a constructor ------------------------------------

HALF_MADE_PRELUDE = """
import gc, os, sys
sys.path.insert(0, {tests!r})
import comfy_standin as cs
from walker import Walker, walk

class Worker:
    def send_command(self, command, **kwargs):
        return {{}}
    def is_alive(self):
        return True
"""

#: Every kind of object of the C module made while a hook walks
#: gc.get_objects() in every collection and uses all it finds.
HALF_MADE_WALK = """
hook = Walker()
hook.install()
gc.set_threshold(1, 1, 1)
kept = []
for i in range(40):
    pool = cs.Pool(process_local=True)
    worker = Worker()
    s = cs.StandIn(worker, 1, f"m{{i}}", 100, "cuda:0", "cpu", pool=pool)
    s.model, s.clone_base_uuid
    s.device = "cuda:1"
    record = pool._ledger.find(worker).register(f"r{{i}}", 5, 1)
    worker_side, fd = cs.Board.make(2, generation=1)
    board = cs.Board.adopt(fd, 2, generation=1, heartbeat_limit=None)
    os.close(fd)
    s.attach_board(board)
    kept.append((pool, s, record, board, worker_side))
gc.set_threshold(700, 10, 10)
hook.remove()
print(walk(o for entry in kept for o in entry), hook.walks)
"""

#: A hook keeps the stand-in it meets while that stand-in is being made,
#: and makes its construction fail (another size for the same model id):
#: what it kept must still be usable.
HALF_MADE_KEEP = """
kept, blockers, target = [], [], {{}}

def saboteur(phase, info):
    worker = target.get("worker")
    if phase != "start" or worker is None:
        return
    for o in gc.get_objects():
        if type(o) is cs.StandIn and o.worker is worker:
            # The one being made (3.10, 3.11: an allocation inside the
            # constructor collected), or made (3.12+: collections wait for
            # the bytecode after the call).
            del target["worker"]
            kept.append(o)
            try:
                blockers.append(cs.StandIn(worker, 1, "m", 999, "cuda:0",
                                           "cpu", pool=target["pool"]))
            except ValueError:  # the one kept is whole, with its record
                pass
            return

gc.callbacks.append(saboteur)
gc.set_threshold(1, 1, 1)
failed = 0
for i in range(40):
    target["pool"] = pool = cs.Pool(process_local=True)
    target["worker"] = Worker()
    try:
        cs.StandIn(target["worker"], 1, "m", 10, "cuda:0", "cpu", pool=pool)
    except ValueError:
        failed += 1
    target.clear()
gc.set_threshold(700, 10, 10)
gc.callbacks.remove(saboteur)
print(walk(kept), failed)
"""


def _run_script(body: str) -> list[str]:
    source = HALF_MADE_PRELUDE.format(tests=str(Path(__file__).parent))
    source += textwrap.dedent(body.format())
    done = subprocess.run([sys.executable, "-c", source],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"exit {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout.split()


def test_walker_classifies_every_method():
    """Every public method of the C module's types is either used by the
    walker or named as one that changes state."""
    assert walker.unclassified() == []


def test_a_collection_inside_a_constructor_finds_nothing_half_made():
    """gc.callbacks hooks run inside allocations on 3.10 and 3.11: one
    that walks gc.get_objects() and uses every object of the C module it
    finds, run in every collection while stand-ins (with a device
    assigned), pools, books, records, sentinels and boards are made,
    crashes nothing (a stand-in the collector could reach before its
    record was set segfaulted in loaded_size())."""
    touched, walks = map(int, _run_script(HALF_MADE_WALK))
    assert walks > 0
    assert touched >= 40 * 5  # stand-in, sentinel, record, two boards


def test_a_hook_never_keeps_a_half_made_stand_in():
    """A hook that keeps a stand-in it finds and makes its construction
    fail (another size for the same model id) keeps only whole ones: none
    is reachable before it is, so no construction fails for a hook, and
    nothing kept lacks its record (one kept with none read freed memory
    for good)."""
    touched, failed = map(int, _run_script(HALF_MADE_KEEP))
    assert failed == 0
