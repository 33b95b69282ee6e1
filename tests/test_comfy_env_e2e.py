"""End to end with comfy-env's REAL worker process.

comfy-env's own per-node call path (``metadata._call_in_worker``) spawns
its persistent worker with this venv's Python as the pack's env, does its
authkey handshake, runs a node of a throwaway pack, and registers the
models the worker reports through its own ``_register_new_patchers`` --
which, with the adapter installed, builds comfy_standin's C stand-in from
the real reply frames.  The host side is the mock ComfyUI of
tests/mockcomfy.

These tests use comfy-env internals (``_call_in_worker``, the worker's
``comfy_worker.register_model``, ``_WORKER_PATCHERS``,
``_shutdown_all_workers``), the same in every release of the adapter's
``TESTED_COMFY_ENV``: another version fails with a message saying so, it
is never skipped.  tests/test_comfy_env_matrix.py runs them against each
of those releases; here the suite's own comfy-env is the newest.

A model-moving command is refused by a live worker (the pack's module
refuses to move; without torch the worker cannot import it); the
``torch_worker``
tests (marker; a separate CI step installs the CPU torch wheel) run the
worker's real unload and detach handlers.
"""

from __future__ import annotations

import gc
import glob
import importlib.util
import os
import pathlib
import sys
import textwrap
import time
import types

import pytest

import comfy_standin as cs
from comfy_standin.integrations import comfy_env as adapter

# Every test here needs comfy-env (conftest fails them when it is
# missing; -m "not comfy_env" leaves them out).
pytestmark = pytest.mark.comfy_env

#: The comfy-env the suite's own environment has: the newest tested.
PINNED = "0.4.46"


def wrong_version(version: str) -> str:
    return (
        f"tests/test_comfy_env_e2e.py drives comfy-env's internals "
        f"(_call_in_worker, _register_new_patchers, comfy_worker) as the "
        f"releases in the adapter's TESTED_COMFY_ENV have them; this "
        f"environment has comfy-env {version}. Re-check those internals "
        f"against {version}, run tests/test_comfy_env_matrix.py with it "
        f"and add it to TESTED_COMFY_ENV."
    )


MiB = 1 << 20
MOCK_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         "mockcomfy")
HAVE_TORCH = importlib.util.find_spec("torch") is not None

# The pack: one node that puts a "model" on the card the way a pack's
# code would, through the worker's own registration API.  The module is
# duck-typed (parameters() whose items claim a CUDA device), so the
# worker's census counts it resident without a GPU.
PACK = textwrap.dedent('''
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
        def __init__(self, nbytes, refuse):
            self._params = [_Param(nbytes, "cuda")]
            self._refuse = refuse

        def parameters(self):
            return iter(self._params)

        def buffers(self):
            return iter(())

        def to(self, device):
            if self._refuse:
                raise RuntimeError("the card is busy")
            kind = getattr(device, "type", str(device).split(":")[0])
            for p in self._params:
                p.device = types.SimpleNamespace(type=kind)
            return self


    class LoadModel:
        def load(self, model_id, nbytes, refuse=False):
            import comfy_worker

            module = FakeModule(nbytes, refuse)
            _KEEP[model_id] = module
            comfy_worker.register_model(model_id, module, kind="unet")
            return (model_id,)

        def touch(self):
            return ("ok",)

        def load_partly(self, model_id, resident):
            """A real torch module kept on the CPU whose ComfyUI patcher
            holds `resident` bytes on the card (a low-VRAM partial load:
            the first parameter stays on the CPU).  Needs torch."""
            import comfy.model_management as mm
            import comfy_worker
            import torch

            module = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB
            patcher = types.SimpleNamespace(
                model=module, loaded_size=lambda: resident)
            _KEEP[model_id] = (module, patcher)
            mm.current_loaded_models.append(
                types.SimpleNamespace(model=patcher))
            comfy_worker.register_model(model_id, module, kind="unet")
            return (model_id,)

        def drop(self, model_id):
            _KEEP.pop(model_id, None)
            import gc

            gc.collect()
            return ("dropped",)
''')


def test_comfy_env_is_the_pinned_version(comfy_env_installed_version):
    version = comfy_env_installed_version
    assert version == PINNED, wrong_version(version)


def _fds():
    return set(os.listdir("/proc/self/fd"))


def _target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None  # closed meanwhile


def _fds_left(before, deadline=5.0):
    """fds opened since `before` that stay open.  A thread of comfy-env's
    may be spawning a process as the test ends (subprocess's exec-error
    pipe lives for the spawn): what closes within `deadline` was not
    left behind."""
    end = time.monotonic() + deadline
    while True:
        left = {fd: _target(fd) for fd in _fds() - before - _process_wide()}
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def _process_wide():
    """fds meant to live as long as the process: the listener of
    multiprocessing's resource sharer, which torch's tensor transport
    (comfy-env's canary, with torch in the host) starts once."""
    sharer = sys.modules.get("multiprocessing.resource_sharer")
    listener = getattr(getattr(sharer, "_resource_sharer", None),
                       "_listener", None)
    try:
        return {str(listener._listener._socket.fileno())}
    except AttributeError:
        return set()


