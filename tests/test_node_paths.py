"""``install-node`` / ``uninstall-node`` in a folder other users share.

``custom_nodes`` may be writable by others, so everything found below it
is hostile: a link at the entry folder, at ``__init__.py``, at
``__pycache__`` or at a cache file; a planted temporary name; a foreign
file; a folder that cannot be written; a path that is a file.  The
commands run in this process through ``comfy_standin.__main__.main`` (as
the console script does), and in a subprocess where the printed undo
command is run as printed.

Read-only folders: tests run as root in CI, and permission bits do not
stop root.  As root a folder is made immutable (``chattr +i``, which needs
CAP_LINUX_IMMUTABLE and a file system with the flag: ext4, xfs, btrfs);
as any other user it is ``chmod 0555``.  Either way the fixture first
checks that a write into the folder really fails, so a test cannot pass
on a folder that was writable after all.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import py_compile
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comfy_standin import __main__ as cli
from comfy_standin import _node

TIMEOUT = 120
OWN_CACHE = f"__init__.{sys.implementation.cache_tag}.pyc"


def make_comfyui(root: Path) -> Path:
    (root / "custom_nodes").mkdir(parents=True)
    (root / "main.py").write_text("# ComfyUI\n")
    return root


@pytest.fixture
def comfyui(tmp_path: Path) -> Path:
    return make_comfyui(tmp_path / "ComfyUI")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside ComfyUI that nothing may touch."""
    victim = tmp_path / "outside"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious\n")
    (victim / OWN_CACHE).write_bytes(b"someone else's bytecode")
    (victim / "__init__.py").write_text(
        f'"""{_node.MARKER}, format 0 (a decoy outside ComfyUI)"""\n')
    return victim


def entry(comfyui: Path) -> Path:
    return comfyui / "custom_nodes" / _node.NODE_DIR


def snapshot(path: Path) -> dict[str, tuple[str, object]]:
    """Everything under `path`, links not followed: name -> (kind,
    content, mode)."""
    seen: dict[str, tuple[str, object]] = {}
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(folder, name)
            st_ = os.lstat(full)
            rel = os.path.relpath(full, path)
            if stat.S_ISLNK(st_.st_mode):
                seen[rel] = ("link", os.readlink(full))
            elif stat.S_ISDIR(st_.st_mode):
                seen[rel] = ("dir", stat.S_IMODE(st_.st_mode))
            else:
                with open(full, "rb") as f:
                    seen[rel] = ("file", (f.read(), st_.st_mode))
    return seen


def run(capsys: pytest.CaptureFixture[str], *argv: str
        ) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def refused(code: int, out: str, err: str, *words: str) -> str:
    """Exit 1, nothing on stdout, one line on stderr holding `words`."""
    assert code == _node.EXIT_REFUSED, (code, out, err)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    line = lines[0]
    assert ": refused: " in line, line
    for word in words:
        assert word in line, line
    return line


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """`folder` cannot be written by this process (see the module
    docstring for how, and why)."""
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(folder)],
                              capture_output=True, text=True)
        assert done.returncode == 0, (
            f"chattr +i {folder}: {done.stderr.strip()}; running as root, "
            f"the read-only tests need the immutable flag (ext4, xfs, "
            f"btrfs and CAP_LINUX_IMMUTABLE) to stop root from writing")

        def undo() -> None:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        mode = stat.S_IMODE(folder.stat().st_mode)
        folder.chmod(0o555)

        def undo() -> None:
            folder.chmod(mode)
    try:
        probe = folder / ".probe"
        with pytest.raises(PermissionError):
            probe.write_text("x")  # the folder really is read-only
        yield
    finally:
        undo()


# ---------------------------------------------------------------------------
# links at every path component


def test_a_linked_comfyui_folder_is_the_users_own(tmp_path, capsys):
    """The path the user typed may go through links (ComfyUI itself
    linked from elsewhere): followed once, the entry lands in the real
    folder, and the undo hint removes it from the same path."""
    real = make_comfyui(tmp_path / "real-ComfyUI")
    link = tmp_path / "ComfyUI"
    link.symlink_to(real)
    code, out, err = run(capsys, "install-node", str(link))
    assert (code, err) == (0, "")
    assert (entry(real) / "__init__.py").read_text() == _node.template()
    assert run(capsys, "uninstall-node", str(link))[0] == 0
    assert not entry(real).exists()


