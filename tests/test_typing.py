"""The typed surface: mypy (pinned in the ``test-core`` extra) checks a
short example of the public API against python/comfy_standin/__init__.pyi,
the types it infers are the ones the stub promises, and stubtest holds the
stub to the runtime module, so the stub cannot drift unnoticed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "python" / "comfy_standin" / "__init__.pyi"
EXAMPLE = ROOT / "examples" / "typed_usage.py"
REVEAL = ROOT / "tests" / "typecheck" / "reveal.py"
ALLOWLIST = ROOT / "tests" / "typecheck" / "stubtest_allowlist.txt"
TIMEOUT = 600


def stubs_only(tmp_path: Path) -> Path:
    """A directory holding the package's stub alone (mypy then sees the
    stub, not the .py modules beside it)."""
    package = tmp_path / "stubs" / "comfy_standin"
    package.mkdir(parents=True)
    shutil.copy(STUB, package / "__init__.pyi")
    return package.parent


def mypy(tmp_path: Path, *args: str):
    env = dict(os.environ, MYPYPATH=str(stubs_only(tmp_path)))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir",
         str(tmp_path / "cache"), "--config-file", os.devnull, *args],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path,
        env=env,
    )


def stubtest(stubs: Path, cwd: Path):
    """stubtest of the stub in `stubs` against the imported package."""
    return subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "comfy_standin",
         "--allowlist", str(ALLOWLIST), "--concise", "--mypy-config-file",
         os.devnull],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd,
        env=dict(os.environ, MYPYPATH=str(stubs)),
    )


def test_mypy_is_the_pinned_one():
    import mypy.version

    assert mypy.version.__version__ == "2.4.1"


def test_the_example_type_checks_strictly(tmp_path):
    result = mypy(tmp_path, "--strict", str(EXAMPLE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_example_runs():
    result = subprocess.run([sys.executable, str(EXAMPLE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "census entries 1" in result.stdout
    assert "dynamic False" in result.stdout


def test_inferred_types_are_the_promised_ones(tmp_path):
    result = mypy(tmp_path, "--strict", str(REVEAL))
    assert result.returncode == 0, result.stdout + result.stderr
    revealed = {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r"reveal\.py:(\d+): note: Revealed type is "
                             r"\"(.*)\"", result.stdout)
    }
    expected = {
        n: line.split("  # ", 1)[1].strip()
        for n, line in enumerate(REVEAL.read_text().splitlines(), 1)
        if line.lstrip().startswith("reveal_type(")
    }
    assert expected and revealed == expected


def test_a_misuse_is_caught(tmp_path):
    """The check can fail: a wrong type is an error."""
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        "import comfy_standin as cs\n"
        "def f(s: cs.StandIn) -> str:\n"
        "    return s.loaded_size()\n"
    )
    result = mypy(tmp_path, "--strict", str(wrong))
    assert result.returncode == 1
    assert 'Incompatible return value type (got "int", expected "str")' \
        in result.stdout


def test_the_stub_matches_the_runtime(tmp_path):
    result = stubtest(stubs_only(tmp_path), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubtest_sees_drift(tmp_path):
    """A stub that lost a name or changed a signature fails stubtest."""
    drifted = STUB.read_text().replace(
        "def loaded_size(self) -> int: ...",
        "def loaded_size(self, device: Any) -> int: ...",
    )
    assert drifted != STUB.read_text()
    stubs = stubs_only(tmp_path)
    (stubs / "comfy_standin" / "__init__.pyi").write_text(drifted)
    result = stubtest(stubs, tmp_path)
    assert result.returncode == 1
    assert "comfy_standin.StandIn.loaded_size" in result.stdout
