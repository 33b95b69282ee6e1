"""Benchmark: what the live board buys a stand-in over receipts alone.

Measures, side by side in one run:

  reads      ns per ``s.loaded_size()`` for the C stand-in
             (comfy_standin.StandIn) and the reference
             (comfy_standin._reference.StandIn), receipts only vs a board
             attached with a valid reading newer than the receipt: the
             call as ComfyUI makes it (the attribute looked up on every
             call), in rounds, reported as best (median, p90).
  error      a real worker process (bench/busy_worker.py) runs a call
             during which its model's residency sweeps up and down between
             0 and the model size every 0.5-2 ms, publishing each change
             on the board and echoing its residency only at the start and
             the end of the call, as comfy-env's worker does.  The host
             samples at a fixed rate the worker's true value (from the
             worker's own CLOCK_MONOTONIC timeline, read afterwards), a
             stand-in with receipts only, and a stand-in with the board
             attached; absolute error of each view against the truth.
  staleness  the same kind of call, the host polling the board stand-in's
             loaded_size() in a loop: time from the worker's change (its
             stamp, taken just before the publish) to the host's first
             loaded_size() that returns it.

Usage:  python bench/bench_board_view.py [--write] [-n N] [--repeats R]
--write replaces the "board vs receipts" section of bench/RESULTS.md and
keeps every other section as it is; the section's command line is the
one that ran.  About 20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import math
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from comfy_standin._core import Board
from comfy_standin._handoff import ENV_VAR, Handoff

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import benchutil  # noqa: E402

WORKER = HERE / "busy_worker.py"
SECTION = "## board vs receipts"
SCRIPT = "bench/bench_board_view.py"
GIB = 1 << 30
SIZE = 8 * GIB
MODEL_ID = "unet-0"
DEADLINE = 60.0  # seconds before a wait on the worker counts as a hang
IMPLS = {"C": "comfy_standin", "reference": "comfy_standin._reference"}


class QuietWorker:
    """A comfy-env worker that is alive and never asked anything here."""

    def send_command(self, command: str, **kwargs: Any) -> Any:
        raise AssertionError(f"no command expected, got {command}")

    def is_alive(self) -> bool:
        return True


def make_standin(impl, size: int = SIZE, model_id: str = MODEL_ID):
    return impl.StandIn(QuietWorker(), 1, model_id, size, "cuda:0", "cpu",
                        pool=impl.Pool(process_local=True))


# ---- 1. read cost -----------------------------------------------------------


def read_ns(s: Any, n: int, rounds: int) -> list[float]:
    """ns per ``s.loaded_size()`` in each round of `n` calls, the method
    looked up on every call as ComfyUI's ``LoadedModel`` does."""
    return benchutil.statement_ns("s.loaded_size()", {"s": s}, n, rounds)


def bench_reads(n: int, repeats: int = 9) -> dict[str, Any]:
    """ns per loaded_size() call, per round; the cases take turns each
    round so that drift of the machine falls on all of them alike."""
    impls = {k: importlib.import_module(v) for k, v in IMPLS.items()}
    # This process plays the worker too: it makes the board and adopts it.
    worker_side, fd = Board.make(len(impls))
    host = Board.adopt(fd, len(impls))
    os.close(fd)
    host.expected_owner = os.getpid()
    cases: dict[tuple[str, str], Any] = {}
    boards = []
    try:
        for name, impl in impls.items():
            receipts = make_standin(impl, model_id=f"r-{name}")
            impl.apply_echo(receipts, 1 * GIB, seq=1)
            on_board = make_standin(impl, model_id=f"b-{name}")
            slot = on_board.attach_board(host)
            worker_side.bind(slot, host.tag(slot))
            impl.apply_echo(on_board, 1 * GIB, seq=1)
            boards.append((on_board, slot))
            cases[(name, "receipts")] = receipts
            cases[(name, "board")] = on_board

        def fresh() -> None:
            # a reading newer than the receipt, and a fresh heartbeat
            for on_board, slot in boards:
                worker_side.publish(slot, 2 * GIB)
                src = on_board.receipt()[3]
                assert src == "board", f"board reading not used: {src}"

        def empty() -> None:
            return None

        times: dict[Any, list[float]] = {key: [] for key in [*cases,
                                                            "empty"]}
        for _ in range(repeats):
            fresh()
            for key, s in cases.items():
                times[key] += read_ns(s, n, 1)
            times["empty"] += benchutil.statement_ns("f()", {"f": empty},
                                                     n, 1)
            for on_board, _ in boards:  # still read from the board
                assert on_board.loaded_size() == 2 * GIB
        out: dict[str, Any] = {"empty": times.pop("empty"), "n": n,
                               "repeats": repeats}
        for (name, case), rounds in times.items():
            out.setdefault(name, {})[case] = rounds
        for on_board, _ in boards:
            on_board.detach_board()
    finally:
        worker_side.close()
        host.close()
    return out


