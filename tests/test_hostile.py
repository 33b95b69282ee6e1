"""Hostile callers of the state sync (issue 8, defects 2, 7, 8 and 10).

The stand-in lives in ComfyUI's process: nothing a caller's objects do may
crash it.  Each entry point (apply_residency, apply_echo, WorkerBooks and
Ledger methods, Pool.report, command replies) is driven with objects whose
``__hash__``, ``__eq__``, ``get``, ``__getitem__``, ``items``,
``__index__`` or ``__bool__`` mutate what is being read, raise an
Exception, or raise a BaseException.  Both implementations must give the
same answer (docs/semantics.md, "Hostile inputs").

Scenarios that crashed the host before the census snapshot run in a
subprocess (``isolated``), so a segfault fails the test instead of killing
pytest.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import subprocess
import sys
import types
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SIZE = 1000


class Worker:
    """A worker answering each command with `replies[command]()`."""

    def __init__(self, **replies: Any) -> None:
        self.replies = replies
        self.alive = True

    def send_command(self, command: str, **kwargs: Any) -> Any:
        reply = self.replies.get(command)
        return reply() if callable(reply) else {}

    def is_alive(self) -> bool:
        return self.alive


def setup(impl: Any, ids=("m0", "m1", "m2"), **replies: Any):
    pool = impl.Pool(process_local=True)
    worker = Worker(**replies)
    table = {
        i: impl.StandIn(worker, 1, i, SIZE, "cuda:0", "cpu", pool=pool)
        for i in ids
    }
    return pool, worker, table


def loaded(table: dict[str, Any]) -> list[int]:
    return [s.loaded_size() for s in table.values()]


def churn() -> None:
    """Reuse freed memory, so a dangling pointer reads garbage."""
    junk = [f"junk-{i}" * 3 for i in range(2000)]
    del junk
    gc.collect()


def impl_name(impl: Any) -> str:
    return "reference" if impl.__name__.endswith("_reference") else "c"


def load(name: str) -> Any:
    import importlib

    if name == "c":
        return importlib.import_module("comfy_standin")
    return importlib.import_module("comfy_standin._reference")


def isolated(impl: Any, scenario: Any) -> None:
    """Runs `scenario(impl)` in a fresh interpreter: a crash is a failure
    with the child's output, not the end of the test run."""
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); "
        f"import test_hostile as t; "
        f"t.{scenario.__name__}(t.load({impl_name(impl)!r})); "
        f"print('scenario done')"
    )
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0 and "scenario done" in result.stdout, (
        f"{scenario.__name__} ({impl_name(impl)}) exited "
        f"{result.returncode}:\n{result.stdout}\n{result.stderr[-3000:]}"
    )


# ---- census ids and entries that mutate the census ------------------------


def scenario_id_hash_clears_census(impl: Any) -> None:
    _, _, table = setup(impl)
    census: list[Any] = []
    calls = []

    class Id(str):
        def __hash__(self) -> int:
            calls.append(self)
            census.clear()
            churn()
            return str.__hash__(self)

    census.extend(
        {"id": Id(f"m{i}"), "resident": 10 + i, "seq": 1} for i in range(3)
    )
    assert impl.apply_residency(table, census) == 3
    assert loaded(table) == [10, 11, 12]
    # The ids are copied as exact strs first: the hostile hash never runs.
    assert calls == []


def scenario_id_eq_clears_census(impl: Any) -> None:
    _, _, table = setup(impl)
    census: list[Any] = []

    class Id(str):
        def __hash__(self) -> int:
            return str.__hash__(self)

        def __eq__(self, other: object) -> bool:
            census.clear()
            churn()
            return str.__eq__(self, other)

    census.extend(
        {"id": Id(f"m{i}"), "resident": 20 + i} for i in range(3)
    )
    assert impl.apply_residency(table, census) == 3
    assert loaded(table) == [20, 21, 22]


def scenario_map_getitem_clears_census(impl: Any) -> None:
    _, _, table = setup(impl)
    census: list[Any] = []

    class Map(dict):
        def __getitem__(self, key: Any) -> Any:
            census.clear()
            churn()
            return dict.__getitem__(self, key)

        def get(self, key: Any, default: Any = None) -> Any:
            return self[key] if key in self else default

    census.extend({"id": f"m{i}", "resident": 30 + i} for i in range(3))
    standins = Map(table)
    # The map is read once through items(); it is never indexed.
    assert impl.apply_residency(standins, census) == 3
    assert loaded(table) == [30, 31, 32]


def scenario_entry_key_eq_clears_entry_and_census(impl: Any) -> None:
    """A str-subclass key stored in an entry, colliding with 'seq':
    looking 'seq' up runs its __eq__, which empties the entry and the
    census while the entry is being read (the WorkerBooks path)."""
    pool, worker, table = setup(impl)
    census: list[Any] = []

    class Key(str):
        def __hash__(self) -> int:
            return hash("seq")

        def __eq__(self, other: object) -> bool:
            entry.clear()
            census.clear()
            churn()
            return False

    entry = {"id": "".join(["m", "0"]), "resident": 40, Key("x"): 9}
    census.extend([entry, {"id": "m1", "resident": 41}])
    books = pool._ledger.find(worker)
    assert books.apply_census(census) == 2
    assert loaded(table) == [40, 41, 0]


def scenario_pool_report_hostile_census(impl: Any) -> None:
    pool, worker, table = setup(impl)
    census: list[Any] = []

    class Id(str):
        def __hash__(self) -> int:
            census.clear()
            churn()
            return str.__hash__(self)

    census.extend({"id": Id(f"m{i}"), "resident": 50 + i} for i in range(3))
    assert pool.report(worker, {"residency": census, "held": 7}) == 3
    assert loaded(table) == [50, 51, 52]


