"""A test worker: a real subprocess holding fake models on a residency board.

No GPU: a fake model is a slot whose residency the worker changes over
time, publishing each change on the board.  It speaks a line protocol on
stdin/stdout (one command per line, one reply line per command):

    start:              python board_worker.py FD  ->  "ready PID SLOTS"
                        (FD: the host's board descriptor, inherited; the
                        worker keeps it open for the hostile commands)
    bind SLOT TAG       "ok"
    publish SLOT N      "ok"
    heartbeat           "ok"
    page SLOT V1 .. Vn  a call during which the model's residency moves:
                        publishes V1, waits for a line "go", publishes V2,
                        ... Vn, and only then replies "done Vn".  Nothing
                        is written to stdout mid-call.
    storm SLOT SIZE     "storming", then publishes values in [0, 2 * SIZE]
                        in a tight loop until killed.
    truncate            tries ftruncate(fd, 0) and ftruncate(fd, 1 MiB):
                        "refused E1 E2" (the errno names) or "resized".
    scribble            "scribbling", then writes random bytes over the
                        whole segment until killed.
    odd                 "odd", then keeps every slot's seqlock word odd
                        (and the heartbeat fresh) until killed.
    tear SLOT           leaves SLOT's seqlock word odd, once (a write that
                        never finished): "torn".
    forkclose           forks; the child closes the board (and exits 0);
                        "forked RC" once the child is reaped.
    open                tries to open the board a second time: "opened" |
                        "refused ExceptionType"
    close               closes the board: "closed"
    exit                exits 0

Errors in a command reply "error ExceptionType: message".
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import sys
import time


def main() -> int:
    from comfy_standin._core import Board

    fd = int(sys.argv[1])
    board = Board.open(fd)
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
            elif cmd == "truncate":
                codes = []
                for length in (0, 1 << 20):
                    try:
                        os.ftruncate(fd, length)
                    except OSError as exc:
                        codes.append(errno.errorcode.get(exc.errno, "?"))
                reply("refused " + " ".join(codes) if len(codes) == 2
                      else "resized")
            elif cmd == "scribble":
                scribble(fd, reply)
            elif cmd == "odd":
                keep_odd(fd, board, reply)
            elif cmd == "tear":
                off = 64 + 64 * int(args[0])
                mem = mmap.mmap(fd, os.fstat(fd).st_size)
                word = int.from_bytes(mem[off:off + 8], "little")
                mem[off:off + 8] = (word | 1).to_bytes(8, "little")
                mem.close()
                reply("torn")
            elif cmd == "forkclose":
                pid = os.fork()
                if pid == 0:
                    board.close()  # the parent's board: must not detach
                    os._exit(0)
                _, status = os.waitpid(pid, 0)
                reply(f"forked {os.waitstatus_to_exitcode(status)}")
            elif cmd == "open":
                try:
                    Board.open(fd).close()
                    reply("opened")
                except Exception as exc:  # noqa: BLE001 - reported
                    reply(f"refused {type(exc).__name__}")
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


def scribble(fd: int, reply) -> None:
    mem = mmap.mmap(fd, os.fstat(fd).st_size)
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


def keep_odd(fd: int, board, reply) -> None:
    mem = mmap.mmap(fd, os.fstat(fd).st_size)
    slots = board.slots
    reply("odd")
    while True:
        for i in range(slots):
            off = 64 + 64 * i
            mem[off:off + 8] = (2 * i + 1).to_bytes(8, "little")
        mem[48:56] = time.monotonic_ns().to_bytes(8, "little")


if __name__ == "__main__":
    sys.exit(main())
