"""What ComfyUI's eviction reaches and what users feel: eviction regret,
out-of-memory events, reloads, waits on busy workers, unlisted bytes.

ComfyUI's ``free_memory`` sorts its candidates by ``-model_offloaded_memory()``
(size minus ``loaded_size()``) and evicts from the front.  For a model a
comfy-env worker holds, ``loaded_size()`` is whatever the host's stand-in
believes, and only a listed stand-in is a candidate at all.  This bench
measures, on comfy-env 0.4.46's own host code and a model of its workers
(bench/regret_sim.py says what is real and what is modelled, function by
function), what each of the package's rules changes for a user.

Columns (bench/regret_sim.py ``COLUMN_RULES``; who answers
``loaded_size()`` and which rules the host follows):

- ``comfy-env``: comfy-env 0.4.46's own ``SubprocessModelPatcher`` and
  ``state_sync`` (receipts: command echoes, the census at the end of every
  node call, registration);
- ``receipts``: comfy_standin's stand-in as shipped, no board;
- ``boards``: the shipped stand-in with the worker's live board, modelled
  as bench/bench_board_view.py measured it (each sampler pass waits for
  the GIL while a call runs, reaches the host after the measured read
  lag, and the next starts a period after it ended, so passes fall behind;
  changes between passes are missed; a sampler held off the GIL past the
  heartbeat limit reads as stale), published synchronously at the
  worker's budget request, after its real load, at every ``_bump_seq`` and
  at each binding;
- ``relist``, ``census``, ``publish``, ``unlisted``, ``no-wait``: ``boards``
  plus one rule of issue 25 each (listed again at every boundary and
  before a worker's budget request; a frame's census applied to the
  stand-ins it creates; a publish before every model command's reply;
  unlisted bytes reclaimed from idle workers after a free_memory left the
  card short; an eviction command to a worker in a call on another thread
  deferred at once);
- ``all``: every rule;
- ``oracle``: stand-ins that read the truth (the harness's check).

Per free_memory pass that has to evict, the **oracle** is free_memory's own
rule on the same candidates (same tie-breaks), fed the true resident bytes,
with each command's effect as the worker would have it and the same
changes happening meanwhile.  A pass **regrets** when it took bytes off the
card beyond what the oracle took (``excess``), left unfreed bytes the
oracle freed (``short``), or evicted a model the oracle left (``wrong``).
Costs users feel are per workload, each column's own trajectory:
out-of-memory events (a load or activations that did not fit), bytes that
came back over the bus (reload seconds at the card class's stated
bandwidth, bench/regret_workloads.py ``BANDWIDTH``), seconds ComfyUI's
threads waited on a busy worker's lock (until its call ends, at most
comfy-env's 30 s per command), seconds waited on a hung worker (60 s,
then comfy-env kills it), and the bytes on the card no entry reaches at
the start of a pass that needed room (**unlisted**; the goal counts
workers that publish a board).

Workloads: hand-written scenarios (each row says what happens),
``--workloads`` seeded random workloads per card class (8, 12, 24, 80 GiB),
and the recorded traces in bench/traces/ (bench/record_trace.py).  95%
confidence intervals are percentile bootstraps over workloads (passes of
one workload are not independent); paired differences are per workload.

    python bench/bench_regret.py            # print the tables
    python bench/bench_regret.py --write    # and RESULTS.md + the PNGs
    python bench/bench_regret.py --smoke    # tiny, seconds, no plot

The second part times one whole free_memory pass over N registered
stand-ins (N = 1, 16, 256, 4096) that need no eviction.

The plots need matplotlib (``pip install matplotlib``); without it the bench
says so and writes the tables only.
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import benchutil  # noqa: E402
import regret_sim as sim  # noqa: E402
import regret_workloads as workloads  # noqa: E402
from regret_sim import GiB, mm  # noqa: E402

import comfy_standin  # noqa: E402
import comfy_standin._reference as reference  # noqa: E402

REGRET_PNG = HERE / "regret.png"
PASS_PNG = HERE / "free_memory_pass.png"
HEADING = "## eviction regret"

COLUMNS = sim.COLUMNS
WORKLOADS = 200
SMOKE_WORKLOADS = 3
PASS_SIZES = (1, 16, 256, 4096)
SMOKE_PASS_SIZES = (1, 16)
BOOTSTRAP = 2000
TOTAL = 16 * GiB


# ---- running ----------------------------------------------------------------


def run_columns(workload: dict, ce: sim.ComfyEnv,
                columns: tuple[str, ...] = COLUMNS) -> dict[str, Any]:
    return {c: sim.run_workload(workload, c, ce) for c in columns}


def measure_scenarios(ce: sim.ComfyEnv, names: list[str] | None = None,
                      progress: Callable | None = None) -> list[tuple]:
    """[(name, description, workload, {column: RunResult})]"""
    out = []
    for name, make in workloads.SCENARIOS.items():
        if names is not None and name not in names:
            continue
        if progress:
            progress(f"scenario: {name}")
        doc = " ".join((make.__doc__ or "").split())
        wl = make()
        out.append((name, doc, wl, run_columns(wl, ce)))
    return out


def workload_summary(result: Any, bandwidth: float) -> dict[str, float]:
    """One column's figures for one workload."""
    passes = result.passes
    costs = result.costs
    causes: collections.Counter = collections.Counter()
    for p in passes:
        if not p.regrets:
            continue
        for c in p.candidates:
            if c.seen != c.truth:
                side = "low" if c.seen < c.truth else "high"
                causes[f"{side}: {c.why}"] += 1
    return {
        "passes": len(passes),
        "regrets": sum(p.regrets for p in passes),
        "regret": sum(p.regret for p in passes),
        "excess": sum(p.excess for p in passes),
        "short": sum(p.short for p in passes),
        "wrong": sum(len(p.wrong) for p in passes),
        "unlisted": sum(p.unlisted for p in passes),
        "unlisted_board": sum(p.unlisted_board for p in passes),
        "unlisted_why": sum((p.unlisted_why for p in passes),
                            collections.Counter()),
        "reload_bytes": costs.reload_bytes,
        "reload_s": costs.reload_bytes / bandwidth,
        "ooms": len(costs.ooms),
        "oom_kinds": collections.Counter(oom_kind(o) for o in costs.ooms),
        "stall_busy": costs.stall_busy,
        "stall_hung": costs.stall_hung,
        "stall_prompt": costs.stall_prompt,
        "stall_other": costs.stall_other,
        "causes": causes,
    }


