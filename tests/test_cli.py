"""The command line, run as users run it: ``python -m comfy_standin ...``
in a subprocess (DESIGN.md 6)."""

from __future__ import annotations

import glob
import io
import json
import os
import re
import subprocess
import sys

import pytest

from comfy_standin import _demo, _status

TIMEOUT = 120  # a hang fails the test instead of blocking CI


def cli(*args: str, env: dict[str, str] | None = None):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "comfy_standin", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=full_env,
    )


def segments() -> set[str]:
    return set(glob.glob("/dev/shm/csb*"))


def demo_worker_alive(pid: int) -> bool:
    """The pid runs a demo worker (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return b"_demo_worker" in cmdline and state != "Z"


# ---------------------------------------------------------------------------
# demo


@pytest.mark.parametrize("impl", ["c", "reference"])
def test_demo_runs_checks_and_leaves_nothing(impl):
    before = segments()
    result = cli("demo", "--impl", impl)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert f"demo ({impl}): all" in out and "checks held" in out
    assert "[FAIL]" not in out
    # The scenes and what ComfyUI saw.
    for scene in ("1. load", "2. a busy call", "3. pressure",
                  "4. worker B is killed", "5. worker A refuses"):
        assert f"== {scene}" in out
    assert "key (-offloaded, refcount, size, index)" in out
    assert re.search(r"B/unet .* 1\.00 GiB +3\.00 GiB +3\.00 GiB +board", out)
    assert "with receipts only, ComfyUI would have taken B/unet first" in out
    assert "B exited with -9" in out
    assert "partially_unload -> 3.00 GiB" in out  # the dead worker's bytes
    assert "(dead owner)" in out
    assert "eviction_deferred" in out
    assert "[ok  ] no board segment, descriptor or mapping left" in out
    # Nothing outlives it: no segment, no worker process.  (Linux boards
    # are sealed memfds: no name in /dev/shm to begin with.)
    names = re.findall(r"board (memfd:csb-[0-9a-f]+|/csb[0-9a-f]+)", out)
    assert len(set(names)) == 2
    for name in names:
        assert not os.path.exists("/dev/shm/" + name.lstrip("/"))
    if not sys.platform.startswith("linux"):
        # Named boards (no memfd here).  On Linux boards have no name, and
        # /dev/shm is shared with whatever else runs on the machine.
        assert segments() - before == set()
    pids = [int(p) for p in re.findall(r"worker [AB] pid (\d+)", out)]
    assert len(set(pids)) == 2
    assert not [pid for pid in pids if demo_worker_alive(pid)]


def test_demo_implementations_print_the_same_story():
    """Same scenario, same numbers: only pids, board names, the
    implementation's name and log wording may differ."""

    def story(impl):
        out = cli("demo", "--impl", impl, "--no-status").stdout
        keep = []
        for line in out.splitlines():
            if "[log]" in line or "pid" in line or "implementation" in line:
                continue
            keep.append(line.replace(f"demo ({impl})", "demo"))
        return keep

    assert story("c") == story("reference")


def test_demo_exits_1_when_a_check_fails(monkeypatch):
    real = _demo.Demo.check_run

    def lying(self, run, label):
        real(self, run, label)
        self.checks.check(False, f"{label}: a claim that does not hold")

    monkeypatch.setattr(_demo.Demo, "check_run", lying)
    out = io.StringIO()
    assert _demo.run_demo("c", out, show_status=False) == 1
    assert "FAILED" in out.getvalue()
    assert "a claim that does not hold" in out.getvalue()


def test_demo_cleans_up_after_a_crash(monkeypatch):
    before = segments()
    started = []

    def crash(self):
        started.append(self.start_worker("A"))
        raise RuntimeError("boom in the middle of the demo")

    monkeypatch.setattr(_demo.Demo, "run", crash)
    out = io.StringIO()
    assert _demo.run_demo("reference", out) == 1
    text = out.getvalue()
    assert "the demo crashed: RuntimeError: boom" in text
    assert "[ok  ] no board segment, descriptor or mapping left" in text
    assert started and started[0].process.returncode is not None
    assert not demo_worker_alive(started[0].pid)
    if not sys.platform.startswith("linux"):
        assert segments() - before == set()


# ---------------------------------------------------------------------------
# status


def test_status_in_a_fresh_process_says_it_is_empty():
    result = cli("status")
    assert result.returncode == 0, result.stderr
    assert "no workers" in result.stdout
    assert "boards attached: none" in result.stdout
    assert "GPU probe" in result.stdout


