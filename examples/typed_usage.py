"""A short, type-checked tour of the public API (tests/test_typing.py runs
mypy --strict over it with the package's stubs, and runs it).

A worker is anything with ``send_command`` and ``is_alive`` (comfy-env's
SubprocessWorker is one); here a toy one that holds one model.  Terms:
docs/glossary.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import comfy_standin as cs

GiB = 1 << 30


class ToyWorker:
    """Holds one model; answers comfy-env's model commands."""

    def __init__(self) -> None:
        self.resident = 0
        self.seq = 0

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        self.seq += 1
        if command == "model_partial_load":
            loaded = min(int(kwargs["extra_bytes"]), 2 * GiB - self.resident)
            self.resident += loaded
            return {"loaded": loaded, "resident": self.resident,
                    "seq": self.seq}
        if command == "model_partial_unload":
            freed = min(int(kwargs["bytes_to_free"]), self.resident)
            self.resident -= freed
            return {"freed": freed, "resident": self.resident,
                    "seq": self.seq}
        self.resident = 0  # model_to_device, to the offload device
        return {"device": kwargs["device"], "seq": self.seq}

    def is_alive(self) -> bool:
        return True


def main() -> None:
    pool = cs.Pool(process_local=False)
    worker = ToyWorker()
    s = cs.StandIn(worker=worker, worker_generation=1, model_id="unet-0",
                   model_size=2 * GiB, load_device="cuda:0",
                   offload_device="cpu", kind="unet", pool=pool)

    loaded: int = s.partially_load("cuda:0", 1e32)   # ComfyUI's "all"
    freed: int = s.partially_unload("cpu", GiB)      # an eviction
    applied: bool = cs.apply_echo(s, resident=worker.resident,
                                  seq=worker.seq)
    census = [{"id": "unet-0", "seq": worker.seq + 1, "resident": 0}]
    entries: int = cs.apply_residency({"unet-0": s}, census)

    bytes_now, seq, age, source = s.receipt()        # the receipt
    reserve: int = pool.reserve("cuda:0", 400 << 20)
    charges: Mapping[cs.Worker, int] = pool.worker_charges()
    print(f"loaded {loaded}, freed {freed}, echo applied {applied}, "
          f"census entries {entries}; receipt {bytes_now} (seq {seq}, "
          f"{age:.3f} s old, {source}); reserve {reserve}; "
          f"charge {charges[worker]}; dynamic {s.is_dynamic()}")


if __name__ == "__main__":
    main()
