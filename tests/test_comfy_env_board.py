"""The live board from comfy-env's REAL worker process.

Right after comfy-env starts a worker, the worker-side publisher (a
stdlib-only module the adapter puts first on the worker's path) makes the
worker's board and hands it to the host; at comfy-env's node boundary the
host binds the worker's models and the publisher publishes what
comfy-env's worker tracks.  Here the worker runs this venv's Python (which
has comfy_standin installed: it is not used there); no torch.
tests/test_pack_env_board.py runs pack environments of other Pythons.

Pinned to the comfy-env releases whose internals were read (the worker's
``main()`` closures, ``call_module``, the spawn call): those the adapter's
``TESTED_COMFY_ENV`` gives boards; another version fails with a message,
never a skip.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import sys

import pytest

import comfy_standin as cs
from comfy_standin.integrations import comfy_env as adapter

from comfy_env_harness import MiB, Host, host_namespace, standin_of, wait_for

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="boards are memfds: Linux"),
    # Every test here needs comfy-env (conftest fails them when it is
    # missing; -m "not comfy_env" leaves them out).
    pytest.mark.comfy_env,
]


@pytest.fixture
def host(mm, monkeypatch, tmp_path, comfy_env_installed_version):
    monkeypatch.setattr(mm, "processing_interrupted", lambda: False,
                        raising=False)
    monkeypatch.setattr(adapter, "_warned", set())
    harness = Host(mm, tmp_path / "pack", pathlib.Path(sys.prefix))
    try:
        yield host_namespace(harness)
    finally:
        harness.close()


def test_a_move_after_the_reply_is_seen_with_no_message(host):
    adapter.install()
    host.call("load", model_id="unet-b", nbytes=3 * MiB)
    worker, _ = host.current()
    s = standin_of(host.mm, "unet-b")
    assert type(s) is cs.StandIn
    board, slot = s.board
    # a board of its own, owned by the worker process, handed over: the
    # host's descriptor is gone, the worker has it mapped
    assert board.expected_owner == worker._process.pid
    assert board.owner_pid == worker._process.pid
    assert board.attached
    assert host.call("publisher") == [True, True, None]
    # the worker published at once; the census of the reply since is as
    # new, so the receipt stands until the board has news
    wait_for(lambda: board.status(slot) == "valid", "the first reading")
    assert board.read(slot)[0] == 3 * MiB and s.loaded_size() == 3 * MiB

    host.call("move_later", model_id="unet-b", delay=0.2)
    calls = worker._call_counter
    wait_for(lambda: s.loaded_size() == 0, "the move on the board")
    assert s.receipt()[0] == 0 and s.receipt()[3] == "board"
    assert worker._call_counter == calls  # no message was sent
    # the next message's census agrees with the board
    host.call("touch")
    assert s.loaded_size() == 0


def test_a_tracked_change_wakes_the_publisher(host, monkeypatch):
    """The sampler sleeps for a minute: only the wrapped _bump_seq (a site
    comfy-env's worker already tracks) can publish the move."""
    monkeypatch.setattr(adapter, "SAMPLE_PERIOD", 60.0)
    adapter.install()
    host.call("load", model_id="m", nbytes=2 * MiB)
    s = standin_of(host.mm, "m")
    board, slot = s.board
    wait_for(lambda: board.status(slot) == "valid", "the first reading")
    host.call("move_later", model_id="m", delay=0.1, bump=True)
    wait_for(lambda: s.loaded_size() == 0, "the bumped move on the board")
    assert s.receipt()[3] == "board"


def test_worker_killed_falls_back_then_a_new_board(host):
    adapter.install()
    host.call("load", model_id="k", nbytes=1 * MiB)
    worker, generation = host.current()
    s = standin_of(host.mm, "k")
    board, slot = s.board
    host.call("touch")  # a census receipt to fall back on
    wait_for(lambda: board.status(slot) == "valid", "the first reading")
    os.kill(worker._process.pid, signal.SIGKILL)
    worker._process.wait(timeout=60)
    # before anyone reaped it: the pidfd says so, reads fall back
    assert board.poll_owner() is True
    assert board.read(slot) is None and board.status(slot) == "dead owner"
    assert s.receipt()[3] != "board" and s.loaded_size() == 1 * MiB
    # the boundary marks it gone: 0, the board closed
    cs.default_pool().boundary(host.mm)
    assert s.stale and s.loaded_size() == 0 and board.closed
    # the next call respawns: a new process, a new board
    host.call("load", model_id="k", nbytes=1 * MiB)
    worker2, generation2 = host.current()
    assert generation2 > generation
    s2 = standin_of(host.mm, "k")
    board2, _ = s2.board
    assert board2 is not board and not board2.closed
    assert board2.owner_pid == worker2._process.pid != worker._process.pid
    wait_for(lambda: board2.status(s2.board[1]) == "valid",
             "the new board's reading")


def test_a_version_tested_on_receipts_is_receipts_only(
        host, monkeypatch, caplog, comfy_env_installed_version):
    monkeypatch.setitem(adapter.TESTED_COMFY_ENV,
                        comfy_env_installed_version, "receipts")
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        adapter.install()
        host.call("load", model_id="v", nbytes=1 * MiB)
        host.call("load", model_id="w", nbytes=1 * MiB)
    lines = [r.getMessage() for r in caplog.records
             if "receipts only" in r.getMessage()]
    version = comfy_env_installed_version
    assert len(lines) == 1 and f"comfy-env {version}" in lines[0], lines
    s = standin_of(host.mm, "v")
    assert s.board is None
    host.call("touch")
    assert s.receipt()[3] == "census" and s.loaded_size() == 1 * MiB
    assert host.call("publisher") == [False, False, None]
    host.current()


def test_worker_shape_mismatch_is_receipts_only(host, monkeypatch, caplog):
    """A comfy-env worker that is not the one checked (here: 0.4.46's own
    worker script with its _bump_seq renamed, as another version might):
    the publisher refuses before touching anything, the host logs one
    line, the worker runs on."""
    from comfy_env.isolation.workers import subprocess as spawn

    monkeypatch.setattr(spawn, "_PERSISTENT_WORKER_SCRIPT",
                        spawn._PERSISTENT_WORKER_SCRIPT.replace(
                            "_bump_seq", "_next_seq"))
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        adapter.install()
        host.call("load", model_id="x", nbytes=1 * MiB)
        host.call("load", model_id="y", nbytes=1 * MiB)
    lines = [r.getMessage() for r in caplog.records
             if "receipts only" in r.getMessage()]
    assert len(lines) == 1 and "register_model" in lines[0], lines
    worker, _ = host.current()
    assert worker.is_alive()
    s = standin_of(host.mm, "x")
    assert s.board is None
    host.call("touch")
    assert s.receipt()[3] == "census" and s.loaded_size() == 1 * MiB


def test_a_publisher_that_cannot_run_is_receipts_only(host, monkeypatch,
                                                       tmp_path, caplog):
    """The worker cannot import the publisher (here: a copy that fails at
    import, as it would under a Python too old for it): the attach call
    fails in the worker, the host logs one line, the worker runs on."""
    broken = tmp_path / "private"
    broken.mkdir()
    (broken / (adapter._PUBLISHER + ".py")).write_text(
        "raise ImportError('this Python cannot run the publisher')\n")
    monkeypatch.setattr(adapter, "_publisher_dir", lambda: str(broken))
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        adapter.install()
        host.call("load", model_id="z", nbytes=1 * MiB)
        host.call("load", model_id="z2", nbytes=1 * MiB)
    worker, _ = host.current()
    lines = [r.getMessage() for r in caplog.records
             if "receipts only" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "could not run the board publisher" in lines[0]
    assert "cannot run the publisher" in lines[0]
    s = standin_of(host.mm, "z")
    assert s.board is None and worker.is_alive()
    host.call("touch")
    assert s.receipt()[3] == "census"


def test_boards_can_be_turned_off(host, monkeypatch, caplog):
    monkeypatch.setenv("COMFY_STANDIN_NO_BOARD", "1")
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        adapter.install()
        host.call("load", model_id="o", nbytes=1 * MiB)
    host.current()
    assert not [r for r in caplog.records
                if "receipts only" in r.getMessage()]
    assert standin_of(host.mm, "o").board is None
    assert host.call("publisher") == [False, False, None]


def test_a_respawn_in_the_same_worker_gets_a_new_board(host):
    """comfy-env restarts a dead process inside the same SubprocessWorker
    (``_ensure_started``, e.g. from a command): the old board is closed,
    the new process gets its own."""
    adapter.install()
    host.call("load", model_id="a", nbytes=1 * MiB)
    worker, _ = host.current()
    s = standin_of(host.mm, "a")
    board, _slot = s.board
    pid = worker._process.pid
    os.kill(pid, signal.SIGKILL)
    worker._process.wait(timeout=60)
    worker.send_command("list_models")  # respawns in place
    worker2, _ = host.current()
    assert worker2 is worker and worker._process.pid != pid
    assert board.closed and s.receipt()[3] != "board"
    host.call("load", model_id="b", nbytes=1 * MiB)
    s2 = standin_of(host.mm, "b")
    board2, slot2 = s2.board
    assert board2 is not board
    assert board2.expected_owner == board2.owner_pid == worker._process.pid
    wait_for(lambda: board2.status(slot2) == "valid", "the new reading")
