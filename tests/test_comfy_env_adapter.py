"""The opt-in comfy-env adapter, against comfy-env from PyPI.

comfy-env imports ``comfy.model_management``; the mock in tests/mockcomfy
stands in for it (conftest puts it on sys.path).  The adapter swaps the
C stand-in into comfy-env; these tests then drive comfy-env's own code
(its registration at a node boundary, its state_sync calls, its held-bytes
arithmetic) and check what ComfyUI's list ends up holding.
"""

from __future__ import annotations

import importlib
import threading

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
    # comfy-env assigned the registration receipt through ``s.model``
    # (model_loaded_weight_memory), which is the stand-in itself
    assert s.model is s
    assert s.loaded_size() == 2 * GiB == s.model_loaded_weight_memory
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


# -- hostile frames: what a worker's _vram_report may hold --------------------

HOSTILE_ENTRIES = [
    {"id": ["unhashable"], "seq": 1, "resident": 5},
    {"id": {"a": 1}, "seq": 1, "resident": 5},
    {"id": 7, "seq": 1, "resident": 5},
    {"seq": 1, "resident": 5},
    "a string",
    5,
    None,
    ["a", 1],
    {"id": "a", "seq": "x" * 100_000, "resident": 1},
    {"id": "a", "seq": 9, "resident": "\x1b[2J" * 1000},
    {"id": "a", "seq": 9, "resident": float("nan")},
    {"id": "a", "seq": 9, "resident": True},
    {"id": "a", "seq": 9, "resident": 2**70},
    {"id": "a", "seq": -1, "resident": 1},
]


def counts():
    return adapter.counters()["census_entries_skipped"]


@pytest.fixture
def fresh_log_once(monkeypatch):
    monkeypatch.setattr(adapter, "_warned", set())


def test_a_hostile_census_never_raises_and_applies_the_valid(
        installed, fresh_log_once):
    """comfy-env's census apply as its boundary calls it (the module
    attribute), with every kind of bad entry between two valid ones."""
    worker = fakes.FakeWorker("w")
    pool = cs.Pool(floor=0)
    a = make(worker, "a", pool=pool)
    b = make(worker, "b", pool=pool)
    lines = []
    before = counts()
    census = [{"id": "a", "seq": 3, "resident": 1 * GiB}, *HOSTILE_ENTRIES,
              {"id": "b", "seq": 4, "resident": 2 * GiB}]
    changed = state_sync.apply_residency({"a": a, "b": b}, census,
                                         log=lines.append)
    assert sorted(changed) == ["a", "b"]
    assert a.receipt()[:2] == (1 * GiB, 3)
    assert b.receipt()[:2] == (2 * GiB, 4)
    assert counts() - before == len(HOSTILE_ENTRIES)
    assert len(lines) == 1 and "skipped" in lines[0]
    assert len(lines[0]) < 1000 and "\x1b" not in lines[0]
    # said once; later ones are counted only
    state_sync.apply_residency({"a": a}, HOSTILE_ENTRIES, log=lines.append)
    assert len(lines) == 1
    assert counts() - before == 2 * len(HOSTILE_ENTRIES)


@pytest.mark.parametrize("census", ["garbage", 5, {"id": "a"}, b"xx",
                                    object()])
def test_a_census_that_is_not_a_list_is_one_skip(installed, census):
    worker = fakes.FakeWorker("w")
    a = make(worker, "a", pool=cs.Pool(floor=0))
    before = counts()
    assert state_sync.apply_residency({"a": a}, census) == []
    assert counts() - before == 1
    assert a.receipt()[:2] == (0, None)


def test_hostile_entries_next_to_comfy_envs_own_patchers(installed):
    """A mixed map: comfy-env's own patcher gets the valid entries (its
    own apply raises on a non-dict entry), ours get theirs."""
    worker = fakes.FakeWorker("w")
    theirs = adapter._originals[
        ("comfy_env.isolation.model_patcher", "SubprocessModelPatcher")
    ](worker=worker, worker_generation=1, model_id="old", model_size=100,
      load_device="cuda:0", offload_device="cpu")
    a = make(worker, "a", pool=cs.Pool(floor=0))
    census = [*HOSTILE_ENTRIES, {"id": "old", "seq": 3, "resident": 60},
              {"id": "a", "seq": 3, "resident": 7}]
    changed = state_sync.apply_residency({"old": theirs, "a": a}, census)
    assert sorted(changed) == ["a", "old"]
    assert theirs.model.model_loaded_weight_memory == 60
    assert a.loaded_size() == 7


