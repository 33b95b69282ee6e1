"""The ledger: workers' books, model registration, charges and the reserve
(docs/semantics.md, "The ledger"; docs/reserve.md)."""

from __future__ import annotations

import gc
import re

import pytest

FLOOR = 300 << 20
MAX = 2**63 - 1
SATURATED = 2**64 - 1


def naming(field: str, value: object) -> str:
    """A regex: the message names `field` and shows repr(`value`)."""
    return f"(?s){re.escape(field)}.*{re.escape(repr(value))}"


def receipt(s):
    loaded, seq, _age, source = s.receipt()
    return loaded, seq, source


# ---- the ledger object ----------------------------------------------------


def test_default_floor(impl):
    assert impl.Ledger().floor == FLOOR
    assert impl.Ledger(floor=123).floor == 123
    assert impl.Ledger(0).floor == 0


@pytest.mark.parametrize(
    "floor, exc",
    [
        (-1, ValueError),
        (2**63, ValueError),
        (2**80, ValueError),
        (True, TypeError),
        (1.0, TypeError),
        (None, TypeError),
        ("1", TypeError),
    ],
)
def test_bad_floor(impl, floor, exc):
    with pytest.raises(exc, match=naming("floor", floor)):
        impl.Ledger(floor)


def test_new_books_start_clean(impl, make_worker):
    ledger = impl.Ledger(floor=100)
    w = make_worker()
    books = ledger.worker(w, 3)
    assert books.generation == 3
    assert books.alive is True
    assert books.in_flight == 0
    assert books.charge() == {
        "charge": 100,
        "sum_sizes": 0,
        "sum_loaded": 0,
        "sum_peak": 0,
        "held": 0,
        "reading": 0,
        "floor": 100,
        "in_flight": 0,
        "models": 0,
        "alive": True,
        "held_from_reading": False,
    }


def test_worker_get_or_create_and_keys(impl, make_worker):
    ledger = impl.Ledger()
    a, b, c = make_worker(), make_worker(), make_worker()
    assert ledger.find(a) is None
    assert list(ledger.keys()) == []
    ledger.worker(b, 1)
    ledger.worker(a, 1)
    ledger.worker(c, 1)
    ledger.worker(b, 1)
    assert list(ledger.keys()) == [b, a, c]
    assert ledger.find(a) is not None
    assert ledger.find(make_worker()) is None


def test_workers_are_compared_by_identity(impl):
    class Equal:
        def __eq__(self, other):
            return True

        def __hash__(self):
            return 0

    ledger = impl.Ledger()
    first, second = Equal(), Equal()
    ledger.worker(first, 1).begin_call()
    ledger.worker(second, 1)
    assert ledger.find(first).in_flight == 1
    assert ledger.find(second).in_flight == 0
    keys = list(ledger.keys())
    assert len(keys) == 2
    assert keys[0] is first and keys[1] is second


def test_worker_with_newer_generation_restarts(impl, pool, make_standin):
    old = make_standin(generation=1)
    ledger = pool._ledger
    impl.apply_echo(old, 500, seq=4)
    books = ledger.worker(old.worker, 2)
    assert books.generation == 2
    assert old.stale
    assert receipt(old) == (0, 4, "worker gone")
    assert books.charge()["models"] == 0


def test_worker_with_older_generation_is_unchanged(impl, pool, make_standin):
    s = make_standin(generation=5)
    impl.apply_echo(s, 500, seq=4)
    books = pool._ledger.worker(s.worker, 2)
    assert books.generation == 5
    assert not s.stale
    assert receipt(s) == (500, 4, "load echo")
    assert books.charge()["models"] == 1


@pytest.mark.parametrize("generation", [-1, True, 1.5, None, 2**63])
def test_worker_bad_generation(impl, make_worker, generation):
    ledger = impl.Ledger()
    with pytest.raises(
        (TypeError, ValueError), match=naming("generation", generation)
    ):
        ledger.worker(make_worker(), generation)
    assert list(ledger.keys()) == []


