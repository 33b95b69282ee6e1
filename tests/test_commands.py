"""Commands and their failures (docs/semantics.md
"Commands"): partially_load, partially_unload, detach, pressure."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import pytest

SIZE = 10_000
FLOOR = 300 << 20


def naming(field: str, value: object) -> str:
    return f"(?s){re.escape(field)}.*{re.escape(repr(value))}"


class FakeWorker:
    """A scripted worker.

    ``replies`` is a queue: each send pops one item; a BaseException is
    raised, a callable is called with (command, kwargs), anything else is
    returned as the reply.  An empty queue answers ``{}``.  With
    ``die_on_send`` the process dies during the send (is_alive() turns
    False and the transport raises)."""

    def __init__(self) -> None:
        self.alive = True
        self.die_on_send = False
        self.replies: list[Any] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __repr__(self) -> str:
        return f"<FakeWorker alive={self.alive}>"

    def send_command(self, command: str, **kwargs: Any) -> Any:
        self.calls.append((command, kwargs))
        if self.die_on_send:
            self.alive = False
            raise ConnectionResetError("worker pipe closed")
        action = self.replies.pop(0) if self.replies else {}
        if isinstance(action, BaseException):
            raise action
        if callable(action):
            return action(command, kwargs)
        return action

    def is_alive(self) -> bool:
        return self.alive


@pytest.fixture
def worker():
    return FakeWorker()


@pytest.fixture
def s(impl, pool, worker):
    """A stand-in of SIZE bytes, nothing resident yet."""
    return impl.StandIn(
        worker, 1, "unet", SIZE, "cuda:0", "cpu", kind="unet", pool=pool
    )


def resident(impl, s, loaded, seq=None):
    """Put `loaded` bytes on the card by an echo; forget the command log."""
    impl.apply_echo(s, loaded, seq=seq)
    s.worker.calls.clear()


def receipt(s):
    loaded, seq, _, source = s.receipt()
    return loaded, seq, source


def books_of(pool, s):
    return pool._ledger.find(s.worker)


GARBAGE_KINDS = [
    "not a dict",
    "missing",
    "str",
    "float",
    "none",
    "bool",
    "negative",
    "nan",
    "beyond size",
    "huge",
]


def garbage(field: str, kind: str) -> tuple[Any, str, Any]:
    """(reply, field path named by the error, offending value)."""
    path = f"reply[{field!r}]"
    values = {
        "str": "5",
        "float": 5.0,
        "none": None,
        "bool": True,
        "negative": -1,
        "nan": math.nan,
        "beyond size": SIZE + 1,
        "huge": 2**64,
    }
    if kind == "not a dict":
        return [(field, 5)], "reply", [(field, 5)]
    if kind == "missing":
        return {"resident": 0, "seq": 1}, path, None
    value = values[kind]
    return {field: value, "seq": 1}, path, value


BAD_OPTIONAL = [
    ("resident", -1),
    ("resident", SIZE + 1),
    ("resident", "0"),
    ("resident", True),
    ("resident", 1.0),
    ("seq", -1),
    ("seq", "3"),
    ("seq", True),
    ("seq", 3.0),
    ("seq", 2**63),
]

NOT_DICTS = [None, [], "ok", 5, ({"freed": 1},), b"{}"]


# ---- partially_load ---------------------------------------------------------


@pytest.mark.parametrize(
    "extra, expected",
    [
        (0, SIZE),
        (None, SIZE),
        (-5, SIZE),
        (-math.inf, SIZE),
        (math.inf, SIZE),
        (math.nan, SIZE),
        (1e32, SIZE),
        (SIZE, SIZE),
        (SIZE + 1, SIZE),
        (2**80, SIZE),
        (100, 100),
        (100.9, 101),  # rounded up: see test_scenarios fractional target
        (0.25, 1),
        (1, 1),
    ],
)
def test_load_clamps_the_request(s, worker, extra, expected):
    worker.replies.append({"loaded": 7, "resident": 7, "seq": 1})
    assert s.partially_load("cuda:0", extra) == 7
    ((command, kwargs),) = worker.calls
    assert command == "model_partial_load"
    assert kwargs == {
        "model_id": "unet",
        "extra_bytes": expected,
        "device": "cuda:0",
    }
    assert type(kwargs["extra_bytes"]) is int


def test_load_sends_the_device_as_str(s, worker):
    class Dev:
        def __str__(self):
            return "cuda:1"

    worker.replies.append({"loaded": 0})
    assert s.partially_load(Dev(), 0, force_patch_weights=True) == 0
    assert worker.calls[0][1]["device"] == "cuda:1"


def test_load_applies_the_reply(impl, pool, s, worker):
    resident(impl, s, 1000, seq=3)
    worker.replies.append({"loaded": 2500, "resident": 3500, "seq": 4})
    assert s.partially_load("cuda:0", 2500) == 2500
    assert receipt(s) == (3500, 4, "load echo")
    assert s.device == "cuda:0"
    assert books_of(pool, s).charge()["sum_peak"] == 3500


def test_load_reply_from_an_old_worker(impl, s, worker):
    resident(impl, s, 1000, seq=3)
    worker.replies.append({"loaded": 2500})
    assert s.partially_load("cuda:0") == 2500
    assert receipt(s) == (3500, 3, "load echo")
    worker.replies.append({"loaded": SIZE})
    assert s.partially_load("cuda:0") == SIZE
    assert receipt(s) == (SIZE, 3, "load echo")  # clamped to the size


def test_load_in_flight_raises_the_peak(impl, pool, s, worker):
    resident(impl, s, 4000)
    with pool.call(worker):
        worker.replies.append({"loaded": 0, "resident": 1000})
        s.partially_load("cuda:0", 1)
        charge = books_of(pool, s).charge()
        assert charge["sum_peak"] == 4000
        assert charge["charge"] == SIZE + FLOOR
    charge = books_of(pool, s).charge()
    assert charge["in_flight"] == 0
    assert charge["charge"] == 4000 + FLOOR


def test_load_of_an_empty_model_sends_nothing(impl, pool, worker):
    empty = impl.StandIn(worker, 1, "e", 0, "cuda:0", "cpu", pool=pool)
    assert empty.partially_load("cuda:0", 1e32) == 0
    assert worker.calls == []


def test_load_on_a_dead_worker_raises(impl, pool, s, worker):
    resident(impl, s, 500, seq=1)
    worker.alive = False
    with pytest.raises(impl.WorkerGoneError) as info:
        s.partially_load("cuda:0")
    message = str(info.value)
    assert "'unet'" in message and "reload the node" in message
    assert worker.calls == []
    # A dead process took its VRAM with it.
    assert books_of(pool, s).alive is False
    assert receipt(s) == (0, 1, "worker gone")


def test_load_on_a_gone_worker_raises(impl, pool, s, worker):
    pool.worker_gone(worker)
    with pytest.raises(impl.WorkerGoneError, match="reload the node"):
        s.partially_load("cuda:0")
    assert worker.calls == []


def test_load_dies_during_send(impl, pool, s, worker):
    resident(impl, s, 500, seq=1)
    worker.die_on_send = True
    with pytest.raises(impl.WorkerGoneError, match="'unet'") as info:
        s.partially_load("cuda:0")
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert books_of(pool, s).alive is False
    assert receipt(s) == (0, 1, "worker gone")


@pytest.mark.parametrize(
    "error", [TimeoutError("busy"), RuntimeError("worker error: oom")]
)
def test_load_failure_on_a_live_worker_reraises(impl, pool, s, worker, error):
    resident(impl, s, 500, seq=1)
    worker.replies.append(error)
    with pytest.raises(type(error)) as info:
        s.partially_load("cuda:0")
    assert info.value is error
    assert books_of(pool, s).alive is True
    assert receipt(s) == (500, 1, "load echo")


@pytest.mark.parametrize("kind", GARBAGE_KINDS)
def test_load_garbage_reply(impl, pool, s, worker, kind):
    resident(impl, s, 500, seq=1)
    reply, path, value = garbage("loaded", kind)
    worker.replies.append(reply)
    pattern = naming(path, value) if value is not None else re.escape(path)
    with pytest.raises(impl.EchoError, match=pattern) as info:
        s.partially_load("cuda:0")
    assert isinstance(info.value, ValueError)
    assert "model_partial_load" in str(info.value)
    assert s.bad_replies == 1
    assert receipt(s) == (500, 1, "load echo")
    assert books_of(pool, s).charge()["sum_peak"] == 500


@pytest.mark.parametrize("field, value", BAD_OPTIONAL)
def test_load_bad_optional_field(impl, s, worker, field, value):
    resident(impl, s, 500, seq=1)
    worker.replies.append({"loaded": 10, field: value})
    with pytest.raises(
        impl.EchoError, match=naming(f"reply[{field!r}]", value)
    ):
        s.partially_load("cuda:0")
    assert s.bad_replies == 1
    assert receipt(s) == (500, 1, "load echo")


@pytest.mark.parametrize("reply", NOT_DICTS)
def test_load_reply_not_a_dict(impl, s, worker, reply):
    worker.replies.append(reply)
    with pytest.raises(impl.EchoError, match=re.escape(repr(reply))):
        s.partially_load("cuda:0")
    assert s.bad_replies == 1
    assert receipt(s) == (0, None, "registered")


# ---- partially_unload -------------------------------------------------------


def test_unload_with_nothing_resident_sends_nothing(s, worker):
    assert s.partially_unload("cpu", 1e32) == 0
    assert s.partially_unload("cpu", 0) == 0
    assert worker.calls == []
    assert s.eviction_deferred is False


@pytest.mark.parametrize(
    "ask, expected",
    [
        (0, 4000),
        (None, 4000),
        (-1, 4000),
        (math.nan, 4000),
        (math.inf, 4000),
        (-math.inf, 4000),
        (1e32, 4000),
        (4000, 4000),
        (4001, 4000),
        (SIZE, 4000),
        (2**100, 4000),
        (1500, 1500),
        (1500.7, 1501),  # rounded up: freed >= the float ComfyUI asked
        (0.2, 1),
    ],
)
def test_unload_clamps_the_request(impl, s, worker, ask, expected):
    resident(impl, s, 4000, seq=1)
    worker.replies.append({"freed": expected, "seq": 2})
    assert s.partially_unload("cpu", ask) == expected
    ((command, kwargs),) = worker.calls
    assert command == "model_partial_unload"
    assert kwargs == {"model_id": "unet", "bytes_to_free": expected}
    assert type(kwargs["bytes_to_free"]) is int
    assert receipt(s) == (4000 - expected, 2, "unload echo")


@pytest.mark.parametrize("freed", [0, 300, 4000, 6000])
def test_unload_returns_exactly_what_was_freed(impl, pool, s, worker, freed):
    resident(impl, s, 4000, seq=1)
    worker.replies.append({"freed": freed, "resident": 1234, "seq": 5})
    assert s.partially_unload("cpu", 1000) == freed
    assert receipt(s) == (1234, 5, "unload echo")
    assert s.device == "cuda:0"
    assert s.eviction_deferred is False


def test_unload_reply_from_an_old_worker(impl, s, worker):
    resident(impl, s, 4000, seq=9)
    worker.replies.append({"freed": 1500})
    assert s.partially_unload("cpu", 1500) == 1500
    assert receipt(s) == (2500, 9, "unload echo")
    worker.replies.append({"freed": 9000})
    assert s.partially_unload("cpu") == 9000
    assert receipt(s) == (0, 9, "unload echo")
    assert s.device == "cpu"


def test_unload_in_flight_keeps_the_peak(impl, pool, s, worker):
    resident(impl, s, 4000)
    pool.begin_call(worker)
    worker.replies.append({"freed": 3000})
    assert s.partially_unload("cpu", 3000) == 3000
    assert books_of(pool, s).charge()["sum_peak"] == 4000
    pool.end_call(worker)
    assert books_of(pool, s).charge()["charge"] == 4000 + FLOOR


def test_unload_dead_worker_is_the_gone_path(impl, pool, s, worker):
    resident(impl, s, 4000, seq=3)
    other = impl.StandIn(worker, 1, "vae", 100, "cuda:0", "cpu", pool=pool)
    resident(impl, other, 60)
    pressure = []
    pool.on_pressure = pressure.append
    worker.alive = False
    assert s.partially_unload("cpu", 1000) == 4000
    assert worker.calls == []
    assert receipt(s) == (0, 3, "worker gone")
    assert s.device == "cpu"
    assert other.loaded_size() == 0
    assert books_of(pool, s).alive is False
    assert pool.worker_charges()[worker] == 0
    assert pressure == []
    assert s.eviction_deferred is False


def test_unload_dies_during_send(impl, pool, s, worker):
    resident(impl, s, 4000, seq=3)
    pressure = []
    pool.on_pressure = pressure.append
    worker.die_on_send = True
    assert s.partially_unload("cpu", 1000) == 4000
    assert len(worker.calls) == 1
    assert receipt(s) == (0, 3, "worker gone")
    assert books_of(pool, s).alive is False
    assert pressure == []


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError("lock wait exceeded 30 s"),
        RuntimeError("worker busy"),
        ValueError("error reply"),
        OSError("transport hiccup"),
    ],
)
def test_unload_refused_by_a_live_worker_defers(impl, pool, s, worker, error):
    resident(impl, s, 4000, seq=3)
    pressure = []
    pool.on_pressure = pressure.append
    worker.replies.append(error)
    assert s.partially_unload("cpu", 1000) == 0
    assert receipt(s) == (4000, 3, "load echo")
    assert s.eviction_deferred is True
    assert books_of(pool, s).alive is True
    assert pressure == [1000]
    assert s.bad_replies == 0
    # The next echo clears the deferral.
    worker.replies.append({"freed": 1000, "seq": 4})
    assert s.partially_unload("cpu", 1000) == 1000
    assert s.eviction_deferred is False


GARBAGE_REPLIES = (
    [garbage("freed", kind)[0] for kind in GARBAGE_KINDS]
    + [{"freed": 10, field: value} for field, value in BAD_OPTIONAL]
    + NOT_DICTS
)


@pytest.mark.parametrize("reply", GARBAGE_REPLIES, ids=repr)
def test_unload_garbage_reply_defers(impl, pool, s, worker, reply):
    resident(impl, s, 4000, seq=3)
    books_before = books_of(pool, s).charge()
    pressure = []
    pool.on_pressure = pressure.append
    worker.replies.append(reply)
    assert s.partially_unload("cpu", 1000) == 0
    assert receipt(s) == (4000, 3, "load echo")
    assert s.bad_replies == 1
    assert s.eviction_deferred is True
    assert pressure == [1000]
    assert books_of(pool, s).charge() == books_before
    worker.replies.append(reply)
    assert s.partially_unload("cpu") == 0
    assert s.bad_replies == 2
    assert pressure == [1000, 4000]


def test_unload_pressure_gets_the_shortfall(impl, pool, s, worker):
    resident(impl, s, 4000)
    pressure = []
    pool.on_pressure = pressure.append
    worker.replies.append({"freed": 300})
    assert s.partially_unload("cpu", 1000) == 300
    assert pressure == [700]
    worker.replies.append({"freed": 1000})
    assert s.partially_unload("cpu", 1000) == 1000
    worker.replies.append({"freed": 2000})
    assert s.partially_unload("cpu", 1000) == 2000
    assert pressure == [700]


def test_unload_pressure_exceptions_are_logged(impl, pool, s, worker, caplog):
    resident(impl, s, 4000)
    calls = []

    def on_pressure(shortfall):
        calls.append(shortfall)
        raise RuntimeError("sibling shrink failed")

    pool.on_pressure = on_pressure
    worker.replies.append({"freed": 0})
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        assert s.partially_unload("cpu", 1000) == 0
    assert calls == [1000]
    assert any(r.name == "comfy_standin" for r in caplog.records)
    worker.replies.append(TimeoutError())
    assert s.partially_unload("cpu", 1000) == 0
    assert calls == [1000, 1000]


def test_unload_never_raises_even_when_everything_fails(impl, pool, s):
    class Hostile:
        def send_command(self, command, **kwargs):
            raise KeyError("no")

        def is_alive(self):
            raise OSError("cannot tell")

    hostile = Hostile()
    t = impl.StandIn(hostile, 1, "m", 100, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(t, 50)
    pool.on_pressure = lambda shortfall: 1 / 0
    result = t.partially_unload("cpu", 10)
    assert result in (0, 50)
    assert t.detach() is t


# ---- detach -----------------------------------------------------------------


def test_detach_sends_model_to_device(impl, pool, s, worker):
    resident(impl, s, 4000, seq=3)
    books_of(pool, s).begin_call()
    impl.apply_echo(s, 4000, in_flight=True)
    books_of(pool, s).end_call()
    worker.calls.clear()
    assert s.detach() is s
    assert worker.calls == [
        ("model_to_device", {"model_id": "unet", "device": "cpu"})
    ]
    assert receipt(s) == (0, 3, "detach echo")
    assert s.device == "cpu"
    assert books_of(pool, s).charge()["sum_peak"] == 0
    # Idempotent: already offloaded, no command.
    assert s.detach(unpatch_all=False) is s
    assert len(worker.calls) == 1


def test_detach_reply_seq(impl, s, worker):
    resident(impl, s, 4000, seq=3)
    worker.replies.append({"device": "cpu", "moved": 4000, "seq": 8})
    s.detach()
    assert receipt(s) == (0, 8, "detach echo")


def test_detach_with_nothing_resident_sends_nothing(s, worker):
    assert s.detach() is s
    assert worker.calls == []


@pytest.mark.parametrize("how", ["dead before", "dies during send"])
def test_detach_gone_path(impl, pool, s, worker, how):
    resident(impl, s, 4000, seq=3)
    if how == "dead before":
        worker.alive = False
    else:
        worker.die_on_send = True
    assert s.detach() is s
    assert len(worker.calls) == (0 if how == "dead before" else 1)
    assert receipt(s) == (0, 3, "worker gone")
    assert books_of(pool, s).alive is False


def test_detach_not_registered(impl, pool, s, worker):
    other = impl.StandIn(worker, 1, "vae", 100, "cuda:0", "cpu", pool=pool)
    resident(impl, other, 60, seq=2)
    resident(impl, s, 4000, seq=3)
    worker.replies.append(RuntimeError("model 'unet' not registered"))
    assert s.detach() is s
    assert receipt(s) == (0, 3, "worker gone")
    assert s.device == "cpu"
    assert s.eviction_deferred is False
    books = books_of(pool, s)
    assert books.alive is True
    assert books.charge()["sum_peak"] == 60
    assert receipt(other) == (60, 2, "load echo")


@pytest.mark.parametrize(
    "failure",
    [
        TimeoutError("busy"),
        RuntimeError("worker error: cuda"),
        *NOT_DICTS,
        {"seq": -1},
        {"seq": "1"},
        {"seq": True},
    ],
    ids=repr,
)
def test_detach_failure_defers(impl, pool, s, worker, failure):
    resident(impl, s, 4000, seq=3)
    worker.replies.append(failure)
    assert s.detach() is s
    assert receipt(s) == (4000, 3, "load echo")
    assert s.eviction_deferred is True
    assert books_of(pool, s).alive is True
    bad = 0 if isinstance(failure, BaseException) else 1
    assert s.bad_replies == bad


def test_old_worker_detach_reply(impl, s, worker):
    resident(impl, s, 4000, seq=3)
    worker.replies.append({})
    s.detach()
    assert receipt(s) == (0, 3, "detach echo")


# ---- stale stand-ins --------------------------------------------------------


def test_stale_standin_never_touches_the_new_generation(impl, pool, s, worker):
    resident(impl, s, 4000, seq=3)
    pool.restarted(worker, 2)
    new = impl.StandIn(worker, 2, "unet", SIZE, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(new, 700, seq=1)
    worker.calls.clear()
    worker.alive = False  # e.g. the new process is not up yet
    assert s.partially_unload("cpu", 1000) == 0
    assert s.detach() is s
    with pytest.raises(impl.WorkerGoneError, match="reload the node"):
        s.partially_load("cuda:0")
    s.model_loaded_weight_memory = 10
    assert worker.calls == []
    books = books_of(pool, new)
    assert books.alive is True and books.generation == 2
    assert receipt(new) == (700, 1, "load echo")
    assert receipt(s) == (0, 3, "worker gone")
    assert s.stale and not new.stale


# ---- a forgotten worker's death (issue 8, defect 9) -------------------------


@pytest.mark.parametrize("method", ["partially_unload", "detach"])
def test_forgotten_worker_death_is_recorded_once(
    impl, pool, s, worker, method
):
    """After pool.forget(worker) and the worker's death, the stand-in
    still learns of it on its eviction path, and the bytes are reported
    freed once only."""
    resident(impl, s, 500, seq=1)
    pool.forget(worker)
    worker.alive = False
    first = (s.partially_unload("cpu", 100) if method == "partially_unload"
             else s.detach())
    if method == "partially_unload":
        assert first == 500
    assert s.stale
    assert s.loaded_size() == 0
    assert receipt(s)[2] == "worker gone"
    assert s.partially_unload("cpu", 100) == 0
    assert s.partially_unload("cpu", 100) == 0
    assert impl.apply_echo(s, 300) is False
    assert s.loaded_size() == 0
    assert worker.calls == []


def test_pool_worker_gone_after_forget_reaches_the_standins(
    impl, pool, s, worker
):
    resident(impl, s, 500, seq=1)
    pool.forget(worker)
    worker.alive = False
    pool.worker_gone(worker)
    assert s.stale and s.loaded_size() == 0
    assert impl.apply_echo(s, 300) is False
    assert s.partially_unload("cpu", 100) == 0
    assert worker.calls == []
    assert pool.graveyard_size() == 1  # kept until the boundary
    pool.boundary()
    assert pool.graveyard_size() == 0


def test_pool_worker_gone_after_forget_spares_a_new_generation(
    impl, pool, s, worker
):
    """A stand-in registered after the forget (new books) dies with the
    worker too, the old one as well; nothing else is touched."""
    resident(impl, s, 500, seq=1)
    pool.forget(worker)
    other = FakeWorker()
    t = impl.StandIn(other, 1, "unet", SIZE, "cuda:0", "cpu", pool=pool)
    resident(impl, t, 700)
    pool.worker_gone(worker)
    assert s.stale
    assert not t.stale and t.loaded_size() == 700


@pytest.mark.parametrize("how", ["sibling", "pool"])
def test_forgotten_worker_death_zeroes_every_sibling(
    impl, pool, s, worker, how
):
    """Issue 8 defects 9 and 10: after pool.forget(worker), whoever learns
    of the death first (a sibling's command, or pool.worker_gone), every
    stand-in of the worker reads 0 / "worker gone", not deferred (the
    reference's s turned stale but kept its receipt and deferred flag)."""
    sibling = impl.StandIn(worker, 1, "vae", SIZE, "cuda:0", "cpu",
                           pool=pool)
    resident(impl, s, 500, seq=1)
    resident(impl, sibling, 300, seq=2)
    worker.replies = [TimeoutError("worker busy")]
    assert s.partially_unload("cpu", 100) == 0
    assert s.eviction_deferred
    pool.forget(worker)
    worker.alive = False
    if how == "sibling":
        assert sibling.partially_unload("cpu", 100) == 300
    else:
        pool.worker_gone(worker)
    for t, seq in ((s, 1), (sibling, 2)):
        assert t.stale
        assert receipt(t) == (0, seq, "worker gone")
        assert not t.eviction_deferred
    assert s.partially_unload("cpu", 100) == 0


def test_model_id_is_stored_and_sent_as_an_exact_str(impl, pool, worker):
    class Id(str):
        def __hash__(self) -> int:
            raise AssertionError("the host hashed the caller's id")

    t = impl.StandIn(worker, 1, Id("unet"), SIZE, "cuda:0", "cpu",
                     pool=pool)
    assert type(t.model_id) is str and t.model_id == "unet"
    worker.replies.append({"loaded": 5})
    assert t.partially_load("cuda:0", 5) == 5
    [(_, kwargs)] = worker.calls
    assert type(kwargs["model_id"]) is str


@pytest.mark.parametrize("how", ["eviction", "pool"])
def test_eviction_deferred_clears_when_the_worker_is_gone(
    impl, pool, s, worker, how
):
    resident(impl, s, 500)
    worker.replies = [TimeoutError("worker busy")]
    assert s.partially_unload("cpu", 100) == 0
    assert s.eviction_deferred
    worker.alive = False
    if how == "eviction":
        assert s.partially_unload("cpu", 100) == 500
    else:
        pool.worker_gone(worker)
    assert s.stale
    assert not s.eviction_deferred
