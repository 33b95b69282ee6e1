"""Nothing is printed, and nothing crashes, at interpreter exit, whatever
order the interpreter tears things down in.

Each case runs comfy-env's own stand-in usage (comfy-env 0.4.46's
SubprocessModelPatcher swapped for ours by the adapter, driven as
comfy-env's patcher tests drive it) in a fresh interpreter, leaves the
objects alive in a different arrangement, and lets the interpreter exit.
At exit the collector may clear the extension module's state, or the
StandIn type (whose module reference then goes), before the objects that
still use them: a finalizer that runs then must get a clean error or
answer, never a NULL dereference or an "Exception ignored" line.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Each case runs comfy-env 0.4.46's own patcher in a fresh interpreter.
pytestmark = pytest.mark.comfy_env

PRELUDE = """
import gc, sys, types, weakref
mode = sys.argv[1]
mm = types.ModuleType("comfy.model_management")
mm.get_torch_device = lambda: types.SimpleNamespace(type="cpu")
mm.get_total_memory = lambda dev: 0
mm.get_free_memory = lambda dev: 0
mm.free_memory = lambda memory_required, device, keep_loaded=[]: []
comfy_pkg = types.ModuleType("comfy")
comfy_pkg.model_management = mm
sys.modules["comfy"] = comfy_pkg
sys.modules["comfy.model_management"] = mm
from comfy_env.isolation import model_patcher
from comfy_standin.integrations import comfy_env as adapter
assert adapter.install()
import comfy_standin as cs
from comfy_standin import _core
import logging
logging.getLogger("comfy_standin").addHandler(logging.NullHandler())
logging.getLogger("comfy_standin").propagate = False

class FakeWorker:
    def __init__(self, alive=True, reply=None, boom=False):
        self._alive, self._reply, self._boom = alive, reply or {}, boom
        self.sent = []
    def is_alive(self):
        return self._alive
    def send_command(self, command, **kwargs):
        self.sent.append((command, kwargs))
        if self._boom:
            raise RuntimeError("transport exploded")
        return dict(self._reply)

def make(worker, model_id="m1", size=8 << 30, resident=None, pool=None):
    kwargs = {} if pool is None else {"pool": pool}
    p = model_patcher.SubprocessModelPatcher(
        worker=worker, worker_generation=1, model_id=model_id,
        model_size=size, load_device="cuda:0", offload_device="cpu",
        **kwargs)
    p.model.model_loaded_weight_memory = size if resident is None else resident
    p.model.device = "cuda:0"
    return p

# comfy-env's own usage of its stand-in, with ours.
freed = 200 << 20
a = make(FakeWorker(reply={"freed": freed, "resident": (8 << 30) - freed}))
assert a.partially_unload("cpu", memory_to_free=freed) == freed
b = make(FakeWorker(alive=False), "m2", resident=4 << 30)
assert b.partially_unload("cpu", memory_to_free=1024) == 4 << 30
b.detach()
c = make(FakeWorker(boom=True), "m3")
assert c.partially_unload("cpu", memory_to_free=1024) == 0
c.detach()
d = make(FakeWorker(reply={"loaded": 3 << 30, "resident": 3 << 30}), "m4",
         resident=0)
assert d.partially_load("cuda:0", extra_memory=3 << 30) == 3 << 30
try:
    a.some_new_upstream_field
except AttributeError as exc:
    assert "some_new_upstream_field" in str(exc)
weakref.ref(a.model)
keep = [a, b, c, d]

def use(s):
    # Everything a finalizer may do with a stand-in at exit.
    for call in (lambda: s.loaded_size(), lambda: s.model_size(),
                 lambda: s.is_dynamic(), lambda: s.receipt(),
                 lambda: s.model, lambda: s.clone_base_uuid,
                 lambda: s.device, lambda: s.model_loaded_weight_memory,
                 lambda: s.current_loaded_device(), lambda: repr(s),
                 lambda: s.partially_unload("cpu", 10),
                 lambda: s.detach(),
                 lambda: s.partially_load("cuda:0", 10),
                 lambda: cs.apply_echo(s, 0),
                 lambda: cs.apply_residency({}, []),
                 lambda: cs.StandIn(FakeWorker(), 1, "late", 10, "cuda:0",
                                    "cpu"),
                 lambda: s.pool.standins(),
                 lambda: s.pool.worker_charges()):
        try:
            call()
        except Exception:
            pass
"""

CASES = {
    # The objects stay in module globals (the simplest teardown).
    "plain": "",
    # The worker holds the pool and the stand-ins, the pool holds the
    # StandIn type: the collector may clear the type (its module reference
    # goes) before it frees the stand-ins.
    "type": """
        pool = cs.Pool()
        w = FakeWorker()
        made = [cs.StandIn(w, 1, f"t{i}", 10, "cuda:0", "cpu", pool=pool)
                for i in range(3)]
        pool.t = type(made[0])
        w.pool = pool
        w.made = made
    """,
    # The extension module itself is in the cycle.
    "module": """
        pool = cs.Pool()
        w = FakeWorker()
        _core.keep = [pool, w,
                      cs.StandIn(w, 1, "x", 10, "cuda:0", "cpu", pool=pool)]
        pool.core = _core
        w.core = _core
    """,
    # A finalizer in a cycle uses stand-ins when the collector reaches it,
    # whatever was cleared before.
    "finalizer": """
        class User:
            def __del__(self):
                for s in self.standins:
                    use(s)
        for order in range(3):
            u = User()
            u.me = u
            u.standins = keep[order:] + keep[:order]
            u.core = _core
            u.type = cs.StandIn
        del u
    """,
    # Registered in ComfyUI's list with finalizers on their inner module
    # (each stand-in itself), the default pool holding them.
    "registered": """
        class LoadedModel:
            def __init__(self, model):
                self._model = weakref.ref(model)
                self.currently_used = True
                self.real_model = None
                self.model_finalizer = None
            @property
            def model(self):
                return self._model()
        def cleanup_models():
            mm.current_loaded_models[:] = [
                e for e in mm.current_loaded_models
                if e.real_model is not None and e.real_model() is not None]
        mm.LoadedModel = LoadedModel
        mm.current_loaded_models = []
        mm.cleanup_models = cleanup_models
        for s in keep:
            cs.register(mm, s)
        mm.keep = mm
    """,
    # A board attached (real shared memory) and a daemon thread reading.
    "board": """
        import threading
        import os
        side, fd = cs.Board.make(4)
        board = cs.Board.adopt(fd, 4)
        os.close(fd)
        keep[0].attach_board(board)
        def read():
            while True:
                keep[0].loaded_size()
                keep[0].receipt()
        threading.Thread(target=read, daemon=True).start()
        keep[0].pool.board = board
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nothing_is_printed_at_exit(case):
    code = PRELUDE + textwrap.dedent(CASES[case]) + "\nprint('done')\n"
    done = subprocess.run([sys.executable, "-c", code, case],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "done\n", "")


@pytest.mark.parametrize("case", ["type", "module", "finalizer"])
def test_nothing_is_printed_at_exit_with_the_reference(case):
    """The same teardown orders with the reference's stand-ins (the module
    cycle with the C module is kept: the reference pools hold the C
    module's Board type)."""
    code = PRELUDE.replace(
        "import comfy_standin as cs", "import comfy_standin._reference as cs"
    ) + textwrap.dedent(CASES[case]) + "\nprint('done')\n"
    done = subprocess.run([sys.executable, "-c", code, case],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "done\n", "")