def test_forget(impl, pool, make_standin):
    s = make_standin(size=1000)
    other = make_standin(size=10)
    impl.apply_echo(s, 700)
    ledger = pool._ledger
    total_before = ledger.total_charge()
    ledger.forget(s.worker)
    assert ledger.find(s.worker) is None
    assert s.worker not in list(ledger.keys())
    assert other.worker in list(ledger.keys())
    # It reads as it last did, but is no longer charged...
    assert receipt(s) == (700, None, "load echo")
    assert ledger.total_charge() == total_before - (700 + FLOOR)
    # ...nor reachable by census, even through new books of that worker.
    books = ledger.worker(s.worker, 1)
    with pytest.raises(impl.EchoError, match=re.escape(repr(s.model_id))):
        books.apply_census([{"id": s.model_id, "resident": 1}])
    assert receipt(s) == (700, None, "load echo")
    ledger.forget(object())  # unknown: nothing happens


# ---- registration ----------------------------------------------------------


def test_register_shares_one_record(impl, pool, make_worker, make_standin):
    w = make_worker()
    a = make_standin(worker=w, model_id="unet", size=1000)
    b = make_standin(worker=w, model_id="unet", size=1000)
    assert a is not b
    impl.apply_echo(a, 321, seq=9)
    assert receipt(b) == (321, 9, "load echo")
    charge = pool._ledger.find(w).charge()
    assert charge["models"] == 1
    assert charge["sum_sizes"] == 1000
    assert charge["sum_loaded"] == 321


def test_register_returns_the_same_record(impl, make_worker):
    ledger = impl.Ledger()
    books = ledger.worker(make_worker(), 1)
    first = books.register("unet", 1000, 1)
    second = books.register("unet", 1000, 1)
    assert books.charge()["models"] == 1
    third = books.register("vae", 10, 1)
    assert books.charge()["models"] == 2
    assert books.charge()["sum_sizes"] == 1010
    assert first is not None and second is not None and third is not None


def test_register_size_mismatch(impl, make_worker, make_standin):
    w = make_worker()
    ledger = impl.Ledger()
    books = ledger.worker(w, 1)
    record = books.register("unet", 1000, 1)
    with pytest.raises(ValueError, match="(?s)1000.*1001|1001.*1000"):
        books.register("unet", 1001, 1)
    assert books.charge()["sum_sizes"] == 1000
    del record
    s = make_standin(worker=w, model_id="clip", size=64)
    with pytest.raises(ValueError, match="(?s)64.*65|65.*64"):
        make_standin(worker=w, model_id="clip", size=65)
    assert s.size == 64


def test_same_id_other_generation_or_worker_is_another_model(
    impl, make_worker, make_standin
):
    w1, w2 = make_worker(), make_worker()
    a = make_standin(worker=w1, model_id="unet", size=1000)
    b = make_standin(worker=w2, model_id="unet", size=2000)
    impl.apply_echo(a, 10)
    assert b.loaded_size() == 0
    c = make_standin(worker=w1, generation=2, model_id="unet", size=3000)
    assert a.stale and not c.stale
    assert c.loaded_size() == 0 and c.size == 3000


def test_register_older_generation_is_stale(impl, pool, make_standin):
    current = make_standin(generation=4, model_id="unet")
    impl.apply_echo(current, 100, seq=1)
    old = make_standin(
        worker=current.worker, generation=3, model_id="unet", size=77
    )
    assert old.stale
    assert not current.stale
    assert receipt(old) == (0, None, "worker gone")
    assert impl.apply_echo(old, 50) is False
    assert receipt(old) == (0, None, "worker gone")
    # Outside the table: not charged, and the current one is untouched.
    charge = pool._ledger.find(current.worker).charge()
    assert charge["models"] == 1 and charge["sum_sizes"] == 1000
    assert receipt(current) == (100, 1, "load echo")


def test_register_newer_generation_bumps(impl, pool, make_standin):
    old = make_standin(generation=1, model_id="unet")
    impl.apply_echo(old, 600, seq=3)
    new = make_standin(worker=old.worker, generation=2, model_id="unet")
    assert old.stale and not new.stale
    assert receipt(old) == (0, 3, "worker gone")
    assert receipt(new) == (0, None, "registered")
    assert pool._ledger.find(old.worker).generation == 2


