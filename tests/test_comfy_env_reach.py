"""ComfyUI reaches every byte a comfy-env worker holds, and never waits on
one: comfy-env 0.4.46's REAL worker process and host code, driven by its
own node call path (tests/comfy_env_harness.py), with the mock
model_management (tests/mockcomfy) in both processes.  The worker's models
are duck-typed modules that claim a CUDA device, so no GPU.  The tests
whose evictions reach the worker's own unload and detach handlers need
torch in the worker (marker ``torch_worker``: a separate CI step installs
the CPU torch wheel and runs them); the others need none.  Both
implementations' rules are held together by tests/test_reach.py and the
differential test; here the C stand-in runs, as in ComfyUI.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import threading
from multiprocessing import resource_sharer

import pytest

import comfy_standin as cs
from comfy_standin.integrations import comfy_env as adapter

from comfy_env_harness import (
    MiB, Host, host_namespace, same_python_env, standin_of, wait_for)

HAVE_TORCH = importlib.util.find_spec("torch") is not None
NEEDS_TORCH = ("the torch_worker tests need torch in this environment: "
               "pip install torch==2.13.0 (CPU wheel)")

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="comfy-env's worker over a Unix socket: Linux"),
    pytest.mark.comfy_env,
]


@pytest.fixture
def hosts(mm, monkeypatch, tmp_path, comfy_env_installed_version):
    monkeypatch.setattr(mm, "processing_interrupted", lambda: False,
                        raising=False)
    monkeypatch.setattr(adapter, "_warned", set())
    made = []

    def make(env=None):
        harness = Host(mm, tmp_path / f"pack{len(made)}",
                       env or pathlib.Path(sys.prefix))
        made.append(harness)
        return host_namespace(harness)

    try:
        yield make
    finally:
        # torch's descriptor passing (comfy-env's transport check, with
        # torch in this process) starts multiprocessing's fd-sharing
        # listener once per process: not a worker's descriptor
        resource_sharer.stop()
        # the first host's check covers every worker (it shuts all down)
        for harness in made[1:]:
            made[0].workers.extend(harness.workers)
        if made:
            made[0].close()


def entries(mm, s):
    return [e for e in mm.current_loaded_models if e.model is s]


def host_model(mm, name, size):
    p = mm.HostModel(name, size)
    entry = mm.LoadedModel(p)
    entry.model_load(0)
    mm.current_loaded_models.insert(0, entry)
    return p


@pytest.mark.torch_worker
def test_evicted_and_loaded_back_two_calls_later_is_listed(
        hosts, mm, tmp_path):
    assert HAVE_TORCH, NEEDS_TORCH
    a = hosts()
    b = hosts(same_python_env(tmp_path / "b"))
    adapter.install()
    a.call("load", model_id="unet", nbytes=8 * MiB)
    s = standin_of(mm, "unet")
    assert type(s) is cs.StandIn and s.loaded_size() == 8 * MiB
    mm.free_memory(1e30, mm.CUDA0)  # ComfyUI's "Free memory"
    assert a.call("where", model_id="unet") == ["cpu"]
    assert not entries(mm, s)
    b.call("load", model_id="vae", nbytes=1 * MiB)  # another worker's call
    a.call("reload", model_id="unet")  # back on the card, no message
    assert s.loaded_size() == 8 * MiB
    (entry,) = entries(mm, s)
    assert entry.currently_used is False
    # a host load needing 8 MiB more than is free takes it
    host_model(mm, "small", 1 * MiB)
    mm.free_memory(mm.get_free_memory(mm.CUDA0) + 8 * MiB, mm.CUDA0)
    assert a.call("where", model_id="unet") == ["cpu"]
    assert s.loaded_size() == 0


@pytest.mark.torch_worker
def test_a_reload_in_the_very_next_call_still_works(hosts, mm):
    assert HAVE_TORCH, NEEDS_TORCH
    a = hosts()
    adapter.install()
    a.call("load", model_id="unet", nbytes=4 * MiB)
    s = standin_of(mm, "unet")
    mm.free_memory(1e30, mm.CUDA0)
    a.call("reload", model_id="unet")
    assert len(entries(mm, s)) == 1 and s.loaded_size() == 4 * MiB
    a.call("touch")
    assert len(entries(mm, s)) == 1  # once


class RecordingLock:
    """comfy-env's command lock (an RLock), recording every acquire that
    may wait: (thread, timeout)."""

    def __init__(self, lock):
        self._lock = lock
        self.waits = []

    def acquire(self, blocking=True, timeout=-1):
        if blocking and timeout != 0:
            self.waits.append((threading.get_ident(), timeout))
        return self._lock.acquire(blocking, timeout)

    def release(self):
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def test_a_busy_workers_stand_in_is_skipped_and_a_host_model_gives_room(
        hosts, mm, tmp_path):
    a = hosts()
    adapter.install()
    a.call("load", model_id="unet", nbytes=3 * MiB)
    worker, _ = a.current()
    s = standin_of(mm, "unet")
    lock = worker._lock = RecordingLock(worker._lock)
    host = host_model(mm, "host-unet", 2 * MiB)
    started, gate = tmp_path / "started", tmp_path / "gate"
    long_call = threading.Thread(target=a.call, args=("hold",), kwargs={
        "started": str(started), "gate": str(gate), "limit": 10.0})
    long_call.start()  # a web route or a second prompt, in a long call
    try:
        wait_for(started.exists, "the long call")
        # the card cannot give 3 MiB more from the host model alone: every
        # candidate is asked, the busy worker's stand-in among them
        mm.free_memory(mm.get_free_memory(mm.CUDA0) + 3 * MiB, mm.CUDA0)
        me = threading.get_ident()
        assert [w for w in lock.waits if w[0] == me] == []  # never waited
        assert host.loaded_size() == 0  # the host model gave the room
        assert s.eviction_deferred and s.loaded_size() == 3 * MiB
        assert not entries(mm, s)
    finally:
        gate.touch()
        long_call.join(60)
    # the long call's boundary lists it again; it is still on the card
    assert a.call("where", model_id="unet") == ["cuda"]
    assert len(entries(mm, s)) == 1


def test_unlisted_bytes_come_back_through_a_release(hosts, mm):
    a = hosts()
    adapter.install()
    a.call("load", model_id="unet", nbytes=2 * MiB)
    worker, _ = a.current()
    a.call("scratch", nbytes=5 * MiB, pinned=1 * MiB)
    pool = cs.default_pool()
    assert pool.unlisted()[worker] == 6 * MiB  # shown in status too
    assert worker.supports_partial_release
    held = pool.charge_details()[worker]["held"]
    # a host load ComfyUI's own eviction cannot make room for: the idle
    # worker is asked, and only what came back is counted
    mm.free_memory(mm.get_free_memory(mm.CUDA0) + 64 * MiB, mm.CUDA0)
    assert a.call("scratch_left") == [0]
    assert pool.charge_details()[worker]["held"] == held - 5 * MiB
    a.call("touch")  # the next report agrees: 1 MiB cannot go
    assert pool.unlisted()[worker] == 1 * MiB


@pytest.mark.torch_worker
def test_a_reply_that_moved_nothing_leaves_the_board_exact(
        hosts, mm, monkeypatch, tmp_path):
    """The worker publishes before a model command's reply leaves it: a
    reply that moved nothing and bumps no seq (a plain module already off
    the card answers an unload with freed 0, resident 0) writes no
    receipt, and the board's reading, measured before that reply, is what
    the worker holds."""
    assert HAVE_TORCH, NEEDS_TORCH
    monkeypatch.setattr(adapter, "SAMPLE_PERIOD", 60.0)  # no sampler pass
    a = hosts()
    adapter.install()
    a.call("load", model_id="unet", nbytes=4 * MiB)
    s = standin_of(mm, "unet")
    board, slot = s.board
    wait_for(lambda: board.status(slot) == "valid", "the first reading")
    gate, done = tmp_path / "gate", tmp_path / "moved"
    a.call("move_quietly", model_id="unet", gate=str(gate), done=str(done))
    gate.touch()  # after the call's reply and its census
    wait_for(done.exists, "the pack's move")
    assert s.loaded_size() == 4 * MiB  # nobody has said otherwise yet
    assert s.partially_unload("cpu", 1 * MiB) == 0  # nothing moved
    assert s.receipt()[3] == "board" and s.loaded_size() == 0
