"""State sync: apply_echo, apply_residency and pool.report
(docs/semantics.md "Receipts")."""

from __future__ import annotations

import math
import re

import pytest

MAX = 2**63 - 1
SIZE = 1000
FLOOR = 300 << 20


def naming(field: str, value: object) -> str:
    return f"(?s){re.escape(field)}.*{re.escape(repr(value))}"


def receipt(s):
    loaded, seq, _, source = s.receipt()
    return loaded, seq, source


@pytest.fixture
def trio(impl, pool, make_worker):
    """Three stand-ins ("m0", "m1", "m2") of one worker, with receipts."""
    w = make_worker()
    standins = {
        f"m{i}": impl.StandIn(w, 1, f"m{i}", SIZE, "cuda:0", "cpu", pool=pool)
        for i in range(3)
    }
    for i, s in enumerate(standins.values()):
        impl.apply_echo(s, 100 * (i + 1), seq=10)
    return standins


def snapshot(pool, standins):
    """Every observable a sync could change."""
    books = pool._ledger.find(next(iter(standins.values())).worker)
    return (
        [
            (receipt(s), s.eviction_deferred, s.stale, s.device)
            for s in standins.values()
        ],
        books.charge(),
    )


# ---- apply_echo -------------------------------------------------------------


def test_an_echo_older_than_the_receipt_writes_nothing(impl, make_standin):
    """Two threads' replies may be applied out of order: an echo whose seq
    is strictly older than the receipt's writes nothing (the newer one is
    written already).  A tie writes; no seq (an older worker) writes and
    keeps the receipt's seq; a receipt with no seq takes any."""
    s = make_standin(size=SIZE)
    assert impl.apply_echo(s, 500, seq=9) is True
    assert receipt(s) == (500, 9, "load echo")
    assert impl.apply_echo(s, 400, seq=2) is False
    assert receipt(s) == (500, 9, "load echo")
    assert impl.apply_echo(s, 0, seq=8, unmapped=True) is False
    assert receipt(s) == (500, 9, "load echo")
    assert impl.apply_echo(s, 400, seq=9) is True
    assert receipt(s) == (400, 9, "unload echo")
    assert impl.apply_echo(s, 450) is True
    assert receipt(s) == (450, 9, "load echo")
    assert impl.apply_echo(s, 0, unmapped=True) is True
    assert receipt(s) == (0, 9, "detach echo")
    assert impl.apply_echo(s, SIZE, seq=MAX) is True
    assert receipt(s) == (SIZE, MAX, "load echo")
    fresh = make_standin(size=SIZE)
    assert impl.apply_echo(fresh, 300, seq=0, unmapped=True) is True
    assert receipt(fresh) == (300, 0, "detach echo")


def test_echo_peak(impl, pool, make_standin):
    s = make_standin(size=SIZE)
    books = pool._ledger.find(s.worker)
    impl.apply_echo(s, 600, in_flight=True)
    impl.apply_echo(s, 100, in_flight=True)
    assert books.charge()["sum_peak"] == 600
    impl.apply_echo(s, 800, in_flight=True)
    assert books.charge()["sum_peak"] == 800
    impl.apply_echo(s, 200)
    assert books.charge()["sum_peak"] == 200
    impl.apply_echo(s, 700, in_flight=True, unmapped=True)
    assert books.charge()["sum_peak"] == 0
    assert receipt(s) == (700, None, "detach echo")


def test_echo_clears_eviction_deferred(impl, pool, make_worker):
    class Refusing:
        def send_command(self, command, **kwargs):
            raise TimeoutError("busy")

        def is_alive(self):
            return True

    s = impl.StandIn(Refusing(), 1, "m", SIZE, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, 500)
    assert s.partially_unload("cpu", 100) == 0
    assert s.eviction_deferred is True
    impl.apply_echo(s, 500)
    assert s.eviction_deferred is False
    assert s.partially_unload("cpu", 100) == 0
    assert s.eviction_deferred is True
    impl.apply_residency({"m": s}, [{"id": "m", "resident": 400}])
    assert s.eviction_deferred is False


@pytest.mark.parametrize(
    "value",
    [-1, SIZE + 1, MAX, 2**63, 2**64, True, False, 1.0, math.nan, "1", None],
)
def test_echo_rejects_resident(impl, make_standin, value):
    s = make_standin(size=SIZE)
    impl.apply_echo(s, 10, seq=3)
    with pytest.raises(impl.EchoError, match=naming("resident", value)):
        impl.apply_echo(s, value, seq=4)
    assert receipt(s) == (10, 3, "load echo")


