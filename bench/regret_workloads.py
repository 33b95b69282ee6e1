"""Workloads for bench/bench_regret.py: seeded random ones, hand-written
scenarios, and recorded traces (bench/traces/), all in one format.

A workload is a dict (JSON-serialisable, so a trace file is one):

- ``card``: bytes on the simulated card;
- ``hosts``: ComfyUI's own models ``{name, size, granularity}``;
- ``workers``: ``{name, publishes, models: [{name, size, mode, kind,
  block, first_param_on_card}]}`` (``mode``: ``legacy`` a ModelPatcher the
  pack loads through load_models_gpu, ``paged`` a comfy-aimdo one,
  ``plain`` a module the pack moves itself; ``publishes``: whether the
  worker's board publisher runs);
- ``events``, ordered by ``t`` (seconds):

  - ``{"ev": "prompt", "id"}``: a prompt starts;
  - ``{"ev": "host", "models", "memory_required", "act", "duration"}``:
    a ComfyUI node loads its models (load_models_gpu) and computes;
  - ``{"ev": "call", "worker", "steps", "empty_cache"}``: an isolated
    node's call in a worker (comfy-env's call_method), its steps
    ``{"load": [names], "memory_required"}`` (the shimmed
    load_models_gpu), ``{"compute": seconds, "act", "use": [names]}``,
    ``{"to": name, "device"}`` (the pack moves a module),
    ``{"offload": name}`` (the pack's own unload);
  - ``{"ev": "route", ...}``: the same as a web-route ``call_module`` on
    another thread, at its time even inside a prompt node;
  - ``{"ev": "background", "worker", "steps"}``: a pack's own thread
    after a call: ``to`` / ``page`` (``{"page": name, "bytes"}``) /
    ``offload`` steps, each ``dt`` seconds after the one before, with no
    message to anyone;
  - ``{"ev": "lag", "worker", "until"}``: the worker's board sampler
    thread does not run (the pack holds the GIL);
  - ``{"ev": "hang", "worker", "until", "heartbeat"}``: the worker's main
    thread hangs; with ``heartbeat`` the sampler still runs;
  - ``{"ev": "kill", "worker"}``: the worker process dies;
  - ``{"ev": "end"}``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30

HERE = Path(__file__).resolve().parent
TRACES = HERE / "traces"

#: Card classes (GiB) and the host-to-device bandwidth a reload is charged
#: at (bytes/s): what pinned copies reach over PCIe 4.0 x8 on an 8 GiB
#: laptop card, PCIe 4.0 x16 consumer cards (12 and 24 GiB, unpinned
#: weights a little slower), PCIe 5.0 x16 on an 80 GiB H100 PCIe.  Stated,
#: not measured: the GiB figures are printed beside the seconds.
CARDS = (8, 12, 24, 80)
BANDWIDTH = {8: 12e9, 12: 16e9, 24: 20e9, 80: 50e9}

#: ComfyUI checkpoint families (GiB, fp16/bf16 unless named): the host's
#: own models per card class, with the activations a sampling step needs.
FAMILIES = {
    "sd15": {"unet": 1.60, "clip": 0.23, "vae": 0.16, "act": (0.4, 1.2)},
    "sdxl": {"unet": 4.78, "clip": 1.52, "vae": 0.16, "act": (0.8, 2.5)},
    "flux-fp8": {"unet": 11.08, "clip": 4.79, "vae": 0.16,
                 "act": (1.2, 3.5)},
    "flux-bf16": {"unet": 22.17, "clip": 9.35, "vae": 0.16,
                  "act": (2.0, 6.0)},
    "wan14b": {"unet": 26.6, "clip": 10.6, "vae": 0.24, "act": (4.0, 12.0)},
}
CARD_FAMILIES = {
    8: ("sd15", "sdxl"),
    12: ("sdxl", "sd15"),
    24: ("flux-fp8", "sdxl"),
    80: ("flux-bf16", "wan14b"),
}

#: Models custom-node packs run in comfy-env workers (GiB, modes seen).
PACK_MODELS = (
    ("sam2-large", 0.84, ("plain",), "vision"),
    ("florence2-large", 1.45, ("plain", "legacy"), "vision"),
    ("depth-anything-v2-l", 1.25, ("plain",), "vision"),
    ("birefnet", 0.83, ("plain",), "vision"),
    ("groundingdino-b", 0.87, ("plain",), "vision"),
    ("esrgan-x4", 0.06, ("plain",), "upscale"),
    ("whisper-large-v3", 2.88, ("plain",), "audio"),
    ("f5-tts", 1.26, ("plain", "legacy"), "audio"),
    ("instantid", 1.62, ("legacy",), "adapter"),
    ("controlnet-union-sdxl", 2.33, ("legacy",), "adapter"),
    ("hunyuan3d-dit", 4.93, ("legacy", "paged"), "3d"),
    ("hunyuan3d-paint", 5.10, ("legacy",), "3d"),
    ("trellis", 4.40, ("legacy", "paged"), "3d"),
    ("wan2.1-1.3b", 2.64, ("paged", "legacy"), "video"),
    ("ltx-video-2b", 3.74, ("paged", "legacy"), "video"),
    ("cogvideox-5b", 10.4, ("paged", "legacy"), "video"),
    ("qwen2.5-vl-3b", 7.0, ("legacy", "paged"), "llm"),
    ("qwen2.5-vl-7b", 15.4, ("legacy", "paged"), "llm"),
    ("llava-1.6-7b-q4", 4.5, ("plain",), "llm"),
)


def _b(gib: float) -> int:
    return int(gib * GiB) // MiB * MiB


def model_spec(rng: random.Random, name: str, size: int, mode: str,
               kind: str) -> dict:
    if mode == "plain":
        block = size
    elif mode == "paged":
        block = 32 * MiB
    else:
        block = max(16 * MiB, size // 48 // MiB * MiB)
    return {"name": name, "size": size, "mode": mode, "kind": kind,
            "block": block,
            "first_param_on_card": rng.random() < 0.5}


def _act(rng: random.Random, size: int) -> int:
    return _b(max(0.15, size / GiB * rng.uniform(0.08, 0.3)))


class _Timeline:
    def __init__(self) -> None:
        self.t = 0.0
        self.events: list[dict] = []

    def add(self, ev: dict, t: float | None = None) -> dict:
        ev["t"] = round(self.t if t is None else t, 6)
        self.events.append(ev)
        return ev

    def sorted(self) -> list[dict]:
        order = {id(e): i for i, e in enumerate(self.events)}
        return sorted(self.events, key=lambda e: (e["t"], order[id(e)]))


def random_workload(card_gib: int, seed: int, prompts: int = 4) -> dict:
    """A seeded workload on a `card_gib` card: ComfyUI's own models of a
    checkpoint family for that card, 2 to 6 workers with pack models that
    fit it, prompts of host and worker nodes, and what real workers do
    without a message (pack threads, web routes, idle gaps, a sampler
    held off the GIL, now and then a hang or a crash)."""
    rng = random.Random(f"{card_gib}:{seed}")
    card = card_gib * GiB
    family_name = rng.choice(CARD_FAMILIES[card_gib])
    family = FAMILIES[family_name]
    hosts = []
    for part in ("unet", "clip", "vae"):
        size = _b(family[part])
        hosts.append({"name": part, "size": size,
                      "granularity": max(16 * MiB, size // 64 // MiB * MiB)})
    fitting = [m for m in PACK_MODELS if m[1] <= 0.7 * card_gib]
    n_workers = rng.randint(2, 6)
    workers = []
    for w in range(n_workers):
        models = []
        for j in range(rng.choice((1, 1, 2, 2, 3))):
            name, gib, modes, kind = rng.choice(fitting)
            models.append(model_spec(rng, f"{name}.{j}", _b(gib),
                                     rng.choice(modes), kind))
        workers.append({"name": f"w{w}", "publishes": rng.random() < 0.85,
                        "models": models})
    tl = _Timeline()
    lo, hi = family["act"]
    for p in range(prompts):
        tl.add({"ev": "prompt", "id": f"p{p}"})
        tl.t += 0.01
        nodes = rng.randint(4, 8)
        for _ in range(nodes):
            if rng.random() < 0.4:
                _host_node(rng, tl, hosts, lo, hi)
            else:
                _worker_node(rng, tl, workers, card)
            tl.t += 0.05
        tl.t += rng.choice((0.5, 5.0, 30.0, 75.0, 150.0)) * rng.random()
    for spec in workers:
        if rng.random() < 0.2:
            for _ in range(rng.randint(1, 3)):
                a = rng.uniform(0, tl.t)
                tl.add({"ev": "lag", "worker": spec["name"],
                        "until": round(a + rng.uniform(0.3, 8.0), 6)}, a)
    if rng.random() < 0.05:
        a = rng.uniform(0, tl.t)
        tl.add({"ev": "hang", "worker": rng.choice(workers)["name"],
                "until": round(a + rng.uniform(5, 90), 6),
                "heartbeat": rng.random() < 0.5}, a)
    if rng.random() < 0.03:
        tl.add({"ev": "kill", "worker": rng.choice(workers)["name"]},
               rng.uniform(0, tl.t))
    tl.add({"ev": "end"})
    return {"name": f"random {card_gib} GiB #{seed}", "card": card,
            "family": family_name, "hosts": hosts, "workers": workers,
            "events": tl.sorted()}


def _host_node(rng, tl, hosts, lo, hi) -> None:
    kind = rng.random()
    if kind < 0.3:
        names, act, duration = ["clip"], _b(0.3), rng.uniform(0.2, 2)
    elif kind < 0.8:
        names = ["unet"]
        act = _b(rng.uniform(lo, hi))
        duration = rng.uniform(3, 30)
    else:
        names, act, duration = ["vae"], _b(rng.uniform(lo, hi)), \
            rng.uniform(0.3, 3)
    tl.add({"ev": "host", "models": names, "memory_required": act,
            "act": act, "duration": round(duration, 3)})
    tl.t += duration


def _worker_steps(rng, spec, card) -> tuple[list[dict], float]:
    models = spec["models"]
    first = rng.choice(models)
    steps: list[dict] = []
    total = 0.0
    chosen = [first]
    if len(models) > 1 and rng.random() < 0.4:
        chosen.append(rng.choice([m for m in models if m is not first]))
    for m in chosen:
        act = _act(rng, m["size"])
        duration = round(rng.uniform(0.3, 20.0 if m["mode"] == "paged"
                                     else 8.0), 3)
        if m["mode"] == "plain":
            steps.append({"to": m["name"], "device": "cuda"})
        else:
            steps.append({"load": [m["name"]], "memory_required": act})
        steps.append({"compute": duration, "act": act, "use": [m["name"]]})
        total += duration
        if m["mode"] == "plain" and rng.random() < 0.3:
            steps.append({"to": m["name"], "device": "cpu"})
        elif m["mode"] == "legacy" and rng.random() < 0.1:
            steps.append({"offload": m["name"]})
    return steps, total


def _worker_node(rng, tl, workers, card) -> None:
    spec = rng.choice(workers)
    steps, duration = _worker_steps(rng, spec, card)
    start = tl.t
    tl.add({"ev": "call", "worker": spec["name"], "steps": steps,
            "empty_cache": rng.random() < 0.3})
    if rng.random() < 0.12 and len(workers) > 1:
        other = rng.choice([w for w in workers if w is not spec])
        route_steps, _ = _worker_steps(rng, other, card)
        route_steps = [s if "compute" not in s else {**s, "compute": 0.2}
                       for s in route_steps]
        tl.add({"ev": "route", "worker": other["name"],
                "steps": route_steps},
               start + rng.uniform(0, max(duration, 0.1)))
    tl.t += duration + 0.02
    if rng.random() < 0.15:
        m = rng.choice(spec["models"])
        if m["mode"] == "plain":
            step = {"to": m["name"], "device": rng.choice(("cuda", "cpu"))}
        elif m["mode"] == "paged":
            step = {"page": m["name"],
                    "bytes": int(m["size"] * rng.uniform(0.2, 1.0))
                    // (32 * MiB) * 32 * MiB}
        else:
            step = {"offload": m["name"]}
        tl.add({"ev": "background", "worker": spec["name"],
                "steps": [{**step, "dt": round(rng.uniform(0.05, 8.0), 3)}]},
               tl.t)


# ---- hand-written scenarios -------------------------------------------------


def _world(card_gib: int, hosts: list[tuple[str, float]],
           workers: list[tuple[str, list[tuple], bool]]) -> dict:
    rng = random.Random(0)
    out_hosts = [{"name": n, "size": _b(g),
                  "granularity": max(16 * MiB, _b(g) // 64 // MiB * MiB)}
                 for n, g in hosts]
    out_workers = []
    for name, models, publishes in workers:
        specs = []
        for mname, gib, mode, first_on_card in models:
            spec = model_spec(rng, mname, _b(gib), mode, "other")
            spec["first_param_on_card"] = first_on_card
            specs.append(spec)
        out_workers.append({"name": name, "publishes": publishes,
                            "models": specs})
    return {"card": card_gib * GiB, "hosts": out_hosts,
            "workers": out_workers}


def _finish(world: dict, name: str, events: list[dict]) -> dict:
    t = 0.0
    out = []
    for ev in events:
        ev = dict(ev)
        if "t" not in ev:
            ev["t"] = t
        t = ev["t"] + 0.01
        out.append(ev)
    order = {id(e): i for i, e in enumerate(out)}
    out.sort(key=lambda e: (e["t"], order[id(e)]))
    return {**world, "name": name, "events": out}


def _call(worker, *steps, t=None, empty_cache=False):
    ev = {"ev": "call", "worker": worker, "steps": list(steps),
          "empty_cache": empty_cache}
    if t is not None:
        ev["t"] = t
    return ev


def _host(models, act_gib, duration, t=None):
    ev = {"ev": "host", "models": models, "memory_required": _b(act_gib),
          "act": _b(act_gib), "duration": duration}
    if t is not None:
        ev["t"] = t
    return ev


def _load(*names, act=0.5):
    return {"load": list(names), "memory_required": _b(act)}


def _compute(seconds, act=0.5, use=()):
    return {"compute": seconds, "act": _b(act), "use": list(use)}


def scenario_mid_call_budget() -> dict:
    """A 24 GiB card, ComfyUI's SDXL models and two workers.  A's video
    model is paged (comfy-aimdo); at the end of a later call its pager
    had trimmed it to 0.5 GiB, and that is what the census said.  In A's next
    call it faults back in to 5 GiB, then A loads its refiner: the
    refiner's request_vram_budget runs ComfyUI's free_memory inside A's
    call while A's own video model moved since its last census.
    comfy-env and receipts read 0.5 GiB: most offloaded, first in line,
    asked for more than 0.5 GiB so detached whole: 5 GiB off the card
    where the oracle took 2.75 GiB of ComfyUI's UNet.  The board,
    published just before the budget request, reads 5 GiB: boards decide
    as the oracle."""
    world = _world(24, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("video", 5.0, "paged", True),
               ("refiner", 4.4, "legacy", True)], True),
        ("B", [("llm", 7.0, "legacy", True)], True),
    ])
    return _finish(world, "mid-call budget, caller's models moved", [
        {"ev": "prompt", "id": "p0"},
        _host(["unet", "clip"], 1.0, 2.0),
        _call("B", _load("llm"), _compute(2.0, use=["llm"])),
        _call("A", _load("video"), _compute(3.0, use=["video"])),
        _call("A", _compute(0.5), {"page": "video", "bytes": _b(0.5)}),
        _call("A", _load("video"), _compute(4.0, 1.0, ["video"]),
              _load("refiner", act=1.0), _compute(2.0, 1.0, ["refiner"])),
        _host(["unet"], 2.0, 3.0),
        {"ev": "end"},
    ])


def scenario_route_during_long_call() -> dict:
    """Worker A's video model (paged) was unloaded by its pack at the end
    of A's last call (receipt 0).  While A's next long call pages it back
    in, a web route on worker R loads a model: its budget request runs
    ComfyUI's free_memory on the route's thread.  A cannot serve a
    command while the prompt thread holds its lock: a command waits until
    A's call ends (comfy-env gives up after 30 s), then evicts the pages
    A is computing with.  Receipts read 0 for the video and send nothing
    (ComfyUI drops the entry); the board reads its pages, so boards send
    A a command that waits for the rest of A's call.  A case the board
    loses, in seconds a route's caller waits; rule 5 defers at once."""
    world = _world(12, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("video", 5.5, "paged", True)], True),
        ("R", [("matte", 3.7, "legacy", True)], True),
    ])
    return _finish(world, "web route frees during a long call", [
        {"ev": "prompt", "id": "p0"},
        _host(["unet", "clip"], 1.0, 3.0),
        _call("A", _load("video"), _compute(3.0, 1.0, ["video"]),
              {"offload": "video"}),
        _call("A", _load("video"), _compute(20.0, 1.0, ["video"])),
        {"ev": "route", "worker": "R", "t": 22.0,
         "steps": [_load("matte", act=0.5), _compute(0.2, use=["matte"])]},
        _host(["unet"], 1.0, 2.0),
        {"ev": "end"},
    ])