def scenario_mapping_entry_get_clears_census(impl: Any) -> None:
    _, _, table = setup(impl)
    census: list[Any] = []

    class Entry(Mapping):
        def __init__(self, data: dict[str, Any]) -> None:
            self.data = data

        def __getitem__(self, key: str) -> Any:
            census.clear()
            churn()
            return self.data[key]

        def __iter__(self):
            return iter(self.data)

        def __len__(self) -> int:
            return len(self.data)

    census.extend(Entry({"id": f"m{i}", "resident": 60 + i}) for i in range(3))
    assert impl.apply_residency(table, census) == 3
    assert loaded(table) == [60, 61, 62]


CRASHERS = [
    scenario_id_hash_clears_census,
    scenario_id_eq_clears_census,
    scenario_map_getitem_clears_census,
    scenario_entry_key_eq_clears_entry_and_census,
    scenario_pool_report_hostile_census,
    scenario_mapping_entry_get_clears_census,
]


@pytest.mark.parametrize("scenario", CRASHERS, ids=lambda f: f.__name__[9:])
def test_census_mutated_while_read(impl, scenario):
    isolated(impl, scenario)


# ---- exceptions from the caller's objects ----------------------------------


def colliding_key(target: str, exc: BaseException) -> Any:
    class Key(str):
        def __hash__(self) -> int:
            return hash(target)

        def __eq__(self, other: object) -> bool:
            raise exc

    return Key("collides-with-" + target)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("path", ["residency", "books", "report"])
def test_exception_while_reading_an_entry_propagates(impl, exc, path):
    """Exception or BaseException: propagated unchanged, nothing applied
    (a census that cannot be read is not a worker's bad word)."""
    pool, worker, table = setup(impl)
    census = [
        {"id": "m0", "resident": 5},
        {"id": "m1", "resident": 6, colliding_key("seq", exc): 1},
    ]
    books = pool._ledger.find(worker)
    call = {
        "residency": lambda: impl.apply_residency(table, census),
        "books": lambda: books.apply_census(census),
        "report": lambda: pool.report(worker, {"residency": census}),
    }[path]
    with pytest.raises(type(exc)):
        call()
    assert loaded(table) == [0, 0, 0]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_exception_from_a_mapping_entry_propagates(impl, exc):
    _, _, table = setup(impl)

    class Entry(Mapping):
        def __getitem__(self, key: str) -> Any:
            raise exc

        def __iter__(self):
            return iter(())

        def __len__(self) -> int:
            return 0

    with pytest.raises(type(exc)):
        impl.apply_residency(table, [{"id": "m0", "resident": 1}, Entry()])
    assert loaded(table) == [0, 0, 0]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_exception_from_the_map_propagates(impl, exc):
    _, _, table = setup(impl)

    class Map(dict):
        def items(self):
            raise exc

    with pytest.raises(type(exc)):
        impl.apply_residency(Map(table), [{"id": "m0", "resident": 1}])
    assert loaded(table) == [0, 0, 0]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_hostile_id_hash_never_runs(impl, exc):
    """Ids are copied as exact strs before any lookup: a str subclass's
    __hash__ / __eq__ never runs, whatever it would raise."""
    pool, worker, table = setup(impl)

    class Id(str):
        def __hash__(self) -> int:
            raise exc

        def __eq__(self, other: object) -> bool:
            raise exc

    census = [{"id": Id("m0"), "resident": 3}, {"id": Id("m1"), "resident": 4}]
    assert impl.apply_residency(table, census) == 2
    books = pool._ledger.find(worker)
    census = [{"id": Id("m2"), "resident": 5}]
    assert books.apply_census(census) == 1
    assert loaded(table) == [3, 4, 5]
    # Registering under a hostile id: no hash either.
    record = books.register(Id("m9"), SIZE, 1)
    assert record.model_id == "m9"
    assert books.find(Id("m9")) is not None


def test_recursion_from_a_mapping_entry(impl):
    _, _, table = setup(impl)

    class Deep(Mapping):
        def __getitem__(self, key: str) -> Any:
            return self[key]

        def __iter__(self):
            return iter(("id",))

        def __len__(self) -> int:
            return 1

    with pytest.raises(RecursionError):
        impl.apply_residency(table, [Deep()])
    assert loaded(table) == [0, 0, 0]


def test_reentrant_census_from_a_mapping_entry(impl):
    """An entry's get() applies another census: both apply, in order."""
    _, _, table = setup(impl)
    inner = [{"id": "m1", "resident": 9, "seq": 5}]

    class Entry(Mapping):
        def __init__(self) -> None:
            self.data = {"id": "m0", "resident": 8, "seq": 5}
            self.done = False

        def __getitem__(self, key: str) -> Any:
            if not self.done:
                self.done = True
                assert impl.apply_residency(table, inner) == 1
            return self.data[key]

        def __iter__(self):
            return iter(self.data)

        def __len__(self) -> int:
            return len(self.data)

    census = [Entry(), {"id": "m1", "resident": 7, "seq": 4}]
    # m1's seq 4 is older than the inner census's 5: skipped.
    assert impl.apply_residency(table, census) == 1
    assert loaded(table) == [8, 9, 0]


def test_list_subclass_census_is_read_from_its_items(impl):
    _, _, table = setup(impl)

    class Census(list):
        def __iter__(self):
            raise AssertionError("__iter__ called")

        def __len__(self) -> int:
            raise AssertionError("__len__ called")

        def __getitem__(self, index: Any) -> Any:
            raise AssertionError("__getitem__ called")

    census = Census([{"id": "m0", "resident": 1}])
    assert impl.apply_residency(table, census) == 1


# ---- hostile integers ------------------------------------------------------


class TrapInt(int):
    """An int whose Python-level conversions and comparisons all raise: a
    byte value must be read from its digits."""

    def _trap(self, *args: Any) -> Any:
        raise AssertionError("int subclass method called")

    __index__ = __int__ = __float__ = _trap
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _trap
    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return f"TrapInt({int.__repr__(self)})"


