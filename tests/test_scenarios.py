"""Scenarios: stand-ins and host models inside the mock ComfyUI.

Each scenario runs under both implementations (``impl``: the C module
``comfy_standin`` and ``comfy_standin._reference``), against the mock
``comfy.model_management`` of ``tests/mockcomfy`` and fake workers whose
bytes live on the same simulated card as the host models. Written against
the public API (``__init__.pyi``, ``docs/semantics.md``).
"""

from __future__ import annotations

import gc

import fakes
import pytest
from mock_fixtures import mock_controlnet as controlnet
from mock_fixtures import mock_mm as _mm
from mock_fixtures import mock_multigpu as multigpu
from mock_fixtures import pool  # noqa: F401  (Linux, floor 0)


MiB = _mm.MiB
GiB = _mm.GiB
CUDA0 = _mm.CUDA0
CUDA1 = _mm.Device("cuda", 1)
CPU = _mm.CPU


def make_standin(impl, pool, worker, model_id, size, resident=0):
    """A worker model, its stand-in with a census receipt, registered."""
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
    assert s.loaded_size() == resident
    impl.register(_mm, s)
    return s


def make_host(mm, name, size, loaded=None, **kw):
    """A host model loaded (to ``loaded`` bytes) as model_load would."""
    p = mm.HostModel(name, size, **kw)
    entry = mm.LoadedModel(p)
    entry.model_load(0 if loaded is None else loaded)
    mm.current_loaded_models.insert(0, entry)
    return p


def step_models(record):
    return [step["entry"].model for step in record["steps"]]


def label(patcher):
    return getattr(patcher, "model_id", None) or patcher.name


def entry_of(mm, patcher):
    return mm.loaded_entry(patcher)


# -- registration -------------------------------------------------------


def test_register_builds_an_unused_entry_with_a_finalizer(impl, pool, mm):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 1 * GiB, resident=1 * GiB)
    entry = mm.current_loaded_models[0]
    assert entry.model is s
    assert entry.currently_used is False
    assert entry.device == CUDA0
    assert entry.real_model() is s.model is s
    assert entry.model_finalizer.alive
    assert entry.model_finalizer.atexit is False
    assert w.commands == []


def test_registered_twice_is_listed_once(impl, pool, mm):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 1 * GiB, resident=1 * GiB)
    host = make_host(mm, "h", 1 * GiB)
    first = entry_of(mm, s)
    first.currently_used = True
    again = impl.register(mm, s)
    assert [p for p in mm.loaded_models() if p is s] == [s]
    assert len(mm.current_loaded_models) == 2
    assert again is first
    assert first.currently_used is False
    assert mm.loaded_models() == [host, s]


# -- eviction order and the partial/detach ladder -----------------------


def test_eviction_order_mixes_host_models_and_standins(impl, pool, mm, sim):
    w = fakes.FakeWorker("w")
    h1 = make_host(mm, "h1", 2 * GiB)  # offloaded 0
    s1 = make_standin(impl, pool, w, "s1", 4 * GiB, 1 * GiB)  # 3 GiB
    h2 = make_host(mm, "h2", 3 * GiB, loaded=1 * GiB)  # 2 GiB
    s2 = make_standin(impl, pool, w, "s2", 1 * GiB, 512 * MiB)  # 0.5 GiB
    free = mm.get_free_memory(CUDA0)
    assert free == 24 * GiB - (2 * GiB + 1 * GiB + 1 * GiB + 512 * MiB)

    unloaded = mm.free_memory(free + 5 * GiB // 2, CUDA0)

    record = mm.free_memory_log[-1]
    assert step_models(record) == [s1, h2, s2, h1]
    keys = [key for key, _ in record["candidates"]]
    assert [k[0] for k in keys] == [-3 * GiB, -2 * GiB, -512 * MiB, 0]
    assert [k[2] for k in keys] == [4 * GiB, 3 * GiB, 1 * GiB, 2 * GiB]
    # memory_to_free is re-read from the card before each candidate, so
    # each eviction must have returned its bytes to the driver
    assert [s["memory_to_free"] for s in record["steps"]] == [
        5 * GiB // 2,
        3 * GiB // 2,
        512 * MiB,
        0,
    ]
    # popped after the loop, highest index first
    assert [e.model for e in unloaded] == [s1, h2, s2]
    assert mm.loaded_models() == [h1]
    assert (s1.loaded_size(), s2.loaded_size(), h2.loaded_size()) == (0, 0, 0)
    assert h1.loaded_size() == 2 * GiB
    assert w.sent("model_to_device") == [
        {"model_id": "s1", "device": "cpu"},
        {"model_id": "s2", "device": "cpu"},
    ]
    assert sim.card().used(process=w.name) == 0
    assert mm.get_free_memory(CUDA0) == free + 5 * GiB // 2


def test_partial_unload_that_frees_enough_keeps_the_entry(impl, pool, mm, sim):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 4 * GiB, 4 * GiB)
    free = mm.get_free_memory(CUDA0)
    assert mm.free_memory(free + 1 * GiB, CUDA0) == []
    assert w.sent() == [{"model_id": "m", "bytes_to_free": 1 * GiB}]
    assert mm.unload_log[-1]["partial"] == 1 * GiB
    assert entry_of(mm, s) is not None
    assert s.loaded_size() == 3 * GiB
    assert sim.card().held("m", process=w.name) == 3 * GiB
    assert s.eviction_deferred is False


