"""Benchmark of the live residency board (docs/board.md).

Measures, in one run:

  publish    ns per Board.publish() from Python (worker side)
  read       ns per Board.read() from Python (host side: a few atomic
             loads and the seqlock; no system call)
  staleness  cross-process: time from a worker process's publish (its
             stamp) to the host's first read that shows it, with the host
             polling in a loop, as a stand-in's loaded_size() would

Usage:  python bench/bench_board.py [--write]
--write replaces the "board" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from comfy_standin._core import Board

RESULTS = Path(__file__).with_name("RESULTS.md")
COMMAND = "python bench/bench_board.py --write"

WORKER = r"""
import sys, time
from comfy_standin._core import Board
src = sys.argv[1]
b = Board.open(int(src) if src.isdigit() else src)
b.bind(0, int(sys.argv[4]))
n, gap = int(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
mono = time.monotonic_ns
for i in range(1, n + 1):
    b.publish(0, i)
    end = mono() + gap
    while mono() < end:
        pass
print("done", flush=True)
"""


def per_call_ns(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / n)
    return best


def loop_overhead_ns(n: int) -> float:
    def nothing():
        return None

    return per_call_ns(nothing, n)


def bench_in_process(n: int) -> dict[str, float]:
    host = Board.create(4)
    worker = Board.open(host.fd if host.fd is not None else host.name)
    host.unlink()
    slot = host.assign("unet-0", 1 << 33)
    worker.bind(slot, host.tag(slot))
    worker.publish(slot, 1)
    publish = worker.publish
    read = host.read
    out = {
        "empty call": loop_overhead_ns(n),
        "publish": per_call_ns(lambda: publish(slot, 12345), n),
        "read": per_call_ns(lambda: read(slot), n),
    }
    worker.close()
    host.close()
    return out


def bench_staleness(count: int, gap_ns: int) -> list[int]:
    host = Board.create(1)
    slot = host.assign("unet-0", 1 << 40)
    fd = host.fd
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER,
         str(fd) if fd is not None else host.name, str(count), str(gap_ns),
         str(host.tag(slot))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        pass_fds=(fd,) if fd is not None else (),
    )
    assert proc.stdout.readline().strip() == "ready"
    host.expected_owner = proc.pid
    host.unlink()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    seen = 0
    lags = []
    read = host.read
    mono = time.monotonic_ns
    while seen < count:
        r = read(slot)
        if r is not None and r[0] != seen:
            lags.append(mono() - r[1])
            seen = r[0]
    assert proc.stdout.readline().strip() == "done"
    proc.wait()
    host.close()
    return lags


def pct(values: list[int], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("-n", type=int, default=200_000)
    parser.add_argument("--publishes", type=int, default=5000)
    args = parser.parse_args()

    calls = bench_in_process(args.n)
    lags = bench_staleness(args.publishes, 100_000)
    us = [v / 1000 for v in lags]
    lines = [
        "## board",
        "",
        f"Command: `{COMMAND}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}, Python "
        f"{platform.python_version()} (load average "
        f"{os.getloadavg()[0]:.2f} at the end of the run: other jobs on the "
        "machine inflate every figure alike).",
        "",
        "| what | figure |",
        "|---|---|",
        f"| empty Python call (loop overhead, for scale) | "
        f"{calls['empty call']:.0f} ns |",
        f"| `Board.publish(slot, n)` (worker) | {calls['publish']:.0f} ns |",
        f"| `Board.read(slot)` (host, no system call) | "
        f"{calls['read']:.0f} ns |",
        f"| cross-process staleness, median | {statistics.median(us):.1f} "
        f"us |",
        f"| cross-process staleness, p90 / p99 | {pct(us, .9):.1f} / "
        f"{pct(us, .99):.1f} us |",
        f"| cross-process staleness, max | {max(us):.1f} us |",
        "",
        f"Staleness: a worker process publishes {len(lags)} values 100 us "
        "apart; the host polls `read()` in a loop and records, for each "
        "new value it sees, `time.monotonic_ns()` minus the value's "
        "publish stamp (both CLOCK_MONOTONIC).  It is the delay the board "
        "adds over a message; a receipt is as stale as the last message.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        old = RESULTS.read_text() if RESULTS.exists() else "# Results\n\n"
        # the heading line itself: "## board vs receipts" is another
        # section (bench/bench_board_view.py) and must survive
        heading = re.search(r"^## board$", old, re.MULTILINE)
        start = heading.start() if heading else -1
        if start >= 0:
            end = old.find("\n## ", start + 1)
            old = old[:start] + (old[end + 1:] if end >= 0 else "")
        RESULTS.write_text(old.rstrip("\n") + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
