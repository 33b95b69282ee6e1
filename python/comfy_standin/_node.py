"""``install-node`` / ``uninstall-node``: the ComfyUI custom-node entry.

The entry is one folder under ComfyUI's ``custom_nodes`` holding an
``__init__.py`` copied from the package's template
(``node_template/__init__.py.tmpl``).  ComfyUI imports it at start-up, it
registers no nodes (``NODE_CLASS_MAPPINGS = {}``), calls
``comfy_standin.integrations.comfy_env.install()`` and adds the status
route.  Nothing else is written: no ``.pth`` file, nothing that runs in any
process but ComfyUI's.

``custom_nodes`` may be shared with other users, so both commands treat
what they find there as hostile:

- The path the user typed (the ComfyUI folder, its ``custom_nodes``) is
  the user's: links in it are followed, once.  ``custom_nodes`` is then
  held open as a directory descriptor and every later step is relative to
  it, so what was checked is what is written, whatever is renamed in the
  meantime.
- Below that, no link is followed: an entry folder, ``__init__.py``,
  ``__pycache__`` or bytecode cache that is a symbolic link refuses the
  command with one line saying so (``O_NOFOLLOW``; nothing is changed).
- ``__init__.py`` is written to a fresh name created with ``O_CREAT |
  O_EXCL | O_NOFOLLOW`` in the entry folder, then renamed over the old one
  (a rename replaces a name, it never follows one).
- ``uninstall-node`` deletes only ``__init__.py`` (when its first line
  carries ``MARKER``) and that file's own bytecode caches
  (``__pycache__/__init__.<tag>[.opt-N].pyc`` for CPython 3 tags and this
  interpreter's), each only if it is a regular file; then the folders, if
  they are empty.  Anything else stays, and the output names it.
- Every ``OSError`` ends the command with one line on stderr and exit 1.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from importlib import resources
from typing import Any, TextIO

from ._text import json_text, visible

#: The folder under custom_nodes.  Not "comfy_standin": ComfyUI imports a
#: custom node under its folder name, which would shadow the package.
NODE_DIR = "comfy-standin-switch"
#: The one file the commands write.
ENTRY_FILE = "__init__.py"
CACHE_DIR = "__pycache__"
#: Recognises a file this command wrote (the template's first line).
MARKER = "comfy-standin node entry"

EXIT_OK = 0
EXIT_REFUSED = 1

#: Bytes read from an existing __init__.py: the template is ~1.5 KiB; a
#: bigger file is not one this command wrote.
_READ_LIMIT = 64 << 10
#: Characters of a path kept in an output line.
_PATH_LIMIT = 1024

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _cache_pattern() -> re.Pattern[str]:
    """Names of the entry file's bytecode caches: every CPython 3 tag
    (ComfyUI may run another Python than this one) and this
    interpreter's own tag."""
    tags = [r"cpython-3\d{1,2}"]
    own = sys.implementation.cache_tag
    if own and not own.startswith("cpython-"):
        tags.append(re.escape(own))
    return re.compile(
        r"__init__\.(?:%s)(?:\.opt-[12])?\.pyc\Z" % "|".join(tags))


_OWN_CACHE = _cache_pattern()


class NotComfyUI(ValueError):
    """The path given is not a ComfyUI checkout."""


class Refused(Exception):
    """The command stops here; the message is the one line that says
    why."""


def _p(path: str) -> str:
    """A path for an output line: printable, one line, bounded."""
    return visible(path, _PATH_LIMIT)


def template() -> str:
    return (
        resources.files("comfy_standin")
        .joinpath("node_template", "__init__.py.tmpl")
        .read_text(encoding="utf-8")
    )


def custom_nodes_dir(comfyui: str) -> str:
    """``COMFYUI/custom_nodes`` (absolute), or NotComfyUI saying what is
    missing."""
    root = os.path.abspath(os.path.expanduser(comfyui))
    if not os.path.isdir(root):
        what = "not a folder" if os.path.lexists(root) else "no such folder"
        raise NotComfyUI(f"{_p(root)}: {what}")
    missing = [
        name for name, ok in (
            ("main.py", os.path.isfile(os.path.join(root, "main.py"))),
            ("custom_nodes/", os.path.isdir(
                os.path.join(root, "custom_nodes"))),
        ) if not ok
    ]
    if missing:
        raise NotComfyUI(
            f"{_p(root)} is not a ComfyUI folder (no "
            f"{' and no '.join(missing)})"
        )
    return os.path.join(root, "custom_nodes")


# ---------------------------------------------------------------------------
# file-system steps, relative to directory descriptors