def test_partial_unload_of_a_fractional_target_keeps_the_entry(impl, pool, mm):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 4 * GiB, 4 * GiB)
    free = mm.get_free_memory(CUDA0)
    target = free + 1 * GiB + 0.5  # what 1.1 * need + reserve looks like
    mm.free_memory(target, CUDA0)
    assert w.sent("model_to_device") == []
    assert entry_of(mm, s) is not None


def test_short_partial_unload_escalates_to_detach(impl, pool, mm, sim):
    w = fakes.FakeWorker("w")
    w.unload_cap = 256 * MiB
    shortfalls = []
    pool.on_pressure = shortfalls.append
    s = make_standin(impl, pool, w, "m", 4 * GiB, 4 * GiB)
    free = mm.get_free_memory(CUDA0)
    unloaded = mm.free_memory(free + 1 * GiB, CUDA0)
    assert [e.model for e in unloaded] == [s]
    assert w.sent() == [
        {"model_id": "m", "bytes_to_free": 1 * GiB},
        {"model_id": "m", "device": "cpu"},
    ]
    assert mm.unload_log[-1]["partial"] == 256 * MiB
    assert mm.unload_log[-1]["detached"] is True
    assert s.loaded_size() == 0
    assert sim.card().used(process=w.name) == 0
    assert shortfalls == [1 * GiB - 256 * MiB]


# -- a worker dying inside free_memory ----------------------------------


def test_worker_dying_mid_free_memory_counts_its_bytes_as_freed(
    impl, pool, mm, sim
):
    w = fakes.FakeWorker("w", context_bytes=300 * MiB)
    s = make_standin(impl, pool, w, "m", 4 * GiB, 3 * GiB)  # offloaded 1
    h = make_host(mm, "h", 2 * GiB)  # offloaded 0: after s
    w.script("die", command="model_partial_unload")
    free = mm.get_free_memory(CUDA0)

    unloaded = mm.free_memory(free + 1 * GiB, CUDA0)  # must not raise

    assert not w.is_alive()
    assert w.sent() == [{"model_id": "m", "bytes_to_free": 1 * GiB}]
    # the gone path returns what was resident: enough, so the entry stays
    assert mm.unload_log[0]["partial"] == 3 * GiB
    assert unloaded == []
    assert s.loaded_size() == 0
    # the dead process's bytes (context included) really went back
    assert mm.get_free_memory(CUDA0) == free + 3 * GiB + 300 * MiB
    steps = mm.free_memory_log[-1]["steps"]
    assert [st["entry"].model for st in steps] == [s, h]
    assert steps[1]["memory_to_free"] <= 0
    assert h.loaded_size() == 2 * GiB