def test_register_on_a_gone_worker(impl, pool, make_standin):
    first = make_standin(generation=1, model_id="a")
    pool.worker_gone(first.worker)
    late = make_standin(worker=first.worker, generation=1, model_id="b")
    assert late.stale
    # The last write was the registration; it reads 0 because it is stale.
    assert receipt(late) == (0, None, "registered")
    assert impl.apply_echo(late, 5) is False
    assert late.loaded_size() == 0


def test_initial_receipt(make_standin):
    s = make_standin(size=1000)
    loaded, seq, age, source = s.receipt()
    assert (loaded, seq, source) == (0, None, "registered")
    assert 0 <= age < 3600


def test_unheld_model_leaves_the_table(impl, make_worker):
    ledger = impl.Ledger()
    books = ledger.worker(make_worker(), 1)
    record = books.register("unet", 1000, 1)
    assert books.charge()["models"] == 1
    del record
    assert books.charge()["models"] == 0


@pytest.mark.parametrize(
    "args, exc, field, value",
    [
        (("", 1, 1), ValueError, "model_id", ""),
        ((5, 1, 1), TypeError, "model_id", 5),
        (("m", -1, 1), ValueError, "size", -1),
        (("m", True, 1), TypeError, "size", True),
        (("m", 1.0, 1), TypeError, "size", 1.0),
        (("m", 1, -2), ValueError, "generation", -2),
    ],
)
def test_register_bad_arguments(impl, make_worker, args, exc, field, value):
    books = impl.Ledger().worker(make_worker(), 1)
    with pytest.raises(exc, match=naming(field, value)):
        books.register(*args)
    assert books.charge()["models"] == 0


# ---- bump and gone ---------------------------------------------------------


def test_bump(impl, pool, make_worker, make_standin):
    w = make_worker()
    a = make_standin(worker=w, model_id="a", size=1000)
    b = make_standin(worker=w, model_id="b", size=500)
    impl.apply_echo(a, 800, seq=5, in_flight=True)
    impl.apply_echo(b, 0, seq=6)
    books = pool._ledger.find(w)
    books.begin_call()
    books.set_report(held=4000, pinned=5, overhead=6)
    books.set_reading(9000)
    books.bump(2)
    assert books.generation == 2
    assert books.alive and books.in_flight == 0
    assert receipt(a) == (0, 5, "worker gone")
    assert receipt(b) == (0, 6, "worker gone")
    assert a.stale and b.stale
    charge = books.charge()
    assert charge["models"] == 0
    assert charge["sum_peak"] == 0
    assert (charge["held"], charge["reading"]) == (0, 0)
    assert charge["charge"] == FLOOR
    assert a.device == "cpu"


@pytest.mark.parametrize("generation", [1, 0])
def test_bump_must_grow(impl, pool, make_standin, generation):
    s = make_standin(generation=1)
    impl.apply_echo(s, 10, seq=1)
    books = pool._ledger.find(s.worker)
    with pytest.raises(ValueError, match=re.escape(repr(generation))):
        books.bump(generation)
    assert books.generation == 1
    assert not s.stale
    assert receipt(s) == (10, 1, "load echo")


