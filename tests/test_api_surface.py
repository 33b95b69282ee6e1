"""The typed surface (python/comfy_standin/__init__.pyi) is what both
implementations have: every name the stub declares exists at run time."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import comfy_standin

STUB = Path(comfy_standin.__file__).with_name("__init__.pyi")


def declared() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = names.setdefault(node.name, set())
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    members.add(item.target.id)
        elif isinstance(node, ast.FunctionDef):
            names[""].add(node.name)
    return names


SURFACE = declared()
SHARED = ["StandIn", "Pool", "EchoError", "WorkerGoneError"]

#: What ComfyUI and comfy-env read or write on a patcher's inner module
#: (``patcher.model``), which a stand-in answers itself.
INNER = {"device", "model_loaded_weight_memory", "model_lowvram",
         "current_weight_patches_uuid", "model_offload_buffer_memory"}


def test_stub_is_parsed():
    assert {"StandIn", "Pool", "Board"} <= set(SURFACE)
    assert INNER | {"model"} <= SURFACE["StandIn"]
    assert {"apply_echo", "apply_residency", "register", "default_pool",
            "probe"} <= SURFACE[""]


@pytest.mark.parametrize("cls", SHARED)
def test_every_declared_member_exists(impl, cls):
    runtime = getattr(impl, cls)
    missing = [
        name for name in sorted(SURFACE.get(cls, ()))
        if name != "__init__" and not hasattr(runtime, name)
        # instance attributes assigned in __init__ (Pool.on_pressure)
        and name != "on_pressure"
    ]
    assert missing == [], f"{impl.__name__}.{cls} lacks {missing}"


def test_the_stand_in_is_its_own_inner_module(impl):
    """No second type: ``model`` is the stand-in, which has every member
    ComfyUI and comfy-env read on the inner module."""
    assert "StandInModule" not in SURFACE
    assert not hasattr(impl, "StandInModule")
    assert not hasattr(comfy_standin._core, "StandInModule")
    assert "StandInModule" not in getattr(impl, "__all__", ())
    for name in INNER:
        assert hasattr(impl.StandIn, name), name


def test_module_functions_exist(impl):
    for name in SURFACE[""] - {"probe"}:
        assert callable(getattr(impl, name)), name
    assert callable(comfy_standin.probe)


def test_board_surface():
    missing = [n for n in SURFACE["Board"]
               if not hasattr(comfy_standin.Board, n)]
    assert missing == []


def test_c_methods_have_signatures():
    # docstrings carry a signature line, so inspect.signature works
    for name in ("partially_load", "partially_unload", "detach",
                 "attach_board", "is_clone"):
        sig = inspect.signature(getattr(comfy_standin.StandIn, name))
        assert "self" in sig.parameters
    assert list(inspect.signature(comfy_standin.apply_echo).parameters)[:2] \
        == ["standin", "resident"]


def test_dir_lists_only_the_api():
    """dir(comfy_standin) is what a user may use: no sys, threading,
    annotations or private helpers (completion in an editor or REPL
    reads dir)."""
    listed = set(dir(comfy_standin))
    assert listed == set(comfy_standin.__all__) | {"__version__"}
    for name in comfy_standin.__all__:
        assert hasattr(comfy_standin, name), name
    assert not {"sys", "threading", "annotations"} & set(
        vars(comfy_standin))