def oom_kind(oom: str) -> str:
    """What did not fit (Run.oom's text: "T s WHO: WHAT")."""
    who, _, what = oom.partition(" ")[2].partition(": ")
    if who == "host":
        return "ComfyUI's activations"
    if what.startswith("activations"):
        return "a worker's activations"
    return "a pack's own .to(cuda) (no budget request)"


def measure_random(ce: sim.ComfyEnv, cards: tuple[int, ...], n: int,
                   progress: Callable | None = None
                   ) -> dict[int, list[dict[str, dict]]]:
    """{card: [{column: workload_summary} for each seed]}"""
    out: dict[int, list[dict[str, dict]]] = {}
    for card in cards:
        rows = []
        bandwidth = workloads.BANDWIDTH[card]
        for seed in range(n):
            if progress and seed % 50 == 0:
                progress(f"random workloads: {card} GiB, {seed}/{n}")
            wl = workloads.random_workload(card, seed)
            results = run_columns(wl, ce)
            rows.append({c: workload_summary(r, bandwidth)
                         for c, r in results.items()})
        out[card] = rows
    return out


def measure_traces(ce: sim.ComfyEnv, progress: Callable | None = None
                   ) -> list[tuple]:
    """[(path, workload, {column: RunResult}, replay check)]"""
    out = []
    for path in workloads.traces():
        if progress:
            progress(f"trace: {path.name}")
        wl = workloads.load_trace(path)
        results = run_columns(wl, ce)
        out.append((path, wl, results,
                    replay_check(wl, results["comfy-env"])))
    return out


def replay_check(wl: dict, result: Any) -> dict[str, Any]:
    """Compare the comfy-env column's replay with what the real run
    observed: the same free_memory passes in the same order, each starting
    from the same free bytes and taking the same bytes of the same
    models."""
    observed = [e for e in wl.get("observed", [])
                if e["ev"] == "obs:pass"]
    real = [(e["free_before"],
             {k: n for k, n in sorted(e["took_bytes"].items())
              if not k.endswith("/ctx")})
            for e in observed]
    replayed = [(p.free_before,
                 {k: n for k, n in sorted(p.evicted.items()) if n > 0})
                for p in result.passes]
    return {"observed": len(real), "replayed": len(replayed),
            "match": real == replayed,
            "real": [sorted(took) for _, took in real],
            "sim": [sorted(took) for _, took in replayed]}