@pytest.mark.parametrize("impl", ["c", "reference"])
def test_status_json_parses(impl):
    result = cli("status", "--json", "--impl", impl)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["workers"] == [] and data["boards"] == []
    assert data["implementation"].startswith("comfy_standin")
    assert set(data["probe_summary"]["libraries"]) == {"cuda", "nvml"}
    assert "devices" in data["probe"]


class StubWorker:
    pid = 4242

    def send_command(self, command, **kwargs):
        return {}

    def is_alive(self):
        return True


def test_status_collects_a_populated_pool(impl):
    from comfy_standin._core import Board

    pool = impl.Pool(process_local=False)
    worker = StubWorker()
    s = impl.StandIn(worker=worker, worker_generation=3, model_id="unet-0",
                     model_size=1 << 30, load_device="cuda:0",
                     offload_device="cpu", kind="unet", pool=pool)
    impl.apply_echo(s, resident=1 << 29, seq=7)
    with Board.create(4, generation=3) as board:
        s.attach_board(board)
        data = _status.collect(pool)
        text = _status.render(data, probe=False)
    json.dumps(data)  # JSON-able
    (w,) = data["workers"]
    assert w["pid"] == 4242 and w["generation"] == 3 and w["alive"]
    (m,) = w["models"]
    assert (m["model_id"], m["loaded"], m["seq"], m["source"]) == (
        "unet-0", 1 << 29, 7, "load echo")
    assert m["board"]["status"] == "not attached"
    assert data["boards"][0]["models"] == ["unet-0"]
    assert "unet-0" in text and "seq 7" in text and "source load echo" in text
    assert "not attached" in text

    # The board is closed now and the worker gone: status still works.
    pool.worker_gone(worker)
    data = _status.collect(pool)
    json.dumps(data)
    assert data["graveyard"] == 1
    assert data["workers"][0]["alive"] is False
    (m,) = data["workers"][0]["models"]
    assert m["source"] == "worker gone"
    assert m["board"]["status"] == "board closed"
    assert data["boards"][0]["closed"] is True
    text = _status.render(data, probe=False)
    assert "gone" in text and "graveyard: 1" in text and "closed" in text


# ---------------------------------------------------------------------------
# probe


def test_probe_readable_and_json():
    result = cli("probe")
    assert result.returncode == 0, result.stderr
    assert "CUDA driver:" in result.stdout and "NVML:" in result.stdout
    data = json.loads(cli("probe", "--json").stdout)
    assert {"probe", "summary"} <= set(data)
    assert data["summary"]["devices"] == len(data["probe"]["devices"])


def test_probe_explains_a_missing_library():
    missing = "/nonexistent/libcuda-for-test.so.1"
    result = cli("probe", env={"COMFY_STANDIN_LIBCUDA": missing,
                               "COMFY_STANDIN_LIBNVML": missing})
    assert result.returncode == 0
    assert "CUDA driver: not loaded" in result.stdout
    assert missing in result.stdout
    assert "COMFY_STANDIN_LIBCUDA" in result.stdout
    data = json.loads(cli("probe", "--json", env={
        "COMFY_STANDIN_LIBCUDA": missing}).stdout)
    cuda = data["summary"]["libraries"]["cuda"]
    assert cuda["loaded"] is False and missing in cuda["explanation"]


def test_probe_require_gpu_exit_code():
    result = cli("probe", "--require-gpu",
                 env={"COMFY_STANDIN_PROBE_DISABLE": "1"})
    assert result.returncode == 3
    assert "disabled by COMFY_STANDIN_PROBE_DISABLE" in result.stdout


# ---------------------------------------------------------------------------
# selfcheck, help, usage


def test_selfcheck_agrees():
    result = cli("selfcheck")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "C and reference agree on all" in result.stdout
    assert "DIFF" not in result.stdout
    assert result.stderr == ""


def test_selfcheck_detects_disagreement(monkeypatch, capsys):
    from comfy_standin import _reference, _selfcheck

    real = _reference.StandIn.partially_unload

    def off_by_one(self, *args, **kwargs):
        freed = real(self, *args, **kwargs)
        return freed + 1 if freed else freed

    monkeypatch.setattr(_reference.StandIn, "partially_unload", off_by_one)
    assert _selfcheck.run(sys.stdout) == 1
    assert "DISAGREE" in capsys.readouterr().out


@pytest.mark.parametrize("sub", ["demo", "status", "probe", "selfcheck"])
def test_help(sub):
    result = cli(sub, "--help")
    assert result.returncode == 0
    assert "usage:" in result.stdout


def test_usage_errors_exit_2():
    assert cli().returncode == 2
    assert cli("nonsense").returncode == 2
    assert cli("demo", "--impl", "rust").returncode == 2
