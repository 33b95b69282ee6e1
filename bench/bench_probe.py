"""How cheap is comfy_standin probe()?  Calls per second, and ratios.

    python bench/bench_probe.py            # stub libraries (no GPU needed)
    python bench/bench_probe.py --real     # the machine's NVML / libcuda
    python bench/bench_probe.py --write    # also update bench/RESULTS.md

Compared, in one run and one process, on the same libraries:

- ``probe()``: the C probe (GIL released), building its result dict;
- a ctypes path: the NVML calls a pure-Python probe makes per call
  (device count, handle, memory info, process list with the grow loop),
  building the same kind of dict;
- a no-op: calling an empty Python function (the floor of any call).

With stubs, the library calls cost next to nothing, so the figures measure
the probe's own overhead (binding, result building); on a real GPU each
NVML call is a driver ioctl and dominates.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import tempfile
import textwrap
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import benchutil  # noqa: E402

SCRIPT = """\
devices 2
name 0 Stub Zero 24G
name 1 Stub One 8G
total 0 25769803776
free 0 20000000000
total 1 8589934592
free 1 1000
proc 0 1234 1048576
proc 0 4321 2097152
proc 1 777 5368709120
"""


def setup_stubs(directory: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from cbuild import build_stub  # noqa: PLC0415

    cuda = build_stub("cuda", directory / "cuda")
    nvml = build_stub("nvml", directory / "nvml")
    script = directory / "script.txt"
    script.write_text(SCRIPT)
    os.environ["CS_STUB_SCRIPT"] = str(script)
    os.environ["COMFY_STANDIN_LIBCUDA"] = str(cuda)
    os.environ["COMFY_STANDIN_LIBNVML"] = str(nvml)
    return cuda, nvml


class NvmlProcess(ctypes.Structure):
    # nvmlProcessInfo_v2_t, the layout _v3 fills.
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("used", ctypes.c_ulonglong),
        ("gpu_instance", ctypes.c_uint),
        ("compute_instance", ctypes.c_uint),
    ]


class NvmlMemory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def make_ctypes_probe(nvml_path: str):
    """What a pure-Python probe does per call, through ctypes."""
    lib = ctypes.CDLL(nvml_path)
    if lib.nvmlInit_v2() != 0:
        raise RuntimeError("nvmlInit_v2 failed")
    get_count = lib.nvmlDeviceGetCount_v2
    get_handle = lib.nvmlDeviceGetHandleByIndex_v2
    get_memory = lib.nvmlDeviceGetMemoryInfo
    get_processes = lib.nvmlDeviceGetComputeRunningProcesses_v3
    insufficient = 7

    def probe():
        count = ctypes.c_uint()
        get_count(ctypes.byref(count))
        devices = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            get_handle(index, ctypes.byref(handle))
            memory = NvmlMemory()
            get_memory(handle, ctypes.byref(memory))
            capacity = 64
            while True:
                buffer = (NvmlProcess * capacity)()
                n = ctypes.c_uint(capacity)
                rc = get_processes(handle, ctypes.byref(n), buffer)
                if rc != insufficient:
                    break
                capacity = n.value * 2
            processes = {buffer[i].pid: buffer[i].used for i in range(n.value)}
            devices.append(
                {"index": index, "total": memory.total, "free": memory.free,
                 "processes": processes}
            )
        return {"devices": devices}

    return probe


def noop():
    pass


def seconds_per_call(function, seconds: float = 0.4,
                     repeats: int = 9) -> list[float]:
    """Seconds per call in each of `repeats` rounds of about `seconds`."""
    timer = timeit.Timer(function)
    number, _ = timer.autorange()
    number = max(1, int(number * seconds / 0.2))
    return [t / number for t in timer.repeat(repeat=repeats,
                                                number=number)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true",
                        help="use the machine's NVML and libcuda")
    parser.add_argument("--write", action="store_true",
                        help="update the 'probe' section of bench/RESULTS.md")
    parser.add_argument("--rounds", type=int, default=9)
    argv = sys.argv[1:] if argv is None else argv
    arguments = parser.parse_args(argv)
    load_before = benchutil.loadavg()

    with tempfile.TemporaryDirectory() as tmp:
        if arguments.real:
            nvml_path = "libnvidia-ml.so.1"
            libraries = "the machine's NVML and CUDA driver"
        else:
            _, nvml = setup_stubs(Path(tmp))
            nvml_path = str(nvml)
            libraries = "stub libraries (tests/c/stubs), 2 devices, 3 pids"
        from comfy_standin import _core  # noqa: PLC0415

        first = _core.probe()  # loads the libraries (once per process)
        if not first["nvml"]["loaded"]:
            print(f"NVML not loaded: {first['nvml']['error']}")
            return 1
        ctypes_probe = make_ctypes_probe(nvml_path)
        ctypes_probe()

        rounds = arguments.rounds
        probe_times = seconds_per_call(_core.probe, repeats=rounds)
        ctypes_times = seconds_per_call(ctypes_probe, repeats=rounds)
        noop_times = seconds_per_call(noop, repeats=rounds)
        inside = sorted(_core.probe()["elapsed_ns"] for _ in range(1000))
        median_inside = inside[len(inside) // 2]

    rows = [
        "| call | calls/s (best round) | us per call: best (median, p90) "
        "| time / probe() time (best) |",
        "|---|---:|---:|---:|",
    ]
    probe_best = min(probe_times)
    for label, times in (
        ("`probe()`", probe_times),
        ("ctypes NVML path", ctypes_times),
        ("no-op Python call", noop_times),
    ):
        rows.append(
            f"| {label} | {1 / min(times):,.0f} | "
            f"{benchutil.spread_text([t * 1e6 for t in times], '{:.3f}')} "
            f"| {min(times) / probe_best:.4g} |"
        )
    table = "\n".join(rows)
    command = benchutil.command("bench/bench_probe.py", argv)
    load = benchutil.load_text(load_before, benchutil.loadavg())
    section = textwrap.dedent(
        f"""\
        `{command}` on {platform.python_implementation()}
        {platform.python_version()}, {platform.machine()}
        ({libraries}); {rounds} rounds each, {load}.

        TABLE

        Median time inside the C probe (`elapsed_ns`, GIL released):
        {median_inside / 1000:.2f} us; the rest of a `probe()` call is
        building the result dict.  The ctypes path makes only the NVML
        calls (no CUDA matching, no names), so it is a lower bound for a
        pure-Python probe.  With stubs every library call is nearly free:
        on a GPU the driver's ioctls dominate both paths alike.
        """
    ).replace("TABLE", table)
    print(section)
    if arguments.write:
        benchutil.write_section("probe", "## probe", section,
                                "bench/bench_probe.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
