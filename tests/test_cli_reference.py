"""docs/cli.md's reference agrees with the parser and with ``--help``;
every exit code in its one table happens as documented."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from benchload import TOOLS_DIR, load_bench

from comfy_standin import __main__ as cli

clidoc = load_bench("clidoc", folder=TOOLS_DIR)

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
TIMEOUT = 120


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "comfy_standin", *args],
        capture_output=True, text=True, timeout=TIMEOUT,
        env={**os.environ, "COLUMNS": "200", **(env or {})})


def doc_sections():
    """{command: set of option strings its doc table lists}; "" is the
    top level, "*" the options every command takes."""
    text = DOC.read_text()
    block = text[text.index(clidoc.BEGIN):text.index(clidoc.END)]
    sections: dict[str, set[str]] = {"": set()}
    current = ""
    for line in block.splitlines():
        heading = re.match(r"### (\S+)", line)
        if heading:
            current = heading.group(1)
            sections[current] = set()
        elif line.startswith("Every command also takes"):
            current = "*"
            sections[current] = set()
        cell = re.match(r"\| `([^`]+)` \|", line)
        if cell:
            sections[current] |= set(
                re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", cell.group(1)))
    return sections


def help_options(*command):
    """The option strings ``--help`` lists for `command`."""
    result = run(*command, "--help")
    assert result.returncode == 0, result.stderr
    found = set(re.findall(r"^\s+((?:-{1,2}[a-z][\w-]*(?:[ =]\S+)?"
                           r"(?:, )?)+)", result.stdout, re.M))
    options = set()
    for entry in found:
        options |= set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", entry))
    return options - {"-h", "--help"}, result.stdout


def test_the_generated_block_is_current():
    text = DOC.read_text()
    assert clidoc.rewrite(text) == text, (
        "docs/cli.md is stale: run python tools/clidoc.py "
        "docs/cli.md")


def test_the_check_command_says_when_stale(tmp_path):
    stale = tmp_path / "cli.md"
    stale.write_text(f"intro\n{clidoc.BEGIN}\nold\n{clidoc.END}\nend\n")
    assert clidoc.main(["--check", str(stale)]) == 1
    assert clidoc.main([str(stale)]) == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith("\nend\n")
    assert clidoc.main(["--check", str(stale)]) == 0


def test_the_rewrite_never_writes_through_a_link(tmp_path):
    """The page is written to a fresh file and renamed over the path: a
    link planted at the path (or at a predictable temporary name) is
    replaced, never written through."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours\n")
    source = tmp_path / "real.md"
    source.write_text(f"intro\n{clidoc.BEGIN}\nold\n{clidoc.END}\nend\n")
    page = tmp_path / "cli.md"
    page.symlink_to(source)
    (tmp_path / ".cli.md.tmp").symlink_to(outside)
    assert clidoc.main([str(page)]) == 0
    assert not page.is_symlink()
    assert clidoc.BEGIN in page.read_text()
    assert "old" in source.read_text()  # the link's target is untouched
    assert outside.read_text() == "not yours\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".cli.md.tmp", "cli.md", "outside.txt", "real.md"]


def test_every_command_is_documented_and_in_help():
    documented = set(doc_sections()) - {"", "*", "Exit"}
    _, top = help_options()
    parser_commands = set(clidoc.subcommands(cli.build_parser()))
    assert documented == parser_commands
    assert {"demo", "status", "probe", "selfcheck", "install-node",
            "uninstall-node"} <= documented
    for name in documented:
        assert re.search(rf"^\s+{re.escape(name)}\s", top, re.M), name


@pytest.mark.parametrize(
    "command", sorted(clidoc.subcommands(cli.build_parser())))
def test_doc_and_help_list_the_same_options(command):
    sections = doc_sections()
    listed, text = help_options(command)
    assert sections[command] | sections["*"] == listed
    # Each option's help text, as the doc has it, is what --help says.
    parser = clidoc.subcommands(cli.build_parser())[command][0]
    flat = " ".join(text.split())
    for action in parser._actions:
        if action.help and "%(" not in action.help:
            assert " ".join(action.help.split()) in flat, action.help


def test_status_doc_names_url_watch_open():
    assert {"--url", "--watch", "--open", "--timeout"} <= doc_sections()[
        "status"]


def documented_codes():
    text = DOC.read_text()
    block = text[text.index("### Exit codes"):text.index(clidoc.END)]
    return [int(code) for code in re.findall(r"^\| (\d+) \|", block, re.M)]


def test_one_exit_code_table():
    assert documented_codes() == [code for code, _ in cli.EXIT_CODES]
    text = DOC.read_text()
    assert text.count("| code | meaning |") == 1
    epilog = cli.build_parser().epilog
    for code, _ in cli.EXIT_CODES:
        assert f" {code} " in epilog


def interrupted(signum):
    """``status --watch`` in a subprocess, stopped by `signum` once it
    has printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "comfy_standin", "status", "--watch", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, err


def happens(code):
    """Make `code` happen the way EXIT_CODES says it does."""
    if code == cli.EXIT_OK:
        result = run("status")
        return [(result.returncode, result.stderr)]
    if code == cli.EXIT_FAILED:
        out = []
        for args in (["status", "--url", "http://HOST:PORT"],
                     ["install-node", "/nonexistent/comfyui"],
                     ["uninstall-node", "/nonexistent/comfyui"]):
            result = run(*args)
            out.append((result.returncode, result.stderr))
        return out
    if code == cli.EXIT_USAGE:
        return [(run(*args).returncode, "") for args in (
            ["no-such-command"], [], ["status", "--open"],
            ["status", "--watch", "0"])]
    if code == cli.EXIT_NO_GPU:
        result = run("probe", "--require-gpu",
                     env={"COMFY_STANDIN_PROBE_DISABLE": "1"})
        return [(result.returncode, result.stderr)]
    if code == cli.EXIT_INTERRUPTED:
        return [interrupted(signal.SIGINT)]
    if code == cli.EXIT_TERMINATED:
        return [interrupted(signal.SIGTERM)]
    raise AssertionError(f"exit code {code} has no case here: add one")


@pytest.mark.parametrize("code", [code for code, _ in cli.EXIT_CODES])
def test_each_exit_code_happens(code):
    for returned, err in happens(code):
        assert returned == code, err
