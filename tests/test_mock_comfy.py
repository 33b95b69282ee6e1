"""Self-tests of the mock ComfyUI, with host models only.

They pin the upstream behaviour the stand-in is tested against (sort key,
memory_to_free recomputation, escalation to detach, pops after the loop,
dedup, clone pops, finalizers), so a mistake in the mock shows up here and
not as a false verdict on the stand-in.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from mock_fixtures import mock_controlnet as controlnet
from mock_fixtures import mock_mm as _mm
from mock_fixtures import mock_multigpu as multigpu

MiB = _mm.MiB
GiB = _mm.GiB
CUDA0 = _mm.CUDA0
CUDA1 = _mm.Device("cuda", 1)


def install(mm, patcher, budget=0):
    """Load ``patcher`` as load_models_gpu would, without free_memory."""
    entry = mm.LoadedModel(patcher)
    entry.model_load(budget)
    mm.current_loaded_models.insert(0, entry)
    return entry


def host(mm, name, size, loaded=None, **kw):
    patcher = mm.HostModel(name, size, **kw)
    install(mm, patcher, 0 if loaded is None else loaded)
    return patcher


def order_of(record):
    return [step["entry"].model for step in record["steps"]]


def names(patchers):
    return [p.name for p in patchers]


# -- the simulated card -------------------------------------------------


def test_card_device_wide_free_counts_every_process(sim):
    card = sim.card()
    card.allocate("w", 3 * GiB, process="worker")
    card.allocate("h", 1 * GiB)
    assert _mm.get_free_memory(CUDA0) == 20 * GiB
    assert card.release_process("worker") == 3 * GiB
    assert _mm.get_free_memory(CUDA0) == 23 * GiB


def test_card_process_local_free_sees_only_the_host(mm):
    mm.reset(total=16 * GiB, process_local=True)
    card = mm.sim.card()
    card.allocate("w", 13 * GiB, process="worker")
    card.allocate("h", 1 * GiB)
    assert mm.get_free_memory(CUDA0) == 15 * GiB
    assert card.free() == 2 * GiB


def test_card_strict_allocation_refuses_overcommit(sim):
    card = sim.card()
    with pytest.raises(_mm.SimOutOfMemory):
        card.allocate("h", 25 * GiB)
    assert card.used() == 0


def test_torch_inactive_bytes_count_as_free(sim):
    sim.card().allocate("h", 2 * GiB)
    sim.card().torch_inactive = 1 * GiB
    total, torch_free = _mm.get_free_memory(CUDA0, torch_free_too=True)
    assert (total, torch_free) == (23 * GiB, 1 * GiB)


# -- LoadedModel --------------------------------------------------------


def test_loaded_model_holds_only_a_weakref(mm):
    p = mm.HostModel("a", 10 * MiB)
    entry = mm.LoadedModel(p)
    assert entry.model is p
    assert entry.device == CUDA0
    assert entry.currently_used is True
    assert entry.real_model is None
    assert entry.model_finalizer is None
    del p
    assert entry.model is None


def test_loaded_model_switches_to_parent_when_clone_dies(mm):
    base = mm.HostModel("base", 10 * MiB, load_device=CUDA1)
    twin = base.clone()
    entry = mm.LoadedModel(twin)
    assert entry.model is twin
    del twin
    gc.collect()
    assert entry.model is base
    assert entry.device == CUDA1


def test_model_load_call_sequence_and_finalizer(mm, sim):
    p = mm.HostModel("a", 10 * MiB)
    entry = install(mm, p)
    assert p.calls == [
        ("model_patches_to", (CUDA0,)),
        ("model_patches_to", ("float16",)),
        ("partially_load", (CUDA0, 1e32)),
    ]
    assert p.loaded_size() == 10 * MiB
    assert sim.card().held("a") == 10 * MiB
    assert entry.real_model() is p.model
    assert entry.model_finalizer.alive
    assert entry.model_finalizer.atexit is False
    del p  # the inner module dies with its only holder
    assert entry.model_finalizer is not None
    assert not entry.model_finalizer.alive
    assert mm.current_loaded_models == []


def test_model_load_passes_a_budget_through(mm):
    p = mm.HostModel("a", 10 * MiB)
    install(mm, p, budget=4 * MiB + 5)
    assert p.calls[-1] == ("partially_load", (CUDA0, 4 * MiB + 5))
    assert p.loaded_size() == 4 * MiB  # whole blocks within the budget


def test_model_unload_partial_that_frees_enough_keeps_entry(mm, sim):
    p = mm.HostModel("a", 100 * MiB)
    entry = install(mm, p)
    assert entry.model_unload(30 * MiB) is False
    assert p.loaded_size() == 70 * MiB
    assert sim.card().held("a") == 70 * MiB
    assert ("detach", (True,)) not in p.calls
    assert entry.model_finalizer.alive


def test_model_unload_short_partial_escalates_to_detach(mm, sim):
    p = mm.HostModel("a", 100 * MiB, partial_limit=10 * MiB)
    entry = install(mm, p)
    finalizer = entry.model_finalizer
    assert entry.model_unload(30 * MiB) is True
    assert [c[0] for c in p.calls[-3:]] == [
        "partially_unload",
        "detach",
        "model_patches_to",
    ]
    assert mm.unload_log[-1]["partial"] == 10 * MiB
    assert p.loaded_size() == 0
    assert sim.card().held("a") == 0
    assert not finalizer.alive
    assert entry.model_finalizer is None
    assert entry.real_model is None


def test_model_unload_target_above_loaded_skips_partial(mm):
    p = mm.HostModel("a", 100 * MiB)
    entry = install(mm, p)
    assert entry.model_unload(100 * MiB) is True
    assert "partially_unload" not in [c[0] for c in p.calls]
    assert ("detach", (True,)) in p.calls


def test_model_unload_without_target_detaches(mm):
    p = mm.HostModel("a", 100 * MiB)
    entry = install(mm, p)
    assert entry.model_unload() is True
    assert p.loaded_size() == 0


def test_model_unload_of_a_never_loaded_entry_raises(mm):
    # upstream detaches model_finalizer unconditionally: every entry in the
    # list must have one (cs.register must set it)
    p = mm.HostModel("a", 100 * MiB)
    entry = mm.LoadedModel(p)
    with pytest.raises(AttributeError):
        entry.model_unload()


def test_model_memory_required_depends_on_current_device(mm):
    p = mm.HostModel("a", 100 * MiB)
    entry = install(mm, p, budget=40 * MiB)
    assert entry.model_memory_required(CUDA0) == 60 * MiB
    assert entry.model_memory_required(CUDA1) == 100 * MiB
    assert entry.model_offloaded_memory() == 60 * MiB


def test_entries_compare_by_patcher_identity(mm):
    p = mm.HostModel("a", 1 * MiB)
    q = mm.HostModel("b", 1 * MiB)
    assert mm.LoadedModel(p) == mm.LoadedModel(p)
    assert mm.LoadedModel(p) != mm.LoadedModel(q)


def test_is_dead_when_patcher_gone_but_module_alive(mm):
    p = mm.HostModel("a", 1 * MiB)
    entry = install(mm, p)
    module = p.model
    del p
    assert entry.is_dead()
    del module
    assert mm.current_loaded_models == []


# -- free_memory --------------------------------------------------------


def test_sort_key_most_offloaded_first(mm):
    a = host(mm, "a", 100 * MiB)  # offloaded 0
    b = host(mm, "b", 100 * MiB, loaded=40 * MiB)  # offloaded 60
    c = host(mm, "c", 200 * MiB, loaded=100 * MiB)  # offloaded 100
    mm.free_memory(1e30, CUDA0)
    record = mm.free_memory_log[-1]
    assert names(order_of(record)) == ["c", "b", "a"]
    keys = [key for key, _ in record["candidates"]]
    assert [k[0] for k in keys] == [-100 * MiB, -60 * MiB, 0]
    assert [k[2] for k in keys] == [200 * MiB, 100 * MiB, 100 * MiB]
    assert [k[3] for k in keys] == [0, 1, 2]  # c was inserted last
    assert (a.loaded_size(), b.loaded_size(), c.loaded_size()) == (0, 0, 0)


@pytest.mark.parametrize("pinned", ["a", "b"])
def test_sort_key_refcount_breaks_ties(mm, pinned):
    a = host(mm, "a", 100 * MiB)
    b = host(mm, "b", 100 * MiB)
    extra = [a if pinned == "a" else b] * 5  # noqa: F841 - references
    mm.free_memory(1e30, CUDA0)
    record = mm.free_memory_log[-1]
    keys = [key for key, _ in record["candidates"]]
    assert keys[0][1] + 5 == keys[1][1]
    first = order_of(record)[0]
    assert first is (b if pinned == "a" else a)


def test_sort_key_size_then_index_break_ties(mm):
    big = host(mm, "big", 200 * MiB)
    s1 = host(mm, "s1", 100 * MiB)
    s2 = host(mm, "s2", 100 * MiB)
    mm.free_memory(1e30, CUDA0)
    assert order_of(mm.free_memory_log[-1]) == [s2, s1, big]


def test_memory_to_free_recomputed_before_each_candidate(mm, sim):
    a = host(mm, "a", 4 * GiB)
    b = host(mm, "b", 4 * GiB)
    free = mm.get_free_memory(CUDA0)
    unloaded = mm.free_memory(free + 3 * GiB, CUDA0)
    steps = mm.free_memory_log[-1]["steps"]
    assert [s["memory_to_free"] for s in steps] == [3 * GiB, 0]
    first, second = order_of(mm.free_memory_log[-1])
    assert first.loaded_size() == 1 * GiB
    assert second.loaded_size() == 4 * GiB
    assert "partially_unload" not in [c[0] for c in second.calls]
    assert unloaded == []
    assert {first, second} == {a, b}
    assert sim.card().free() == free + 3 * GiB


def test_short_partial_escalates_and_is_popped(mm):
    a = host(mm, "a", 4 * GiB, partial_limit=1 * GiB)
    b = host(mm, "b", 8 * GiB)
    free = mm.get_free_memory(CUDA0)
    unloaded = mm.free_memory(free + 3 * GiB, CUDA0)
    assert [e.model for e in unloaded] == [a]
    assert a.loaded_size() == 0
    assert b.loaded_size() == 8 * GiB
    assert [e.model for e in mm.current_loaded_models] == [b]


def test_pops_happen_after_the_loop(mm, sim):
    models = [host(mm, name, 100 * MiB) for name in "abc"]
    lengths = []
    sim.on_query.append(
        lambda card: lengths.append(len(_mm.current_loaded_models))
    )
    unloaded = mm.free_memory(1e30, CUDA0)
    assert lengths[:3] == [3, 3, 3]
    assert len(unloaded) == 3
    assert mm.current_loaded_models == []
    steps = mm.free_memory_log[-1]["steps"]
    assert [s["index"] for s in steps] == [0, 1, 2]
    assert [p.loaded_size() for p in models] == [0, 0, 0]


def test_candidates_filtered_by_device_and_keep_loaded(mm, sim):
    sim.add_card(CUDA1, 8 * GiB)
    a = host(mm, "a", 100 * MiB)
    b = host(mm, "b", 100 * MiB)
    other = host(mm, "other", 100 * MiB, load_device=CUDA1)
    keep = [mm.loaded_entry(b)]
    mm.free_memory(1e30, CUDA0, keep_loaded=keep)
    assert a.loaded_size() == 0
    assert b.loaded_size() == 100 * MiB
    assert other.loaded_size() == 100 * MiB
    assert mm.loaded_entry(b).currently_used is True
    assert mm.loaded_entry(other).currently_used is True
    assert mm.loaded_entry(a) is None


def test_candidates_lose_currently_used_even_if_kept(mm):
    a = host(mm, "a", 100 * MiB)
    mm.free_memory(0, CUDA0)
    assert a.loaded_size() == 100 * MiB
    assert mm.loaded_entry(a).currently_used is False


def test_device_none_marks_but_unloads_nothing(mm):
    a = host(mm, "a", 100 * MiB)
    assert mm.free_memory(1e30, None) == []
    assert a.loaded_size() == 100 * MiB
    assert mm.loaded_entry(a).currently_used is False


def test_disable_smart_memory_unloads_everything(mm):
    mm.DISABLE_SMART_MEMORY = True
    a = host(mm, "a", 100 * MiB)
    assert len(mm.free_memory(0, CUDA0)) == 1
    assert a.loaded_size() == 0


def test_for_dynamic_counts_dynamic_models_instead_of_evicting(mm):
    d = host(mm, "d", 512 * MiB, dynamic=True)
    n = host(mm, "n", 1 * GiB)
    free = mm.get_free_memory(CUDA0)
    mm.free_memory(free + 768 * MiB, CUDA0, for_dynamic=True)
    steps = mm.free_memory_log[-1]["steps"]
    assert [s["entry"].model for s in steps] == [d, n]
    assert [s["memory_to_free"] for s in steps] == [0, 256 * MiB]
    assert d.loaded_size() == 512 * MiB
    assert n.loaded_size() == 768 * MiB


def test_without_for_dynamic_dynamic_models_are_evicted(mm):
    d = host(mm, "d", 512 * MiB, dynamic=True)
    host(mm, "n", 1 * GiB)
    free = mm.get_free_memory(CUDA0)
    mm.free_memory(free + 768 * MiB, CUDA0)
    assert d.loaded_size() == 0
    assert mm.loaded_entry(d) is None


@pytest.mark.parametrize(
    ("for_dynamic", "pins", "expected"),
    [(False, 5, [5, 5]), (True, 5, []), (False, 0, [])],
)
def test_pin_budget_asked_only_when_not_dynamic(
    mm, for_dynamic, pins, expected
):
    host(mm, "a", 100 * MiB)
    mm.free_memory(0, CUDA0, for_dynamic=for_dynamic, pins_required=pins)
    assert [r["size"] for r in mm.pin_requests] == expected
    if expected:
        assert [r["fn"] for r in mm.pin_requests] == [
            "ensure_pin_budget",
            "ensure_pin_registerable",
        ]


def test_free_memory_runs_gc_when_an_entry_is_dead(mm):
    p = host(mm, "a", 100 * MiB)
    module = p.model
    del p
    mm.free_memory(0, CUDA0)
    assert mm.counters["gc_collect"] == 1
    assert mm.free_memory_log[-1]["candidates"] == []  # dead: not a candidate
    del module


# -- load_models_gpu ----------------------------------------------------


def test_load_models_gpu_keeps_the_callers_order(mm):
    a = mm.HostModel("a", 100 * MiB)
    b = mm.HostModel("b", 100 * MiB)
    mm.load_models_gpu([a, b])
    assert mm.loaded_models() == [a, b]
    assert a.loaded_size() == b.loaded_size() == 100 * MiB


def test_load_models_gpu_dedups_including_patches_models(mm):
    x = mm.HostModel("x", 10 * MiB)
    a = mm.HostModel("a", 100 * MiB, patches_models=[x])
    mm.load_models_gpu([a, a, x])
    assert mm.loaded_models() == [a, x]
    assert x.loaded_size() == 10 * MiB
    assert [r() for r in mm.load_log[-1]["models"]] == [x, a]


def test_reloading_reuses_the_entry_and_pops_it_as_its_own_clone(mm):
    a = mm.HostModel("a", 100 * MiB)
    mm.load_models_gpu([a])
    entry = mm.current_loaded_models[0]
    mm.free_memory(0, CUDA0)
    assert entry.currently_used is False
    mm.load_models_gpu([a])
    assert mm.current_loaded_models == [entry]
    assert mm.current_loaded_models[0] is entry
    assert entry.currently_used is True
    assert [r() for r in mm.load_log[-1]["reused"]] == [a]
    # ModelPatcher.is_clone(self) is True: the entry is popped and detached
    # without unpatching, then loaded and inserted again
    assert [r() for r in mm.load_log[-1]["clone_pops"]] == [a]
    assert ("detach", (False,)) in a.calls
    assert a.loaded_size() == 100 * MiB


def test_loading_a_clone_pops_the_loaded_base(mm):
    a = mm.HostModel("a", 100 * MiB)
    mm.load_models_gpu([a])
    base_entry = mm.current_loaded_models[0]
    finalizer = base_entry.model_finalizer
    twin = a.clone()
    mm.load_models_gpu([twin])
    assert mm.loaded_models() == [twin]
    assert ("detach", (False,)) in a.calls
    assert not finalizer.alive


def test_total_pins_required_is_sizes_of_non_dynamic_models(mm):
    n = mm.HostModel("n", 1 * GiB)
    d = mm.HostModel("d", 512 * MiB, dynamic=True)
    mm.load_models_gpu([n, d])
    pins = mm.pins_log[-1]
    assert pins["total"] == 1 * GiB
    assert [r() for r in pins["models"]] == [n]
    assert [r["size"] for r in mm.pin_requests] == [1 * GiB, 1 * GiB]
    assert mm.free_memory_log[0]["for_dynamic"] is False


def test_all_dynamic_load_frees_for_dynamic_without_pins(mm):
    d = mm.HostModel("d", 512 * MiB, dynamic=True)
    mm.load_models_gpu([d])
    assert mm.free_memory_log[0]["for_dynamic"] is True
    assert mm.pin_requests == []


def test_free_memory_asked_for_requirement_plus_reserve(mm):
    a = mm.HostModel("a", 1 * GiB)
    mm.load_models_gpu([a], memory_required=2 * GiB)
    extra = max(0.8 * GiB + 400 * MiB, 2 * GiB + 400 * MiB)
    assert mm.free_memory_log[0]["memory_required"] == 1 * GiB * 1.1 + extra


def test_partially_loaded_model_needs_only_its_remainder(mm):
    a = host(mm, "a", 1 * GiB, loaded=256 * MiB)
    mm.load_models_gpu([a])
    extra = 0.8 * GiB + 400 * MiB
    assert mm.free_memory_log[0]["memory_required"] == 768 * MiB * 1.1 + extra


def test_low_vram_budget_loads_part_of_a_big_model(mm):
    mm.reset(total=4 * GiB)
    a = mm.HostModel("a", 3 * GiB)
    mm.load_models_gpu([a])
    budget = mm.load_log[-1]["loaded"][0][1]
    assert budget == 4 * GiB - (0.8 * GiB + 400 * MiB)
    assert a.loaded_size() == int(budget // MiB) * MiB
    assert len(mm.free_memory_log) == 1


def test_second_pass_when_free_is_below_the_minimum(mm):
    mm.reset(total=1 * GiB)
    a = mm.HostModel("a", 10 * MiB)
    mm.load_models_gpu([a])
    first, second = mm.free_memory_log
    assert first["pins_required"] == 10 * MiB
    assert second["memory_required"] == 0.8 * GiB + 400 * MiB
    assert second["pins_required"] == 0
    # no room above the minimum: the budget is 0.1 byte (low-VRAM mode)
    assert mm.load_log[-1]["loaded"][0][1] == 0.1
    assert a.calls[-1] == ("partially_load", (CUDA0, 0.1))
    assert a.loaded_size() == 0


def test_load_evicts_others_to_make_room(mm):
    mm.reset(total=8 * GiB)
    old = host(mm, "old", 4 * GiB)
    new = mm.HostModel("new", 3 * GiB)
    mm.load_models_gpu([new])
    assert new.loaded_size() == 3 * GiB
    assert old.loaded_size() < 4 * GiB
    assert mm.sim.card().used() == old.loaded_size() + 3 * GiB


# -- the other readers --------------------------------------------------


def test_loaded_models_filters_on_currently_used(mm):
    a = host(mm, "a", 1 * MiB)
    b = host(mm, "b", 1 * MiB)
    mm.loaded_entry(a).currently_used = False
    assert mm.loaded_models() == [b, a]
    assert mm.loaded_models(only_currently_used=True) == [b]


def test_cleanup_models_drops_entries_whose_module_died(mm):
    a = host(mm, "a", 1 * MiB)
    b = host(mm, "b", 1 * MiB)
    assert mm.loaded_models() == [b, a]
    mm.current_loaded_models[1].real_model = weakref.ref(
        mm.HostModule("x", CUDA0)
    )
    mm.cleanup_models()
    assert mm.loaded_models() == [b]


def test_unload_model_and_clones_frees_the_family_only(mm):
    a = host(mm, "a", 100 * MiB)
    kin = host(mm, "kin", 100 * MiB, clone_base_uuid=a.clone_base_uuid)
    extra = host(mm, "extra", 100 * MiB)
    other = host(mm, "other", 100 * MiB)
    a.additional_models = [extra]
    mm.unload_model_and_clones(a)
    assert mm.loaded_models() == [other]
    assert (a.loaded_size(), kin.loaded_size(), extra.loaded_size()) == (
        0,
        0,
        0,
    )
    assert mm.free_memory_log[-1]["memory_required"] == 1e30


def test_unload_model_and_clones_none_uuid_matches_none(mm):
    # the hazard the sentinel exists for: None == None frees a stranger
    a = host(mm, "a", 100 * MiB)
    stranger = host(mm, "stranger", 100 * MiB)
    a.clone_base_uuid = None
    stranger.clone_base_uuid = None
    mm.unload_model_and_clones(a)
    assert stranger.loaded_size() == 0


def test_unload_all_models_walks_every_card(mm, sim):
    sim.add_card(CUDA1, 8 * GiB)
    a = host(mm, "a", 100 * MiB)
    b = host(mm, "b", 100 * MiB, load_device=CUDA1)
    mm.unload_all_models()
    assert a.loaded_size() == b.loaded_size() == 0
    assert mm.current_loaded_models == []


def test_pin_eviction_walk_sees_only_dynamic_models(mm):
    host(mm, "n", 100 * MiB)
    d = host(mm, "d", 64 * MiB, dynamic=True)
    assert list(mm.models_for_pin_eviction(None)) == [d]
    mm.reset_cast_buffers()
    assert d.calls[-1][0] == "partially_unload_ram"


# -- multigpu and the control-net round trip ----------------------------


def base_clone_on(mm, sim, model):
    sim.add_card(CUDA1, 8 * GiB)
    p = mm.HostModel(
        "p",
        100 * MiB,
        load_device=CUDA1,
        clone_base_uuid=model.clone_base_uuid,
    )
    p.is_multigpu_base_clone = True
    install(mm, p)
    return p


def test_multigpu_reuses_a_matching_base_clone(mm, sim):
    model = mm.HostModel("m", 100 * MiB)
    p = base_clone_on(mm, sim, model)
    twin = multigpu.reuse_loaded(model, CUDA1)
    assert twin is not None
    assert twin.model is p.model
    assert p.clone_calls == 1
    assert multigpu.trace == [("p", None)]


@pytest.mark.parametrize(
    "check", ["load_device", "clone_base_uuid", "multigpu_base_clone"]
)
def test_multigpu_each_check_skips_on_its_own(mm, sim, check):
    model = mm.HostModel("m", 100 * MiB)
    p = base_clone_on(mm, sim, model)
    device = CUDA1
    if check == "load_device":
        device = CUDA0
    elif check == "clone_base_uuid":
        p.clone_base_uuid = mm.HostModel("x", 1).clone_base_uuid
    else:
        p.is_multigpu_base_clone = False
    assert multigpu.rejections(p, model, device) == {check}
    for order in multigpu.all_orders():
        if check in order:
            assert multigpu.reuse_loaded(model, device, order) is None
            assert multigpu.trace == [("p", check)]
    assert p.clone_calls == 0


def test_multigpu_orders_cover_permutations():
    orders = multigpu.all_orders()
    assert len(orders) == 24 + 4 * 6
    assert multigpu.DEFAULT_ORDER in orders
    assert multigpu.ORDERS["upstream_and_chain"] in orders


def test_round_trip_reloads_only_models_in_use(mm):
    a = mm.HostModel("a", 100 * MiB)
    b = mm.HostModel("b", 100 * MiB)
    mm.load_models_gpu([a])
    mm.load_models_gpu([b])  # its free_memory marks a unused
    vae = mm.HostModel("vae", 100 * MiB)
    handed_back = controlnet.round_trip(lambda: mm.load_models_gpu([vae]))
    assert handed_back == [b]
    assert [c[0] for c in a.calls].count("partially_load") == 1
    assert [c[0] for c in b.calls].count("partially_load") == 2


def test_reset_detaches_finalizers(mm):
    p = mm.HostModel("a", 1 * MiB)
    entry = install(mm, p)
    finalizer = entry.model_finalizer
    mm.reset()
    assert not finalizer.alive
    assert mm.current_loaded_models == []
