"""The eviction-regret bench still runs, and its harness still holds
(bench/bench_regret.py, bench/regret_sim.py, bench/regret_workloads.py).

Seconds, no time asserted.  What is asserted holds by construction of the
harness or of a scenario, so a broken harness fails here:

- the ``oracle`` column reads the truth, so in every pass it must evict
  exactly what the oracle replay (free_memory's rule fed the truth, each
  command's effect computed apart from the simulated worker) evicts: the
  replay and the simulated workers agree;
- the recorded traces (bench/traces/) replay in the ``comfy-env`` column
  exactly as comfy-env's real workers ran them: the simulation of
  comfy-env 0.4.46 is held to the real thing;
- each column has its rule and only its rule: the model evicted and
  loaded back two calls later is listed and taken only where ``relist``
  is on, a busy worker is waited on except where ``no-wait`` is on (the
  recorded busy_worker trace), the registration census orders as the
  oracle where ``census`` is on, a model command's reply is published
  where ``publish`` is on, a worker's cache comes back after the pass
  where ``unlisted`` is on, counted as the receipt measured it;
- each scenario's mechanism shows where its docstring says it does (the
  mid-call budget regrets on receipts and not on boards; a worker without
  a publisher ties; a moved: False detach costs comfy-env an entry);
- the board is modelled as measured: its sampler falls behind in a call,
  its readings reach the host after the measured lag, a stale heartbeat
  reads as no reading;
- the goals are judged as issue 25 states them;
- a workload is a pure function of its seed, and runs deterministically.

comfy-env 0.4.46 is required (its own code is the faithful column): a
missing or other version fails, it is never skipped.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from benchload import load_bench

# comfy-env 0.4.46's own code is the faithful column: every test needs it.
pytestmark = pytest.mark.comfy_env

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
GiB = 1 << 30


@pytest.fixture(scope="module")
def bench() -> Any:
    before = set(sys.modules)
    module = load_bench("bench_regret", register=True)
    yield module
    for name in set(sys.modules) - before:
        if name in ("bench_regret", "regret_sim", "regret_workloads") or \
                name == "comfy_env" or name.startswith("comfy_env."):
            del sys.modules[name]
    if str(BENCH_DIR) in sys.path:
        sys.path.remove(str(BENCH_DIR))


@pytest.fixture(scope="module")
def ce(bench: Any) -> Any:
    return bench.sim.load_comfy_env()


@pytest.fixture(scope="module")
def scenarios(bench: Any, ce: Any) -> dict[str, tuple]:
    return {name: (wl, results) for name, _, wl, results in
            bench.measure_scenarios(ce)}


def passes_equal(a: Any, b: Any) -> bool:
    return [(p.evicted, p.free_after) for p in a.passes] == \
        [(p.evicted, p.free_after) for p in b.passes]


def test_oracle_column_evicts_what_the_oracle_replay_evicts(
        bench: Any, ce: Any, scenarios: dict) -> None:
    runs = [results["oracle"] for _, results in scenarios.values()]
    for card in bench.workloads.CARDS:
        for seed in range(2):
            wl = bench.workloads.random_workload(card, seed)
            runs.append(bench.sim.run_workload(wl, "oracle", ce))
    checked = 0
    for run in runs:
        for p in run.passes:
            assert p.evicted == {k: v for k, v in p.oracle_evicted.items()
                                 if k in p.evicted}, p
            assert p.free_after == p.oracle_free_after, p
            assert not p.regrets
            checked += 1
    assert checked > 20


@pytest.fixture(scope="module")
def traces(bench: Any, ce: Any) -> dict[str, tuple]:
    return {path.stem: (wl, results, check)
            for path, wl, results, check in bench.measure_traces(ce)}


def test_recorded_traces_replay_as_comfy_env_ran_them(
        bench: Any, traces: dict) -> None:
    assert {"two_workers", "busy_worker"} <= set(traces)
    for name, (wl, results, check) in traces.items():
        assert check["observed"] > 0, name
        assert check["match"], (name, check["real"], check["sim"])
        assert wl["source"].startswith("comfy-env 0.4.46 real workers")
        assert set(results) == set(bench.COLUMNS)


def took(result: Any, key: str) -> list[int]:
    return [p.evicted.get(key, 0) for p in result.passes]


def test_relist_takes_the_model_loaded_back_two_calls_later(
        bench: Any, traces: dict) -> None:
    """two_workers: ComfyUI evicts A's DiT, B is called, A loads the DiT
    back; ComfyUI's next loads find it listed only where rule 1 is on."""
    wl, results, _ = traces["two_workers"]
    evicted_at = next(i for i, n in enumerate(took(results["comfy-env"],
                                                   "A/dit")) if n > 0)
    for column in bench.COLUMNS:
        later = sum(took(results[column], "A/dit")[evicted_at + 2:])
        if column in ("relist", "all"):
            assert later > 4 * GiB, column
            assert not results[column].costs.ooms, column
        elif column != "oracle":
            assert later == 0, column
            assert len(results[column].costs.ooms) == 1, column


