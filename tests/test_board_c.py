"""Runs the board core's C unit tests (tests/c/test_board.c).

Compiled with cc -std=c11 -Wall -Wextra -Werror plus $CS_TEST_CFLAGS (CI:
-fsanitize=address,undefined), against the board core's own sources, so
the core is tested without Python in the process.
"""

import subprocess
import sys

import pytest

from cbuild import BOARD_SOURCES, ROOT, build

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the board is a sealed memfd: Linux only"
)


def test_board_core_c(tmp_path):
    exe = build(
        [ROOT / "tests" / "c" / "test_board.c", *BOARD_SOURCES],
        tmp_path / "test_board",
    )
    proc = subprocess.run([str(exe)], capture_output=True, text=True,
                          timeout=300)
    sys.stderr.write(proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failures" in proc.stdout
