"""A registered stand-in cannot vanish (docs/semantics.md "The pool").

ComfyUI's ``LoadedModel`` holds its model through a weakref.  Before the
pool held registered stand-ins, one whose caller dropped it was collected
at once: its entry left ``current_loaded_models`` through the finalizer on
its ``model`` (the stand-in itself) and no command ever reached the worker,
which kept the bytes.  These tests drive ComfyUI-like flows of the mock
(tests/mockcomfy) with no reference to the stand-in kept outside (only
weakrefs), for both implementations.
"""

from __future__ import annotations

import gc
import weakref

import fakes
import pytest

from mock_fixtures import mock_mm as _mm

GiB = _mm.GiB
CPU = _mm.CPU


def register_dropped(impl, pool, worker, model_id, size, resident):
    """Registers a stand-in and keeps only a weakref to it."""
    worker.add_model(model_id, size, resident=resident)
    s = impl.StandIn(
        worker=worker,
        worker_generation=1,
        model_id=model_id,
        model_size=size,
        load_device=worker.load_device,
        offload_device=CPU,
        kind="unet",
        pool=pool,
    )
    census = [e for e in worker.census() if e["id"] == model_id]
    impl.apply_residency({model_id: s}, census)
    impl.register(_mm, s)
    return weakref.ref(s)


@pytest.fixture
def own_pool(impl):
    p = impl.Pool(floor=0, process_local=False)
    yield p
    p.boundary()


def listed(mm, ref):
    return any(e.model is ref() for e in mm.current_loaded_models
               if ref() is not None)


def test_dropped_reference_stays_registered(impl, own_pool, mm):
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    gc.collect()
    mm.cleanup_models_gc()
    mm.cleanup_models()
    assert ref() is not None, "collected while ComfyUI lists it"
    assert listed(mm, ref)
    assert mm.get_free_memory(mm.CUDA0) == 22 * GiB
    # a boundary does not let go of a model ComfyUI still lists
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is not None and listed(mm, ref)
    assert w.commands == []


def test_unload_all_models_reaches_the_worker(impl, own_pool, mm):
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    gc.collect()
    mm.unload_all_models()
    assert [c for c, _ in w.commands] == ["model_to_device"]
    assert w.resident("m") == 0
    assert mm.get_free_memory(mm.CUDA0) == 24 * GiB
    assert not listed(mm, ref)
    # held past the boundary: the worker may load the model back, and the
    # pool must then list it again (only the worker says when it is gone)
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is not None and own_pool.held() == [ref()]
    assert not listed(mm, ref)  # off the card: not listed
    w.send_command("model_partial_load", model_id="m", extra_bytes=2 * GiB,
                   device=str(mm.CUDA0))  # the worker's own call, no echo
    impl.apply_residency({"m": ref()}, w.census())
    own_pool.boundary(mm)
    assert listed(mm, ref)
    # the worker drops the model: "not registered" ends the hold
    w.forget_model("m")
    mm.unload_all_models()
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is None
    assert own_pool.held() == []


def test_free_memory_partial_keeps_it(impl, own_pool, mm):
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 4 * GiB, 4 * GiB)
    gc.collect()
    # the card has 20 GiB free; ask for 21: one GiB from the stand-in
    mm.free_memory(21 * GiB, mm.CUDA0)
    assert [c for c, _ in w.commands] == ["model_partial_unload"]
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is not None and listed(mm, ref)
    assert ref().loaded_size() == 3 * GiB


def test_gc_inside_free_memory_collects_nothing(impl, own_pool, mm, sim):
    """A collection between two evictions of the index loop (a finalizer
    there would pop entries under free_memory's indices)."""
    w = fakes.FakeWorker("w")
    refs = [
        register_dropped(impl, own_pool, w, f"m{i}", 1 * GiB, 1 * GiB)
        for i in range(3)
    ]
    sim.on_query.append(lambda card: gc.collect())
    unloaded = mm.free_memory(1e30, mm.CUDA0)
    sim.on_query.clear()
    assert len(unloaded) == 3
    assert all(r() is not None for r in refs)
    assert w.resident("m0") == w.resident("m1") == w.resident("m2") == 0
    del unloaded
    own_pool.boundary(mm)
    gc.collect()
    # held while the worker holds the models (off the card: not listed)
    assert all(r() is not None for r in refs)
    assert not any(listed(mm, r) for r in refs)
    w.kill()
    own_pool.boundary(mm)
    own_pool.boundary(mm)
    gc.collect()
    assert all(r() is None for r in refs)


