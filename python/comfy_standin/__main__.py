"""Command line: ``comfy-standin COMMAND`` or ``python -m comfy_standin
COMMAND`` (docs/cli.md).

Exit codes: ``EXIT_CODES`` below.  SIGINT and SIGTERM run the same
clean-up (worker processes ended, boards closed) and end with one line on
stderr.  docs/cli.md's reference is written from this parser
(``python tools/clidoc.py docs/cli.md``).

Adding a subcommand: write ``_add_NAME(sub, common)`` that adds its
parser (``parents=[common("what -v adds")]`` gives it ``--json``/
``--quiet``/``--verbose``) and sets ``func``; list it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, TextIO

from ._text import NotJSON, json_text, visible

#: Makes the parent parser of a subcommand: the options every command
#: takes, with that command's help for -v (``_common_options``).
Common = Callable[[str], argparse.ArgumentParser]
#: ComfyUI's default address (``_status.DEFAULT_URL``; a test holds them
#: equal): the parser is built without importing the HTTP client.
_DEFAULT_URL = "http://127.0.0.1:8188"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_GPU = 3
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143

#: Every exit code and what it means: the one table (``--help``'s epilog
#: and docs/cli.md's table are written from it; tests/test_cli_reference.py
#: makes each code happen).
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success"),
    (EXIT_FAILED, "a check failed (`demo`, `selfcheck`); `status --url` "
                  "read nothing usable (a URL it cannot read, nothing "
                  "answers, no route, a reply that is not a status, the "
                  "deadline); `install-node` / `uninstall-node` refused; "
                  "a `--json` result with a number JSON cannot carry "
                  "(NaN, an infinity): one line on stderr"),
    (EXIT_USAGE, "bad usage (unknown option or command, no command, "
                 "`--open` without `--url`): usage and an `error:` line "
                 "on stderr"),
    (EXIT_NO_GPU, "`probe --require-gpu` found no readable GPU: one line "
                  "on stderr says why"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C, SIGINT), `status --watch` "
                       "included: clean-up, one line on stderr"),
    (EXIT_TERMINATED, "terminated (SIGTERM): the same clean-up"),
)


# ---------------------------------------------------------------------------
# conventions shared by every subcommand


def program_name(argv0: str | None = None) -> str:
    """The program as the user invoked it: the console script's name, or
    ``python -m comfy_standin``."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    base = os.path.basename(argv0 or "")
    if base in ("", "-c", "__main__.py", "-m") or base.endswith(".py"):
        return "python -m comfy_standin"
    return base