@pytest.mark.parametrize("value", [-1, 2**63, True, 1.0, "1", math.inf])
def test_echo_rejects_seq(impl, make_standin, value):
    s = make_standin(size=SIZE)
    impl.apply_echo(s, 10, seq=3)
    with pytest.raises(impl.EchoError, match=naming("seq", value)):
        impl.apply_echo(s, 20, seq=value)
    assert receipt(s) == (10, 3, "load echo")


def test_echo_error_is_a_value_error(impl):
    assert issubclass(impl.EchoError, ValueError)
    assert issubclass(impl.WorkerGoneError, RuntimeError)


@pytest.mark.parametrize("target", [None, object(), "m"])
def test_echo_needs_a_standin(impl, target):
    with pytest.raises(TypeError):
        impl.apply_echo(target, 10)


def test_echo_on_the_other_implementation(both_impls, make_worker):
    c, ref = both_impls
    a = c.StandIn(make_worker(), 1, "m", 10, "x", "y", pool=c.Pool())
    b = ref.StandIn(make_worker(), 1, "m", 10, "x", "y", pool=ref.Pool())
    with pytest.raises(TypeError):
        ref.apply_echo(a, 5)
    with pytest.raises(TypeError):
        c.apply_echo(b, 5)
    with pytest.raises(c.EchoError, match="standins"):
        c.apply_residency({"m": b}, [{"id": "m", "resident": 1}])
    with pytest.raises(ref.EchoError, match="standins"):
        ref.apply_residency({"m": a}, [{"id": "m", "resident": 1}])
    assert a.loaded_size() == 0 and b.loaded_size() == 0


@pytest.mark.parametrize("how", ["gone", "restarted"])
def test_echo_on_stale_or_gone_writes_nothing(impl, pool, make_standin, how):
    s = make_standin(size=SIZE)
    impl.apply_echo(s, 10, seq=3)
    if how == "gone":
        pool.worker_gone(s.worker)
    else:
        pool.restarted(s.worker, 2)
    before = receipt(s)
    assert before == (0, 3, "worker gone")
    assert impl.apply_echo(s, 20, seq=4) is False
    assert impl.apply_echo(s, 0, unmapped=True) is False
    assert receipt(s) == before
    # Validation still comes first.
    with pytest.raises(impl.EchoError):
        impl.apply_echo(s, -1)


# ---- apply_residency: rules -------------------------------------------------


def test_census_replaces_receipts(impl, pool, trio):
    applied = impl.apply_residency(
        trio,
        [
            {"id": "m0", "seq": 11, "resident": 0, "device": "cpu"},
            {"id": "m2", "seq": 12, "resident": 999, "device": "cuda:0"},
        ],
    )
    assert applied == 2
    assert receipt(trio["m0"]) == (0, 11, "census")
    assert receipt(trio["m2"]) == (999, 12, "census")
    # Missing means unknown, not zero.
    assert receipt(trio["m1"]) == (200, 10, "load echo")
    assert trio["m0"].device == "cpu"
    assert trio["m2"].device == "cuda:0"
    books = pool._ledger.find(trio["m0"].worker)
    assert books.charge()["sum_loaded"] == 0 + 200 + 999


def test_census_tie_goes_to_the_census(impl, trio):
    assert impl.apply_residency(trio, [{"id": "m1", "seq": 10, "resident": 5}])
    assert receipt(trio["m1"]) == (5, 10, "census")


def test_census_strictly_older_is_dropped(impl, trio):
    applied = impl.apply_residency(
        trio,
        [
            {"id": "m0", "seq": 9, "resident": 5},
            {"id": "m1", "seq": 0, "resident": 6},
            {"id": "m2", "seq": 10, "resident": 7},
        ],
    )
    assert applied == 1
    assert receipt(trio["m0"]) == (100, 10, "load echo")
    assert receipt(trio["m1"]) == (200, 10, "load echo")
    assert receipt(trio["m2"]) == (7, 10, "census")


def test_census_without_seq_applies_and_keeps_seq(impl, trio):
    applied = impl.apply_residency(
        trio,
        [
            {"id": "m0", "resident": 50},
            {"id": "m1", "seq": None, "resident": 60},
        ],
    )
    assert applied == 2
    assert receipt(trio["m0"]) == (50, 10, "census")
    assert receipt(trio["m1"]) == (60, 10, "census")


def test_receipt_without_seq_is_older_than_every_seq(impl, make_standin):
    s = make_standin(size=SIZE)
    impl.apply_echo(s, 10)
    assert (
        impl.apply_residency(
            {s.model_id: s}, [{"id": s.model_id, "seq": 0, "resident": 3}]
        )
        == 1
    )
    assert receipt(s) == (3, 0, "census")


