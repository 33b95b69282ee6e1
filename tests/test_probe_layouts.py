"""The probe against drivers whose process-list layout differs, and
drivers that lie.

NVML's process entries are 16, 24 or 32 bytes depending on the driver, not
on the entry point's name (R535.54-era drivers write 32 from _v3, a 16-byte
stride was reported on 550.127).  The probe measures the entry size in each
answer and cross-checks the entries; whatever it cannot measure it refuses.
Every case here must give exactly the scripted pids and bytes, or
``processes: None`` with the reason in ``processes_error`` -- never other
pids or bytes, never a crash.  The probe before the measurement read 24
bytes a step into a 1536-byte stack buffer: a 32-byte driver gave garbage
from the second process on and overflowed the stack at 49 (``test_layout``
with ``32`` crashes it).

Scripts use the stubs' directives (tests/c/stubs/stub_script.h); each probe
runs in a fresh interpreter (tests/test_probe.py's ``run_probe``).
"""

from __future__ import annotations

import os
import textwrap

import pytest

from cbuild import STUBS, compile_c
from test_probe import run_probe, stubs  # noqa: F401 (a fixture)

GiB = 1 << 30
MiB = 1 << 20
TOTAL = 24 * GiB
COUNTS = (0, 1, 3, 49, 200)


def device_lines(device: int, layout: int | None = None) -> list[str]:
    lines = [f"total {device} {TOTAL}", f"free {device} {TOTAL // 2}"]
    if layout is not None:
        lines.append(f"proc_layout {device} {layout}")
    return lines


def processes(device: int, count: int) -> dict[int, int]:
    """Distinct pids and byte counts, so a misread cannot look right."""
    return {
        100000 * (device + 1) + 7 * i + 1: (i + 1) * MiB + 4096 * i + device
        for i in range(count)
    }


def proc_lines(device: int, table: dict[int, int]) -> list[str]:
    return [f"proc {device} {pid} {used}" for pid, used in table.items()]


ENTRY_POINTS = {
    "v3": (),
    "v2": ("STUB_NO_PROCESSES_V3",),
    "v1": ("STUB_NO_PROCESSES_V3", "STUB_NO_PROCESSES_V2"),
}


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("layout", [16, 24, 32])
def test_layout(tmp_path, stubs, layout, entry_point):  # noqa: F811
    # One device per process count, all with this layout, whatever the
    # entry point's own layout is.
    lines = [f"devices {len(COUNTS)}"]
    tables = []
    for device, count in enumerate(COUNTS):
        table = processes(device, count)
        tables.append(table)
        lines += device_lines(device, layout) + proc_lines(device, table)
    out = run_probe(
        tmp_path, "\n".join(lines) + "\n", cuda=stubs("cuda"),
        nvml=stubs("nvml", *ENTRY_POINTS[entry_point]),
    )
    devices = out["result"]["devices"]
    assert len(devices) == len(COUNTS)
    for device, count, table in zip(devices, COUNTS, tables, strict=True):
        expected = dict(list(table.items())[:128])
        assert device["processes"] == expected, count
        assert device["processes_truncated"] is (count > 128)
        assert device["processes_error"] is None
        assert device["error"] is None
        assert device["process_entry_size"] == (layout if count else None)
        assert device["free"] == TOTAL // 2


def test_mig_instance_ids_and_unknown_usage(tmp_path, stubs):  # noqa: F811
    # Instance ids 0 (MIG) end the entry in zero bytes; usage "not
    # available" (all ones) in the middle of the list.
    script = "\n".join(
        ["devices 2"]
        + device_lines(0, 24) + ["proc_ids 0 0 0"]
        + proc_lines(0, {11: MiB}) + ["proc 0 12 na"]
        + device_lines(1, 32) + ["proc_ids 1 3 1"]
        + ["proc 1 13 na"] + proc_lines(1, {14: 2 * MiB, 15: 3 * MiB})
    )
    out = run_probe(
        tmp_path, script + "\n", cuda=stubs("cuda"), nvml=stubs("nvml")
    )
    devices = out["result"]["devices"]
    assert devices[0]["processes"] == {11: MiB, 12: None}
    assert devices[0]["process_entry_size"] == 24
    assert devices[1]["processes"] == {13: None, 14: 2 * MiB, 15: 3 * MiB}
    assert devices[1]["process_entry_size"] == 32


