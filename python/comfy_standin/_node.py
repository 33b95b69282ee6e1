"""``install-node`` / ``uninstall-node``: the ComfyUI custom-node entry.

The entry is one folder under ComfyUI's ``custom_nodes`` holding an
``__init__.py`` copied from the package's template
(``node_template/__init__.py.tmpl``).  ComfyUI imports it at start-up, it
registers no nodes (``NODE_CLASS_MAPPINGS = {}``), calls
``comfy_standin.integrations.comfy_env.install()`` and adds the status
route.  Nothing else is written: no ``.pth`` file, nothing that runs in any
process but ComfyUI's.
"""

from __future__ import annotations

import os
import sys
from importlib import resources
from typing import TextIO

#: The folder under custom_nodes.  Not "comfy_standin": ComfyUI imports a
#: custom node under its folder name, which would shadow the package.
NODE_DIR = "comfy-standin-switch"
#: Recognises a file this command wrote (the template's first line).
MARKER = "comfy-standin node entry"

EXIT_OK = 0
EXIT_REFUSED = 1


class NotComfyUI(ValueError):
    """The path given is not a ComfyUI checkout."""


def template() -> str:
    return (
        resources.files("comfy_standin")
        .joinpath("node_template", "__init__.py.tmpl")
        .read_text(encoding="utf-8")
    )


def custom_nodes_dir(comfyui: str) -> str:
    """``COMFYUI/custom_nodes``, or NotComfyUI saying what is missing."""
    root = os.path.abspath(os.path.expanduser(comfyui))
    if not os.path.isdir(root):
        raise NotComfyUI(f"{root}: no such directory")
    missing = [
        name for name, ok in (
            ("main.py", os.path.isfile(os.path.join(root, "main.py"))),
            ("custom_nodes/", os.path.isdir(
                os.path.join(root, "custom_nodes"))),
        ) if not ok
    ]
    if missing:
        raise NotComfyUI(
            f"{root} is not a ComfyUI folder (no {' and no '.join(missing)})"
        )
    return os.path.join(root, "custom_nodes")


def _is_ours(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "__init__.py"),
                  encoding="utf-8") as f:
            return MARKER in f.readline()
    except OSError:
        return False


def install(comfyui: str, out: TextIO) -> int:
    """Writes the entry; idempotent.  Returns an exit code."""
    try:
        nodes = custom_nodes_dir(comfyui)
    except NotComfyUI as exc:
        print(f"install-node: refused: {exc}", file=out)
        return EXIT_REFUSED
    folder = os.path.join(nodes, NODE_DIR)
    target = os.path.join(folder, "__init__.py")
    text = template()
    if os.path.lexists(folder) and not _is_ours(folder):
        print(f"install-node: refused: {folder} exists and was not written "
              f"by comfy_standin; remove or rename it first", file=out)
        return EXIT_REFUSED
    try:
        with open(target, encoding="utf-8") as f:
            current = f.read()
    except OSError:
        current = None
    if current == text:
        print(f"install-node: already installed: {folder} (nothing "
              f"changed)", file=out)
    else:
        os.makedirs(folder, exist_ok=True)
        tmp = target + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
        verb = "updated" if current is not None else "installed"
        print(f"install-node: {verb} {target}", file=out)
    print(
        "  at its next start ComfyUI makes comfy-env use comfy_standin "
        "stand-ins and\n  serves GET /comfy_standin/status; it registers "
        "no nodes.\n"
        f"  ComfyUI must run with this Python (comfy_standin is installed "
        f"here):\n    {sys.executable}\n"
        f"  undo: python -m comfy_standin uninstall-node {comfyui}",
        file=out,
    )
    if not _importable("comfy_env"):
        print("  note: comfy-env is not importable from this Python; the "
              "entry will log\n  'not switched on' until it is.", file=out)
    return EXIT_OK


def uninstall(comfyui: str, out: TextIO) -> int:
    """Removes the entry if this command wrote it; idempotent."""
    try:
        nodes = custom_nodes_dir(comfyui)
    except NotComfyUI as exc:
        print(f"uninstall-node: refused: {exc}", file=out)
        return EXIT_REFUSED
    folder = os.path.join(nodes, NODE_DIR)
    if not os.path.lexists(folder):
        print(f"uninstall-node: not installed: {folder} does not exist "
              f"(nothing changed)", file=out)
        return EXIT_OK
    if not _is_ours(folder):
        print(f"uninstall-node: refused: {folder} was not written by "
              f"comfy_standin; left as it is", file=out)
        return EXIT_REFUSED
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name == "__pycache__" and os.path.isdir(path):
            for cached in os.listdir(path):
                os.remove(os.path.join(path, cached))
            os.rmdir(path)
        elif name in ("__init__.py", "__init__.py.tmp"):
            os.remove(path)
    try:
        os.rmdir(folder)
    except OSError:
        print(f"uninstall-node: removed the entry; {folder} kept (it holds "
              f"other files)", file=out)
        return EXIT_OK
    print(f"uninstall-node: removed {folder}; ComfyUI uses comfy-env's own "
          f"stand-ins from its next start", file=out)
    return EXIT_OK


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