def test_a_linked_custom_nodes_is_the_users_own(comfyui, tmp_path, capsys):
    shared = tmp_path / "shared-nodes"
    shared.mkdir()
    (comfyui / "custom_nodes").rmdir()
    (comfyui / "custom_nodes").symlink_to(shared)
    code, out, err = run(capsys, "install-node", str(comfyui))
    assert (code, err) == (0, "")
    assert (shared / _node.NODE_DIR / "__init__.py").is_file()
    assert run(capsys, "uninstall-node", str(comfyui))[0] == 0
    assert os.listdir(shared) == []


@pytest.mark.parametrize("command", ["install-node", "uninstall-node"])
def test_an_entry_folder_that_is_a_link_is_refused(comfyui, outside,
                                                   capsys, command):
    """The entry name links to a folder outside ComfyUI holding a file
    with our marker: followed, install would write there and uninstall
    would delete there."""
    before = snapshot(outside)
    entry(comfyui).symlink_to(outside)
    code, out, err = run(capsys, command, str(comfyui))
    refused(code, out, err, "symbolic link", str(entry(comfyui)),
            str(outside))
    assert snapshot(outside) == before
    assert os.readlink(entry(comfyui)) == str(outside)


@pytest.mark.parametrize("command", ["install-node", "uninstall-node"])
def test_an_entry_file_that_is_a_link_is_refused(comfyui, outside, capsys,
                                                 command):
    entry(comfyui).mkdir()
    (entry(comfyui) / "__init__.py").symlink_to(outside / "__init__.py")
    before = snapshot(outside)
    code, out, err = run(capsys, command, str(comfyui))
    refused(code, out, err, "symbolic link", "__init__.py")
    assert snapshot(outside) == before
    assert (entry(comfyui) / "__init__.py").is_symlink()


@pytest.mark.parametrize("command", ["install-node", "uninstall-node"])
def test_a_pycache_that_is_a_link_is_refused(comfyui, outside, capsys,
                                             command):
    """uninstall would delete in the linked folder; an install would let
    ComfyUI's own import write its bytecode there."""
    assert run(capsys, "install-node", str(comfyui))[0] == 0
    (entry(comfyui) / "__pycache__").symlink_to(outside)
    before = snapshot(outside)
    mine = snapshot(entry(comfyui))
    code, out, err = run(capsys, command, str(comfyui))
    refused(code, out, err, "symbolic link", "__pycache__")
    assert snapshot(outside) == before
    assert snapshot(entry(comfyui)) == mine  # nothing removed first


def test_a_cache_file_that_is_a_link_is_refused(comfyui, outside, capsys):
    assert run(capsys, "install-node", str(comfyui))[0] == 0
    cache = entry(comfyui) / "__pycache__"
    cache.mkdir()
    (cache / "__init__.cpython-39.pyc").write_bytes(b"ours")
    (cache / OWN_CACHE).symlink_to(outside / OWN_CACHE)
    before = snapshot(outside)
    mine = snapshot(entry(comfyui))
    code, out, err = run(capsys, "uninstall-node", str(comfyui))
    refused(code, out, err, "symbolic link", OWN_CACHE)
    assert snapshot(outside) == before
    assert snapshot(entry(comfyui)) == mine


def test_a_planted_temporary_name_is_never_followed(comfyui, outside,
                                                    capsys):
    """An update while a link sits at the name the old install-node
    wrote through (``__init__.py.tmp``), and at every other name a
    writer might pick: the template lands only in the entry's own
    regular file."""
    assert run(capsys, "install-node", str(comfyui))[0] == 0
    target = entry(comfyui) / "__init__.py"
    target.write_text(f'"""{_node.MARKER}, format 0"""\n')
    for name in ("__init__.py.tmp", ".__init__.py.tmp", "__init__.pyc"):
        (entry(comfyui) / name).symlink_to(outside / "keep.txt")
    before = snapshot(outside)
    code, out, err = run(capsys, "install-node", str(comfyui))
    assert (code, err) == (0, ""), err
    assert "updated" in out
    assert snapshot(outside) == before
    assert not target.is_symlink() and target.read_text() == \
        _node.template()
    assert (entry(comfyui) / "__init__.py.tmp").is_symlink()


def test_a_link_swapped_in_after_the_check_is_not_followed(
        comfyui, outside, capsys, monkeypatch):
    """The entry folder is replaced by a link between the look and the
    open: the open does not follow it (O_NOFOLLOW), the command refuses."""
    real_lstat = _node._lstat
    swapped = []

    def lstat_then_swap(name, dir_fd):
        result = real_lstat(name, dir_fd)
        if name == _node.NODE_DIR and not swapped:
            swapped.append(name)
            folder = entry(comfyui)
            os.rename(folder, folder.with_name("moved-away"))
            folder.symlink_to(outside)
        return result

    assert run(capsys, "install-node", str(comfyui))[0] == 0
    (entry(comfyui) / "__init__.py").write_text(
        f'"""{_node.MARKER}, format 0"""\n')
    before = snapshot(outside)
    monkeypatch.setattr(_node, "_lstat", lstat_then_swap)
    code, out, err = run(capsys, "install-node", str(comfyui))
    refused(code, out, err, "symbolic link")
    assert snapshot(outside) == before


