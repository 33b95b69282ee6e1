"""Benchmark of the live residency board (docs/board.md).

Measures, in one run:

  publish    ns per ``b.publish(slot, n)`` from Python (worker side)
  read       ns per ``b.read(slot)`` from Python (host side: a few atomic
             loads and the seqlock; no system call)
  staleness  cross-process: a worker process publishes N values, one
             every gap; the host polls ``read()`` in a loop and records,
             for each new value it sees, the time from the value's
             publish stamp to that read.  Values the worker overwrote
             before the host read them are not observed: the report
             gives what was published and what was observed apart, and
             its percentiles are over the observed values.

Each timing is a statement as a caller writes it (name and attribute
looked up per call), in rounds: the best, the median and the p90 of the
rounds are reported, with the machine's load before and after.

Usage:  python bench/bench_board.py [--write] [-n N] [--rounds R]
                                    [--publishes N] [--gap-us US]
--write replaces the "board" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import select
import subprocess
import sys
import time
from pathlib import Path

from comfy_standin._core import Board
from comfy_standin._handoff import ENV_VAR, Handoff

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402

SCRIPT = "bench/bench_board.py"

WORKER = r"""
import sys, time
from comfy_standin._demo_worker import make_and_send
b = make_and_send(1, 0)
n, gap = int(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
b.bind(0, int(sys.stdin.readline()))  # the host's tag, then go
mono = time.monotonic_ns
published = 0
for i in range(1, n + 1):
    b.publish(0, i)
    published = i
    end = mono() + gap
    while mono() < end:
        pass
print("done", published, flush=True)
sys.stdin.readline()  # the board stays open until the host read the last
"""


def bench_in_process(n: int, rounds: int = 9) -> dict[str, list[float]]:
    """ns per call for each round: an empty call, publish, read."""
    worker, fd = Board.make(4)
    host = Board.adopt(fd, 4)
    os.close(fd)
    slot = host.assign("unet-0", 1 << 33)
    worker.bind(slot, host.tag(slot))
    worker.publish(slot, 1)

    def nothing() -> None:
        return None

    namespace = {"w": worker, "h": host, "slot": slot, "f": nothing}
    try:
        return {
            "empty call": benchutil.statement_ns("f()", namespace, n,
                                                 rounds),
            "publish": benchutil.statement_ns("w.publish(slot, 12345)",
                                              namespace, n, rounds),
            "read": benchutil.statement_ns("h.read(slot)", namespace, n,
                                           rounds),
        }
    finally:
        worker.close()
        host.close()


class _Lines:
    """The worker's stdout, read without ever blocking past a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.fd = proc.stdout.fileno()
        self.buf = b""
        self.eof = False

    def poll(self) -> str | None:
        """A complete line if one has arrived, else None (never waits)."""
        if b"\n" not in self.buf and not self.eof:
            if select.select([self.fd], [], [], 0)[0]:
                data = os.read(self.fd, 65536)
                self.buf += data
                self.eof = not data
        line, sep, rest = self.buf.partition(b"\n")
        if not sep:
            return None
        self.buf = rest
        return line.decode()

    def wait(self, deadline: float) -> str:
        while (line := self.poll()) is None:
            if self.eof or time.monotonic() > deadline:
                raise RuntimeError(
                    f"board worker: no answer (exit status "
                    f"{self.proc.poll()})")
            select.select([self.fd], [], [], 0.05)
        return line


def bench_staleness(count: int, gap_ns: int, deadline: float | None = None
                    ) -> dict[str, object]:
    """{'published', 'observed', 'lags_ns'}: the worker's count, the
    distinct values the host saw, and the lag of each one it saw.  Every
    wait ends by `deadline` seconds (default: the run's length plus
    30 s), whether or not the worker finishes."""
    if deadline is None:
        deadline = count * gap_ns / 1e9 + 30.0
    end = time.monotonic() + deadline
    handoff = Handoff()
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(count), str(gap_ns)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, ENV_VAR: handoff.spec},
    )
    lines = _Lines(proc)
    host = None
    try:
        if lines.wait(end) != "ready":
            raise RuntimeError("board worker: expected 'ready'")
        host, _, _ = handoff.collect(proc.pid,
                                     lambda fd: Board.adopt(fd, 1))
        slot = host.assign("unet-0", 1 << 40)
        host.expected_owner = proc.pid
        proc.stdin.write(f"{host.tag(slot)}\n".encode())
        proc.stdin.flush()
        seen = 0
        lags: list[int] = []
        read = host.read
        mono = time.monotonic_ns
        published = None
        spins = 0
        while True:
            r = read(slot)
            if r is not None and r[0] != seen:
                lags.append(mono() - r[1])
                seen = r[0]
            spins += 1
            if spins & 1023:
                continue
            line = lines.poll()
            if line is not None and line.startswith("done "):
                published = int(line.split()[1])
            if published is not None and seen >= published:
                break
            if published is not None or lines.eof:
                # the worker is done (its board still open) or gone: one
                # last read, then stop
                r = read(slot)
                if r is not None and r[0] != seen:
                    lags.append(mono() - r[1])
                    seen = r[0]
                if published is None:
                    raise RuntimeError(
                        f"board worker exited (status {proc.poll()}) "
                        "before saying what it published")
                break
            if time.monotonic() > end:
                raise RuntimeError("board staleness: deadline passed")
        try:
            proc.stdin.write(b"bye\n")
            proc.stdin.flush()
            proc.wait(max(1.0, end - time.monotonic()))
        except (BrokenPipeError, subprocess.TimeoutExpired):
            pass
        return {"published": published, "observed": len(lags),
                "lags_ns": lags}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stdin.close()
        proc.stdout.close()
        handoff.close()
        if host is not None:
            host.close()


