"""Garbage collection (docs/semantics.md "The stand-in", garbage
collection): a cycle through any object a stand-in, its module or its
sentinel holds is collected, and with it the model's charge on its
worker's books."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

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
    refs = [weakref.ref(x) for x in (s, pool, worker, s.model)]
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