@pytest.mark.parametrize("value", [SIZE, SIZE + 1, 10**15, MAX])
def test_census_clamps_to_the_size(impl, trio, value):
    impl.apply_residency(trio, [{"id": "m0", "seq": 11, "resident": value}])
    assert receipt(trio["m0"]) == (SIZE, 11, "census")
    assert trio["m0"].loaded_size() == SIZE


def test_census_ignores_extra_keys(impl, trio):
    entry = {
        "id": "m0",
        "seq": 11,
        "resident": 1,
        "device": None,
        "dtype": "bf16",
        "extra": object(),
    }
    assert impl.apply_residency(trio, (entry,)) == 1
    assert receipt(trio["m0"]) == (1, 11, "census")


def test_census_seq_never_goes_backwards(impl, trio):
    for seq, value in [(20, 1), (15, 2), (20, 3), (19, 4), (21, 5)]:
        impl.apply_residency(
            trio, [{"id": "m0", "seq": seq, "resident": value}]
        )
    assert receipt(trio["m0"]) == (5, 21, "census")


def test_empty_census(impl, pool, trio):
    before = snapshot(pool, trio)
    assert impl.apply_residency(trio, []) == 0
    assert impl.apply_residency(trio, ()) == 0
    assert impl.apply_residency({}, []) == 0
    assert snapshot(pool, trio) == before


def test_census_peak_follows_in_flight(impl, pool, trio):
    w = trio["m0"].worker
    books = pool._ledger.find(w)
    with pool.call(w):
        impl.apply_residency(trio, [{"id": "m0", "seq": 11, "resident": 900}])
        impl.apply_residency(trio, [{"id": "m0", "seq": 12, "resident": 50}])
        assert books.charge()["sum_peak"] == 900 + 200 + 300
    impl.apply_residency(trio, [{"id": "m0", "seq": 13, "resident": 40}])
    assert books.charge()["sum_peak"] == 40 + 200 + 300


def test_census_skips_stale_and_gone(impl, pool, make_worker):
    w1, w2 = make_worker(), make_worker()
    old = impl.StandIn(w1, 1, "a", SIZE, "cuda:0", "cpu", pool=pool)
    dead = impl.StandIn(w2, 1, "b", SIZE, "cuda:0", "cpu", pool=pool)
    pool.restarted(w1, 2)
    pool.worker_gone(w2)
    new = impl.StandIn(w1, 2, "c", SIZE, "cuda:0", "cpu", pool=pool)
    census = [
        {"id": "a", "seq": 1, "resident": 10},
        {"id": "b", "seq": 1, "resident": 20},
        {"id": "c", "seq": 1, "resident": 30},
    ]
    assert impl.apply_residency({"a": old, "b": dead, "c": new}, census) == 1
    assert receipt(old) == (0, None, "worker gone")
    assert receipt(dead) == (0, None, "worker gone")
    assert receipt(new) == (30, 1, "census")


# ---- apply_residency: all or nothing ----------------------------------------


BAD_ENTRIES = [
    ("not a mapping", None, "", None),
    ("not a mapping", 5, "", 5),
    ("not a mapping", "m0", "", "m0"),
    ("not a mapping", ["m0", 5], "", ["m0", 5]),
    ("missing id", {"resident": 5}, "['id']", None),
    ("id", {"id": 5, "resident": 5}, "['id']", 5),
    ("id", {"id": None, "resident": 5}, "['id']", None),
    ("id", {"id": b"m0", "resident": 5}, "['id']", b"m0"),
    ("id", {"id": "", "resident": 5}, "['id']", ""),
    ("missing resident", {"id": "new"}, "['resident']", None),
    ("resident", {"id": "new", "resident": -1}, "['resident']", -1),
    ("resident", {"id": "new", "resident": True}, "['resident']", True),
    ("resident", {"id": "new", "resident": 1.5}, "['resident']", 1.5),
    (
        "resident",
        {"id": "new", "resident": math.nan},
        "['resident']",
        math.nan,
    ),
    ("resident", {"id": "new", "resident": "1"}, "['resident']", "1"),
    ("resident", {"id": "new", "resident": None}, "['resident']", None),
    ("resident", {"id": "new", "resident": 2**63}, "['resident']", 2**63),
    ("seq", {"id": "new", "resident": 1, "seq": -1}, "['seq']", -1),
    ("seq", {"id": "new", "resident": 1, "seq": True}, "['seq']", True),
    ("seq", {"id": "new", "resident": 1, "seq": 2.0}, "['seq']", 2.0),
    ("seq", {"id": "new", "resident": 1, "seq": "2"}, "['seq']", "2"),
    ("seq", {"id": "new", "resident": 1, "seq": 2**63}, "['seq']", 2**63),
    ("device", {"id": "new", "resident": 1, "device": 0}, "['device']", 0),
    (
        "device",
        {"id": "new", "resident": 1, "device": b"cpu"},
        "['device']",
        b"cpu",
    ),
    ("unknown", {"id": "nobody", "resident": 1}, "['id']", "nobody"),
]


