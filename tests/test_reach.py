"""ComfyUI reaches every byte a worker holds, and never waits on one
(docs/semantics.md "The pool", "Never wait"; docs/architecture.md,
"Unlisted bytes").

Both implementations, with the fake workers of tests/fakes.py on the mock's
simulated card (tests/mockcomfy: ComfyUI's ``free_memory`` and
``LoadedModel``), so what ComfyUI's eviction takes is what the card gets
back.  tests/test_comfy_env_reach.py runs the same stories with
comfy-env 0.4.46's real worker.
"""

from __future__ import annotations

import logging
import os
import threading

import fakes

from comfy_standin import Board
from mock_fixtures import mock_mm as _mm

GiB = _mm.GiB
CPU = _mm.CPU


def make(impl, pool, worker, model_id, size, resident, register=True):
    worker.add_model(model_id, size, resident=resident)
    s = impl.StandIn(worker=worker, worker_generation=1, model_id=model_id,
                     model_size=size, load_device=worker.load_device,
                     offload_device=CPU, kind="unet", pool=pool)
    impl.apply_residency(
        {model_id: s}, [e for e in worker.census() if e["id"] == model_id])
    if register:
        impl.register(_mm, s)
    return s


def host_model(mm, name, size):
    p = mm.HostModel(name, size)
    entry = mm.LoadedModel(p)
    entry.model_load(0)
    mm.current_loaded_models.insert(0, entry)
    return p


def entries_of(mm, s):
    return [e for e in mm.current_loaded_models if e.model is s]


def worker_call(impl, worker, s):
    """One node call of `worker` that ends at a boundary: its census
    (comfy-env sends one in every reply frame)."""
    impl.apply_residency({s.model_id: s}, [
        e for e in worker.census() if e["id"] == s.model_id])


# ---- listed again -----------------------------------------------------------


def test_evicted_then_loaded_back_two_calls_later_is_listed(impl, pool, mm):
    """The worker loads the model back inside its own call (comfy-env's
    worker registers nothing new: it dedups on the module); a call to
    another worker comes between.  The pool lists it again, and it is
    what free_memory takes when a host load needs room."""
    a, b = fakes.FakeWorker("a"), fakes.FakeWorker("b")
    s = make(impl, pool, a, "unet", 8 * GiB, 8 * GiB)
    other = make(impl, pool, b, "vae", 1 * GiB, 1 * GiB)
    mm.free_memory(1e30, mm.CUDA0)  # "Free memory": both off the card
    assert a.resident("unet") == 0 and not entries_of(mm, s)
    pool.boundary(mm)
    assert not entries_of(mm, s)  # off the card: no entry
    # the next call of a: the pack moves the model back with no message
    a.send_command("model_partial_load", model_id="unet",
                   extra_bytes=8 * GiB, device=str(mm.CUDA0))
    a.commands.clear()
    worker_call(impl, a, s)
    pool.boundary(mm)
    worker_call(impl, b, other)  # a call to another worker between
    pool.boundary(mm)
    (entry,) = entries_of(mm, s)
    assert entry.currently_used is False
    assert pool.boundary(mm) == []  # once: no second entry
    assert len(entries_of(mm, s)) == 1
    # a host load that needs 8 GiB more than is free takes it
    free = mm.get_free_memory(mm.CUDA0)
    mm.free_memory(free + 8 * GiB, mm.CUDA0)
    assert a.resident("unet") == 0 and s.loaded_size() == 0
    assert mm.get_free_memory(mm.CUDA0) == free + 8 * GiB


def test_reload_in_the_very_next_call_is_listed(impl, pool, mm):
    a = fakes.FakeWorker("a")
    s = make(impl, pool, a, "unet", 4 * GiB, 4 * GiB)
    mm.free_memory(1e30, mm.CUDA0)
    a.send_command("model_partial_load", model_id="unet",
                   extra_bytes=4 * GiB, device=str(mm.CUDA0))
    worker_call(impl, a, s)
    assert pool.boundary(mm) == [s]
    assert len(entries_of(mm, s)) == 1 and s.loaded_size() == 4 * GiB


def test_a_board_reading_lists_it_with_no_message(impl, pool, mm):
    """The newest true word is the board's: a model whose receipt says 0
    but whose slot says it is back is listed."""
    worker_side, fd = Board.make(4)  # shared memory is C in both impls
    board = Board.adopt(fd, 4)
    os.close(fd)
    try:
        a = fakes.FakeWorker("a")
        s = make(impl, pool, a, "unet", 2 * GiB, 2 * GiB)
        mm.free_memory(1e30, mm.CUDA0)
        slot = s.attach_board(board)
        worker_side.bind(slot, board.tag(slot))
        pool.boundary(mm)
        assert not entries_of(mm, s)
        worker_side.publish(slot, 2 * GiB)  # the pack moved it back
        assert s.loaded_size() == 2 * GiB and s.receipt()[3] == "board"
        assert pool.relist(mm) == [s] and len(entries_of(mm, s)) == 1
    finally:
        worker_side.close()
        board.close()