# ---- statistics -------------------------------------------------------------


def bootstrap(values: list[float], weights: list[float] | None = None,
              reps: int = BOOTSTRAP, seed: int = 1) -> tuple[float, float,
                                                             float]:
    """(estimate, low, high): the mean of `values` (or the ratio
    sum(values) / sum(weights)), with a 95% percentile bootstrap over the
    workloads."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan

    def stat(idx: list[int]) -> float:
        top = sum(values[i] for i in idx)
        if weights is None:
            return top / len(idx)
        bottom = sum(weights[i] for i in idx)
        return top / bottom if bottom else 0.0

    every = list(range(n))
    estimate = stat(every)
    rng = random.Random(seed)
    stats = sorted(stat(rng.choices(every, k=n)) for _ in range(reps))
    return estimate, stats[int(0.025 * reps)], stats[int(0.975 * reps) - 1]


def summarize(rows: list[dict[str, dict]]) -> dict[str, dict[str, Any]]:
    out = {}
    for column in COLUMNS:
        per = [r[column] for r in rows]
        passes = [w["passes"] for w in per]
        out[column] = {
            "workloads": len(per),
            "passes": sum(passes),
            "regrets": sum(w["regrets"] for w in per),
            "regret_per_pass": bootstrap([w["regret"] / GiB for w in per],
                                         passes),
            "short": sum(w["short"] for w in per),
            "wrong": sum(w["wrong"] for w in per),
            "excess": sum(w["excess"] for w in per),
            "unlisted": bootstrap([w["unlisted"] / GiB for w in per],
                                  passes),
            "unlisted_board": bootstrap(
                [w["unlisted_board"] / GiB for w in per], passes),
            "reload_s": bootstrap([w["reload_s"] for w in per]),
            "reload_gib": statistics.fmean(
                [w["reload_bytes"] / GiB for w in per]),
            "ooms": bootstrap([w["ooms"] for w in per]),
            "stall_busy": bootstrap([w["stall_busy"] for w in per]),
            "stall_hung": statistics.fmean([w["stall_hung"] for w in per]),
            "causes": sum((w["causes"] for w in per),
                          collections.Counter()),
            "unlisted_why": sum((w["unlisted_why"] for w in per),
                                collections.Counter()),
            "oom_kinds": sum((w["oom_kinds"] for w in per),
                             collections.Counter()),
        }
    return out


#: The columns each is compared with, per workload: comfy-env's own, and
#: (for each rule) the shipped stand-in with its board.
BASE = "comfy-env"
SHIPPED = "boards"
RULE_COLUMNS = ("relist", "census", "publish", "unlisted", "no-wait", "all")
PAIRS = tuple([(c, BASE) for c in COLUMNS if c not in (BASE, "oracle")]
              + [(c, SHIPPED) for c in RULE_COLUMNS])
PAIRED_KEYS = (("ooms", 1.0), ("reload_s", 1.0), ("stall_busy", 1.0),
               ("unlisted_board", 1 / GiB), ("regret", 1 / GiB))


def paired(rows: list[dict[str, dict]], a: str, b: str
           ) -> dict[str, Any]:
    """Per workload, column a minus column b (unlisted and regret: per
    pass that needed room, over the workloads with such passes in both)."""
    out = {}
    for key, scale in PAIRED_KEYS:
        diffs = []
        for r in rows:
            va, vb = r[a][key], r[b][key]
            if key in ("unlisted_board", "regret"):
                if not r[a]["passes"] or not r[b]["passes"]:
                    continue
                va, vb = va / r[a]["passes"], vb / r[b]["passes"]
            diffs.append((va - vb) * scale)
        est = bootstrap(diffs)
        out[key] = {
            "ci": est,
            "better": sum(d < 0 for d in diffs),
            "worse": sum(d > 0 for d in diffs),
        }
    return out


#: Issue 25's goals for column ``all`` against comfy-env's, per card class
#: (GiB): OOMs fewer by at least this much per workload, the interval
#: excluding 0 (None: fewer, not worse).
OOM_GOAL = {8: 0.4, 12: 0.0, 24: 0.0, 80: None}
STALL_GOAL = 0.0
UNLISTED_GOAL = 0.1
RELOAD_GOAL = 0.3


def goals(random_rows: dict[int, list], column: str = "all"
          ) -> list[dict[str, Any]]:
    """Each goal, per card class: the figure, its interval and met or
    missed (by how much)."""
    out = []
    for card, rows in random_rows.items():
        d = paired(rows, column, BASE)
        s = summarize(rows)[column]
        ooms = d["ooms"]["ci"]
        need = OOM_GOAL.get(card)
        if need is None:
            met = ooms[0] <= 0
            want = "not worse"
        elif need > 0:
            met = ooms[0] <= -need and ooms[2] < 0
            want = f"<= -{need} (interval below 0)"
        else:
            met = ooms[0] < 0
            want = "fewer"
        out.append({"card": card, "goal": "OOMs per workload, all - "
                    "comfy-env", "want": want, "ci": ooms, "met": met,
                    "by": ooms[0] + (need or 0)})
        stall = s["stall_busy"]
        out.append({"card": card, "goal": "stalled s on busy workers per "
                    "workload", "want": "0", "ci": stall,
                    "met": stall[0] <= STALL_GOAL, "by": stall[0]})
        unl = s["unlisted_board"]
        out.append({"card": card, "goal": "unlisted GiB per pass that "
                    "needed room (workers with a board)",
                    "want": f"<= {UNLISTED_GOAL}", "ci": unl,
                    "met": unl[0] <= UNLISTED_GOAL,
                    "by": unl[0] - UNLISTED_GOAL})
        rel = d["reload_s"]["ci"]
        out.append({"card": card, "goal": "reload s per workload, all - "
                    "comfy-env", "want": f"<= +{RELOAD_GOAL}", "ci": rel,
                    "met": rel[0] <= RELOAD_GOAL,
                    "by": rel[0] - RELOAD_GOAL})
    return out


def goals_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| card | goal | wanted | measured [95% CI] | |",
             "|---:|---|---|---|---|"]
    for g in rows:
        verdict = "met" if g["met"] else f"missed by {abs(g['by']):.3f}"
        lines.append(f"| {g['card']} GiB | {g['goal']} | {g['want']} | "
                     f"{ci(g['ci'], '{:.3f}')} | {verdict} |")
    return "\n".join(lines)


# ---- report -----------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def ci(t: tuple[float, float, float], fmt: str = "{:.3f}") -> str:
    est, lo, hi = t
    return f"{fmt.format(est)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def run_row(result: Any, bandwidth: float) -> str:
    w = workload_summary(result, bandwidth)
    n = max(1, w["passes"])
    return (f"{w['passes']} | {w['regrets']} | {w['regret'] / GiB:.2f} | "
            f"{w['unlisted'] / GiB / n:.2f} | {w['reload_s']:.2f} | "
            f"{w['ooms']} | {w['stall_busy']:.1f} | {w['stall_hung']:.0f}")


RUN_HEAD = ("| workload | column | passes | regretting passes | regret GiB | "
            "unlisted GiB/pass | reload s | OOMs | stalled on busy s | "
            "stalled on hung s |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def bandwidth_of(wl: dict) -> float:
    return workloads.BANDWIDTH.get(int(wl["card"]) // GiB, 20e9)


def scenario_table(scenarios: list[tuple]) -> str:
    lines = [RUN_HEAD]
    for name, _, wl, results in scenarios:
        bandwidth = bandwidth_of(wl)
        for column in COLUMNS:
            lines.append(f"| {name} | {column} | "
                         + run_row(results[column], bandwidth) + " |")
    return "\n".join(lines)


def random_table(card: int, summary: dict[str, dict]) -> str:
    lines = [
        "| column | OOMs per workload | reload s per workload | stalled s "
        "on busy workers per workload | unlisted GiB per pass (workers "
        "with a board) | unlisted GiB per pass (all) | stalled s on hung "
        "workers | passes | regretting passes | regret GiB per pass |",
        "|---|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for column in COLUMNS:
        s = summary[column]
        share = 100 * s["regrets"] / max(1, s["passes"])
        lines.append(
            f"| {column} | {ci(s['ooms'], '{:.2f}')} | "
            f"{ci(s['reload_s'], '{:.2f}')} | "
            f"{ci(s['stall_busy'], '{:.1f}')} | "
            f"{ci(s['unlisted_board'], '{:.2f}')} | "
            f"{ci(s['unlisted'], '{:.2f}')} | {s['stall_hung']:.1f} | "
            f"{s['passes']:,} | {s['regrets']} ({share:.1f} %) | "
            f"{ci(s['regret_per_pass'])} |")
    return "\n".join(lines)


def paired_table(random_rows: dict[int, list]) -> str:
    lines = [
        "| card | a - b | OOMs [95% CI] (a better / worse) | reload s "
        "| stalled s on busy workers | unlisted GiB per pass (board) | "
        "regret GiB per pass |",
        "|---:|---|---|---|---|---|---|",
    ]
    for card, rows in random_rows.items():
        for a, b in PAIRS:
            d = paired(rows, a, b)
            cells = []
            for key, _ in PAIRED_KEYS:
                fmt = "{:.2f}" if key != "regret" else "{:.3f}"
                cells.append(f"{ci(d[key]['ci'], fmt)} "
                             f"({d[key]['better']} / {d[key]['worse']})")
            lines.append(f"| {card} GiB | {a} - {b} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def causes_text(summaries: dict[int, dict]) -> str:
    """Why the figures were wrong in the passes that regretted."""
    lines = []
    for column in COLUMNS:
        if column == "oracle":
            continue
        total: collections.Counter = collections.Counter()
        for summary in summaries.values():
            total += summary[column]["causes"]
        if not total:
            lines.append(f"- {column}: none")
            continue
        top = ", ".join(f"{why} {n}" for why, n in total.most_common(6))
        lines.append(f"- {column} ({sum(total.values())}): {top}")
    return "\n".join(lines)


def oom_text(summaries: dict[int, dict],
             columns: tuple[str, ...] = (BASE, SHIPPED, "all")) -> str:
    """What did not fit, per workload."""
    lines = []
    for card, summary in summaries.items():
        for column in columns:
            s = summary[column]
            n = max(1, s["workloads"])
            kinds = ", ".join(f"{kind} {count / n:.2f}" for kind, count in
                              sorted(s["oom_kinds"].items()))
            lines.append(f"- {card} GiB, {column}: {kinds or 'none'}")
    return "\n".join(lines)


def unlisted_text(summaries: dict[int, dict],
                  columns: tuple[str, ...] = (BASE, SHIPPED, "all")) -> str:
    """Why the bytes no entry reached were out of reach (workers with a
    board), GiB per pass that needed room."""
    lines = []
    for card, summary in summaries.items():
        for column in columns:
            s = summary[column]
            n = max(1, s["passes"])
            top = ", ".join(f"{why} {b / GiB / n:.2f}"
                            for why, b in s["unlisted_why"].most_common(5))
            lines.append(f"- {card} GiB, {column}: {top or 'none'}")
    return "\n".join(lines)


def trace_text(traces: list[tuple]) -> str:
    if not traces:
        return "No trace in bench/traces/ (bench/record_trace.py makes one)."
    lines = [RUN_HEAD]
    checks = []
    for path, wl, results, check in traces:
        bandwidth = bandwidth_of(wl)
        for column in COLUMNS:
            lines.append(f"| {path.name} | {column} | "
                         + run_row(results[column], bandwidth) + " |")
        verdict = ("the same" if check["match"] else
                   f"DIFFERENT (real {check['real']}, replay {check['sim']})")
        checks.append(
            f"- {path.name} ({wl.get('source', '')}): the real run had "
            f"{check['observed']} free_memory passes that evicted; the "
            f"comfy-env column's replay had {check['replayed']}; the "
            f"models each took bytes of: {verdict}.")
    return "\n".join(lines) + "\n\n" + "\n".join(checks)


def machine() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, "
            f"{platform.python_implementation()} "
            f"{platform.python_version()}, load average {load}")


# ---- a whole free_memory pass with N stand-ins ----------------------------


class InertWorker:
    """A worker that is never asked anything (no eviction in the pass)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._mem_lock = threading.Lock()
        self._calls_in_flight = 0

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        return {}

    def is_alive(self) -> bool:
        return True