@contextmanager
def _step(what: str) -> Iterator[None]:
    """Turns an OSError of the step into the one-line refusal."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise Refused(f"{what}: {reason}") from None


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _link_refusal(path: str, name: str, dir_fd: int, command: str) -> Refused:
    try:
        target = f" (to {_p(os.readlink(name, dir_fd=dir_fd))})"
    except OSError:
        target = ""
    return Refused(
        f"{_p(path)} is a symbolic link{target}; {command} does not follow "
        f"links it did not create: remove it, then run {command} again"
    )


def _open_dir(name: str, dir_fd: int, path: str, command: str) -> int:
    """Opens the folder `name` without following a link at it."""
    try:
        return os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if _is_link(name, dir_fd):  # swapped in since it was looked at
            raise _link_refusal(path, name, dir_fd, command) from None
        raise Refused(f"cannot open {_p(path)}: "
                      f"{exc.strerror or type(exc).__name__}") from None


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        st = _lstat(name, dir_fd)
    except OSError:
        return False
    return st is not None and stat.S_ISLNK(st.st_mode)


def _read_entry(dir_fd: int, path: str) -> str | None:
    """The text of the entry's regular __init__.py (at most _READ_LIMIT
    bytes), without following a link and without blocking on a FIFO;
    None when it cannot be read as text."""
    with _step(f"cannot read {_p(path)}"):
        fd = os.open(ENTRY_FILE, os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW
                     | os.O_NONBLOCK, dir_fd=dir_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            chunks = []
            size = 0
            while size <= _READ_LIMIT:
                chunk = os.read(fd, _READ_LIMIT + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    data = b"".join(chunks)
    if len(data) > _READ_LIMIT:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_ours(text: str | None) -> bool:
    return text is not None and MARKER in text.split("\n", 1)[0]


def _check_entry_file(entry_fd: int, folder: str, command: str
                      ) -> str | None:
    """The current text of our __init__.py; None when there is none.
    Refused when it is a link, or a file this command did not write."""
    target = os.path.join(folder, ENTRY_FILE)
    with _step(f"cannot read {_p(target)}"):
        st = _lstat(ENTRY_FILE, entry_fd)
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _link_refusal(target, ENTRY_FILE, entry_fd, command)
    text = _read_entry(entry_fd, target) if stat.S_ISREG(st.st_mode) \
        else None
    if not _is_ours(text):
        verb = "left as it is" if command == "uninstall-node" else \
            "remove or rename it first"
        raise Refused(f"{_p(folder)} exists and was not written by "
                      f"comfy_standin; {verb}")
    return text


def _write_entry(entry_fd: int, text: str, target: str) -> None:
    """Writes `text` to a fresh file in the folder, then renames it over
    __init__.py.  The fresh file is removed again on any failure."""
    data = text.encode("utf-8")
    tmp = f".{ENTRY_FILE}.{secrets.token_hex(8)}.tmp"
    with _step(f"cannot write {_p(target)}"):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
                     | os.O_CLOEXEC, 0o644, dir_fd=entry_fd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, ENTRY_FILE, src_dir_fd=entry_fd,
                       dst_dir_fd=entry_fd)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=entry_fd)
            raise


def _open_custom_nodes(comfyui: str) -> tuple[str, int]:
    """(absolute custom_nodes path, a descriptor of that folder).  The
    user's own path: links in it are followed."""
    try:
        nodes = custom_nodes_dir(comfyui)
    except NotComfyUI as exc:
        raise Refused(str(exc)) from None
    with _step(f"cannot open {_p(nodes)}"):
        return nodes, os.open(nodes, _DIR_FLAGS)


#: Whether this platform has what the commands need (POSIX does).
_SUPPORTED = bool(_NOFOLLOW) and all(
    f in os.supports_dir_fd
    for f in (os.open, os.stat, os.mkdir, os.unlink, os.rmdir, os.rename)
)


def _supported() -> None:
    if not _SUPPORTED:
        raise Refused("this platform cannot open files relative to a "
                      "folder without following links (POSIX is needed)")


# ---------------------------------------------------------------------------
# install


