#!/usr/bin/env python
"""What the hostile-edge checks cost, side by side in one run.

Run from the repository root (the comfy-env rows need comfy-env and the
test extra: tests/fakes.py and tests/mockcomfy)::

    python bench/bench_edges.py            # print the table
    python bench/bench_edges.py --write    # and rewrite our section of
                                           # bench/RESULTS.md
    python bench/bench_edges.py --smoke    # one tiny round, no timing use

Each row times two ways of doing one job in alternating turns (the loop
count doubles until a run takes 20 ms, then 7 rounds) and prints both,
best (median, p90) of the rounds, and the ratio of the bests; the section
gives the machine's load before and after and the command that ran:

- ``census wrapper``: comfy-env's ``state_sync.apply_residency`` as the
  adapter wraps it (every entry checked, then the C state sync) against
  ``comfy_standin.apply_residency`` called directly, on a valid census of
  8 models; and on the same census with one bad entry (the wrapper then
  applies entry by entry).
- ``visible()``: a 1 MiB worker string against a 1 KiB one, both cut
  to the 200-character limit (the cut is O(limit), so about 1).

and one memory row: bytes still allocated (tracemalloc) after 20 workers
each refused the board with a 1 MiB reason, with the adapter's
``_warn_once`` against a log-once set keyed by the reason text (what it
was keyed by before).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import benchutil  # noqa: E402

HEADING = "## what the edge checks cost"
SCRIPT = "bench/bench_edges.py"
GIB = 1 << 30
MIB = 1 << 20

SMOKE = {"min_seconds": 0.0, "rounds": 1, "workers": 2, "reason": 1024}
FULL = {"min_seconds": 0.02, "rounds": 7, "workers": 20, "reason": MIB}


def _tests_on_path() -> None:
    for sub in ("tests", "tests/mockcomfy"):
        path = str(ROOT / sub)
        if path not in sys.path:
            sys.path.insert(0, path)


def _loops(fn: Callable[[], object], min_seconds: float) -> int:
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - start >= min_seconds or n >= 1 << 20:
            return n
        n *= 2


def pair(a: Callable[[], object], b: Callable[[], object],
         cfg: dict[str, Any]) -> tuple[list[float], list[float]]:
    """ns per call of `a` and of `b` in each round, in alternating
    turns."""
    n = max(_loops(a, cfg["min_seconds"]), _loops(b, cfg["min_seconds"]))
    rounds: tuple[list[float], list[float]] = ([], [])
    for _ in range(cfg["rounds"]):
        for i, fn in enumerate((a, b)):
            start = time.perf_counter_ns()
            for _ in range(n):
                fn()
            rounds[i].append((time.perf_counter_ns() - start) / n)
    return rounds


# ---- rows ------------------------------------------------------------------


def census_rows(cfg: dict[str, Any]) -> list[tuple[str, str, list[float], str,
                                                   list[float]]]:
    _tests_on_path()
    import fakes  # noqa: F401 - puts the mock comfy on the path

    import comfy_standin as cs
    from comfy_standin.integrations import comfy_env as adapter

    state_sync = importlib.import_module("comfy_env.state_sync")
    adapter.install()
    try:
        worker = fakes.FakeWorker("w")
        pool = cs.Pool(floor=0)
        standins = {
            f"m{i}": cs.StandIn(worker=worker, worker_generation=1,
                                model_id=f"m{i}", model_size=4 * GIB,
                                load_device="cuda:0", offload_device="cpu",
                                pool=pool)
            for i in range(8)
        }
        def census(resident: int, bad: bool) -> list[Any]:
            out: list[Any] = [
                {"id": mid, "seq": 1, "resident": resident}
                for mid in standins
            ]
            if bad:
                out.insert(4, {"id": ["unhashable"]})
            return out

        def alternating(censuses: list[list[Any]],
                        apply: Callable[..., object]) -> Callable[[], None]:
            """Applies the two censuses in turn, so every entry moves."""
            turn = [0]

            def step() -> None:
                turn[0] ^= 1
                apply(standins, censuses[turn[0]])

            return step

        rows = []
        for bad in (False, True):
            hostile = [census(1 * MIB, bad), census(2 * MIB, bad)]
            valid = [census(1 * MIB, False), census(2 * MIB, False)]
            wrapped, direct = pair(
                alternating(hostile, state_sync.apply_residency),
                alternating(valid, cs.apply_residency), cfg)
            rows.append((
                f"census of 8{', one bad entry' if bad else ''}",
                "adapter's wrapper", wrapped,
                "C apply_residency (valid entries)", direct))
        return rows
    finally:
        adapter.uninstall()


def visible_rows(cfg: dict[str, Any]) -> list[tuple[str, str, list[float], str,
                                                    list[float]]]:
    from comfy_standin._text import visible

    huge = "\x1b[2J" + "x" * MIB
    small = "\x1b[2J" + "x" * 1024
    a, b = pair(lambda: visible(huge), lambda: visible(small), cfg)
    return [("visible(), worker text", "1 MiB string", a,
             "1 KiB string", b)]


def memory_row(cfg: dict[str, Any]) -> tuple[str, int, int]:
    from comfy_standin.integrations import comfy_env as adapter

    def retained(warn: Callable[[str, str], None]) -> int:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(cfg["workers"]):
            reason = f"{i}:" + "r" * cfg["reason"]
            warn(f"worker:{reason}",
                 f"comfy_standin: worker w{i} does not publish a live "
                 f"board ({reason}); its stand-ins use receipts only")
            del reason
        kept = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        return kept

    keyed_by_text: set[str] = set()

    def by_text(kind: str, message: str) -> None:
        if kind not in keyed_by_text:
            keyed_by_text.add(kind)
            logging.getLogger("comfy_standin").warning("%s", message)

    saved = adapter._warned
    adapter._warned = set()
    try:
        now = retained(adapter._warn_once)
    finally:
        adapter._warned = saved
    before = retained(by_text)
    return (f"log-once after {cfg['workers']} refusing workers, "
            f"{cfg['reason'] // 1024} KiB reasons", now, before)


# ---- output ----------------------------------------------------------------


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    logger = logging.getLogger("comfy_standin")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # the rows log on purpose
    try:
        rows = census_rows(cfg) + visible_rows(cfg)
        return {"rows": rows, "memory": memory_row(cfg)}
    finally:
        logger.setLevel(level)


def table(results: dict[str, Any]) -> str:
    lines = ["| job | this way | ns, best (median, p90) | against | ns, "
             "best (median, p90) | ratio of the bests |",
             "|---|---|---:|---|---:|---:|"]
    for job, a_name, a, b_name, b in results["rows"]:
        lines.append(f"| {job} | {a_name} | {benchutil.spread_text(a)} | "
                     f"{b_name} | {benchutil.spread_text(b)} "
                     f"| {min(a) / min(b):.2f} |")
    job, now, before = results["memory"]
    lines += [
        "",
        "| memory | keyed by a fixed kind (now) | keyed by the reason "
        "text | ratio |",
        "|---|---:|---:|---:|",
        f"| {job} | {now:,} B | {before:,} B | "
        f"{before / max(now, 1):,.0f}x less |",
    ]
    return "\n".join(lines)


def section(results: dict[str, Any], argv: list[str] | None = None,
            load_before: tuple[float, ...] | None = None) -> str:
    command = benchutil.command(SCRIPT, ["--write"] if argv is None
                                else argv)
    load = benchutil.load_text(load_before or benchutil.loadavg(),
                               benchutil.loadavg())
    rounds = len(results["rows"][0][2]) if results["rows"] else 0
    return "\n".join([
        f"Command: `{command}` ({rounds} rounds; {load}).  What each row "
        "times: the bench's docstring.  The ratio is this way's cost over "
        "the other's, of the best rounds.",
        "",
        table(results),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite our section of bench/RESULTS.md")
    parser.add_argument("--smoke", action="store_true",
                        help="one tiny round (checks the bench runs)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    load_before = benchutil.loadavg()
    text = section(run(SMOKE if args.smoke else FULL), argv, load_before)
    print(text)
    if args.write and not args.smoke:
        benchutil.write_section("edges", HEADING, text, SCRIPT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