def report(calls: dict[str, list[float]], stale: dict[str, object],
           argv: list[str], load_before: tuple[float, ...]) -> str:
    lags_us = [v / 1000 for v in stale["lags_ns"]]
    published, observed = stale["published"], stale["observed"]
    rounds = len(calls["read"])
    lines = [
        f"Command: `{benchutil.command(SCRIPT, argv)}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}, Python "
        f"{platform.python_version()}; "
        f"{benchutil.load_text(load_before, benchutil.loadavg())} (other "
        "jobs on the machine inflate every figure alike).",
        "",
        f"Per call, ns, best (median, p90) of {rounds} rounds, each "
        "statement as a caller writes it:",
        "",
        "| what | ns per call |",
        "|---|---:|",
        f"| empty Python call `f()` (loop overhead, for scale) | "
        f"{benchutil.spread_text(calls['empty call'])} |",
        f"| `b.publish(slot, n)` (worker) | "
        f"{benchutil.spread_text(calls['publish'])} |",
        f"| `b.read(slot)` (host, no system call) | "
        f"{benchutil.spread_text(calls['read'])} |",
        "",
        f"Cross-process staleness: a worker process published "
        f"{published:,} values one after another; the host, polling "
        f"`read()` in a loop, observed {observed:,} of them (the rest "
        "were overwritten before a read reached them) and for each "
        "measured `time.monotonic_ns()` minus the value's publish stamp "
        "(both CLOCK_MONOTONIC): the delay the board adds over a "
        "message.  A receipt is as stale as the last message.",
        "",
        f"| staleness, over the {observed:,} observed values | us |",
        "|---|---:|",
    ]
    if lags_us:
        for label, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99)):
            lines.append(f"| {label} | {benchutil.pct(lags_us, q):.1f} |")
        lines.append(f"| max | {max(lags_us):.1f} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("-n", type=int, default=200_000,
                        help="calls per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--publishes", type=int, default=5000)
    parser.add_argument("--gap-us", type=int, default=100)
    args = parser.parse_args(argv)

    load_before = benchutil.loadavg()
    calls = bench_in_process(args.n, args.rounds)
    stale = bench_staleness(args.publishes, args.gap_us * 1000)
    text = report(calls, stale, argv, load_before)
    print(text)
    if args.write:
        benchutil.write_section("board", "## board", text, SCRIPT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