def test_the_hold_ends_only_when_the_worker_says_so(impl, pool, mm):
    a = fakes.FakeWorker("a")
    s = make(impl, pool, a, "unet", 2 * GiB, 2 * GiB)
    mm.free_memory(1e30, mm.CUDA0)
    pool.boundary(mm)
    assert pool.held() == [s]
    a.forget_model("unet")  # the pack dropped its module
    a.add_model("unet2", 1 * GiB)
    s.model.model_loaded_weight_memory = 1 * GiB  # a stale word says loaded
    impl.register(mm, s)
    mm.free_memory(1e30, mm.CUDA0)  # "not registered": the model is gone
    assert s.receipt()[3] == "worker gone"
    pool.boundary(mm)
    assert pool.held() == [] and not entries_of(mm, s)


# ---- census at creation -----------------------------------------------------


def test_census_at_creation_registers_what_the_worker_holds(impl, pool, mm):
    """comfy-env makes a frame's stand-ins at full size after applying
    that frame's census; the pool applies it to them."""
    a = fakes.FakeWorker("a")
    a.add_model("unet", 6 * GiB, resident=2 * GiB)
    s = impl.StandIn(worker=a, worker_generation=1, model_id="unet",
                     model_size=6 * GiB, load_device=a.load_device,
                     offload_device=CPU, pool=pool)
    s.model.model_loaded_weight_memory = 6 * GiB  # comfy-env: "on cuda"
    census = [*a.census(), {"id": "unet-of-another-frame", "resident": 1},
              "not an entry", {"id": "unet", "resident": -1}]
    assert pool.census_at_creation({"unet": s}, census) == 1
    assert s.loaded_size() == 2 * GiB and s.receipt()[3] == "census"
    assert pool.census_at_creation({"unet": s}, None) == 0


# ---- never wait -------------------------------------------------------------


