"""The hostile-edge harness: generated worker words against the Python
edges around the C core.

What a worker sends (a census, an echo, a reply to a release ask, an
answer that never comes) is hostile input.  Each property below drives
one edge with generated values of every shape (wrong types, unhashable
ids, NaN, huge ints, huge strings with terminal escapes, nesting) and
checks what must hold for any input:

- the comfy-env adapter's ``state_sync`` wrappers, called as comfy-env
  calls them: never raise; the receipts end as if only the valid entries
  had been applied; every log line is one bounded printable line;
- ``Pool.reclaim``: never raises; it counts no more than the worker
  held; a worker found dead is gone from the books and never asked
  again;
- the adapter's log-once set: keyed by fixed kinds, bounded.

``install-node`` / ``uninstall-node`` have their own harness in
tests/test_node_paths.py (planted links and files).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import fakes
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mock_fixtures import mock_mm as mm

import comfy_standin as cs
from comfy_standin._text import LOG_TEXT_LIMIT
from comfy_standin.integrations import comfy_env as adapter



def _state_sync() -> Any:
    """comfy-env's state_sync module, as its callers see it (imported at
    use: this file collects without comfy-env)."""
    return importlib.import_module("comfy_env.state_sync")


GiB = 1 << 30
MiB = 1 << 20
#: One shared huge value: a 64 KiB string with terminal escapes.
HUGE = "\x1b]52;c;cHduZWQ=\x07\x1b[2J" + "x" * (64 << 10)
#: The longest line the adapter logs: its limit plus the cut marker.
LINE_MAX = 4 * LOG_TEXT_LIMIT + len("...[+99999999 chars]")

HOSTILE = settings(
    max_examples=120, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture,
                           HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=4), st.just(HUGE),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
ids = st.one_of(st.sampled_from(["a", "b", "old", "zzz"]), values)
entries = st.one_of(
    st.fixed_dictionaries(
        {"id": ids},
        optional={
            "seq": st.one_of(st.integers(0, 40), values),
            "resident": st.one_of(st.integers(0, 5 * GiB), values),
            "device": st.one_of(st.just("cuda:0"), values),
        },
    ),
    values,
)
censuses = st.one_of(st.lists(entries, max_size=8), values)


def printable_lines(lines: list[str]) -> None:
    for line in lines:
        assert isinstance(line, str) and line.isprintable(), line[:200]
        assert len(line) <= LINE_MAX, len(line)


@pytest.fixture
def adapter_on(mm_module):
    assert adapter.install() is True
    yield
    adapter.uninstall()


@pytest.fixture
def mm_module(mm):
    return mm


# ---------------------------------------------------------------------------
# the adapter's state sync


def comfy_envs_own(worker: Any, model_id: str, size: int) -> Any:
    return adapter._originals[
        ("comfy_env.isolation.model_patcher", "SubprocessModelPatcher")
    ](worker=worker, worker_generation=1, model_id=model_id,
      model_size=size, load_device="cuda:0", offload_device="cpu")


def patcher_set() -> dict[str, Any]:
    worker = fakes.FakeWorker("w")
    pool = cs.Pool(floor=0)
    out = {
        mid: cs.StandIn(worker=worker, worker_generation=1, model_id=mid,
                        model_size=4 * GiB, load_device="cuda:0",
                        offload_device="cpu", pool=pool)
        for mid in ("a", "b")
    }
    out["old"] = comfy_envs_own(worker, "old", 4 * GiB)
    out["_keep"] = (worker, pool)
    return out


def picture(patchers: dict[str, Any]) -> dict[str, Any]:
    seen = {}
    for mid in ("a", "b"):
        loaded, seq, _, source = patchers[mid].receipt()
        seen[mid] = (loaded, seq, source)
    old = patchers["old"]
    seen["old"] = (old.model.model_loaded_weight_memory,
                   getattr(old, "_residency_seq", None))
    return seen


@pytest.mark.comfy_env
@HOSTILE
@given(census=censuses)
def test_census_wrapper_is_the_valid_entries_alone(adapter_on, census):
    """Whatever the census holds: no exception, and the receipts end as
    if each valid entry had been applied alone, in order."""
    hostile = patcher_set()
    twin = patcher_set()
    live = {k: v for k, v in hostile.items() if k != "_keep"}
    lines: list[str] = []
    state_sync = _state_sync()
    changed = state_sync.apply_residency(live, census, log=lines.append)
    assert isinstance(changed, list) and set(changed) <= set(live)
    printable_lines(lines)
    # The twin: only dict entries with a str id, one at a time.
    original = state_sync.apply_residency.__wrapped__
    if isinstance(census, (list, tuple)):
        for entry in census:
            if not isinstance(entry, dict) or not isinstance(
                    entry.get("id"), str):
                continue
            mid = entry["id"]
            if mid == "old":
                original({"old": twin["old"]}, [entry])
            elif mid in ("a", "b"):
                try:
                    cs.apply_residency({mid: twin[mid]}, [entry])
                except cs.EchoError:
                    pass
    assert picture(hostile) == picture(twin)


@pytest.mark.comfy_env
@HOSTILE
@given(census=censuses, resident=values, seq=values)
def test_peak_and_echo_wrappers_never_raise(adapter_on, census, resident,
                                            seq):
    patchers = patcher_set()
    live = {k: v for k, v in patchers.items() if k != "_keep"}
    state_sync = _state_sync()
    state_sync.apply_peak_raise(live, census)
    for mid in ("a", "old"):
        state_sync.apply_echo(live[mid], resident, seq=seq)
        state_sync.apply_echo(live[mid], resident, seq=seq, unmapped=True)
    s = live["a"]
    assert 0 <= s.loaded_size() <= s.size


@HOSTILE
@given(calls=st.lists(st.tuples(st.one_of(st.text(max_size=30),
                                          st.just(HUGE)),
                                st.one_of(st.text(max_size=30),
                                          st.just(HUGE))),
                      max_size=40))
def test_log_once_set_stays_small(monkeypatch, calls, caplog):
    monkeypatch.setattr(adapter, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        for kind, message in calls:
            adapter._warn_once(kind, message)
            adapter._warn_once("worker", "worker {reason}", reason=message)
    assert len(adapter._warned) <= adapter._WARNED_MAX
    assert all(len(k) <= 40 + len("...[+99999999 chars]")
               for k in adapter._warned)
    printable_lines([r.getMessage() for r in caplog.records])
    caplog.clear()


# ---------------------------------------------------------------------------
# reclaim: idle workers asked for bytes no listed model accounts for

receipts = st.one_of(values, st.fixed_dictionaries({}, optional={
    key: st.one_of(st.integers(-5, 2**66), values)
    for key in ("freed_bytes", "freed", "pinned_before", "pinned_after")
}))
reports = st.one_of(values, st.fixed_dictionaries({}, optional={
    "held": st.one_of(st.integers(0, 8 * GiB), values),
    "pinned": st.one_of(st.integers(0, 2 * GiB), values),
    "residency": values,
}))
answers = st.one_of(
    st.tuples(st.just("reply"), st.one_of(values, st.fixed_dictionaries(
        {}, optional={"receipt": receipts, "_vram_report": reports}))),
    st.tuples(st.sampled_from(["dead", "busy", "raise", "die"]),
              st.none()),
)


class Scripted(fakes.FakeWorker):
    """Answers each release ask with the next scripted answer."""

    def __init__(self, name: str, script: list[tuple[str, Any]],
                 releases: bool) -> None:
        super().__init__(name, sim=mm.Sim())  # a machine per example
        self.script = list(script)
        self.supports_partial_release = releases
        self.asked_after_death = 0

    def send_command_no_spawn(self, command, lock_timeout, **params):
        if not self.alive:
            self.asked_after_death += 1
            return "dead"
        kind, value = self.script.pop(0) if self.script else ("busy", None)
        if kind == "reply":
            return value
        if kind in ("dead", "die"):
            self.alive = False
            if kind == "dead":
                return "dead"
            raise fakes.WorkerDiedError("gone")
        if kind == "raise":
            raise RuntimeError(HUGE)
        return "busy"


@HOSTILE
@given(script=st.lists(answers, max_size=6),
       releases=st.booleans(),
       asks=st.lists(st.integers(0, 8 * GiB), min_size=1, max_size=5))
@example(script=[("reply", {"receipt": {"freed_bytes": 2**40}})],
         releases=True, asks=[GiB])  # says more than it held
@example(script=[("die", None)], releases=True, asks=[GiB, GiB])
def test_reclaim_against_any_answer(impl, mm_module, script, releases, asks,
                                    caplog):
    pool = impl.Pool(floor=0, process_local=False)
    w = Scripted("w", script, releases)
    w.add_model("m", 2 * GiB, resident=2 * GiB)
    s = impl.StandIn(w, 1, "m", 2 * GiB, mm.CUDA0, mm.CPU, pool=pool)
    impl.apply_residency({"m": s}, w.census())
    pool.report(w, {"held": 3 * GiB, "pinned": 512 * MiB})
    with caplog.at_level(logging.DEBUG, logger="comfy_standin"):
        for size in asks:
            held = pool.charge_details().get(w, {}).get("held", 0)
            got = pool.reclaim(size)
            assert isinstance(got, int) and 0 <= got <= held
            books = pool._ledger.find(w)
            if not w.alive:  # a death seen, or the next ask sees it
                pool.reclaim(size)
                assert books is None or not books.alive
                assert pool.unlisted().get(w, 0) == 0
                assert pool.reclaim(size) == 0
    assert w.asked_after_death <= 1  # the one ask that found it dead
    for record in caplog.records:
        if record.name.startswith("comfy_standin") and \
                record.exc_info is None:
            assert "\x1b" not in record.getMessage()
            assert len(record.getMessage()) < 4000
    pool.boundary()