class IndexOnly:
    calls = 0

    def __index__(self) -> int:
        IndexOnly.calls += 1
        return 5


def test_int_subclass_is_read_from_its_digits(impl):
    pool, worker, table = setup(impl)
    s = table["m0"]
    assert impl.apply_echo(s, TrapInt(500), seq=TrapInt(3)) is True
    assert s.loaded_size() == 500 and s.receipt()[1] == 3
    census = [{"id": "m1", "resident": TrapInt(7), "seq": TrapInt(9)}]
    assert impl.apply_residency(table, census) == 1
    books = pool._ledger.find(worker)
    assert books.apply_census([{"id": "m2", "resident": TrapInt(8)}]) == 1
    assert loaded(table) == [500, 7, 8]


@pytest.mark.parametrize(
    "value", [IndexOnly(), 2**64, 10**40, -(2**70), 2**63, 5.0],
    ids=repr,
)
def test_non_byte_values_are_refused_without_running_index(impl, value):
    IndexOnly.calls = 0
    pool, worker, table = setup(impl)
    s = table["m0"]
    with pytest.raises(impl.EchoError, match="resident"):
        impl.apply_echo(s, value)
    with pytest.raises(impl.EchoError, match="seq"):
        impl.apply_echo(s, 1, seq=value)
    with pytest.raises(impl.EchoError, match=re.escape("census[0]")):
        impl.apply_residency(table, [{"id": "m0", "resident": value}])
    books = pool._ledger.find(worker)
    with pytest.raises(impl.EchoError, match=re.escape("census[0]")):
        books.apply_census([{"id": "m0", "resident": 1, "seq": value}])
    assert IndexOnly.calls == 0
    assert loaded(table) == [0, 0, 0]


def test_ledger_methods_with_hostile_objects(impl):
    """Workers are keyed by identity (their __hash__/__eq__ never run);
    every figure is read from its digits."""

    class Key:
        def __hash__(self) -> int:
            raise KeyboardInterrupt

        def __eq__(self, other: object) -> bool:
            raise KeyboardInterrupt

    ledger = impl.Ledger(floor=TrapInt(100))
    key = Key()
    books = ledger.worker(key, TrapInt(1))
    assert ledger.find(key) is books and ledger.keys() == [key]
    books.set_report(held=TrapInt(5), pinned=TrapInt(1), overhead=None)
    books.set_reading(TrapInt(7))
    books.bump(TrapInt(2))
    record = books.register("m0", TrapInt(SIZE), TrapInt(2))
    assert record.size == SIZE
    assert books.apply_census([{"id": "m0", "resident": TrapInt(9)}]) == 1
    assert record.loaded == 9
    ledger.forget(key)
    assert ledger.find(key) is None and ledger.keys() == []


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_apply_echo_flag_whose_bool_raises(impl, exc):
    _, _, table = setup(impl)

    class Flag:
        def __bool__(self) -> bool:
            raise exc

    with pytest.raises(type(exc)):
        impl.apply_echo(table["m0"], 5, unmapped=Flag())
    assert loaded(table) == [0, 0, 0]


def test_apply_echo_unknown_keyword_before_the_flags_run(impl):
    # The flags are tested after the arguments are parsed (and owned):
    # a wrong call runs none of the caller's code, as for a Python function.
    _, _, table = setup(impl)
    ran: list[str] = []

    class Flag:
        def __bool__(self) -> bool:
            ran.append("bool")
            return True

    with pytest.raises(TypeError, match="in_fligth"):
        impl.apply_echo(table["m0"], 5, unmapped=Flag(), in_fligth=True)
    assert ran == [] and loaded(table) == [0, 0, 0]


# ---- command replies -------------------------------------------------------