# ---- the worker process -----------------------------------------------------


class BusyWorker:
    """bench/busy_worker.py as a subprocess; lines are read from its pipe
    with select() and os.read(), so a non-blocking look never misses a
    line buffered on this side.  It makes its board and hands it over;
    `board` is this side's, adopted."""

    def __init__(self, size: int = SIZE):
        fd, self.log_path = tempfile.mkstemp(prefix="busy_worker.", text=True)
        os.close(fd)
        self.buf = b""
        with Handoff() as handoff:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), str(size), self.log_path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                env={**os.environ, ENV_VAR: handoff.spec},
            )
            self.fd = self.proc.stdout.fileno()
            words = self.line().split()
            if words[0] != "ready":
                raise RuntimeError(f"busy worker: {' '.join(words)}")
            self.pid = int(words[1])
            self.board, _, _ = handoff.collect(
                self.proc.pid, lambda fd: Board.adopt(fd, 1))

    def bind(self, slot: int) -> None:
        self.send(f"bind {slot} {self.board.tag(slot)}")
        if (line := self.line()) != "bound":
            raise RuntimeError(f"busy worker: {line!r}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def _fill(self, timeout: float) -> bool:
        if not select.select([self.fd], [], [], timeout)[0]:
            return False
        data = os.read(self.fd, 65536)
        if not data:
            raise RuntimeError(
                f"busy worker died (rc {self.proc.wait(DEADLINE)})")
        self.buf += data
        return True

    def _pop(self) -> str | None:
        line, sep, rest = self.buf.partition(b"\n")
        if not sep:
            return None
        self.buf = rest
        return line.decode()

    def poll_line(self) -> str | None:
        """A line if one has arrived, else None, without waiting."""
        line = self._pop()
        if line is None and self._fill(0):
            line = self._pop()
        return line

    def line(self) -> str:
        end = time.monotonic() + DEADLINE
        while (line := self._pop()) is None:
            if not self._fill(max(0.0, end - time.monotonic())):
                if time.monotonic() >= end:
                    raise RuntimeError("busy worker did not answer")
        return line

    def timeline(self) -> list[tuple[int, int]]:
        with open(self.log_path) as f:
            return [(int(t), int(v)) for t, v in (ln.split() for ln in f)]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(DEADLINE)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(DEADLINE)
        self.proc.stdin.close()
        self.proc.stdout.close()
        for path in (self.log_path, self.log_path + ".tmp"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class Host:
    """One board, a worker on it, and two stand-ins of its model: one on
    receipts only, one with the board attached.  Both get every echo."""

    def __init__(self, impl_name: str = "C", size: int = SIZE):
        self.impl = importlib.import_module(IMPLS[impl_name])
        self.size = size
        self.receipts = make_standin(self.impl, size)
        self.on_board = make_standin(self.impl, size)
        self.worker: BusyWorker | None = None
        try:
            self.worker = BusyWorker(size)
            self.board = self.worker.board
            self.worker.bind(self.on_board.attach_board(self.board))
            self.board.expected_owner = self.worker.pid
        except BaseException:
            self.close()
            raise

    def apply(self, line: str) -> str | None:
        """Applies an "echo RESIDENT SEQ" line to both stand-ins; returns
        the line if it is anything else."""
        words = line.split()
        if words[0] != "echo":
            return line
        resident, seq = int(words[1]), int(words[2])
        self.impl.apply_echo(self.receipts, resident, seq=seq)
        self.impl.apply_echo(self.on_board, resident, seq=seq)
        return None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.on_board.detach_board()
            self.worker.board.close()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_call(host: Host, command: str) -> None:
    host.worker.send(command)
    first = host.worker.line()
    if host.apply(first) is not None:  # the start echo, before sampling
        raise RuntimeError(f"busy worker: expected an echo, got {first!r}")


def _finish(host: Host, line: str) -> int:
    if not line.startswith("done "):
        raise RuntimeError(f"busy worker: {line!r}")
    return int(line.split()[1])


# ---- 2. error of the host's view --------------------------------------------


def sample_call(host: Host, duration_s: float, period_us: float, seed: int,
                step_us: tuple[int, int] = (500, 2000),
                start: int | None = None):
    """A busy call sampled at a fixed rate.  Returns (timeline, samples):
    the worker's [(t_ns, value)] and the host's [(t_ns, receipts view,
    board view)]."""
    start = host.size // 4 if start is None else start
    _start_call(host, f"call {seed} {max(1, round(duration_s * 1000))} "
                      f"{step_us[0]} {step_us[1]} {start}")
    receipts, on_board = host.receipts.loaded_size, host.on_board.loaded_size
    poll, mono = host.worker.poll_line, time.monotonic_ns
    period = int(period_us * 1000)
    samples = []
    next_t = mono()
    done = None
    deadline = time.monotonic() + duration_s + DEADLINE
    while done is None:
        now = mono()
        while now < next_t:  # pace: a fixed rate, spinning
            now = mono()
        next_t = max(next_t + period, now - period)
        samples.append((mono(), receipts(), on_board()))
        while (line := poll()) is not None:
            if (other := host.apply(line)) is not None:
                done = _finish(host, other)
        if time.monotonic() > deadline:
            raise RuntimeError("busy worker: the call did not end")
    timeline = host.worker.timeline()
    assert len(timeline) == done, (len(timeline), done)
    return timeline, samples


def script_call(host: Host, values: list[int]):
    """A scripted call in lockstep (no timing): the worker publishes each
    value after a "go"; the host waits until the board stand-in shows it
    (polling the board, as a host would) and samples.  By construction the
    board view then equals the truth while the receipt is the start echo.
    Returns (timeline, samples) like sample_call()."""
    _start_call(host, "script " + " ".join(map(str, values)))
    samples = []
    mono = time.monotonic_ns

    def sample() -> None:
        samples.append((mono(), host.receipts.loaded_size(),
                        host.on_board.loaded_size()))

    sample()
    for value in values[1:]:
        host.worker.send("go")
        end = time.monotonic() + DEADLINE
        while host.on_board.loaded_size() != value:
            if time.monotonic() > end:
                raise RuntimeError(f"the board never showed {value}")
            os.sched_yield()
        sample()
    host.worker.send("go")
    line = host.worker.line()
    if host.apply(line) is not None:
        raise RuntimeError(f"busy worker: expected an echo, got {line!r}")
    sample()
    done = _finish(host, host.worker.line())
    timeline = host.worker.timeline()
    assert len(timeline) == done == len(values)
    return timeline, samples


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ratio(a: float, b: float) -> float:
    return a / b if b else (math.inf if a else 1.0)


def summarize_errors(timeline, samples, size: int) -> dict[str, Any]:
    """Absolute error of each view against the worker's true value at the
    sample's time (its last change stamped at or before it)."""
    times = [t for t, _ in timeline]
    errors: dict[str, list[int]] = {"receipts": [], "board": []}
    for ts, receipt_view, board_view in samples:
        i = bisect.bisect_right(times, ts) - 1
        if i < 0:
            continue  # before the call's first value (not expected)
        truth = timeline[i][1]
        errors["receipts"].append(abs(receipt_view - truth))
        errors["board"].append(abs(board_view - truth))
    out: dict[str, Any] = {"samples": len(errors["board"]),
                           "changes": len(timeline) - 1, "size": size}
    for view, errs in errors.items():
        out[view] = {
            "mean": statistics.fmean(errs) if errs else math.nan,
            "p95": pct(errs, 0.95) if errs else math.nan,
            "max": max(errs) if errs else math.nan,
            "exact": (sum(e == 0 for e in errs) / len(errs)
                      if errs else math.nan),
        }
    out["ratio"] = {k: ratio(out["receipts"][k], out["board"][k])
                    for k in ("mean", "p95", "max")}
    return out


# ---- staleness --------------------------------------------------------------


def poll_call(host: Host, duration_s: float, seed: int,
              step_us: tuple[int, int] = (500, 2000)):
    """A busy call, the host polling the board stand-in's loaded_size() as
    fast as it can.  Returns (timeline, seen): the worker's changes and
    [(t_ns, value)] for each new value the host saw."""
    _start_call(host, f"call {seed} {max(1, round(duration_s * 1000))} "
                      f"{step_us[0]} {step_us[1]} {host.size // 4}")
    on_board = host.on_board.loaded_size
    poll, mono = host.worker.poll_line, time.monotonic_ns
    seen = []
    last = on_board()
    done = None
    deadline = time.monotonic() + duration_s + DEADLINE
    while done is None:
        if time.monotonic() > deadline:
            raise RuntimeError("busy worker: the call did not end")
        for _ in range(64):
            value = on_board()
            if value != last:
                seen.append((mono(), value))
                last = value
        while (line := poll()) is not None:
            if (other := host.apply(line)) is not None:
                done = _finish(host, other)
    timeline = host.worker.timeline()
    assert len(timeline) == done
    return timeline, seen


def staleness(timeline, seen) -> dict[str, Any]:
    """Lag from each change (values are distinct within a call) to the
    host's first read of it; changes overwritten before the host read
    them are counted as missed."""
    changed_at = {v: t for t, v in timeline[1:]}
    first: dict[int, int] = {}
    for t, v in seen:
        if v in changed_at and v not in first:
            first[v] = t
    lags = [(first[v] - t) / 1000 for v, t in changed_at.items() if v in first]
    return {
        "changes": len(changed_at),
        "missed": len(changed_at) - len(lags),
        "median_us": statistics.median(lags) if lags else math.nan,
        "p90_us": pct(lags, 0.90) if lags else math.nan,
        "p99_us": pct(lags, 0.99) if lags else math.nan,
        "max_us": max(lags) if lags else math.nan,
    }


# ---- report -----------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = (len(os.sched_getaffinity(0))
              if hasattr(os, "sched_getaffinity") else os.cpu_count())
    return (f"{usable} CPUs usable (nproc), {cpu}, {platform.system()} "
            f"{platform.release()}, {platform.python_implementation()} "
            f"{platform.python_version()}")


def gb(n: float) -> str:
    return f"{n / GIB:g} GiB"


def size_text(n: float, size: int) -> str:
    """Bytes, then a readable unit and the share of the model's size."""
    if not n:
        return "0 B"
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):  # noqa: B007, E501
        if n >= scale:
            break
    else:
        unit, scale = "B", 1
    return (f"{n:,.0f} B ({n / scale:.2f} {unit}, "
            f"{100 * n / size:.3g} % of size)")