def test_gone(impl, pool, make_worker, make_standin):
    w = make_worker()
    a = make_standin(worker=w, model_id="a")
    impl.apply_echo(a, 900, seq=2, in_flight=True)
    books = pool._ledger.find(w)
    books.begin_call()
    books.set_report(held=5000)
    books.set_reading(6000)
    books.gone()
    assert books.alive is False
    assert receipt(a) == (0, 2, "worker gone")
    assert a.stale
    assert a.device == "cpu"
    assert books.charge() == {
        "charge": 0,
        "sum_sizes": 0,
        "sum_loaded": 0,
        "sum_peak": 0,
        "held": 0,
        "reading": 0,
        "floor": 0,
        "in_flight": 0,
        "models": 0,
        "alive": False,
        "held_from_reading": False,
    }
    # ids stay known: a census naming one is valid but applies nothing.
    assert books.apply_census([{"id": "a", "resident": 5, "seq": 9}]) == 0
    assert receipt(a) == (0, 2, "worker gone")
    with pytest.raises(impl.EchoError):
        books.apply_census([{"id": "nope", "resident": 5}])
    assert impl.apply_echo(a, 10) is False
    assert receipt(a) == (0, 2, "worker gone")
    # Calls are no-ops on a gone worker, end_call included.
    books.begin_call()
    books.end_call()
    books.end_call()
    assert books.in_flight == 0


def test_gone_is_idempotent(impl, pool, make_standin):
    s = make_standin()
    impl.apply_echo(s, 10, seq=1)
    books = pool._ledger.find(s.worker)
    books.gone()
    first = s.receipt()
    books.gone()
    again = s.receipt()
    assert (first[0], first[1], first[3]) == (again[0], again[1], again[3])
    assert again[3] == "worker gone"
    assert books.alive is False


def test_gone_again_changes_nothing(impl, pool, make_worker, make_standin):
    """Idempotent: a second gone() neither rewrites receipts nor counts
    as a release (so the reserve does not shrink on it)."""
    w = make_worker()
    first = make_standin(worker=w, model_id="a")
    other = make_standin(size=10**6)
    impl.apply_echo(other, 5000)
    books = pool._ledger.find(w)
    books.gone()
    late = make_standin(worker=w, model_id="b")
    ledger = pool._ledger
    high = ledger.reserve(100, 0, True)
    assert high == 100 + 5000 + FLOOR
    books.gone()
    assert receipt(late) == (0, None, "registered")
    assert receipt(first) == (0, None, "worker gone")
    # A lower base is no release: the published value stays.
    assert ledger.reserve(0, 0, True) == high


def test_restart_after_gone(impl, pool, make_standin):
    s = make_standin(generation=1, model_id="unet")
    books = pool._ledger.find(s.worker)
    books.gone()
    books.bump(2)
    assert books.alive
    t = make_standin(worker=s.worker, generation=2, model_id="unet")
    assert impl.apply_echo(t, 5) is True
    assert s.stale and s.loaded_size() == 0
    assert t.loaded_size() == 5


# ---- calls and reports -----------------------------------------------------


def test_begin_end_call(impl, make_worker):
    books = impl.Ledger().worker(make_worker(), 1)
    books.begin_call()
    books.begin_call()
    assert books.in_flight == 2
    assert books.charge()["in_flight"] == 2
    books.end_call()
    books.end_call()
    assert books.in_flight == 0
    with pytest.raises(RuntimeError):
        books.end_call()
    assert books.in_flight == 0
    books.begin_call()
    assert books.in_flight == 1


def test_set_report(impl, make_worker):
    books = impl.Ledger(floor=0).worker(make_worker(), 1)
    books.set_report(held=100, pinned=2, overhead=3)
    assert books.charge()["held"] == 100
    books.set_report(pinned=7)
    assert books.charge()["held"] == 100
    books.set_report(held=None, overhead=None)
    assert books.charge()["held"] == 100
    books.set_report(held=40)
    assert books.charge()["held"] == 40
    assert books.charge()["charge"] == 40


@pytest.mark.parametrize("field", ["held", "pinned", "overhead"])
@pytest.mark.parametrize("value", [-1, True, 1.0, "1", 2**63, [1]])
def test_set_report_rejects_everything(impl, make_worker, field, value):
    books = impl.Ledger(floor=0).worker(make_worker(), 1)
    books.set_report(held=10)
    kwargs = {"held": 99, "pinned": 99, "overhead": 99, field: value}
    with pytest.raises(impl.EchoError, match=naming(field, value)):
        books.set_report(**kwargs)
    assert books.charge()["held"] == 10


