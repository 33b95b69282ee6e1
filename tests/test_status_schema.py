"""The status route and the ``status --url`` client agree on one schema.

``_status.ANSWER`` is the schema (docs/cli.md, "The status answer").
Hypothesis builds real pools and stand-ins, of both implementations, in
the states a receipt can be in (registered only, so no seq yet; each
source; a deferred eviction; a bad reply), with boards a real worker
process publishes on (valid, stale heartbeat, torn, dead owner, wrong
owner, not attached, closed), workers alive, in flight, gone, restarted
or behind a launcher, held registrations and a graveyard, the probe with
no library, disabled or reading two devices from the stub libraries
(tests/c/stubs), and ComfyUI's ``comfy.model_management`` absent or with
odd entries; each answer the route's ``payload_json()`` makes is read by
the client (``parse_answer`` and ``render_remote``) and held to the
schema strictly: no field the schema does not name.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import fakes
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mock_fixtures import mock_mm
from test_board import Worker
from test_probe import TWO_DEVICES, run_probe, stubs  # noqa: F401
from test_status_url import good_answer

import comfy_standin as cs
from comfy_standin import _reference, _server_route, _status
from comfy_standin._text import NotJSON

GiB = 1 << 30
SIZE = GiB
#: Models a worker may have on each board.
PER_BOARD = 3
#: The board states a stand-in can read, each a board of its own.
BOARD_STATES = ("valid", "stale heartbeat", "torn", "dead owner",
                "wrong owner", "not attached")
#: How a model's receipt was last written (its source, or an event).
EVENTS = ("registered", "load echo", "unload echo", "detach echo",
          "census", "assigned", "board", "deferred", "bad reply")
IMPLS = {"c": cs, "reference": _reference}
#: The pid comfy-env would have started under a launcher that runs Python
#: as its child (no such process: only shown).
LAUNCHER_PID = 4_000_001


class Rig:
    """A board in one state, with PER_BOARD slots assigned: a real worker
    process (tests/board_worker.py) has bound and published each."""

    def __init__(self, state: str) -> None:
        self.state = state
        stale = state == "stale heartbeat"
        self.worker = Worker(PER_BOARD + 1, generation=1,
                             heartbeat_limit=0.05 if stale else None)
        self.board = self.worker.board
        self.ids = [f"m-{state}-{i}" for i in range(PER_BOARD)]
        self.slots = [self.board.assign(mid, SIZE) for mid in self.ids]
        for slot in self.slots:
            assert self.worker.ask(
                f"bind {slot} {self.board.tag(slot)}") == "ok"
            assert self.worker.ask(f"publish {slot} {SIZE // 2}") == "ok"
        if state == "not attached":
            assert self.worker.ask("close") == "closed"
        else:
            self.board.expected_owner = (
                os.getpid() if state == "wrong owner" else self.worker.pid)
        if state == "torn":
            for slot in self.slots:
                assert self.worker.ask(f"tear {slot}") == "torn"
        if state == "dead owner":
            self.worker.kill()
            self.board.poll_owner()
        deadline = time.monotonic() + 30
        while self.statuses() != {state} and time.monotonic() < deadline:
            time.sleep(0.01)  # a stale heartbeat takes 0.05 s to be one
        assert self.statuses() == {state}

    def statuses(self) -> set[str]:
        return {self.board.status(slot, SIZE) for slot in self.slots}

    def publish(self, i: int) -> None:
        """A reading newer than any receipt written so far."""
        assert self.worker.ask(f"publish {self.slots[i]} {SIZE // 3}") \
            == "ok"

    def close(self) -> None:
        self.worker.close()


@pytest.fixture(scope="module")
def rigs():
    made = {}
    try:
        for state in BOARD_STATES:
            made[state] = Rig(state)
        yield made
    finally:
        for rig in made.values():
            rig.close()


@pytest.fixture(scope="module")
def probes(tmp_path_factory, stubs):  # noqa: F811 - test_probe's fixture
    """Real probe results: this machine's, disabled, and two devices of
    the stub libraries (one process's usage hidden)."""
    work = tmp_path_factory.mktemp("schema-probe")
    return {
        "here": cs.probe(),
        "disabled": run_probe(
            work, env={"COMFY_STANDIN_PROBE_DISABLE": "1"})["result"],
        "two devices": run_probe(
            work, TWO_DEVICES, cuda=stubs("cuda"),
            nvml=stubs("nvml"))["result"],
    }


class OddEntry:
    """An entry of current_loaded_models that is not ComfyUI's own: a
    custom node's, a half-torn-down one, or a buggy one."""

    class Device:
        def __str__(self):
            raise RuntimeError("no name")

    model_finalizer = None  # as ComfyUI's LoadedModel before a load

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.currently_used = kind == "floats"
        self.device = OddEntry.Device() if kind == "odd device" \
            else mock_mm.CUDA0

    @property
    def model(self):
        if self.kind == "raises":
            raise RuntimeError("patcher gone wrong")
        return None if self.kind == "no patcher" else self

    def is_dead(self):
        return self.kind == "dead"

    def model_memory(self):
        return {"huge": 10 ** 30, "floats": 1.5e9, "bool": True}.get(
            self.kind, GiB)

    def model_loaded_memory(self):
        return {"huge": -5, "floats": float("inf")}.get(self.kind, 0)

    def model_offloaded_memory(self):
        return {"huge": float("nan"), "floats": 2.5}.get(self.kind, GiB)

    def is_dynamic(self):
        raise RuntimeError("not a patcher")


ODD = ("raises", "huge", "floats", "bool", "dead", "no patcher",
       "odd device")

models = st.lists(st.tuples(st.sampled_from(EVENTS),
                            st.sampled_from((None, "closed")
                                            + BOARD_STATES),
                            st.booleans()), max_size=PER_BOARD)
workers = st.lists(st.fixed_dictionaries({
    "named": st.booleans(),
    "pid": st.sampled_from([None, 777, 4242]),
    "state": st.sampled_from(["alive", "in flight", "gone", "restarted",
                              "launcher"]),
    "models": models,
}), max_size=3)
scenarios = st.fixed_dictionaries({
    "impl": st.sampled_from(sorted(IMPLS)),
    "workers": workers,
    "comfyui": st.sampled_from(["present", "absent"]),
    "odd": st.lists(st.sampled_from(ODD), max_size=3),
    "probe": st.sampled_from(["here", "disabled", "two devices"]),
    "readings": st.booleans(),
    "reserve": st.sampled_from([400 << 20, None, 1.5e9, float("inf"),
                                10 ** 30, "junk"]),
})


def census(impl, worker, s) -> None:
    """The worker's node-boundary census of `s`'s model."""
    impl.apply_residency({s.model_id: s}, [
        entry for entry in worker.census() if entry["id"] == s.model_id])


def apply(impl, worker, s, event: str, rig: Rig | None, i: int) -> None:
    """Write `s`'s receipt the way `event` says, through the real paths
    (commands to the worker, echoes, a census, an assignment)."""
    if event == "load echo":
        s.partially_load(mock_mm.CUDA0, SIZE // 2)
    elif event == "unload echo":
        census(impl, worker, s)
        s.partially_unload(SIZE // 4)
    elif event == "detach echo":
        census(impl, worker, s)
        s.detach()
    elif event in ("census", "board"):
        census(impl, worker, s)
        if event == "board" and rig is not None:
            rig.publish(i)
    elif event == "assigned":
        s.model.model_loaded_weight_memory = SIZE // 8
    elif event == "deferred":
        census(impl, worker, s)
        worker.script("refuse", "model_partial_unload", message="busy")
        s.partially_unload(SIZE // 4)
    elif event == "bad reply":
        census(impl, worker, s)
        worker.script("garbage", "model_partial_unload", how="negative",
                      field="freed")
        s.partially_unload(SIZE // 4)


@contextlib.contextmanager
def built(scenario, rigs, probes):
    """The scenario as ComfyUI's process would hold it: yields the pool,
    with cs.default_pool, cs.probe and comfy.model_management set."""
    impl = IMPLS[scenario["impl"]]
    pool = impl.Pool()
    saved = cs.default_pool, cs.probe
    result = probes[scenario["probe"]]
    cs.default_pool = lambda: pool
    cs.probe = lambda: result
    mock_mm.reset()
    fake_workers, kept, closed, in_flight = [], [], [], []
    try:
        mock_mm.EXTRA_RESERVED_VRAM = scenario["reserve"]
        for n, spec in enumerate(scenario["workers"]):
            worker = fakes.FakeWorker(f"pack-{n}")
            fake_workers.append(worker)
            if not spec["named"]:
                worker.name = None  # named by its repr
            if spec["pid"] is not None:
                worker.pid = spec["pid"]
            for i, (event, board, held) in enumerate(spec["models"]):
                if event == "board":
                    board = "valid"
                rig = rigs.get(board)
                model_id = rig.ids[i] if rig else f"m-{n}-{i}"
                worker.add_model(model_id, SIZE, resident=SIZE // 2)
                s = impl.StandIn(worker, 1, model_id, SIZE, mock_mm.CUDA0,
                                 mock_mm.CPU, kind="unet", pool=pool)
                kept.append(s)
                if rig is not None:
                    s.attach_board(rig.board)
                elif board == "closed":
                    own_side, fd = cs.Board.make(1, generation=1)
                    own = cs.Board.adopt(fd, 1, generation=1)
                    os.close(fd)
                    own_side.close()
                    s.attach_board(own)
                    closed.append(own)
                apply(impl, worker, s, event, rig, i)
                if held:
                    impl.register(mock_mm, s)
            if spec["state"] == "launcher":
                worker.pid = LAUNCHER_PID  # beside a board's handoff peer
            if spec["state"] == "gone":
                worker.kill()
                pool.worker_gone(worker)
            elif spec["state"] == "restarted":
                kept.append(impl.StandIn(worker, 2, "m-new", SIZE,
                                         mock_mm.CUDA0, mock_mm.CPU,
                                         pool=pool))
            elif spec["state"] == "in flight":
                in_flight.append(worker)
        for board in closed:
            board.close()
        for kind in scenario["odd"]:
            mock_mm.current_loaded_models.append(OddEntry(kind))
        if scenario["readings"]:
            pool.update_readings(result)
        with contextlib.ExitStack() as calls:
            for worker in in_flight:
                calls.enter_context(pool.call(worker))
            with without_comfyui(scenario["comfyui"] == "absent"):
                yield pool
    finally:
        cs.default_pool, cs.probe = saved
        for worker in fake_workers:
            worker.kill()
            pool.worker_gone(worker)
        mock_mm.reset()
        pool.boundary(mock_mm)
        del kept


@contextlib.contextmanager
def without_comfyui(absent: bool):
    name = "comfy.model_management"
    saved = sys.modules.get(name)
    if absent:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules[name] = saved


def read_as_the_client(body: bytes) -> dict:
    """What ``status --url`` does with the route's bytes, and the strict
    check: every field is one the schema names."""
    data = _status.parse_answer(body, "the route")
    _status.check_answer(data, strict=True)
    text = _status.render_remote(data, "http://127.0.0.1:8188")
    assert text.startswith("ComfyUI at http://127.0.0.1:8188: pid ")
    assert all(line.isprintable() for line in text.splitlines())
    return data


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(scenario=scenarios)
def test_every_answer_the_route_makes_is_read(rigs, probes, scenario):
    with built(scenario, rigs, probes) as pool:
        body = _server_route.payload_json()
        local = _status.collect(pool)
    data = read_as_the_client(body)
    # The local `status --json` is the same pool object.
    _status.POOL.check(local, "status", strict=True)
    # Workers are named by their name, else by their repr.
    expected = sorted(
        f"pack-{n}" if spec["named"] else "<FakeWorker"
        for n, spec in enumerate(scenario["workers"])
        if spec["models"] or spec["state"] == "restarted")
    shown = sorted(w["worker"] if w["worker"].startswith("pack-")
                   else w["worker"][:len("<FakeWorker")]
                   for w in data["pool"]["workers"])
    assert shown == expected


def test_every_state_at_once(rigs, probes):
    """One scenario with every event on every board state, and every odd
    entry: each source and board status shows up in the answer, which
    the client reads."""
    boards = (None, "closed", "stale heartbeat", "torn", "dead owner",
              "wrong owner", "valid", "not attached")
    pairs = [(event, boards[j % len(boards)], True)
             for j, event in enumerate(EVENTS)]
    assert set(boards[1:]) == {"closed", *BOARD_STATES}
    scenario = {
        "impl": "c", "comfyui": "present", "odd": list(ODD),
        "probe": "two devices", "readings": True, "reserve": 400 << 20,
        "workers": [
            {"named": True, "pid": 777, "state": state,
             "models": pairs[PER_BOARD * k:PER_BOARD * (k + 1)]}
            for k, state in enumerate(["alive", "in flight", "launcher"])
        ] + [{"named": False, "pid": None, "state": "gone",
              "models": [("census", None, True)]},
             {"named": True, "pid": None, "state": "restarted",
              "models": [("registered", None, False)]}],
    }
    with built(scenario, rigs, probes):
        body = _server_route.payload_json()
    data = read_as_the_client(body)
    models = [m for w in data["pool"]["workers"] for m in w["models"]]
    sources = {m["source"] for m in models}
    assert sources >= {"registered", "load echo", "unload echo",
                       "detach echo", "census", "assigned", "board",
                       "worker gone"}, sources
    assert {m["board"]["status"] for m in models if m["board"]} >= set(
        BOARD_STATES) | {"board closed"}
    registered = [m for m in models if m["source"] == "registered"]
    assert registered and all(m["seq"] is None for m in registered)
    assert any(m["eviction_deferred"] for m in models)
    assert any(m["bad_replies"] for m in models)
    assert data["pool"]["graveyard"] > 0 and data["pool"]["held"] > 0
    (launched,) = [w for w in data["pool"]["workers"]
                   if w["launcher_pid"] == LAUNCHER_PID]
    assert launched["launcher_pid"] == LAUNCHER_PID
    assert launched["pid"] == rigs["valid"].worker.pid
    assert data["probe"]["devices"] and data["comfyui"]["available"]
    errors = [e for e in data["comfyui"]["models"] if "error" in e]
    assert len(errors) == 2  # "raises" and "odd device"


def test_the_hand_written_answer_is_one_the_schema_admits():
    """tests/test_status_url.py's good_answer() (the client property
    tests mutate it) is an answer of the schema, strictly."""
    _status.check_answer(good_answer(), strict=True)


def test_strict_refuses_a_field_the_schema_does_not_name():
    answer = good_answer()
    answer["pool"]["workers"][0]["models"][0]["extra"] = 1
    _status.check_answer(answer)  # the client lets it through
    with pytest.raises(_status.RemoteError,
                       match=r"models\[0\]\.extra is not in the schema"):
        _status.check_answer(answer, strict=True)


def test_one_of_pool_and_pool_error():
    answer = good_answer()
    answer["pool_error"] = "ZeroDivisionError: division by zero"
    with pytest.raises(_status.RemoteError, match="one of pool or "
                                                  "pool_error"):
        _status.check_answer(answer)
    del answer["pool"]
    _status.check_answer(answer, strict=True)
    text = _status.render_remote(answer, "http://127.0.0.1:8188")
    assert ("the pool could not be read in ComfyUI's process: "
            "ZeroDivisionError" in text)


def test_the_route_refuses_to_send_a_non_finite_number(monkeypatch):
    """A NaN or an infinity has no JSON form: payload_json names where
    it is instead of writing a bare Infinity."""
    real = _server_route.payload

    def odd():
        answer = real()
        answer["pool"]["workers"] = [{"age": float("inf")}]
        return answer

    monkeypatch.setattr(_server_route, "payload", odd)
    with pytest.raises(NotJSON, match=r"pool\.workers\[0\]\.age \(inf\) "
                                      r"is not a finite number"):
        _server_route.payload_json()


def test_the_client_refuses_a_number_too_large_for_a_float():
    """1e999 is a JSON number that parses to an infinity: refused as not
    JSON, where it is, before --json could print a bare Infinity."""
    answer = json.dumps(good_answer())
    body = answer.replace('"age_seconds": 0.5', '"age_seconds": 1e999')
    assert body != answer
    with pytest.raises(_status.RemoteError,
                       match=r"not JSON \(1e999 is not a finite number"):
        _status.parse_answer(body.encode(), "x")
    unchecked = answer.replace('"elapsed_ns": ', '"extra": 1e999, '
                               '"elapsed_ns": ')
    with pytest.raises(_status.RemoteError, match="1e999"):
        _status.parse_answer(unchecked.encode(), "x")
