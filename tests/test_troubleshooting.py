"""docs/troubleshooting.md lists every line comfy_standin can write to
ComfyUI's log.

The lines are read from the source: in Python (python/comfy_standin,
the node entry's template included) every ``log``/``_log``/``logger``
call at level info and above, and the messages handed to the adapter's
``_warn_once`` and ``_note``; in C (src/) every ``cs_log_warning``.  A
message's placeholders (``%s``, ``%R``, ``{expr}`` of an f-string, ...)
become ``…``; the page gives each message in that form a heading of its
own (in backticks), with what it means and what to do.
The test fails naming each message the page lacks (with its file, line
and level) and each entry of the page no message produces any more.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
PYTHON = ROOT / "python" / "comfy_standin"
C_SOURCES = ROOT / "src"

LOGGERS = {"log", "_log", "logger"}
LEVELS = {"info", "warning", "error", "exception", "critical"}
#: Helpers that log the message given as their argument `index`.
HELPERS = {"_warn_once": 1, "_note": 1, "_note_once": 2}
#: A message is one of these: what a placeholder becomes.
HOLE = "…"
PRINTF = re.compile(r"%(?:\d+\$)?[-+ #0]*\d*(?:\.\d+)?(?:hh|h|ll|l|z|j|t)?"
                    r"[diouxXeEfgGcsrRSUVAap]")
#: What starts a message of ours (anything else is not one of our lines).
PREFIXES = ("comfy_standin:", "[comfy-standin]")


@dataclass(frozen=True)
class Message:
    text: str   # with placeholders as HOLE
    where: str  # file:line
    level: str


def canonical(template: str) -> str:
    text = PRINTF.sub(HOLE, template.replace("%%", "\0"))
    return " ".join(text.replace("\0", "%").split())


def literal(node: ast.AST) -> str | None:
    """The template of a message expression: str constants, f-strings
    (each formatted value a hole) and their + concatenation; None when
    the message is not written at the call."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value).replace("%", "%%"))
            else:
                parts.append(HOLE)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = literal(node.left), literal(node.right)
        if left is not None and right is not None:
            return left + right
    return None


def python_messages(text: str, where: str
                    ) -> tuple[list[Message], list[str]]:
    """(messages, calls whose message is not written at the call) of the
    Python source `text` of the file named `where`."""
    found, unreadable = [], []
    tree = ast.parse(text, where)
    # A helper's own calls pass on their caller's message (read there).
    inside_helpers = {
        id(call) for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef) and function.name in HELPERS
        for call in ast.walk(function) if isinstance(call, ast.Call)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in LEVELS
                and isinstance(func.value, ast.Name)
                and func.value.id in LOGGERS):
            level, index = func.attr, 0
        elif isinstance(func, ast.Name) and func.id in HELPERS:
            level, index = "warning", HELPERS[func.id]
        else:
            continue
        if len(node.args) <= index:
            continue
        argument = node.args[index]
        if id(node) in inside_helpers and isinstance(argument, ast.Name):
            continue
        template = literal(argument)
        if (template is not None and isinstance(func, ast.Name)
                and func.id == "_warn_once" and node.keywords):
            # _warn_once(kind, template, **worker_text): str.format fields
            template = re.sub(r"\{[A-Za-z_]\w*\}", HOLE, template)
        if template is None:
            unreadable.append(f"{where}:{node.lineno}")
        elif canonical(template).strip(HOLE + " "):
            found.append(Message(canonical(template),
                                 f"{where}:{node.lineno}", level))
        # else "%s": a helper passing on its caller's message, which is
        # read at the caller
    found.sort(key=lambda m: int(m.where.rsplit(":", 1)[1]))
    return found, unreadable


C_CALL = re.compile(r"\bcs_log_warning\s*\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)")
C_STRING = re.compile(r"\"((?:[^\"\\]|\\.)*)\"")


def c_messages(path: Path) -> list[Message]:
    text = path.read_text()
    found = []
    for call in C_CALL.finditer(text):
        template = "".join(C_STRING.findall(call.group(1)))
        template = template.encode().decode("unicode_escape")
        line = text.count("\n", 0, call.start()) + 1
        found.append(Message(canonical(template),
                             f"{path.relative_to(ROOT)}:{line}", "warning"))
    return found