def _sockets():
    """comfy-env's worker sockets of this process (comfy_worker_<host
    pid>_<hex>.sock): another test run on the machine makes its own."""
    return set(glob.glob(f"/dev/shm/comfy_worker_{os.getpid()}_*"))


@pytest.fixture
def host(mm, monkeypatch, tmp_path, comfy_env_installed_version):
    """A ComfyUI host with the adapter installed and a pack on disk."""
    if comfy_env_installed_version not in adapter.TESTED_COMFY_ENV:
        pytest.fail(wrong_version(comfy_env_installed_version))
    from comfy_env.isolation import metadata
    from comfy_env.isolation import pool as ce_pool

    # comfy-env's host contract reads this name (the mock lacks it).
    monkeypatch.setattr(mm, "processing_interrupted", lambda: False,
                        raising=False)
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "e2epack.py").write_text(PACK)
    spec = (pathlib.Path(sys.prefix), pack, [str(pack), MOCK_ROOT], {},
            120.0)
    fds, sockets = _fds(), _sockets()
    adapter.install()

    def call(method, **kwargs):
        return metadata._call_in_worker(
            worker_spec=spec, module_name="e2epack", class_name="LoadModel",
            method_name=method, self_state=None, kwargs=kwargs,
            node_name=f"LoadModel.{method}",
        )

    ns = types.SimpleNamespace(mm=mm, call=call, pool=ce_pool,
                               key=str(spec[0]), workers=[])
    try:
        yield ns
    finally:
        ce_pool._shutdown_all_workers()
        adapter.uninstall()
        cs.default_pool().boundary(mm)
        gc.collect()
    # nothing of the worker is left: process, fds, sockets
    for pid in ns.workers:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} left"
    assert _fds_left(fds) == {}, "file descriptors left open"
    assert _sockets() - sockets == set(), "worker sockets left"


def standin_of(mm, model_id):
    for entry in mm.current_loaded_models:
        s = entry.model
        if s is not None and getattr(s, "model_id", None) == model_id:
            return s
    return None


def test_real_worker_registration_census_refusal_shutdown(host):
    mm = host.mm
    assert host.call("load", model_id="unet-e2e", nbytes=3 * MiB,
                     refuse=True) == ["unet-e2e"]
    worker, generation = host.pool._WORKER_POOL[host.key]
    host.workers.append(worker._process.pid)
    # the handshake: a per-spawn authkey, checked on connect
    assert len(worker._authkey) == 64 and worker.is_alive()
    assert worker.supports_partial_release and worker.supports_release_pins

    # comfy-env's own boundary built OUR stand-in from the reply frame
    s = standin_of(mm, "unet-e2e")
    assert type(s) is cs.StandIn
    assert s.size == 3 * MiB and s.kind == "unet"
    assert s.worker is worker and s.worker_generation == generation
    assert host.pool._WORKER_PATCHERS[host.key]["unet-e2e"] is s
    assert s.pool is cs.default_pool() and s in s.pool.held()
    entry = mm.loaded_entry(s)
    assert entry.currently_used is False and entry.model_finalizer.alive

    # the next frame carries the worker's census: applied to the stand-in
    host.call("touch")
    loaded, seq, _, source = s.receipt()
    assert (loaded, seq, source) == (3 * MiB, 1, "census")

    # a live worker refuses to move a model (the move raises in it; with
    # no torch in the worker, importing torch does): nothing freed, the
    # receipt kept, the eviction deferred
    assert s.partially_unload("cpu", 1 * MiB) == 0
    assert s.receipt()[:2] == (loaded, seq) and s.receipt()[3] == "census"
    assert s.eviction_deferred and worker.is_alive()
    # ComfyUI's own eviction: detach refused, the entry popped anyway ...
    mm.unload_all_models()
    assert mm.loaded_entry(s) is None
    assert s.loaded_size() == 3 * MiB
    # ... and listed again at comfy-env's next node boundary
    del s, entry
    gc.collect()
    host.call("touch")
    s = standin_of(mm, "unet-e2e")
    assert s is not None and s.loaded_size() == 3 * MiB

    # shutdown: the worker is gone, the stand-in reads 0 and is let go
    worker.shutdown()
    assert not worker.is_alive()
    assert s.partially_unload("cpu", 1 * MiB) == 3 * MiB  # the gone path
    assert s.stale and s.loaded_size() == 0
    del s
    cs.default_pool().boundary(mm)
    assert not any(
        getattr(p, "model_id", None) == "unet-e2e"
        for p in cs.default_pool().held()
    )


