"""comfy_standin._core.probe() against scripted stub libraries.

No GPU needed: the suite compiles stand-ins for libcuda.so.1 and
libnvidia-ml.so.1 (tests/c/stubs/) into a temporary directory and points
COMFY_STANDIN_LIBCUDA / COMFY_STANDIN_LIBNVML at them.  Every probe runs in
a fresh interpreter, because the libraries are loaded once per process
(and the environment is read then).  The stubs count the calls a probe must
never make (context creation, nvmlShutdown), and the tests read those
counts from the same process through ctypes.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cbuild import build_stub

GiB = 1 << 30

# The subprocess: probe (several times, so the once-guard is exercised),
# then report the result and the stubs' counters.
RUNNER = textwrap.dedent(
    """
    import ctypes, os, sys
    {before}
    from comfy_standin import _core
    results = [_core.probe() for _ in range({calls})]
    counts = {{}}
    for kind, path, names in (
        ("cuda", os.environ.get("CS_TEST_STUB_CUDA"),
         ("cuInit", "cuGetProcAddress", "cuGetProcAddress.version",
          "cuCtxCreate", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
          "cuCtxPushCurrent", "cuMemGetInfo", "cuDeviceTotalMem.v1")),
        ("nvml", os.environ.get("CS_TEST_STUB_NVML"),
         ("nvmlInit", "nvmlShutdown",
          "nvmlDeviceGetComputeRunningProcesses")),
    ):
        if not path:
            continue
        try:
            # RTLD_NOLOAD: read the copy the probe loaded, load no other.
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            counts[kind] = None  # the probe never loaded it
            continue
        fn = getattr(lib, "stub_%s_count" % kind)
        fn.argtypes = [ctypes.c_char_p]
        fn.restype = ctypes.c_long
        counts[kind] = {{n: fn(n.encode()) for n in names}}
    {after}
    print(repr({{"results": results, "counts": counts}}))
    """
)


@pytest.fixture(scope="session")
def stubs(tmp_path_factory):
    """Builds stub variants on demand: stubs(kind, *defines) -> path."""
    root = tmp_path_factory.mktemp("probe-stubs")
    built: dict[tuple[str, tuple[str, ...]], Path] = {}

    def get(kind: str, *defines: str) -> Path:
        key = (kind, defines)
        if key not in built:
            directory = root / f"{kind}-{len(built)}"
            built[key] = build_stub(kind, directory, defines)
        return built[key]

    return get


def clean_environment() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COMFY_STANDIN_", "CS_STUB_", "CS_TEST_STUB"))
    }
    return env


def run_probe(
    tmp_path: Path,
    script: str = "",
    *,
    cuda: Path | str | None = None,
    nvml: Path | str | None = None,
    env: dict[str, str] | None = None,
    calls: int = 2,
    before: str = "",
    after: str = "",
) -> dict:
    """Runs the probe in a fresh interpreter; returns {"result", "results",
    "counts"}.  cuda/nvml: stub paths for the override variables (None:
    leave the variable unset)."""
    script_path = tmp_path / "gpu-script.txt"
    script_path.write_text(textwrap.dedent(script))
    environment = clean_environment()
    environment["CS_STUB_SCRIPT"] = str(script_path)
    if cuda is not None:
        environment["COMFY_STANDIN_LIBCUDA"] = str(cuda)
        environment["CS_TEST_STUB_CUDA"] = str(cuda)
    if nvml is not None:
        environment["COMFY_STANDIN_LIBNVML"] = str(nvml)
        environment["CS_TEST_STUB_NVML"] = str(nvml)
    environment.update(env or {})
    code = RUNNER.format(before=before, after=after, calls=calls)
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    out = ast.literal_eval(completed.stdout.strip().splitlines()[-1])
    results = out["results"]
    for later in results[1:]:
        assert without_clock(later) == without_clock(results[0])
    out["result"] = results[-1]
    return out


def without_clock(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "elapsed_ns"}


TWO_DEVICES = """
    devices 2
    name 0 Stub Zero 24G
    name 1 Stub One 8G
    total 0 25769803776
    free 0 20000000000
    total 1 8589934592
    free 1 1000
    proc 0 1234 1048576
    proc 0 42 na
    proc 1 777 5368709120
    driver_version 12040
