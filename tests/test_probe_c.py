"""Builds and runs the C unit test of the probe core (tests/c/test_probe.c).

Compiled with the system ``cc``, ``-std=c11 -Wall -Wextra -Werror`` and the
core's warnings, then ``CS_TEST_CFLAGS`` (CI: ``-fsanitize=address,
undefined``).  The stubs it loads are built with the same flags.  One
scenario per process: the probe loads its libraries once per process.
"""

from __future__ import annotations

import subprocess

import pytest

from cbuild import REPO, build_stub, compile_c

# The probe core: the loader and the query (probe.c), the CUDA driver half
# and the NVML half.
PROBE = ("probe.c", "probe_cuda.c", "probe_nvml.c")


@pytest.fixture(scope="module")
def probe_test(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-c")
    cuda = build_stub("cuda", root / "cuda", for_python=False)
    nvml = build_stub("nvml", root / "nvml", for_python=False)
    binary = compile_c(
        [REPO / "tests" / "c" / "test_probe.c",
         *(REPO / "src" / name for name in PROBE)],
        root / "test_probe",
        include_dirs=(REPO / "include",),
        libraries=("dl",),
    )
    return binary, cuda, nvml


@pytest.mark.parametrize(
    "scenario", ["full", "disabled", "missing", "layouts", "options"]
)
def test_probe_core(probe_test, tmp_path, scenario):
    binary, cuda, nvml = probe_test
    completed = subprocess.run(
        [str(binary), str(cuda), str(nvml), str(tmp_path / "script.txt"),
         scenario],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == "ok"
    # Sanitizer reports go to stderr even when they do not fail the run.
    assert "runtime error" not in completed.stderr
    assert "ERROR: AddressSanitizer" not in completed.stderr