def scenario_pack_thread() -> dict:
    """After its call returned, a pack's own thread moves its segmenter
    to the card (a prefetch): no reply, no census until the worker's
    next call.  Its receipt says 0; the next host load sorts it as fully
    offloaded, sends it nothing, drops its entry and evicts ComfyUI's own
    models instead."""
    world = _world(8, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("seg", 1.25, "plain", True)], True),
        ("B", [("llm", 2.64, "legacy", True)], True),
    ])
    return _finish(world, "pack thread moves weights after its call", [
        {"ev": "prompt", "id": "p0"},
        _call("A", {"to": "seg", "device": "cuda"}, _compute(0.5,
              use=["seg"]), {"to": "seg", "device": "cpu"}),
        {"ev": "background", "worker": "A", "t": 1.0,
         "steps": [{"to": "seg", "device": "cuda", "dt": 0.5}]},
        _host(["unet", "clip"], 1.0, 2.0, t=2.0),
        _call("B", _load("llm"), _compute(1.0, use=["llm"])),
        _host(["unet"], 1.5, 2.0),
        {"ev": "end"},
    ])


def scenario_idle_release() -> dict:
    """A worker idle for over a minute is released by comfy-env's idle
    sweep (full_release): its model leaves the card, but the reply's
    census waits for the worker's next node boundary, so its receipt
    stays high.  The next host load sorts it late and asks it for bytes
    it no longer has: a round trip, no byte regret.  The detach that
    follows answers "already on cpu" (moved: False): comfy-env writes 0;
    ours, under the rule that such a reply writes nothing, keeps the high
    receipt and lists the model again (the board, where there is one,
    reads 0)."""
    world = _world(8, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("dit", 4.93, "legacy", True)], True),
        ("B", [("depth", 1.25, "plain", True)], True),
    ])
    return _finish(world, "idle release", [
        {"ev": "prompt", "id": "p0"},
        _call("A", _load("dit"), _compute(3.0, use=["dit"])),
        _call("B", {"to": "depth", "device": "cuda"},
              _compute(0.5, use=["depth"])),
        {"ev": "prompt", "id": "p1", "t": 90.0},
        _host(["unet"], 1.0, 3.0),
        _host(["unet", "clip"], 1.0, 3.0),
        {"ev": "end"},
    ])