class TrapReply(dict):
    """A reply whose overridden methods all fail: it is read as a plain
    dict, from its storage."""

    def _trap(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("dict subclass method called")

    __getitem__ = get = keys = items = values = __contains__ = _trap
    __iter__ = __len__ = _trap


def test_reply_dict_subclass_is_read_from_its_storage(impl):
    _, _, table = setup(
        impl,
        model_partial_load=lambda: TrapReply(loaded=300, resident=300, seq=2),
        model_partial_unload=lambda: TrapReply(freed=100, resident=200),
    )
    s = table["m0"]
    assert s.partially_load("cuda:0", 300) == 300
    assert s.receipt()[:2] == (300, 2)
    assert s.partially_unload("cpu", 100) == 100
    assert s.loaded_size() == 200
    assert s.bad_replies == 0


def test_reply_key_that_empties_the_reply(impl):
    """A stored str-subclass key colliding with 'resident' empties the
    reply while it is read: 'resident' is then absent (derived)."""

    def reply() -> dict[str, Any]:
        class Key(str):
            def __hash__(self) -> int:
                return hash("resident")

            def __eq__(self, other: object) -> bool:
                data.clear()
                churn()
                return False

        data = {"loaded": TrapInt(250), Key("k"): 1, "seq": 4}
        return data

    _, _, table = setup(impl, model_partial_load=reply)
    s = table["m0"]
    assert s.partially_load("cuda:0", 250) == 250
    # resident derived from before (0) + loaded; seq read after the
    # reply was emptied: absent.
    assert s.receipt()[:2] == (250, None)


def test_reply_lookup_raising_exception_is_a_bad_reply(impl):
    def reply() -> dict[str, Any]:
        return {"loaded": 5, colliding_key("seq", RuntimeError("boom")): 1}

    _, _, table = setup(impl, model_partial_load=reply)
    s = table["m0"]
    with pytest.raises(impl.EchoError, match="seq") as info:
        s.partially_load("cuda:0", 5)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert s.bad_replies == 1
    assert s.loaded_size() == 0


def test_reply_lookup_raising_keyboard_interrupt_propagates(impl):
    def reply() -> dict[str, Any]:
        return {"loaded": 5, colliding_key("seq", KeyboardInterrupt()): 1}

    _, _, table = setup(impl, model_partial_load=reply)
    s = table["m0"]
    with pytest.raises(KeyboardInterrupt):
        s.partially_load("cuda:0", 5)
    assert s.loaded_size() == 0


@pytest.mark.parametrize("value", [IndexOnly(), 2**64, -(10**30)], ids=repr)
def test_reply_values_refused_without_running_index(impl, value):
    IndexOnly.calls = 0
    _, _, table = setup(
        impl, model_partial_load=lambda: {"loaded": value}
    )
    s = table["m0"]
    with pytest.raises(impl.EchoError, match="loaded"):
        s.partially_load("cuda:0", 5)
    assert IndexOnly.calls == 0


# ---- the stand-in map (defect 10) ------------------------------------------


def test_defaultdict_map_gains_no_key(impl):
    _, _, table = setup(impl)
    standins = defaultdict(lambda: table["m0"], table)
    with pytest.raises(impl.EchoError, match=re.escape("'nobody'")):
        impl.apply_residency(standins, [{"id": "nobody", "resident": 1}])
    assert sorted(standins) == ["m0", "m1", "m2"]
    assert impl.apply_residency(standins, [{"id": "m1", "resident": 4}]) == 1
    assert sorted(standins) == ["m0", "m1", "m2"]
    assert loaded(table) == [0, 4, 0]


def test_object_with_getitem_is_not_a_map(impl):
    _, _, table = setup(impl)

    class DictLike:
        def __getitem__(self, key: str) -> Any:
            return table[key]

        def keys(self):
            return table.keys()

        def items(self):
            return table.items()

        def __len__(self) -> int:
            return len(table)

    with pytest.raises(TypeError, match="standins"):
        impl.apply_residency(DictLike(), [{"id": "m0", "resident": 1}])
    assert loaded(table) == [0, 0, 0]


def test_any_mapping_is_a_map(impl):
    _, _, table = setup(impl)
    proxy = types.MappingProxyType(dict(table))
    assert impl.apply_residency(proxy, [{"id": "m2", "resident": 6}]) == 1
    assert loaded(table) == [0, 0, 6]


def test_map_items_must_be_pairs(impl):
    _, _, table = setup(impl)

    class Odd(dict):
        def items(self):
            return [("m0", table["m0"], "extra")]

    with pytest.raises(TypeError, match=re.escape("standins.items()")):
        impl.apply_residency(Odd(table), [{"id": "m0", "resident": 1}])


def test_map_key_compared_by_characters(impl):
    """A str-subclass key equal by characters is the stand-in's id; its
    __eq__ never runs."""
    _, _, table = setup(impl)

    class Key(str):
        def __hash__(self) -> int:
            return str.__hash__(self)

        def __eq__(self, other: object) -> bool:
            raise AssertionError("key __eq__ called")

        __ne__ = __eq__

    standins = {Key("m0"): table["m0"]}
    assert impl.apply_residency(standins, [{"id": "m0", "resident": 2}]) == 1
    assert loaded(table) == [2, 0, 0]


# ---- drift between the C type and the reference (defect 7) ---------------


@pytest.mark.parametrize("path", ["residency", "books", "report"])
def test_mapping_census_entries_are_accepted(impl, path):
    pool, worker, table = setup(impl)

    class Entry(Mapping):
        def __init__(self, **data: Any) -> None:
            self.data = data

        def __getitem__(self, key: str) -> Any:
            return self.data[key]

        def __iter__(self):
            return iter(self.data)

        def __len__(self) -> int:
            return len(self.data)

    census = [
        types.MappingProxyType({"id": "m0", "resident": 1, "seq": 3}),
        Entry(id="m1", resident=2, device="cuda:0"),
        {"id": "m2", "resident": 3},
    ]
    books = pool._ledger.find(worker)
    applied = {
        "residency": lambda: impl.apply_residency(table, census),
        "books": lambda: books.apply_census(census),
        "report": lambda: pool.report(worker, {"residency": census}),
    }[path]()
    assert applied == 3
    assert loaded(table) == [1, 2, 3]


def test_mapping_census_entry_still_validated(impl):
    _, _, table = setup(impl)
    census = [types.MappingProxyType({"id": "m0", "resident": -1})]
    field = re.escape("census[0]['resident']")
    with pytest.raises(impl.EchoError, match=field):
        impl.apply_residency(table, census)


LONE = "model-\udc80"


def test_model_id_without_utf8_form_is_refused(impl):
    pool = impl.Pool(process_local=True)
    with pytest.raises(ValueError, match="model_id") as info:
        impl.StandIn(Worker(), 1, LONE, SIZE, "cuda:0", "cpu", pool=pool)
    assert not isinstance(info.value, UnicodeError)
    books = pool._ledger.worker(Worker(), 1)
    with pytest.raises(ValueError, match="model_id") as info:
        books.register(LONE, SIZE, 1)
    assert not isinstance(info.value, UnicodeError)
    assert books.find(LONE) is None


@pytest.mark.parametrize("path", ["residency", "books"])
def test_census_id_without_utf8_form_is_an_echo_error(impl, path):
    pool, worker, table = setup(impl)
    census = [{"id": "m0", "resident": 1}, {"id": LONE, "resident": 1}]
    books = pool._ledger.find(worker)
    call = {
        "residency": lambda: impl.apply_residency(table, census),
        "books": lambda: books.apply_census(census),
    }[path]
    with pytest.raises(impl.EchoError, match=re.escape("census[1]['id']")):
        call()
    assert loaded(table) == [0, 0, 0]


@pytest.mark.skipif(sys.platform != "linux", reason="the board: Linux")
def test_echo_source_compares_with_the_receipt_not_the_board(impl):
    from comfy_standin import _core

    _, _, table = setup(impl)
    s = table["m0"]
    worker_side, fd = _core.Board.make(1)
    board = _core.Board.adopt(fd, 1)
    os.close(fd)
    slot = s.attach_board(board)
    worker_side.bind(slot, board.tag(slot))
    try:
        impl.apply_echo(s, 800, seq=1)
        worker_side.publish(slot, 100)
        assert s.loaded_size() == 100  # the board is newer
        # 500 < the receipt's 800: an unload echo, whatever the board says.
        impl.apply_echo(s, 500, seq=2)
        assert s.receipt()[1:][::2] == (2, "unload echo")
        worker_side.publish(slot, 900)
        assert s.loaded_size() == 900
        # 600 > the receipt's 500: a load echo.
        impl.apply_echo(s, 600, seq=3)
        assert s.receipt()[3] == "load echo"
    finally:
        s.detach_board()
        worker_side.close()
        board.close()


# ---- the C type: constants and cleared objects (defect 8) -----------------


def test_value_max_is_exact():
    from comfy_standin import _core

    assert _core.VALUE_MAX == 2**63 - 1
    assert type(_core.VALUE_MAX) is int


def test_no_64_bit_constant_goes_through_a_c_long():
    """PyModule_AddIntConstant takes a C long, 32 bits on LLP64 (Windows):
    VALUE_MAX went through it and read -1 there."""
    source = (HERE.parent / "src" / "module.c").read_text()
    names = re.findall(
        r'PyModule_AddIntConstant\(\s*\w+,\s*"(\w+)"', source
    )
    assert names and not {"VALUE_MAX", "DEFAULT_FLOOR"} & set(names)


def _tp_clear(obj: Any) -> None:
    """Calls the type's tp_clear as the collector would on a cycle."""
    api = ctypes.pythonapi
    api.PyType_GetSlot.restype = ctypes.c_void_p
    api.PyType_GetSlot.argtypes = [ctypes.py_object, ctypes.c_int]
    py_tp_clear = 51  # Include/typeslots.h
    address = api.PyType_GetSlot(type(obj), py_tp_clear)
    assert address
    ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object)(address)(obj)