def source_messages() -> tuple[list[Message], list[str]]:
    messages, unreadable = [], []
    for path in sorted(PYTHON.rglob("*.py")) + sorted(
            PYTHON.rglob("*.py.tmpl")):
        if path.name in ("_demo.py", "_demo_worker.py", "__main__.py"):
            continue  # the demo's and the CLI's own output, not a log
        got, bad = python_messages(path.read_text(),
                                   str(path.relative_to(ROOT)))
        messages += got
        unreadable += bad
    for path in sorted(C_SOURCES.glob("*.c")):
        messages += c_messages(path)
    ours = [m for m in messages if m.text.startswith(PREFIXES)]
    return ours, unreadable


def page_entries(text: str) -> set[str]:
    """The messages the page explains: one heading each, the message in
    backticks."""
    return {canonical(m) for m in re.findall(r"^#{2,4} `([^`\n]+)`$",
                                              text, re.M)}


def compare(messages: list[Message], entries: set[str]) -> list[str]:
    problems = []
    missing: dict[str, list[Message]] = {}
    for m in messages:
        if m.text not in entries:
            missing.setdefault(m.text, []).append(m)
    for text, where in sorted(missing.items()):
        places = ", ".join(f"{m.where} ({m.level})" for m in where)
        problems.append(f"missing from docs/troubleshooting.md: `{text}` "
                        f"[{places}]")
    produced = {m.text for m in messages}
    for entry in sorted(entries - produced):
        problems.append(f"in docs/troubleshooting.md but logged nowhere: "
                        f"`{entry}`")
    return problems


def test_every_log_line_is_explained():
    messages, _ = source_messages()
    problems = compare(messages, page_entries(PAGE.read_text()))
    assert not problems, "\n".join(problems)


def test_every_log_call_is_read():
    """A call whose message the scan cannot read would escape it: every
    one writes its message at the call, except the helpers that pass
    on a message their callers wrote."""
    messages, unreadable = source_messages()
    assert unreadable == [], unreadable
    assert len(messages) >= 40, len(messages)
    # both layers are read: C's and the reference's copy of a message
    texts = {m.text for m in messages}
    assert "comfy_standin: the worker of model … is gone" in texts
    assert any(m.where.startswith("src/") for m in messages)
    assert any(m.where.startswith("python/comfy_standin/node_template")
               for m in messages)


def test_the_check_can_fail():
    sample = (
        "log.warning('comfy_standin: %s went %r', a, b)\n"
        "_log.info(f'comfy_standin: worker {w.name} is ' + 'slow')\n"
        "_warn_once('k', 'comfy_standin: once ' f'{x}')\n"
        "log.debug('comfy_standin: not at info or above')\n"
        "log.warning(message)\n"
        "log.warning('%s', message)\n"
    )
    messages, unreadable = python_messages(sample, "x")
    assert [m.text for m in messages] == [
        "comfy_standin: … went …",
        "comfy_standin: worker … is slow",
        "comfy_standin: once …",
    ]
    assert unreadable == ["x:5"]
    c_file = ('cs_log_warning("comfy_standin: on_pressure(%llu) raised %S "\n'
              '               "(ignored)", n, cause);\n')
    got = [canonical("".join(C_STRING.findall(m.group(1))))
           for m in C_CALL.finditer(c_file)]
    assert got == ["comfy_standin: on_pressure(…) raised … (ignored)"]
    entries = page_entries("### `comfy_standin: … went …`\nmeans\n"
                           "### `comfy_standin: gone away`\n"
                           "says `comfy_standin: once …` in passing\n")
    assert compare(messages, entries) == [
        "missing from docs/troubleshooting.md: `comfy_standin: once …` "
        "[x:3 (warning)]",
        "missing from docs/troubleshooting.md: `comfy_standin: worker … "
        "is slow` [x:2 (info)]",
        "in docs/troubleshooting.md but logged nowhere: "
        "`comfy_standin: gone away`",
    ]
