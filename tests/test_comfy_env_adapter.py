"""The opt-in comfy-env adapter, against comfy-env from PyPI.

comfy-env imports ``comfy.model_management``; the mock in tests/mockcomfy
stands in for it (conftest puts it on sys.path).  The adapter swaps the
C stand-in into comfy-env; these tests then drive comfy-env's own code
(its registration at a node boundary, its state_sync calls, its held-bytes
arithmetic) and check what ComfyUI's list ends up holding.
"""

from __future__ import annotations

import importlib

import fakes
import pytest

import comfy_standin as cs
from comfy_standin.integrations import comfy_env as adapter

# Every test here needs comfy-env ('.[test]' installs it): missing, each
# fails (conftest says why), never skips; -m "not comfy_env" leaves them
# out, and this module still imports without it.
pytestmark = pytest.mark.comfy_env


@pytest.fixture(autouse=True)
def _comfy_env_modules():
    """comfy-env's modules under the names the tests use, imported when
    a test runs (not when the file is collected)."""
    global comfy_env_pool, model_patcher, state_sync
    comfy_env_pool = importlib.import_module("comfy_env.isolation.pool")
    model_patcher = importlib.import_module(
        "comfy_env.isolation.model_patcher")
    state_sync = importlib.import_module("comfy_env.state_sync")

GiB = 1 << 30


@pytest.fixture
def installed(mm):
    originals = (
        model_patcher.SubprocessModelPatcher,
        state_sync.apply_echo,
        state_sync.apply_residency,
        state_sync.apply_peak_raise,
    )
    assert adapter.install() is True
    yield
    adapter.uninstall()
    assert (
        model_patcher.SubprocessModelPatcher,
        state_sync.apply_echo,
        state_sync.apply_residency,
        state_sync.apply_peak_raise,
    ) == originals
    comfy_env_pool._WORKER_PATCHERS.clear()
    comfy_env_pool._STALE_PATCHERS.clear()


def make(worker, model_id="unet-0", size=4 * GiB, pool=None):
    # comfy-env's keywords, exactly as its pool passes them.
    return model_patcher.SubprocessModelPatcher(
        worker=worker,
        worker_generation=1,
        model_id=model_id,
        model_size=size,
        load_device="cuda:0",
        offload_device="cpu",
        kind="unet",
        pool=pool,
    )


def test_install_swaps_and_uninstall_restores(installed):
    assert adapter.installed()
    assert model_patcher.SubprocessModelPatcher is cs.StandIn
    assert state_sync.apply_echo.__wrapped__ is not None
    assert adapter.install() is True  # idempotent


def test_not_installed_is_comfy_envs_own():
    assert not adapter.installed()
    assert model_patcher.SubprocessModelPatcher is not cs.StandIn


def test_comfy_env_registration_at_a_node_boundary(installed, mm):
    """comfy-env's own _register_new_patchers builds our stand-in and puts
    it into (mock) ComfyUI's list, unused, with a finalizer."""
    worker = fakes.FakeWorker("w")
    worker.add_model("unet-0", 2 * GiB, resident=2 * GiB)
    worker._last_new_models = [
        {"id": "unet-0", "size": 2 * GiB, "kind": "unet", "device": "cuda:0"}
    ]
    comfy_env_pool._register_new_patchers("/env/a", worker, 1)
    entries = [e for e in mm.current_loaded_models if e.model is not None]
    assert len(entries) == 1
    s = entries[0].model
    assert isinstance(s, cs.StandIn)
    assert s.model_id == "unet-0" and s.size == 2 * GiB
    assert entries[0].currently_used is False
    assert entries[0].model_finalizer is not None
    # comfy-env assigned the registration receipt through the inner module
    assert s.loaded_size() == 2 * GiB
    assert s.receipt()[3] == "assigned"
    # and ComfyUI can evict it through the worker
    freed = s.partially_unload("cpu", 1 * GiB)
    assert freed == 1 * GiB
    assert s.loaded_size() == 1 * GiB


def test_comfy_env_echo_goes_to_the_ledger(installed):
    worker = fakes.FakeWorker("w")
    s = make(worker, pool=cs.Pool(floor=0))
    state_sync.apply_echo(s, 3 * GiB, seq=4, in_flight=True)
    assert s.receipt()[:2] == (3 * GiB, 4)
    assert s._residency_seq == 4 and s._residency_peak == 3 * GiB
    # comfy-env's contract: clamps and never raises
    state_sync.apply_echo(s, 99 * GiB, seq=5)
    assert s.loaded_size() == s.size
    state_sync.apply_echo(s, -7, seq=6)
    assert s.loaded_size() == 0
    state_sync.apply_echo(s, 1 * GiB, seq="garbage")
    assert s.loaded_size() == 0 and s._residency_seq == 6
    state_sync.apply_echo(s, 5, unmapped=True, seq=7)
    assert s.loaded_size() == 0 and s._residency_peak == 0
    # comfy-env's admission view reads the C ledger through the compat names
    state_sync.apply_echo(s, 2 * GiB, seq=8)
    assert state_sync.held_ceiling(s) == 2 * GiB
    assert state_sync.held_charge(s, in_flight=True) == s.size


def test_comfy_env_census_is_lenient_per_entry(installed):
    worker = fakes.FakeWorker("w")
    pool = cs.Pool(floor=0)
    a = make(worker, "a", pool=pool)
    b = make(worker, "b", pool=pool)
    changed = state_sync.apply_residency(
        {"a": a, "b": b},
        [
            {"id": "a", "seq": 3, "resident": 1 * GiB},
            {"id": "b", "seq": 3, "resident": -1},  # bad: skipped alone
            {"id": "zzz", "seq": 1, "resident": 5},  # unknown: ignored
        ],
    )
    assert changed == ["a"]
    assert a.receipt()[:2] == (1 * GiB, 3)
    assert b.receipt()[:2] == (0, None)
    # a strictly older seq is dropped; the tie goes to the census
    assert state_sync.apply_residency(
        {"a": a}, [{"id": "a", "seq": 2, "resident": 7}]
    ) == []
    assert state_sync.apply_residency(
        {"a": a}, [{"id": "a", "seq": 3, "resident": 7}]
    ) == ["a"]


def test_comfy_env_peak_raise(installed):
    worker = fakes.FakeWorker("w")
    s = make(worker, pool=cs.Pool(floor=0))
    state_sync.apply_echo(s, 1 * GiB, seq=1)
    state_sync.apply_peak_raise({"unet-0": s}, [{"id": "unet-0",
                                                 "resident": 3 * GiB}])
    assert s._residency_peak == 3 * GiB
    assert s.loaded_size() == 1 * GiB  # the receipt is untouched
    state_sync.apply_peak_raise({"unet-0": s}, [{"id": "unet-0",
                                                 "resident": 1}])
    assert s._residency_peak == 3 * GiB  # never lowers


def test_adapter_passes_comfy_envs_own_patchers_through(installed):
    """A stand-in created before install() stays comfy-env's and keeps
    comfy-env's own state sync."""
    worker = fakes.FakeWorker("w")
    theirs = adapter._originals[
        ("comfy_env.isolation.model_patcher", "SubprocessModelPatcher")
    ](worker=worker, worker_generation=1, model_id="old", model_size=100,
      load_device="cuda:0", offload_device="cpu")
    state_sync.apply_echo(theirs, 40, seq=2)
    assert theirs.model.model_loaded_weight_memory == 40
    changed = state_sync.apply_residency(
        {"old": theirs}, [{"id": "old", "seq": 3, "resident": 60}]
    )
    assert changed == ["old"]
    assert theirs.model.model_loaded_weight_memory == 60