def test_comfy_envs_boundary_ingests_a_hostile_frame(installed, mm):
    """The real caller: comfy-env's _ingest_worker_frames with the
    frame a worker left on ``_last_vram_report``."""
    import threading

    worker = fakes.FakeWorker("w")
    worker._mem_lock = threading.Lock()
    a = make(worker, "a", pool=cs.Pool(floor=0))
    comfy_env_pool._WORKER_PATCHERS["/env/h"] = {"a": a}
    worker._last_vram_report = {
        "residency": [*HOSTILE_ENTRIES,
                      {"id": "a", "seq": 5, "resident": 3 * GiB}],
    }
    comfy_env_pool._ingest_worker_frames("/env/h", worker, 1)
    assert a.receipt()[:2] == (3 * GiB, 5)


def test_peak_raise_never_raises(installed):
    worker = fakes.FakeWorker("w")
    s = make(worker, pool=cs.Pool(floor=0))
    state_sync.apply_echo(s, 1 * GiB, seq=1)
    before = adapter.counters()["peak_entries_skipped"]
    for census in (5, "x", {"id": "unet-0"}, HOSTILE_ENTRIES):
        state_sync.apply_peak_raise({"unet-0": s}, census)
    state_sync.apply_peak_raise(
        {"unet-0": s},
        [*HOSTILE_ENTRIES, {"id": "unet-0", "resident": 3 * GiB}])
    assert s._residency_peak == 3 * GiB and s.loaded_size() == 1 * GiB
    assert adapter.counters()["peak_entries_skipped"] > before


def test_an_echo_of_garbage_is_ignored_in_one_bounded_line(
        installed, caplog, fresh_log_once):
    worker = fakes.FakeWorker("w")
    hostile_id = "\x1b]52;c;cHduZWQ=\x07" + "m" * 60_000
    s = make(worker, hostile_id, pool=cs.Pool(floor=0))
    before = adapter.counters()["echoes_ignored"]

    class Bad:
        def __int__(self):
            raise ValueError("\x1b[2J" * 10_000)

    with caplog.at_level("DEBUG", logger="comfy_standin"):
        for resident in (Bad(), "9" * 10_000, float("nan"), float("inf")):
            state_sync.apply_echo(s, resident, seq=1)
    assert adapter.counters()["echoes_ignored"] - before == 4
    assert s.loaded_size() == 0
    assert [r.levelname for r in caplog.records] == ["WARNING"] + \
        ["DEBUG"] * 3  # said once, then counted
    for record in caplog.records:
        text = record.getMessage()
        assert len(text) < 1000 and "\x1b" not in text and "\x07" not in text


def test_log_once_is_keyed_by_a_fixed_kind(fresh_log_once, caplog):
    """Twenty workers refusing the board, each with its own 1 MiB reason,
    as the board code reports them: one bounded line, one key."""
    with caplog.at_level("WARNING", logger="comfy_standin"):
        for i in range(20):
            reason = f"{i}:" + "\x1b[2J" + "r" * (1 << 20)
            adapter._warn_once(
                f"worker:{reason}",
                f"comfy_standin: worker w{i} does not publish a live board "
                f"({reason}); its stand-ins use receipts only")
    assert adapter._warned == {"worker"}
    (record,) = caplog.records
    text = record.getMessage()
    assert len(text) <= 1000 and "\x1b" not in text
    assert text.endswith("receipts only")


def test_warn_once_puts_worker_text_in_bounded(fresh_log_once, caplog):
    with caplog.at_level("WARNING", logger="comfy_standin"):
        adapter._warn_once("worker", "worker {name} refused ({reason})",
                           name="w\n1", reason="x" * (1 << 20))
    (record,) = caplog.records
    text = record.getMessage()
    assert text.startswith("worker w\\n1 refused (xxx") and text.endswith(")")
    assert len(text) < 400


