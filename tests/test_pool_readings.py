"""The pool's use of the GPU probe: per-pid readings as a floor under a
worker's held figure, and the card's total as the reserve's cap."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cbuild import build_stub

GiB = 1 << 30
MiB = 1 << 20


class PidWorker:
    def __init__(self, pid):
        self.pid = pid

    def send_command(self, command, **kwargs):
        return {}

    def is_alive(self):
        return True


class PopenHolder:
    """comfy-env keeps its subprocess.Popen on ``_process``."""

    class _Popen:
        def __init__(self, pid):
            self.pid = pid

    def __init__(self, pid):
        self._process = self._Popen(pid)

    def send_command(self, command, **kwargs):
        return {}

    def is_alive(self):
        return True


def probe_result(processes_by_device):
    return {
        "devices": [
            {"index": i, "total": 24 * GiB, "free": 10 * GiB,
             "processes": processes}
            for i, processes in enumerate(processes_by_device)
        ]
    }


def test_reading_floors_held_and_says_so(impl):
    pool = impl.Pool(floor=0, process_local=True)
    w1, w2, w3 = PidWorker(101), PopenHolder(202), PidWorker(303)
    keep = [
        impl.StandIn(w, 1, f"m{i}", 8 * GiB, "cuda:0", "cpu", pool=pool)
        for i, w in enumerate((w1, w2, w3))
    ]
    pool.report(w1, {"held": 1 * GiB})
    pool.report(w2, {"held": 5 * GiB})
    readings = pool.update_readings(
        probe_result([{101: 2 * GiB, 202: 3 * GiB, 999: 7 * GiB},
                      {101: 1 * GiB, 202: None}])
    )
    # summed over devices; a hidden (None) usage is not a reading
    assert readings == {w1: 3 * GiB, w2: 3 * GiB}
    details = pool.charge_details()
    assert details[w1]["charge"] == 3 * GiB
    assert details[w1]["held_from_reading"] is True
    assert details[w1]["held"] == 1 * GiB and details[w1]["reading"] == 3 * GiB
    # the report is higher than the reading: the report stands
    assert details[w2]["charge"] == 5 * GiB
    assert details[w2]["held_from_reading"] is False
    # no reading for w3 (not in the probe): nothing changes
    assert details[w3]["reading"] == 0
    assert pool.worker_charges() == {
        w: d["charge"] for w, d in details.items()
    }
    assert len(keep) == 3


def test_readings_without_a_gpu_change_nothing(impl):
    pool = impl.Pool(floor=0)
    w = PidWorker(os.getpid())
    s = impl.StandIn(w, 1, "m", 1 * GiB, "cuda:0", "cpu", pool=pool)
    assert pool.update_readings({"devices": []}) == {}
    assert pool.charge_details()[w]["reading"] == 0
    # the real probe: whatever this machine has, no raise, and this test
    # process (not a GPU user here) gets no reading
    assert w not in pool.update_readings() or os.path.exists("/dev/nvidia0")
    assert s.loaded_size() == 0


def test_unknown_pid_is_skipped(impl):
    pool = impl.Pool(floor=0)

    class NoPid:
        def send_command(self, command, **kwargs):
            return {}

        def is_alive(self):
            return True

    w = NoPid()
    s = impl.StandIn(w, 1, "m", 1 * GiB, "cuda:0", "cpu", pool=pool)
    assert pool.update_readings(probe_result([{1: 5}])) == {}
    assert pool.update_readings(
        probe_result([{77: 5 * MiB}]), pid_of=lambda worker: 77
    ) == {w: 5 * MiB}
    assert s.stale is False


# The reserve's cap comes from the probe's total for the device, in a
# fresh process whose probe loads the stub libraries.
RESERVE = textwrap.dedent(
    """
    import comfy_standin as cs
    from comfy_standin import _reference as ref
    out = []
    for impl in (cs, ref):
        pool = impl.Pool(floor=0, process_local=True)
        class W:
            def send_command(self, c, **k): return {}
            def is_alive(self): return True
        w = W()
        s = impl.StandIn(w, 1, "m", 40 << 30, "cuda:0", "cpu", pool=pool)
        pool.begin_call(w)  # in flight: charges the full 40 GiB
        out.append((pool.reserve("cuda:0", 1 << 30),
                    pool.reserve("cuda:7", 1 << 30)))
    print(repr(out))
    """
)


@pytest.fixture(scope="module")
def stub_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-stubs")
    cuda = build_stub("cuda", root / "cuda")
    nvml = build_stub("nvml", root / "nvml")
    return root, cuda, nvml


def test_reserve_cap_from_the_probe(stub_env):
    root, cuda, nvml = stub_env
    script = root / "script.txt"
    # The stubs' script format: see tests/c/stubs/stub_script.h.
    script.write_text(
        "devices 1\n"
        "name 0 StubCard\n"
        f"total 0 {24 * GiB}\n"
        "free 0 10000000000\n"
    )
    env = dict(os.environ)
    env.update(
        COMFY_STANDIN_LIBCUDA=str(cuda),
        COMFY_STANDIN_LIBNVML=str(nvml),
        CS_STUB_SCRIPT=str(script),
    )
    out = subprocess.run(
        [sys.executable, "-c", RESERVE], env=env, capture_output=True,
        text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    results = eval(out.stdout)  # noqa: S307 (our own repr)
    cap = 24 * GiB * 3 // 4
    # cuda:0 is capped at 75% of the probed card; cuda:7 has no probed
    # total, so no cap: base + 40 GiB
    assert results == [(cap, 41 * GiB), (cap, 41 * GiB)]


# ---- "no per-process readings" -----------------------------------------


def refused(processes_error="unknown process entry layout"):
    """A device whose process list the probe could not read or refused."""
    return {"index": 0, "total": 24 * GiB, "free": 10 * GiB,
            "processes": None, "processes_truncated": False,
            "processes_error": processes_error}


def test_no_per_process_readings_leaves_the_held_figure(impl):
    pool = impl.Pool(floor=0, process_local=True)
    w = PidWorker(101)
    keep = impl.StandIn(w, 1, "m", 8 * GiB, "cuda:0", "cpu", pool=pool)
    pool.report(w, {"held": 1 * GiB})
    assert pool.update_readings(probe_result([{101: 6 * GiB}])) == {
        w: 6 * GiB
    }
    assert pool.charge_details()[w]["charge"] == 6 * GiB
    # The list is now unreadable (a layout the probe refused): the old
    # reading is no floor any more, the worker's own figure stands.
    assert pool.update_readings({"devices": [refused()]}) == {}
    details = pool.charge_details()[w]
    assert details["reading"] == 0
    assert details["held_from_reading"] is False
    assert details["charge"] == 1 * GiB
    assert keep.stale is False


def test_a_truncated_or_absent_list_is_no_reading_either(impl):
    pool = impl.Pool(floor=0)
    w = PidWorker(101)
    keep = impl.StandIn(w, 1, "m", 8 * GiB, "cuda:0", "cpu", pool=pool)
    for unreadable in (
        {"devices": [{"processes": {5: 1}, "processes_truncated": True}]},
        {"nvml": {"loaded": False}, "devices": []},
        {"devices": [{"index": 0}]},  # no "processes" at all
    ):
        pool.update_readings(probe_result([{101: 6 * GiB}]))
        assert pool.charge_details()[w]["reading"] == 6 * GiB
        assert pool.update_readings(unreadable) == {}
        assert pool.charge_details()[w]["reading"] == 0, unreadable
    assert keep.stale is False


def test_readable_devices_still_floor_beside_an_unreadable_one(impl):
    pool = impl.Pool(floor=0)
    w1, w2 = PidWorker(101), PidWorker(202)
    keep = [
        impl.StandIn(w, 1, f"m{i}", 8 * GiB, "cuda:0", "cpu", pool=pool)
        for i, w in enumerate((w1, w2))
    ]
    pool.update_readings(probe_result([{101: 1 * GiB, 202: 2 * GiB}]))
    result = probe_result([{101: 3 * GiB}])
    result["devices"].append(refused())
    # w1's bytes on the readable card are a true lower bound; w2 is on no
    # readable list: no floor.
    assert pool.update_readings(result) == {w1: 3 * GiB}
    details = pool.charge_details()
    assert details[w1]["reading"] == 3 * GiB
    assert details[w2]["reading"] == 0
    assert len(keep) == 2


# The pool on the real probe: the stub NVML writes 32-byte entries (a
# driver of the R535.54 era) for 49 processes, one of them this process;
# then a device whose entries match no layout.
REAL_PROBE = textwrap.dedent(
    """
    import os
    import comfy_standin as cs
    from comfy_standin import _reference as ref
    out = []
    for impl in (cs, ref):
        pool = impl.Pool(floor=0)
        class W:
            pid = os.getpid()
            def send_command(self, c, **k): return {}
            def is_alive(self): return True
        w = W()
        s = impl.StandIn(w, 1, "m", 40 << 30, "cuda:0", "cpu", pool=pool)
        pool.report(w, {"held": 1 << 30})
        first = pool.update_readings(pid_of=lambda worker: os.getpid())
        charge = pool.charge_details()[w]["charge"]
        # pid_of names a pid only the refused device lists
        second = dict(pool.update_readings(pid_of=lambda worker: 4242))
        out.append((first[w], charge, second,
                    pool.charge_details()[w]["reading"]))
    print(repr(out))
    """
)


def test_pool_on_a_32_byte_driver_and_a_refused_list(stub_env):
    root, cuda, nvml = stub_env
    script = root / "layouts.txt"
    lines = [
        "devices 2",
        f"total 0 {24 * GiB}", "free 0 10000000000", "proc_layout 0 32",
        "procs 0 48 70000 1048576",
        f"total 1 {24 * GiB}", "free 1 10000000000", "proc_layout 1 20",
        "proc 1 4242 1048576",
    ]
    script.write_text("\n".join(lines) + "\n")
    env = dict(os.environ)
    env.update(
        COMFY_STANDIN_LIBCUDA=str(cuda),
        COMFY_STANDIN_LIBNVML=str(nvml),
        CS_STUB_SCRIPT=str(script),
    )
    # The subprocess's own pid is unknown in advance: it adds itself.
    code = (
        "import os, pathlib\n"
        f"p = pathlib.Path({str(script)!r})\n"
        "p.write_text(p.read_text() + "
        "'proc 0 %d %d\\n' % (os.getpid(), 3 << 30))\n" + REAL_PROBE
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True,
        text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    results = eval(out.stdout)  # noqa: S307 (our own repr)
    # 3 GiB read exactly from the 32-byte list (its 49th entry) and
    # floors the 1 GiB report; then no reading from the refused list.
    assert results == [(3 * GiB, 3 * GiB, {}, 0)] * 2