def _install(comfyui: str) -> dict[str, Any]:
    _supported()
    with _step("cannot read the node template in the comfy_standin "
               "package"):
        text = template()
    nodes, nodes_fd = _open_custom_nodes(comfyui)
    folder = os.path.join(nodes, NODE_DIR)
    target = os.path.join(folder, ENTRY_FILE)
    created = False
    try:
        with _step(f"cannot read {_p(nodes)}"):
            st = _lstat(NODE_DIR, nodes_fd)
        if st is None:
            with _step(f"cannot create {_p(folder)}"):
                os.mkdir(NODE_DIR, 0o755, dir_fd=nodes_fd)
            created = True
        elif stat.S_ISLNK(st.st_mode):
            raise _link_refusal(folder, NODE_DIR, nodes_fd, "install-node")
        elif not stat.S_ISDIR(st.st_mode):
            raise Refused(f"{_p(folder)} exists and is not a folder; "
                          f"remove or rename it first")
        entry_fd = _open_dir(NODE_DIR, nodes_fd, folder, "install-node")
        try:
            current = None
            if not created:
                current = _check_entry_file(entry_fd, folder, "install-node")
                if current is None:
                    with _step(f"cannot read {_p(folder)}"):
                        others = os.listdir(entry_fd)
                    if others:
                        raise Refused(
                            f"{_p(folder)} exists and was not written by "
                            f"comfy_standin; remove or rename it first")
            # ComfyUI's import writes the entry's bytecode into
            # __pycache__: a link there would take it elsewhere.
            with _step(f"cannot read {_p(folder)}"):
                cache = _lstat(CACHE_DIR, entry_fd)
            if cache is not None and stat.S_ISLNK(cache.st_mode):
                raise _link_refusal(os.path.join(folder, CACHE_DIR),
                                    CACHE_DIR, entry_fd, "install-node")
            if current == text:
                action = "unchanged"
            else:
                _write_entry(entry_fd, text, target)
                action = "updated" if current is not None else "installed"
        finally:
            os.close(entry_fd)
    except BaseException:
        if created:  # leave no empty folder behind a refusal
            with suppress(OSError):
                os.rmdir(NODE_DIR, dir_fd=nodes_fd)
        raise
    finally:
        os.close(nodes_fd)
    root = os.path.dirname(nodes)
    return {
        "command": "install-node",
        "action": action,
        "comfyui": root,
        "entry": folder,
        "file": target,
        "python": sys.executable,
        "undo": undo_command(root),
        "comfy_env_importable": _importable("comfy_env"),
    }


def undo_command(root: str) -> str:
    """The uninstall command line, runnable as printed: the interpreter
    that ran install-node and the absolute ComfyUI path."""
    return " ".join(shlex.quote(part) for part in (
        sys.executable or "python3", "-m", "comfy_standin",
        "uninstall-node", os.path.abspath(root)))


def install(comfyui: str, out: TextIO, *, json_output: bool = False,
            quiet: bool = False, err: TextIO | None = None) -> int:
    """Writes the entry; idempotent.  Returns an exit code.

    The result goes to `out` (one JSON document with `json_output`, the
    result line only with `quiet`); a refusal is one line on `err`
    (default stderr) and exit 1."""
    try:
        result = _install(comfyui)
    except Refused as exc:
        return _refuse("install-node", exc, err)
    if json_output:
        _emit_json(out, result)
        return EXIT_OK
    if result["action"] == "unchanged":
        line = (f"install-node: already installed: {_p(result['entry'])} "
                f"(nothing changed)")
    else:
        line = f"install-node: {result['action']} {_p(result['file'])}"
    print(line, file=out)
    if quiet:
        return EXIT_OK
    print(
        "  at its next start ComfyUI makes comfy-env use comfy_standin "
        "stand-ins and\n  serves GET /comfy_standin/status; it registers "
        "no nodes.\n"
        f"  ComfyUI must run with this Python (comfy_standin is installed "
        f"here):\n    {_p(result['python'])}\n"
        f"  undo: {_p(result['undo'])}",
        file=out,
    )
    if not result["comfy_env_importable"]:
        print("  note: comfy-env is not importable from this Python; the "
              "entry will log\n  'not switched on' until it is.", file=out)
    return EXIT_OK


# ---------------------------------------------------------------------------
# uninstall


def _caches(entry_fd: int, folder: str) -> tuple[int | None, list[str]]:
    """(descriptor of __pycache__ or None, the names in it to delete).
    Refused when __pycache__ or one of the entry's caches is a link."""
    cache_path = os.path.join(folder, CACHE_DIR)
    with _step(f"cannot read {_p(folder)}"):
        st = _lstat(CACHE_DIR, entry_fd)
    if st is None or not (stat.S_ISDIR(st.st_mode)
                          or stat.S_ISLNK(st.st_mode)):
        return None, []  # no cache folder (a file by that name stays)
    if stat.S_ISLNK(st.st_mode):
        raise _link_refusal(cache_path, CACHE_DIR, entry_fd,
                            "uninstall-node")
    cache_fd = _open_dir(CACHE_DIR, entry_fd, cache_path, "uninstall-node")
    try:
        doomed = []
        with _step(f"cannot read {_p(cache_path)}"):
            for name in os.listdir(cache_fd):
                if not _OWN_CACHE.match(name):
                    continue
                member = _lstat(name, cache_fd)
                if member is None:
                    continue
                if stat.S_ISLNK(member.st_mode):
                    raise _link_refusal(os.path.join(cache_path, name),
                                        name, cache_fd, "uninstall-node")
                if stat.S_ISREG(member.st_mode):
                    doomed.append(name)
    except BaseException:
        os.close(cache_fd)
        raise
    return cache_fd, sorted(doomed)


