"""Loading a bench script (bench/<name>.py) as a module, for the smoke
tests: the benches are scripts, not a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
TOOLS_DIR = BENCH_DIR.parent / "tools"


def load_bench(name: str, register: bool = False,
               folder: Path = BENCH_DIR) -> ModuleType:
    """bench/<name>.py (or `folder`/<name>.py), executed as the module
    `name`; with `register` it is in sys.modules while it runs
    (dataclasses look their module up), and stays there for the caller to
    remove."""
    path = folder / f"{name}.py"
    assert path.exists(), f"{path} is missing"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