def test_a_busy_worker_is_waited_on_unless_no_wait(bench: Any,
                                                   traces: dict) -> None:
    """busy_worker: ComfyUI loads on another thread while C is in a call.
    comfy-env waits for C's lock until the call ends (3 s) and then takes
    C's tagger, then a full lock timeout (30 s); no-wait defers at once
    and the room comes from ComfyUI's own models."""
    _, results, _ = traces["busy_worker"]
    theirs = results["comfy-env"]
    assert math.isclose(theirs.costs.stall_busy, 33.0, abs_tol=0.1)
    first = [p for p in theirs.passes if p.thread == "route"][0]
    assert first.evicted["C/tagger"] > 0
    for column in ("no-wait", "all"):
        ours = results[column]
        assert ours.costs.stall_busy == 0, column
        route = [p for p in ours.passes if p.thread == "route"]
        assert route and all(p.evicted.get("C/tagger", 0) == 0
                             for p in route), column
        assert sum(p.evicted.get("host/unet", 0) for p in route) > 0
        assert not ours.costs.ooms
    assert results["boards"].costs.stall_busy > 0


def test_mid_call_budget_regrets_on_receipts_not_on_boards(
        scenarios: dict) -> None:
    _, results = scenarios["mid-call budget"]
    for column in ("comfy-env", "receipts"):
        first = results[column].passes[0]
        # A's own video model (5 GiB resident, 0.5 GiB on its receipt)
        # was detached whole inside A's call
        assert first.evicted["A/video"] == 5 * GiB, column
        assert first.oracle_evicted["A/video"] == 0, column
        assert first.excess > 0, column
    for p in results["boards"].passes:
        assert not p.regrets
    assert results["boards"].passes[0].evicted["A/video"] == 0


def test_a_route_waits_for_a_long_call_to_end(scenarios: dict) -> None:
    _, results = scenarios["route during a long call"]
    assert results["receipts"].costs.stall_other == 0
    # the board reads A's pages: its commands wait on A's lock until A's
    # 20 s call ends, less than comfy-env's 30 s timeout
    wait = results["boards"].costs.stall_busy
    assert 0 < wait < 30
    assert results["boards"].costs.stall_prompt == 0
    assert results["no-wait"].costs.stall_busy == 0


def test_hung_worker_with_a_heartbeat_costs_boards_a_minute(
        scenarios: dict) -> None:
    _, results = scenarios["hung, fresh heartbeat"]
    assert results["receipts"].costs.stall_prompt == 0
    assert results["boards"].costs.stall_prompt == 60
    assert results["boards"].costs.stall_hung == 60
    assert results["boards"].costs.stall_busy == 0


def test_no_publisher_and_a_lagging_sampler_tie_with_receipts(
        scenarios: dict) -> None:
    for name in ("publishes nothing", "sampler lags"):
        _, results = scenarios[name]
        assert passes_equal(results["boards"], results["receipts"]), name
        assert any(p.regrets for p in results["receipts"].passes), name
    _, results = scenarios["pack thread"]
    assert not any(p.regrets for p in results["boards"].passes)


def test_registration_census_orders_as_the_oracle(scenarios: dict) -> None:
    _, results = scenarios["registration"]
    last = {c: results[c].passes[-1] for c in results}
    first_key = {c: p.candidates[0].key for c, p in last.items()}
    assert first_key["comfy-env"] == first_key["receipts"] == "B/seg"
    assert first_key["oracle"] == "A/llm"
    # the census at creation, and a board (its binding publishes at once)
    assert first_key["census"] == first_key["boards"] == "A/llm"


def test_census_at_creation_corrects_the_full_size_guess(
        bench: Any, ce: Any) -> None:
    """Without a board, only rule 2 writes the registering frame's census
    into the stand-in it creates."""
    wl = bench.workloads.scenario_registration()
    for spec in wl["workers"]:
        spec["publishes"] = False
    figures = {}
    for column in ("receipts", "census"):
        result = bench.sim.run_workload(wl, column, ce)
        last = result.passes[-1]
        figures[column] = {c.key: (c.seen, c.truth) for c in last.candidates}
    seen, truth = figures["receipts"]["A/llm"]
    assert seen == 10 * GiB // (1 << 20) * (1 << 20) and truth < seen
    assert figures["census"]["A/llm"][0] == figures["census"]["A/llm"][1]


