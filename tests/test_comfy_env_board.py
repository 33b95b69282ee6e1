"""The live board from comfy-env's REAL worker process (comfy-env 0.4.46).

The adapter hands each worker process a board at spawn; at comfy-env's
node boundary it binds the worker's models, and ``comfy_standin.worker``
(imported in the worker over comfy-env's own ``call_module``) publishes
what comfy-env's worker tracks.  The worker runs this venv's Python, so
it imports the same comfy_standin; no torch.

Pinned to the comfy-env version whose internals were read (the worker's
``main()`` closures, ``call_module``, the spawn call): another version
fails with a message, never a skip.
"""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import os
import pathlib
import signal
import sys
import textwrap
import time
import types

import pytest

import comfy_standin as cs
from comfy_standin.integrations import comfy_env as adapter

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="boards are memfds: Linux"
)

PINNED = "0.4.46"
VERSION = importlib.metadata.version("comfy-env")
MiB = 1 << 20
MOCK_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         "mockcomfy")

# A pack whose "models" claim a CUDA device (duck-typed parameters), so
# comfy-env's census counts them resident with no GPU and no torch.  Its
# nodes move one later, from a thread, after the call has replied.
PACK = textwrap.dedent('''
    import sys
    import threading
    import time
    import types

    _KEEP = {}


    class _Param:
        def __init__(self, nbytes, device):
            self.nbytes = nbytes
            self.device = types.SimpleNamespace(type=device)

        def numel(self):
            return self.nbytes

        def element_size(self):
            return 1


    class FakeModule:
        def __init__(self, nbytes):
            self._params = [_Param(nbytes, "cuda")]

        def parameters(self):
            return iter(self._params)

        def buffers(self):
            return iter(())

        def to(self, device):
            for p in self._params:
                p.device = types.SimpleNamespace(type=str(device))
            return self


    def _bump_seq():
        reg = sys.modules["comfy_worker"].register_model
        cells = dict(zip(reg.__code__.co_freevars, reg.__closure__))
        return cells["_bump_seq"].cell_contents


    class Node:
        def load(self, model_id, nbytes, break_hook=False):
            import comfy_worker

            module = FakeModule(nbytes)
            _KEEP[model_id] = module
            comfy_worker.register_model(model_id, module, kind="unet")
            if break_hook:  # not comfy-env's closure any more
                comfy_worker.register_model = lambda *a, **k: 0
            return (model_id,)

        def touch(self):
            return ("ok",)

        def move_later(self, model_id, delay, bump=False):
            """Reply now; move the model to the CPU `delay` s later, as
            a pager or a pack's thread does, with no message."""
            module = _KEEP[model_id]
            bump_seq = _bump_seq() if bump else None

            def later():
                time.sleep(delay)
                module.to("cpu")
                if bump_seq is not None:
                    bump_seq(model_id)  # a site comfy-env already tracks

            threading.Thread(target=later, daemon=True).start()
            return ("moving",)

        def publisher(self):
            try:
                import _comfy_standin_publisher as publisher
            except ImportError:
                return (False, False, None)
            state = publisher.state()
            hooked = getattr(_bump_seq(), "__wrapped__", None) is not None
            return (state["running"], hooked, state.get("failed"))
''')


def _fds():
    return set(os.listdir("/proc/self/fd"))


def _target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _board_maps():
    with open("/proc/self/maps") as f:
        return [line for line in f if "csb-" in line]


@pytest.fixture
def host(mm, monkeypatch, tmp_path):
    assert VERSION == PINNED, (
        f"tests/test_comfy_env_board.py drives comfy-env {PINNED}'s "
        f"internals; this environment has {VERSION}: re-check them")
    from comfy_env.isolation import metadata
    from comfy_env.isolation import pool as ce_pool

    monkeypatch.setattr(mm, "processing_interrupted", lambda: False,
                        raising=False)
    monkeypatch.setattr(adapter, "_warned", set())
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "boardpack.py").write_text(PACK)
    spec = (pathlib.Path(sys.prefix), pack, [str(pack), MOCK_ROOT], {},
            120.0)
    fds, maps = _fds(), _board_maps()

    def call(method, **kwargs):
        return metadata._call_in_worker(
            worker_spec=spec, module_name="boardpack", class_name="Node",
            method_name=method, self_state=None, kwargs=kwargs,
            node_name=f"Node.{method}",
        )

    def current():
        worker, gen = ce_pool._WORKER_POOL[str(spec[0])]
        if worker._process.pid not in ns.workers:
            ns.workers.append(worker._process.pid)
        return worker, gen

    ns = types.SimpleNamespace(mm=mm, call=call, current=current,
                               workers=[])
    try:
        yield ns
    finally:
        ce_pool._shutdown_all_workers()
        adapter.uninstall()
        cs.default_pool().boundary(mm)
        gc.collect()
    for pid in ns.workers:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} left"
    left = {fd: _target(fd) for fd in _fds() - fds}
    left = {fd: t for fd, t in left.items() if t is not None}
    assert not any("csb-" in t or "socket" in t for t in left.values()), left
    assert _board_maps() == maps, "a board mapping was left"


def standin_of(mm, model_id):
    for entry in mm.current_loaded_models:
        s = entry.model
        if s is not None and getattr(s, "model_id", None) == model_id:
            return s
    return None


def wait_for(predicate, what, limit=30.0):
    """Poll (no message is sent) until predicate() holds; the limit only
    bounds a broken run, it is not a speed claim."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.01)


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
    assert board.attached and not board.linked and board.fd is None
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


def test_other_comfy_env_version_is_receipts_only(host, monkeypatch,
                                                  caplog):
    monkeypatch.setattr(adapter, "SUPPORTED_COMFY_ENV", ("0.0.0",))
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        adapter.install()
        host.call("load", model_id="v", nbytes=1 * MiB)
        host.call("load", model_id="w", nbytes=1 * MiB)
    lines = [r.getMessage() for r in caplog.records
             if "receipts only" in r.getMessage()]
    assert len(lines) == 1 and f"comfy-env {VERSION}" in lines[0], lines
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
