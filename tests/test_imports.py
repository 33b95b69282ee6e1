"""Every module of the package imports on its own, and no two import each
other: the graph of imports inside python/comfy_standin, those inside
functions included, has no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "comfy_standin"
NAME = "comfy_standin"


def module_name(path: Path) -> str:
    parts = [NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(module: str, path: Path) -> set[str]:
    """The package's modules that `module` imports anywhere in its source:
    at module level, in functions, under ``if TYPE_CHECKING``."""
    package = module if path.name == "__init__.py" else \
        module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module
                                          else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from . import pool`` imports a submodule; ``from .pool
                # import Pool`` an attribute of its module.
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in MODULES else source)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one
    (Tarjan's algorithm, then a path back to the component's root)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = []
    for component in components:
        members = set(component)
        root = min(component)
        path, seen = [root], {root}
        while True:
            step = sorted(t for t in graph[path[-1]] if t in members)
            if root in step:
                break
            step = [t for t in step if t not in seen] or step
            path.append(step[0])
            seen.add(step[0])
        found.append([*path, root])
    return found


def test_the_walk_sees_imports_inside_functions():
    assert "comfy_standin._status" in GRAPH["comfy_standin.__main__"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c",
                                                          "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_back():
    found = cycles(GRAPH)
    assert not found, "import cycles: " + "; ".join(
        " -> ".join(cycle) for cycle in found)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_in_a_fresh_interpreter(module):
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