def test_publish_before_a_model_command_reply(bench: Any, ce: Any) -> None:
    """A plain module's partial unload answers with no seq: no _bump_seq,
    so the shipped publisher is silent; rule 3 publishes before the
    reply."""
    sim = bench.sim
    wl = bench.workloads.scenario_pack_thread()
    stamps = {}
    for column in ("boards", "publish"):
        with sim.Run(wl, column, ce) as run:
            worker = run.worker_for("A")
            m = worker.models["seg"]
            worker.set_resident(m, m.size)
            worker.register(m)
            worker.bind(m.mid)
            worker.publish_sync()
            run.clock.now = 0.2
            reply = worker.send_command("model_partial_unload",
                                        model_id=m.mid, bytes_to_free=0)
            assert "seq" not in reply and m.resident == 0
            stamps[column] = worker.sync[m.mid]
    assert stamps["boards"] == (m.size, 0.0)
    value, stamp = stamps["publish"]
    assert value == 0 and math.isclose(stamp, 0.2 + sim.RTT)


def test_reclaim_brings_back_a_cache_no_stand_in_describes(
        scenarios: dict) -> None:
    _, results = scenarios["allocator cache"]
    cache = 3 * GiB // (1 << 20) * (1 << 20)
    for column in ("comfy-env", "boards", "no-wait"):
        (p,) = results[column].passes
        assert p.reclaimed == 0 and p.unlisted_board == cache, column
    for column in ("unlisted", "all"):
        (p,) = results[column].passes
        # the receipt's measured bytes, no more
        assert p.reclaimed == cache, column
        assert p.unlisted_board == 0, column


def test_moved_false_costs_comfy_env_the_entry(scenarios: dict) -> None:
    _, results = scenarios["moved: False"]
    ours = results["receipts"]
    theirs = results["comfy-env"]
    # ours list the LLM again and take its bytes at the last load
    assert any("A/llm" in p.evicted and p.evicted["A/llm"] > 0
               for p in ours.passes[3:])
    assert len(theirs.costs.ooms) == len(ours.costs.ooms) + 1


def test_random_workloads_are_deterministic(bench: Any, ce: Any) -> None:
    wl = bench.workloads.random_workload(12, 7)
    assert wl == bench.workloads.random_workload(12, 7)
    assert wl != bench.workloads.random_workload(12, 8)
    a = bench.workload_summary(bench.sim.run_workload(wl, "boards", ce), 1e9)
    b = bench.workload_summary(bench.sim.run_workload(wl, "boards", ce), 1e9)
    assert a == b


def test_board_readings_as_measured(bench: Any, ce: Any) -> None:
    """The sampler starts at the first binding, which publishes at once;
    a change reaches the host only with a later pass, after the read lag;
    in a call the passes fall behind the period; a sampler held off past
    the heartbeat limit reads as no reading."""
    sim = bench.sim
    workload = bench.workloads.scenario_pack_thread()
    workload["events"] = [
        {"ev": "lag", "worker": "A", "t": 3.0, "until": 9.5},
        {"ev": "end", "t": 0.0},
    ]
    with sim.Run(workload, "boards", ce) as run:
        worker = run.worker_for("A")
        m = worker.models["seg"]
        worker.register(m)
        assert worker.next_pass == math.inf  # no thread before a binding
        tag = worker.bind(m.mid)
        worker.publish_sync()
        assert worker.board_read(m.mid, tag, 0.0) == (0, 0.0)
        run.clock.now = 0.51
        worker.set_resident(m, m.size)
        assert worker.board_read(m.mid, tag, 0.51)[0] == 0
        period = sim.SAMPLE_PERIOD + sim.PASS_COST
        lag = sim.READ_LAG[-1][1]
        value, stamp = worker.board_read(m.mid, tag, 0.51 + period + lag)
        assert value == m.size and 0.51 < stamp <= 0.51 + period
        for _, visible, end in worker.sampler:
            assert 0 <= visible - end <= lag
        # outside a call the passes keep the period; inside one each
        # waits for the GIL
        worker.calls.append([1.0, 2.0])
        worker.board_read(m.mid, tag, 2.5)
        starts = [p[0] for p in worker.sampler]
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        inside = [g for a, g in zip(starts, gaps, strict=False)
                  if 1.0 <= a < 1.95]
        outside = [g for a, g in zip(starts, gaps, strict=False)
                   if a >= 2.05]
        assert outside and all(math.isclose(g, period) for g in outside)
        assert inside and statistics.fmean(inside) > period
        assert max(inside) <= period + sim.SWITCH_INTERVAL
        # held off the GIL from 3.0: stale 5 s after its last heartbeat
        run.clock.now = 3.2
        worker.set_resident(m, 0)
        assert worker.board_read(m.mid, tag, 3.5)[0] == m.size
        assert worker.board_read(m.mid, tag, 7.9) is not None
        assert worker.board_read(m.mid, tag, 8.1) is None
        assert worker.board_read(m.mid, tag, 9.6)[0] == 0  # resumed
        assert worker.board_read(m.mid, tag + 1, 9.6) is None  # tag
        worker.kill()
        assert worker.board_read(m.mid, tag, 9.7) is None


