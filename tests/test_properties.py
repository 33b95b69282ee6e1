"""Property tests (hypothesis): random histories of registrations, echoes,
censuses (valid and not), reports, assignments (of
``model_loaded_weight_memory`` and ``device``), gone/restart and calls.

- Invariants, per implementation, after every step: 0 <= loaded <= size;
  a seq never goes backwards except by an echo (a reply is the newest
  word); a rejected input changes nothing; the reserve follows its rule
  (never shrinks without a release, never exceeds the cap when the base
  is under it).
- Differential: the same history on the C implementation and on the
  reference gives the same observables after every step.
- Decoders: any census, report or command reply is either applied or
  rejected with EchoError, never anything else, and a rejection changes
  nothing.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FLOOR = 1000
MAX = 2**63 - 1
SATURATED = 2**64 - 1
IDS = ("a", "b", "c")
SIZES = (0, 100, 1000)
WORKERS = 2

# Modest by default so the suite stays fast; raise it for a soak run:
# COMFY_STANDIN_EXAMPLES=5000 pytest tests/test_properties.py
SETTINGS = settings(
    max_examples=int(os.environ.get("COMFY_STANDIN_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<Worker {self.name}>"

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        return {}

    def is_alive(self) -> bool:
        return True


# ---- strategies -------------------------------------------------------------

BAD_VALUES = (-1, 2**63, True, None, 1.5, "7", math.nan)
byte_ish = st.one_of(
    st.integers(0, 1200),
    st.integers(0, 1200),
    st.integers(0, 1200),
    st.sampled_from(BAD_VALUES),
)
seq_ish = st.one_of(
    st.none(),
    st.integers(0, 30),
    st.integers(0, 30),
    st.sampled_from((-1, True, 2.0, 2**63)),
)
worker_index = st.integers(0, WORKERS - 1)
standin_index = st.integers(0, 40)

census_entry = st.tuples(
    standin_index,
    byte_ish,
    seq_ish,
    st.sampled_from(("ok", "ok", "ok", "no seq", "unknown", "junk")),
)
report_entry = st.tuples(st.sampled_from((*IDS, "zz")), byte_ish, seq_ish)

operation = st.one_of(
    st.tuples(
        st.just("register"),
        worker_index,
        st.integers(1, 3),
        st.sampled_from(IDS),
        st.sampled_from(SIZES),
    ),
    st.tuples(
        st.just("echo"),
        standin_index,
        byte_ish,
        seq_ish,
        st.booleans(),
        st.booleans(),
    ),
    st.tuples(st.just("census"), st.lists(census_entry, max_size=4)),
    st.tuples(
        st.just("report"),
        worker_index,
        st.one_of(st.none(), byte_ish),
        st.one_of(st.none(), st.lists(report_entry, max_size=3)),
    ),
    st.tuples(st.just("gone"), worker_index),
    st.tuples(st.just("restart"), worker_index, st.integers(0, 4)),
    st.tuples(st.just("begin"), worker_index),
    st.tuples(st.just("end"), worker_index),
    st.tuples(
        st.just("reserve"),
        st.integers(0, 5000),
        st.sampled_from((0, 2000, 4000, 10**6)),
    ),
    st.tuples(st.just("assign"), standin_index, st.integers(0, 1200)),
    st.tuples(st.just("device"), standin_index,
              st.sampled_from(("cuda:1", "cpu", "mps"))),
    st.tuples(st.just("reading"), worker_index, st.integers(0, 5000)),
)
history = st.lists(operation, max_size=30)


# ---- the harness ------------------------------------------------------------


class Harness:
    """One implementation driven through a history."""

    def __init__(self, impl: Any) -> None:
        self.impl = impl
        self.pool = impl.Pool(floor=FLOOR, process_local=True)
        self.workers = [Worker(f"w{i}") for i in range(WORKERS)]
        # Held strongly: a model nobody holds would leave its table.
        self.standins: list[Any] = []

    def books(self, index: int) -> Any:
        return self.pool._ledger.find(self.workers[index])

    def pick(self, index: int) -> Any:
        return self.standins[index % len(self.standins)]

    def run(self, op: tuple) -> tuple:
        """('ok', result) or ('error', class name, field path)."""
        try:
            return ("ok", self._run(op))
        except (ValueError, TypeError, RuntimeError) as exc:
            path = ""
            if isinstance(exc, self.impl.EchoError):
                path = str(exc).split(": ", 1)[0]
            return ("error", type(exc).__name__, path)

    def _run(self, op: tuple) -> Any:
        kind, *args = op
        impl, pool = self.impl, self.pool
        if kind == "register":
            w, generation, model_id, size = args
            s = impl.StandIn(
                self.workers[w],
                generation,
                model_id,
                size,
                "cuda:0",
                "cpu",
                pool=pool,
            )
            self.standins.append(s)
            return len(self.standins) - 1
        if kind == "echo":
            index, resident, seq, unmapped, in_flight = args
            if not self.standins:
                return None
            return impl.apply_echo(
                self.pick(index),
                resident,
                seq=seq,
                unmapped=unmapped,
                in_flight=in_flight,
            )
        if kind == "census":
            standins: dict[str, Any] = {}
            census: list[Any] = []
            for index, resident, seq, mode in args[0]:
                if mode == "junk":
                    census.append(["not", "a", "mapping"])
                    continue
                if mode == "unknown" or not self.standins:
                    model_id = "zz"
                else:
                    s = self.pick(index)
                    model_id = s.model_id
                    standins[model_id] = s
                entry = {"id": model_id, "resident": resident}
                if mode != "no seq":
                    entry["seq"] = seq
                census.append(entry)
            return impl.apply_residency(standins, census)
        if kind == "report":
            w, held, entries = args
            report: dict[str, Any] = {}
            if held is not None:
                report["held"] = held
            if entries is not None:
                report["residency"] = [
                    {"id": i, "resident": r, "seq": q} for i, r, q in entries
                ]
            return pool.report(self.workers[w], report)
        if kind == "gone":
            return pool.worker_gone(self.workers[args[0]])
        if kind == "restart":
            return pool.restarted(self.workers[args[0]], args[1])
        if kind == "begin":
            return pool.begin_call(self.workers[args[0]])
        if kind == "end":
            return pool.end_call(self.workers[args[0]])
        if kind == "reserve":
            return pool.reserve(None, args[0], args[1])
        if kind == "assign":
            if not self.standins:
                return None
            self.pick(args[0]).model_loaded_weight_memory = args[1]
            return None
        if kind == "device":
            if not self.standins:
                return None
            self.pick(args[0]).device = args[1]
            return None
        if kind == "reading":
            books = self.books(args[0])
            return None if books is None else books.set_reading(args[1])
        raise AssertionError(kind)

    def observe(self) -> tuple:
        """Every observable but receipt ages."""
        standins = []
        for s in self.standins:
            loaded, seq, _age, source = s.receipt()
            standins.append(
                (
                    s.loaded_size(),
                    loaded,
                    seq,
                    source,
                    s.stale,
                    s.eviction_deferred,
                    s.device,
                    s.model_loaded_weight_memory,
                    s.size,
                )
            )
        books = []
        for index in range(WORKERS):
            b = self.books(index)
            books.append(
                None
                if b is None
                else (b.generation, b.alive, b.in_flight, b.charge())
            )
        charges = self.pool.worker_charges()
        return (
            tuple(standins),
            tuple(books),
            tuple(charges.get(w) for w in self.workers),
            self.pool._ledger.total_charge(),
        )


def _seq(value: int | None) -> int:
    return -1 if value is None else value


def released(before: tuple, after: tuple) -> bool:
    """Did a release (docs/semantics.md) happen between two observations?
    A lowered receipt, a lowered held or reading, a gone worker or a
    restart."""
    for old, new in zip(before[0], after[0], strict=False):
        if new[1] < old[1]:
            return True
    for old, new in zip(before[1], after[1], strict=False):
        if old is None or new is None:
            continue
        if new[0] > old[0] or (old[1] and not new[1]):
            return True
        if new[1] and new[3]["held"] < old[3]["held"]:
            return True
        if new[1] and new[3]["reading"] < old[3]["reading"]:
            return True
    return False


def check_history(impl: Any, ops: list[tuple]) -> None:
    h = Harness(impl)
    last_reserve: int | None = None
    release_since = False
    for op in ops:
        before = h.observe()
        expected_reserve = None
        if op[0] == "reserve":
            base, total = op[1], op[2]
            target = min(base + before[3], SATURATED)
            if total > 0:
                target = min(target, total * 3 // 4)
            target = max(target, base)
            if last_reserve is None or target >= last_reserve or release_since:
                expected_reserve = target
            else:
                expected_reserve = last_reserve
            if total > 0:  # the cap holds for a kept value too
                expected_reserve = max(
                    min(expected_reserve, total * 3 // 4), base
                )
        outcome = h.run(op)
        after = h.observe()
        if outcome[0] == "error":
            assert after == before, (op, outcome)
            continue
        release_since = release_since or released(before, after)
        for s, row in zip(h.standins, after[0], strict=False):
            loaded_size, loaded = row[0], row[1]
            assert 0 <= loaded_size <= s.size
            assert 0 <= loaded <= s.size
            if row[4]:
                assert loaded_size == 0
        if op[0] not in ("echo",):
            for old, new in zip(before[0], after[0], strict=False):
                assert _seq(new[2]) >= _seq(old[2]), (op, old, new)
        if op[0] == "reserve":
            result = outcome[1]
            assert result == expected_reserve, (op, before, result)
            base, total = op[1], op[2]
            assert result >= base
            if total > 0 and base <= total * 3 // 4:
                assert result <= total * 3 // 4
            last_reserve = result
            release_since = False
        for row in after[1]:
            if row is not None and not row[1]:
                assert row[3]["charge"] == 0


# ---- the tests --------------------------------------------------------------


@SETTINGS
@given(ops=history)
def test_invariants_hold_over_any_history(impl, ops):
    check_history(impl, ops)


@SETTINGS
@given(ops=history)
def test_c_and_reference_agree(both_impls, ops):
    c, ref = both_impls
    hc, hr = Harness(c), Harness(ref)
    assert hc.observe() == hr.observe()
    for step, op in enumerate(ops):
        assert hc.run(op) == hr.run(op), (step, op)
        assert hc.observe() == hr.observe(), (step, op)


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.binary(max_size=2),
)
json_value = st.recursive(
    json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
    ),
    max_leaves=8,
)
near_entry = st.fixed_dictionaries(
    {
        "id": st.one_of(
            st.sampled_from(("m0", "m1", "m2", "zz", "")), json_leaf
        ),
        "resident": st.one_of(st.integers(0, 5000), json_value),
    },
    optional={
        "seq": st.one_of(st.none(), st.integers(0, 100), json_value),
        "device": st.one_of(st.none(), st.just("cuda:0"), json_value),
    },
)
any_census = st.one_of(
    st.lists(
        st.one_of(near_entry, near_entry, near_entry, json_value), max_size=4
    ),
    st.lists(near_entry, max_size=4).map(tuple),
    json_value,
)


def three_standins(impl: Any) -> tuple[Any, dict[str, Any], Any]:
    pool = impl.Pool(floor=FLOOR, process_local=True)
    w = Worker("w")
    standins = {
        f"m{i}": impl.StandIn(w, 1, f"m{i}", 1000, "cuda:0", "cpu", pool=pool)
        for i in range(3)
    }
    for i, s in enumerate(standins.values()):
        impl.apply_echo(s, 100 * i, seq=10 * i)
    return pool, standins, w


def snapshot(pool: Any, standins: dict[str, Any], w: Any) -> tuple:
    rows = []
    for s in standins.values():
        loaded, seq, _age, source = s.receipt()
        rows.append((loaded, seq, source, s.eviction_deferred))
    return tuple(rows), pool._ledger.find(w).charge()


@SETTINGS
@given(census=any_census)
def test_any_census_applies_or_changes_nothing(impl, census):
    pool, standins, w = three_standins(impl)
    before = snapshot(pool, standins, w)
    try:
        applied = impl.apply_residency(standins, census)
    except impl.EchoError:
        assert snapshot(pool, standins, w) == before
        return
    assert isinstance(census, (list, tuple))
    assert 0 <= applied <= len(census)
    for s in standins.values():
        assert 0 <= s.loaded_size() <= s.size


@SETTINGS
@given(
    report=st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "held": st.one_of(st.integers(0, 10**6), json_value),
                "pinned": st.one_of(st.integers(0, 10**6), json_value),
                "overhead": st.one_of(st.integers(0, 10**6), json_value),
                "residency": any_census,
            },
        ),
        json_value,
    )
)
def test_any_report_applies_or_changes_nothing(impl, report):
    pool, standins, w = three_standins(impl)
    before = snapshot(pool, standins, w)
    try:
        applied = pool.report(w, report)
    except impl.EchoError:
        assert snapshot(pool, standins, w) == before
        return
    assert isinstance(applied, int) and applied >= 0
    held = report.get("held")
    if held is not None:
        assert pool._ledger.find(w).charge()["held"] == held


class ScriptedWorker(Worker):
    def __init__(self, reply: Any) -> None:
        super().__init__("scripted")
        self.reply = reply

    def send_command(self, command: str, **kwargs: Any) -> Any:
        return self.reply


reply_value = st.one_of(st.integers(0, 1500), json_value)
any_reply = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "freed": reply_value,
            "loaded": reply_value,
            "resident": reply_value,
            "seq": st.one_of(st.integers(0, 100), json_value),
        },
    ),
    json_value,
)


def _written(
    before: tuple[int, int], moved: bool, resident: Any, derived: int,
    seq: Any,
) -> tuple[int, int | None] | None:
    """What a good reply writes over a receipt (loaded, seq) = `before`
    (docs/semantics.md, "Which word wins"), or None when it writes
    nothing: one that moved something writes its resident figure (the
    worker's, or `derived` when it sent none); one that moved nothing
    writes only a measured figure above 0; an older seq writes nothing."""
    figure = derived if resident is None else resident
    if not (moved or (resident is not None and resident > 0)):
        return None
    if seq is not None and seq < before[1]:
        return None
    return figure, before[1] if seq is None else seq


@SETTINGS
@given(reply=any_reply, ask=st.one_of(st.integers(-5, 2000), st.floats()))
def test_any_unload_reply_never_raises(impl, reply, ask):
    pool = impl.Pool(floor=FLOOR, process_local=True)
    s = impl.StandIn(
        ScriptedWorker(reply), 1, "m", 1000, "cuda:0", "cpu", pool=pool
    )
    impl.apply_echo(s, 600, seq=4)
    freed = s.partially_unload("cpu", ask)
    loaded, seq, _age, source = s.receipt()
    if s.bad_replies:
        assert freed == 0
        assert (loaded, seq, source) == (600, 4, "load echo")
        assert s.eviction_deferred
    else:
        assert freed == reply["freed"]
        written = _written((600, 4), freed > 0, reply.get("resident"),
                           max(0, 600 - freed), reply.get("seq"))
        if written is None:
            assert (loaded, seq, source) == (600, 4, "load echo")
        else:
            assert (loaded, seq, source) == (*written, "unload echo")
        assert not s.eviction_deferred
    assert 0 <= s.loaded_size() <= s.size


@SETTINGS
@given(reply=any_reply)
def test_any_load_reply_applies_or_raises_echo_error(impl, reply):
    pool = impl.Pool(floor=FLOOR, process_local=True)
    s = impl.StandIn(
        ScriptedWorker(reply), 1, "m", 1000, "cuda:0", "cpu", pool=pool
    )
    impl.apply_echo(s, 600, seq=4)
    try:
        loaded = s.partially_load("cuda:0")
    except impl.EchoError:
        assert s.bad_replies == 1
        assert s.receipt()[3] == "load echo" and s.loaded_size() == 600
        return
    assert loaded == reply["loaded"]
    written = _written((600, 4), loaded > 0, reply.get("resident"),
                       min(600 + loaded, 1000), reply.get("seq"))
    assert s.receipt()[:2] == ((600, 4) if written is None else written)


def test_harness_detects_a_broken_implementation(impl):
    """The invariant checker must be able to fail: a reserve that ignores
    the release rule is caught."""

    class Broken:
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            return getattr(self._real, name)

        def Pool(self, *args, **kwargs):
            pool = self._real.Pool(*args, **kwargs)
            pool.reserve = lambda device, base, total=None: base
            return pool

    ops = [
        ("register", 0, 1, "a", 1000),
        ("echo", 0, 500, 1, False, False),
        ("reserve", 0, 0),
    ]
    check_history(impl, ops)
    with pytest.raises(AssertionError):
        check_history(Broken(impl), ops)
