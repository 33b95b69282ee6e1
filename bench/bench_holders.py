#!/usr/bin/env python
"""The stand-in against the memory-holder hook, on the same scenarios.

Run from the repository root (needs the test extra: the scenarios run on
the mock ComfyUI of tests/mockcomfy with tests/fakes.py's workers)::

    python bench/bench_holders.py            # print the table
    python bench/bench_holders.py --write    # and rewrite our section of
                                             # bench/RESULTS.md

Nothing is timed: every figure is bytes or a count, measured by the
scenario suite of tests/test_holders.py (``run_all``) in two modes:
``standin`` (every worker model has a registered stand-in) and
``holders`` (no stand-in registered; the pool is a memory holder and
``comfy_standin.holders.install`` is on the mock).  The figures are the
same for the C stand-in and the pure-Python reference; ``--impl`` picks
one.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS_PATH = HERE / "RESULTS.md"
BEGIN_MARKER = "<!-- holders:begin -->"
END_MARKER = "<!-- holders:end -->"
HEADING = "## stand-in vs memory holders"
COMMAND = "python bench/bench_holders.py --write"

MIB = 1 << 20


def _suite() -> Any:
    tests = ROOT / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    spec = importlib.util.spec_from_file_location(
        "holders_suite", tests / "test_holders.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f}"


def table(figures: list[Any]) -> str:
    rows = [
        "| scenario | mode | short by (MiB) | freed (MiB) | victims "
        "| requests ended short | 1: worker pins out of reach (MiB) "
        "| 2: stale bytes decided on (MiB) | 3: counted twice (MiB) "
        "| asks to a busy worker |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for f in figures:
        rows.append(
            f"| {f.scenario} | {f.mode} | {_mib(f.asked)} | {_mib(f.freed)} "
            f"| {', '.join(f.victims) or '-'} | {f.short} "
            f"| {_mib(f.pinned_out_of_reach)} "
            f"| {_mib(f.stale_in_decision)} | {_mib(f.counted_twice)} "
            f"| {f.asked_busy} |")
    return "\n".join(rows)


def totals(figures: list[Any]) -> str:
    lines = ["| mode | freed (MiB) | requests ended short "
             "| 1 (MiB) | 2 (MiB) | 3 (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for mode in ("standin", "holders"):
        fs = [f for f in figures if f.mode == mode]
        lines.append(
            f"| {mode} | {_mib(sum(f.freed for f in fs))} "
            f"| {sum(f.short for f in fs)} "
            f"| {_mib(sum(f.pinned_out_of_reach for f in fs))} "
            f"| {_mib(sum(f.stale_in_decision for f in fs))} "
            f"| {_mib(sum(f.counted_twice for f in fs))} |")
    return "\n".join(lines)


def section(figures: list[Any], impl_name: str) -> str:
    return "\n".join([
        HEADING,
        "",
        BEGIN_MARKER,
        f"Command: `{COMMAND}` (implementation: {impl_name}; the "
        f"reference gives the same figures).  Scenarios and figures: "
        f"tests/test_holders.py; the argument they serve: "
        f"docs/upstream/comfyui.md.",
        "",
        "Each scenario runs on the mock ComfyUI (tests/mockcomfy) twice: "
        "`standin` registers a stand-in per worker model (comfy-env "
        "today); `holders` registers none and installs the memory-holder "
        "shim with the pool as the holder.  *Short by*: what ComfyUI's "
        "first request lacked; *freed*: bytes that left the card; "
        "*requests ended short*: `free_memory` calls that ended below "
        "their target plus pin budgets that failed.  The seed's "
        "inaccuracies: **1** worker pinned RAM still pinned after the "
        "host's pin ladder ran under RAM pressure as deep as those pins; "
        "**2** bytes by which what the host decided on (the stand-ins' "
        "`loaded_size()` in the sort key; the holder's figure for the "
        "workers it may ask) differed from the truth; **3** worker bytes "
        "listed in `current_loaded_models` that device-wide free memory "
        "already lacks.",
        "",
        table(figures),
        "",
        "Totals over the scenarios:",
        "",
        totals(figures),
        "",
        "With holders, 1 and 3 are 0 in every scenario by construction "
        "(nothing of a worker is in ComfyUI's list; the pin ladder reaches "
        "idle workers' pins); 2 is 0 because the holder asks only idle "
        "workers, whose figures are exact, and never sends a command to "
        "a worker in a call: that worker's bytes stay out of reach in "
        "both modes.  The cost: ComfyUI's own models pay first "
        "(`mixed`: the host models are the victims, not the "
        "most-offloaded worker model).",
        END_MARKER,
    ])


def write(text: str) -> None:
    old = RESULTS_PATH.read_text()
    if BEGIN_MARKER in old:
        head, _, rest = old.partition(HEADING + "\n")
        _, _, tail = rest.partition(END_MARKER)
        new = head + text + tail
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    RESULTS_PATH.write_text(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite our section of bench/RESULTS.md")
    parser.add_argument("--impl", choices=("c", "reference"), default="c")
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("comfy_standin").setLevel(logging.ERROR)
    suite = _suite()
    impl = importlib.import_module(
        "comfy_standin" if args.impl == "c" else "comfy_standin._reference")
    figures = suite.run_all(impl)
    text = section(figures, args.impl)
    print(text)
    if args.write:
        write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