def scenario_cleared_ledger_and_books(impl: Any) -> None:
    ledger = impl.Ledger()
    worker = Worker()
    books = ledger.worker(worker, 1)
    record = books.register("m0", SIZE, 1)
    _tp_clear(books)
    for call in (lambda: books.key,):
        try:
            call()
        except RuntimeError as exc:
            assert "cleared" in str(exc)
        else:
            raise AssertionError("a cleared WorkerBooks answered")
    repr(books)
    assert books.charge()["models"] == 1
    assert record.model_id == "m0"
    for call in (ledger.keys,):
        try:
            call()
        except RuntimeError as exc:
            assert "cleared" in str(exc)
        else:
            raise AssertionError("keys() of cleared books answered")
    _tp_clear(ledger)
    for call in (
        lambda: ledger.worker(worker, 1),
        lambda: ledger.find(worker),
        lambda: ledger.forget(worker),
        ledger.keys,
    ):
        try:
            call()
        except RuntimeError as exc:
            assert "cleared" in str(exc)
        else:
            raise AssertionError("a cleared Ledger answered")
    assert ledger.total_charge() >= 0


def scenario_cleared_standin(impl: Any) -> None:
    """A stand-in the collector cleared (tp_clear, as part of a cycle),
    with a device assigned, its sentinel made and a board attached, as a
    finalizer running in that collection may still reach it: it keeps its
    model id and receipt; what it held reads None, ``model`` (itself)
    included; the inner module's members answer from the receipt; its
    eviction calls free nothing and none crashes."""
    from comfy_standin.pool import Pool

    pool = Pool(floor=0)
    worker = Worker()
    s = impl.StandIn(worker, 1, "m0", SIZE, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, 500, seq=1)
    s.device = "cuda:1"
    s.clone_base_uuid  # noqa: B018
    worker_side, fd = impl.Board.make(2)
    board = impl.Board.adopt(fd, 2)
    os.close(fd)
    s.attach_board(board)
    _tp_clear(s)
    churn()
    assert s.model_id == "m0" and s.receipt()[0] == 500
    for name in ("load_device", "offload_device", "kind", "worker", "pool",
                 "model", "clone_base_uuid", "device", "board"):
        assert getattr(s, name) is None, name
    assert s.loaded_size() == 500 == s.model_loaded_weight_memory
    assert s.current_loaded_device() is None
    assert s.model_lowvram is False and s.model_offload_buffer_memory == 0
    assert s.current_weight_patches_uuid is None
    assert s.partially_unload("cpu", 100) == 0
    assert s.detach() is None
    s.device = "cuda:0"  # the assignment holds until the next receipt
    assert s.device == "cuda:0"
    s.model_loaded_weight_memory = 10
    assert s.device is None and s.loaded_size() == 10
    repr(s)
    board.close()
    worker_side.close()


def _clear_module(copy: Any) -> None:
    """Runs the module's m_clear, as the collector does when a module
    instance is collected or the interpreter shuts down."""
    api = ctypes.pythonapi
    api.PyModule_GetDef.restype = ctypes.c_void_p
    api.PyModule_GetDef.argtypes = [ctypes.py_object]
    definition = api.PyModule_GetDef(copy)
    # PyModuleDef: PyModuleDef_Base (PyObject_HEAD, m_init, m_index,
    # m_copy), m_name, m_doc, m_size, m_methods, m_slots, m_traverse,
    # m_clear.  Checked against m_name before use.
    word = ctypes.sizeof(ctypes.c_void_p)
    head = ctypes.sizeof(ctypes.c_ssize_t) + word  # refcount, type
    base = head + 3 * word
    name = ctypes.c_char_p.from_address(definition + base).value
    assert name == b"comfy_standin._core", name
    clear = ctypes.c_void_p.from_address(definition + base + 6 * word).value
    ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object)(clear)(copy)


def _module_copy() -> Any:
    """A second instance of the extension module (multi-phase init)."""
    import importlib.util

    from comfy_standin import _core

    spec = importlib.util.find_spec("comfy_standin._core")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy is not _core
    return copy


