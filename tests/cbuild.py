"""Compile the test suite's C sources with the system compiler.

Tiny on purpose: `build(sources, out)` runs
``cc -std=c11 -Wall -Wextra -Werror -I include ... $CS_TEST_CFLAGS``.
CI sets CS_TEST_CFLAGS to ``-fsanitize=address,undefined`` for standalone
test programs.  A shared library meant to be loaded into this Python
(``shared=True``) drops -fsanitize flags: an ASan runtime cannot be loaded
into an interpreter that was not started with it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "include"
SRC = ROOT / "src"
CC = os.environ.get("CC", "cc")
BASE_FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-g"]


def extra_flags(shared: bool = False) -> list[str]:
    flags = shlex.split(os.environ.get("CS_TEST_CFLAGS", ""))
    if shared:
        flags = [f for f in flags if not f.startswith("-fsanitize")]
    return flags


def have_cc() -> bool:
    return shutil.which(CC) is not None


def build(sources, out, *, shared: bool = False, libs=()) -> Path:
    """Compile `sources` into `out` (an executable, or a .so if shared)."""
    out = Path(out)
    cmd = [CC, *BASE_FLAGS, f"-I{INCLUDE}", f"-I{SRC}"]
    if shared:
        cmd += ["-shared", "-fPIC"]
    cmd += extra_flags(shared)
    cmd += [str(s) for s in sources]
    cmd += ["-o", str(out), "-pthread", *libs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"C build failed ({shlex.join(cmd)}):\n{proc.stdout}{proc.stderr}"
        )
    return out
