"""One simulated card shared by several processes (bench/record_trace.py).

The mock ``comfy.model_management`` (tests/mockcomfy) keeps a card per
process.  On Linux ``get_free_memory`` is device-wide: every process sees
what every other holds.  This file gives each process a slot in a small
shared file (its pid and the bytes it holds on the card) and hooks the
mock so that each ``get_free_memory`` first counts the other processes'
bytes (under the owner ``("others", "all")``), and every allocation or
release publishes this process's total.

Layout: SLOTS little-endian (pid, bytes) pairs of int64.  One writer per
slot (its process); readers take each pair as it is (a torn pair between
two values of one process is no worse than a driver's reading taken a
microsecond earlier or later).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

SLOTS = 16
PAIR = struct.Struct("<qq")
SIZE = SLOTS * PAIR.size


def create(path: Path) -> None:
    """Make an empty shared card file (exclusively: never follow a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                 0o600)
    try:
        os.write(fd, b"\0" * SIZE)
    finally:
        os.close(fd)


class SharedCard:
    """This process's view of the shared card file."""

    def __init__(self, path: str | Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != SIZE:
                raise ValueError(f"{path}: not a shared card file")
            self.map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.pid = os.getpid()
        self.slot = self._claim()

    def _claim(self) -> int:
        for i in range(SLOTS):
            pid, _ = PAIR.unpack_from(self.map, i * PAIR.size)
            if pid in (0, self.pid):
                PAIR.pack_into(self.map, i * PAIR.size, self.pid, 0)
                return i
        raise RuntimeError("shared card: no free slot")

    def publish(self, nbytes: int) -> None:
        PAIR.pack_into(self.map, self.slot * PAIR.size, self.pid,
                       int(nbytes))

    def others(self) -> int:
        total = 0
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, nbytes = PAIR.unpack_from(self.map, i * PAIR.size)
            if pid:
                total += max(0, nbytes)
        return total

    def release(self) -> None:
        PAIR.pack_into(self.map, self.slot * PAIR.size, 0, 0)


def install(mm: Any, path: str | Path) -> SharedCard:
    """Hook the mock's card of this process to the shared file."""
    shared = SharedCard(path)
    card = mm.sim.card()
    card.strict = False
    key = ("others", "all")

    def own() -> int:
        return sum(n for k, n in card.allocations.items() if k != key)

    def refresh(_card: Any = None) -> None:
        others = shared.others()
        if others:
            card.allocations[key] = others
        else:
            card.allocations.pop(key, None)

    allocate, release = card.allocate, card.release

    def hooked_allocate(owner: str, nbytes: int, process: str = "host"):
        allocate(owner, nbytes, process)
        shared.publish(own())

    def hooked_release(owner: str, nbytes: int | None = None,
                       process: str = "host") -> int:
        n = release(owner, nbytes, process)
        shared.publish(own())
        return n

    card.allocate = hooked_allocate
    card.release = hooked_release
    mm.sim.on_query.insert(0, refresh)
    shared.refresh = refresh  # type: ignore[attr-defined]
    shared.publish(own())
    return shared
