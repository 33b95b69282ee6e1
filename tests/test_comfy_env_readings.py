"""The driver's reading of a worker's process, on the product path: the
comfy-env adapter floors each worker's held figure with it at every node
boundary and before ``Pool.reclaim`` decides (docs/architecture.md,
"Unlisted bytes").

comfy-env 0.4.46's real worker and host code (tests/comfy_env_harness.py)
with the mock model_management (tests/mockcomfy) in both processes; the
probe loads the stub NVML and CUDA libraries (tests/c/stubs), whose script
lists the worker's pid.  The probe loads its libraries once per process,
so each story runs in an interpreter of its own and hands back what it
saw as JSON; the assertions are here.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest

from cbuild import build_stub

HERE = pathlib.Path(__file__).resolve().parent
MiB = 1 << 20

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="comfy-env's worker over a Unix socket: Linux"),
    pytest.mark.comfy_env,
]


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    root = tmp_path_factory.mktemp("readings-stubs")
    return build_stub("cuda", root / "cuda"), build_stub("nvml", root / "nvml")


def run_story(name, tmp_path, **env):
    """Runs ``name(root)`` of this module in a fresh interpreter with `env`
    added; returns what it returned."""
    result = tmp_path / "result.json"
    code = (f"import json, sys, {__name__} as t; "
            f"json.dump(t.{name}(sys.argv[1]), open(sys.argv[2], 'w'))")
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(result)],
        cwd=HERE, env={**os.environ, **env}, capture_output=True, text=True,
        timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(result.read_text())


@pytest.mark.parametrize("launcher", ["direct", "pixi"])
def test_bytes_only_the_driver_saw_come_back_as_the_worker_measured(
        stubs, tmp_path, launcher):
    cuda, nvml = stubs
    script = tmp_path / "gpu.txt"
    seen = run_story(f"story_reading_{launcher}", tmp_path,
                     COMFY_STANDIN_LIBCUDA=str(cuda),
                     COMFY_STANDIN_LIBNVML=str(nvml),
                     CS_STUB_SCRIPT=str(script))
    floor = seen["floor"]
    # The worker never reported its scratch (held 0): the driver's figure,
    # its context (the floor) + the 2 MiB model + 5 + 3 MiB of scratch.
    before = seen["before"]
    assert before["held"] == 0
    assert before["reading"] == floor + 10 * MiB
    assert before["held_from_reading"] is True
    assert seen["unlisted_before"] == 8 * MiB
    # free_memory left the card short: one release ask for all the driver
    # showed, and only the 5 MiB the worker measured coming back count
    # (3 MiB of its scratch cannot go).
    (unlisted,) = seen["unlisted_at_reclaim"]
    assert unlisted >= 8 * MiB
    assert seen["asked"] == [unlisted]
    assert seen["reclaimed"] == [5 * MiB]
    assert seen["scratch_left"] == 0
    # status --url and the page show it as the driver's figure, for the
    # pid the driver lists: the worker Python's, not its launcher's
    worker = seen["status"]
    assert worker["pid"] == seen["worker_pid"]
    if launcher == "pixi":
        assert worker["launcher_pid"] not in (None, seen["worker_pid"])
    assert worker["charge"]["reading"] == floor + 10 * MiB
    assert f"driver's reading {(floor + 10 * MiB) >> 20} MiB" in seen["text"]


def test_no_nvml_changes_nothing_and_probes_once(tmp_path):
    seen = run_story(
        "story_no_nvml", tmp_path,
        COMFY_STANDIN_LIBCUDA=str(tmp_path / "none" / "libcuda.so.1"),
        COMFY_STANDIN_LIBNVML=str(tmp_path / "none" / "libnvidia-ml.so.1"))
    assert seen["probes"] == 1  # the failed load, then nothing
    for charge in seen["charges"]:
        assert charge["reading"] == 0 and charge["held_from_reading"] is False
        assert charge["held"] == 0
    assert seen["unlisted"] == [0, 0]
    assert seen["asked"] == []
    assert seen["scratch_left"] == 5 * MiB
    # not a word about readings (the eviction's own lines aside)
    words = ("NVML", "probe", "reading", "driver")
    assert not [line for line in seen["log"]
                if any(word in line for word in words)], seen["log"]


# ---- the stories (each in an interpreter of its own) ------------------------


def _world(root, launcher="direct"):
    """comfy-env's host with the mock model_management and the adapter
    switched on; returns (mm, the Host, its namespace).  With `launcher`
    "pixi" the pack's environment is laid out as comfy-env's pixi ones
    (this Python, seeing this one's packages), which comfy-env starts
    through a launcher that runs the worker Python as its child."""
    from mock_fixtures import mock_mm as mm

    import comfy_env_harness as harness
    from comfy_standin.integrations import comfy_env as adapter

    mm.reset()
    mm.processing_interrupted = lambda: False
    root = pathlib.Path(root)
    env = pathlib.Path(sys.prefix)
    if launcher == "pixi":
        import comfy_env.pixi

        built = harness.same_python_env(root / "pixi")
        env = root / "envs" / "pack" / ".pixi" / "envs" / "default"
        env.parent.mkdir(parents=True)
        built.rename(env)
        (root / "envs" / "pack" / "pixi.toml").write_text("# unread\n")
        comfy_env.pixi.PIXI = str(harness.fake_pixi(root, close_fds=True))
    host = harness.Host(mm, root / "pack", env)
    adapter.install()
    return mm, host, harness.host_namespace(host)


def _record(pool, worker):
    """Records the partial_release sizes asked of `worker`, and what each
    reclaim counted and the unlisted figure it started from."""
    asked, reclaimed, unlisted = [], [], []
    no_spawn, reclaim = worker.send_command_no_spawn, pool.reclaim

    def send_command_no_spawn(method, **kwargs):
        if method == "partial_release":
            asked.append(kwargs["size"])
        return no_spawn(method, **kwargs)

    def record_reclaim(shortfall):
        unlisted.append(pool.unlisted().get(worker, 0))
        reclaimed.append(reclaim(shortfall))
        return reclaimed[-1]

    worker.send_command_no_spawn = send_command_no_spawn
    pool.reclaim = record_reclaim
    return asked, reclaimed, unlisted


def story_reading_direct(root):
    return _story_reading(root, "direct")


def story_reading_pixi(root):
    return _story_reading(root, "pixi")


def _story_reading(root, launcher):
    import comfy_standin as cs
    from comfy_standin import _status

    mm, host, a = _world(root, launcher)
    try:
        a.call("touch")  # starts the worker; no stand-in yet: no probe
        worker, _ = a.current()
        pid = a.call("about")[0]["pid"]
        # The stub reads its script at the first probe: the boundary of
        # the first call that leaves the worker a stand-in.
        pool = cs.default_pool()
        pathlib.Path(os.environ["CS_STUB_SCRIPT"]).write_text(
            "devices 1\n"
            f"total 0 {24 << 30}\n"
            f"free 0 {20 << 30}\n"
            f"proc 0 {os.getpid()} {1 << 30}\n"
            f"proc 0 {pid} {pool.floor + 10 * MiB}\n"
            f"proc 0 {pid + 100000} {4 << 30}\n")
        a.call("load", model_id="unet", nbytes=2 * MiB)
        a.call("scratch", nbytes=5 * MiB, pinned=3 * MiB, reported=False)
        before = pool.charge_details()[worker]
        unlisted_before = pool.unlisted()[worker]
        asked, reclaimed, unlisted = _record(pool, worker)
        mm.free_memory(mm.get_free_memory(mm.CUDA0) + 64 * MiB, mm.CUDA0)
        status = _status.collect(pool)
        (view,) = [w for w in status["workers"] if w["pid"] == pid]
        return {
            "floor": pool.floor, "worker_pid": pid,
            "before": before, "unlisted_before": unlisted_before,
            "asked": asked, "reclaimed": reclaimed,
            "unlisted_at_reclaim": unlisted,
            "scratch_left": a.call("scratch_left")[0],
            "status": view, "text": _status.render(status, probe=False),
        }
    finally:
        host.close()


def story_no_nvml(root):
    import comfy_standin as cs

    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("comfy_standin")
    logger.addHandler(Lines(logging.DEBUG))
    logger.setLevel(logging.DEBUG)
    probes = []
    probe = cs.probe

    def counted():
        probes.append(1)
        return probe()

    cs.probe = counted
    mm, host, a = _world(root)
    try:
        a.call("load", model_id="unet", nbytes=2 * MiB)
        a.call("scratch", nbytes=5 * MiB, pinned=3 * MiB, reported=False)
        worker, _ = a.current()
        pool = cs.default_pool()
        asked, _, _ = _record(pool, worker)
        charges, unlisted = [], []
        for _ in range(2):
            a.call("touch")
            mm.free_memory(mm.get_free_memory(mm.CUDA0) + 64 * MiB,
                           mm.CUDA0)
            charges.append(pool.charge_details()[worker])
            unlisted.append(pool.unlisted()[worker])
        return {
            "probes": len(probes), "charges": charges, "unlisted": unlisted,
            "asked": asked, "scratch_left": a.call("scratch_left")[0],
            "log": lines,
        }
    finally:
        host.close()