def _pass_impls(ce: sim.ComfyEnv) -> list[tuple[str, Callable[[int], list]]]:
    size = 2 * GiB
    patcher_type = ce.model_patcher.SubprocessModelPatcher
    state_sync = ce.state_sync

    def ours(module):
        def make(n: int) -> list:
            pool = module.Pool(floor=0, process_local=False)
            out = []
            for i in range(n):
                if i % 8 == 0:
                    worker = InertWorker(f"w{i // 8}")
                s = module.StandIn(
                    worker=worker, worker_generation=1, model_id=f"m{i}",
                    model_size=size, load_device=mm.CUDA0,
                    offload_device=mm.CPU, kind="unet", pool=pool,
                )
                module.apply_echo(s, resident=size // 2, seq=1)
                out.append(s)
            return [pool, *out]

        return make

    def host(n: int) -> list:
        out = []
        for i in range(n):
            h = mm.HostModel(f"h{i}", size)
            h.model._loaded = size // 2  # no card bytes: nothing evicted
            out.append(h)
        return out

    impls = [("c", ours(comfy_standin)), ("reference", ours(reference))]

    def theirs(n: int) -> list:
        out = []
        for i in range(n):
            if i % 8 == 0:
                worker = InertWorker(f"w{i // 8}")
            s = patcher_type(
                worker, 1, f"m{i}", size, mm.CUDA0, mm.CPU, kind="unet"
            )
            state_sync.apply_echo(s, size // 2, seq=1)
            out.append(s)
        return out

    impls.append(("comfy-env", theirs))
    impls.append(("mock HostModel", host))
    return impls


def _entries(objects: list) -> list:
    entries = []
    for obj in objects:
        if not hasattr(obj, "model_size"):
            continue  # the pool
        entry = mm.LoadedModel(obj)
        entry.currently_used = False
        entry.real_model = weakref.ref(obj.model)  # is_dead() reads it
        entries.append(entry)
    return entries


def measure_pass(ce: sim.ComfyEnv, sizes=PASS_SIZES, rounds: int = 9,
                 min_batch=0.05, progress=None):
    """{impl: {n: [seconds per pass, one per round]}}: free_memory(0) over
    n entries, the implementations taking turns each round."""
    impls = _pass_impls(ce)
    out: dict[str, dict[int, list[float]]] = {name: {} for name, _ in impls}
    mm.reset(total=TOTAL)
    try:
        for n in sizes:
            if progress:
                progress(f"free_memory pass: n = {n}")
            keep = {name: make(n) for name, make in impls}
            entries = {name: _entries(keep[name]) for name, _ in impls}
            loops = {}
            for name, _ in impls:
                mm.current_loaded_models[:] = entries[name]
                k = 1
                while True:
                    t = _time_passes(k)
                    if t >= min_batch or k >= 1 << 16:
                        break
                    k *= 2
                loops[name] = k
            times: dict[str, list[float]] = {name: [] for name in out}
            for _ in range(rounds):
                for name, _ in impls:
                    mm.current_loaded_models[:] = entries[name]
                    times[name].append(
                        _time_passes(loops[name]) / loops[name])
            for name in out:
                out[name][n] = times[name]
            del mm.current_loaded_models[:]
            del keep, entries
            gc.collect()
    finally:
        mm.reset()
    return out


def _time_passes(k: int) -> float:
    free_memory = mm.free_memory
    dev = mm.CUDA0
    clock = time.perf_counter
    enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection is not the pass's cost
    try:
        t0 = clock()
        for _ in range(k):
            free_memory(0, dev)
        t = clock() - t0
    finally:
        if enabled:
            gc.enable()
    del mm.free_memory_log[:]
    return t




def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values))
                                            - 1))]