def good_census():
    return [
        {"id": "m0", "seq": 50, "resident": 1},
        {"id": "m1", "seq": 50, "resident": 2},
        {"id": "m2", "seq": 50, "resident": 3},
    ]


@pytest.mark.parametrize("position", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "what, entry, field, value",
    BAD_ENTRIES,
    ids=[f"{i}-{case[0]}" for i, case in enumerate(BAD_ENTRIES)],
)
def test_bad_entry_rejects_the_whole_census(
    impl, pool, trio, position, what, entry, field, value
):
    census = good_census()
    if isinstance(entry, dict) and entry.get("id") == "new":
        # A valid id (the one this position replaces) with a bad field.
        entry = dict(entry, id=f"m{position % 3}")
        del census[position % 3]
        position = min(position, len(census))
    census.insert(position, entry)
    before = snapshot(pool, trio)
    path = f"census[{position}]{field}"
    pattern = (
        re.escape(path)
        if value is None and what.startswith("missing")
        else naming(path, value)
    )
    with pytest.raises(impl.EchoError, match=pattern):
        impl.apply_residency(trio, census)
    assert snapshot(pool, trio) == before


@pytest.mark.parametrize("position", [1, 2, 3])
def test_duplicate_id_rejects_the_whole_census(impl, pool, trio, position):
    census = good_census()
    census.insert(position, {"id": "m0", "seq": 60, "resident": 9})
    before = snapshot(pool, trio)
    with pytest.raises(
        impl.EchoError, match=naming(f"census[{position}]['id']", "m0")
    ):
        impl.apply_residency(trio, census)
    assert snapshot(pool, trio) == before


@pytest.mark.parametrize(
    "census",
    [
        None,
        "census",
        b"census",
        5,
        {"id": "m0", "resident": 1},
        {"m0": 1},
        {1, 2},
        iter([{"id": "m0", "resident": 1}]),
        bytearray(b"x"),
    ],
    ids=repr,
)
def test_census_container_types(impl, pool, trio, census):
    before = snapshot(pool, trio)
    with pytest.raises(impl.EchoError, match="census"):
        impl.apply_residency(trio, census)
    assert snapshot(pool, trio) == before


def test_standins_map_is_checked(impl, pool, trio):
    before = snapshot(pool, trio)
    census = [{"id": "m0", "resident": 1}]
    with pytest.raises(impl.EchoError, match=re.escape("'bogus'")):
        impl.apply_residency({**trio, "bogus": object()}, census)
    with pytest.raises(impl.EchoError, match=re.escape("'m1'")):
        impl.apply_residency({"m0": trio["m0"], "m1": trio["m2"]}, census)
    with pytest.raises(impl.EchoError, match=re.escape("'m0'")):
        impl.apply_residency({"m0": None}, census)
    with pytest.raises(impl.EchoError, match=re.escape("'m2'")):
        impl.apply_residency(
            {"m0": trio["m0"]}, [*census, {"id": "m2", "resident": 1}]
        )
    assert snapshot(pool, trio) == before


@pytest.mark.parametrize("standins", [None, [], "m0", 5])
def test_standins_must_be_a_mapping(impl, pool, trio, standins):
    before = snapshot(pool, trio)
    with pytest.raises(TypeError, match="standins"):
        impl.apply_residency(standins, [{"id": "m0", "resident": 1}])
    assert snapshot(pool, trio) == before


# ---- pool.report ------------------------------------------------------------


def test_report_applies_census_and_figures(impl, pool, trio):
    w = trio["m0"].worker
    applied = pool.report(
        w,
        {
            "held": 5000,
            "pinned": 7,
            "overhead": 8,
            "residency": [
                {"id": "m0", "seq": 11, "resident": 10, "device": "cuda:0"},
                {"id": "m1", "seq": 3, "resident": 20, "device": "cuda:0"},
            ],
            "future_field": {"ignored": True},
        },
    )
    assert applied == 1
    assert receipt(trio["m0"]) == (10, 11, "census")
    assert receipt(trio["m1"]) == (200, 10, "load echo")
    charge = pool._ledger.find(w).charge()
    assert charge["held"] == 5000
    assert charge["charge"] == 5000 + FLOOR
    assert pool.worker_charges()[w] == 5000 + FLOOR