def test_a_pid_in_two_mig_instances_is_summed(tmp_path, stubs):  # noqa: F811
    script = "\n".join(
        ["devices 1", *device_lines(0, 24),
         "proc_ids 0 1 0", "proc 0 21 4096", "proc 0 22 100",
         "proc_ids 0 2 0", "proc 0 21 8192", "proc 0 23 na",
         "proc_ids 0 3 0", "proc 0 23 5"]
    )
    out = run_probe(
        tmp_path, script + "\n", cuda=stubs("cuda"), nvml=stubs("nvml")
    )
    device = out["result"]["devices"][0]
    # Summed; a hidden figure in any instance hides the sum.
    assert device["processes"] == {21: 12288, 22: 100, 23: None}
    assert device["processes_error"] is None


# (script lines for device I, the reason the probe must give)
LIES = [
    # layouts no driver has
    (["proc_layout {i} 20"] + ["proc {i} %d 4096" % p for p in (5, 6, 7)],
     "unknown process entry layout: the driver wrote 60 bytes for 3 "
     "processes (entries of 16, 24 or 32 bytes expected)"),
    (["proc_layout {i} 40", "proc {i} 5 4096"],
     "unknown process entry layout: the driver wrote 40 bytes for 1 "
     "processes (entries of 16, 24 or 32 bytes expected)"),
    # asks for more on every call
    (["proc_lie {i} grow", "proc {i} 5 4096"],
     "nvmlDeviceGetComputeRunningProcesses_v3: the list changed on each "
     "of 6 calls"),
    # writes more entries than it reports: 3 + 4 of 24 bytes
    (["proc_lie {i} overrun 4"] + ["proc {i} %d 4096" % p for p in (5, 6, 7)],
     "unknown process entry layout: the driver wrote 168 bytes for 3 "
     "processes (entries of 16, 24 or 32 bytes expected)"),
    # ... and past the capacity it was given: 64 + 4 of 32 bytes
    (["proc_layout {i} 32", "proc_lie {i} overrun 4", "procs {i} 200 5 4096"],
     "unknown process entry layout: the driver wrote 2176 bytes for 64 "
     "processes (entries of 16, 24 or 32 bytes expected)"),
    # reports more entries than the buffer holds
    (["proc_lie {i} overcount", "procs {i} 200 5 4096"],
     "nvmlDeviceGetComputeRunningProcesses_v3: reports 200 processes "
     "written into room for 64"),
    # writes fewer entries than it reports: 2 x 24 bytes look like 3 x 16,
    # and the cross-check catches it (entry 1 would end in padding the
    # driver never wrote) ...
    (["proc_lie {i} short 1"] + ["proc {i} %d 4096" % p for p in (5, 6, 7)],
     "process entry 1 of 3 is not written to its end under the 16-byte "
     "layout the driver's answer measures"),
    # ... also with MIG ids 0 ...
    (["proc_lie {i} short 1", "proc_ids {i} 0 0"]
     + ["proc {i} %d 4096" % p for p in (5, 6, 7)],
     "process entry 1 of 3 is not written to its end under the 16-byte "
     "layout the driver's answer measures"),
    # ... and 3 x 32 bytes that look like 4 x 24 (entry 1 would be pid 0)
    (["proc_layout {i} 32", "proc_lie {i} short 1"]
     + ["proc {i} %d 4096" % p for p in (5, 6, 7, 8)],
     "process entry 1 of 4 has an impossible pid under the 24-byte layout "
     "the driver's answer measures"),
    # writes entries and reports none
    (["proc_lie {i} zero"] + ["proc {i} %d 4096" % p for p in (5, 6, 7)],
     "the driver wrote 72 bytes for 0 processes"),
    # a pid twice in the same instance
    (["proc {i} 500 4096", "proc {i} 501 4096", "proc {i} 500 4096"],
     "pid 500 listed twice under the 24-byte layout the driver's answer "
     "measures"),
    # more bytes than the card has
    (["proc {i} 5 4096", f"proc {{i}} 6 {TOTAL + 1}"],
     "process entry 1 of 2 uses more memory than the device has under the "
     "24-byte layout the driver's answer measures"),
]


