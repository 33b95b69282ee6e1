"""Compile C for the tests with the system compiler.

Flags: always ``-std=c11 -Wall -Wextra -Werror`` (plus the warnings the
meson build holds the core to), then whatever ``CS_TEST_CFLAGS`` holds (CI
puts ``-fsanitize=address,undefined`` there).  ``CC`` picks the compiler
(default ``cc``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO
INCLUDE = REPO / "include"
SRC = REPO / "src"
STUBS = REPO / "tests" / "c" / "stubs"
# The board core's translation units (src/board_internal.h says which does
# what).
BOARD_SOURCES = [SRC / "board.c", SRC / "board_host.c", SRC / "board_worker.c"]

BASE_FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror"]
# What meson.build's core_args hold the core to (warning_level=3 adds
# -Wpedantic).
STRICT_FLAGS = [
    "-Wpedantic",
    "-Wshadow",
    "-Wstrict-prototypes",
    "-Wmissing-prototypes",
    "-Wpointer-arith",
    "-Wcast-align",
    "-Wwrite-strings",
    "-Wvla",
]

# The library names the probe looks for, and the sonames the stubs carry
# so that dlopen(..., RTLD_NOLOAD) finds a preloaded stub by that name.
SONAMES = {"cuda": "libcuda.so.1", "nvml": "libnvidia-ml.so.1"}


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def extra_cflags(*, for_python: bool = False) -> list[str]:
    """CS_TEST_CFLAGS, split.  A library loaded into the (uninstrumented)
    Python interpreter cannot carry sanitizer instrumentation: its runtime
    must come first in the process.  Those flags are dropped there; the C
    unit test gets them all."""
    flags = shlex.split(os.environ.get("CS_TEST_CFLAGS", ""))
    if for_python:
        flags = [f for f in flags if not f.startswith("-fsanitize")]
    return flags


def compile_c(
    sources: list[Path | str],
    output: Path,
    *,
    shared: bool = False,
    strict: bool = True,
    defines: tuple[str, ...] = (),
    include_dirs: tuple[Path, ...] = (),
    libraries: tuple[str, ...] = (),
    soname: str | None = None,
    for_python: bool = False,
    hidden: bool = True,
) -> Path:
    """Compiles and links; raises with the compiler's output on failure."""
    output.parent.mkdir(parents=True, exist_ok=True)
    command = [*compiler(), *BASE_FLAGS]
    if strict:
        command += STRICT_FLAGS
    command += [f"-D{d}" for d in defines]
    command += [f"-I{d}" for d in (*include_dirs, INCLUDE, SRC)]
    command += ["-g", "-O1", "-fno-omit-frame-pointer"]
    if shared:
        command += ["-shared", "-fPIC"]
        if hidden:  # the stubs mark their exports; test libraries do not
            command.append("-fvisibility=hidden")
        if soname:
            command.append(f"-Wl,-soname,{soname}")
    command += ["-pthread"]
    command += extra_cflags(for_python=for_python)
    command += [str(s) for s in sources]
    command += ["-o", str(output)]
    command += [f"-l{lib}" for lib in libraries]
    completed = subprocess.run(
        command, capture_output=True, text=True, check=False
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"compile failed ({completed.returncode}): "
            f"{shlex.join(command)}\n{completed.stdout}{completed.stderr}"
        )
    return output


def build_stub(
    kind: str,
    directory: Path,
    defines: tuple[str, ...] = (),
    *,
    for_python: bool = True,
) -> Path:
    """Builds tests/c/stubs/stub_<kind>.c as <directory>/<soname>.

    kind is "cuda" or "nvml"; defines select a variant (e.g.
    STUB_NO_GET_PROC_ADDRESS).  Stubs are test fixtures, never installed.
    """
    soname = SONAMES[kind]
    return compile_c(
        [STUBS / f"stub_{kind}.c"],
        directory / soname,
        shared=True,
        strict=False,  # the stubs mimic foreign ABIs, not house style
        defines=defines,
        soname=soname,
        for_python=for_python,
    )


def run_c_test(binary: Path, timeout: float = 300) -> str:
    """Runs a C test program; returns its output, fails with it.

    Leak checking is on for C programs (CI's sanitizer pass); the Python
    interpreter's own run keeps it off."""
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = env.get("CS_C_ASAN_OPTIONS", "detect_leaks=1")
    completed = subprocess.run(
        [str(binary)], capture_output=True, text=True, env=env,
        timeout=timeout, check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, f"{binary.name} failed:\n{output}"
    return output


def build(sources, out, *, shared: bool = False, libs=()) -> Path:
    """compile_c for the board tests: an executable, or a .so (loaded into
    the interpreter, so without sanitizer instrumentation) if shared.
    `libs` are linker arguments ("-lrt")."""
    return compile_c(
        list(sources),
        Path(out),
        shared=shared,
        strict=False,
        for_python=shared,
        hidden=False,
        libraries=tuple(lib[2:] if lib.startswith("-l") else lib
                        for lib in libs),
    )
