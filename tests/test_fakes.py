"""Self-tests of the fake workers (tests/fakes.py)."""

from __future__ import annotations

import math

import fakes
import pytest


MiB = 1024 * 1024


@pytest.fixture
def worker(mm):
    w = fakes.FakeWorker("w")
    w.add_model("m", 100 * MiB)
    return w


def test_partial_load_allocates_and_echoes(worker, sim):
    reply = worker.send_command(
        "model_partial_load",
        model_id="m",
        extra_bytes=30 * MiB,
        device="cuda:0",
    )
    assert reply == {
        "status": "ok",
        "loaded": 30 * MiB,
        "resident": 30 * MiB,
        "seq": 1,
    }
    assert sim.card().held("m", process="w") == 30 * MiB
    assert worker.models["m"].device == "cuda:0"


def test_partial_load_clamps_to_size(worker):
    reply = worker.send_command(
        "model_partial_load", model_id="m", extra_bytes=10**12, device="cuda:0"
    )
    assert reply["loaded"] == reply["resident"] == 100 * MiB


def test_partial_unload_frees_and_counts_seq(worker, sim):
    worker.send_command(
        "model_partial_load",
        model_id="m",
        extra_bytes=100 * MiB,
        device="cuda:0",
    )
    reply = worker.send_command(
        "model_partial_unload", model_id="m", bytes_to_free=40 * MiB
    )
    assert reply == {
        "status": "ok",
        "freed": 40 * MiB,
        "resident": 60 * MiB,
        "seq": 2,
    }
    assert sim.card().used() == 60 * MiB


def test_model_to_device_offloads_and_reloads(worker, sim):
    worker.add_model("n", 10 * MiB, resident=10 * MiB)
    reply = worker.send_command("model_to_device", model_id="n", device="cpu")
    assert reply["moved"] is True
    assert reply["device"] == "cpu"
    assert sim.card().used() == 0
    reply = worker.send_command(
        "model_to_device", model_id="n", device="cuda:0"
    )
    assert reply["moved"] is True
    assert worker.resident("n") == 10 * MiB


def test_model_to_device_moves_nothing_when_the_first_parameter_is_there(
    worker, sim
):
    """comfy-env 0.4.46's worker compares the model's first parameter with
    the target: already there, it moves nothing and answers moved False,
    whatever else of the model is on the card."""
    worker.add_model("n", 10 * MiB, resident=8 * MiB)
    worker.first_parameter_on_cpu("n")
    reply = worker.send_command("model_to_device", model_id="n", device="cpu")
    assert reply["moved"] is False and "seq" in reply
    assert worker.resident("n") == 8 * MiB
    assert sim.card().used() == 8 * MiB


def test_unknown_model_is_not_registered(worker):
    with pytest.raises(fakes.WorkerError, match="not registered"):
        worker.send_command("model_to_device", model_id="zz", device="cpu")
    assert worker.is_alive()


def test_forgotten_model_is_not_registered(worker, sim):
    worker.add_model("n", 10 * MiB, resident=10 * MiB)
    worker.forget_model("n")
    assert sim.card().used() == 0
    with pytest.raises(fakes.WorkerError, match="not registered"):
        worker.send_command("model_to_device", model_id="n", device="cpu")


def test_kill_releases_everything(worker, sim):
    worker.add_model("n", 10 * MiB, resident=10 * MiB)
    worker.kill()
    assert not worker.is_alive()
    assert sim.card().used() == 0
    with pytest.raises(fakes.WorkerDiedError):
        worker.send_command(
            "model_partial_unload", model_id="n", bytes_to_free=1
        )
    assert worker.sent() == [{"model_id": "n", "bytes_to_free": 1}]


def test_die_during_command(worker, sim):
    worker.add_model("n", 10 * MiB, resident=10 * MiB)
    worker.script("die")
    assert worker.is_alive()
    with pytest.raises(fakes.WorkerDiedError):
        worker.send_command(
            "model_partial_unload", model_id="n", bytes_to_free=1
        )
    assert not worker.is_alive()
    assert sim.card().used() == 0


def test_die_after_moves_bytes_then_dies(worker, sim):
    worker.script("die_after")
    with pytest.raises(fakes.WorkerDiedError):
        worker.send_command(
            "model_partial_load", model_id="m", extra_bytes=5, device="cuda:0"
        )
    assert not worker.is_alive()
    assert worker.resident("m") == 5
    assert sim.card().used() == 0


