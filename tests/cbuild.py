"""Compile the C test programs and stub libraries the suite needs.

Tests build their C with the system compiler into a temporary directory;
nothing is installed.  CS_TEST_CFLAGS adds flags (CI passes the sanitizer
flags there), so the same tests run plain and under ASan/UBSan.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "include"
SRC = ROOT / "src"

BASE_FLAGS = [
    "-std=c11",
    "-O1",
    "-g",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wshadow",
    "-Wstrict-prototypes",
    "-Wmissing-prototypes",
    "-D_GNU_SOURCE",
    "-fno-omit-frame-pointer",
]


def extra_flags() -> list[str]:
    return shlex.split(os.environ.get("CS_TEST_CFLAGS", ""))


def compile_c(
    sources: list[Path | str],
    output: Path,
    *,
    shared: bool = False,
    flags: list[str] | tuple[str, ...] = (),
    libs: list[str] | tuple[str, ...] = ("-lpthread", "-ldl"),
    sanitize: bool = True,
) -> Path:
    """Compile `sources` to `output` (an executable or a shared library).

    Raises CalledProcessError with the compiler's output on failure, so a
    warning in test C fails the test that needed it.
    """
    cc = os.environ.get("CC", "cc")
    cmd = [cc, *BASE_FLAGS, f"-I{INCLUDE}", f"-I{SRC}"]
    if shared:
        cmd += ["-shared", "-fPIC"]
    if sanitize:
        cmd += extra_flags()
    cmd += [*flags, "-o", str(output), *map(str, sources), *libs]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(
            result.returncode, cmd, result.stdout, result.stderr
        )
    return output


def run_c_test(binary: Path, timeout: float = 300) -> str:
    """Run a C test program; returns its output, fails with it."""
    env = dict(os.environ)
    # The interpreter's LD_PRELOAD of the sanitizer runtimes (CI) is fine
    # for a sanitized test binary too; leak checking is on for C programs.
    env["ASAN_OPTIONS"] = env.get("CS_C_ASAN_OPTIONS", "detect_leaks=1")
    result = subprocess.run(
        [str(binary)], capture_output=True, text=True, env=env,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{binary.name} failed:\n{output}"
    return output
