"""comfy_standin._core declares per-interpreter GIL support on 3.12+
(Py_mod_multiple_interpreters): every Python object it uses lives in its
module state, nothing is queued from one interpreter onto another, and
the C core's process-wide state is thread-safe.  Here an isolated
subinterpreter (its own GIL) imports the package, uses every part of it,
and is destroyed, several times over, while the main interpreter keeps
using its own instance.

The subinterpreter API appeared in 3.12 (``_xxsubinterpreters``, then
``_interpreters`` in 3.13); before that there is nothing to test, and CI
runs this file on 3.13."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 12), reason="no subinterpreter API before 3.12"
)

USE = textwrap.dedent("""
    import gc
    import logging
    import os
    import comfy_standin as cs
    from comfy_standin import _core

    logging.getLogger("comfy_standin").addHandler(logging.NullHandler())
    logging.getLogger("comfy_standin").propagate = False

    class Worker:
        def __init__(self):
            self.alive = True
        def send_command(self, command, **kwargs):
            if command == "model_partial_unload":
                return {"freed": 10, "resident": 90, "seq": 2}
            if command == "model_partial_load":
                return {"loaded": 10, "resident": 100, "seq": 4}
            return {"device": "cpu", "moved": True, "seq": 5}
        def is_alive(self):
            return self.alive

    pool = cs.Pool(process_local=True)
    w = Worker()
    s = cs.StandIn(w, 1, "m", 100, "cuda:0", "cpu", pool=pool)
    cs.apply_echo(s, 100, seq=1)
    assert s.partially_unload("cpu", 10) == 10 and s.loaded_size() == 90
    assert cs.apply_residency(
        {"m": s}, [{"id": "m", "resident": 50, "seq": 3}]) == 1
    assert s.partially_load("cuda:0", 10) == 10
    assert s.detach() is s and s.loaded_size() == 0
    s.clone_base_uuid, repr(s), s.receipt()
    try:
        s.partially_load("cuda:0", 1, bogus=1)
    except TypeError:
        pass
    pool.report(w, {"held": 5, "residency": []})
    pool.reserve("cuda:0", 1000, 8000)
    pool.standins(), pool.worker_charges(), cs.probe()
    side, fd = cs.Board.make(2)
    board = cs.Board.adopt(fd, 2)
    os.close(fd)
    s.attach_board(board)
    board.close()
    side.close()
    w.alive = False
    other = cs.StandIn(w, 1, "n", 100, "cuda:0", "cpu", pool=pool)
    cs.apply_echo(other, 40)
    assert other.partially_unload("cpu", 10) == 40  # the worker died
    pool.boundary()
    del s, other, w, pool, board
    gc.collect()
""")

DRIVER = textwrap.dedent("""
    import sys
    if sys.version_info >= (3, 13):
        import _interpreters as interpreters

        def create():
            return interpreters.create(interpreters.new_config("isolated"))

        def run(interp, code):
            failure = interpreters.run_string(interp, code)
            assert failure is None, failure
    else:
        import _xxsubinterpreters as interpreters

        def create():
            return interpreters.create(isolated=True)

        def run(interp, code):
            interpreters.run_string(interp, code)

    import comfy_standin as cs
    from comfy_standin import _core

    code = sys.stdin.read()
    exec(code)  # the main interpreter's own instance, first
    before = _core._live_counts()
    for _ in range(4):
        interp = create()
        run(interp, code)
        run(interp, code)
        interpreters.destroy(interp)
        exec(code)  # the main instance still works in between
    assert _core._live_counts() == before, (_core._live_counts(), before)
    print("ok")
""")


def test_an_isolated_subinterpreter_imports_uses_and_drops_the_module():
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], input=USE, capture_output=True,
        text=True, timeout=300,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")