def test_worker_dying_during_detach_does_not_raise(impl, pool, mm, sim):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 2 * GiB, 2 * GiB)
    w.script("die", command="model_to_device")
    unloaded = mm.free_memory(1e30, CUDA0)
    assert [e.model for e in unloaded] == [s]
    assert [c for c, _ in w.commands] == ["model_to_device"]
    assert s.loaded_size() == 0
    assert sim.card().used(process=w.name) == 0


def test_worker_dead_before_free_memory_gets_no_command(impl, pool, mm, sim):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 4 * GiB, 4 * GiB)
    w.kill()
    free = mm.get_free_memory(CUDA0)
    assert free == 24 * GiB
    mm.free_memory(free + 1 * GiB, CUDA0)
    assert w.commands == []
    assert s.loaded_size() == 0


# -- a refusing worker --------------------------------------------------


FAILURES = [
    ("refuse", {}),
    ("timeout", {}),
    ("garbage", {"how": "missing", "field": "freed", "perform": False}),
    ("garbage", {"how": "negative", "field": "freed", "perform": False}),
    ("garbage", {"how": "bool", "field": "freed", "perform": False}),
    ("garbage", {"how": "nan", "field": "freed", "perform": False}),
    ("garbage", {"how": "beyond", "field": "freed", "perform": False}),
    ("garbage", {"how": "str", "field": "freed", "perform": False}),
    ("garbage", {"how": "not_dict", "perform": False}),
]


@pytest.mark.parametrize(
    ("kind", "options"),
    FAILURES,
    ids=[f"{k}-{o.get('how', '')}" for k, o in FAILURES],
)
def test_refusing_worker_keeps_the_receipt(impl, pool, mm, sim, kind, options):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 4 * GiB, 3 * GiB)
    before = s.receipt()
    w.script(kind, command="model_partial_unload", **options)
    w.script("refuse", command="model_to_device")
    free = mm.get_free_memory(CUDA0)

    unloaded = mm.free_memory(free + 1 * GiB, CUDA0)  # must not raise

    assert w.is_alive()
    assert [c for c, _ in w.commands] == [
        "model_partial_unload",
        "model_to_device",
    ]
    assert mm.unload_log[0]["partial"] == 0
    # upstream pops an entry whose detach freed nothing; the stand-in must
    # still say the weights are there
    assert [e.model for e in unloaded] == [s]
    assert s.loaded_size() == 3 * GiB
    assert s.receipt()[0] == before[0]
    assert s.receipt()[1] == before[1]
    assert s.eviction_deferred is True
    assert sim.card().held("m", process=w.name) == 3 * GiB


def test_boundary_puts_back_a_refused_eviction(impl, pool, mm, sim):
    """ComfyUI pops an entry whose detach freed nothing; at the next node
    boundary the pool lists it again, unused, so ComfyUI keeps seeing the
    bytes; a stand-in evicted for real stays out."""
    w = fakes.FakeWorker("w")
    kept = make_standin(impl, pool, w, "kept", 4 * GiB, 3 * GiB)
    gone = make_standin(impl, pool, w, "gone", 1 * GiB, 1 * GiB)
    w.script("refuse", command="model_partial_unload")
    w.script("refuse", command="model_to_device")
    unloaded = mm.free_memory(1e30, CUDA0)
    assert {id(e.model) for e in unloaded} == {id(kept), id(gone)}
    assert kept.eviction_deferred and not gone.eviction_deferred
    assert all(e.model is not kept for e in mm.current_loaded_models)

    assert pool.boundary(mm) == [kept]
    entries = [e for e in mm.current_loaded_models if e.model is kept]
    assert len(entries) == 1 and entries[0].currently_used is False
    assert all(e.model is not gone for e in mm.current_loaded_models)
    assert pool.boundary(mm) == []  # already listed: not twice
    # the next eviction reaches it and this time the worker complies
    mm.free_memory(1e30, CUDA0)
    assert kept.loaded_size() == 0 and not kept.eviction_deferred
    assert sim.card().held("kept", process=w.name) == 0