# ---------------------------------------------------------------------------
# read-only folders, paths that are files, OSErrors


def test_a_read_only_custom_nodes_is_one_line(comfyui, capsys):
    with read_only(comfyui / "custom_nodes"):
        code, out, err = run(capsys, "install-node", str(comfyui))
    refused(code, out, err, "cannot create", str(entry(comfyui)))
    assert not entry(comfyui).exists()


def test_a_read_only_entry_is_left_whole(comfyui, capsys):
    assert run(capsys, "install-node", str(comfyui))[0] == 0
    old = f'"""{_node.MARKER}, format 0"""\n'
    (entry(comfyui) / "__init__.py").write_text(old)
    (entry(comfyui) / "__pycache__").mkdir()
    (entry(comfyui) / "__pycache__" / OWN_CACHE).write_bytes(b"x")
    before = snapshot(entry(comfyui))
    with read_only(entry(comfyui)):
        code, out, err = run(capsys, "install-node", str(comfyui))
        refused(code, out, err, "cannot write", "__init__.py")
        code, out, err = run(capsys, "uninstall-node", str(comfyui))
        # the cache folder is writable: its file goes, the entry stays
        refused(code, out, err, "cannot remove", "__init__.py")
    after = snapshot(entry(comfyui))
    assert after["__init__.py"] == before["__init__.py"]
    assert [n for n in after if n.startswith(".")] == []  # no temp left


def test_uninstall_in_a_read_only_custom_nodes(comfyui, capsys):
    assert run(capsys, "install-node", str(comfyui))[0] == 0
    with read_only(comfyui / "custom_nodes"):
        code, out, err = run(capsys, "uninstall-node", str(comfyui))
    refused(code, out, err, "removed the entry's files", "cannot remove",
            str(entry(comfyui)))
    assert os.listdir(entry(comfyui)) == []  # the folder alone is left
    assert run(capsys, "uninstall-node", str(comfyui))[0] == 0
    assert not entry(comfyui).exists()


@pytest.mark.parametrize("what", ["comfyui", "custom_nodes", "entry",
                                  "through_a_file"])
def test_a_path_that_is_a_file(comfyui, capsys, what):
    path = str(comfyui)
    if what == "comfyui":
        path = str(comfyui / "main.py")
        words = ["not a folder"]
    elif what == "custom_nodes":
        (comfyui / "custom_nodes").rmdir()
        (comfyui / "custom_nodes").write_text("")
        words = ["not a ComfyUI folder", "custom_nodes"]
    elif what == "entry":
        entry(comfyui).write_text("a file\n")
        words = ["is not a folder"]
    else:
        path = str(comfyui / "main.py" / "deeper")
        words = ["no such folder"]
    before = snapshot(comfyui)
    for command in ("install-node", "uninstall-node"):
        code, out, err = run(capsys, command, path)
        refused(code, out, err, *words)
    assert snapshot(comfyui) == before


@pytest.mark.parametrize("failing", ["write", "fsync", "replace", "mkdir"])
def test_every_os_error_is_the_one_line_refusal(comfyui, capsys,
                                                monkeypatch, failing):
    assert run(capsys, "install-node", str(comfyui))[0] == 0
    if failing == "mkdir":
        (entry(comfyui) / "__init__.py").unlink()
        entry(comfyui).rmdir()
    else:
        (entry(comfyui) / "__init__.py").write_text(
            f'"""{_node.MARKER}, format 0"""\n')
    before = snapshot(comfyui)

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_node.os, failing, fail)
    code, out, err = run(capsys, "install-node", str(comfyui))
    refused(code, out, err, os.strerror(errno.ENOSPC))
    monkeypatch.undo()
    assert snapshot(comfyui) == before  # no temporary file, no folder


# ---------------------------------------------------------------------------
# what uninstall removes


