"""A test worker: a real subprocess holding fake models on a residency board.

No GPU: a fake model is a slot whose residency the worker changes over
time, publishing each change on the board.  It makes its board and hands
it to the host over the handoff named in its environment, as the demo's
worker does (comfy_standin._demo_worker.make_and_send), then speaks a line
protocol on stdin/stdout (one command per line, one reply line per
command):

    start:              COMFY_STANDIN_BOARD=<handoff> python board_worker.py
                        SLOTS  ->  "ready PID SLOTS" once the board is sent
    bind SLOT TAG       "ok"
    publish SLOT N      "ok"
    heartbeat           "ok"
    page SLOT V1 .. Vn  a call during which the model's residency moves:
                        publishes V1, waits for a line "go", publishes V2,
                        ... Vn, and only then replies "done Vn".  Nothing
                        is written to stdout mid-call.
    storm SLOT SIZE     "storming", then publishes values in [0, 2 * SIZE]
                        in a tight loop until killed.
    scribble            "scribbling", then writes random bytes over the
                        whole segment until killed.
    odd                 "odd", then keeps every slot's seqlock word odd
                        (and the heartbeat fresh) until killed.
    tear SLOT           leaves SLOT's seqlock word odd, once (a write that
                        never finished): "torn".
    forkclose           forks; the child closes the board (and exits 0);
                        "forked RC" once the child is reaped.
    close               closes the board: "closed"
    exit                exits 0

The hostile commands write through the worker's own mapping (the seals
refuse any other writable one).  Errors in a command reply
"error ExceptionType: message".
"""

from __future__ import annotations

import ctypes
import os
import random
import sys
import time


def writable(board) -> memoryview:
    """The worker's own read-write mapping of `board`, found in
    /proc/self/maps by the board's label: the only way to write a board
    once it is sealed.  Drop the view before the board is closed."""
    want = board.name.removeprefix("memfd:")
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            if want in line and perms.startswith("rw"):
                start = int(span.split("-")[0], 16)
                length = 64 + 64 * board.slots  # the mapping's page: more
                raw = (ctypes.c_char * length).from_address(start)
                return memoryview(raw).cast("B")
    raise LookupError(f"no writable mapping of {want}")


def main() -> int:
    from comfy_standin._demo_worker import make_and_send

    board = make_and_send(int(sys.argv[1]), generation=0)
    out = sys.stdout

    def reply(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    reply(f"ready {os.getpid()} {board.slots}")
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd, args = words[0], words[1:]
        try:
            if cmd == "bind":
                board.bind(int(args[0]), int(args[1]))
                reply("ok")
            elif cmd == "publish":
                board.publish(int(args[0]), int(args[1]))
                reply("ok")
            elif cmd == "heartbeat":
                board.heartbeat()
                reply("ok")
            elif cmd == "page":
                slot, values = int(args[0]), [int(v) for v in args[1:]]
                for i, value in enumerate(values):
                    board.publish(slot, value)
                    if i + 1 < len(values):
                        if sys.stdin.readline().strip() != "go":
                            raise RuntimeError("page: expected 'go'")
                reply(f"done {values[-1]}")
            elif cmd == "storm":
                slot, size = int(args[0]), int(args[1])
                reply("storming")
                rng = random.Random(1)
                publish = board.publish
                while True:
                    publish(slot, rng.randint(0, 2 * size))
            elif cmd == "scribble":
                scribble(writable(board), reply)
            elif cmd == "odd":
                keep_odd(writable(board), board.slots, reply)
            elif cmd == "tear":
                off = 64 + 64 * int(args[0])
                mem = writable(board)
                word = int.from_bytes(mem[off:off + 8], "little")
                mem[off:off + 8] = (word | 1).to_bytes(8, "little")
                reply("torn")
            elif cmd == "forkclose":
                pid = os.fork()
                if pid == 0:
                    board.close()  # the parent's board: must not detach
                    os._exit(0)
                _, status = os.waitpid(pid, 0)
                reply(f"forked {os.waitstatus_to_exitcode(status)}")
            elif cmd == "close":
                board.close()
                reply("closed")
            elif cmd == "exit":
                return 0
            else:
                reply(f"error ValueError: unknown command {cmd!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the host
            reply(f"error {type(exc).__name__}: {exc}")
    return 0


def scribble(mem: memoryview, reply) -> None:
    rng = random.Random(2)
    reply("scribbling")
    while True:
        off = rng.randrange(len(mem))
        n = rng.randint(1, 16)
        mem[off:off + n] = rng.randbytes(min(n, len(mem) - off))
        if rng.random() < 0.3:
            # The owner and a fresh heartbeat back often, so reads get
            # past the header to the slots.
            mem[40:48] = os.getpid().to_bytes(8, "little")
            mem[48:56] = time.monotonic_ns().to_bytes(8, "little")


def keep_odd(mem: memoryview, slots: int, reply) -> None:
    reply("odd")
    while True:
        for i in range(slots):
            off = 64 + 64 * i
            mem[off:off + 8] = (2 * i + 1).to_bytes(8, "little")
        mem[48:56] = time.monotonic_ns().to_bytes(8, "little")


if __name__ == "__main__":
    sys.exit(main())
