"""A test worker: a real subprocess holding fake models on a residency board.

No GPU: a fake model is a slot whose residency the worker changes over
time, publishing each change on the board.  It speaks a line protocol on
stdin/stdout (one command per line, one reply line per command):

    start:              python board_worker.py NAME  ->  "ready PID SLOTS"
    find ID             "slot N" | "slot none"
    publish SLOT N      "ok"
    heartbeat           "ok"
    page SLOT V1 .. Vn  a call during which the model's residency moves:
                        publishes V1, waits for a line "go", publishes V2,
                        ... Vn, and only then replies "done Vn".  Nothing
                        is written to stdout mid-call.
    storm SLOT SIZE     "storming", then publishes values in [0, SIZE] in a
                        tight loop until killed.
    scribble            "scribbling", then writes random bytes over the
                        whole segment until killed (the board must still
                        have its name).
    open NAME           tries to open another board: "opened" | "refused
                        ExceptionType"
    close               closes the board: "closed"
    exit                exits 0

Errors in a command reply "error ExceptionType: message".
"""

from __future__ import annotations

import os
import random
import sys


def main() -> int:
    from comfy_standin._core import Board

    board = Board.open(sys.argv[1])
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
            if cmd == "find":
                slot = board.find(args[0])
                reply(f"slot {'none' if slot is None else slot}")
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
                    publish(slot, rng.randint(0, size))
            elif cmd == "scribble":
                scribble(board)
            elif cmd == "open":
                try:
                    Board.open(args[0]).close()
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


def scribble(board) -> None:
    import _posixshmem
    import mmap

    fd = _posixshmem.shm_open(board.name, os.O_RDWR, 0o600)
    try:
        mem = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    header = bytes(mem[:64])
    rng = random.Random(2)
    print("scribbling", flush=True)
    while True:
        off = rng.randrange(len(mem))
        n = rng.randint(1, 16)
        chunk = rng.randbytes(min(n, len(mem) - off))
        mem[off:off + len(chunk)] = chunk
        if rng.random() < 0.5:
            # Put the header back often, so reads get past it to slots.
            mem[:64] = header


if __name__ == "__main__":
    sys.exit(main())