def test_refused_partial_then_successful_detach(impl, pool, mm, sim):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 4 * GiB, 3 * GiB)
    w.script("refuse", command="model_partial_unload")
    free = mm.get_free_memory(CUDA0)
    unloaded = mm.free_memory(free + 1 * GiB, CUDA0)
    assert [e.model for e in unloaded] == [s]
    assert s.loaded_size() == 0
    assert s.eviction_deferred is False
    assert sim.card().used(process=w.name) == 0


# -- the clone_base_uuid readers ----------------------------------------


def test_unload_model_and_clones_with_none_uuid_keeps_the_standin(
    impl, pool, mm
):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 2 * GiB, 2 * GiB)
    target = make_host(mm, "target", 1 * GiB)
    target.clone_base_uuid = None
    mm.unload_model_and_clones(target)
    assert target.loaded_size() == 0
    assert mm.loaded_models() == [s]
    assert w.commands == []
    assert s.loaded_size() == 2 * GiB
    assert s.clone_base_uuid != None  # noqa: E711


def test_unload_model_and_clones_of_a_host_model_keeps_the_standin(
    impl, pool, mm
):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 2 * GiB, 2 * GiB)
    target = make_host(mm, "target", 1 * GiB)
    kin = make_host(mm, "kin", 1 * GiB, clone_base_uuid=target.clone_base_uuid)
    mm.unload_model_and_clones(target, all_devices=True)
    assert mm.loaded_models() == [s]
    assert kin.loaded_size() == 0
    assert w.commands == []


def test_standin_uuid_matches_only_itself(impl, pool, mm):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "a", 2 * GiB, 2 * GiB)
    t = make_standin(impl, pool, w, "b", 2 * GiB, 2 * GiB)
    mm.unload_model_and_clones(s)
    assert mm.loaded_models() == [t]
    assert [p["model_id"] for p in w.sent()] == ["a"]


def test_multigpu_loop_never_reaches_clone_in_any_order(impl, pool, mm, sim):
    sim.add_card(CUDA1, 24 * GiB)
    w = fakes.FakeWorker("w", load_device=CUDA1)
    s = make_standin(impl, pool, w, "m", 2 * GiB, 2 * GiB)
    targets = [mm.HostModel("t", 1 * GiB), mm.HostModel("n", 1 * GiB)]
    targets[1].clone_base_uuid = None
    for model in targets:
        # the stand-in must fail at least two checks, each on its own
        rejected = multigpu.rejections(s, model, CUDA1)
        assert {"clone_base_uuid", "multigpu_base_clone"} <= rejected
        for order in multigpu.all_orders():
            assert multigpu.reuse_loaded(model, CUDA1, order) is None
            assert multigpu.trace[0][1] is not None
    assert w.commands == []


def test_multigpu_loop_walks_past_the_standin_to_a_real_base_clone(
    impl, pool, mm, sim
):
    sim.add_card(CUDA1, 24 * GiB)
    model = mm.HostModel("model", 1 * GiB)
    base = make_host(
        mm,
        "base",
        1 * GiB,
        load_device=CUDA1,
        clone_base_uuid=model.clone_base_uuid,
    )
    base.is_multigpu_base_clone = True
    w = fakes.FakeWorker("w", load_device=CUDA1)
    s = make_standin(impl, pool, w, "m", 2 * GiB, 2 * GiB)
    assert mm.loaded_models() == [s, base]
    for order in multigpu.all_orders():
        twin = multigpu.reuse_loaded(model, CUDA1, order)
        assert twin is not None
        assert twin.model is base.model
        assert multigpu.trace[0] == ("m", multigpu.trace[0][1])
        assert multigpu.trace[0][1] is not None
    assert base.clone_calls == len(multigpu.all_orders())
    assert w.commands == []


# -- the currently_used round trip and pins -----------------------------