def scenario_cleared_module_state_standin(impl: Any) -> None:
    """Every entry point of a stand-in whose module state was cleared
    (interpreter shutdown: a finalizer may still call it) answers or
    raises RuntimeError naming the clearing; the eviction paths still
    never raise an Exception.  None may read the cleared (NULL) fields."""
    from comfy_standin.pool import Pool

    copy = _module_copy()

    class CopyPool(Pool):
        _impl = copy

    pool = CopyPool()
    worker = Worker()
    made = copy.StandIn(worker, 1, "m0", SIZE, "cuda:0", "cpu", pool=pool)
    copy.apply_echo(made, 500)
    fresh = copy.StandIn(worker, 1, "m1", SIZE, "cuda:0", "cpu", pool=pool)
    copy.apply_echo(fresh, 500)
    # One with its sentinel made and a device assigned, one without.
    sentinel = made.clone_base_uuid
    made.device = "cuda:1"
    _clear_module(copy)
    raising = {
        "StandIn()": lambda: copy.StandIn(worker, 1, "m2", SIZE, "cuda:0",
                                          "cpu", pool=pool),
        "StandIn.__new__": lambda: copy.StandIn.__new__(
            copy.StandIn, worker, 1, "m3", SIZE, "cuda:0", "cpu", pool=pool),
        "partially_load": lambda: fresh.partially_load("cuda:0", 10),
        "clone_base_uuid": lambda: fresh.clone_base_uuid,
        "attach_board": lambda: fresh.attach_board(None),
    }
    _each_refuses_as_cleared(raising)
    for s in (made, fresh):
        assert s.partially_unload("cpu", 100) == 0
        s.detach()
        assert s.loaded_size() == 500 and s.model_size() == SIZE
        assert s.is_dynamic() is False
        # The inner module's members need no module state: the model is
        # the stand-in itself.
        assert s.model is s
        assert s.model_loaded_weight_memory == 500
        assert s.model_lowvram is False and s.model_offload_buffer_memory == 0
        s.receipt()
        repr(s)
    assert made.device == "cuda:1" and fresh.device == "cuda:0"
    fresh.device = "cpu"
    assert fresh.device == "cpu" and fresh.current_loaded_device() == "cpu"
    assert made.clone_base_uuid is sentinel


def _each_refuses_as_cleared(calls: dict[str, Any]) -> None:
    """Each call raises RuntimeError saying the module state was cleared."""
    for what, call in calls.items():
        try:
            call()
        except RuntimeError as exc:
            assert "cleared" in str(exc), (what, exc)
        else:
            raise AssertionError(f"{what} answered after m_clear")


def scenario_cleared_module_state(impl: Any) -> None:
    """A second instance of the extension module (multi-phase init), its
    state cleared as m_clear does when the module is collected, while
    objects of its types are still reachable."""
    copy = _module_copy()
    ledger = copy.Ledger()
    books = ledger.worker(Worker(), 1)
    books.register("m0", SIZE, 1)

    _clear_module(copy)

    calls = {
        "Ledger.worker": lambda: ledger.worker(Worker(), 1),
        "register": lambda: books.register("m1", SIZE, 1),
        "apply_census": lambda: books.apply_census([]),
        "set_report": lambda: books.set_report(held=-1),
        "apply_residency": lambda: copy.apply_residency({}, []),
        "apply_echo": lambda: copy.apply_echo(object(), 1),
    }
    _each_refuses_as_cleared(calls)


@pytest.mark.parametrize(
    "scenario",
    [scenario_cleared_ledger_and_books, scenario_cleared_standin,
     scenario_cleared_module_state, scenario_cleared_module_state_standin],
    ids=lambda f: f.__name__[9:],
)
def test_c_objects_after_clear_raise(scenario):
    """C only: the reference has no tp_clear or module state."""
    isolated(load("c"), scenario)


# ---- differential: the same census through both implementations ----------


class StrId(str):
    """A str-subclass id whose hash and equality are not the caller's to
    decide (they would raise if called)."""

    def __hash__(self) -> int:
        raise AssertionError("id __hash__ called")

    def __eq__(self, other: object) -> bool:
        raise AssertionError("id __eq__ called")

    __ne__ = __eq__


def _id_strategy(st: Any) -> Any:
    known = st.sampled_from(["m0", "m1", "m2"])
    return st.one_of(
        known,
        known.map(StrId),
        st.sampled_from(["nobody", "", "m\udc80", None, 5, b"m0"]),
    )


def _value_strategy(st: Any) -> Any:
    return st.one_of(
        st.integers(0, 2 * SIZE),
        st.integers(0, 2 * SIZE).map(TrapInt),
        st.sampled_from([None, -1, 2**63, 2**64, True, 1.0, "1"]),
    )


def _entry_strategy(st: Any) -> Any:
    fields = st.fixed_dictionaries(
        {"id": _id_strategy(st)},
        optional={
            "resident": _value_strategy(st),
            "seq": _value_strategy(st),
            "device": st.sampled_from([None, "cuda:0", 0]),
        },
    )
    return st.one_of(
        fields,
        fields.map(types.MappingProxyType),
        st.sampled_from([None, 5, "m0", ["m0", 1]]),
    )


def _outcome(impl: Any, census: list[Any], path: str) -> Any:
    pool, worker, table = setup(impl)
    impl.apply_echo(table["m1"], 100, seq=10)
    try:
        if path == "residency":
            result: Any = impl.apply_residency(table, census)
        else:
            result = pool._ledger.find(worker).apply_census(census)
    except Exception as exc:  # noqa: BLE001 -- compared, not swallowed
        where = re.match(r"census(\[\d+\](\['\w+'\])?)?", str(exc))
        result = (type(exc).__name__, where and where.group(0))
    receipts = [
        (s.loaded_size(), s.receipt()[1], s.receipt()[3])
        for s in table.values()
    ]
    return result, receipts