@pytest.mark.parametrize(
    ("kind", "error"),
    [("refuse", fakes.WorkerError), ("timeout", TimeoutError)],
)
def test_refuse_and_timeout_keep_the_worker_and_its_bytes(
    worker, sim, kind, error
):
    worker.add_model("n", 10 * MiB, resident=10 * MiB)
    worker.script(kind)
    with pytest.raises(error):
        worker.send_command(
            "model_partial_unload", model_id="n", bytes_to_free=10 * MiB
        )
    assert worker.is_alive()
    assert worker.resident("n") == 10 * MiB
    assert sim.card().used() == 10 * MiB
    assert worker.seq == 0


def test_scripts_wait_for_their_command(worker):
    worker.script("refuse", command="model_partial_unload")
    worker.send_command(
        "model_partial_load", model_id="m", extra_bytes=1, device="cuda:0"
    )
    with pytest.raises(fakes.WorkerError):
        worker.send_command(
            "model_partial_unload", model_id="m", bytes_to_free=1
        )
    worker.send_command("model_partial_unload", model_id="m", bytes_to_free=1)
    assert worker.resident("m") == 0


@pytest.mark.parametrize(
    ("how", "check"),
    [
        ("missing", lambda r: "freed" not in r),
        ("str", lambda r: isinstance(r["freed"], str)),
        ("negative", lambda r: r["freed"] == -5),
        ("bool", lambda r: r["freed"] is True),
        ("nan", lambda r: math.isnan(r["freed"])),
        ("float", lambda r: isinstance(r["freed"], float)),
        ("none", lambda r: r["freed"] is None),
        ("huge", lambda r: r["freed"] == 2**64),
        ("beyond", lambda r: r["freed"] == 100 * MiB + 1),
        ("not_dict", lambda r: isinstance(r, list)),
        ("null", lambda r: r is None),
    ],
)
def test_garbage_replies(worker, how, check):
    worker.add_model("n", 100 * MiB, resident=50 * MiB)
    worker.script("garbage", how=how, field="freed")
    reply = worker.send_command(
        "model_partial_unload", model_id="n", bytes_to_free=10 * MiB
    )
    assert check(reply)
    assert worker.resident("n") == 40 * MiB  # the work was done


def test_garbage_without_performing(worker):
    worker.add_model("n", 100 * MiB, resident=50 * MiB)
    worker.script("garbage", reply="oops", perform=False)
    assert (
        worker.send_command(
            "model_partial_unload", model_id="n", bytes_to_free=10 * MiB
        )
        == "oops"
    )
    assert worker.resident("n") == 50 * MiB


def test_old_worker_replies(worker):
    worker.script("old", drop=("seq", "resident"))
    reply = worker.send_command(
        "model_partial_load", model_id="m", extra_bytes=1, device="cuda:0"
    )
    assert reply == {"status": "ok", "loaded": 1}
    worker.drop_fields = {"seq"}
    reply = worker.send_command(
        "model_partial_unload", model_id="m", bytes_to_free=1
    )
    assert reply == {"status": "ok", "freed": 1, "resident": 0}


def test_short_unloads(worker):
    worker.add_model("n", 100 * MiB, resident=100 * MiB)
    worker.script("short", freed=3)
    reply = worker.send_command(
        "model_partial_unload", model_id="n", bytes_to_free=10 * MiB
    )
    assert reply["freed"] == 3
    worker.unload_cap = 7
    reply = worker.send_command(
        "model_partial_unload", model_id="n", bytes_to_free=10 * MiB
    )
    assert reply["freed"] == 7
    assert worker.resident("n") == 100 * MiB - 10


def test_call_script_runs_inside_the_command(worker):
    seen = []
    worker.script("call", fn=lambda: seen.append(worker.seq))
    worker.send_command(
        "model_partial_load", model_id="m", extra_bytes=1, device="cuda:0"
    )
    assert seen == [0]
    assert worker.seq == 1


def test_census_and_vram_report(mm):
    w = fakes.FakeWorker("w", context_bytes=300 * MiB, report_in_replies=True)
    w.add_model("a", 100 * MiB, resident=60 * MiB)
    w.add_model("b", 50 * MiB)
    w.held_extra = 5
    w.pinned = 7
    reply = w.send_command(
        "model_partial_unload", model_id="a", bytes_to_free=10
    )
    census = [
        {"id": "a", "seq": 1, "resident": 60 * MiB - 10, "device": "cuda:0"},
        {"id": "b", "seq": 1, "resident": 0, "device": "cpu"},
    ]
    assert w.census() == census
    report = {
        "held": 60 * MiB - 10 + 5,
        "residency": census,
        "pinned": 7,
        "overhead": 300 * MiB,
    }
    assert w.vram_report() == report == w._vram_report
    assert reply["_vram_report"] == report
    assert mm.sim.card().used(process="w") == 360 * MiB - 10