def test_set_reading(impl, make_worker):
    books = impl.Ledger(floor=0).worker(make_worker(), 1)
    books.set_report(held=100)
    books.set_reading(50)
    charge = books.charge()
    assert charge["reading"] == 50 and charge["charge"] == 100
    assert charge["held_from_reading"] is False
    books.set_reading(300)
    charge = books.charge()
    assert charge["charge"] == 300 and charge["held"] == 100
    assert charge["held_from_reading"] is True
    books.set_reading(0)
    assert books.charge()["charge"] == 100


@pytest.mark.parametrize(
    "value, exc",
    [
        (-1, ValueError),
        (2**63, ValueError),
        (True, TypeError),
        (2.0, TypeError),
        (None, TypeError),
    ],
)
def test_set_reading_bad(impl, make_worker, value, exc):
    books = impl.Ledger(floor=0).worker(make_worker(), 1)
    books.set_reading(7)
    with pytest.raises(exc, match=naming("used", value)):
        books.set_reading(value)
    assert books.charge()["reading"] == 7


# ---- charges ---------------------------------------------------------------


def test_charge_idle_takes_the_largest_figure(
    impl, pool, make_worker, make_standin
):
    w = make_worker()
    a = make_standin(worker=w, model_id="a", size=1000)
    b = make_standin(worker=w, model_id="b", size=3000)
    books = pool._ledger.find(w)
    impl.apply_echo(a, 400)
    impl.apply_echo(b, 100)
    assert books.charge()["sum_loaded"] == 500
    assert books.charge()["charge"] == 500 + FLOOR
    books.set_report(held=800)
    assert books.charge()["charge"] == 800 + FLOOR
    books.set_reading(FLOOR + 700)  # the driver counts the context too
    assert books.charge()["charge"] == 800 + FLOOR
    books.set_reading(FLOOR + 900)
    assert books.charge()["charge"] == 900 + FLOOR
    impl.apply_echo(b, 2900)
    assert books.charge()["charge"] == 3300 + FLOOR


def test_charge_in_flight_is_the_sum_of_sizes(
    impl, pool, make_worker, make_standin
):
    w = make_worker()
    held = [
        make_standin(worker=w, model_id="a", size=1000),
        make_standin(worker=w, model_id="b", size=3000),
    ]
    books = pool._ledger.find(w)
    books.set_report(held=10**6)
    books.begin_call()
    assert books.charge()["charge"] == 4000 + FLOOR
    books.end_call()
    assert books.charge()["charge"] == 10**6 + FLOOR
    assert len(held) == 2


def test_peak_rises_in_flight_and_drops_when_idle(impl, pool, make_standin):
    s = make_standin(size=1000)
    books = pool._ledger.find(s.worker)
    impl.apply_echo(s, 700, in_flight=True)
    impl.apply_echo(s, 200, in_flight=True)
    charge = books.charge()
    assert (charge["sum_loaded"], charge["sum_peak"]) == (200, 700)
    assert charge["charge"] == 700 + FLOOR
    impl.apply_echo(s, 300)
    assert books.charge()["sum_peak"] == 300
    impl.apply_echo(s, 900, in_flight=True)
    impl.apply_echo(s, 100, unmapped=True, in_flight=True)
    assert books.charge()["sum_peak"] == 0


def test_charge_saturates(impl, make_worker):
    books = impl.Ledger(floor=MAX).worker(make_worker(), 1)
    records = [books.register(f"m{i}", MAX, 1) for i in range(3)]
    books.apply_census([{"id": f"m{i}", "resident": MAX} for i in range(3)])
    charge = books.charge()
    assert charge["sum_sizes"] == SATURATED
    assert charge["sum_loaded"] == SATURATED
    assert charge["charge"] == SATURATED
    books.begin_call()
    assert books.charge()["charge"] == SATURATED
    assert len(records) == 3