def test_lying_drivers_give_no_readings_with_a_reason(
    tmp_path, stubs  # noqa: F811
):
    lines = [f"devices {len(LIES) + 1}"]
    for device, (lie, _) in enumerate(LIES):
        lines += device_lines(device)
        lines += [line.format(i=device) for line in lie]
    honest = len(LIES)  # a truthful device beside the liars
    lines += device_lines(honest, 32) + proc_lines(honest, {9: 5 * MiB})
    out = run_probe(
        tmp_path, "\n".join(lines) + "\n", cuda=stubs("cuda"),
        nvml=stubs("nvml"),
    )
    devices = out["result"]["devices"]
    for device, (_, reason) in zip(devices[:-1], LIES, strict=True):
        assert device["processes"] is None, reason
        assert device["processes_error"] == reason
        assert device["error"] == reason  # the device's first failure
        assert device["process_entry_size"] is None
        assert device["processes_truncated"] is False
        assert device["free"] == TOTAL // 2  # the rest still reads
    assert devices[honest]["processes"] == {9: 5 * MiB}
    assert devices[honest]["processes_error"] is None


def test_an_answer_short_once_is_measured_again(tmp_path, stubs):  # noqa: F811
    # The first answer reports 3 entries and writes 2 (a process exited
    # meanwhile): refused, asked again under the other sentinel, read.
    table = processes(0, 3)
    script = "\n".join(
        ["devices 1", *device_lines(0, 24), "proc_lie 0 short_once 1",
         *proc_lines(0, table)]
    )
    out = run_probe(
        tmp_path, script + "\n", cuda=stubs("cuda"), nvml=stubs("nvml"),
        calls=1,
    )
    device = out["result"]["devices"][0]
    assert device["processes"] == table
    assert device["processes_error"] is None
    calls = out["counts"]["nvml"]["nvmlDeviceGetComputeRunningProcesses"]
    assert calls == 2


def test_list_growing_forever_is_bounded(tmp_path, stubs):  # noqa: F811
    script = "devices 1\n" + "\n".join(device_lines(0)) + (
        "\nproc_lie 0 grow\nproc 0 5 4096\n"
    )
    out = run_probe(
        tmp_path, script, cuda=stubs("cuda"), nvml=stubs("nvml"), calls=1
    )
    assert out["result"]["devices"][0]["processes"] is None
    calls = out["counts"]["nvml"]["nvmlDeviceGetComputeRunningProcesses"]
    assert calls == 6


def test_no_nvml_says_why_there_are_no_readings(tmp_path, stubs):  # noqa: F811
    out = run_probe(
        tmp_path, "devices 1\n" + "\n".join(device_lines(0)) + "\n",
        cuda=stubs("cuda"), nvml=tmp_path / "absent" / "libnvidia-ml.so.1",
    )
    device = out["result"]["devices"][0]
    assert device["processes"] is None
    assert device["processes_error"] == "NVML not loaded"
    assert device["error"] is None  # said once, in result["nvml"]


def test_memory_info_written_past_its_struct_is_refused(
    tmp_path, stubs  # noqa: F811
):
    # NVML alone (its own device table): nvmlMemory_t is 24 bytes; an
    # answer of 32 is another layout, and its figures are not used.
    script = "devices 1\n" + "\n".join(device_lines(0)) + (
        "\nstruct_extra 0 8\nproc 0 5 4096\n"
    )
    out = run_probe(
        tmp_path, script, cuda=tmp_path / "absent" / "libcuda.so.1",
        nvml=stubs("nvml"),
    )
    device = out["result"]["devices"][0]
    assert device["total"] is None and device["free"] is None
    assert device["source"] is None
    assert device["error"] == (
        "nvmlDeviceGetMemoryInfo: the driver wrote 32 bytes, not the 24 of "
        "nvmlMemory_t"
    )
    assert device["processes"] == {5: 4096}


