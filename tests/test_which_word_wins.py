"""Which word wins (docs/semantics.md): a reply that says nothing moved
never writes 0; an echo older than the receipt writes nothing; a valid
board reading measured after the receipt wins over it, one measured
before it loses; and the pool charges a worker with the figure its
stand-ins answer.  Both implementations, against comfy-env 0.4.46's
replies as its worker sends them (isolation/workers/_persistent_worker.py,
_handle_model_to_device and _handle_model_partial)."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import fakes
import pytest
from mock_fixtures import mock_mm as _mm
from mock_fixtures import pool  # noqa: F401  (Linux, floor 0)

from comfy_standin import _core

MiB = 1 << 20
SIZE = 8 * MiB


class Worker:
    """Answers each command with the next reply of `replies`."""

    def __init__(self, *replies: Any) -> None:
        self.replies = list(replies)
        self.sent: list[str] = []

    def send_command(self, command: str, **kwargs: Any) -> Any:
        self.sent.append(command)
        return self.replies.pop(0)

    def is_alive(self) -> bool:
        return True


def standin(impl, pool, worker, resident=SIZE, seq=4):  # noqa: F811
    s = impl.StandIn(worker, 1, "m", SIZE, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, resident, seq=seq)
    return s


def receipt(s) -> tuple[Any, ...]:
    loaded, seq, _, source = s.receipt()
    return loaded, seq, source


# ---- a. a reply that says nothing moved never writes 0 -------------------


def test_a_detach_that_moved_nothing_writes_nothing_and_is_deferred(
    impl, pool, caplog  # noqa: F811
):
    """comfy-env's worker answers {device, moved: False, seq} when the
    model's first parameter is on the offload device already, whatever
    else of it is on the card: no byte was freed, so the receipt stays
    (bytes, seq, source), and the eviction is deferred."""
    w = Worker({"status": "ok", "device": "cpu", "moved": False, "seq": 9})
    s = standin(impl, pool, w)
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        assert s.detach() is s
    assert receipt(s) == (SIZE, 4, "load echo")
    assert s.loaded_size() == SIZE and s.eviction_deferred
    assert s.current_loaded_device() == "cuda:0"
    assert caplog.messages == [
        "comfy_standin: model_to_device of model 'm' deferred: the worker "
        "moved nothing (moved: False)"
    ]


@pytest.mark.parametrize("moved", [True, None, 4 * MiB])
def test_a_detach_that_moved_writes_zero(impl, pool, moved):  # noqa: F811
    """moved True (or absent: an older worker; or a byte count above 0)."""
    reply = {"status": "ok", "device": "cpu", "seq": 9}
    if moved is not None:
        reply["moved"] = moved
    s = standin(impl, pool, Worker(reply))
    s.detach()
    assert receipt(s) == (0, 9, "detach echo") and not s.eviction_deferred


@pytest.mark.parametrize("moved", [0, False])
def test_moved_zero_or_false_is_nothing_moved(impl, pool, moved):  # noqa
    s = standin(impl, pool, Worker({"moved": moved, "seq": 9}))
    s.detach()
    assert receipt(s) == (SIZE, 4, "load echo") and s.eviction_deferred


@pytest.mark.parametrize("moved", ["yes", -1, 1.0, [True]])
def test_a_moved_that_is_neither_a_bool_nor_a_count_is_a_bad_reply(
    impl, pool, moved  # noqa: F811
):
    s = standin(impl, pool, Worker({"moved": moved, "seq": 9}))
    s.detach()
    assert receipt(s) == (SIZE, 4, "load echo")
    assert s.bad_replies == 1 and s.eviction_deferred


@pytest.mark.parametrize(
    "reply, written",
    [
        # the plain-module path: nothing on the card by its first parameter
        ({"freed": 0, "resident": 0}, None),
        # the patcher path: measured by the real patcher, nothing freed
        ({"freed": 0, "resident": 5 * MiB, "seq": 6}, (5 * MiB, 6)),
        ({"freed": 0, "resident": 0, "seq": 6}, None),
        # an older worker: no resident, nothing freed
        ({"freed": 0}, None),
        # something moved: its resident is written, 0 included
        ({"freed": SIZE, "resident": 0, "seq": 6}, (0, 6)),
        ({"freed": 3 * MiB}, (5 * MiB, 4)),
    ],
)
def test_an_unload_that_freed_nothing_never_writes_zero(
    impl, pool, reply, written  # noqa: F811
):
    s = standin(impl, pool, Worker(reply))
    assert s.partially_unload("cpu", MiB) == reply["freed"]
    if written is None:
        assert receipt(s) == (SIZE, 4, "load echo")
    else:
        assert receipt(s) == (*written, "unload echo")


@pytest.mark.parametrize(
    "reply, written",
    [
        ({"loaded": 0, "resident": 0, "seq": 6}, None),
        ({"loaded": 0}, None),
        ({"loaded": 0, "resident": SIZE}, (SIZE, 2)),
        ({"loaded": 2 * MiB, "resident": 2 * MiB, "seq": 6}, (2 * MiB, 6)),
    ],
)
def test_a_load_that_loaded_nothing_never_writes_zero(
    impl, pool, reply, written  # noqa: F811
):
    s = standin(impl, pool, Worker(reply), resident=MiB, seq=2)
    assert s.partially_load("cuda:0", SIZE) == reply["loaded"]
    if written is None:
        assert receipt(s) == (MiB, 2, "load echo")
    else:
        assert receipt(s)[:2] == written


def test_free_through_comfyui_keeps_bytes_a_detach_did_not_move(
    impl, pool, mm  # noqa: F811
):
    """What the real server showed: ComfyUI's unload_all_models (POST
    /free) runs free_memory, whose model_unload calls detach; the worker's
    model has its first parameter on the CPU and 8 MiB still on the card,
    so it moves nothing.  The stand-in keeps its 8 MiB (never "0, detach
    echo"), ComfyUI drops the entry as it does after any detach, and the
    pool's boundary lists it again, since its worker still holds it."""
    w = fakes.FakeWorker("w")
    w.add_model("m", SIZE, resident=SIZE)
    s = impl.StandIn(w, 1, "m", SIZE, w.load_device, _mm.CPU, pool=pool)
    impl.apply_residency({"m": s}, w.census())
    impl.register(mm, s)
    w.first_parameter_on_cpu("m")
    mm.unload_all_models()
    assert [c for c, _ in w.commands] == ["model_to_device"]
    assert w.resident("m") == SIZE and s.loaded_size() == SIZE
    assert s.receipt()[3] == "census" and s.eviction_deferred
    assert mm.loaded_entry(s) is None  # ComfyUI dropped it
    assert pool.boundary(mm) == [s]
    assert mm.loaded_entry(s) is not None


# ---- b. echo order ---------------------------------------------------------


def test_an_older_reply_applied_after_a_newer_one_writes_nothing(
    impl, pool  # noqa: F811
):
    """Two threads' replies applied out of order: the one with seq 7 lands
    after the one with seq 9.  The receipt keeps seq 9's word, and the
    unload still returns what its reply says was freed."""
    w = Worker({"freed": MiB, "resident": 6 * MiB, "seq": 9},
               {"freed": 2 * MiB, "resident": 7 * MiB, "seq": 7})
    s = standin(impl, pool, w, seq=4)
    assert s.partially_unload("cpu", MiB) == MiB
    assert receipt(s) == (6 * MiB, 9, "unload echo")
    assert s.partially_unload("cpu", 2 * MiB) == 2 * MiB
    assert receipt(s) == (6 * MiB, 9, "unload echo")


def test_a_seq_less_reply_and_a_tie_apply(impl, pool):  # noqa: F811
    w = Worker({"freed": MiB, "resident": 6 * MiB, "seq": 4},
               {"freed": MiB, "resident": 5 * MiB})
    s = standin(impl, pool, w, seq=4)
    s.partially_unload("cpu", MiB)
    assert receipt(s) == (6 * MiB, 4, "unload echo")
    s.partially_unload("cpu", MiB)
    assert receipt(s) == (5 * MiB, 4, "unload echo")


# ---- the board against the receipt ---------------------------------------

board_only = pytest.mark.skipif(
    sys.platform != "linux", reason="the board is a Linux memfd here"
)


def attached(s):
    """The host board attached to `s`, and its worker side (in-process)."""
    side, fd = _core.Board.make(2)
    host = _core.Board.adopt(fd, 2, heartbeat_limit=3600.0)
    os.close(fd)
    slot = s.attach_board(host)
    side.bind(slot, host.tag(slot))
    return host, side, slot


@board_only
def test_a_board_measured_before_an_echo_loses_one_after_it_wins(
    impl, pool  # noqa: F811
):
    """Each slot's stamp is the worker's measurement time: a reading
    measured before the echo was received is older than the echo and
    loses to it; one measured after wins."""
    w = Worker({"status": "ok", "device": "cpu", "moved": True, "seq": 9})
    s = standin(impl, pool, w, resident=0, seq=1)
    host, side, slot = attached(s)
    try:
        side.publish(slot, SIZE)  # measured now: newer than the receipt
        assert s.loaded_size() == SIZE and s.receipt()[3] == "board"
        s.detach()  # an echo after it: 0 bytes, seq 9
        assert s.loaded_size() == 0 and s.receipt()[3] == "detach echo"
        time.sleep(0.002)  # a later measurement has a later stamp
        side.publish(slot, 3 * MiB)
        assert s.loaded_size() == 3 * MiB and s.receipt()[3] == "board"
    finally:
        side.close()
        host.close()


# ---- c. the pool charges the figure the stand-ins answer ------------------


@board_only
def test_a_worker_is_charged_the_figure_its_stand_ins_answer(impl):
    """A worker whose model reads 8 MiB from its board (its receipt says
    0): its charge, what status shows as loaded and what the reserve
    counts are 8 MiB too, not the receipt's 0."""
    pool = impl.Pool(floor=MiB, process_local=True)  # noqa: F811
    w = Worker()
    s = standin(impl, pool, w, resident=0, seq=1)
    host, side, slot = attached(s)
    try:
        side.publish(slot, SIZE)
        assert s.loaded_size() == SIZE
        details = pool.charge_details()[w]
        assert details["sum_loaded"] == SIZE
        assert details["charge"] == SIZE + MiB
        assert pool.worker_charges()[w] == SIZE + MiB
        assert pool._ledger.total_charge() == SIZE + MiB
        assert pool.reserve("cuda:0", 100, 1 << 40) == 100 + SIZE + MiB
        # Two stand-ins of the model share its figure, counted once.
        twin = impl.StandIn(w, 1, "m", SIZE, "cuda:0", "cpu", pool=pool)
        assert twin.loaded_size() == 0  # no board of its own
        assert pool.charge_details()[w]["sum_loaded"] == SIZE
        del twin
        s.detach_board()
        assert pool.charge_details()[w]["sum_loaded"] == 0
    finally:
        side.close()
        host.close()