@pytest.mark.parametrize("registered", ["before", "after"])
def test_round_trip_never_reloads_a_standin(impl, pool, mm, registered):
    # "after": no free_memory has cleared currently_used since register
    w = fakes.FakeWorker("w")
    unet = mm.HostModel("unet", 3 * GiB)
    if registered == "before":
        s = make_standin(impl, pool, w, "m", 2 * GiB, 1 * GiB)
    mm.load_models_gpu([unet])
    if registered == "after":
        s = make_standin(impl, pool, w, "m", 2 * GiB, 1 * GiB)
    assert mm.loaded_models(only_currently_used=True) == [unet]
    vae = mm.HostModel("vae", 512 * MiB)

    handed_back = controlnet.round_trip(lambda: mm.load_models_gpu([vae]))

    assert s not in handed_back
    assert w.sent("model_partial_load") == []
    assert w.sent("model_to_device") == []
    assert entry_of(mm, s) is not None
    assert entry_of(mm, s).currently_used is False


def test_round_trip_after_reregistration_still_skips_the_standin(
    impl, pool, mm
):
    w = fakes.FakeWorker("w")
    s = make_standin(impl, pool, w, "m", 2 * GiB, 1 * GiB)
    entry_of(mm, s).currently_used = True  # somebody else's write
    impl.register(mm, s)
    assert s not in controlnet.round_trip()
    assert w.sent("model_partial_load") == []


def test_no_standin_size_enters_pins_required(impl, pool, mm):
    w = fakes.FakeWorker("w")
    unet = mm.HostModel("unet", 3 * GiB)
    clip = mm.HostModel("clip", 1 * GiB)
    mm.load_models_gpu([unet, clip])
    s = make_standin(impl, pool, w, "big", 7 * GiB, 2 * GiB)
    mm.load_models_gpu(mm.loaded_models(only_currently_used=True))
    controlnet.round_trip(lambda: mm.load_models_gpu([clip]))
    assert mm.pins_log
    for pins in mm.pins_log:
        assert s not in [ref() for ref in pins["models"]]
        assert pins["total"] <= 4 * GiB
    sizes = {r["size"] for r in mm.pin_requests}
    assert sizes
    assert all(size < s.size for size in sizes)
    assert w.sent("model_partial_load") == []


# -- garbage collection inside the free_memory loop ---------------------


def test_gc_during_free_memory_does_not_shift_the_loop(impl, pool, mm, sim):
    w = fakes.FakeWorker("w")
    held = [
        make_standin(impl, pool, w, "a", 4 * GiB, 3 * GiB),  # offloaded 1
        make_standin(impl, pool, w, "b", 4 * GiB, 2 * GiB),  # offloaded 2
    ]
    h = make_host(mm, "h", 2 * GiB)  # offloaded 0: last
    w.script("die")  # in b's eviction, the first command
    lengths = []

    def collect_between_candidates(card):
        lengths.append(len(_mm.current_loaded_models))
        if not w.is_alive():
            # comfy-env lets go of a dead worker's stand-ins (the test's
            # references stand for its), and a collection runs inside the
            # loop, between two candidates
            held.clear()
            gc.collect()

    free = mm.get_free_memory(CUDA0)
    sim.on_query.append(collect_between_candidates)
    mm.free_memory(free + 6 * GiB, CUDA0)
    sim.on_query.clear()

    record = mm.free_memory_log[-1]
    assert lengths[:3] == [3, 3, 3]
    planned = [entry for _, entry in record["candidates"]]
    assert [st["entry"] for st in record["steps"]] == planned
    # nothing died under the loop: every step is the entry it planned,
    # still bound to its model (no strong reference here keeps a or b)
    assert all(st["entry"].model is not None for st in record["steps"])
    assert [label(st["entry"].model) for st in record["steps"]] == [
        "b",
        "a",
        "h",
    ]
    # the worker died in b's detach: both of its models (5 GiB) went with
    # it, a needed no command, and the host model made up the last GiB
    assert not w.is_alive()
    assert [c for c, _ in w.commands] == ["model_to_device"]
    assert [st["memory_to_free"] for st in record["steps"]] == [
        6 * GiB,
        1 * GiB,
        1 * GiB,
    ]
    assert h.loaded_size() == 1 * GiB
    del planned, record
    pool.boundary()  # the graveyard empties at the node boundary
    gc.collect()
    assert all(not e.is_dead() for e in mm.current_loaded_models)
    assert all(e.model is not None for e in mm.current_loaded_models)
