"""The stand-in, which is its own inner module (``model``): every member
ComfyUI touches (docs/semantics.md, docs/comfyui.md), construction, and
registration."""

# Comparisons of an object with itself and `not (a == b)` are what these
# tests are about: ComfyUI's code spells them that way.
# ruff: noqa: PLR0124, SIM201, SIM202

from __future__ import annotations

import copy
import dis
import gc
import pickle
import re
import sys
import threading
import time
import uuid
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

MAX = 2**63 - 1


def naming(field: str, value: object) -> str:
    return f"(?s){re.escape(field)}.*{re.escape(repr(value))}"


class Device:
    """An opaque device object, as torch.device is to the stand-in."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Device({self.name!r})"

    def __str__(self) -> str:
        return self.name


@pytest.fixture
def devices():
    return Device("cuda:0"), Device("cpu")


@pytest.fixture
def standin(impl, pool, make_worker, devices):
    return impl.StandIn(
        worker=make_worker(),
        worker_generation=1,
        model_id="unet-0",
        model_size=8000,
        load_device=devices[0],
        offload_device=devices[1],
        kind="unet",
        pool=pool,
    )


# ---- the members of docs/semantics.md ---------------------------------------


def test_plain_answers(standin, devices):
    s = standin
    assert s.load_device is devices[0]
    assert s.offload_device is devices[1]
    assert s.parent is None
    assert s.size == 8000
    assert s.model_size() == 8000
    assert s.loaded_size() == 0
    assert s.is_dynamic() is False
    assert s.model_dtype() is None
    assert s.model_patches_models() == []
    assert s.get_nested_additional_models() == []
    assert s.lowvram_patch_counter() == 0
    assert s.model_patches_to(devices[0]) is None
    assert s.model_patches_to(None) is None
    assert s.loaded_size() == 0 and s.current_loaded_device() is devices[1]


def test_introspection(impl, pool, standin):
    s = standin
    assert s.worker_generation == 1
    assert s.model_id == "unet-0"
    assert s.kind == "unet"
    assert s.pool is pool
    assert s.worker.calls == []
    assert s.stale is False
    assert s.eviction_deferred is False
    assert s.bad_replies == 0
    loaded, seq, age, source = s.receipt()
    assert (loaded, seq, source) == (0, None, "registered")
    assert isinstance(age, float) and age >= 0


def test_default_kind(impl, pool, make_worker):
    s = impl.StandIn(make_worker(), 1, "m", 10, "cuda:0", "cpu", pool=pool)
    assert s.kind == "other"


def test_model_is_the_standin_itself(impl, standin):
    """ComfyUI reads ``M = patcher.model`` and weak-references it: the
    stand-in answers as its own model, so no second object is made."""
    assert standin.model is standin
    assert standin.model.model is standin
    assert type(standin.model) is impl.StandIn
    assert not hasattr(impl, "StandInModule")


def test_loaded_size_and_device_follow_receipts(impl, standin, devices):
    s = standin
    impl.apply_echo(s, 3000, seq=1)
    assert s.loaded_size() == 3000
    assert s.model_size() == 8000
    assert s.current_loaded_device() is devices[0]
    assert s.device is devices[0]
    assert s.model_loaded_weight_memory == 3000
    impl.apply_residency({"unet-0": s}, [{"id": "unet-0", "resident": 0}])
    assert s.loaded_size() == 0
    assert s.current_loaded_device() is devices[1]
    assert s.device is devices[1]
    assert s.model_loaded_weight_memory == 0


def test_no_patch_semantics(standin):
    for name in ("clone", "add_patches", "add_hook_patches"):
        with pytest.raises(NotImplementedError, match="worker"):
            getattr(standin, name)()
        with pytest.raises(NotImplementedError):
            getattr(standin, name)(1, key="value")


def test_is_clone(impl, pool, make_worker, make_standin):
    w = make_worker()
    a = make_standin(worker=w, model_id="unet")
    same = make_standin(worker=w, model_id="unet")
    assert a.is_clone(a)
    assert a.is_clone(same) and same.is_clone(a)
    other_id = make_standin(worker=w, model_id="vae")
    other_worker = make_standin(model_id="unet")
    newer = make_standin(worker=w, generation=2, model_id="unet")
    assert not a.is_clone(other_id)
    assert not a.is_clone(other_worker)
    assert not a.is_clone(newer)
    assert not newer.is_clone(a)
    assert not a.is_clone(None)
    assert not a.is_clone(SimpleNamespace(worker=w, model_id="unet"))


def test_is_clone_across_implementations(both_impls, make_worker):
    c, ref = both_impls
    w = make_worker()
    a = c.StandIn(w, 1, "unet", 10, "cuda:0", "cpu", pool=c.Pool())
    b = ref.StandIn(w, 1, "unet", 10, "cuda:0", "cpu", pool=ref.Pool())
    assert not a.is_clone(b)
    assert not b.is_clone(a)


# ---- clone_base_uuid --------------------------------------------------------


def test_clone_base_uuid_sentinel(make_worker, make_standin):
    w = make_worker()
    a = make_standin(worker=w, model_id="unet-0")
    b = make_standin(worker=w, model_id="unet-0")
    sentinel = a.clone_base_uuid
    assert sentinel is a.clone_base_uuid
    assert sentinel == sentinel
    assert not (sentinel != sentinel)
    real = uuid.uuid4()
    assert sentinel != real and real != sentinel
    assert not (sentinel == real) and not (real == sentinel)
    assert sentinel is not None
    assert sentinel != None  # noqa: E711
    assert not (sentinel == None)  # noqa: E711
    assert sentinel != b.clone_base_uuid
    assert not (sentinel == b.clone_base_uuid)
    assert sentinel != str(real) and sentinel != 0
    assert hash(sentinel) == hash(sentinel)
    assert {sentinel: 1, b.clone_base_uuid: 2}[sentinel] == 1
    assert not isinstance(sentinel, uuid.UUID)


def test_clone_base_uuid_repr(make_standin):
    s = make_standin(model_id="unet-0")
    assert repr(s.clone_base_uuid) == (
        "<comfy_standin private clone_base_uuid of model 'unet-0' "
        "(never equals a uuid)>"
    )


def test_multigpu_filters_reject_a_standin(make_standin):
    """comfy/multigpu.py: each check must fail before clone()."""
    s = make_standin()
    target = SimpleNamespace(clone_base_uuid=uuid.uuid4())
    assert s.clone_base_uuid != target.clone_base_uuid
    assert not getattr(s, "is_multigpu_base_clone", False)
    none_target = SimpleNamespace(clone_base_uuid=None)
    assert s.clone_base_uuid != none_target.clone_base_uuid


# ---- identity, weak references, unknown attributes --------------------------


def test_identity_equality_and_hash(make_worker, make_standin):
    w = make_worker()
    a = make_standin(worker=w, model_id="unet")
    b = make_standin(worker=w, model_id="unet")
    assert a == a and not (a != a)
    assert a != b and not (a == b)
    assert hash(a) == object.__hash__(a)
    assert len({a: 1, b: 2}) == 2
    assert [a, b].index(b) == 1


def test_weak_references(make_standin):
    s = make_standin()
    ref = weakref.ref(s)
    # ComfyUI's entry holds weakref.ref(patcher.model): the stand-in's own.
    inner = weakref.ref(s.model)
    assert ref() is s and inner() is s
    fired = []
    weakref.finalize(s.model, fired.append, "model")
    del s
    gc.collect()
    assert ref() is None
    assert inner() is None
    assert fired == ["model"]


def test_graveyard_keeps_standins_of_a_dead_worker(impl, pool, make_standin):
    s = make_standin()
    worker = s.worker
    fired = []
    weakref.finalize(s.model, fired.append, "model")
    ref = weakref.ref(s)
    pool.worker_gone(worker)
    del s
    gc.collect()
    assert ref() is not None and fired == []
    pool.boundary()
    gc.collect()
    assert ref() is None and fired == ["model"]


def test_graveyard_on_restart(impl, pool, make_worker, make_standin):
    w = make_worker()
    old = make_standin(worker=w, generation=1, model_id="unet")
    ref = weakref.ref(old)
    keep = make_standin(worker=w, generation=1, model_id="vae")
    pool.restarted(w, 2)
    newer = make_standin(worker=w, generation=2, model_id="unet")
    newer_ref = weakref.ref(newer)
    del old, keep, newer
    gc.collect()
    assert ref() is not None
    pool.boundary()
    gc.collect()
    assert ref() is None
    assert newer_ref() is None  # current stand-ins are never kept


def test_graveyard_on_implicit_restart(impl, pool, make_worker, make_standin):
    w = make_worker()
    old = make_standin(worker=w, generation=1, model_id="unet")
    ref = weakref.ref(old)
    newer = make_standin(worker=w, generation=2, model_id="unet")
    del old
    gc.collect()
    assert ref() is not None and ref().stale
    pool.boundary()
    gc.collect()
    assert ref() is None
    assert not newer.stale


def _contract_message(impl) -> bool:
    """Whether the stand-in type's own AttributeError says the upstream
    contract changed: the reference always; the C type where that costs
    its method calls nothing (3.12+: docs/semantics.md, "Unknown
    attributes")."""
    return impl.__name__ != "comfy_standin" or sys.version_info >= (3, 12)


def test_unknown_attribute_names_it(impl, standin):
    with pytest.raises(AttributeError) as info:
        standin.is_multigpu_base_clone  # noqa: B018
    message = str(info.value)
    assert "is_multigpu_base_clone" in message
    assert ("the upstream contract changed" in message) == (
        _contract_message(impl)
    )
    with pytest.raises(AttributeError, match="dynamic_pins"):
        standin.dynamic_pins  # noqa: B018
    with pytest.raises(AttributeError, match="loaded_ram_size"):
        standin.loaded_ram_size()


def test_getattr_default_works(standin):
    assert getattr(standin, "is_multigpu_base_clone", False) is False
    assert getattr(standin, "__foo__", "default") == "default"
    assert getattr(standin, "_private_thing", 3) == 3
    assert not hasattr(standin, "__deepcopy__")
    assert not hasattr(standin, "__setstate__")


@pytest.mark.parametrize("name", ["__foo__", "__deepcopy__", "__copy__"])
def test_dunder_attribute_error_is_plain(impl, standin, name):
    with pytest.raises(AttributeError) as info:
        getattr(standin, name)
    assert name in str(info.value)
    assert "contract" not in str(info.value)
    if _contract_message(impl):
        assert str(info.value) == name


def _specialised(call: Any, obj: Any) -> bool:
    """Whether CPython 3.11+ specialises `call(obj)` (a one-line lambda
    calling a method of obj) after a warm-up: the method is loaded without
    a bound method (LOAD_METHOD_NO_DICT / LOAD_ATTR_METHOD_NO_DICT) and
    called as a method descriptor."""
    for _ in range(2000):
        call(obj)
    ops = [i.opname for i in dis.get_instructions(call, adaptive=True)]
    loads = [op for op in ops if "METHOD" in op and "LOAD" in op]
    calls = [op for op in ops if "METHOD_DESCRIPTOR" in op]
    return bool(loads) and all(op.endswith("METHOD_NO_DICT") for op in loads)\
        and bool(calls)


@pytest.mark.skipif(sys.version_info < (3, 11),
                    reason="no specialising interpreter before 3.11")
@pytest.mark.parametrize(
    "call",
    [lambda s: s.loaded_size(), lambda s: s.model_size(),
     lambda s: s.is_dynamic(), lambda s: s.current_loaded_device()],
    ids=["loaded_size", "model_size", "is_dynamic", "current_loaded_device"],
)
def test_comfyuis_method_calls_are_specialised(both_impls, call):
    """The C StandIn keeps CPython's own attribute lookup (no tp_getattro
    on a type whose methods sit on a hot path): `s.loaded_size()`, as
    ComfyUI's sort key calls it, is specialised like a built-in's method
    call, with no bound method per call.  The check can fail: a type that
    overrides attribute lookup is not specialised."""
    c = both_impls[0]
    s = c.StandIn(_Quiet(), 1, "m", 10, "cuda:0", "cpu", pool=c.Pool())
    assert type(s).__getattribute__ is object.__getattribute__
    assert _specialised(call, s)

    class Overriding:
        def loaded_size(self):
            return 0

        model_size = is_dynamic = current_loaded_device = loaded_size

        def __getattribute__(self, name):
            return object.__getattribute__(self, name)

    assert not _specialised(call, Overriding())


class _Quiet:
    def send_command(self, command: str, **kwargs: Any) -> Any:
        return {}

    def is_alive(self) -> bool:
        return True


def test_attribute_lookup_is_cpythons_own(both_impls):
    """3.10 calls a method without a bound method only on a type whose
    tp_getattro is CPython's own (3.11+ specialises only past it, or past
    the slot __getattr__ gives on 3.12+): the C StandIn's is, on every
    version."""
    c = both_impls[0]
    s = c.StandIn(_Quiet(), 1, "m", 10, "cuda:0", "cpu", pool=c.Pool())
    assert type(s).__getattribute__ is object.__getattribute__


@pytest.mark.parametrize("obj", ["standin", "sentinel"])
def test_copy_and_pickle_refuse(standin, obj):
    target = {
        "standin": standin,
        "sentinel": standin.clone_base_uuid,
    }[obj]
    for attempt in (
        copy.copy,
        copy.deepcopy,
        pickle.dumps,
        lambda x: pickle.dumps(x, protocol=0),
    ):
        with pytest.raises(TypeError, match="cannot pickle"):
            attempt(target)


def test_cannot_set_unknown_attributes(standin):
    with pytest.raises(AttributeError):
        standin.is_multigpu_base_clone = True
    assert getattr(standin, "is_multigpu_base_clone", False) is False
    with pytest.raises(AttributeError):
        standin.size = 5
    assert standin.size == 8000


# ---- what ComfyUI reads on the inner module: the stand-in answers it --------


INNER_CONSTANTS = {
    "model_lowvram": False,
    "current_weight_patches_uuid": None,
    "model_offload_buffer_memory": 0,
}


def test_inner_module_constants(standin):
    m = standin.model
    assert m is standin
    assert m.model_lowvram is False
    assert m.current_weight_patches_uuid is None
    assert m.model_offload_buffer_memory == 0
    assert type(m.model_offload_buffer_memory) is int
    assert m.model_loaded_weight_memory == 0
    # ModelPatcher's int of that name is never read off a stand-in's model
    # (only ModelPatcher's own methods read it): the method ComfyUI calls.
    assert m.lowvram_patch_counter() == 0
    assert getattr(m, "__foo__", 1) == 1
    assert getattr(m, "dynamic_pins", None) is None
    with pytest.raises(AttributeError, match="dynamic_pins"):
        m.dynamic_pins  # noqa: B018


@pytest.mark.parametrize("name", sorted(INNER_CONSTANTS))
def test_inner_module_constants_are_read_only(standin, name):
    for value in (True, 1, None, "x"):
        with pytest.raises(AttributeError):
            setattr(standin, name, value)
    with pytest.raises(AttributeError):
        delattr(standin, name)
    value = getattr(standin, name)
    assert value == INNER_CONSTANTS[name]
    assert type(value) is type(INNER_CONSTANTS[name])


@pytest.mark.parametrize("name", ["device", "model_loaded_weight_memory"])
def test_inner_module_members_cannot_be_deleted(impl, standin, devices, name):
    impl.apply_echo(standin, 100, seq=1)
    with pytest.raises(AttributeError, match=f"{name} cannot be deleted"):
        delattr(standin, name)
    assert standin.device is devices[0]
    assert standin.model_loaded_weight_memory == 100
    loaded, seq, _, source = standin.receipt()
    assert (loaded, seq, source) == (100, 1, "load echo")


def test_inner_device_assignment(impl, standin, devices):
    s, m = standin, standin.model
    assert m is s
    assert m.device is devices[1]
    elsewhere = Device("cuda:1")
    m.device = elsewhere
    assert m.device is elsewhere
    assert s.current_loaded_device() is elsewhere
    # The next receipt makes it consistent again.
    impl.apply_echo(s, 10)
    assert m.device is devices[0]
    m.device = elsewhere
    assert m.device is elsewhere
    impl.apply_residency({"unet-0": s}, [{"id": "unet-0", "resident": 0}])
    assert m.device is devices[1]


def test_inner_model_loaded_weight_memory(impl, pool, standin, devices):
    s, m = standin, standin.model
    assert m is s
    impl.apply_echo(s, 100, seq=7)
    assert m.model_loaded_weight_memory == 100
    m.model_loaded_weight_memory = 5000
    loaded, seq, _, source = s.receipt()
    assert (loaded, seq, source) == (5000, 7, "assigned")
    assert s.loaded_size() == 5000
    assert m.device is devices[0]
    books = pool._ledger.find(s.worker)
    assert books.charge()["sum_peak"] == 5000
    m.model_loaded_weight_memory = 0
    assert s.loaded_size() == 0 and m.device is devices[1]
    m.model_loaded_weight_memory = 8000
    assert s.loaded_size() == 8000


@pytest.mark.parametrize(
    "value, exc",
    [
        (-1, ValueError),
        (8001, ValueError),
        (2**63, ValueError),
        (2**100, ValueError),
        (True, TypeError),
        (1.0, TypeError),
        (None, TypeError),
        ("5", TypeError),
    ],
)
def test_inner_model_loaded_weight_memory_bad(impl, standin, value, exc):
    impl.apply_echo(standin, 100, seq=7)
    with pytest.raises(exc, match=naming("model_loaded_weight_memory", value)):
        standin.model_loaded_weight_memory = value
    loaded, seq, _, source = standin.receipt()
    assert (loaded, seq, source) == (100, 7, "load echo")


def test_inner_assignment_on_stale_is_ignored(impl, pool, make_standin):
    s = make_standin(size=1000)
    pool.restarted(s.worker, 2)
    s.model_loaded_weight_memory = 500
    loaded, _, _, source = s.receipt()
    assert (loaded, source) == (0, "worker gone")
    assert s.model_loaded_weight_memory == 0
    with pytest.raises(ValueError):
        s.model_loaded_weight_memory = 1001


# ---- construction -----------------------------------------------------------


class NoSend:
    def is_alive(self):
        return True


class NoAlive:
    def send_command(self, command, **kwargs):
        return {}


class NotCallable:
    send_command = 5

    def is_alive(self):
        return True


@pytest.mark.parametrize(
    "worker", [None, object(), NoSend(), NoAlive(), NotCallable(), "worker"]
)
def test_constructor_bad_worker(impl, pool, worker):
    with pytest.raises(TypeError, match="worker"):
        impl.StandIn(worker, 1, "m", 10, "cuda:0", "cpu", pool=pool)
    assert list(pool._ledger.keys()) == []


BAD_BYTES = [
    (-1, ValueError),
    (2**63, ValueError),
    (2**100, ValueError),
    (-(2**100), ValueError),
    (True, TypeError),
    (False, TypeError),
    (1.0, TypeError),
    (float("nan"), TypeError),
    (None, TypeError),
    ("1", TypeError),
]


@pytest.mark.parametrize("value, exc", BAD_BYTES)
@pytest.mark.parametrize("field", ["worker_generation", "model_size"])
def test_constructor_bad_numbers(impl, pool, make_worker, field, value, exc):
    kwargs = {
        "worker": make_worker(),
        "worker_generation": 1,
        "model_id": "m",
        "model_size": 10,
        "load_device": "cuda:0",
        "offload_device": "cpu",
        "pool": pool,
        field: value,
    }
    with pytest.raises(exc, match=naming(field, value)):
        impl.StandIn(**kwargs)
    assert list(pool._ledger.keys()) == []


@pytest.mark.parametrize(
    "value, exc",
    [("", ValueError), (5, TypeError), (None, TypeError), (b"m", TypeError)],
)
def test_constructor_bad_model_id(impl, pool, make_worker, value, exc):
    with pytest.raises(exc, match=naming("model_id", value)):
        impl.StandIn(make_worker(), 1, value, 10, "cuda:0", "cpu", pool=pool)
    assert list(pool._ledger.keys()) == []


def test_constructor_bad_kind(impl, pool, make_worker):
    with pytest.raises(TypeError, match=naming("kind", 5)):
        impl.StandIn(make_worker(), 1, "m", 10, "a", "b", kind=5, pool=pool)


@pytest.mark.parametrize("bad_pool", [object(), "pool", 5])
def test_constructor_bad_pool(impl, make_worker, bad_pool):
    with pytest.raises(TypeError, match="pool"):
        impl.StandIn(make_worker(), 1, "m", 10, "a", "b", pool=bad_pool)


def test_constructor_pool_of_the_other_implementation(both_impls, make_worker):
    c, ref = both_impls
    with pytest.raises(TypeError, match="pool"):
        c.StandIn(make_worker(), 1, "m", 10, "a", "b", pool=ref.Pool())
    with pytest.raises(TypeError, match="pool"):
        ref.StandIn(make_worker(), 1, "m", 10, "a", "b", pool=c.Pool())


def test_constructor_extremes(impl, pool, make_worker):
    s = impl.StandIn(make_worker(), MAX, "m", MAX, "a", "b", pool=pool)
    assert s.size == MAX and s.worker_generation == MAX
    zero = impl.StandIn(make_worker(), 0, "z", 0, "a", "b", pool=pool)
    assert zero.size == 0 and zero.loaded_size() == 0


def test_a_model_id_of_more_than_64_kib_is_refused(impl, pool, make_worker):
    """A record keeps its id's length in 16 bits (one small allocation per
    stand-in): ids of up to 65535 bytes of UTF-8."""
    w = make_worker()
    longest = impl.StandIn(w, 1, "m" * 65535, 10, "a", "b", pool=pool)
    assert longest.model_id == "m" * 65535
    for too_long in ("n" * 65536, "\u00e9" * 32768):
        with pytest.raises(ValueError, match="65536 bytes of UTF-8"):
            impl.StandIn(w, 1, too_long, 10, "a", "b", pool=pool)


def test_default_pool(impl, make_worker):
    assert impl.default_pool() is impl.default_pool()
    assert isinstance(impl.default_pool(), impl.Pool)
    w = make_worker()
    s = impl.StandIn(w, 1, "m", 10, "cuda:0", "cpu")
    try:
        assert s.pool is impl.default_pool()
        assert impl.default_pool()._ledger.find(w) is not None
    finally:
        impl.default_pool().forget(w)


# ---- registration into model_management -------------------------------------


class LoadedModel:
    """What comfy.model_management.LoadedModel does with a patcher."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        if model.parent is not None:
            raise AssertionError("a stand-in has no parent")
        self.device = model.load_device
        self.real_model = None
        self.currently_used = True
        self.model_finalizer = None

    @property
    def model(self):
        return self._model()

    def model_memory(self):
        return self.model.model_size()

    def model_loaded_memory(self):
        return self.model.loaded_size()


def fake_mm():
    mm = SimpleNamespace(current_loaded_models=[], cleanups=[])
    mm.LoadedModel = LoadedModel

    def cleanup_models():
        mm.cleanups.append(len(mm.current_loaded_models))
        mm.current_loaded_models[:] = [
            e for e in mm.current_loaded_models if e.real_model() is not None
        ]

    mm.cleanup_models = cleanup_models
    return mm


def test_register(impl, make_standin):
    mm = fake_mm()
    previous = SimpleNamespace(model=None, real_model=lambda: mm)
    mm.current_loaded_models.append(previous)
    s = make_standin()
    entry = impl.register(mm, s)
    assert mm.current_loaded_models == [entry, previous]
    assert entry.model is s
    assert entry.currently_used is False
    assert entry.real_model() is s.model is s
    assert entry.model_finalizer.alive
    assert entry.model_finalizer.atexit is False
    assert entry.model_memory() == s.size


def test_register_twice_returns_the_entry(impl, make_standin):
    mm = fake_mm()
    s = make_standin()
    entry = impl.register(mm, s)
    entry.currently_used = True
    again = impl.register(mm, s)
    assert again is entry
    assert again.currently_used is False
    assert len(mm.current_loaded_models) == 1
    t = make_standin()
    other = impl.register(mm, t)
    assert mm.current_loaded_models == [other, entry]


def test_register_finalizer_cleans_up(impl, make_standin):
    mm = fake_mm()
    s = make_standin()
    impl.register(mm, s)
    pool, worker = s.pool, s.worker
    del s
    gc.collect()
    # registered: its pool keeps it (tests/test_registration_ownership.py)
    assert mm.cleanups == []
    pool.worker_gone(worker)
    pool.boundary()
    gc.collect()
    assert mm.cleanups == [1]
    assert mm.current_loaded_models == []


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_sentinel_refused_at_dump_for_every_protocol(standin, protocol):
    """Protocols 0 and 1 reduce through copyreg: refused at dump, not
    produced and then failing on load."""
    with pytest.raises(TypeError, match="cannot pickle"):
        pickle.dumps(standin.clone_base_uuid, protocol=protocol)


def test_eviction_deferred_is_writable_with_a_bool(make_standin):
    # comfy-env's _register_new_patchers writes `p.eviction_deferred =
    # False` after listing a refused stand-in again; an AttributeError
    # there aborted its whole boundary.
    s = make_standin()
    assert s.eviction_deferred is False
    s.eviction_deferred = True
    assert s.eviction_deferred is True
    s.eviction_deferred = False
    assert s.eviction_deferred is False
    for bad in (1, 0, None, "yes"):
        with pytest.raises(TypeError, match="eviction_deferred"):
            s.eviction_deferred = bad
    assert s.eviction_deferred is False
    with pytest.raises(TypeError, match="deleted"):
        del s.eviction_deferred


# ---- lean construction: lazy members, the pool's roster (issue 11) ---------


def _is_c(impl) -> bool:
    return impl.__name__ == "comfy_standin"


def test_model_is_no_second_object_and_the_sentinel_is_made_once(
    impl, make_standin
):
    s = make_standin()
    if _is_c(impl):
        # Nothing but the stand-in is made at construction...
        kinds = {type(o).__name__ for o in gc.get_referents(s)}
        assert "CloneBaseSentinel" not in kinds
    held = gc.get_referents(s)
    # ...reading its model makes nothing: the model is the stand-in, and
    # it holds no reference to itself (refcounting frees it, no cycle).
    model = s.model
    assert model is s and s.detach() is s
    assert [type(o) for o in gc.get_referents(s)] == [type(o) for o in held]
    assert all(o is not s for o in gc.get_referents(s))
    sentinel = s.clone_base_uuid
    # ...and from then on the same sentinel, held once by the stand-in.
    assert s.clone_base_uuid is sentinel
    assert gc.get_referents(s).count(sentinel) == 1
    weakref.ref(model)  # ComfyUI's weakref.finalize target


class Device:
    """A device object compared by identity only (like a caller's own)."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_stand_ins_made_alike_share_their_devices_and_kind(impl, pool,
                                                          make_worker):
    worker, other = make_worker(), make_worker()
    load, offload = Device("cuda:0"), Device("cpu")

    def make(w, model_id, load_device=load, kind="unet"):
        return impl.StandIn(w, 1, model_id, 1000, load_device, offload,
                            kind=kind, pool=pool)

    a, b = make(worker, "a"), make(worker, "b")
    c = make(worker, "c", load_device=Device("cuda:1"))
    d, e = make(worker, "d", kind="clip"), make(other, "e")
    f = make(worker, "f")
    # Whatever is shared, each answers with the objects it was made with.
    for s, want_load, kind in ((a, load, "unet"), (b, load, "unet"),
                               (d, load, "clip"), (e, load, "unet")):
        assert s.load_device is want_load and s.offload_device is offload
        assert s.kind == kind
    assert c.load_device is not load and c.load_device.name == "cuda:1"
    if _is_c(impl):
        # One (load, offload, kind) tuple for a run of stand-ins made with
        # the same objects: 8 bytes each instead of 24 on the stand-in.
        # Each shares the tuple of the stand-in listed last on its
        # worker's roster, or else on the roster used last under its
        # pool: c and d differ from theirs; e is the first of its worker
        # and follows d (clip); f follows d on its worker and e under the
        # pool; h follows f.
        def profile(s):
            (t,) = [o for o in gc.get_referents(s) if type(o) is tuple]
            return t

        h = make(worker, "h")
        assert profile(a) is profile(b)
        assert profile(c) is not profile(b) and profile(d) is not profile(c)
        assert profile(e) is not profile(d) and profile(e) is not profile(a)
        assert profile(f) is not profile(d) and profile(f) is profile(e)
        assert profile(h) is profile(f)
        del h
    # The last stand-in made is gone (its profile with it, unless shared):
    # the next is made from its own arguments, never from freed memory.
    del f
    gc.collect()
    g = make(worker, "g", kind=str("un") + "et")
    assert g.load_device is load and g.kind == "unet"
    del g
    # Nothing shared outlives the stand-ins holding it.
    ref = weakref.ref(load)
    del a, b, c, d, e, s, want_load, load, make
    gc.collect()
    assert ref() is None


def test_an_assigned_device_is_kept_until_the_next_receipt(impl, standin,
                                                           devices):
    s = standin
    assert s.current_loaded_device() is devices[1]  # nothing assigned yet
    impl.apply_echo(s, resident=10, seq=1)
    assert s.current_loaded_device() is devices[0]
    s.device = devices[1]
    assert s.current_loaded_device() is devices[1]
    assert s.device is devices[1] and s.model.device is devices[1]
    s.model.device = devices[0]  # through model: the same stand-in
    assert s.device is devices[0]


def test_model_finalizer_fires_by_reference_counting(make_standin, devices):
    """weakref.finalize(s.model, ...) fires when the last reference to the
    stand-in goes, by reference counting (no collector pass), whatever
    it was given or made meanwhile."""
    s = make_standin()
    s.device = devices[0]
    s.clone_base_uuid  # noqa: B018
    fired = []
    weakref.finalize(s.model, fired.append, "model")
    gc.disable()
    try:
        del s
        assert fired == ["model"]
    finally:
        gc.enable()


def test_cycle_through_lazily_made_members_is_collected(make_standin):
    class Id(str):
        pass

    model_id = Id("cyclic")
    s = make_standin(model_id=model_id)
    model_id.owner = s  # id -> stand-in -> sentinel -> id
    _ = s.clone_base_uuid
    s.device = s  # stand-in -> its assigned device -> stand-in
    ref = weakref.ref(s)
    del s, model_id, _
    gc.collect()
    assert ref() is None


def test_pool_lists_live_standins_only(impl, pool, make_worker, make_standin):
    w = make_worker()
    a = make_standin(worker=w)
    b = make_standin(worker=w)
    assert sorted(map(id, pool.standins()[w])) == sorted([id(a), id(b)])
    seen = []
    # A weakref callback runs while `a` dies: the pool no longer lists it.
    keep = weakref.ref(a, lambda _: seen.append(pool.standins()[w]))
    gc.disable()
    try:
        del a
    finally:
        gc.enable()
    assert keep() is None
    assert seen == [[b]]
    assert pool.standins()[w] == [b]


def test_pool_drops_standins_cleared_by_the_collector(
    impl, pool, make_worker, make_standin
):
    w = make_worker()
    s = make_standin(worker=w)
    s.device = s  # a cycle: only the collector frees it
    del s
    gc.collect()
    assert pool.standins().get(w, []) == []


def test_construction_runs_no_python_of_the_pool(
    impl, make_worker, monkeypatch
):
    """A stand-in joins its worker's roster in the worker's books, in the
    step that registers its model: no method of the pool runs, and the
    pool's lock is never taken, except that a newer generation runs the
    pool's restarted() first (it buries the older stand-ins)."""
    pool = impl.Pool()
    ids = iter(range(1000))

    def make_standin(worker, generation):
        return impl.StandIn(
            worker, generation, f"m{next(ids)}", 10, "cuda", "cpu", pool=pool
        )

    calls: list[int] = []
    restarted = type(pool).restarted

    def counting(self, worker, generation):
        calls.append(generation)
        return restarted(self, worker, generation)

    monkeypatch.setattr(type(pool), "restarted", counting)
    w = make_worker()
    old = make_standin(w, 1)
    same = make_standin(w, 1)
    assert calls == []
    assert pool.standins()[w] == [old, same]
    newer = make_standin(w, 2)
    assert calls == [2]
    assert pool.graveyard_size() == 2 and old.stale and same.stale
    assert pool.standins()[w] == [old, same, newer]
    older = make_standin(w, 1)  # a late one of the old process: no restart
    assert calls == [2] and older.stale
    # The pool's lock held by another thread does not hold construction.
    other = make_worker()
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with pool._lock:
            held.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(30)
        made = make_standin(other, 1)
    finally:
        done.set()
        t.join()
    assert pool.standins()[other] == [made]


def test_constructor_arguments(impl, pool, make_worker, devices):
    w = make_worker()
    args = (w, 1, "m", 10, *devices)
    s = impl.StandIn(*args, "vae", pool)
    assert (s.kind, s.pool) == ("vae", pool)
    s = impl.StandIn(
        *args[:3],
        model_size=10,
        load_device=devices[0],
        offload_device=devices[1],
        pool=pool,
    )
    assert (s.kind, s.size) == ("other", 10)
    for bad_args, bad_kwargs in [
        (args[:5], {"pool": pool}),  # offload_device missing
        (args, {"worker": w, "pool": pool}),  # twice
        (args, {"pool": pool, "colour": "red"}),
        ((*args, "vae", pool, None), {}),  # too many
    ]:
        with pytest.raises(TypeError):
            impl.StandIn(*bad_args, **bad_kwargs)


def test_the_books_own_the_roster(impl, make_worker):
    """The roster of a worker's stand-ins lives in the worker's books:
    made with them, and taken off the ledger with them by forget()."""
    pool = impl.Pool()
    worker = make_worker()
    a = impl.StandIn(worker, 1, "a", 10, "cuda:0", "cpu", pool=pool)
    b = impl.StandIn(worker, 1, "b", 10, "cuda:0", "cpu", pool=pool)
    old = pool._ledger.find(worker)
    assert old.standins() == [a, b]
    assert pool._ledger.books() == [old]
    assert pool._ledger.forget(worker) is old
    assert pool._ledger.forget(worker) is None
    assert old.standins() == [a, b] and pool.standins() == {}
    c = impl.StandIn(worker, 1, "c", 10, "cuda:0", "cpu", pool=pool)
    new = pool._ledger.find(worker)
    assert new is not old and new.standins() == [c]
    assert old.standins() == [a, b]
    assert pool.standins()[worker] == [c]
    # The roster lists live stand-ins only, in adoption order; the books
    # live as long as a stand-in on their roster does.
    ref = weakref.ref(old)
    del a
    assert old.standins() == [b]
    del old, b
    gc.collect()
    assert ref() is None


def test_a_run_of_stand_ins_never_joins_a_forgotten_workers_roster(
    impl, make_worker
):
    """Once forget() took a worker's books off the ledger, the next
    stand-in of that worker gets new books, in both implementations."""
    pool = impl.Pool()
    worker = make_worker()
    a = impl.StandIn(worker, 1, "a", 10, "cuda:0", "cpu", pool=pool)
    b = impl.StandIn(worker, 1, "b", 10, "cuda:0", "cpu", pool=pool)
    old = pool._ledger.find(worker)
    assert sorted(s.model_id for s in old.standins()) == ["a", "b"]
    pool.forget(worker)
    assert pool.standins() == {}
    c = impl.StandIn(worker, 1, "c", 10, "cuda:0", "cpu", pool=pool)
    new = pool._ledger.find(worker)
    assert new is not old and new.standins() == [c]
    assert sorted(s.model_id for s in old.standins()) == ["a", "b"]
    assert pool.standins()[worker] == [c]
    # A newer generation is listed on the current books too.
    d = impl.StandIn(worker, 2, "d", 10, "cuda:0", "cpu", pool=pool)
    assert new.generation == 2 and new.standins() == [c, d]
    # Another pool's stand-in of the same worker, made right after, is
    # that pool's.
    other = impl.Pool()
    e = impl.StandIn(worker, 2, "e", 10, "cuda:0", "cpu", pool=other)
    assert list(other.standins()[worker]) == [e]
    assert e not in new.standins()
    del a, b


def test_construction_never_deadlocks_on_a_finalizer_reading_the_pool(
    impl, make_worker
):
    """Construction takes no lock a finalizer could want: a collection its
    allocations start may run a finalizer that reads the pool (here:
    pool.standins()), in both implementations."""
    c = impl
    pool = c.Pool()
    seen: list = []

    class Finalized:
        def __init__(self) -> None:
            self.cycle = self

        def __del__(self) -> None:
            seen.append(len(pool.standins()))
            if len(seen) < 5000:
                Finalized()  # garbage for the next collection, always

    made: list = []

    def construct() -> None:
        old = gc.get_threshold()
        gc.set_threshold(1)
        try:
            # 50 at least, and until a finalizer has run: another thread
            # inside a collection holds the collector off (the thread-switch
            # stress mode, tests/stress.py, runs such threads), so how many
            # it takes is not known in advance, only bounded.
            i = 0
            deadline = time.monotonic() + 50
            while (i < 50 or not seen) and time.monotonic() < deadline:
                i += 1
                Finalized()
                made.append(
                    c.StandIn(
                        make_worker(), 1, f"m{i}", 10, "cuda", "cpu", pool=pool
                    )
                )
        finally:
            gc.set_threshold(*old)

    t = threading.Thread(target=construct, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "deadlocked on the pool's lock"
    assert len(made) >= 50 and seen, "no finalizer ran in 50 s"


def test_the_registration_stamp_is_never_earlier_than_the_registration(
    impl, pool, make_worker
):
    """A board reading wins over the receipt only when newer: a reading
    published before a stand-in was made must read as older than its
    registration.  So the registration stamp is the precise monotonic
    clock: a coarse one lags by up to a tick (4 ms), and the differential
    referee caught a board value winning over a newer registration so."""
    for i in range(50):
        t0 = time.monotonic_ns()
        s = impl.StandIn(make_worker(), 1, f"m{i}", 10, "cuda:0", "cpu",
                         pool=pool)
        age = s.receipt()[2]
        t1 = time.monotonic_ns()
        assert s.receipt()[3] == "registered"
        assert age <= (t1 - t0) / 1e9 + 1e-9, (i, age, (t1 - t0) / 1e9)


def test_bad_replies_are_the_models_count(impl, pool, make_worker):
    """Two stand-ins of one model on one worker share its receipt, its
    deferral and its count of bad replies (the differential referee found
    the reference counting per stand-in)."""
    worker = make_worker()
    a = impl.StandIn(worker, 1, "m", 1000, "cuda:0", "cpu", pool=pool)
    b = impl.StandIn(worker, 1, "m", 1000, "cuda:0", "cpu", pool=pool)
    worker.send_command = lambda command, **kw: {"loaded": "garbage"}
    with pytest.raises(impl.EchoError):
        a.partially_load("cuda:0", 100)
    assert (a.bad_replies, b.bad_replies) == (1, 1)
    other = impl.StandIn(worker, 1, "n", 1000, "cuda:0", "cpu", pool=pool)
    assert other.bad_replies == 0