def test_both_implementations_agree_on_random_censuses(both_impls):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    c_impl, reference = both_impls

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        census=st.lists(_entry_strategy(st), max_size=5),
        path=st.sampled_from(["residency", "books"]),
    )
    def check(census: list[Any], path: str) -> None:
        assert _outcome(c_impl, census, path) == _outcome(
            reference, census, path
        )

    check()


# ---- the constructor's own arguments ---------------------------------------


class Device:
    """A device object only the keyword dict below holds."""

    def __init__(self, name: str) -> None:
        self.name = name


def scenario_keyword_dict_emptied_by_the_worker(impl: Any) -> None:
    """StandIn.__new__ called from C with a dict its caller still holds
    (PyObject_Call passes it down as is): the worker's attribute lookup,
    run by the constructor's checks, empties that dict, freeing the only
    references to the id and the devices."""
    kwargs: dict[str, Any] = {}

    class Worker:
        def __getattribute__(self, name: str) -> Any:
            kwargs.clear()
            return object.__getattribute__(self, name)

        def send_command(self, command: str, **kw: Any) -> dict:
            return {}

        def is_alive(self) -> bool:
            return True

    pool = impl.Pool(process_local=True)
    kwargs.update(
        worker=Worker(), worker_generation=1,
        model_id="".join(["m", "o", "d", "e", "l"]) * 3, model_size=SIZE,
        load_device=Device("cuda:0"), offload_device=Device("cpu"),
        kind="".join(["u", "n", "e", "t"]), pool=pool,
    )
    call = ctypes.pythonapi.PyObject_Call
    call.restype = ctypes.py_object
    call.argtypes = [ctypes.py_object] * 3
    s = call(impl.StandIn.__new__, (impl.StandIn,), kwargs)
    assert kwargs == {}
    gc.collect()
    assert s.model_id == "model" * 3 and s.kind == "unet"
    assert s.load_device.name == "cuda:0"
    assert s.offload_device.name == "cpu"


def test_keyword_dict_emptied_during_construction():
    # The C type only: the reference's __new__ is object.__new__, whose
    # keyword dict its own __init__ never sees again.
    isolated(load("c"), scenario_keyword_dict_emptied_by_the_worker)


# ---- keyword arguments of the other C entry points -------------------------
#
# Each scenario calls one C entry point through PyObject_Call with a keyword
# dict it keeps, and empties that dict from Python code the entry point runs
# (the worker, an argument's own __float__ or __bool__, a collection, another
# thread while the GIL is released).  The arguments' finalizers log when they
# are freed: none may be freed before the function is done with it.


def c_call() -> Any:
    """PyObject_Call(callable, args, kwargs): the dict goes down as is."""
    call = ctypes.pythonapi["PyObject_Call"]
    call.restype = ctypes.py_object
    call.argtypes = [ctypes.py_object] * 3
    return call


class Argument:
    """An argument only the keyword dict holds; logs when it is freed."""

    def __init__(self, name: str, log: list[str], value: int = 0) -> None:
        self.name = name
        self.log = log
        self.value = value

    def __str__(self) -> str:
        return self.name

    def __float__(self) -> float:
        return float(self.value)

    def __del__(self) -> None:
        self.log.append(f"freed {self.name}")


def scenario_partially_load_keywords_emptied_by_is_alive(impl: Any) -> None:
    """device_to and extra_memory are read after worker.is_alive()."""
    log: list[str] = []
    kwargs: dict[str, Any] = {}
    sent: list[dict] = []

    class LoadWorker(Worker):
        armed = False

        def is_alive(self) -> bool:
            if self.armed:
                kwargs.clear()
                log.append("cleared")
            return True

        def send_command(self, command: str, **kw: Any) -> Any:
            log.append("sent")
            sent.append(kw)
            return {"loaded": kw["extra_bytes"]}

    worker = LoadWorker()
    pool = impl.Pool(process_local=True)
    s = impl.StandIn(worker, 1, "m", SIZE, "cuda:0", "cpu", pool=pool)
    worker.armed = True
    kwargs.update(
        device_to=Argument("cuda:1", log),
        extra_memory=Argument("extra", log, 300),
    )
    assert c_call()(s.partially_load, (), kwargs) == 300
    assert log[:2] == ["cleared", "sent"], log
    assert sorted(log[2:]) == ["freed cuda:1", "freed extra"], log
    assert sent == [{"model_id": "m", "extra_bytes": 300, "device": "cuda:1"}]


def scenario_partially_unload_keywords_emptied_by_float(impl: Any) -> None:
    """memory_to_free's own __float__ empties the dict and answers a float
    subclass: CPython names the object's type in a DeprecationWarning after
    __float__ returned, so it must still be alive then."""
    import warnings

    log: list[str] = []
    kwargs: dict[str, Any] = {}

    class Bytes(float):
        pass

    class Amount:
        def __float__(self) -> Any:
            kwargs.clear()
            log.append("cleared")
            return Bytes(400.0)

        def __del__(self) -> None:
            log.append("freed")

    pool, worker, table = setup(
        impl, ids=("m",),
        model_partial_unload=lambda: {"freed": 400},
    )
    s = table["m"]
    assert impl.apply_echo(s, SIZE)
    kwargs.update(device_to="cpu", memory_to_free=Amount())
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda *a, **k: log.append("warned")
        freed = c_call()(s.partially_unload, (), kwargs)
    assert log == ["cleared", "warned", "freed"], log
    assert freed == 400 and s.loaded_size() == SIZE - 400


