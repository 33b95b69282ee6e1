"""A Pool used without comfy-env does what comfy-env 0.4.46's pool does:
the published reserve reaches comfy-aimdo's pager headroom, and pressure
makes idle workers give VRAM back, from a thread, debounced.

comfy-aimdo and ComfyUI's ``comfy.memory_management`` are fakes put into
``sys.modules``; the workers are tests/fakes.py's.
"""

from __future__ import annotations

import sys
import threading
import types

import fakes
import pytest

from mock_fixtures import mock_mm as _mm

GiB = _mm.GiB
MiB = _mm.MiB
CPU = _mm.CPU


@pytest.fixture
def aimdo(monkeypatch):
    """A pager that is on, with comfy-aimdo's module-level setter."""
    written = []
    control = types.ModuleType("comfy_aimdo.control")
    control.set_simple_vram_headroom = written.append
    package = types.ModuleType("comfy_aimdo")
    package.control = control
    cmm = types.ModuleType("comfy.memory_management")
    cmm.aimdo_enabled = True
    monkeypatch.setitem(sys.modules, "comfy_aimdo", package)
    monkeypatch.setitem(sys.modules, "comfy_aimdo.control", control)
    monkeypatch.setitem(sys.modules, "comfy.memory_management", cmm)
    return types.SimpleNamespace(written=written, control=control, cmm=cmm)


def charged_pool(impl, process_local):
    pool = impl.Pool(floor=300 * MiB, process_local=process_local)
    w = fakes.FakeWorker("w")
    w.add_model("m", 6 * GiB, resident=6 * GiB)
    s = impl.StandIn(w, 1, "m", 6 * GiB, "cuda:0", "cpu", pool=pool)
    impl.apply_residency({"m": s}, w.census())
    return pool, s


def test_reserve_is_published_and_forwarded(impl, mm, aimdo):
    pool, s = charged_pool(impl, process_local=True)
    value = pool.publish_reserve(mm, total=24 * GiB)
    # base 400 MiB + the worker's 6 GiB + 300 MiB floor
    assert value == 400 * MiB + 6 * GiB + 300 * MiB
    assert mm.EXTRA_RESERVED_VRAM == value
    # the pager gets its seed plus what the pool added, not the base again
    assert aimdo.written == [256 * MiB + 6 * GiB + 300 * MiB]
    # unchanged: nothing written again; the base is not re-read
    assert pool.publish_reserve(mm, total=24 * GiB) == value
    assert aimdo.written == [256 * MiB + 6 * GiB + 300 * MiB]


def test_linux_forwards_the_seed_only(impl, mm, aimdo):
    pool, s = charged_pool(impl, process_local=False)
    assert pool.publish_reserve(mm) == 400 * MiB
    assert aimdo.written == [256 * MiB]


def test_reserve_vram_seeds_the_headroom(impl, mm, aimdo, monkeypatch):
    cli_args = types.ModuleType("comfy.cli_args")
    cli_args.args = types.SimpleNamespace(reserve_vram=1.5)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", cli_args)
    pool, s = charged_pool(impl, process_local=False)
    pool.publish_reserve(mm)
    assert aimdo.written == [int(1.5 * GiB)]


def test_older_aimdo_exports_only_the_c_symbol(impl, mm, aimdo):
    written = []
    del aimdo.control.set_simple_vram_headroom
    aimdo.control.lib = types.SimpleNamespace(
        set_simple_vram_headroom=written.append)
    pool, s = charged_pool(impl, process_local=False)
    pool.publish_reserve(mm)
    assert written == [256 * MiB]


def test_pager_off_or_absent_forwards_nothing(impl, mm, aimdo, monkeypatch):
    aimdo.cmm.aimdo_enabled = False
    pool, s = charged_pool(impl, process_local=True)
    pool.publish_reserve(mm, total=24 * GiB)
    assert aimdo.written == []
    monkeypatch.delitem(sys.modules, "comfy_aimdo.control")
    monkeypatch.setitem(sys.modules, "comfy_aimdo", None)  # not importable
    aimdo.cmm.aimdo_enabled = True
    pool2, s2 = charged_pool(impl, process_local=True)
    assert pool2.publish_reserve(mm, total=24 * GiB) > 400 * MiB


class ImportSpy:
    """A meta-path finder that records every module the import system is
    asked to find, and finds none."""

    def __init__(self):
        self.asked = []

    def find_spec(self, name, path=None, target=None):
        self.asked.append(name)
        return None