def _uninstall(comfyui: str) -> dict[str, Any]:
    _supported()
    nodes, nodes_fd = _open_custom_nodes(comfyui)
    folder = os.path.join(nodes, NODE_DIR)
    result: dict[str, Any] = {
        "command": "uninstall-node",
        "comfyui": os.path.dirname(nodes),
        "entry": folder,
        "removed": [],
        "kept": [],
    }
    try:
        with _step(f"cannot read {_p(nodes)}"):
            st = _lstat(NODE_DIR, nodes_fd)
        if st is None:
            result["action"] = "not installed"
            return result
        if stat.S_ISLNK(st.st_mode):
            raise _link_refusal(folder, NODE_DIR, nodes_fd, "uninstall-node")
        if not stat.S_ISDIR(st.st_mode):
            raise Refused(f"{_p(folder)} is not a folder and was not "
                          f"written by comfy_standin; left as it is")
        entry_fd = _open_dir(NODE_DIR, nodes_fd, folder, "uninstall-node")
        try:
            current = _check_entry_file(entry_fd, folder, "uninstall-node")
            if current is None:  # only an empty folder may go then
                with _step(f"cannot read {_p(folder)}"):
                    others = os.listdir(entry_fd)
                if others:
                    raise Refused(f"{_p(folder)} was not written by "
                                  f"comfy_standin; left as it is")
            # Every link is refused before anything is removed.
            cache_fd, caches = _caches(entry_fd, folder)
            try:
                # Caches first: a failure then leaves a working entry that
                # a second run can remove.
                cache_path = os.path.join(folder, CACHE_DIR)
                for name in caches:
                    path = os.path.join(cache_path, name)
                    with _step(f"cannot remove {_p(path)}"):
                        os.unlink(name, dir_fd=cache_fd)
                    result["removed"].append(path)
                if cache_fd is not None:
                    try:
                        os.rmdir(CACHE_DIR, dir_fd=entry_fd)
                    except OSError:
                        pass  # not empty: it holds others' files, kept
                    else:
                        result["removed"].append(cache_path)
            finally:
                if cache_fd is not None:
                    os.close(cache_fd)
            if current is not None:
                target = os.path.join(folder, ENTRY_FILE)
                with _step(f"cannot remove {_p(target)}"):
                    os.unlink(ENTRY_FILE, dir_fd=entry_fd)
                result["removed"].append(target)
            with _step(f"cannot read {_p(folder)}"):
                kept = sorted(os.listdir(entry_fd))
        finally:
            os.close(entry_fd)
        if kept:
            result["action"] = "removed, folder kept"
            result["kept"] = [os.path.join(folder, name) for name in kept]
            return result
        with _step(f"removed the entry's files; cannot remove "
                   f"{_p(folder)}"):
            os.rmdir(NODE_DIR, dir_fd=nodes_fd)
        result["removed"].append(folder)
        result["action"] = "removed"
        return result
    finally:
        os.close(nodes_fd)


def uninstall(comfyui: str, out: TextIO, *, json_output: bool = False,
              quiet: bool = False, verbose: bool = False,
              err: TextIO | None = None) -> int:
    """Removes the entry if this command wrote it; idempotent.  Output
    as for ``install``; `verbose`: also every path removed and kept."""
    try:
        result = _uninstall(comfyui)
    except Refused as exc:
        return _refuse("uninstall-node", exc, err)
    if json_output:
        _emit_json(out, result)
        return EXIT_OK
    folder = _p(result["entry"])
    action = result["action"]
    if action == "not installed":
        print(f"uninstall-node: not installed: {folder} does not exist "
              f"(nothing changed)", file=out)
    elif action == "removed":
        print(f"uninstall-node: removed {folder}; ComfyUI uses comfy-env's "
              f"own stand-ins from its next start", file=out)
    else:
        names = [os.path.basename(p) for p in result["kept"]]
        shown = ", ".join(visible(n, 80) for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        print(f"uninstall-node: removed the entry; {folder} kept (it holds "
              f"other files: {shown}{more})", file=out)
    if verbose and not quiet:
        for word in ("removed", "kept"):
            for path in result[word]:
                print(f"  {word} {_p(path)}", file=out)
    return EXIT_OK


# ---------------------------------------------------------------------------
# output


def _refuse(command: str, exc: Refused, err: TextIO | None) -> int:
    print(f"{command}: refused: {exc}", file=sys.stderr if err is None
          else err)
    return EXIT_REFUSED


def _emit_json(out: TextIO, data: dict[str, Any]) -> None:
    # ensure_ascii: a file name that is not valid UTF-8 (a lone surrogate
    # after os.fsdecode) still makes valid JSON.
    print(json_text(data, indent=2, sort_keys=True, ensure_ascii=True),
          file=out)


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