def scenario_allocator_cache() -> dict:
    """Worker A's pack unloads its upscaler itself, then computes 3 GiB of
    activations with no model, which its allocator keeps cached
    (reserved, not allocated) after the call.  No stand-in describes a
    cache, and A's reads 0: ComfyUI's next load evicts its own models,
    and comfy-env's pressure hook, which fires from a stand-in with bytes
    to give, stays silent.  Rule 4's reclaim asks idle A for what is still
    missing after the pass: its cache comes back."""
    world = _world(8, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("upscale", 0.5, "legacy", True)], True),
    ])
    return _finish(world, "allocator cache", [
        {"ev": "prompt", "id": "p0"},
        _call("A", _load("upscale"), _compute(0.5, 0.2, ["upscale"]),
              {"offload": "upscale"}, _compute(2.0, 3.0)),
        _host(["unet", "clip"], 1.5, 3.0),
        {"ev": "end"},
    ])


def scenario_hung_heartbeat() -> dict:
    """Worker A paged its model in with a pack thread after its last call
    (its receipt says 0), then its main thread hangs while the board's
    sampler keeps beating.  The host's next load: receipts send A nothing;
    boards read 4 GiB, send A a command that waits 60 s for a reply, and
    comfy-env then kills A (its bytes do come back).  The board loses a
    minute."""
    world = _world(8, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("video", 2.64, "paged", True)], True),
    ])
    return _finish(world, "hung worker, fresh heartbeat", [
        {"ev": "prompt", "id": "p0"},
        _call("A", _load("video"), _compute(2.0, use=["video"]),
              {"offload": "video"}),
        {"ev": "background", "worker": "A", "t": 2.5,
         "steps": [{"page": "video", "bytes": _b(2.5), "dt": 0.2}]},
        {"ev": "hang", "worker": "A", "t": 3.0, "until": 200.0,
         "heartbeat": True},
        _host(["unet", "clip"], 1.5, 2.0, t=5.0),
        {"ev": "end"},
    ])