def test_report_partial(impl, pool, trio):
    w = trio["m0"].worker
    assert pool.report(w, {}) == 0
    assert pool.report(w, {"held": 100, "residency": None}) == 0
    assert pool._ledger.find(w).charge()["held"] == 100
    assert pool.report(w, {"residency": [{"id": "m2", "resident": 0}]}) == 1
    assert pool._ledger.find(w).charge()["held"] == 100
    assert receipt(trio["m2"]) == (0, 10, "census")


@pytest.mark.parametrize(
    "report, field, value",
    [
        ({"held": -1}, "held", -1),
        ({"held": True}, "held", True),
        ({"pinned": 1.5}, "pinned", 1.5),
        ({"overhead": "3"}, "overhead", "3"),
        ({"held": 2**63}, "held", 2**63),
        ({"residency": "m0"}, "census", "m0"),
        (
            {"residency": [{"id": "m0", "resident": -4}]},
            "census[0]['resident']",
            -4,
        ),
        (
            {"residency": [{"id": "zz", "resident": 4}]},
            "census[0]['id']",
            "zz",
        ),
    ],
)
def test_report_is_all_or_nothing(impl, pool, trio, report, field, value):
    w = trio["m0"].worker
    pool.report(w, {"held": 50})
    full = {
        "held": 999,
        "pinned": 1,
        "overhead": 1,
        "residency": [{"id": "m1", "seq": 99, "resident": 7}],
        **report,
    }
    before = snapshot(pool, trio)
    with pytest.raises(impl.EchoError, match=naming(field, value)):
        pool.report(w, full)
    assert snapshot(pool, trio) == before
    assert pool._ledger.find(w).charge()["held"] == 50


@pytest.mark.parametrize("report", [None, [], "held", 5])
def test_report_must_be_a_mapping(impl, pool, trio, report):
    with pytest.raises(impl.EchoError, match=re.escape(repr(report))):
        pool.report(trio["m0"].worker, report)


def test_report_from_an_unknown_worker(impl, pool, make_worker):
    stranger = make_worker("stranger")
    with pytest.raises(impl.EchoError, match="no stand-ins"):
        pool.report(stranger, {"held": 5})
    assert pool._ledger.find(stranger) is None


def test_report_on_a_gone_worker_applies_nothing(impl, pool, trio):
    w = trio["m0"].worker
    pool.worker_gone(w)
    assert (
        pool.report(
            w,
            {
                "held": 10,
                "residency": [{"id": "m0", "seq": 99, "resident": 5}],
            },
        )
        == 0
    )
    assert receipt(trio["m0"]) == (0, 10, "worker gone")
    assert pool.worker_charges()[w] == 0


# ---- raise_peak (comfy-env's peak-only pass) --------------------------------


def test_raise_peak_only_raises(impl, pool, make_standin):
    s = make_standin(size=1000)
    impl.apply_echo(s, 200, seq=1)
    writes = s.receipt()
    assert impl.raise_peak(s, 700) is True
    assert s._residency_peak == 700
    assert impl.raise_peak(s, 100) is True
    assert s._residency_peak == 700
    assert impl.raise_peak(s, 10**6) is True
    assert s._residency_peak == 1000  # clamped to the size
    assert s.receipt()[:2] == writes[:2]  # the receipt is untouched
    with pytest.raises(impl.EchoError, match="resident"):
        impl.raise_peak(s, -1)
    with pytest.raises(TypeError):
        impl.raise_peak(object(), 1)
    pool.worker_gone(s.worker)
    assert impl.raise_peak(s, 5) is False
    assert s._residency_peak == 0


def test_compat_views_follow_the_ledger(impl, make_standin):
    s = make_standin(size=1000, generation=3)
    assert (s._residency_seq, s._residency_peak) == (-1, 0)
    assert s._worker_generation == 3 and s._model_id == s.model_id
    assert s._worker is s.worker and s._kind == s.kind
    impl.apply_echo(s, 400, seq=9, in_flight=True)
    assert (s._residency_seq, s._residency_peak) == (9, 400)
    for name in ("_residency_peak", "_residency_seq", "_model_id"):
        with pytest.raises(AttributeError):
            setattr(s, name, 1)