def test_total_charge(impl, pool, make_worker, make_standin):
    ledger = pool._ledger
    assert ledger.total_charge() == 0
    w1, w2, w3 = make_worker(), make_worker(), make_worker()
    # Models nobody holds leave the table, so keep the stand-ins.
    held = [
        make_standin(worker=w1, size=100),
        make_standin(worker=w2, size=5000),
        make_standin(worker=w3),
    ]
    impl.apply_echo(held[0], 60)
    ledger.find(w2).begin_call()
    ledger.find(w3).gone()
    expected = sum(ledger.find(w).charge()["charge"] for w in (w1, w2, w3))
    assert expected == 60 + FLOOR + 5000 + FLOOR
    assert ledger.total_charge() == expected
    assert pool.worker_charges() == {w1: 60 + FLOOR, w2: 5000 + FLOOR, w3: 0}


# ---- the reserve -----------------------------------------------------------


def test_reserve_device_wide_is_base(impl, make_worker):
    ledger = impl.Ledger(floor=100)
    books = ledger.worker(make_worker(), 1)
    books.set_report(held=10**9)
    assert ledger.reserve(400, 0, False) == 400
    assert ledger.reserve(7, 10**12, False) == 7
    # ... and leaves the state alone: the first process-local call
    # publishes whatever it computes.
    assert ledger.reserve(0, 0, True) == 10**9 + 100


def test_reserve_grows_at_once_and_shrinks_after_release(
    impl, pool, make_standin
):
    ledger = pool._ledger
    s = make_standin(size=10**6)
    books = ledger.find(s.worker)
    assert ledger.reserve(1000, 0, True) == 1000 + FLOOR
    impl.apply_echo(s, 5000)
    assert ledger.reserve(1000, 0, True) == 1000 + FLOOR + 5000
    # Lower without a release (a smaller base): the last value stays.
    assert ledger.reserve(10, 0, True) == 1000 + FLOOR + 5000
    impl.apply_echo(s, 2000)  # a release
    assert ledger.reserve(1000, 0, True) == 1000 + FLOOR + 2000
    # The release mark was cleared: no further shrink without another.
    assert ledger.reserve(10, 0, True) == 1000 + FLOOR + 2000
    books.set_report(held=9000)
    assert ledger.reserve(10, 0, True) == 10 + FLOOR + 9000
    books.set_report(held=3000)  # a lower held is a release
    assert ledger.reserve(10, 0, True) == 10 + FLOOR + 3000


@pytest.mark.parametrize("release", ["census", "gone", "bump", "assigned"])
def test_reserve_release_kinds(impl, pool, make_standin, release):
    ledger = pool._ledger
    s = make_standin(size=10**6)
    impl.apply_echo(s, 7000, seq=1)
    high = ledger.reserve(0, 0, True)
    assert high == 7000 + FLOOR
    books = ledger.find(s.worker)
    if release == "census":
        books.apply_census([{"id": s.model_id, "resident": 1000, "seq": 2}])
        expected = 1000 + FLOOR
    elif release == "gone":
        books.gone()
        expected = 0
    elif release == "bump":
        books.bump(2)
        expected = FLOOR
    else:
        s.model_loaded_weight_memory = 1000
        expected = 1000 + FLOOR
    assert ledger.reserve(0, 0, True) == expected


def test_reserve_does_not_shrink_on_a_raise(impl, pool, make_standin):
    ledger = pool._ledger
    s = make_standin(size=10**6)
    impl.apply_echo(s, 7000)
    assert ledger.reserve(0, 0, True) == 7000 + FLOOR
    impl.apply_echo(s, 8000)  # not a release
    ledger.forget(s.worker)  # not a release either
    assert ledger.reserve(0, 0, True) == 7000 + FLOOR


def test_reserve_cap_holds_for_a_kept_value(impl, pool, make_standin):
    ledger = pool._ledger
    s = make_standin(size=10**12)
    impl.apply_echo(s, 10**10)
    assert ledger.reserve(0, 0, True) == 10**10 + FLOOR
    # No release, so the value would be kept, but the card's size arrived.
    total = 4 * 10**9
    assert ledger.reserve(0, total, True) == total * 3 // 4
    # Never below the base, though.
    assert ledger.reserve(total, total, True) == total


