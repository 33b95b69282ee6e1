"""The demo's worker process: fake models on a simulated card, no GPU.

Started by ``python -m comfy_standin demo`` as::

    COMFY_STANDIN_BOARD=<handoff> python -m comfy_standin._demo_worker

It makes its residency board (a sealed memfd only it can write) and sends
the descriptor to the host over the handoff named in its environment
(comfy_standin._handoff), with the code a comfy-env worker's publisher uses
(python/comfy_standin/_worker_side/).  Then it speaks comfy-env's command
protocol (docs/comfyui.md, "Worker protocol") as JSON lines: one request
per line on stdin, exactly one reply line per request on stdout, so the
host never has to wait on a clock.

Requests are ``{"method": ..., "params": {...}}``; replies are
``{"status": "ok", ...}`` or ``{"status": "error", "error": "..."}``.

- ``make_models {models: [{id, size, kind}]}``: like a loader node; the
  reply carries ``_new_models`` as comfy-env's frames do.
- ``board_bind {model_id, slot, tag}``: the host gave the model a board
  slot under a tag of its choosing; the model's residency is published
  there from now on (the current value at once).
- ``model_partial_load {model_id, extra_bytes, device}`` ->
  ``{loaded, resident, seq}``
- ``model_partial_unload {model_id, bytes_to_free}`` ->
  ``{freed, resident, seq}`` (freed in whole 64 MiB blocks, so it may free
  a little more than asked)
- ``model_to_device {model_id, device}`` -> ``{device, moved, seq}``
- ``call_begin {model_id, resident}``: a node call starts and pages the
  model to ``resident`` bytes, publishing it on the board.  The reply is a
  progress frame that says nothing about residency: from the host's side
  the bytes moved without a message.
- ``call_end``: the call returns; its reply says nothing about residency
  either (a worker from before censuses).
- ``report``: a frame carrying ``_vram_report`` (``held`` and the
  residency census), as comfy-env's worker sends at a node boundary.
- ``refuse {on}``: from now on evictions fail as comfy-env's do when the
  worker's lock is not free in time (a live worker that cannot answer).
- ``exit``: replies, then exits 0.

Every change of a model's residency is published on the board *before*
the reply is written, so a host that has the reply also sees the board.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

#: A partial unload frees whole blocks (a layer at a time).
BLOCK = 64 << 20


class FakeModel:
    def __init__(self, model_id: str, size: int, kind: str) -> None:
        self.model_id = model_id
        self.size = size
        self.kind = kind
        self.resident = 0
        self.slot: int | None = None


class DemoWorker:
    def __init__(self, board: Any) -> None:
        self.board = board
        self.models: dict[str, FakeModel] = {}
        self.seq = 0
        self.refusing = False
        self.in_call: str | None = None

    # -- residency ------------------------------------------------------

    def _set(self, model: FakeModel, resident: int) -> None:
        model.resident = resident
        if model.slot is not None:
            self.board.publish(model.slot, resident)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _model(self, params: dict[str, Any]) -> FakeModel:
        model_id = params.get("model_id")
        model = self.models.get(model_id)
        if model is None:
            raise KeyError(f"model {model_id!r} not registered")
        return model

    def _refuse(self) -> None:
        if self.refusing:
            raise TimeoutError(
                "worker busy: its command lock was not free within 2 s"
            )

    # -- commands -------------------------------------------------------

    def make_models(self, params: dict[str, Any]) -> dict[str, Any]:
        new = []
        for spec in params["models"]:
            model = FakeModel(spec["id"], int(spec["size"]), spec["kind"])
            self.models[model.model_id] = model
            new.append(
                {
                    "id": model.model_id,
                    "size": model.size,
                    "kind": model.kind,
                    "device": "cpu",
                }
            )
        return {"_new_models": new}

    def board_bind(self, params: dict[str, Any]) -> dict[str, Any]:
        model = self._model(params)
        slot, tag = int(params["slot"]), int(params["tag"])
        self.board.bind(slot, tag)
        model.slot = slot
        self.board.publish(slot, model.resident)
        return {"slot": slot}

    def model_partial_load(self, params: dict[str, Any]) -> dict[str, Any]:
        model = self._model(params)
        room = model.size - model.resident
        loaded = max(0, min(int(params["extra_bytes"]), room))
        self._set(model, model.resident + loaded)
        return {
            "loaded": loaded,
            "resident": model.resident,
            "seq": self._next_seq(),
        }

    def model_partial_unload(self, params: dict[str, Any]) -> dict[str, Any]:
        self._refuse()
        model = self._model(params)
        asked = max(0, int(params["bytes_to_free"]))
        blocks = -(-asked // BLOCK)
        freed = min(model.resident, blocks * BLOCK)
        self._set(model, model.resident - freed)
        return {
            "freed": freed,
            "resident": model.resident,
            "seq": self._next_seq(),
        }

    def model_to_device(self, params: dict[str, Any]) -> dict[str, Any]:
        self._refuse()
        model = self._model(params)
        device = str(params["device"])
        if device.startswith("cpu"):
            moved = model.resident
            self._set(model, 0)
        else:
            moved = model.size - model.resident
            self._set(model, model.size)
        return {"device": device, "moved": moved, "seq": self._next_seq()}

    def call_begin(self, params: dict[str, Any]) -> dict[str, Any]:
        model = self._model(params)
        resident = max(0, min(int(params["resident"]), model.size))
        self.in_call = model.model_id
        self._set(model, resident)
        self._next_seq()  # the worker's own count moves; the host's does not
        return {"phase": "running", "call": model.model_id}

    def call_end(self, params: dict[str, Any]) -> dict[str, Any]:
        self.in_call = None
        return {"result": "done"}

    def report(self, params: dict[str, Any]) -> dict[str, Any]:
        residency = [
            {
                "id": m.model_id,
                "seq": self.seq,
                "resident": m.resident,
                "device": "cuda:0" if m.resident else "cpu",
            }
            for m in self.models.values()
        ]
        return {
            "_vram_report": {
                "held": sum(m.resident for m in self.models.values()),
                "residency": residency,
            }
        }

    def refuse(self, params: dict[str, Any]) -> dict[str, Any]:
        self.refusing = bool(params.get("on", True))
        return {"refusing": self.refusing}


def make_and_send(slots: int, generation: int) -> Any:
    """Makes this worker's board (a memfd only it can write) and sends its
    descriptor to the host over the handoff named in COMFY_STANDIN_BOARD,
    as a comfy-env worker's publisher does; neither the variable nor the
    descriptor stays here.  ConnectionError when the handoff is gone."""
    from comfy_standin._core import Board
    from comfy_standin._worker_side import _comfy_standin_publisher as pub

    spec = pub._parse_spec(os.environ.pop(pub.ENV_VAR, ""))
    if isinstance(spec, str):
        raise ValueError(spec)
    board, fd = Board.make(slots, generation=generation)
    try:
        why = pub._send_board(*spec, fd)
    finally:
        os.close(fd)  # the mapping keeps the board
    if why is not None:
        board.close()
        raise ConnectionError(why)
    return board


def main() -> int:
    try:
        return _serve()
    except ConnectionError:  # BrokenPipeError, a handoff gone and the like
        # The host went away (interrupted, it ends its workers): nobody
        # is left to answer, and a traceback would land on the host's
        # terminal.  Nothing more goes to the broken pipe at exit either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1


def _serve() -> int:
    worker = DemoWorker(make_and_send(8, generation=1))
    board = worker.board
    out = sys.stdout

    def reply(frame: dict[str, Any]) -> None:
        out.write(json.dumps(frame) + "\n")
        out.flush()

    reply({"status": "ok", "ready": True, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
                method = request["method"]
                params = request.get("params") or {}
                if method == "exit":
                    reply({"status": "ok"})
                    return 0
                handler = getattr(worker, method, None)
                if method.startswith("_") or handler is None:
                    raise ValueError(f"unknown command {method!r}")
                frame = {"status": "ok"}
                frame.update(handler(params))
            except Exception as exc:  # noqa: BLE001 - reported to the host
                frame = {
                    "status": "error",
                    "error": f"{type(exc).__name__}: {exc}",
                }
            reply(frame)
    finally:
        board.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