def hold_lock(worker):
    """Another thread holds the worker's command lock (a web route or a
    second prompt in a long call on it) until the returned event is set."""
    held, done = threading.Event(), threading.Event()

    def run():
        with worker.lock:
            held.set()
            done.wait(30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert held.wait(30)
    return done, thread


def test_a_busy_worker_is_skipped_and_a_host_model_gives_the_room(
        impl, pool, mm, caplog):
    a = fakes.FakeWorker("a")
    # ComfyUI sorts the most offloaded first: the stand-in (a quarter
    # off the card) before the host model (all on it)
    s = make(impl, pool, a, "unet", 4 * GiB, 3 * GiB)
    host = host_model(mm, "host-unet", 4 * GiB)
    done, thread = hold_lock(a)
    try:
        free = mm.get_free_memory(mm.CUDA0)
        with caplog.at_level(logging.WARNING, logger="comfy_standin"):
            mm.free_memory(free + 2 * GiB, mm.CUDA0)
    finally:
        done.set()
        thread.join(30)
    # asked without waiting (lock_timeout 0), nothing sent, nothing freed
    assert a.no_spawn == [("model_partial_unload", 0.0),
                          ("model_to_device", 0.0)]
    assert a.commands == [] and a.resident("unet") == 3 * GiB
    assert s.eviction_deferred and s.loaded_size() == 3 * GiB
    assert host.loaded_size() == 2 * GiB  # the room came from the host model
    assert mm.get_free_memory(mm.CUDA0) >= free + 2 * GiB
    assert any("busy" in r.getMessage() for r in caplog.records)
    # listed again at the boundary, and evictable once the worker is free
    assert pool.boundary(mm) == [s]
    mm.free_memory(1e30, mm.CUDA0)
    assert a.resident("unet") == 0


def test_a_workers_own_request_still_evicts_its_models(impl, pool, mm):
    """comfy-env's _handle_vram_budget runs on the thread that holds the
    worker's lock for its call: the lock is reentrant, so it is won."""
    a = fakes.FakeWorker("a")
    s = make(impl, pool, a, "unet", 4 * GiB, 4 * GiB)
    with a.lock:
        mm.free_memory(1e30, mm.CUDA0)
    assert a.no_spawn and a.resident("unet") == 0 and s.loaded_size() == 0


def test_a_worker_without_no_spawn_gets_send_command(impl, pool, mm):
    class Plain(fakes.FakeWorker):
        send_command_no_spawn = None  # not callable: the plain protocol

    a = Plain("a")
    make(impl, pool, a, "unet", 2 * GiB, 2 * GiB)
    mm.free_memory(1e30, mm.CUDA0)
    assert a.no_spawn == [] and a.resident("unet") == 0


def test_dead_from_no_spawn_takes_the_gone_path(impl, pool, mm):
    class Dying(fakes.FakeWorker):
        def send_command_no_spawn(self, command, lock_timeout=2.0, **kw):
            self.kill()  # died between the stand-in's check and the send
            return "dead"

    a = Dying("a")
    s = make(impl, pool, a, "unet", 2 * GiB, 2 * GiB)
    assert s.partially_unload(CPU, 1 * GiB) == 2 * GiB
    assert s.stale and s.receipt()[3] == "worker gone"


# ---- unlisted bytes ---------------------------------------------------------


def test_unlisted_bytes_come_back_measured(impl, pool, mm, caplog):
    """A worker's allocator cache: no model accounts for it.  After
    ComfyUI's own eviction the pool asks the idle worker for it; only the
    bytes that came back count (part of the cache cannot go)."""
    a = fakes.FakeWorker("a")
    s = make(impl, pool, a, "unet", 2 * GiB, 2 * GiB)
    a.add_cache(3 * GiB)
    a.cache_pinned = 1 * GiB
    pool.report(a, a.vram_report())
    assert pool.unlisted()[a] == 3 * GiB
    mm.free_memory(1e30, mm.CUDA0)  # no stand-in of a is listed after
    assert not entries_of(mm, s)
    pool.report(a, a.vram_report())  # the boundary's report
    before = mm.get_free_memory(mm.CUDA0)
    got = pool.reclaim(10 * GiB)
    assert got == 2 * GiB == mm.get_free_memory(mm.CUDA0) - before
    assert a.no_spawn[-1] == ("partial_release", 0.0)
    assert a.sent("partial_release") == [{"model_id": None,
                                          "size": 3 * GiB}]
    assert pool.unlisted()[a] == 1 * GiB  # held dropped by what came back


def test_a_driver_reading_counts_past_the_context(impl, mm):
    """The driver's reading of a worker's process counts its CUDA context,
    which the floor stands for and no release gives back: only what it
    holds beyond that and its models is unlisted, and a reclaim counts
    only what the worker measured coming back."""
    pool = impl.Pool(floor=300 << 20)
    a = fakes.FakeWorker("a", context_bytes=300 << 20)
    b = fakes.FakeWorker("b", context_bytes=300 << 20)  # its context only
    keep = [make(impl, pool, a, "unet", 2 * GiB, 2 * GiB),
            make(impl, pool, b, "vae", 1 * GiB, 1 * GiB)]
    a.add_cache(3 * GiB)  # never reported: its held stays 0
    a.cache_pinned = 1 * GiB
    pids = {id(a): 101, id(b): 202}

    def read():  # the driver's figure per process, from the card
        card = mm.sim.card()
        pool.update_readings({"devices": [{"index": 0, "processes": {
            pids[id(w)]: card.used(w.name) for w in (a, b)}}]},
            lambda w: pids[id(w)])

    read()
    assert pool.charge_details()[a]["held"] == 0
    assert pool.unlisted() == {a: 3 * GiB, b: 0}
    mm.free_memory(1e30, mm.CUDA0)  # ComfyUI's own eviction: the models
    read()
    assert pool.unlisted() == {a: 3 * GiB, b: 0}
    assert pool.reclaim(10 * GiB) == 2 * GiB  # 1 GiB of the cache stays
    assert a.sent("partial_release") == [{"model_id": None,
                                          "size": 3 * GiB}]
    assert b.sent("partial_release") == []
    assert len(keep) == 2
    pool.boundary()


def test_a_worker_that_cannot_release_says_so_once(impl, pool, mm, caplog):
    a = fakes.FakeWorker("a")
    make(impl, pool, a, "unet", 1 * GiB, 1 * GiB)
    a.add_cache(1 * GiB)
    a.supports_partial_release = False
    pool.report(a, a.vram_report())
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        assert pool.reclaim(GiB) == 0
        assert pool.reclaim(GiB) == 0
    lines = [r.getMessage() for r in caplog.records
             if "cannot release" in r.getMessage()]
    assert len(lines) == 1 and "no partial_release" in lines[0], lines
    assert a.no_spawn == []


def test_reclaim_never_waits_on_a_busy_worker(impl, pool, mm):
    a = fakes.FakeWorker("a")
    make(impl, pool, a, "unet", 1 * GiB, 1 * GiB)
    a.add_cache(1 * GiB)
    pool.report(a, a.vram_report())
    done, thread = hold_lock(a)
    try:
        assert pool.reclaim(GiB) == 0
    finally:
        done.set()
        thread.join(30)
    assert a.no_spawn == [("partial_release", 0.0)] and a.commands == []
    assert pool.unlisted()[a] == 1 * GiB


def test_status_shows_the_unlisted_bytes(impl, pool, mm):
    from comfy_standin import _status

    a = fakes.FakeWorker("a")
    make(impl, pool, a, "unet", 1 * GiB, 1 * GiB)
    a.add_cache(512 << 20)
    pool.report(a, a.vram_report())
    status = _status.collect(pool)
    (worker,) = status["workers"]
    assert worker["unlisted"] == 512 << 20
    assert "; unlisted 512 MiB" in _status.render(status, probe=False)