def test_reserve_cap_and_base(impl, pool, make_standin):
    ledger = pool._ledger
    s = make_standin(size=10**12)
    impl.apply_echo(s, 10**10)
    total = 4 * 10**9
    assert ledger.reserve(10**6, total, True) == total * 3 // 4
    # The cap never pushes below the base.
    impl.apply_echo(s, 0)
    assert ledger.reserve(total, total, True) == total
    # Total 0: no cap.
    impl.apply_echo(s, 10**10)
    assert ledger.reserve(5, 0, True) == 5 + FLOOR + 10**10


@pytest.mark.parametrize(
    "args, exc, field, value",
    [
        ((-1, 0, True), ValueError, "base", -1),
        ((True, 0, True), TypeError, "base", True),
        ((1.5, 0, True), TypeError, "base", 1.5),
        ((0, -3, True), ValueError, "total", -3),
        ((0, None, True), TypeError, "total", None),
        ((0, 2**64, True), ValueError, "total", 2**64),
        ((0, 0, 1), TypeError, "process_local", 1),
        ((0, 0, None), TypeError, "process_local", None),
    ],
)
def test_reserve_bad_arguments(impl, args, exc, field, value):
    ledger = impl.Ledger()
    with pytest.raises(exc, match=naming(field, value)):
        ledger.reserve(*args)


def test_boundary_forgets_gone_workers_nobody_holds(impl, make_worker):
    pool = impl.Pool(floor=0)
    dead, held_dead, alive = make_worker(), make_worker(), make_worker()
    s1 = impl.StandIn(dead, 1, "a", 10, "cuda:0", "cpu", pool=pool)
    s2 = impl.StandIn(held_dead, 1, "b", 10, "cuda:0", "cpu", pool=pool)
    s3 = impl.StandIn(alive, 1, "c", 10, "cuda:0", "cpu", pool=pool)
    pool.worker_gone(dead)
    pool.worker_gone(held_dead)
    del s1
    pool.boundary()  # the graveyard let s1 go only now
    pool.boundary()
    keys = pool._ledger.keys()
    assert dead not in keys  # gone, and no stand-in of it left
    assert held_dead in keys and alive in keys  # s2 and s3 still held
    assert s2.stale and not s3.stale
    del s2
    pool.boundary()
    assert pool._ledger.keys() == [alive]


# ---- a dead worker forgotten before the next reserve (issue 8, defect 6) --


class _Worker:
    def __init__(self) -> None:
        self.alive = True

    def send_command(self, command, **kwargs):
        return {}

    def is_alive(self) -> bool:
        return self.alive


GIB = 1 << 30


@pytest.mark.parametrize("how", ["worker_gone", "eviction"])
def test_reserve_shrinks_after_a_dead_worker_is_forgotten(impl, how):
    """Death is a release; boundary() forgetting the worker before the
    next reserve must not lose it (the reserve stayed at 9 GiB in C)."""
    import gc

    pool = impl.Pool(floor=0, process_local=True)
    w = _Worker()
    s = impl.StandIn(w, 1, "big", 8 * GIB, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, 8 * GIB)
    assert pool.reserve("cuda:0", GIB, total=0) == 9 * GIB
    w.alive = False
    if how == "worker_gone":
        pool.worker_gone(w)
    else:
        assert s.partially_unload("cpu", GIB) == 8 * GIB
    del s
    gc.collect()
    pool.boundary()  # drops the graveyard, then forgets the dead worker
    assert pool.worker_charges() == {}
    assert pool._ledger.keys() == []
    assert pool.reserve("cuda:0", GIB, total=0) == GIB


def test_forgetting_a_live_worker_is_not_a_release(impl):
    pool = impl.Pool(floor=0, process_local=True)
    w = _Worker()
    s = impl.StandIn(w, 1, "big", 8 * GIB, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, 8 * GIB)
    assert pool.reserve("cuda:0", GIB, total=0) == 9 * GIB
    pool.forget(w)
    # Nothing said the bytes are back: the reserve holds.
    assert pool.reserve("cuda:0", GIB, total=0) == 9 * GIB
    assert s.loaded_size() == 8 * GIB