def test_statistics_and_tables(bench: Any, ce: Any) -> None:
    est, lo, hi = bench.bootstrap([1.0, 2.0, 3.0, 10.0])
    assert lo <= est <= hi and est == 4.0
    assert bench.bootstrap([1.0, 2.0, 3.0, 10.0]) == (est, lo, hi)
    ratio = bench.bootstrap([2.0, 0.0, 4.0], [1.0, 1.0, 2.0])
    assert ratio[0] == 1.5
    rows = bench.measure_random(ce, (8, 24), 2)
    summaries = {card: bench.summarize(r) for card, r in rows.items()}
    for card, summary in summaries.items():
        table = bench.random_table(card, summary)
        for column in bench.COLUMNS:
            assert f"| {column} |" in table
    paired = bench.paired_table(rows)
    for column in bench.COLUMNS:
        if column not in ("comfy-env", "oracle"):
            assert f"| 8 GiB | {column} - comfy-env |" in paired
    assert "| 24 GiB | all - boards |" in paired
    assert bench.causes_text(summaries).startswith("- comfy-env")
    assert "- 8 GiB, all: " in bench.unlisted_text(summaries)
    assert "- 24 GiB, comfy-env: " in bench.oom_text(summaries)
    assert bench.oom_kind("3.0s host: activations 1 GiB") == \
        "ComfyUI's activations"


def _rows(n: int, **columns: dict[str, float]) -> list[dict[str, dict]]:
    """n workloads whose columns have the given figures, the rest 0."""
    import collections

    def summary(**figures: float) -> dict:
        out = dict.fromkeys(
            ("passes", "regrets", "regret", "excess", "short", "wrong",
             "unlisted", "unlisted_board", "reload_bytes", "reload_s",
             "ooms", "stall_busy", "stall_hung", "stall_prompt",
             "stall_other"), 0)
        out.update(passes=2, causes=collections.Counter(),
                   unlisted_why=collections.Counter(),
                   oom_kinds=collections.Counter())
        out.update(figures)
        return out

    return [{c: summary(**columns.get(c, {})) for c in columns["all_of"]}
            for _ in range(n)]


def test_goals_are_judged_as_stated(bench: Any) -> None:
    cols = bench.COLUMNS
    met = {8: _rows(20, all_of=cols, **{
        "comfy-env": {"ooms": 2}, "all": {
            "ooms": 1.5, "reload_s": 0.2,
            "unlisted_board": 0.1 * GiB}}),
        80: _rows(20, all_of=cols)}
    verdicts = {(g["card"], g["goal"].split(" ")[0]): g
                for g in bench.goals(met)}
    assert all(g["met"] for g in verdicts.values()), verdicts
    missed = {8: _rows(20, all_of=cols, **{
        "comfy-env": {"ooms": 2}, "all": {
            "ooms": 1.7, "reload_s": 0.5, "stall_busy": 3.0,
            "unlisted_board": 0.5 * GiB}})}
    verdicts = {g["goal"].split(" ")[0]: g for g in bench.goals(missed)}
    assert not any(g["met"] for g in verdicts.values()), verdicts
    assert math.isclose(verdicts["OOMs"]["by"], 0.1)
    assert math.isclose(verdicts["reload"]["by"], 0.2)
    assert math.isclose(verdicts["unlisted"]["by"], 0.15)
    table = bench.goals_table(bench.goals(missed))
    assert "missed by 0.100" in table and "| 8 GiB |" in table