def test_real_worker_killed_is_noticed_at_the_boundary(host):
    """SIGKILL between calls: the next boundary (comfy-env's, wrapped)
    marks the worker gone; the next call respawns a new generation whose
    stand-in is a fresh C one."""
    import signal

    mm = host.mm
    host.call("load", model_id="m", nbytes=1 * MiB)
    worker, generation = host.pool._WORKER_POOL[host.key]
    host.workers.append(worker._process.pid)
    s = standin_of(mm, "m")
    os.kill(worker._process.pid, signal.SIGKILL)
    worker._process.wait(timeout=60)
    cs.default_pool().boundary(mm)
    assert s.stale and s.loaded_size() == 0
    assert s not in cs.default_pool().held()
    host.call("load", model_id="m", nbytes=1 * MiB)
    worker2, generation2 = host.pool._WORKER_POOL[host.key]
    host.workers.append(worker2._process.pid)
    assert worker2 is not worker and generation2 > generation
    s2 = standin_of(mm, "m")
    assert type(s2) is cs.StandIn and s2 is not s
    assert s2.worker_generation == generation2 and not s2.stale


def test_pressure_reaches_comfy_envs_hook(host, monkeypatch):
    """With the adapter, a short eviction of our stand-in notifies
    comfy-env's own pressure hook, as its patcher does."""
    from comfy_env.isolation import model_patcher

    seen = []
    monkeypatch.setattr(model_patcher, "_ON_PRESSURE", seen.append)
    assert cs.default_pool().on_pressure is not None
    cs.default_pool().on_pressure(5 * MiB)
    assert seen == [5 * MiB]


@pytest.mark.torch_worker
def test_real_worker_unload_and_detach_echoes(host):
    """torch in the worker: its own model_partial_unload and
    model_to_device handlers move the module and answer; the stand-in
    takes their echoes.  Deselected by default (pyproject's addopts);
    ``-m torch_worker`` runs it, and without torch it fails."""
    assert HAVE_TORCH, (
        "the torch_worker tests need torch in this environment: "
        "pip install torch==2.13.0 (CPU wheel)"
    )
    mm = host.mm
    host.call("load", model_id="u", nbytes=4 * MiB)
    host.call("load", model_id="d", nbytes=2 * MiB)  # census for "u" too
    worker, _ = host.pool._WORKER_POOL[host.key]
    host.workers.append(worker._process.pid)
    u, d = standin_of(mm, "u"), standin_of(mm, "d")
    host.call("touch")
    assert u.loaded_size() == 4 * MiB and d.loaded_size() == 2 * MiB
    # a whole-module move (no patcher in the worker): all of it freed
    assert u.partially_unload("cpu", 1 * MiB) == 4 * MiB
    assert u.receipt()[0] == 0 and u.receipt()[3] == "unload echo"
    assert not u.eviction_deferred
    # detach: model_to_device answers with a fresh seq
    seq_before = d.receipt()[1]
    d.detach()
    loaded, seq, _, source = d.receipt()
    assert (loaded, source) == (0, "detach echo") and seq > seq_before
    # ComfyUI's next free_memory finds nothing left to move
    mm.unload_all_models()
    host.call("touch")
    assert u.loaded_size() == 0 and d.loaded_size() == 0


@pytest.mark.torch_worker
def test_a_detach_that_moved_nothing_keeps_the_bytes(host):
    """comfy-env's worker answers model_to_device with moved False when
    the module's first parameter is already on the offload device, even
    though its patcher still holds bytes on the card (a partial load):
    nothing was freed, so the stand-in must not write 0, and the board
    (read from the worker's own census) must agree with it."""
    assert HAVE_TORCH, (
        "the torch_worker tests need torch in this environment: "
        "pip install torch==2.13.0 (CPU wheel)"
    )
    mm = host.mm
    host.call("load_partly", model_id="p", resident=2 * MiB)
    host.call("touch")  # the census of the call's end: 2 MiB
    worker, _ = host.pool._WORKER_POOL[host.key]
    host.workers.append(worker._process.pid)
    s = standin_of(mm, "p")
    assert s.model_size() == 4 * MiB
    assert s.receipt()[0] == 2 * MiB
    board, slot = s.board
    deadline = time.monotonic() + 30
    while board.status(slot) != "valid":
        assert time.monotonic() < deadline, board.status(slot)
        time.sleep(0.01)
    assert board.read(slot)[0] == 2 * MiB
    s.detach()
    # the worker moved nothing: the receipt keeps its bytes, the eviction
    # counts as refused (ComfyUI is told nothing was freed; the pool lists
    # the model again at the next boundary), and the board still says so
    assert s.receipt()[0] == 2 * MiB and s.receipt()[3] != "detach echo"
    assert s.eviction_deferred
    assert s.loaded_size() == 2 * MiB
    assert board.read(slot)[0] == 2 * MiB
    status = cs.default_pool().charge_details()[worker]
    assert status["sum_loaded"] >= 2 * MiB
