"""docs/cli.md's generated blocks: the command reference, written from
the argparse parser, and the status answer's fields, written from the
schema the client checks answers with (``_status.ANSWER``).

``python tools/clidoc.py docs/cli.md`` rewrites each block
between ``<!-- BEGIN GENERATED: NAME -->`` and ``<!-- END GENERATED:
NAME -->`` (everything outside them is hand-written); ``--check`` exits
1 when a block is not what the code says.  The format is this module's
own, not argparse's help layout, so it reads the same on every Python
version.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from typing import Any

BEGIN = "<!-- BEGIN GENERATED: cli reference -->"
END = "<!-- END GENERATED: cli reference -->"
SCHEMA_BEGIN = "<!-- BEGIN GENERATED: status answer -->"
SCHEMA_END = "<!-- END GENERATED: status answer -->"
PROG = "comfy-standin"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _arguments(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        name = str(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        name = action.dest.upper()
    return f"[{name}]" if action.nargs == "?" else name


def _invocation(action: argparse.Action) -> str:
    arguments = _arguments(action)
    if not action.option_strings:
        return arguments
    flags = ", ".join(action.option_strings)
    return f"{flags} {arguments}" if arguments else flags


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": PROG}
    return _cell(text)


def _common_dests() -> set[str]:
    from comfy_standin import __main__ as cli

    return {a.dest for a in cli._common_options()._actions}


def _visible_actions(parser: argparse.ArgumentParser,
                     common: bool = False) -> list[Any]:
    """The options --help lists, with (`common`) or without the ones
    every command takes."""
    # -v's help is each command's own: listed in each command's table.
    skip = set() if common else _common_dests() - {"verbose"}
    return [a for a in parser._actions
            if a.help != argparse.SUPPRESS and a.dest not in skip
            and not isinstance(a, (argparse._HelpAction,
                                   argparse._SubParsersAction))]


def _synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    words = [f"{PROG} {name}".strip()]
    if name:
        words.append("[--json] [--quiet | --verbose]")
    for action in _visible_actions(parser):
        if action.dest == "verbose":
            continue  # in the common options above
        if action.option_strings:
            words.append(f"[{action.option_strings[-1]}"
                         + (f" {_arguments(action)}]"
                            if _arguments(action) else "]"))
        else:
            words.append(_arguments(action))
    return " ".join(words)


def _table(parser: argparse.ArgumentParser,
           common: bool = False) -> list[str]:
    actions = _visible_actions(parser, common)
    if not actions:
        return ["Only the options every command takes."]
    rows = ["| option | meaning |", "|---|---|"]
    for action in actions:
        rows.append(f"| `{_invocation(action)}` | {_help(action)} |")
    return rows


def subcommands(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """{name: (subparser, one-line help)} in --help order."""
    (sub,) = [a for a in parser._actions
              if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    return {name: (subparser, helps.get(name, ""))
            for name, subparser in sub.choices.items() if name in helps}


def reference() -> str:
    """The generated block, markers included."""
    from comfy_standin import __main__ as cli

    parser = cli.build_parser(PROG)
    lines = [
        BEGIN,
        "<!-- Written by `python tools/clidoc.py docs/cli.md` "
        "from the parser in python/comfy_standin/__main__.py: change "
        "them there. -->",
        "",
        f"`{_synopsis('', parser)} COMMAND ...`",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    commands = subcommands(parser)
    for name, (_, text) in commands.items():
        lines.append(f"| [`{name}`](#{name}) | {_cell(text)} |")
    lines += ["", *_table(parser), "",
              "Every command also takes these:", "",
              *_table(cli._common_options(), common=True)]
    for name, (subparser, text) in commands.items():
        lines += ["", f"### {name}", "", f"`{_synopsis(name, subparser)}`",
                  "", _cell(subparser.description or text), "",
                  *_table(subparser)]
    lines += ["", "### Exit codes", "", "| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {_cell(meaning)} |"
              for code, meaning in cli.EXIT_CODES]
    lines.append(END)
    return "\n".join(lines)


def schema() -> str:
    """The status answer's block, markers included: one row per field of
    ``_status.ANSWER``, depth first."""
    from comfy_standin import _status

    lines = [
        SCHEMA_BEGIN,
        "<!-- Written by `python tools/clidoc.py docs/cli.md` "
        "from the schema in python/comfy_standin/_status.py (ANSWER): "
        "change it there. -->",
        "",
        "| field | type | present | meaning |",
        "|---|---|---|---|",
    ]
    for path, field in _status.ANSWER.fields(""):
        lines.append(f"| `{path}` | {field.shape.kind} | "
                     f"{'always' if field.required else 'sometimes'} | "
                     f"{_cell(field.doc)} |")
    lines.append(SCHEMA_END)
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """`text` (docs/cli.md) with each generated block it has replaced."""
    for begin, end, build in ((BEGIN, END, reference),
                              (SCHEMA_BEGIN, SCHEMA_END, schema)):
        if begin not in text:
            continue
        start = text.index(begin)
        stop = text.index(end, start) + len(end)
        text = text[:start] + build() + text[stop:]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/clidoc.py",
        description="Write docs/cli.md's generated command reference.")
    parser.add_argument("path", help="docs/cli.md")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if the block is stale")
    args = parser.parse_args(argv)
    with open(args.path, encoding="utf-8") as f:
        text = f.read()
    new = rewrite(text)
    if args.check:
        if new != text:
            print(f"{args.path}: a generated block is stale; run python "
                  f"tools/clidoc.py {args.path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        _replace(args.path, new)
    return 0


def _replace(path: str, text: str) -> None:
    """Writes `text` to a fresh file beside `path` (created, never opened
    through a link someone planted), then renames it over `path`: a link
    at `path` is replaced, not written through."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}."
                               f"{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


if __name__ == "__main__":
    sys.exit(main())