def test_pass_timing_has_a_number_per_impl_and_round(bench: Any,
                                                     ce: Any) -> None:
    timings = bench.measure_pass(ce, (1, 16), rounds=2, min_batch=0.0)
    assert {"c", "reference", "comfy-env", "mock HostModel"} == set(timings)
    for name, points in timings.items():
        assert sorted(points) == [1, 16], name
        for rounds in points.values():
            assert len(rounds) == 2
            assert all(math.isfinite(t) and t > 0 for t in rounds), name
    table = bench.pass_table(timings)
    assert "| 16 |" in table and "best (median, p90)" in table


def test_the_section_says_what_ran(
        bench: Any, ce: Any, scenarios: dict) -> None:
    rows = bench.measure_random(ce, (8,), 1)
    summaries = {8: bench.summarize(rows[8])}
    timings = {"c": {1: [1e-6], 16: [1.6e-5]}}
    scenario_list = [(name, "what happens", wl, results)
                     for name, (wl, results) in scenarios.items()]
    text = bench.format_section(
        scenario_list, summaries, rows, [], timings, "no plot here",
        "the command", 1.0, 1, (0.5, 0.5, 0.5), "comfy-env 0.4.46")
    assert text.startswith("Command: `the command`")
    assert "No plots: no plot here" in text
    assert "load average 0.50, 0.50, 0.50 before" in text


def test_the_command_line_runs(bench: Any, capsys: Any) -> None:
    assert bench.main(["--smoke", "--workloads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| mid-call budget | boards |" in out
    assert "two_workers.jsonl" in out and "busy_worker.jsonl" in out
    assert "| 8 GiB | OOMs per workload, all - comfy-env |" in out


class ScriptedWorker:
    """Answers each command with the next scripted reply (an exception
    instance is raised), and records what it was sent."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)
        self.sent: list[tuple[str, dict]] = []
        self.alive = True

    def send_command(self, command: str, **kwargs: Any) -> dict:
        self.sent.append((command, kwargs))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def is_alive(self) -> bool:
        return self.alive


def test_the_bench_stand_in_decides_as_the_shipped_c_type(
        bench: Any, ce: Any) -> None:
    """Column "receipts" models comfy_standin.StandIn as shipped: the same
    replies give the same figures, the same commands and the same
    returns."""
    import comfy_standin as cs

    sim = bench.sim
    size = 4 * GiB
    replies = [
        {"status": "ok", "freed": 1 * GiB, "resident": 2 * GiB, "seq": 2},
        {"status": "ok", "freed": 0, "resident": 2 * GiB, "seq": 3},
        RuntimeError("timed out waiting for the worker lock"),
        {"status": "ok", "device": "cpu", "moved": False, "seq": 4},
        {"status": "ok", "freed": 1 * GiB, "resident": 0},
    ]
    workload = bench.workloads.scenario_pack_thread()
    with sim.Run(workload, "receipts", ce) as run:
        ours_worker = ScriptedWorker(replies)
        ours = sim.OurStandIn(run, ours_worker, 1, "m", size, "cuda:0",
                              "cpu")
        theirs_worker = ScriptedWorker(replies)
        theirs = cs.StandIn(worker=theirs_worker, worker_generation=1,
                            model_id="m", model_size=size,
                            load_device="cuda:0", offload_device="cpu",
                            pool=cs.Pool(floor=0, process_local=False))
        steps = [
            ("census", 3 * GiB, 1),
            ("unload", 1.5 * GiB),   # frees 1 GiB (short of 1.5)
            ("unload", 0.5 * GiB),   # frees nothing
            ("unload", 0.5 * GiB),   # a busy worker: deferred
            ("detach",),             # moved: False
            ("census", 1 * GiB, 4),  # a tie goes to the census
            ("unload", 0),           # no seq in the reply
            ("census", 3 * GiB, 2),  # strictly older: dropped
            ("detach",),             # nothing resident: no command
        ]
        for step in steps:
            if step[0] == "census":
                ours.census(step[1], step[2])
                cs.apply_residency({"m": theirs}, [
                    {"id": "m", "resident": step[1], "seq": step[2]}])
            elif step[0] == "unload":
                assert ours.partially_unload("cpu", step[1]) == \
                    theirs.partially_unload("cpu", step[1]), step
                assert ours.eviction_deferred == \
                    theirs.eviction_deferred, step
            else:
                ours.detach()
                theirs.detach()
            assert ours.loaded_size() == theirs.loaded_size(), step
            assert ours.receipt()[1] == theirs.receipt()[1], step
        assert ours_worker.sent == theirs_worker.sent
