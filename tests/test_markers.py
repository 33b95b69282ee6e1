"""Markers say what a test needs, and the README's recipe for working
without comfy-env holds.

With comfy-env hidden from a pytest run (the plugin below makes importing
it and reading its metadata fail, as in an environment that installed
only ``.[test-core]``): every test file still imports, ``-m "not
comfy_env"`` leaves out exactly the marked tests, and a marked test run
anyway FAILS with a line saying what is missing -- it is never skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: A pytest plugin (``-p no_comfy_env``) that hides comfy-env: its import
#: fails as a missing module does, its distribution is not found.
HIDE_COMFY_ENV = textwrap.dedent('''
    import importlib.abc
    import importlib.metadata
    import sys


    class _NoComfyEnv(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "comfy_env" or name.startswith("comfy_env."):
                raise ModuleNotFoundError(
                    f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, _NoComfyEnv())
    _distribution = importlib.metadata.distribution


    def _hidden(name):
        if name.replace("_", "-").lower() == "comfy-env":
            raise importlib.metadata.PackageNotFoundError(name)
        return _distribution(name)


    importlib.metadata.distribution = _hidden
''')

TIMEOUT = 600


def pytest_without_comfy_env(tmp_path: Path, *args: str,
                             cwd: Path = ROOT) -> subprocess.CompletedProcess:
    (tmp_path / "no_comfy_env.py").write_text(HIDE_COMFY_ENV)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no_comfy_env",
         "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, env=env,
    )


def test_the_hiding_plugin_hides_comfy_env(tmp_path):
    """The check can fail: a test file importing comfy-env at the top
    does not collect under the plugin."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_needs_it.py").write_text(
        "import comfy_env\n\n\ndef test_x():\n    assert comfy_env\n")
    done = pytest_without_comfy_env(tmp_path, "-q", "--co",
                                    str(project), cwd=project)
    assert done.returncode != 0
    assert "No module named 'comfy_env'" in done.stdout


def test_without_comfy_env_every_test_file_collects(tmp_path):
    done = pytest_without_comfy_env(tmp_path, "-q", "--co",
                                    "-m", "not comfy_env")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    found = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)",
                      summary)
    assert found, summary
    selected, total, deselected = map(int, found.groups())
    assert selected + deselected == total and deselected >= 20, summary
    assert selected > 1000, summary
    # what was left out is what is marked comfy_env (or torch_worker or
    # comfyui, marked comfy_env too): no file lost tests by accident
    listed = pytest_without_comfy_env(tmp_path, "-q", "--co",
                                      "-m", "comfy_env")
    assert listed.returncode == 0, listed.stdout[-3000:]
    marked = [line.split("::")[0] for line in listed.stdout.splitlines()
              if "::" in line]
    assert len(marked) == deselected
    # whole files are marked where every test needs comfy-env
    kept = {line.split("::")[0] for line in done.stdout.splitlines()
            if "::" in line}
    assert not kept & {"tests/test_comfy_env_adapter.py",
                       "tests/test_comfy_env_board.py",
                       "tests/test_comfy_env_e2e.py",
                       "tests/test_comfy_env_matrix.py",
                       "tests/test_comfy_env_reach.py",
                       "tests/test_comfy_env_readings.py",
                       "tests/test_pack_env_board.py",
                       "tests/test_comfyui_server.py",
                       "tests/test_bench_regret_smoke.py",
                       "tests/test_bench_edges_smoke.py",
                       "tests/test_shutdown.py"}
    assert set(marked) == {
        "tests/test_comfy_env_adapter.py", "tests/test_comfy_env_board.py",
        "tests/test_comfy_env_e2e.py", "tests/test_comfy_env_matrix.py",
        "tests/test_node_install.py", "tests/test_comfy_env_reach.py",
        "tests/test_comfy_env_readings.py",
        "tests/test_pack_env_board.py", "tests/test_edges.py",
        "tests/test_comfyui_server.py", "tests/test_markers.py",
        "tests/test_bench_regret_smoke.py", "tests/test_bench_edges_smoke.py",
        "tests/test_shutdown.py",
    }


def test_a_marked_test_fails_without_comfy_env_and_is_not_skipped(
        tmp_path):
    done = pytest_without_comfy_env(
        tmp_path, "-q", "-rA",
        "tests/test_node_install.py::"
        "test_the_entry_switches_on_and_adds_the_route",
        "tests/test_comfy_env_adapter.py::test_not_installed_is_comfy_envs_own",
    )
    assert done.returncode == 1, done.stdout[-3000:]
    assert "skipped" not in done.stdout.lower(), done.stdout[-3000:]
    assert "2 errors" in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("comfy-env is not installed") >= 2
    assert "-m \"not comfy_env\"" in done.stdout


def test_the_rest_of_a_mixed_file_runs_without_comfy_env(tmp_path):
    done = pytest_without_comfy_env(
        tmp_path, "-q", "-m", "not comfy_env",
        "tests/test_node_install.py",
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 deselected" in done.stdout, done.stdout[-3000:]


def test_every_marker_is_registered_with_what_it_needs(pytestconfig):
    assert "--strict-markers" in pytestconfig.getini("addopts")
    markers = dict(m.split(":", 1) for m in pytestconfig.getini("markers"))
    assert {"comfy_env", "comfyui", "network", "torch_worker"} <= set(
        markers)
    assert all(len(text.strip()) > 20 for text in markers.values())
    # the test-core extra needs no comfy-env; the test extra adds it
    # (read from pyproject.toml: tomllib is not in 3.10's library)
    text = (ROOT / "pyproject.toml").read_text()
    core = re.search(r"^test-core = \[(.*?)^\]", text, re.M | re.S)
    assert core and "pytest" in core.group(1), text
    assert "comfy-env" not in core.group(1)
    assert re.search(
        r'^test = \["comfy-standin\[test-core,test-comfy-env\]"\]', text,
        re.M)


@pytest.mark.comfy_env  # without comfy-env they fail saying so first
def test_a_comfyui_test_fails_when_no_tree_is_named():
    """The tests against ComfyUI itself, asked for with no ComfyUI tree
    named: each fails saying what to set, none is skipped."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "COMFY_STANDIN_COMFYUI")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p",
         "no:cacheprovider", "-m", "comfyui",
         "tests/test_comfyui_server.py"],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "skipped" not in done.stdout.lower(), done.stdout[-3000:]
    assert "3 errors" in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("COMFY_STANDIN_COMFYUI is not set") >= 3