def test_uninstall_removes_only_the_entry_and_its_own_caches(comfyui,
                                                             capsys):
    assert run(capsys, "install-node", str(comfyui))[0] == 0
    source = entry(comfyui) / "__init__.py"
    compiled = py_compile.compile(str(source), doraise=True)  # real cache
    assert os.path.basename(compiled) == OWN_CACHE
    cache = entry(comfyui) / "__pycache__"
    theirs = ["other.cpython-311.pyc", "__init__.cpython-311.pyc.1234",
              "__init__.txt", "x.pyc"]
    others = {"__init__.cpython-39.pyc", "__init__.cpython-314.opt-1.pyc"}
    for name in sorted(others - {OWN_CACHE}) + theirs:
        (cache / name).write_bytes(b"")
    (cache / "__init__.cpython-38.pyc").mkdir()  # not a regular file
    (entry(comfyui) / "notes.txt").write_text("mine")
    code, out, err = run(capsys, "uninstall-node", str(comfyui))
    assert (code, err) == (0, "")
    assert "kept" in out and "notes.txt" in out
    assert sorted(os.listdir(cache)) == sorted(
        theirs + ["__init__.cpython-38.pyc"])
    assert sorted(os.listdir(entry(comfyui))) == ["__pycache__",
                                                   "notes.txt"]


def test_uninstall_removes_an_empty_folder_of_ours(comfyui, capsys):
    entry(comfyui).mkdir()  # an install that stopped after mkdir
    code, out, err = run(capsys, "uninstall-node", str(comfyui))
    assert (code, err) == (0, "") and "removed" in out
    assert not entry(comfyui).exists()


def test_a_foreign_file_in_the_entry_folder_stays(comfyui, capsys):
    assert run(capsys, "install-node", str(comfyui))[0] == 0
    foreign = entry(comfyui) / "foreign.py"
    foreign.write_text("print('not ours')\n")
    (entry(comfyui) / "__init__.py").write_text(
        f'"""{_node.MARKER}, format 0"""\n')
    code, out, err = run(capsys, "install-node", str(comfyui))
    assert (code, err) == (0, "") and "updated" in out
    assert foreign.read_text() == "print('not ours')\n"
    code, out, err = run(capsys, "uninstall-node", str(comfyui))
    assert code == 0 and "foreign.py" in out
    assert os.listdir(entry(comfyui)) == ["foreign.py"]


# ---------------------------------------------------------------------------
# unicode and relative paths, the undo hint, output modes


def test_relative_unicode_path_and_a_runnable_undo_hint(tmp_path, capsys,
                                                        monkeypatch):
    make_comfyui(tmp_path / "Cömfy UI ☃" / "ComfyUI")
    monkeypatch.chdir(tmp_path)
    relative = os.path.join("Cömfy UI ☃", "ComfyUI")
    code, out, err = run(capsys, "install-node", relative)
    assert (code, err) == (0, "")
    absolute = str(tmp_path / relative)
    assert os.path.join(absolute, "custom_nodes", _node.NODE_DIR) in out
    (undo,) = [line.split("undo: ", 1)[1] for line in out.splitlines()
               if "undo: " in line]
    argv = shlex.split(undo)
    assert argv == [sys.executable, "-m", "comfy_standin", "uninstall-node",
                    absolute]
    done = subprocess.run(argv, capture_output=True, text=True,
                          timeout=TIMEOUT, cwd="/")
    assert done.returncode == 0, done.stderr
    assert not entry(tmp_path / relative).exists()


def test_control_characters_in_paths_stay_visible(tmp_path, capsys):
    hostile = tmp_path / "C\x1b]52;c;cHduZWQ=\x07\n\u202eUI"
    make_comfyui(hostile)
    code, out, err = run(capsys, "install-node", "--quiet", str(hostile))
    assert code == 0 and err == ""
    assert out.count("\n") == 1 and "\x1b" not in out and "\x07" not in out
    assert "\\x1b]52" in out and "\\u202e" in out
    data = json.loads(run(capsys, "install-node", "--json",
                          str(hostile))[1])
    assert data["entry"] == str(entry(hostile))  # raw in JSON, escaped
    # a file name that is not UTF-8 is named, not a UnicodeEncodeError
    os.close(os.open(os.path.join(os.fsencode(entry(hostile)),
                                  b"bad\xffname"), os.O_CREAT | os.O_WRONLY))
    code, out, err = run(capsys, "uninstall-node", str(hostile))
    assert code == 0 and err == "" and "bad\\udcffname" in out