def test_publish_imports_nothing(impl, mm, monkeypatch):
    # Outside ComfyUI (or before it imported them) comfy.memory_management,
    # comfy.cli_args and comfy_aimdo are absent: publishing must not try to
    # import them.  A failed import scans sys.path on every boundary and
    # allocates as it fails (a leak check saw 35 B per call), and importing
    # comfy.cli_args would parse this process's argv.
    for name in ("comfy.memory_management", "comfy.cli_args",
                 "comfy_aimdo", "comfy_aimdo.control"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spy = ImportSpy()
    monkeypatch.setattr(sys, "meta_path", [spy, *sys.meta_path])
    pool, s = charged_pool(impl, process_local=True)
    for _ in range(3):
        assert pool.publish_reserve(mm, total=24 * GiB) > 400 * MiB
    assert spy.asked == []
    assert "comfy.cli_args" not in sys.modules


def test_a_broken_pager_module_forwards_nothing(impl, mm, aimdo):
    class Exploding(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("half-imported")

    sys.modules["comfy_aimdo.control"] = Exploding("comfy_aimdo.control")
    pool, s = charged_pool(impl, process_local=False)
    assert pool.publish_reserve(mm) == 400 * MiB
    assert aimdo.written == []


def test_a_failing_setter_never_fails_the_boundary(impl, mm, aimdo):
    def broken(value):
        raise OSError("pager gone")

    aimdo.control.set_simple_vram_headroom = broken
    pool, s = charged_pool(impl, process_local=False)
    assert pool.publish_reserve(mm) == 400 * MiB


class ReleasingWorker(fakes.FakeWorker):
    """A comfy-env-like worker advertising the release commands; records
    the thread each command arrives on."""

    supports_partial_release = True
    supports_release_pins = True

    def __init__(self, name, give_back):
        super().__init__(name)
        self.give_back = give_back
        self.asks = []
        self.arrived = threading.Event()

    def send_command_no_spawn(self, command, size, lock_timeout):
        self.asks.append((command, size, threading.current_thread().name,
                          lock_timeout))
        self.arrived.set()
        if command == "partial_release":
            return {"receipt": {"freed_bytes": min(size, self.give_back)}}
        return {"receipt": {"pinned_before": size, "pinned_after": 0}}


def test_pressure_asks_idle_workers_from_a_thread(impl, mm):
    pool = impl.Pool(floor=0, process_local=False)
    pool.release_idle_on_pressure(debounce=3600)
    # the evicted one: its worker frees less than asked
    short = fakes.FakeWorker("short")
    short.add_model("a", 4 * GiB, resident=4 * GiB)
    short.unload_cap = 1 * GiB
    a = impl.StandIn(short, 1, "a", 4 * GiB, "cuda:0", "cpu", pool=pool)
    impl.apply_residency({"a": a}, short.census())
    # an idle sibling holding 3 GiB and 1 GiB pinned; a busy one
    idle = ReleasingWorker("idle", give_back=2 * GiB)
    idle.add_model("b", 3 * GiB, resident=3 * GiB)
    b = impl.StandIn(idle, 1, "b", 3 * GiB, "cuda:0", "cpu", pool=pool)
    impl.apply_residency({"b": b}, idle.census())
    pool.report(idle, {"pinned": 1 * GiB})
    busy = ReleasingWorker("busy", give_back=9 * GiB)
    busy.add_model("c", 8 * GiB, resident=8 * GiB)
    c = impl.StandIn(busy, 1, "c", 8 * GiB, "cuda:0", "cpu", pool=pool)
    impl.apply_residency({"c": c}, busy.census())
    pool.begin_call(busy)

    assert a.partially_unload("cpu", 3 * GiB) == 1 * GiB
    thread = pool._pressure_thread
    assert thread is not None and thread is not threading.current_thread()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert busy.asks == []  # mid call: never asked
    # short still holds 3 GiB; the idle sibling is asked for the shortfall
    # (2 GiB, all it can be asked is its 3), then for its pinned bytes
    assert [(cmd, size) for cmd, size, _, _ in idle.asks] == [
        ("partial_release", 2 * GiB),
        ("release_pins", 1 * GiB),
    ]
    assert {name for _, _, name, _ in idle.asks} == {"comfy-standin-pressure"}
    assert {t for _, _, _, t in idle.asks} == {2.0}

    # debounced: a second notice within the window asks nobody
    idle.asks.clear()
    assert a.partially_unload("cpu", 3 * GiB) == 1 * GiB
    assert pool._pressure_thread is thread
    assert idle.asks == []
    pool.end_call(busy)


def test_pressure_without_debounce_asks_each_time(impl, mm):
    pool = impl.Pool(floor=0, process_local=False)
    pool.release_idle_on_pressure(debounce=0)
    idle = ReleasingWorker("idle", give_back=1 * GiB)
    idle.add_model("b", 3 * GiB, resident=3 * GiB)
    b = impl.StandIn(idle, 1, "b", 3 * GiB, "cuda:0", "cpu", pool=pool)
    impl.apply_residency({"b": b}, idle.census())
    for _ in range(2):
        pool.on_pressure(5 * GiB)
        pool._pressure_thread.join(timeout=60)
    assert [cmd for cmd, *_ in idle.asks] == ["partial_release"] * 2


def test_pressure_ask_failures_are_swallowed(impl, mm):
    class Refusing(ReleasingWorker):
        def send_command_no_spawn(self, command, size, lock_timeout):
            super().send_command_no_spawn(command, size, lock_timeout)
            raise ConnectionError("worker went away")

    pool = impl.Pool(floor=0, process_local=False)
    pool.release_idle_on_pressure(debounce=0)
    w = Refusing("r", give_back=0)
    w.add_model("b", 3 * GiB, resident=3 * GiB)
    b = impl.StandIn(w, 1, "b", 3 * GiB, "cuda:0", "cpu", pool=pool)
    impl.apply_residency({"b": b}, w.census())
    assert pool._ask_idle_workers(1 * GiB) == 0
    assert [cmd for cmd, *_ in w.asks] == ["partial_release"]
