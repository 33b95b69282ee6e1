"""A busy worker for bench/bench_board_view.py: a real subprocess holding
one fake model on a residency board, as comfy-env's worker would hold a
paged model.

No GPU: the model's residency is a number the worker moves over time,
publishing every change on the board.  Like comfy-env's worker it tells
the host its residency only at the start and the end of a call (a command
echo, printed as a line "echo RESIDENT SEQ"); in between, the board is
the only channel.  It also logs its true timeline, one "T_NS VALUE" line
per change (T_NS: CLOCK_MONOTONIC, taken just before the publish), into
LOG, which the host reads after the call.

    start:  COMFY_STANDIN_BOARD=<handoff> python busy_worker.py SIZE LOG
            ->  "ready PID" once it has made its board (one slot) and
            handed it over (comfy_standin._handoff)
    bind SLOT TAG
        what the host gave the model (Board.tag): "bound"

    call SEED DURATION_MS MIN_US MAX_US START
        a paging call: publishes START (rounded down to 2**20) and
        echoes it, then for
        DURATION_MS moves the residency every MIN_US..MAX_US (random,
        seeded) by a layer-sized chunk, up towards the model size and
        down towards 0 in turn, publishing each change; then echoes the
        final value, writes LOG and replies "done N" (N changes).
    script V0 V1 .. Vn
        a scripted call in lockstep with the host (for tests, no timing):
        publishes V0 and echoes it; then, for each further value, waits
        for a line "go" and publishes it; after one more "go" echoes the
        last value, writes LOG and replies "done N".
    exit

Every value a call publishes is distinct from every other in that call
(the step index is added in the low bits), so the host can match what it
sees to the change that produced it.
"""

from __future__ import annotations

import os
import random
import sys
import time

TAG_BITS = 20  # low bits of a paging value: the step index


def main() -> int:
    from comfy_standin._demo_worker import make_and_send

    size, log_path = sys.argv[1:3]
    size = int(size)  # the host's own figure: the board's is host-private
    board = make_and_send(1, generation=0)
    slot = 0
    out = sys.stdout
    seq = 0

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    def echo(value: int) -> None:
        nonlocal seq
        seq += 1
        say(f"echo {value} {seq}")

    def write_log(log: list[tuple[int, int]]) -> None:
        tmp = log_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(f"{t} {v}\n" for t, v in log)
        os.replace(tmp, log_path)

    mono = time.monotonic_ns
    publish = board.publish
    say(f"ready {os.getpid()}")
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd, args = words[0], [int(a) for a in words[1:]]
        if cmd == "bind":
            slot = args[0]
            board.bind(slot, args[1])
            say("bound")
        elif cmd == "call":
            seed, duration_ms, min_us, max_us, start = args
            log = page(board, slot, size, seed, duration_ms, min_us, max_us,
                       start, echo)
            write_log(log)
            say(f"done {len(log)}")
        elif cmd == "script":
            log = []
            for i, value in enumerate(args):
                if i:
                    if sys.stdin.readline().strip() != "go":
                        raise RuntimeError("script: expected 'go'")
                t = mono()
                publish(slot, value)
                log.append((t, value))
                if i == 0:
                    echo(value)
            if sys.stdin.readline().strip() != "go":
                raise RuntimeError("script: expected 'go'")
            echo(args[-1])
            write_log(log)
            say(f"done {len(log)}")
        elif cmd == "exit":
            break
        else:
            say(f"error unknown command {cmd!r}")
    board.close()
    return 0


def page(board, slot, size, seed, duration_ms, min_us, max_us, start, echo):
    """The call: residency sweeps up and down between 0 and `size`."""
    rng = random.Random(seed)
    mono = time.monotonic_ns
    publish = board.publish
    tag_room = 1 << TAG_BITS
    # Bases are multiples of tag_room and the step index stays below it,
    # so every value of the call is distinct and names its step.
    top = (size - tag_room) // tag_room * tag_room
    lo_chunk = max(1, size // 64 // tag_room)
    hi_chunk = max(lo_chunk, size // 12 // tag_room)
    start = min(start, top) // tag_room * tag_room
    t = mono()
    publish(slot, start)
    log = [(t, start)]
    echo(start)
    base, up, step = start, True, 0
    end = t + duration_ms * 1_000_000
    while True:
        time.sleep(rng.uniform(min_us, max_us) / 1e6)
        if mono() >= end:
            break
        step += 1
        chunk = rng.randint(lo_chunk, hi_chunk) * tag_room
        base = base + chunk if up else base - chunk
        if base >= top:
            base, up = top, False
        elif base <= 0:
            base, up = 0, True
        value = base + step % tag_room  # (a call has far fewer steps)
        t = mono()
        publish(slot, value)
        log.append((t, value))
    # the end of the call: the worker's word, as comfy-env echoes it
    echo(log[-1][1])
    return log


if __name__ == "__main__":
    sys.exit(main())
