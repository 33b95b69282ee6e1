"""Lints of the C source that a compiler does not do: the two layers stay
apart (no Python.h in the core or its public headers), PEP 7 layout (79
columns, spaces, no trailing blanks)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ["src/ledger.c", "src/probe.c", "src/board.c", "src/board_host.c",
        "src/board_worker.c", "src/board_internal.h", "src/platform.h"]
HEADERS = sorted((ROOT / "include" / "comfy_standin").glob("*.h"))
C_FILES = sorted(
    [*ROOT.glob("src/*.[ch]"), *HEADERS, *ROOT.glob("tests/c/*.c")]
)


@pytest.mark.parametrize(
    "path", [ROOT / p for p in CORE] + HEADERS, ids=lambda p: p.name
)
def test_core_has_no_python(path):
    text = path.read_text()
    assert "Python.h" not in text and "PyObject" not in text, path


@pytest.mark.parametrize("path", C_FILES, ids=lambda p: p.name)
def test_layout(path):
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if len(line) > 79:
            problems.append(f"{number}: {len(line)} columns")
        if "\t" in line:
            problems.append(f"{number}: tab")
        if line != line.rstrip():
            problems.append(f"{number}: trailing blank")
    assert problems == [], f"{path.name}: {problems[:10]}"


def test_every_public_header_is_guarded():
    for header in HEADERS:
        text = header.read_text()
        guard = f"COMFY_STANDIN_{header.stem.upper()}_H"
        assert f"#ifndef {guard}" in text and f"#define {guard}" in text
        assert 'extern "C"' in text, header.name