def test_memory_info_inconsistent_is_refused(tmp_path, stubs):  # noqa: F811
    script = f"devices 1\ntotal 0 {GiB}\nfree 0 {2 * GiB}\n"
    out = run_probe(
        tmp_path, script, cuda=tmp_path / "absent" / "libcuda.so.1",
        nvml=stubs("nvml"),
    )
    device = out["result"]["devices"][0]
    assert device["free"] is None
    assert device["error"].startswith(
        "nvmlDeviceGetMemoryInfo: inconsistent figures (total 1073741824, "
        "free 2147483648"
    )


def test_uuid_written_past_its_struct_is_refused(tmp_path, stubs):  # noqa: F811
    script = "devices 1\n" + "\n".join(device_lines(0)) + (
        "\nstruct_extra 0 4\n"
    )
    out = run_probe(
        tmp_path, script, cuda=stubs("cuda"),
        nvml=tmp_path / "absent" / "libnvidia-ml.so.1",
    )
    device = out["result"]["devices"][0]
    assert device["uuid"] is None
    assert device["error"] == (
        "cuDeviceGetUuid: the driver wrote beyond the 16 bytes of CUuuid"
    )
    assert device["total"] == TOTAL  # the rest of the driver's answers


# ---- the environment is read with the GIL held -------------------------


@pytest.fixture(scope="module")
def getenv_spy(tmp_path_factory):
    """A getenv() interposer (LD_PRELOAD) that counts reads of the
    probe's variables made by a thread that does not hold the GIL."""
    root = tmp_path_factory.mktemp("getenv-spy")
    return compile_c(
        [STUBS / "stub_getenv.c"], root / "libgetenv_spy.so", shared=True,
        strict=False, for_python=True, hidden=False, libraries=("dl",),
    )


SPY_AFTER = textwrap.dedent(
    """
    spy = ctypes.CDLL(os.environ["CS_TEST_GETENV_SPY"], mode=os.RTLD_NOLOAD)
    spy.getenv_spy_count.restype = ctypes.c_long
    spy.getenv_spy_count.argtypes = [ctypes.c_int]
    counts["getenv"] = {"locked": spy.getenv_spy_count(1),
                        "unlocked": spy.getenv_spy_count(0)}
    """
)


def spy_environment(spy) -> dict[str, str]:
    preload = os.environ.get("LD_PRELOAD", "")  # CI's sanitizer runtimes
    return {
        "LD_PRELOAD": f"{preload} {spy}".strip(),
        "CS_TEST_GETENV_SPY": str(spy),
    }


def test_environment_read_with_the_gil_held(tmp_path, stubs, getenv_spy):  # noqa: F811
    out = run_probe(
        tmp_path, "devices 1\n", cuda=stubs("cuda"), nvml=stubs("nvml"),
        env=spy_environment(getenv_spy), calls=3, after=SPY_AFTER,
    )
    assert out["result"]["nvml"]["path"] == str(stubs("nvml"))
    spied = out["counts"]["getenv"]
    assert spied["unlocked"] == 0
    assert spied["locked"] >= 3  # the spy saw the probe's reads


RACE_BEFORE = textwrap.dedent(
    """
    import threading
    stop = threading.Event()
    def churn():
        i = 0
        while not stop.is_set():
            # Grows and shrinks the C environment: setenv may move it.
            os.environ["CS_TEST_CHURN_%d" % (i % 97)] = "x" * (i % 300)
            if i % 3 == 0:
                os.environ.pop("CS_TEST_CHURN_%d" % ((i * 7) % 97), None)
            i += 1
    writers = [threading.Thread(target=churn) for _ in range(2)]
    for t in writers: t.start()
    """
)

RACE_AFTER = textwrap.dedent(
    """
    try:
        seen = [_core.probe() for _ in range(3000)]
    finally:
        stop.set()
        for t in writers: t.join()
    assert all(r["nvml"]["path"] == os.environ["COMFY_STANDIN_LIBNVML"]
               and r["nvml"]["loaded"] for r in seen)
    """
)


def test_probe_while_threads_write_the_environment(tmp_path, stubs):  # noqa: F811
    # The writers start before the first probe (which loads the libraries
    # from the overrides) and run through 3000 more.
    out = run_probe(
        tmp_path, "devices 1\n", cuda=stubs("cuda"), nvml=stubs("nvml"),
        calls=1, before=RACE_BEFORE, after=RACE_AFTER,
    )
    assert out["result"]["nvml"]["loaded"] is True