def test_refused_eviction_is_restored_not_dropped(impl, own_pool, mm):
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    w.script("refuse", "model_to_device")
    gc.collect()
    mm.unload_all_models()
    assert not listed(mm, ref)  # upstream pops it anyway
    assert ref().eviction_deferred
    assert own_pool.boundary(mm) == [ref()]
    gc.collect()
    assert ref() is not None and listed(mm, ref)
    assert ref().loaded_size() == 2 * GiB
    assert w.resident("m") == 2 * GiB


def test_dead_worker_releases_at_the_boundary(impl, own_pool, mm):
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    gc.collect()
    w.kill()
    mm.cleanup_models_gc()
    assert ref() is not None
    mm.unload_all_models()  # the gone path: nothing to send
    gc.collect()
    assert ref() is not None  # in the graveyard until the boundary
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is None
    assert not any(e.model is not None for e in mm.current_loaded_models)


def test_dead_worker_still_listed_leaves_at_the_boundary(impl, own_pool,
                                                         mm):
    """Death seen by the pool while ComfyUI still lists the model: the
    entry leaves through its finalizer at the boundary, not before."""
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    w.kill()
    own_pool.worker_gone(w)
    gc.collect()
    assert ref() is not None and listed(mm, ref)
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is None
    mm.cleanup_models_gc()
    assert mm.current_loaded_models == []


def test_model_lost_by_the_worker_releases(impl, own_pool, mm):
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    w.forget_model("m")  # restarted under the same object: "not registered"
    gc.collect()
    mm.unload_all_models()
    assert ref().receipt()[3] == "worker gone"
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is None


def test_restart_releases_the_old_generation(impl, own_pool, mm):
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    own_pool.restarted(w, 2)
    gc.collect()
    assert ref() is not None
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is None


def test_boundary_without_mm_keeps_listed_ones(impl, own_pool, mm):
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    mm.unload_all_models()
    own_pool.boundary()  # the worker still has the model: kept
    gc.collect()
    assert ref() is not None
    own_pool.boundary(mm)  # unloaded by ComfyUI: kept all the same
    gc.collect()
    assert ref() is not None and not listed(mm, ref)


def test_a_dropped_pool_and_its_holds_are_collected(impl, mm):
    """The hold is an ordinary reference cycle (pool -> stand-in -> pool)
    that the collector sees and frees: nothing lands in gc.garbage."""
    pool = impl.Pool(floor=0, process_local=False)
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, pool, w, "m", 2 * GiB, 2 * GiB)
    pool_ref = weakref.ref(pool)
    assert ref() in gc.get_referents(pool._held)
    del pool
    _mm.reset()  # ComfyUI's list lets go (finalizers detached)
    gc.collect()
    assert ref() is None and pool_ref() is None
    assert gc.garbage == []


def test_register_holds_only_our_stand_ins(impl, own_pool, mm):
    class Foreign:
        load_device = mm.CUDA0
        parent = None

        def __init__(self):
            self.model = _mm.HostModule("x", CPU)

        def __getattr__(self, name):
            raise AttributeError(name)

    foreign = Foreign()
    impl.register(mm, foreign)
    assert own_pool.held() == []


def test_a_worker_dead_without_a_command_is_noticed(impl, own_pool, mm):
    """The process died and nothing was sent since: the boundary asks
    is_alive(), marks the worker gone and lets its stand-ins go."""
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    w.kill()
    gc.collect()
    assert ref() is not None
    own_pool.boundary(mm)
    gc.collect()
    assert ref() is None
    own_pool.boundary(mm)
    assert own_pool.worker_charges() == {}  # its books are forgotten


def test_refusal_then_census_is_still_restored(impl, own_pool, mm):
    """A refused detach, then a census (a reply frame of the next call)
    clears the deferral before the boundary: the model is still on the
    card, so the boundary lists it again all the same."""
    w = fakes.FakeWorker("w")
    ref = register_dropped(impl, own_pool, w, "m", 2 * GiB, 2 * GiB)
    w.script("refuse", "model_to_device")
    mm.unload_all_models()
    assert not listed(mm, ref) and ref().eviction_deferred
    impl.apply_residency({"m": ref()}, w.census())
    assert not ref().eviction_deferred
    assert own_pool.boundary(mm) == [ref()]
    gc.collect()
    assert ref() is not None and listed(mm, ref)
    # and ComfyUI's next eviction reaches the worker
    mm.unload_all_models()
    assert w.resident("m") == 0
    own_pool.boundary(mm)
    # held (the worker has the model still), unlisted while off the card
    assert own_pool.held() == [ref()] and not listed(mm, ref)
