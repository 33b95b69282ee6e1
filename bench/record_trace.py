"""Record a trace from comfy-env 0.4.46's real worker processes, for
bench/bench_regret.py to replay (bench/traces/*.jsonl).

What runs for real: comfy-env's host path for an isolated node
(``metadata._call_in_worker``: the worker spawn and handshake, the call,
the node boundary ``_register_new_patchers``), its worker process
(``_persistent_worker.py``: the shimmed ``load_models_gpu`` and its
``request_vram_budget`` callback, the host's ``_handle_vram_budget`` and
ComfyUI's ``free_memory`` inside it, the command handlers
``model_partial_unload`` / ``model_to_device`` served inside the call,
``_register_if_cuda``, the census on every frame), two workers at once,
with torch (the CPU wheel: the handlers import it).  ComfyUI is the mock
of tests/mockcomfy in every process; a small shared file
(bench/trace_card.py) makes each process's ``get_free_memory``
device-wide, as on Linux.  The models are a pack's fake modules whose
parameters carry a ``torch.device``, so bytes move without a GPU and the
worker compares devices as it does on one.

Recorded: the script (events with the times they really started),
every free_memory pass on the host that had to evict (its candidates, the
figure each was sorted by, which models' bytes left the card), every
census comfy-env applied, and each process's residency changes
(``obs:`` lines).  The replay (bench/regret_workloads.py ``load_trace``)
plays the script through bench/regret_sim.py in every column; its
comfy-env column must evict the same models in the same passes as the
real run (bench/bench_regret.py ``replay_check``).

    pip install torch==2.13.0          # the CPU wheel, this venv only
    python bench/record_trace.py       # bench/traces/two_workers.jsonl and
                                       # bench/traces/busy_worker.jsonl

Takes about 100 s (two worker processes start with torch; the last call
outlasts two of comfy-env's 30 s lock timeouts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import stat
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MOCK = REPO / "tests" / "mockcomfy"
for _p in (str(MOCK), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import comfy.model_management as mm  # noqa: E402
import trace_card  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
CONTEXT = 300 * MiB
TRACES = HERE / "traces"

# The pack every worker runs: patchers and modules that hold bytes on the
# shared card, and one node whose call plays a list of steps.
PACK = textwrap.dedent('''
    import json
    import math
    import os
    import time

    import torch

    import comfy.model_management as mm
    import trace_card

    MiB = 1 << 20
    CARD = int(os.environ["TRACE_CARD_BYTES"])
    WORKER = os.environ["TRACE_WORKER"]
    SPECS = json.loads(os.environ["TRACE_MODELS"])

    mm.reset(total=CARD)
    _shared = trace_card.install(mm, os.environ["TRACE_SHARED"])
    _card = mm.sim.card()
    _card.allocate("ctx", int(os.environ["TRACE_CONTEXT"]))
    _log = open(os.environ["TRACE_LOG"], "a", buffering=1)
    ON, OFF = torch.device("cuda:0"), torch.device("cpu")


    def truth(name, resident, cause):
        _log.write(json.dumps({"t": time.monotonic(), "worker": WORKER,
                               "model": name, "resident": resident,
                               "cause": cause}) + "\\n")


    class _Param:
        def __init__(self, nbytes):
            self.nbytes = nbytes
            self.device = OFF

        def numel(self):
            return self.nbytes

        def element_size(self):
            return 1


    class FakeModule:
        """A module of `size` bytes in one parameter."""

        def __init__(self, spec):
            self.spec = spec
            self.size = spec["size"]
            self.resident = 0
            self._params = [_Param(self.size)]
            self.model_loaded_weight_memory = 0
            self.model_lowvram = False
            self.lowvram_patch_counter = 0
            self.current_weight_patches_uuid = None
            self.model_offload_buffer_memory = 0
            self.device = OFF

        def parameters(self):
            return iter(self._params)

        def buffers(self):
            return iter(())

        def set_resident(self, value, cause):
            value = max(0, min(int(value), self.size))
            delta = value - self.resident
            if delta > 0:
                _card.allocate(self.spec["name"], delta)
            elif delta < 0:
                _card.release(self.spec["name"], -delta)
            self.resident = value
            full = value >= self.size
            first = full or (value > 0 and self.spec["first_param_on_card"])
            self._params[0].device = ON if first else OFF
            self.device = ON if value else OFF
            truth(self.spec["name"], value, cause)

        def to(self, device):  # a pack's plain module
            dev = torch.device(device)
            if dev.type == "cuda":
                need = self.size - self.resident
                if need > mm.get_free_memory(mm.CUDA0):
                    raise RuntimeError("CUDA out of memory (trace)")
                self.set_resident(self.size, "pack")
            else:
                self.set_resident(0, "pack")
            return self


    class PackPatcher:
        """A ModelPatcher-like of a legacy model, loaded in blocks."""

        def __init__(self, spec):
            self.name = spec["name"]
            self.size = spec["size"]
            self.block = spec["block"]
            self.load_device, self.offload_device = mm.CUDA0, mm.CPU
            self.parent = None
            self.model = type(self.name, (FakeModule,), {})(spec)

        def model_size(self):
            return self.size

        def loaded_size(self):
            return self.model.resident

        def current_loaded_device(self):
            return self.load_device if self.model.resident else \\
                self.offload_device

        def is_dynamic(self):
            return False

        def is_clone(self, other):
            return other is self

        def model_dtype(self):
            return "float16"

        def model_patches_to(self, arg):
            return None

        def model_patches_models(self):
            return []

        def get_nested_additional_models(self):
            return []

        def lowvram_patch_counter(self):
            return 0

        def partially_load(self, device_to, extra_memory=0,
                           force_patch_weights=False):
            have = self.model.resident
            room = self.size - have
            if extra_memory >= room:
                want = room
            else:
                want = min(room, math.floor(extra_memory / self.block)
                           * self.block)
            if want > 0:
                self.model.set_resident(have + want, "load")
            return want

        def partially_unload(self, device_to, memory_to_free=0,
                             force_patch_weights=False):
            have = self.model.resident
            blocks = max(1, math.ceil(memory_to_free / self.block))
            freed = min(have, blocks * self.block)
            self.model.set_resident(have - freed, "unload")
            return freed

        def detach(self, unpatch_all=True):
            if unpatch_all:
                self.model.set_resident(0, "detach")
            return self.model


    PATCHERS = {}
    MODULES = {}
    for _spec in SPECS:
        if _spec["mode"] == "legacy":
            PATCHERS[_spec["name"]] = PackPatcher(_spec)
        else:
            MODULES[_spec["name"]] = type(_spec["name"], (FakeModule,),
                                          {})(_spec)


    class TraceNode:
        def run(self, steps):
            import comfy_worker

            for step in steps:
                if "load" in step:
                    mm.load_models_gpu(
                        [PATCHERS[n] for n in step["load"]],
                        memory_required=step.get("memory_required", 0))
                elif "compute" in step:
                    act = int(step.get("act", 0))
                    if act:
                        _card.allocate("act", act)
                    time.sleep(step["compute"])
                    if act:
                        _card.release("act")
                elif "to" in step:
                    module = MODULES[step["to"]]
                    module.to(step["device"])
                    if step["device"] != "cpu" and not getattr(
                            module, "_registered", False):
                        module._registered = True
                        comfy_worker.register_model(
                            f"{module.spec['name']}_0", module,
                            kind=module.spec["kind"])
                elif "offload" in step:
                    patcher = PATCHERS[step["offload"]]
                    patcher.detach()
                    for entry in list(mm.current_loaded_models):
                        if entry.model is patcher:
                            mm.current_loaded_models.remove(entry)
                else:
                    raise ValueError(f"unknown step {step!r}")
            return ("ok",)
''')


def _b(gib: float) -> int:
    return int(gib * GiB) // MiB * MiB


def _spec(name: str, gib: float, mode: str, first_on_card: bool,
          kind: str = "other") -> dict:
    size = _b(gib)
    block = size if mode == "plain" else max(16 * MiB,
                                             size // 48 // MiB * MiB)
    return {"name": name, "size": size, "mode": mode, "kind": kind,
            "block": block, "first_param_on_card": first_on_card}


def _host(name: str, gib: float) -> dict:
    size = _b(gib)
    return {"name": name, "size": size,
            "granularity": max(16 * MiB, size // 64 // MiB * MiB)}


def _call(worker: str, *steps: dict, during: list | None = None) -> dict:
    ev = {"ev": "call", "worker": worker, "steps": list(steps),
          "empty_cache": False}
    if during:
        ev["during"] = during
    return ev


def _hostev(models: list[str], act_gib: float, duration: float) -> dict:
    return {"ev": "host", "models": models,
            "memory_required": _b(act_gib), "act": _b(act_gib),
            "duration": duration}


def _beside(after: float, models: list[str], act_gib: float) -> dict:
    """ComfyUI's load_models_gpu on another thread (a web route, a second
    prompt thread), `after` seconds into the call it is listed with."""
    return {"ev": "host", "thread": "route", "after": after,
            "models": models, "memory_required": _b(act_gib)}


#: The recorded worlds (a name: its card, ComfyUI's models, the workers,
#: the script), each written to its own file in bench/traces/.
#:
#: two_workers: a 12 GiB card, ComfyUI's SDXL models, worker A with a
#: legacy DiT, a refiner it loads in the same call (a budget request while
#: the DiT moved since its last census) and a plain segmenter its pack
#: moves itself, worker B with an LLM whose first parameter leaves the
#: card first.  p0 loads everything once; its last host load evicts A's
#: DiT.  p1 calls B first, so A's reload of the DiT lands two node calls
#: after the eviction (comfy-env's boundary skips known ids: nothing lists
#: it again), then ComfyUI's next loads need room.
#:
#: busy_worker: a 12 GiB card, ComfyUI's SDXL models, a ControlNet and an
#: IP-Adapter,
#: worker C with a tagger its own load keeps partly on the CPU (room for
#: its activations).  ComfyUI loads the ControlNet, later the IP-Adapter,
#: on another thread while C is in a call: first one that outlasts the
#: load by about 3 s (a
#: command to C waits for C's lock until the call ends), then one longer
#: than two of comfy-env's lock timeouts (each command waits 30 s and
#: fails).
WORLDS = {
    "two_workers": {
        "card": 12,
        "hosts": [_host("unet", 4.78), _host("clip", 1.52),
                  _host("vae", 0.16)],
        "workers": [
            {"name": "A", "models": [_spec("dit", 4.93, "legacy", True),
                                     _spec("seg", 1.25, "plain", True),
                                     _spec("refiner", 2.33, "legacy",
                                           True)]},
            {"name": "B", "models": [_spec("llm", 7.0, "legacy", False)]},
        ],
        "script": [
            {"ev": "prompt", "id": "p0"},
            _hostev(["unet", "clip"], 1.0, 0.5),
            _call("A", {"load": ["dit"], "memory_required": _b(0.5)},
                  {"compute": 0.3, "act": 0, "use": ["dit"]}),
            _call("A", {"to": "seg", "device": "cuda"},
                  {"compute": 0.2, "act": 0, "use": ["seg"]},
                  {"to": "seg", "device": "cpu"}),
            _call("B", {"load": ["llm"], "memory_required": _b(1.0)},
                  {"compute": 0.5, "act": 0, "use": ["llm"]}),
            _hostev(["unet"], 2.0, 0.5),
            {"ev": "prompt", "id": "p1"},
            _call("B", {"compute": 0.2, "act": 0, "use": []}),
            _call("A", {"load": ["dit"], "memory_required": _b(0.5)},
                  {"compute": 0.3, "act": 0, "use": ["dit"]},
                  {"load": ["refiner"], "memory_required": _b(0.5)},
                  {"compute": 0.3, "act": 0, "use": ["refiner"]},
                  {"to": "seg", "device": "cuda"},
                  {"compute": 0.2, "act": 0, "use": ["seg"]}),
            _hostev(["unet", "clip"], 2.0, 0.5),
            _call("B", {"load": ["llm"], "memory_required": _b(1.0)},
                  {"compute": 0.5, "act": 0, "use": ["llm"]}),
            _hostev(["unet", "clip", "vae"], 2.5, 0.5),
        ],
    },
    "busy_worker": {
        "card": 12,
        "hosts": [_host("unet", 4.78), _host("clip", 1.52),
                  _host("vae", 0.16), _host("cnet", 1.25),
                  _host("ipa", 0.69)],
        "workers": [
            {"name": "C", "models": [_spec("tagger", 2.33, "legacy",
                                           True)]},
        ],
        "script": [
            {"ev": "prompt", "id": "p0"},
            _hostev(["unet", "clip"], 1.0, 0.5),
            _call("C", {"load": ["tagger"], "memory_required": _b(3.0)},
                  {"compute": 0.3, "act": 0, "use": ["tagger"]}),
            _call("C", {"compute": 4.0, "act": 0, "use": ["tagger"]},
                  during=[_beside(1.0, ["cnet"], 4.0)]),
            _hostev(["unet", "clip"], 1.0, 0.5),
            _call("C", {"load": ["tagger"], "memory_required": _b(3.0)},
                  {"compute": 66.0, "act": 0, "use": ["tagger"]},
                  during=[_beside(1.0, ["ipa"], 4.0)]),
        ],
    },
}


def _env_dir(root: Path, name: str) -> Path:
    """A directory comfy-env takes for a pack environment: bin/python
    runs this interpreter."""
    env = root / f"env-{name}"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return env


class Recorder:
    def __init__(self, root: Path, name: str) -> None:
        from comfy_env.isolation import metadata
        from comfy_env.isolation import pool as ce_pool
        import comfy_env.state_sync as state_sync

        self.metadata, self.pool, self.sync = metadata, ce_pool, state_sync
        self.root = root
        self.name = name
        world = WORLDS[name]
        self.world = world
        self.t0 = time.monotonic()
        self.obs: list[dict] = []
        self.events: list[dict] = []
        card = world["card"] * GiB
        mm.reset(total=card)
        mm.processing_interrupted = lambda: False
        shared_path = root / "card"
        trace_card.create(shared_path)
        self.shared = trace_card.install(mm, shared_path)
        self.card = mm.sim.card()
        self.hosts = {h["name"]: mm.HostModel(h["name"], h["size"],
                                              granularity=h["granularity"])
                      for h in world["hosts"]}
        pack = root / "pack"
        pack.mkdir()
        (pack / "tracepack.py").write_text(PACK)
        self.logs = {}
        self.specs = {}
        for w in world["workers"]:
            log = root / f"truth-{w['name']}.jsonl"
            log.touch()
            self.logs[w["name"]] = log
            env_vars = {
                "TRACE_CARD_BYTES": str(card),
                "TRACE_WORKER": w["name"],
                "TRACE_MODELS": json.dumps(w["models"]),
                "TRACE_SHARED": str(shared_path),
                "TRACE_LOG": str(log),
                "TRACE_CONTEXT": str(CONTEXT),
            }
            self.specs[w["name"]] = (_env_dir(root, w["name"]), pack,
                                     [str(pack), str(MOCK), str(HERE)],
                                     env_vars, 120.0)
        self._wrap()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 6)

    # -- what the host saw ----------------------------------------------------

    def truth(self) -> dict[str, int]:
        out = {f"host/{n}": h.loaded_size() for n, h in self.hosts.items()}
        for name, log in self.logs.items():
            for line in log.read_text().splitlines():
                e = json.loads(line)
                out[f"{name}/{e['model']}"] = e["resident"]
        return out

    def name_of(self, p: Any) -> str:
        if isinstance(p, mm.HostModel):
            return f"host/{p.name}"
        key = next(k for k, v in self.pool._WORKER_POOL.items()
                   if v.worker is p._worker)
        worker = next(w["name"] for w in self.world["workers"]
                      if str(self.specs[w["name"]][0]) == key)
        return f"{worker}/{p._model_id.rsplit('_', 1)[0]}"

    def _wrap(self) -> None:
        original = mm.free_memory
        recorder = self

        def free_memory(memory_required, device, keep_loaded=[],  # noqa: B006
                        for_dynamic=False, pins_required=0, ram_required=0):
            self.shared.refresh()
            free0 = recorder.card.free()
            before = recorder.truth()
            t = recorder.now()
            del mm.free_memory_log[:]
            out = original(memory_required, device, keep_loaded, for_dynamic,
                           pins_required, ram_required)
            record = mm.free_memory_log[-1]
            if memory_required > free0 and record["candidates"]:
                after = recorder.truth()
                took = {k: before[k] - after.get(k, 0) for k in before
                        if before[k] > after.get(k, 0)}
                recorder.obs.append({
                    "ev": "obs:pass", "t": t,
                    "required": memory_required, "free_before": free0,
                    "candidates": [
                        [recorder.name_of(e.model),
                         e.model.model_size() + key[0]]
                        for key, e in record["candidates"]],
                    "took": sorted(k.split("/", 1)[1] for k in took
                                   if k.split("/", 1)[1] != "ctx"),
                    "took_bytes": took,
                })
            return out

        mm.free_memory = free_memory
        apply_residency = self.sync.apply_residency

        def census(patchers, entries, log=None):
            recorder.obs.append({
                "ev": "obs:census", "t": recorder.now(),
                "entries": [{k: e.get(k) for k in ("id", "seq", "resident")}
                            for e in entries or []]})
            return apply_residency(patchers, entries, log=log)

        self.sync.apply_residency = census

    # -- playing the script ---------------------------------------------------

    def beside(self, ev: dict) -> None:
        """A host load on this (another) thread; the event gets the time it
        really started."""
        ev = {k: v for k, v in ev.items() if k != "after"}
        ev["t"] = self.now()
        self.events.append(ev)
        mm.load_models_gpu([self.hosts[n] for n in ev["models"]],
                           memory_required=ev["memory_required"])

    def play(self) -> None:
        for ev in self.world["script"]:
            ev = dict(ev)
            during = ev.pop("during", [])
            ev["t"] = self.now()
            self.events.append(ev)
            if ev["ev"] == "prompt":
                continue
            if ev["ev"] == "host":
                mm.load_models_gpu([self.hosts[n] for n in ev["models"]],
                                   memory_required=ev["memory_required"])
                self.card.allocate("act", ev["act"])
                time.sleep(ev["duration"])
                self.card.release("act")
                mm.soft_empty_cache()
                continue
            threads = [threading.Timer(d["after"], self.beside, (d,))
                       for d in during]
            for thread in threads:
                thread.start()
            try:
                self.metadata._call_in_worker(
                    worker_spec=self.specs[ev["worker"]],
                    module_name="tracepack", class_name="TraceNode",
                    method_name="run", self_state=None,
                    kwargs={"steps": ev["steps"]},
                    node_name=f"TraceNode.run ({ev['worker']})")
            finally:
                for thread in threads:
                    thread.join()
        self.events.append({"ev": "end", "t": self.now()})
        self.events.sort(key=lambda e: e["t"])

    def close(self) -> None:
        self.pool._shutdown_all_workers()
        self.shared.release()

    def lines(self) -> list[dict]:
        import torch

        import comfy_env

        truth = []
        for log in self.logs.values():
            for line in log.read_text().splitlines():
                e = json.loads(line)
                e["t"] = round(e["t"] - self.t0, 6)
                truth.append({"ev": "obs:truth", **e})
        header = {
            "format": "comfy-standin-trace/1",
            "name": f"{self.name} (recorded)",
            "card": self.world["card"] * GiB,
            "hosts": self.world["hosts"],
            "workers": [{"name": w["name"], "publishes": True,
                         "torch_cuda": False, "models": w["models"]}
                        for w in self.world["workers"]],
            "num_streams": 0,
            "source": (f"comfy-env {comfy_env.__version__} real workers, "
                       f"torch {torch.__version__}, recorded "
                       f"{datetime.date.today().isoformat()} by "
                       "bench/record_trace.py"),
        }
        obs = sorted(self.obs + truth, key=lambda e: e["t"])
        return [header, *self.events, *obs]


def record(name: str, out: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="record_trace."))
    try:
        recorder = Recorder(root, name)
        try:
            recorder.play()
        finally:
            recorder.close()
        lines = recorder.lines()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(line, sort_keys=True) + "\n"
                           for line in lines))
    os.replace(tmp, out)
    passes = sum(1 for e in lines if e.get("ev") == "obs:pass")
    print(f"wrote {out}: {len(lines)} lines, {passes} passes that evicted")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("worlds", nargs="*", choices=[[], *WORLDS],
                        help="which to record (default: all)")
    parser.add_argument("--out", type=Path, default=TRACES,
                        help="the directory the traces go to")
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("record_trace.py needs torch in this environment (the "
              "worker's handlers import it): pip install torch==2.13.0",
              file=sys.stderr)
        return 2
    for name in args.worlds or WORLDS:
        record(name, args.out / f"{name}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