"""


# ---- the full picture --------------------------------------------------


def test_every_field_from_both_libraries(tmp_path, stubs):
    # CUDA ordinals reversed against NVML's order: devices must be matched
    # by UUID, and `index` is the CUDA ordinal (torch's cuda:N).
    out = run_probe(
        tmp_path,
        TWO_DEVICES + "cuda_devices 1 0\n",
        cuda=stubs("cuda"),
        nvml=stubs("nvml"),
    )
    result = out["result"]
    assert set(result) == {
        "cuda", "nvml", "devices", "devices_truncated", "elapsed_ns"
    }
    assert result["cuda"] == {
        "loaded": True,
        "error": None,
        "path": str(stubs("cuda")),
        "driver_version": 12040,
        "preloaded": False,
    }
    assert result["nvml"] == {
        "loaded": True,
        "error": None,
        "path": str(stubs("nvml")),
        "driver_version": 12040,
        "preloaded": False,
    }
    assert result["devices_truncated"] is False
    # A duration field, checked for type only (speed lives in bench/).
    clock = result["elapsed_ns"]
    assert type(clock) is int and clock >= 0
    assert result["devices"] == [
        {
            "index": 0,
            "nvml_index": 1,
            "name": "Stub One 8G",
            "uuid": "GPU-00000000-0000-0000-0000-000000000002",
            "total": 8 * GiB,
            "free": 1000,
            "processes": {777: 5 * GiB},
            "processes_truncated": False,
            "processes_error": None,
            "process_entry_size": 24,
            "source": "nvml",
            "error": None,
        },
        {
            "index": 1,
            "nvml_index": 0,
            "name": "Stub Zero 24G",
            "uuid": "GPU-00000000-0000-0000-0000-000000000001",
            "total": 24 * GiB,
            "free": 20000000000,
            # NVML_VALUE_NOT_AVAILABLE reads as None, not 2**64-1.
            "processes": {1234: 1 << 20, 42: None},
            "processes_truncated": False,
            "processes_error": None,
            "process_entry_size": 24,
            "source": "nvml",
            "error": None,
        },
    ]


def test_no_context_is_created_and_libraries_load_once(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda"), nvml=stubs("nvml"),
        calls=5,
    )
    cuda = out["counts"]["cuda"]
    for creating in (
        "cuCtxCreate", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
        "cuCtxPushCurrent",
    ):
        assert cuda[creating] == 0, creating
    # No context is current, so the context-bound free figure is not read.
    assert cuda["cuMemGetInfo"] == 0
    # Once per process, however many calls.
    assert cuda["cuInit"] == 1
    nvml = out["counts"]["nvml"]
    assert nvml["nvmlInit"] == 1
    assert nvml["nvmlShutdown"] == 0
    # Two devices, five calls: the process list is read every call.
    assert nvml["nvmlDeviceGetComputeRunningProcesses"] == 10


def test_cuda_symbols_resolved_at_the_pinned_abi(tmp_path, stubs):
    # NVML absent: totals come from cuDeviceTotalMem.  The stub hands out
    # a 32-bit variant to anyone asking for an old ABI, so a wrong pin
    # would read 24 GiB as 0.
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda"),
        nvml=tmp_path / "absent" / "libnvidia-ml.so.1",
    )
    cuda = out["counts"]["cuda"]
    assert cuda["cuGetProcAddress.version"] == 11030
    assert cuda["cuDeviceTotalMem.v1"] == 0
    devices = out["result"]["devices"]
    assert [d["total"] for d in devices] == [24 * GiB, 8 * GiB]
    assert [d["source"] for d in devices] == ["cuda", "cuda"]
    assert [d["free"] for d in devices] == [None, None]
    assert [d["processes"] for d in devices] == [None, None]
    # NVML's absence is said once, in result["nvml"]["error"].
    assert [d["error"] for d in devices] == [None, None]


def test_without_cuGetProcAddress_versioned_names_are_used(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES,
        cuda=stubs("cuda", "STUB_NO_GET_PROC_ADDRESS"),
        nvml=tmp_path / "absent" / "libnvidia-ml.so.1",
    )
    result = out["result"]
    assert result["cuda"]["loaded"] is True
    assert out["counts"]["cuda"]["cuDeviceTotalMem.v1"] == 0
    assert [d["total"] for d in result["devices"]] == [24 * GiB, 8 * GiB]
    assert [d["name"] for d in result["devices"]] == [
        "Stub Zero 24G", "Stub One 8G"
    ]


def test_current_context_gives_cuda_free_for_its_device_only(
    tmp_path, stubs
):
    script = TWO_DEVICES + "ctx_current 1\nctx_free 1 4242\n"
    out = run_probe(
        tmp_path, script, cuda=stubs("cuda"),
        nvml=tmp_path / "absent" / "libnvidia-ml.so.1", calls=3,
    )
    devices = out["result"]["devices"]
    assert devices[0]["free"] is None
    assert devices[0]["source"] == "cuda"
    assert devices[1]["free"] == 4242
    assert devices[1]["total"] == 8 * GiB
    assert devices[1]["source"] == "cuda"
    assert out["counts"]["cuda"]["cuMemGetInfo"] == 3
    assert out["counts"]["cuda"]["cuCtxCreate"] == 0


def test_nvml_preferred_over_a_current_context(tmp_path, stubs):
    script = TWO_DEVICES + "ctx_current 0\nctx_free 0 4242\n"
    out = run_probe(
        tmp_path, script, cuda=stubs("cuda"), nvml=stubs("nvml")
    )
    assert out["result"]["devices"][0]["free"] == 20000000000
    assert out["counts"]["cuda"]["cuMemGetInfo"] == 0


def test_preloaded_libcuda_is_preferred(tmp_path, stubs):
    # No override: the probe asks for "libcuda.so.1" with RTLD_NOLOAD
    # first, which finds the stub already loaded under that soname.
    path = stubs("cuda")
    out = run_probe(
        tmp_path, TWO_DEVICES, nvml=stubs("nvml"),
        env={"CS_TEST_STUB_CUDA": str(path)},
        before=f"ctypes.CDLL({str(path)!r})",
    )
    cuda = out["result"]["cuda"]
    assert cuda["loaded"] is True
    assert cuda["preloaded"] is True
    assert cuda["path"] == str(path)
    assert out["result"]["devices"][0]["source"] == "nvml"


# ---- unavailable -------------------------------------------------------


def test_libraries_missing(tmp_path):
    cuda = tmp_path / "nowhere" / "libcuda.so.1"
    nvml = tmp_path / "nowhere" / "libnvidia-ml.so.1"
    out = run_probe(tmp_path, TWO_DEVICES, cuda=cuda, nvml=nvml)
    result = out["result"]
    for name, path in (("cuda", cuda), ("nvml", nvml)):
        library = result[name]
        assert library["loaded"] is False
        assert library["path"] is None
        assert library["driver_version"] is None
        # dlerror()'s text, naming the file and the reason.
        assert str(path) in library["error"]
        assert "No such file" in library["error"]
    assert result["devices"] == []
    assert out["counts"] == {"cuda": None, "nvml": None}


@pytest.mark.parametrize("value", ["1", "yes"])
def test_disabled(tmp_path, stubs, value):
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda"), nvml=stubs("nvml"),
        env={"COMFY_STANDIN_PROBE_DISABLE": value},
    )
    result = out["result"]
    for name in ("cuda", "nvml"):
        assert result[name]["loaded"] is False
        assert result[name]["error"] == "disabled"
        assert result[name]["path"] is None
    assert result["devices"] == []
    # Nothing was even opened.
    assert out["counts"] == {"cuda": None, "nvml": None}


@pytest.mark.parametrize("value", ["0", ""])
def test_disable_variable_off(tmp_path, stubs, value):
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda"), nvml=stubs("nvml"),
        env={"COMFY_STANDIN_PROBE_DISABLE": value},
    )
    assert out["result"]["cuda"]["loaded"] is True
    assert out["result"]["nvml"]["loaded"] is True


def test_cuInit_symbol_missing_falls_back_to_nvml(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES + "cuda_devices 1 0\n",
        cuda=stubs("cuda", "STUB_NO_INIT"), nvml=stubs("nvml"),
    )
    result = out["result"]
    assert result["cuda"]["loaded"] is False
    assert result["cuda"]["error"] == "symbol cuInit not found"
    assert result["cuda"]["path"] is None
    # NVML's own enumeration and indices.
    devices = result["devices"]
    assert [d["index"] for d in devices] == [0, 1]
    assert [d["nvml_index"] for d in devices] == [0, 1]
    assert [d["name"] for d in devices] == ["Stub Zero 24G", "Stub One 8G"]
    assert [d["total"] for d in devices] == [24 * GiB, 8 * GiB]
    assert [d["source"] for d in devices] == ["nvml", "nvml"]
    assert devices[0]["processes"] == {1234: 1 << 20, 42: None}


def test_cuInit_fails(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES + "fail cuInit 100\n",
        cuda=stubs("cuda"), nvml=stubs("nvml"),
    )
    cuda = out["result"]["cuda"]
    assert cuda["loaded"] is False
    assert cuda["error"] == "cuInit: CUDA_ERROR_NO_DEVICE (CUDA error 100)"
    assert len(out["result"]["devices"]) == 2


def test_cuDeviceGetCount_fails(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES + "fail cuDeviceGetCount 999\n",
        cuda=stubs("cuda"), nvml=stubs("nvml"),
    )
    result = out["result"]
    assert result["cuda"]["loaded"] is True
    assert result["cuda"]["error"] == (
        "cuDeviceGetCount: CUDA_ERROR_UNKNOWN (CUDA error 999)"
    )
    assert [d["nvml_index"] for d in result["devices"]] == [0, 1]


def test_nvml_init_symbol_missing(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda"),
        nvml=stubs("nvml", "STUB_NO_INIT"),
    )
    result = out["result"]
    assert result["nvml"]["loaded"] is False
    assert result["nvml"]["error"] == "symbol nvmlInit_v2 not found"
    assert [d["source"] for d in result["devices"]] == ["cuda", "cuda"]
    assert [d["free"] for d in result["devices"]] == [None, None]


def test_nvml_init_fails(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES + "fail nvmlInit 9\n",
        cuda=stubs("cuda"), nvml=stubs("nvml"),
    )
    nvml = out["result"]["nvml"]
    assert nvml["loaded"] is False
    assert nvml["error"] == "nvmlInit_v2: Driver Not Loaded (NVML error 9)"
    assert out["counts"]["nvml"]["nvmlShutdown"] == 0


def test_cuda_uuid_missing_cannot_match(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda", "STUB_NO_UUID"),
        nvml=stubs("nvml"),
    )
    devices = out["result"]["devices"]
    assert [d["uuid"] for d in devices] == [None, None]
    assert [d["source"] for d in devices] == ["cuda", "cuda"]
    assert devices[0]["error"].startswith("no UUID from the CUDA driver")


@pytest.mark.parametrize("uuid", [
    # A MIG device's UUID in the format older drivers give: 48 characters
    # and its NUL, one byte beyond the 48 the probe once passed NVML.
    "MIG-GPU-5e0e2aef-9f37-e6a2-1f55-b6b2b7b5a1c1/7/0",
    # The longest NVML_DEVICE_UUID_V2_BUFFER_SIZE (96) holds.
    "GPU-" + "a" * 91,
])
def test_nvml_uuids_up_to_the_v2_buffer_size_are_read_whole(
    tmp_path, stubs, uuid
):
    """NVML documents 96 bytes (NVML_DEVICE_UUID_V2_BUFFER_SIZE) as always
    enough for nvmlDeviceGetUUID and answers INSUFFICIENT_SIZE to less;
    the probe passes 96.  With no CUDA driver NVML's UUID is the device's
    own, shown as it is."""
    out = run_probe(
        tmp_path, TWO_DEVICES + f"nvml_uuid 1 {uuid}\n",
        cuda=tmp_path / "no-such-libcuda.so.1", nvml=stubs("nvml"),
    )
    devices = out["result"]["devices"]
    assert [d["source"] for d in devices] == ["nvml", "nvml"]
    assert devices[1]["uuid"] == uuid
    assert devices[1]["error"] is None
    assert devices[0]["uuid"] == "GPU-00000000-0000-0000-0000-000000000001"


# ---- per-call failures -------------------------------------------------


def test_memory_info_fails(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES + "fail nvmlDeviceGetMemoryInfo 4\n",
        cuda=stubs("cuda"), nvml=stubs("nvml"),
    )
    device = out["result"]["devices"][0]
    assert device["free"] is None
    assert device["total"] == 24 * GiB  # from the driver
    assert device["source"] == "cuda"
    assert device["error"] == (
        "nvmlDeviceGetMemoryInfo: Insufficient Permissions (NVML error 4)"
    )
    assert device["processes"] == {1234: 1 << 20, 42: None}


def test_memory_info_symbol_missing(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda"),
        nvml=stubs("nvml", "STUB_NO_MEMORY_INFO"),
    )
    device = out["result"]["devices"][0]
    assert device["free"] is None
    assert device["error"] == "symbol nvmlDeviceGetMemoryInfo not found"


def test_process_list_fails(tmp_path, stubs):
    out = run_probe(
        tmp_path,
        TWO_DEVICES + "fail nvmlDeviceGetComputeRunningProcesses 3\n",
        cuda=stubs("cuda"), nvml=stubs("nvml"),
    )
    device = out["result"]["devices"][0]
    assert device["processes"] is None  # unknown, not "nothing running"
    assert device["free"] == 20000000000
    assert device["error"] == (
        "nvmlDeviceGetComputeRunningProcesses_v3: Not Supported "
        "(NVML error 3)"
    )


def test_device_name_fails_falls_back_to_nvml_name(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES + "fail cuDeviceGetName 999\n",
        cuda=stubs("cuda"), nvml=stubs("nvml"),
    )
    device = out["result"]["devices"][0]
    assert device["name"] == "Stub Zero 24G"
    assert device["error"] == (
        "cuDeviceGetName: CUDA_ERROR_UNKNOWN (CUDA error 999)"
    )
    assert device["free"] == 20000000000


def test_cuCtxGetCurrent_fails(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES + "fail cuCtxGetCurrent 999\n",
        cuda=stubs("cuda"), nvml=stubs("nvml"),
    )
    result = out["result"]
    assert result["cuda"]["loaded"] is True
    assert result["cuda"]["error"] == (
        "cuCtxGetCurrent: CUDA_ERROR_UNKNOWN (CUDA error 999)"
    )
    assert result["devices"][0]["free"] == 20000000000


# ---- the process list --------------------------------------------------


@pytest.mark.parametrize(
    "variant, symbol",
    [
        ((), "v3"),
        (("STUB_NO_PROCESSES_V3",), "v2"),
        (("STUB_NO_PROCESSES_V3", "STUB_NO_PROCESSES_V2"), "v1"),
    ],
)
def test_process_layouts(tmp_path, stubs, variant, symbol):
    # v1 entries are 16 bytes, v2/v3 24: reading with the wrong stride
    # scrambles pids after the first.
    script = TWO_DEVICES + "procs 1 5 9000 333\n"
    out = run_probe(
        tmp_path, script, cuda=stubs("cuda"), nvml=stubs("nvml", *variant)
    )
    assert out["result"]["devices"][1]["processes"] == {
        777: 5 * GiB, **{9000 + i: 333 for i in range(5)}
    }


def test_process_symbols_missing(tmp_path, stubs):
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda"),
        nvml=stubs("nvml", "STUB_NO_PROCESSES"),
    )
    device = out["result"]["devices"][0]
    assert device["processes"] is None
    assert device["error"] == (
        "symbol nvmlDeviceGetComputeRunningProcesses not found"
    )
    assert device["free"] == 20000000000


def test_process_buffer_grows(tmp_path, stubs):
    # More processes than the first buffer holds.
    script = TWO_DEVICES + "procs 0 100 10000 7\n"
    out = run_probe(
        tmp_path, script, cuda=stubs("cuda"), nvml=stubs("nvml"), calls=1
    )
    processes = out["result"]["devices"][0]["processes"]
    assert len(processes) == 102
    assert all(processes[10000 + i] == 7 for i in range(100))
    # Device 0: one short call and one retry; device 1: one call.
    calls = out["counts"]["nvml"]["nvmlDeviceGetComputeRunningProcesses"]
    assert calls == 3


def test_process_buffer_grows_while_processes_start(tmp_path, stubs):
    # Each short answer is followed by 60 new processes: the retry's
    # buffer must have headroom, and the loop must still end.
    script = TWO_DEVICES + "procs 0 100 10000 7\nproc_growth 60\n"
    out = run_probe(
        tmp_path, script, cuda=stubs("cuda"), nvml=stubs("nvml"), calls=1
    )
    device = out["result"]["devices"][0]
    assert device["error"] is None
    assert device["processes"] is not None
    assert len(device["processes"]) == 128  # the cap
    assert device["processes_truncated"] is True


def test_process_list_truncated(tmp_path, stubs):
    script = TWO_DEVICES + "procs 0 300 10000 7\n"
    out = run_probe(
        tmp_path, script, cuda=stubs("cuda"), nvml=stubs("nvml")
    )
    device = out["result"]["devices"][0]
    assert device["processes_truncated"] is True
    assert len(device["processes"]) == 128
    assert out["result"]["devices"][1]["processes_truncated"] is False


def test_devices_truncated(tmp_path, stubs):
    out = run_probe(
        tmp_path, "devices 20\n", cuda=stubs("cuda"), nvml=stubs("nvml")
    )
    result = out["result"]
    assert result["devices_truncated"] is True
    assert [d["index"] for d in result["devices"]] == list(range(16))


def test_devices_hidden_from_cuda_are_not_listed(tmp_path, stubs):
    # CUDA_VISIBLE_DEVICES="" in a worker: the driver sees no device, so
    # neither does the probe, although NVML sees two.
    out = run_probe(
        tmp_path, TWO_DEVICES + "cuda_devices\n", cuda=stubs("cuda"),
        nvml=stubs("nvml"),
    )
    assert out["result"]["devices"] == []
    out = run_probe(
        tmp_path, TWO_DEVICES + "cuda_devices 1\n", cuda=stubs("cuda"),
        nvml=stubs("nvml"),
    )
    devices = out["result"]["devices"]
    assert [(d["index"], d["nvml_index"]) for d in devices] == [(0, 1)]


def test_no_devices(tmp_path, stubs):
    out = run_probe(tmp_path, "", cuda=stubs("cuda"), nvml=stubs("nvml"))
    result = out["result"]
    assert result["cuda"]["loaded"] is True
    assert result["nvml"]["loaded"] is True
    assert result["devices"] == []


# ---- threads -----------------------------------------------------------


def test_concurrent_calls_agree(tmp_path, stubs):
    # Eight threads, fifty calls each, with the GIL released inside: every
    # answer equals the single-threaded one.
    after = textwrap.dedent(
        """
        import threading
        barrier = threading.Barrier(8)
        seen = []
        def work():
            barrier.wait()
            for _ in range(50):
                r = _core.probe()
                r.pop("elapsed_ns")
                seen.append(r)
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        first = dict(results[0]); first.pop("elapsed_ns")
        assert len(seen) == 400
        assert all(r == first for r in seen), "threads disagree"
        """
    )
    out = run_probe(
        tmp_path, TWO_DEVICES, cuda=stubs("cuda"), nvml=stubs("nvml"),
        calls=1, after=after,
    )
    assert out["counts"]["cuda"]["cuInit"] == 1


def test_concurrent_first_calls_race_the_once_guard(tmp_path, stubs):
    # No call before the threads: all eight race into pthread_once.
    code_runs = textwrap.dedent(
        """
        import threading, sys
        from comfy_standin import _core
        barrier = threading.Barrier(8)
        seen = []
        def work():
            barrier.wait()
            r = _core.probe(); r.pop("elapsed_ns"); seen.append(r)
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert len(seen) == 8 and all(r == seen[0] for r in seen)
        assert seen[0]["cuda"]["loaded"] and seen[0]["nvml"]["loaded"]
        assert len(seen[0]["devices"]) == 2
        print("ok")
        """
    )
    script = tmp_path / "gpu-script.txt"
    script.write_text(textwrap.dedent(TWO_DEVICES))
    env = clean_environment()
    env.update(
        CS_STUB_SCRIPT=str(script),
        COMFY_STANDIN_LIBCUDA=str(stubs("cuda")),
        COMFY_STANDIN_LIBNVML=str(stubs("nvml")),
    )
    completed = subprocess.run(
        [sys.executable, "-c", code_runs], env=env, capture_output=True,
        text=True, timeout=120, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "ok"