def use_color(stream: TextIO) -> bool:
    """Colour only on a terminal, never with NO_COLOR set
    (https://no-color.org) or TERM=dumb."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class Output:
    """How a subcommand should talk: ``json`` (one JSON document on
    stdout, nothing else there), ``quiet`` (the result line only),
    ``verbose`` (also debug logging on stderr), ``color``."""

    def __init__(self, args: argparse.Namespace, stream: TextIO) -> None:
        self.json = bool(getattr(args, "json", False))
        self.quiet = bool(getattr(args, "quiet", False))
        self.verbose = bool(getattr(args, "verbose", False))
        self.color = not self.json and use_color(stream)
        self.stream = stream

    def emit_json(self, data: Any) -> None:
        print(json_text(data, indent=2, sort_keys=True), file=self.stream)


class _QuietPipe:
    """stdout that stops writing, without a traceback, once the reader
    has gone (``comfy-standin demo | head``).  The command still finishes
    (and cleans up); main() then points fd 1 at /dev/null so the final
    flush at exit cannot complain either."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self.broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is so that the same clean-up as
    for Ctrl-C runs.  A KeyboardInterrupt, so no ``except Exception``
    swallows it."""


def _on_signal(signum: int, frame: Any) -> None:
    # Clean-up must not be cut short by a second signal: ignore both
    # from now on (clean-up is bounded: workers are killed, not asked).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


def _configure_logging(out: Output, inline: bool) -> None:
    """--verbose: the package's log on stderr (the demo shows it inline
    instead); --quiet and --json: errors only."""
    logger = logging.getLogger("comfy_standin")
    if out.verbose and not inline:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    elif out.quiet or out.json:
        logger.setLevel(logging.ERROR)


# ---------------------------------------------------------------------------
# demo


def _cmd_demo(args: argparse.Namespace, out: Output) -> int:
    from . import _demo

    return _demo.run_demo(
        args.impl, out.stream, show_status=not args.no_status,
        mode="json" if out.json else "quiet" if out.quiet else "text",
        color=out.color, verbose=out.verbose,
    )


def _add_demo(sub: Any, common: Common) -> None:
    demo = sub.add_parser(
        "demo", parents=[common(
            "also each command sent to a worker and its reply ([wire]), "
            "and each board as it is made")],
        help="self-contained run: worker subprocesses, boards, a "
             "ComfyUI-like memory manager under pressure (no GPU needed)",
        description=(
            "Starts two worker processes holding fake models on a "
            "simulated card, registers their stand-ins next to host "
            "models, and shows what ComfyUI's eviction sees and does: a "
            "busy call (receipt vs live board), pressure, a worker "
            "killed with SIGKILL, a worker refusing. Checks its own "
            "claims; exit 0 only if all held. Terms: docs/glossary.md."
        ),
    )
    demo.add_argument("--impl", choices=("c", "reference"), default="c",
                      help="stand-in implementation (default: c)")
    demo.add_argument("--no-status", action="store_true",
                      help="skip the status dump of the demo's pool")
    demo.set_defaults(func=_cmd_demo)


# ---------------------------------------------------------------------------
# status


def _cmd_status(args: argparse.Namespace, out: Output) -> int:
    if args.open and args.url is None:
        args.parser.error("--open needs --url (the ComfyUI whose page to "
                          "open)")
    if args.open:
        return _status_open(args, out)
    if args.url is not None or args.watch is not None:
        return _status_loop(args, out)
    return _status_once(args, out)


def _status_open(args: argparse.Namespace, out: Output) -> int:
    """``status --url URL --open``: the live VRAM page's address, printed;
    opened in a browser too when this session has a display."""
    from . import _status

    try:
        address = _status.page_address(args.url)
    except _status.RemoteError as exc:
        print(f"status: {exc}", file=sys.stderr)
        return EXIT_FAILED
    opened = False
    if _has_display():
        import webbrowser

        try:
            opened = webbrowser.open(address)
        except Exception:  # noqa: BLE001 - the address is printed anyway
            opened = False
    if out.json:
        out.emit_json({"page": address, "opened": opened})
    else:
        print(address, file=out.stream)
    return EXIT_OK


def _has_display() -> bool:
    """A graphical session a browser could open in (never a text-mode
    browser taking over this terminal)."""
    if sys.platform == "darwin":
        return True
    return bool(os.environ.get("DISPLAY")
                or os.environ.get("WAYLAND_DISPLAY"))


def _status_loop(args: argparse.Namespace, out: Output) -> int:
    """``status --url`` (a running ComfyUI) and ``--watch SECONDS``.  Each
    round has its own deadline (``--timeout``); Ctrl-C ends a watch like
    any command: clean-up, one line on stderr, exit 130."""
    import time

    while True:
        if args.url is None:
            code = _status_once(args, out)
        else:
            code = _status_remote(args, out)
        if args.watch is None:
            return code
        out.stream.flush()
        time.sleep(args.watch)
        print(file=out.stream)


def _status_remote(args: argparse.Namespace, out: Output) -> int:
    from . import _status

    try:
        data = _status.fetch(args.url, timeout=args.timeout)
        text = None if out.json else _status.render_remote(data, args.url)
    except _status.RemoteError as exc:
        print(f"status: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - the one-line promise holds
        print(f"status: {visible(args.url)}: internal error reading the "
              f"answer ({visible(exc, 120)}); please report it",
              file=sys.stderr)
        return EXIT_FAILED
    if text is None:
        out.emit_json(data)
    else:
        print(text, file=out.stream)
        if out.verbose:
            print("raw probe result (ComfyUI's):", file=out.stream)
            out.emit_json(data["probe"])
    return EXIT_OK


def _status_once(args: argparse.Namespace, out: Output) -> int:
    import comfy_standin as cs

    from . import _status

    status = _status.collect(cs.default_pool())
    result = cs.probe()
    if out.json:
        status["probe"] = result
        status["probe_summary"] = _status.probe_summary(result)
        out.emit_json(status)
    elif out.quiet:
        print(_status.summary_line(status, result), file=out.stream)
    else:
        if not status["workers"] and not status["graveyard"] \
                and args.watch is None:
            print(_status.no_workers_line(program_name()), file=out.stream)
        else:
            print(_status.render(status, probe=False), file=out.stream)
        print(_status.render_probe(result), file=out.stream)
        if out.verbose:
            print("raw probe result:", file=out.stream)
            out.emit_json(result)
    return EXIT_OK


def _add_status(sub: Any, common: Common) -> None:
    status = sub.add_parser(
        "status", parents=[common(
            "also the probe's raw result (with --url: ComfyUI's), and "
            "the package's log on stderr")],
        help="this process's default pool, or a running ComfyUI's "
             "(--url): workers, models, receipts (age, source), boards; "
             "and the probe",
        description=(
            "Without --url: this process's own pool, which is empty "
            "unless something in this process registered stand-ins (a "
            "fresh command line has none). With --url: the pool of a "
            "running ComfyUI with the node entry installed, read from "
            "its GET /comfy_standin/status."
        ),
    )
    status.add_argument(
        "--url", nargs="?", const=_DEFAULT_URL, default=None,
        help="read a running ComfyUI (with the node entry installed) "
             f"instead of this process; URL defaults to {_DEFAULT_URL}, "
             "a URL or HOST[:PORT] without a port to port 8188",
    )
    status.add_argument("--watch", type=_positive_seconds, default=None,
                        metavar="SECONDS",
                        help="print again every SECONDS until Ctrl-C")
    status.add_argument(
        "--timeout", type=_positive_seconds, default=5.0,
        metavar="SECONDS",
        help="with --url: the whole request (each --watch round) ends "
             "after SECONDS (default: 5)",
    )
    status.add_argument(
        "--open", action="store_true",
        help="with --url: print the address of the live VRAM page "
             "(GET /comfy_standin/), and open it in a browser when there "
             "is a display",
    )
    status.set_defaults(func=_cmd_status, parser=status)


# ---------------------------------------------------------------------------
# probe


def _cmd_probe(args: argparse.Namespace, out: Output) -> int:
    import comfy_standin as cs

    from . import _status

    result = cs.probe()
    summary = _status.probe_summary(result)
    if out.json:
        out.emit_json({"probe": result, "probe_summary": summary})
    elif out.quiet:
        print(_status.probe_line(summary), file=out.stream)
    else:
        print(_status.render_probe(result), file=out.stream)
        if out.verbose:
            print("raw probe result:", file=out.stream)
            out.emit_json(result)
    if args.require_gpu and not summary["gpu"]:
        print(f"probe: {_status.no_gpu_reason(summary)}", file=sys.stderr)
        return EXIT_NO_GPU
    return EXIT_OK


def _add_probe(sub: Any, common: Common) -> None:
    probe = sub.add_parser(
        "probe", parents=[common(
            "also the raw result as JSON, and the package's log on "
            "stderr")],
        help="the GPU probe (CUDA driver and NVML through dlopen)",
    )
    probe.add_argument("--require-gpu", action="store_true",
                       help=f"exit {EXIT_NO_GPU} when no GPU is readable, "
                            f"saying why on stderr")
    probe.set_defaults(func=_cmd_probe)


# ---------------------------------------------------------------------------
# selfcheck


def _cmd_selfcheck(args: argparse.Namespace, out: Output) -> int:
    from . import _selfcheck

    return _selfcheck.run(
        out.stream,
        mode="json" if out.json else "quiet" if out.quiet else "text",
        color=out.color, verbose=out.verbose,
    )


def _add_selfcheck(sub: Any, common: Common) -> None:
    selfcheck = sub.add_parser(
        "selfcheck", parents=[common(
            "also every observation of both implementations, step by "
            "step")],
        help="imports, version, C and reference agree on a scripted "
             "history",
    )
    selfcheck.set_defaults(func=_cmd_selfcheck)


# ---------------------------------------------------------------------------
# install-node / uninstall-node


def _cmd_install_node(args: argparse.Namespace, out: Output) -> int:
    from . import _node

    return _node.install(args.comfyui, out.stream, json_output=out.json,
                         quiet=out.quiet)


def _cmd_uninstall_node(args: argparse.Namespace, out: Output) -> int:
    from . import _node

    return _node.uninstall(args.comfyui, out.stream, json_output=out.json,
                           quiet=out.quiet, verbose=out.verbose)


def _add_node(sub: Any, common: Common) -> None:
    install_node = sub.add_parser(
        "install-node", parents=[common(
            "no more than without it: install-node prints all it did "
            "already")],
        help="switch comfy_standin on in a ComfyUI: a custom-node entry "
             "that registers no nodes (undo: uninstall-node)",
    )
    install_node.add_argument("comfyui", metavar="PATH_TO_COMFYUI",
                              help="the ComfyUI folder (has main.py and "
                                   "custom_nodes/)")
    install_node.set_defaults(func=_cmd_install_node)
    uninstall_node = sub.add_parser(
        "uninstall-node", parents=[common(
            "also each path removed and each kept")],
        help="remove the entry install-node wrote",
    )
    uninstall_node.add_argument("comfyui", metavar="PATH_TO_COMFYUI",
                                help="the ComfyUI folder install-node "
                                     "wrote into")
    uninstall_node.set_defaults(func=_cmd_uninstall_node)


# ---------------------------------------------------------------------------
# the parser

#: One entry per subcommand, in --help order.
SUBCOMMANDS: list[Callable[[Any, Common], None]] = [
    _add_demo,
    _add_status,
    _add_probe,
    _add_selfcheck,
    _add_node,
]


#: The -v help of the options every command takes (each command's says
#: what -v adds there).
VERBOSE_HELP = "more detail (what each command adds: in its own help)"


def _common_options(verbose: str = VERBOSE_HELP) -> argparse.ArgumentParser:
    """--json, --quiet and --verbose, whose help is `verbose`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true",
                        help="one JSON document on stdout, nothing else")
    level = common.add_mutually_exclusive_group()
    level.add_argument("-q", "--quiet", action="store_true",
                       help="print only the result line")
    level.add_argument("-v", "--verbose", action="store_true",
                       help=verbose)
    return common


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or program_name(),
        description=(
            "Stand-ins for models held by comfy-env worker processes in "
            "ComfyUI's VRAM management."
        ),
        epilog=(
            "Every command takes --json, --quiet and --verbose. Exit "
            "codes: "
            + "; ".join(f"{code} {meaning.replace('`', '')}"
                        for code, meaning in EXIT_CODES)
            + ". Colour only on a terminal and never with NO_COLOR. "
            "Docs: docs/ in the source tree (cli.md, glossary.md, "
            "architecture.md)."
        ),
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub, _common_options)
    return parser


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected seconds above 0, got {text!r}")
    return value


def _version() -> str:
    try:
        import comfy_standin

        return comfy_standin.__version__
    except Exception as exc:  # noqa: BLE001 - --version must still work
        return f"(import failed: {exc})"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    stdout = _QuietPipe(sys.stdout)
    previous: dict[int, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, _on_signal)
    except ValueError:  # not the main thread: leave signals alone
        pass
    saved_stdout, sys.stdout = sys.stdout, stdout  # type: ignore[assignment]
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.error(f"a command is required; see '{parser.prog} "
                         f"--help'")
        out = Output(args, stdout)  # type: ignore[arg-type]
        _configure_logging(out, inline=args.command == "demo")
        return int(args.func(args, out))
    except NotJSON as exc:
        print(f"{parser.prog} {args.command}: --json: {exc}; printed "
              f"nothing (JSON has no such number)", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated)
        print(f"{parser.prog}: {'terminated' if terminated else 'interrupted'}"
              f"; cleaned up", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    finally:
        stdout.flush()
        sys.stdout = saved_stdout
        if stdout.broken:
            # The reader left: nothing more can be said on stdout, and the
            # interpreter's own flush at exit must not say so either.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, saved_stdout.fileno())
            os.close(devnull)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