def scenario_sampler_lag() -> dict:
    """As "pack thread", but the worker's sampler is held off the GIL for
    8 s from just before the move: the board's last pass predates the
    move and its heartbeat goes stale after 5 s, so the board falls back
    to the receipt.  Boards tie with receipts."""
    world = _world(8, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("seg", 1.25, "plain", True)], True),
        ("B", [("llm", 2.64, "legacy", True)], True),
    ])
    return _finish(world, "sampler lags", [
        {"ev": "prompt", "id": "p0"},
        _call("A", {"to": "seg", "device": "cuda"},
              _compute(0.5, use=["seg"]), {"to": "seg", "device": "cpu"}),
        {"ev": "lag", "worker": "A", "t": 0.9, "until": 12.0},
        {"ev": "background", "worker": "A", "t": 1.0,
         "steps": [{"to": "seg", "device": "cuda", "dt": 0.5}]},
        _host(["unet", "clip"], 1.0, 2.0, t=7.0),
        _call("B", _load("llm"), _compute(1.0, use=["llm"])),
        _host(["unet"], 1.5, 2.0),
        {"ev": "end"},
    ])


def scenario_no_publisher() -> dict:
    """As "pack thread", with a worker that publishes nothing (its board
    could not be handed over, or an older comfy-env): boards read the
    receipt and tie with it."""
    out = scenario_pack_thread()
    out["workers"][0]["publishes"] = False
    out["name"] = "worker publishes nothing"
    return out