def scenario_attach_board_keywords_emptied_by_a_collection(impl: Any) -> None:
    """attach_board makes no container object between assigning the slot
    and storing the board.  It made the stand-in's inner module there,
    and a collection ran in that allocation (Python 3.10 and 3.11 collect
    inside an allocation): a gc callback, as a finalizer could, emptied
    the keywords dict with the board half attached.  A collection is run
    at each of the call's allocations in turn: one at least runs inside
    the call, none finds the slot assigned and the board not stored (where
    it would empty the dict), and every attach holds its board."""
    import weakref

    log: list[str] = []
    kwargs: dict[str, Any] = {}
    state = {"calling": False}
    pool, worker, table = setup(impl, ids=())
    s: Any = None
    ref: Any = None
    model_id = ""

    def on_free(dead: Any) -> None:
        if dead is ref:  # the board of this attempt, not an earlier one
            log.append("freed")

    def on_collection(phase: str, info: dict) -> None:
        if phase != "start" or not state["calling"]:
            return
        log.append("during")
        board = ref() if ref is not None and kwargs else None
        if board is None:
            return
        inside = s.board is None and board.find(model_id) is not None
        del board
        if inside:
            kwargs.clear()
            log.append("cleared")

    # Arguments converted up front: the call allocates no container
    # object before attach_board's own.
    call = ctypes.pythonapi["PyObject_Call"]
    call.restype = ctypes.py_object
    threshold = gc.get_threshold()
    gc.callbacks.append(on_collection)
    gc.set_threshold(100)
    try:
        # A collection runs in the allocation that takes the count of new
        # container objects past 100: each attempt allocates one more
        # before the call, so the collection moves through the call's
        # allocations one by one.
        for extra in range(101):
            model_id = f"m{extra}"
            s = impl.StandIn(worker, 1, model_id, SIZE, "cuda:0", "cpu",
                             pool=pool)
            worker_side, fd = impl.Board.make(4)
            board = impl.Board.adopt(fd, 4)
            os.close(fd)
            worker_side.close()
            ref = weakref.ref(board, on_free)
            kwargs.update(board=board)
            args = [ctypes.py_object(s.attach_board), ctypes.py_object(()),
                    ctypes.py_object(kwargs)]
            padding: list[list] = []
            gc.collect()
            for _ in range(extra):
                padding.append([])
            state["calling"] = True
            slot = call(*args)
            state["calling"] = False
            del padding
            assert s.board == (board, slot), (extra, s.board)
            assert board.find(model_id) == slot and s.loaded_size() == 0
            del board
            ref = None  # this board now lives as long as this stand-in
            kwargs.clear()
    finally:
        state["calling"] = False
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_collection)
    assert "during" in log, "no collection ran inside attach_board"
    assert "cleared" not in log and "freed" not in log, log


def scenario_apply_echo_keywords_emptied_by_a_flag(impl: Any) -> None:
    """unmapped's __bool__ empties the dict: resident and seq are read
    after it."""
    log: list[str] = []
    kwargs: dict[str, Any] = {}

    class Count(int):
        def __del__(self) -> None:
            log.append(f"freed {int(self)}")

    class Flag:
        def __bool__(self) -> bool:
            kwargs.clear()
            log.append("cleared")
            return False

    pool, worker, table = setup(impl, ids=("m",))
    s = table["m"]
    kwargs.update(standin=s, resident=Count(600), seq=Count(7),
                  unmapped=Flag())
    assert c_call()(impl.apply_echo, (), kwargs) is True
    assert log[0] == "cleared", log
    assert sorted(log[1:]) == ["freed 600", "freed 7"], log
    assert s.loaded_size() == 600 and s.receipt()[1] == 7


def scenario_board_adopt_keywords_emptied_while_the_gil_is_released(
    impl: Any,
) -> None:
    """Board.adopt releases the GIL to check and map the descriptor:
    another thread empties the dict then; the arguments were read before
    (the board adopted has the slots asked for)."""
    import itertools
    import threading

    log: list[str] = []
    kwargs: dict[str, Any] = {}

    class Slots(int):
        def __del__(self) -> None:
            log.append("freed")

    def other(gate: Any) -> None:
        with gate:  # released from C just before the call below
            kwargs.clear()
            log.append("cleared")

    worker_side, fd = impl.Board.make(3)
    call = c_call()
    sys.setswitchinterval(1e-4)
    try:
        for skip in (10**6, 10**7, 10**8):
            log.clear()
            gate = threading.Lock()
            gate.acquire()
            thread = threading.Thread(target=other, args=(gate,))
            thread.start()
            kwargs.update(fd=fd, slots=Slots(3))
            # One C call: release the gate, spin in C (no eval breaker, so
            # the other thread waits for the GIL and asks for it), then
            # Board.adopt, whose GIL release hands it over.
            steps = itertools.chain(
                [(gate.release, (), {})],
                itertools.islice(
                    itertools.repeat((impl.Board.adopt, (), kwargs)), skip,
                    skip + 1,
                ),
            )
            adopted = list(itertools.starmap(call, steps))[-1]
            assert adopted.slots == 3
            adopted.close()
            del adopted
            log.append("returned")
            thread.join()
            if log.index("cleared") < log.index("returned"):
                break
    finally:
        os.close(fd)
        worker_side.close()
    assert log == ["cleared", "freed", "returned"], log


@pytest.mark.parametrize(
    "scenario",
    [
        scenario_partially_load_keywords_emptied_by_is_alive,
        scenario_partially_unload_keywords_emptied_by_float,
        pytest.param(
            scenario_attach_board_keywords_emptied_by_a_collection,
            marks=pytest.mark.skipif(
                sys.version_info >= (3, 12),
                reason="from 3.12 on an allocation only schedules a "
                "collection: no Python runs inside attach_board",
            ),
        ),
        scenario_apply_echo_keywords_emptied_by_a_flag,
        scenario_board_adopt_keywords_emptied_while_the_gil_is_released,
    ],
    ids=lambda f: f.__name__.removeprefix("scenario_"),
)
def test_keyword_dict_emptied_during_the_call(scenario):
    # The C entry points only: a Python function's frame owns its keyword
    # arguments.
    isolated(load("c"), scenario)