def best_of(timings: dict[str, dict[int, list[float]]]
            ) -> dict[str, dict[int, float]]:
    return {name: {n: min(ts) for n, ts in points.items()}
            for name, points in timings.items()}


def pass_table(timings: dict[str, dict[int, list[float]]]) -> str:
    names = list(timings)
    sizes = sorted(next(iter(timings.values())))
    head = "| N | " + " | ".join(
        f"{n}: us/pass best (median, p90)" for n in names)
    if "c" in names:
        head += " | " + " | ".join(f"{n}/c" for n in names if n != "c")
    head += " |"
    rule = "|---:|" + "---:|" * len(names)
    if "c" in names:
        rule += "---:|" * (len(names) - 1)
    lines = [head, rule]
    for n in sizes:
        cells = []
        for name in names:
            ts = timings[name][n]
            med = statistics.median(ts)
            cells.append(f"{min(ts) * 1e6:,.1f} ({med * 1e6:,.1f}, "
                         f"{pct(ts, 0.9) * 1e6:,.1f})")
        if "c" in names:
            c = min(timings["c"][n])
            cells += [f"{min(timings[name][n]) / c:.2f}"
                      for name in names if name != "c"]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slope(points: dict[int, float]) -> float:
    """Least-squares exponent b of t = a * N**b (1: linear)."""
    xs = [math.log(n) for n in points]
    ys = [math.log(t) for t in points.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


# ---- plots and RESULTS.md ---------------------------------------------------


def plot(summaries: dict[int, dict], timings) -> str | None:
    """Write the two PNGs; None, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return (f"matplotlib is missing ({type(exc).__name__}: {exc}); "
                f"pip install matplotlib to get the plots")
    best = best_of(timings)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=80)
    for name, points in best.items():
        ns = sorted(points)
        ax.plot(ns, [points[n] / n * 1e9 for n in ns], marker="o",
                label=f"{name} (exponent {slope(points):.2f})")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("N registered models")
    ax.set_ylabel("ns per candidate, best round (flat: linear)")
    ax.set_title("One free_memory pass (no eviction), mock ComfyUI")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PASS_PNG)
    plt.close(fig)

    cards = list(summaries)
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.6), dpi=80)
    width = 0.8 / len(COLUMNS)
    panels = (("ooms", "OOMs per workload"),
              ("reload_s", "reload s per workload"),
              ("stall_busy", "stalled s on busy workers per workload"),
              ("unlisted_board", "unlisted GiB per pass (board)"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for j, column in enumerate(COLUMNS):
            xs = [i + (j - (len(COLUMNS) - 1) / 2) * width
                  for i in range(len(cards))]
            est = [summaries[c][column][key][0] for c in cards]
            lo = [e - summaries[c][column][key][1] for c, e in
                  zip(cards, est, strict=True)]
            hi = [summaries[c][column][key][2] - e for c, e in
                  zip(cards, est, strict=True)]
            ax.bar(xs, est, width, yerr=[lo, hi], capsize=2, label=column)
        ax.set_xticks(range(len(cards)))
        ax.set_xticklabels([f"{c} GiB" for c in cards])
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Random workloads per card class (95% CI, bootstrap over "
                 "workloads)")
    fig.tight_layout()
    fig.savefig(REGRET_PNG)
    plt.close(fig)
    return None


def format_section(scenarios, summaries, random_rows, traces, timings,
                   plot_note, command, seconds, n_workloads, load_before,
                   label) -> str:
    best = best_of(timings)
    slopes = ", ".join(f"{n} {slope(p):.2f}" for n, p in best.items())
    lines = [
        f"Command: `{command}` (took {seconds:.0f} s; {label}).  "
        f"Machine: {machine_line(load_before)}.  What is real and what is "
        "modelled: bench/regret_sim.py's docstring; the columns, the "
        "oracle and the figures: bench/bench_regret.py's; the outcome in "
        "words: docs/regret.md.",
        "",
        "### Scenarios: residency that changes without a message",
        "",
        scenario_table(scenarios),
        "",
    ]
    for name, doc, _, _ in scenarios:
        lines.append(f"- **{name}**: {doc}")
    lines += [
        "",
        f"### {n_workloads} seeded random workloads per card class",
        "",
        "Each: ComfyUI's own models of a checkpoint family for the card, "
        "2 to 6 workers with pack models of realistic sizes (one in "
        "seven publishes no board), four prompts of host and worker "
        "nodes, web routes, pack threads, idle gaps, a board sampler held "
        "off the GIL, now and then a hang or a crash "
        "(bench/regret_workloads.py, ``random_workload``).  ComfyUI's "
        "host loads go through load_models_gpu, a worker's through its "
        "shimmed load_models_gpu and comfy-env's _handle_vram_budget.  "
        "Reload seconds at "
        + ", ".join(f"{c} GiB: {b / 1e9:g} GB/s"
                    for c, b in workloads.BANDWIDTH.items()) + ".",
        "",
    ]
    lines += [
        "### Issue 25's goals: column `all` against `comfy-env`, same run",
        "",
        goals_table(goals(random_rows)),
        "",
        "What did not fit (out-of-memory events per workload, by kind):",
        "",
        oom_text(summaries),
        "",
        "Why the unlisted bytes were out of reach (workers with a board; "
        "GiB per pass that needed room, the five largest causes):",
        "",
        unlisted_text(summaries),
        "",
    ]
    for card, summary in summaries.items():
        lines += [f"**{card} GiB card**", "", random_table(card, summary), ""]
    lines += [
        "Paired, per workload (a minus b; negative: a is better; in "
        "brackets the 95% CI; then how many workloads a was better / "
        "worse in; unlisted and regret per pass that needed room, over "
        "the workloads with such passes in both):",
        "",
        paired_table(random_rows),
        "",
        "What the wrong figures were in the passes that regretted (high: "
        "the figure said more than was there; low: less; then where it "
        "came from: the receipt's source, a board's state, and whether "
        "the worker was mid-call):",
        "",
        causes_text(summaries),
        "",
        "### Recorded traces (comfy-env's real workers, replayed in every "
        "column)",
        "",
        trace_text(traces),
        "",
        "### The cost of one free_memory pass",
        "",
        "One whole free_memory pass over N registered models that need "
        "no eviction (filter, sort key, loop): best of 9 rounds, the "
        "implementations taking turns, with the median and p90 of the "
        "rounds.  `mock HostModel` is the mock's own model, the floor of "
        "the loop.",
        "",
        pass_table(timings),
        "",
        f"Fitted exponent of time against N (best rounds; 1 is linear): "
        f"{slopes}.",
        "",
    ]
    if plot_note:
        lines += [f"No plots: {plot_note}", ""]
    else:
        lines += [
            f"![regret and costs per card]({REGRET_PNG.name}) "
            f"![cost of a pass against N]({PASS_PNG.name})",
            "",
        ]
    return "\n".join(lines)


def machine_line(load_before: tuple[float, ...]) -> str:
    before = ", ".join(f"{x:.2f}" for x in load_before)
    after = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, "
            f"{platform.python_implementation()} "
            f"{platform.python_version()}; load average {before} before, "
            f"{after} after")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite our section of RESULTS.md and the PNGs")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_WORKLOADS} workloads per card, two "
                        "scenarios, N = 1 and 16, no plot")
    parser.add_argument("--workloads", type=int, default=None,
                        help=f"random workloads per card (default "
                        f"{WORKLOADS})")
    args = parser.parse_args(argv)
    n = args.workloads or (SMOKE_WORKLOADS if args.smoke else WORKLOADS)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr)

    ce = sim.load_comfy_env()
    load_before = os.getloadavg()
    t0 = time.monotonic()
    scenarios = measure_scenarios(
        ce, ["mid-call budget", "route during a long call"]
        if args.smoke else None, progress)
    random_rows = measure_random(ce, workloads.CARDS, n, progress)
    summaries = {card: summarize(rows) for card, rows in random_rows.items()}
    traces = measure_traces(ce, progress)
    timings = measure_pass(
        ce, SMOKE_PASS_SIZES if args.smoke else PASS_SIZES,
        rounds=1 if args.smoke else 9,
        min_batch=0.0 if args.smoke else 0.05, progress=progress)
    seconds = time.monotonic() - t0
    print(scenario_table(scenarios))
    for card, summary in summaries.items():
        print(f"\n{card} GiB card\n" + random_table(card, summary))
    print("\n" + paired_table(random_rows))
    print("\n" + goals_table(goals(random_rows)))
    print("\n" + oom_text(summaries))
    print("\n" + unlisted_text(summaries))
    print("\n" + causes_text(summaries))
    print("\n" + trace_text(traces))
    print("\n" + pass_table(timings))
    if args.write:
        note = None if args.smoke else plot(summaries, timings)
        if note:
            print(note, file=sys.stderr)
        command = ("python bench/bench_regret.py " + " ".join(argv)).strip()
        benchutil.write_section(
            "regret", HEADING,
            format_section(scenarios, summaries, random_rows, traces,
                           timings, note, command, seconds, n, load_before,
                           f"comfy-env {ce.version}"),
            "bench/bench_regret.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