def scenario_registration() -> dict:
    """A worker's LLM loads partially (lowvram: its own load_models_gpu
    keeps 5 GiB free for activations) and registers at the end of the
    call that loaded it: the census that carried its true bytes arrived
    before its stand-in existed, so comfy-env writes the full size.  At
    the next host load it sorts as not offloaded at all (a tie with B's
    segmenter, broken by size), where it is the most offloaded model on
    the card: receipts evict the segmenter too.  receipts+ applies that
    census to the new stand-in; the board binds at the same boundary and
    its binding publishes at once: both decide as the oracle."""
    world = _world(12, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("llm", 10.0, "legacy", True)], True),
        ("B", [("seg", 1.25, "plain", True)], True),
    ])
    return _finish(world, "registration: census before the stand-in", [
        {"ev": "prompt", "id": "p0"},
        _host(["unet", "clip"], 1.0, 2.0),
        _call("A", _load("llm", act=5.0), _compute(2.0, 1.0, ["llm"])),
        _call("B", {"to": "seg", "device": "cuda"},
              _compute(0.2, use=["seg"])),
        _host(["unet"], 2.0, 2.0),
        {"ev": "end"},
    ])


def scenario_moved_false() -> dict:
    """Worker A's LLM is fully loaded, then ComfyUI takes part of it back
    (a partial unload) and its first parameter is among what went to the
    CPU.  The next pass asks it to detach: the worker compares the first
    parameter only, answers "already on cpu" (moved: False) and frees
    nothing.  comfy-env writes 0 and ComfyUI drops the entry for good:
    the LLM's remaining bytes are on the card with no entry, and the
    last load's activations do not fit.  Ours keep the receipt, list the
    LLM again at the next node boundary (B's call), and the last load
    takes its bytes."""
    world = _world(12, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("llm", 7.0, "legacy", False)], True),
        ("B", [("seg", 1.25, "plain", True)], True),
    ])
    return _finish(world, "detach that moved nothing", [
        {"ev": "prompt", "id": "p0"},
        _call("A", _load("llm", act=0.5), _compute(2.0, 0.5, ["llm"])),
        _host(["clip"], 2.5, 1.0),
        _host(["unet"], 2.0, 2.0),
        _call("B", {"to": "seg", "device": "cuda"},
              _compute(0.2, use=["seg"])),
        _host(["unet", "clip"], 3.0, 2.0),
        _call("B", _compute(0.2, use=["seg"])),
        _host(["unet", "clip", "vae"], 4.0, 2.0),
        {"ev": "end"},
    ])