def test_ledger_forget_keeps_a_pending_release(impl):
    ledger = impl.Ledger(floor=0)
    key = object()
    books = ledger.worker(key, 1)
    record = books.register("m", 100, 1)
    books.set_report(held=100)
    assert ledger.reserve(0, 0, True) == 100
    books.gone()  # a release nobody has seen yet
    ledger.forget(key)
    assert ledger.reserve(0, 0, True) == 0
    del record


# ---- unhashable workers: the pool keys workers by identity (defect 10) ----


def _unhashable_worker():
    import dataclasses

    @dataclasses.dataclass(eq=True)
    class DataWorker:
        name: str
        pid: int = 4242
        alive: bool = True

        def send_command(self, command, **kwargs):
            return {"freed": 0}

        def is_alive(self) -> bool:
            return self.alive

    return DataWorker


def test_unhashable_workers_everywhere_in_the_pool(impl):
    DataWorker = _unhashable_worker()
    a, b = DataWorker("same"), DataWorker("same")  # equal, not identical
    with pytest.raises(TypeError):
        hash(a)
    pool = impl.Pool(floor=FLOOR, process_local=True)
    sa = impl.StandIn(a, 1, "m", 1000, "cuda:0", "cpu", pool=pool)
    sb = impl.StandIn(b, 1, "m", 1000, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(sa, 100)
    impl.apply_echo(sb, 200)
    charges = pool.worker_charges()
    assert len(charges) == 2
    assert charges[a] == 100 + FLOOR and charges[b] == 200 + FLOOR
    assert a in charges and DataWorker("same") not in charges
    assert charges.get(DataWorker("other"), "none") == "none"
    assert list(charges) == [a, b] or list(charges) == [b, a]
    details = pool.charge_details()
    assert details[a]["sum_loaded"] == 100
    assert details[b]["sum_loaded"] == 200
    assert pool.standins()[a] == [sa]
    assert pool.standins()[b] == [sb]
    probe = {"devices": [{"index": 0, "processes": {4242: FLOOR + 5000}}]}
    readings = pool.update_readings(probe)
    assert readings[a] == FLOOR + 5000 and readings[b] == FLOOR + 5000
    assert pool.boundary() == []
    pool.worker_gone(a)
    assert pool.worker_charges()[a] == 0
    del sa
    import gc

    gc.collect()
    pool.boundary()
    assert a not in pool.worker_charges()
    assert pool.worker_charges()[b] == 5000 + FLOOR


def test_worker_map_compares_as_a_dict(impl):
    pool = impl.Pool(floor=0, process_local=True)
    w = _Worker()
    s = impl.StandIn(w, 1, "m", 1000, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, 10)
    charges = pool.worker_charges()
    assert charges == {w: 10}
    assert {w: 10} == charges
    assert charges != {w: 11}
    assert charges != {_Worker(): 10}
    assert dict(charges) == {w: 10}
    assert dict(charges.items()) == {w: 10}
    assert "WorkerMap" in repr(charges)


def test_books_found_again_after_forget_and_among_several_workers(impl):
    """The C ledger remembers the books it found last (stand-ins come in
    runs on one worker): forgetting them, or asking for another worker's,
    must never answer with the wrong or a freed one."""
    ledger = impl.Ledger()
    a, b = object(), object()
    first = ledger.worker(a, 1)
    assert ledger.find(a) is first and ledger.worker(a, 1) is first
    other = ledger.worker(b, 1)
    assert other is not first
    assert ledger.find(a) is first and ledger.find(b) is other
    ledger.forget(a)
    assert ledger.find(a) is None
    again = ledger.worker(a, 2)
    assert again is not first and ledger.find(a) is again
    del first
    gc.collect()
    # A new worker object, perhaps at the freed one's address, is a new
    # worker to the ledger.
    ledger.forget(b)
    del b, other
    gc.collect()
    fresh = [object() for _ in range(64)]
    assert all(ledger.find(w) is None for w in fresh)
    assert sorted(map(id, ledger.keys())) == [id(a)]