def test_json_and_quiet(comfyui, capsys):
    code, out, err = run(capsys, "install-node", "--json", str(comfyui))
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["action"] == "installed" and data["python"] == \
        sys.executable
    assert data["file"] == str(entry(comfyui) / "__init__.py")
    assert shlex.split(data["undo"])[0] == sys.executable
    code, out, err = run(capsys, "install-node", "--quiet", str(comfyui))
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"install-node: already installed: {entry(comfyui)} "
        f"(nothing changed)"]
    code, out, err = run(capsys, "uninstall-node", "--json", str(comfyui))
    data = json.loads(out)
    assert (code, err, data["action"]) == (0, "", "removed")
    assert data["removed"] == [str(entry(comfyui) / "__init__.py"),
                               str(entry(comfyui))]
    code, out, err = run(capsys, "uninstall-node", "--quiet", str(comfyui))
    assert code == 0 and len(out.splitlines()) == 1 and "not installed" in out


@pytest.mark.parametrize("mode", [[], ["--json"], ["--quiet"]])
def test_refusals_go_to_stderr_in_every_mode(comfyui, capsys, mode):
    entry(comfyui).mkdir()
    (entry(comfyui) / "__init__.py").write_text("NODE_CLASS_MAPPINGS = {}\n")
    for command in ("install-node", "uninstall-node"):
        code, out, err = run(capsys, command, *mode, str(comfyui))
        refused(code, out, err, "not written by comfy_standin")


def test_refusal_from_a_subprocess_is_one_stderr_line(comfyui, outside):
    entry(comfyui).symlink_to(outside)
    done = subprocess.run(
        [sys.executable, "-m", "comfy_standin", "uninstall-node", "--json",
         str(comfyui)], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in \
        done.stderr


# ---------------------------------------------------------------------------
# the harness: a neighbour plants anything at the entry's names

NAMES = ["__init__.py", "__pycache__", "__init__.py.tmp", "notes.txt",
         f"__pycache__/{OWN_CACHE}", "__pycache__/__init__.cpython-310.pyc",
         "__pycache__/other.pyc"]
KINDS = ["ours", "foreign", "empty_dir", "link_file", "link_dir",
         "dangling"]


def plant(folder: Path, name: str, kind: str, outside: Path) -> None:
    path = folder / name
    if not path.parent.is_dir() or os.path.lexists(path):
        return  # the parent is not a real folder, or taken already
    if kind == "ours":
        path.write_text(f'"""{_node.MARKER}, format 0"""\n')
    elif kind == "foreign":
        path.write_text("foreign\n")
    elif kind == "empty_dir":
        path.mkdir()
    elif kind == "link_file":
        path.symlink_to(outside / "keep.txt")
    elif kind == "link_dir":
        path.symlink_to(outside)
    else:
        path.symlink_to(outside / "nothing-here")


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(planted=st.lists(st.tuples(st.sampled_from(NAMES),
                                  st.sampled_from(KINDS)), max_size=6),
       entry_kind=st.sampled_from(["none", "dir", "link_dir", "file"]),
       commands=st.lists(st.sampled_from(["install-node",
                                          "uninstall-node"]),
                         min_size=1, max_size=3))
def test_hostile_trees(tmp_path_factory, capsys, planted, entry_kind,
                       commands):
    """Whatever a neighbour planted: nothing outside changes, a refusal
    is one line on stderr, and a file is deleted only if it is our entry
    file or one of its caches."""
    base = tmp_path_factory.mktemp("hostile")
    comfyui = make_comfyui(base / "ComfyUI")
    outside = base / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious\n")
    (outside / "__init__.py").write_text(f'"""{_node.MARKER}"""\n')
    folder = entry(comfyui)
    if entry_kind == "dir":
        folder.mkdir()
    elif entry_kind == "link_dir":
        folder.symlink_to(outside)
    elif entry_kind == "file":
        folder.write_text("x\n")
    if entry_kind == "dir":
        for name, kind in planted:
            plant(folder, name, kind, outside)
    outside_before = snapshot(outside)
    for command in commands:
        before = snapshot(comfyui)
        code, out, err = run(capsys, command, str(comfyui))
        after = snapshot(comfyui)
        assert snapshot(outside) == outside_before
        if code == _node.EXIT_REFUSED:
            refused(code, out, err)
        else:
            assert code == 0 and err == "", err
        gone = set(before) - set(after)
        prefix = os.path.join("custom_nodes", _node.NODE_DIR)
        allowed = {prefix, os.path.join(prefix, "__init__.py"),
                   os.path.join(prefix, "__pycache__")}
        for name in gone:
            assert name in allowed or _node._OWN_CACHE.match(
                os.path.basename(name)), (command, name)
            if name != prefix and before[name][0] == "file" and \
                    name.endswith("__init__.py"):
                assert _node.MARKER.encode() in before[name][1][0]
        for name in set(after) & set(before):
            if before[name][0] == "link":
                assert after[name] == before[name]  # links stay as they are