def scenario_route_census() -> dict:
    """A web route on worker A moves its tagger to the card: its reply's
    census only raises comfy-env's admission peak, so the receipt says 0
    until A's next node call; the next host load drops the entry and
    evicts ComfyUI's own models.  The board saw the move."""
    world = _world(8, [("unet", 4.78), ("clip", 1.52), ("vae", 0.16)], [
        ("A", [("tagger", 1.45, "plain", True)], True),
    ])
    return _finish(world, "web route's census (peak only)", [
        {"ev": "prompt", "id": "p0"},
        _call("A", {"to": "tagger", "device": "cuda"},
              _compute(0.3, use=["tagger"]),
              {"to": "tagger", "device": "cpu"}),
        {"ev": "route", "worker": "A", "t": 1.0,
         "steps": [{"to": "tagger", "device": "cuda"},
                   _compute(0.2, use=["tagger"])]},
        _host(["unet", "clip"], 1.0, 2.0, t=2.0),
        {"ev": "end"},
    ])


SCENARIOS = {
    "mid-call budget": scenario_mid_call_budget,
    "route during a long call": scenario_route_during_long_call,
    "pack thread": scenario_pack_thread,
    "idle release": scenario_idle_release,
    "allocator cache": scenario_allocator_cache,
    "hung, fresh heartbeat": scenario_hung_heartbeat,
    "sampler lags": scenario_sampler_lag,
    "publishes nothing": scenario_no_publisher,
    "registration": scenario_registration,
    "moved: False": scenario_moved_false,
    "route census": scenario_route_census,
}


# ---- traces -----------------------------------------------------------------


def load_trace(path: Path) -> dict:
    """A recorded trace (bench/record_trace.py): JSON lines, the first a
    header with the workload's world, then one event a line; lines whose
    ``ev`` starts with ``obs:`` are what the real run observed (kept for
    the comparison, not played)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()
             if line.strip()]
    if not lines or lines[0].get("format") != "comfy-standin-trace/1":
        raise ValueError(f"{path}: not a comfy-standin-trace/1 file")
    header = lines[0]
    events = [e for e in lines[1:] if not e["ev"].startswith("obs:")]
    observed = [e for e in lines[1:] if e["ev"].startswith("obs:")]
    return {"name": header["name"], "card": header["card"],
            "hosts": header["hosts"], "workers": header["workers"],
            "events": events, "observed": observed,
            "source": header.get("source", "")}


def traces() -> list[Path]:
    return sorted(TRACES.glob("*.jsonl"))