def ratio_text(a: float, b: float) -> str:
    if not b:
        return "board exact" if a else "both exact"
    return f"{a / b:,.0f}x"


def report(reads, errors, stale, args, where: str | None = None,
           load_before: tuple[float, ...] | None = None) -> str:
    size = errors["size"]
    r, b = errors["receipts"], errors["board"]
    best = {name: {case: min(rounds) for case, rounds in reads[name].items()}
            for name in ("C", "reference")}
    c, ref = best["C"], best["reference"]
    spread = benchutil.spread_text
    load = benchutil.load_text(load_before or benchutil.loadavg(),
                               benchutil.loadavg())
    lines = [
        f"Command: `{benchutil.command(SCRIPT, args.argv)}`  ",
        f"Machine: {where or machine()}; {load}.",
        "",
        "What a stand-in's `loaded_size()` costs, and how wrong it is while "
        "a worker pages, with receipts only (docs/architecture.md, inaccuracy "
        "2) and with the live board attached (docs/board.md).",
        "",
        f"### read cost (ns per `s.loaded_size()`, best (median, p90) of "
        f"{reads['repeats']} rounds x {reads['n']:,})",
        "",
        "The call as ComfyUI makes it: the method looked up on every call "
        "(`s.loaded_size()`), never bound once before the loop.  Ratios "
        "are of the best rounds.",
        "",
        "| implementation | receipts only | board attached (valid reading) "
        "| board / receipts |",
        "|---|---:|---:|---:|",
        f"| C (`comfy_standin.StandIn`) | "
        f"{spread(reads['C']['receipts'])} | {spread(reads['C']['board'])} "
        f"| {ratio(c['board'], c['receipts']):.1f}x |",
        f"| reference (`comfy_standin._reference.StandIn`) | "
        f"{spread(reads['reference']['receipts'])} | "
        f"{spread(reads['reference']['board'])} | "
        f"{ratio(ref['board'], ref['receipts']):.1f}x |",
        f"| reference / C | {ratio(ref['receipts'], c['receipts']):.1f}x | "
        f"{ratio(ref['board'], c['board']):.1f}x | |",
        "",
        f"Loop overhead (an empty Python call `f()`) "
        f"{spread(reads['empty'])} ns, "
        "included in every figure.  With a board (layout 2), a read takes "
        "the slot's tag from the host's own table, checks the host's "
        "worker-gone flag, the owner word and the heartbeat (coarse clock), "
        "and the seqlock snapshot (tag, value, stamp): a few atomic loads "
        "and no system call (the precise clock only for a stamp more than a "
        "tick past the coarse one).  Board v1 paid a `kill(pid, 0)` per "
        "read: 506 ns, 18.0x a receipt, on this machine.",
        "",
        "### error of the host's view during a busy call (C stand-in)",
        "",
        f"A worker process pages a model of {gb(size)} for "
        f"{args.duration:g} s: every {args.step_min_us}-{args.step_max_us} "
        f"us its residency moves by size/64..size/12 towards the size, "
        f"then back towards 0, {errors['changes']:,} changes, each "
        "published on the board; it echoes its residency only at the start "
        "and the end of the call.  The host samples every "
        f"{args.period_us:g} us ({errors['samples']:,} samples) and "
        "compares each view with the worker's true value at that instant "
        "(the worker's CLOCK_MONOTONIC log of its changes).",
        "",
        "| absolute error | receipts only | board attached | "
        "receipts / board |",
        "|---|---:|---:|---:|",
    ]
    for key in ("mean", "p95", "max"):
        lines.append(
            f"| {key} | {size_text(r[key], size)} | "
            f"{size_text(b[key], size)} | "
            f"{ratio_text(r[key], b[key])} |")
    lines += [
        f"| samples exactly right | {100 * r['exact']:.2f} % | "
        f"{100 * b['exact']:.2f} % | |",
        "",
        "The board's residual error is the moments between a change and the "
        "host's next read of it (a sample that falls in the worker's "
        "publish, or in the microsecond after).",
        "",
        "### staleness of the board view (cross-process)",
        "",
        f"Another {args.stale_duration:g} s call of the same kind; the host "
        "polls the board stand-in's `loaded_size()` in a loop and records, "
        "for each change, the time from the worker's stamp (taken just "
        "before its publish) to the first `loaded_size()` that returns it.",
        "",
        "| changes | missed | median | p90 | p99 | max |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {stale['changes']:,} | {stale['missed']} | "
        f"{stale['median_us']:.1f} us | {stale['p90_us']:.1f} us | "
        f"{stale['p99_us']:.1f} us | {stale['max_us']:.1f} us |",
        "",
        "The worker sleeps between changes (as a pager waits on compute), "
        "so a change is stamped just after the worker wakes; with the host "
        "spinning, the lag includes the scheduler's placing of the two "
        "processes on the CPUs, and any other load on the machine shows "
        "in the tail.  A receipt, by contrast, is as stale as the last "
        "message: up to the whole call.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("-n", type=int, default=100_000,
                        help="loaded_size() calls per round")
    parser.add_argument("--repeats", type=int, default=9,
                        help="read-cost rounds (best, median and p90 "
                        "reported)")
    parser.add_argument("--duration", type=float, default=6.0,
                        help="seconds of the sampled call")
    parser.add_argument("--period-us", type=float, default=200.0)
    parser.add_argument("--step-min-us", type=int, default=500)
    parser.add_argument("--step-max-us", type=int, default=2000)
    parser.add_argument("--stale-duration", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    where = machine()  # before the run loads the machine
    load_before = benchutil.loadavg()
    reads = bench_reads(args.n, args.repeats)
    steps = (args.step_min_us, args.step_max_us)
    with Host() as host:
        timeline, samples = sample_call(host, args.duration, args.period_us,
                                        args.seed, steps)
        errors = summarize_errors(timeline, samples, host.size)
        stale = staleness(*poll_call(host, args.stale_duration,
                                     args.seed + 1, steps))
    text = report(reads, errors, stale, args, where, load_before)
    print(text)
    if args.write:
        benchutil.write_section("board-view", SECTION, text, SCRIPT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
