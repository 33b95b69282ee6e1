"""Fake comfy-env workers for the test suite.

A :class:`FakeWorker` speaks comfy-env's host-to-worker protocol
(docs/comfyui.md, "Worker protocol"): ``send_command(command,
model_id=..., **params) -> dict`` and ``is_alive()``. It holds fake models
with sizes and residency, and really allocates and releases their bytes in
the mock's simulated card (``comfy.model_management.sim``), under its own
process name, so ComfyUI's ``get_free_memory`` sees exactly what an eviction
returned.

Commands:

- ``model_partial_load(extra_bytes, device)`` -> ``{status, loaded,
  resident, seq}``
- ``model_partial_unload(bytes_to_free)`` -> ``{status, freed, resident,
  seq}``
- ``send_command_no_spawn(command, lock_timeout=2.0, **params)``, as
  comfy-env 0.4.46's: ``"dead"`` when not alive, ``"busy"`` when its
  command lock (``lock``, an RLock as comfy-env's ``_lock``) is not won
  within ``lock_timeout``, else ``send_command`` under that lock; every
  call is recorded in ``no_spawn`` as ``(command, lock_timeout)``.
- ``partial_release(size)`` -> ``{status, receipt: {freed_bytes,
  free_before, free_after}}``, as comfy-env 0.4.46's worker measures it:
  it gives back up to ``size`` bytes of its allocator cache (``add_cache``;
  ``cache_pinned`` of them cannot go) and says what the card got back.
- ``model_to_device(device)`` -> ``{status, device, moved, seq}``, with
  ``moved`` a bool as comfy-env 0.4.46 sends it (False, moving nothing,
  when the model's first parameter is on the target already); an unknown
  model id raises an error whose text contains "not registered".

Failures are scripted with :meth:`FakeWorker.script` (one-shot, for the next
matching command) or set as standing behaviour (``unload_cap``,
``drop_fields``). Every command is recorded in ``commands`` *before* any
failure, so "no command sent" is ``worker.commands == []``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from mock_fixtures import mock_mm as mm

__all__ = [
    "GARBAGE",
    "FakeModel",
    "FakeWorker",
    "WorkerDiedError",
    "WorkerError",
]


class WorkerError(RuntimeError):
    """An error reply from a live worker (comfy-env raises on those)."""


class WorkerDiedError(ConnectionError):
    """The transport reports the worker process is gone."""


@dataclass
class FakeModel:
    model_id: str
    size: int
    kind: str = "other"
    resident: int = 0
    device: str = "cpu"
    seq: int = 0  # worker seq of the last change to this model


@dataclass
class _Scripted:
    kind: str
    command: str | None
    options: dict = field(default_factory=dict)


def _beyond(reply, field_name, model):
    reply[field_name] = model.size + 1
    return reply


#: Ready-made bad replies: name -> function(reply, field, model) -> reply.
GARBAGE = {
    "missing": lambda r, f, m: {k: v for k, v in r.items() if k != f},
    "str": lambda r, f, m: {**r, f: str(r.get(f, 0))},
    "negative": lambda r, f, m: {**r, f: -5},
    "bool": lambda r, f, m: {**r, f: True},
    "nan": lambda r, f, m: {**r, f: float("nan")},
    "float": lambda r, f, m: {**r, f: float(r.get(f, 0)) + 0.5},
    "none": lambda r, f, m: {**r, f: None},
    "huge": lambda r, f, m: {**r, f: 2**64},
    "beyond": _beyond,
    "not_dict": lambda r, f, m: [r],
    "null": lambda r, f, m: None,
}


class FakeWorker:
    """A worker process holding fake models on a simulated card.

    ``name`` is its process name in the simulated card. ``context_bytes``
    (the CUDA context and handles, 276-300 MiB measured) is allocated at
    once when given. ``report_in_replies`` adds a ``_vram_report`` to every
    reply, as comfy-env's reply frames may carry one.
    """

    def __init__(
        self,
        name: str = "worker-0",
        *,
        load_device=mm.CUDA0,
        sim: mm.Sim | None = None,
        context_bytes: int = 0,
        report_in_replies: bool = False,
    ) -> None:
        self.name = name
        self.load_device = mm.device(load_device)
        self.sim = sim if sim is not None else mm.sim
        self.models: dict[str, FakeModel] = {}
        self.seq = 0
        self.alive = True
        self.commands: list[tuple[str, dict]] = []
        self.replies: list[object] = []
        self.scripts: deque[_Scripted] = deque()
        self.unload_cap: int | None = None  # standing "free less than asked"
        self.drop_fields: set[str] = set()  # standing "old worker"
        self.report_in_replies = report_in_replies
        self.pinned = 0
        self.held_extra = 0  # torch/aimdo bytes beyond the models
        self.context_bytes = int(context_bytes)
        self.during: list = []  # callbacks run inside every command
        self.lock = threading.RLock()  # comfy-env's command lock (_lock)
        self.no_spawn: list[tuple[str, float]] = []
        self.supports_partial_release = True
        self.cache_pinned = 0  # cache bytes a release cannot give back
        if self.context_bytes:
            self._card().allocate("context", self.context_bytes, self.name)

    # -- setup ------------------------------------------------------------

    def _card(self, dev=None):
        return self.sim.card(self.load_device if dev is None else dev)

    def add_model(
        self,
        model_id: str,
        size: int,
        resident: int = 0,
        kind: str = "other",
    ) -> dict:
        """Register a model; returns its ``_new_models`` entry."""
        if model_id in self.models:
            raise ValueError(f"{model_id!r} already registered")
        model = FakeModel(model_id, int(size), kind)
        self.models[model_id] = model
        if resident:
            self._load(model, int(resident), str(self.load_device))
        return {
            "id": model_id,
            "size": model.size,
            "kind": kind,
            "device": str(self.load_device),
        }

    def forget_model(self, model_id: str) -> None:
        """The worker restarted or dropped the model: it is no longer
        registered (its bytes go back to the card)."""
        model = self.models.pop(model_id)
        self._card().release(model.model_id, process=self.name)

    # -- scripting --------------------------------------------------------

    def script(self, kind: str, command: str | None = None, **options):
        """Queue a one-shot behaviour for the next command (of ``command``
        when given). Kinds:

        - ``"die"``: the process dies before doing anything; raises
          :class:`WorkerDiedError`, ``is_alive()`` turns False, its bytes
          return to the card;
        - ``"die_after"``: the command runs (bytes move), then the process
          dies before replying;
        - ``"refuse"``: raises :class:`WorkerError` (``message=`` text),
          the worker stays alive, nothing moves;
        - ``"timeout"``: raises ``TimeoutError``, alive, nothing moves;
        - ``"garbage"``: the command runs (``perform=False`` to skip it),
          the reply is replaced: ``reply=`` an object, or ``how=`` a key of
          :data:`GARBAGE` applied to ``field=``;
        - ``"old"``: the reply omits ``drop=`` fields (default ``("seq",)``);
        - ``"short"``: an unload frees at most ``freed=`` bytes;
        - ``"call"``: run ``fn()`` inside the command, then proceed;
        - ``"nothing"``: the worker moves nothing and says so as comfy-env
          0.4.46's does: a detach ``{device, moved: False, seq}`` (its
          model's first parameter on the target already), an unload
          ``{freed: 0, resident: 0}`` and a load ``{loaded: 0, resident:
          <size>}`` (its plain-module path, no seq);
        - ``"seq"``: the command runs, its reply carries ``seq=`` instead
          of the worker's (an older reply applied after a newer one);
        - ``"busy"``: ``send_command_no_spawn`` answers ``"busy"`` (another
          thread holds the command lock) and sends nothing.
        """
        self.scripts.append(_Scripted(kind, command, options))
        return self

    def kill(self) -> None:
        """The process is gone: not alive, every byte back to the card."""
        self.alive = False
        self.sim.release_process(self.name)

    def is_alive(self) -> bool:
        return self.alive

    def _take_script(self, command: str) -> _Scripted | None:
        for item in self.scripts:
            if item.command is None or item.command == command:
                self.scripts.remove(item)
                return item
        return None

    # -- protocol ---------------------------------------------------------

    def send_command(self, command: str, model_id=None, **params):
        self.commands.append((command, {"model_id": model_id, **params}))
        if not self.alive:
            raise WorkerDiedError(f"worker {self.name} is not running")
        for fn in list(self.during):
            fn(self, command)
        item = self._take_script(command)
        kind = item.kind if item else None
        opts = item.options if item else {}
        if kind == "call":
            opts["fn"]()
            kind = None
        if kind == "die":
            self.kill()
            raise WorkerDiedError(f"worker {self.name} died during {command}")
        if kind == "refuse":
            raise WorkerError(opts.get("message", f"worker busy: {command}"))
        if kind == "timeout":
            raise TimeoutError(f"{command} timed out after 30 s")
        perform = not (kind == "garbage" and not opts.get("perform", True))
        cap = self.unload_cap
        if kind == "short":
            cap = opts.get("freed", 0)
        if kind == "nothing":
            reply = self._nothing_reply(command, model_id, params)
        elif perform:
            reply = self._perform(command, model_id, params, cap)
        else:
            reply = self._dry_reply(command, model_id, params)
        if kind == "seq":
            reply["seq"] = opts["seq"]
        if kind == "die_after":
            self.kill()
            raise WorkerDiedError(f"worker {self.name} died after {command}")
        drop = set(self.drop_fields)
        if kind == "old":
            drop |= set(opts.get("drop", ("seq",)))
        for name in drop:
            reply.pop(name, None)
        if self.report_in_replies:
            reply["_vram_report"] = self.vram_report()
        if kind == "garbage":
            if "reply" in opts:
                reply = opts["reply"]
            else:
                model = self.models.get(model_id)
                reply = GARBAGE[opts.get("how", "missing")](
                    reply, opts.get("field", "freed"), model
                )
        self.replies.append(reply)
        return reply

    def send_command_no_spawn(self, command: str, lock_timeout=2.0,
                              **params):
        self.no_spawn.append((command, lock_timeout))
        if not self.alive:
            return "dead"
        for item in list(self.scripts):
            if item.kind == "busy" and item.command in (None, command):
                self.scripts.remove(item)
                return "busy"
        if not self.lock.acquire(timeout=lock_timeout):
            return "busy"
        try:
            return self.send_command(command, **params)
        finally:
            self.lock.release()

    def _model(self, model_id) -> FakeModel:
        model = self.models.get(model_id)
        if model is None:
            raise WorkerError(
                f"model {model_id!r} not registered in worker {self.name}"
            )
        return model

    def _bump(self, model: FakeModel) -> int:
        self.seq += 1
        model.seq = self.seq
        return self.seq

    def _load(self, model: FakeModel, want: int, dev: str) -> int:
        want = max(0, min(int(want), model.size - model.resident))
        if want:
            self._card(dev).allocate(model.model_id, want, self.name)
            model.resident += want
            model.device = dev
        return want

    def _unload(self, model: FakeModel, want: int) -> int:
        want = max(0, min(int(want), model.resident))
        freed = self._card().release(model.model_id, want, self.name)
        model.resident -= freed
        if model.resident == 0:
            model.device = "cpu"
        return freed

    def add_cache(self, nbytes: int) -> None:
        """Bytes its allocator keeps on the card that no model accounts
        for (in ``held``, on the card, in no census entry)."""
        self._card().allocate("cache", int(nbytes), self.name)
        self.held_extra += int(nbytes)

    def _partial_release(self, size: int) -> dict:
        card = self._card()
        before = card.free()
        give = max(0, min(int(size), self.held_extra - self.cache_pinned))
        self.held_extra -= card.release("cache", give, self.name)
        after = card.free()
        return {"status": "ok", "receipt": {
            "freed_bytes": after - before, "free_before": before,
            "free_after": after, "errors": []}}

    def _perform(self, command, model_id, params, cap):
        if command == "partial_release":
            return self._partial_release(params["size"])
        model = self._model(model_id)
        if command == "model_partial_load":
            extra = params["extra_bytes"]
            dev = params.get("device", str(self.load_device))
            loaded = self._load(model, extra, dev)
            return {
                "status": "ok",
                "loaded": loaded,
                "resident": model.resident,
                "seq": self._bump(model),
            }
        if command == "model_partial_unload":
            want = params["bytes_to_free"]
            if cap is not None:
                want = min(want, cap)
            freed = self._unload(model, want)
            return {
                "status": "ok",
                "freed": freed,
                "resident": model.resident,
                "seq": self._bump(model),
            }
        if command == "model_to_device":
            # As comfy-env 0.4.46's worker: when the model's first
            # parameter is on the target already it moves nothing and says
            # so (moved False), whatever else is on the card; otherwise it
            # moves the model and says moved True.
            dev = str(params["device"])
            moved = model.device != dev
            if moved and mm.device(dev).type == "cpu":
                self._unload(model, model.resident)
                model.device = dev
            elif moved:
                self._load(model, model.size, dev)
            return {
                "status": "ok",
                "device": dev,
                "moved": moved,
                "seq": self._bump(model),
            }
        raise WorkerError(f"unknown command {command!r}")

    def _nothing_reply(self, command, model_id, params):
        model = self._model(model_id)
        if command == "model_to_device":
            return {"status": "ok", "device": str(params["device"]),
                    "moved": False, "seq": self._bump(model)}
        if command == "model_partial_unload":
            return {"status": "ok", "freed": 0, "resident": 0}
        return {"status": "ok", "loaded": 0, "resident": model.size}

    def _dry_reply(self, command, model_id, params):
        model = self._model(model_id)
        base = {"status": "ok", "resident": model.resident, "seq": self.seq}
        if command == "model_partial_load":
            base["loaded"] = 0
        elif command == "model_partial_unload":
            base["freed"] = 0
        else:
            base.update(device=model.device, moved=False)
        return base

    def first_parameter_on_cpu(self, model_id: str) -> None:
        """The model's first parameter moves to the CPU while the rest
        stays on the card (a lowvram split): comfy-env's worker then
        answers a detach with moved False and moves nothing."""
        self.models[model_id].device = "cpu"

    # -- what the worker would tell the host ------------------------------

    def resident(self, model_id: str) -> int:
        return self.models[model_id].resident

    def census(self) -> list[dict]:
        """The residency list of a ``_vram_report``: one entry per model,
        each with the worker's current seq (a fresh reading)."""
        return [
            {
                "id": m.model_id,
                "seq": self.seq,
                "resident": m.resident,
                "device": m.device,
            }
            for m in self.models.values()
        ]

    def held(self) -> int:
        """The worker's measured scalar: its model bytes plus whatever else
        it holds (one figure, never a sum of overlapping counters)."""
        return sum(m.resident for m in self.models.values()) + self.held_extra

    def vram_report(self) -> dict:
        return {
            "held": self.held(),
            "residency": self.census(),
            "pinned": self.pinned,
            "overhead": self.context_bytes,
        }

    # alias matching the wire name
    @property
    def _vram_report(self) -> dict:
        return self.vram_report()

    def sent(self, command: str | None = None) -> list[dict]:
        """Params of the recorded commands (of ``command`` when given)."""
        return [p for c, p in self.commands if command in (None, c)]

    def __repr__(self):
        state = "alive" if self.alive else "dead"
        return f"<FakeWorker {self.name} {state} models={list(self.models)}>"