def test_the_board_refusal_path_logs_once_per_kind(fresh_log_once, caplog):
    """_board_off is what the boundary calls when a worker refuses the
    board with its own reason."""
    import types

    class Worker:  # weak-referenceable, as comfy-env's are
        def __init__(self, name):
            self.name = name

    with caplog.at_level("WARNING", logger="comfy_standin"):
        for i in range(20):
            worker = Worker(f"w{i}")
            state = adapter._BoardState(types.SimpleNamespace(closed=True),
                                        0, 0)
            reason = f"{i}" + "z" * (1 << 20)
            adapter._board_off(worker, state, {}, f"worker:{reason}", reason)
    assert len(adapter._warned) == 1
    assert len(caplog.records) == 1
    assert len(caplog.records[0].getMessage()) <= 1000


def test_a_model_listed_again_is_named_in_one_bounded_line(installed, mm,
                                                           caplog):
    """comfy-env's boundary lists again a stand-in ComfyUI dropped while
    its worker holds it; the model id is the worker's own text."""
    hostile = "\x1b[2J" + "m" * 60_000
    worker = fakes.FakeWorker("w")
    worker.add_model(hostile, 2 * GiB, resident=2 * GiB)
    worker._last_new_models = [
        {"id": hostile, "size": 2 * GiB, "kind": "unet", "device": "cuda:0"}
    ]
    comfy_env_pool._register_new_patchers("/env/r", worker, 1)
    mm.current_loaded_models.clear()  # dropped; the weights are still there
    with caplog.at_level("INFO", logger="comfy_standin"):
        comfy_env_pool._register_new_patchers("/env/r", worker, 1)
    # (other tests' stand-ins in the default pool may be listed too)
    (record,) = [r for r in caplog.records
                 if "again" in r.getMessage() and "mmm" in r.getMessage()]
    text = record.getMessage()
    assert len(text) < 1000 and "\x1b" not in text
    assert any(e.model is not None and e.model.model_id == hostile
               for e in mm.current_loaded_models)


def test_a_frames_census_applies_to_the_stand_ins_it_creates(installed, mm):
    """comfy-env's _register_new_patchers applies the frame's census, then
    makes that frame's stand-ins at full size: the adapter applies the
    same census to them."""
    worker = fakes.FakeWorker("w")
    worker.add_model("part", 4 * GiB, resident=1 * GiB)
    worker._last_new_models = [
        {"id": "part", "size": 4 * GiB, "kind": "unet", "device": "cuda:0"}]
    worker._last_vram_report = worker.vram_report()
    worker._mem_lock = threading.Lock()  # comfy-env's census lock
    comfy_env_pool._register_new_patchers("/env/c", worker, 1)
    s = comfy_env_pool._WORKER_PATCHERS["/env/c"]["part"]
    assert type(s) is cs.StandIn
    assert s.loaded_size() == 1 * GiB and s.receipt()[3] == "census"
    # and the frame's held figure reached the pool's books
    assert cs.default_pool().charge_details()[worker]["held"] == 1 * GiB


def test_a_workers_vram_request_lists_its_models_again_first(installed, mm):
    """comfy-env's _handle_vram_budget runs ComfyUI's free_memory for a
    worker's load: a model of another worker that ComfyUI evicted once and
    that worker loaded back is listed before it, and is what it takes."""
    other = fakes.FakeWorker("other")
    other.add_model("back", 6 * GiB, resident=6 * GiB)
    other._last_new_models = [
        {"id": "back", "size": 6 * GiB, "kind": "unet", "device": "cuda:0"}]
    comfy_env_pool._register_new_patchers("/env/o", other, 1)
    s = comfy_env_pool._WORKER_PATCHERS["/env/o"]["back"]
    mm.free_memory(1e30, mm.CUDA0)
    assert other.resident("back") == 0 and s.loaded_size() == 0
    # the worker loads it back inside its own call: no registration, and
    # no boundary yet (its census arrives with the call's reply)
    other.send_command("model_partial_load", model_id="back",
                       extra_bytes=6 * GiB, device="cuda:0")
    cs.apply_residency({"back": s}, other.census())
    assert not any(e.model is s for e in mm.current_loaded_models)
    free = mm.get_free_memory(mm.CUDA0)
    comfy_env_pool._handle_vram_budget({"total_size": free},
                                       worker_key="/env/r")
    # reached: ComfyUI took what the load needed from it
    assert other.resident("back") < 6 * GiB
    assert s.loaded_size() == other.resident("back")
