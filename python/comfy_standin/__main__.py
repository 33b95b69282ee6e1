"""Command line: ``python -m comfy_standin {demo,status,probe,selfcheck}``.

Exit codes: 0 success; 1 a check failed (demo, selfcheck), ``status
--url`` read nothing, ``install-node``/``uninstall-node`` refused; 2 bad
usage (argparse); 3 ``probe --require-gpu`` found no readable GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_GPU = 3


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import _demo

    return _demo.run_demo(args.impl, sys.stdout,
                          show_status=not args.no_status)


def _cmd_status(args: argparse.Namespace) -> int:
    if args.url is not None or args.watch is not None:
        return _status_loop(args)
    return _status_once(args)


def _status_loop(args: argparse.Namespace) -> int:
    """``status --url`` (a running ComfyUI) and ``--watch SECONDS``."""
    import time

    from . import _status

    while True:
        if args.url is None:
            code = _status_once(args)
        else:
            try:
                data = _status.fetch(args.url)
            except _status.RemoteError as exc:
                print(f"status: {exc}", file=sys.stderr)
                code = EXIT_FAILED
            else:
                code = EXIT_OK
                if args.json:
                    print(json.dumps(data, indent=2, sort_keys=True))
                else:
                    print(_status.render_remote(data, args.url))
        if args.watch is None:
            return code
        sys.stdout.flush()
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return code
        print()


def _status_once(args: argparse.Namespace) -> int:
    import comfy_standin as cs

    from . import _status

    if args.impl == "c":
        pool = cs.default_pool()
    else:
        from . import _reference

        pool = _reference.default_pool()
    status = _status.collect(pool)
    result = cs.probe()
    if args.json:
        status["probe"] = result
        status["probe_summary"] = _status.probe_summary(result)
        print(json.dumps(status, indent=2, sort_keys=True, default=str))
    else:
        print(_status.render(status, probe=False))
        print(_status.render_probe(result))
    return EXIT_OK


def _cmd_probe(args: argparse.Namespace) -> int:
    import comfy_standin as cs

    from . import _status

    result = cs.probe()
    summary = _status.probe_summary(result)
    if args.json:
        print(json.dumps({"probe": result, "summary": summary}, indent=2,
                         sort_keys=True, default=str))
    else:
        print(_status.render_probe(result))
    if args.require_gpu and not summary["gpu"]:
        return EXIT_NO_GPU
    return EXIT_OK


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    from . import _selfcheck

    return _selfcheck.run(sys.stdout)


def _cmd_install_node(args: argparse.Namespace) -> int:
    from . import _node

    return _node.install(args.comfyui, sys.stdout)


def _cmd_uninstall_node(args: argparse.Namespace) -> int:
    from . import _node

    return _node.uninstall(args.comfyui, sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m comfy_standin",
        description=(
            "Stand-ins for models held by comfy-env worker processes in "
            "ComfyUI's VRAM management."
        ),
        epilog=(
            "exit codes: 0 ok; 1 a check failed (demo, selfcheck), status "
            "--url read nothing, install-node/uninstall-node refused; 2 bad "
            "usage; 3 probe --require-gpu found no GPU"
        ),
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="self-contained run: worker subprocesses, boards, a "
             "ComfyUI-like memory manager under pressure (no GPU needed)",
        description=(
            "Starts two worker processes holding fake models on a "
            "simulated card, registers their stand-ins next to host "
            "models, and shows what ComfyUI's eviction sees and does: a "
            "busy call (receipt vs live board), pressure, a worker "
            "killed with SIGKILL, a worker refusing. Checks its own "
            "claims; exit 0 only if all held."
        ),
    )
    demo.add_argument("--impl", choices=("c", "reference"), default="c",
                      help="stand-in implementation (default: c)")
    demo.add_argument("--no-status", action="store_true",
                      help="skip the status dump of the demo's pool")
    demo.set_defaults(func=_cmd_demo)

    status = sub.add_parser(
        "status",
        help="this process's default pool, or a running ComfyUI's "
             "(--url): workers, models, receipts (age, source), boards; "
             "and the probe",
    )
    status.add_argument("--json", action="store_true",
                        help="machine-readable output")
    status.add_argument("--impl", choices=("c", "reference"), default="c",
                        help="whose default pool (default: c)")
    status.add_argument(
        "--url", nargs="?", const="http://127.0.0.1:8188", default=None,
        help="read a running ComfyUI (with the node entry installed) "
             "instead of this process; URL defaults to "
             "http://127.0.0.1:8188",
    )
    status.add_argument("--watch", type=_positive_seconds, default=None,
                        metavar="SECONDS",
                        help="print again every SECONDS until Ctrl-C")
    status.set_defaults(func=_cmd_status)

    probe = sub.add_parser(
        "probe",
        help="the GPU probe (CUDA driver and NVML through dlopen)",
    )
    probe.add_argument("--json", action="store_true",
                       help="machine-readable output")
    probe.add_argument("--require-gpu", action="store_true",
                       help=f"exit {EXIT_NO_GPU} when no GPU is readable")
    probe.set_defaults(func=_cmd_probe)

    selfcheck = sub.add_parser(
        "selfcheck",
        help="imports, version, C and reference agree on a scripted "
             "history",
    )
    selfcheck.set_defaults(func=_cmd_selfcheck)

    install_node = sub.add_parser(
        "install-node",
        help="switch comfy_standin on in a ComfyUI: a custom-node entry "
             "that registers no nodes (undo: uninstall-node)",
    )
    install_node.add_argument("comfyui", metavar="PATH_TO_COMFYUI",
                              help="the ComfyUI folder (has main.py and "
                                   "custom_nodes/)")
    install_node.set_defaults(func=_cmd_install_node)
    uninstall_node = sub.add_parser(
        "uninstall-node",
        help="remove the entry install-node wrote",
    )
    uninstall_node.add_argument("comfyui", metavar="PATH_TO_COMFYUI")
    uninstall_node.set_defaults(func=_cmd_uninstall_node)
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
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
