"""The command line, run as users run it: ``python -m comfy_standin ...``
in a subprocess (docs/cli.md), and as the console script
``comfy-standin``."""

from __future__ import annotations

import glob
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest

from comfy_standin import _demo, _status
from comfy_standin._handoff import ENV_VAR, Handoff

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
    """Board segments in /dev/shm.  Other processes on the machine (other
    test runs) may have some of their own: tests look for the names the
    demo printed, not at the difference of two listings."""
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
    started = []

    def crash(self):
        started.append(self.start_worker("A"))
        started.append(self.board_names[-1])
        raise RuntimeError("boom in the middle of the demo")

    monkeypatch.setattr(_demo.Demo, "run", crash)
    out = io.StringIO()
    assert _demo.run_demo("reference", out) == 1
    text = out.getvalue()
    assert "the demo crashed: RuntimeError: boom" in text
    assert "[ok  ] no board segment, descriptor or mapping left" in text
    assert started and started[0].process.returncode is not None
    assert not demo_worker_alive(started[0].pid)
    # On Linux the board is a sealed memfd with no name; elsewhere its name
    # must be gone from /dev/shm.
    assert not os.path.exists("/dev/shm/" + started[1].lstrip("/"))


# ---------------------------------------------------------------------------
# status


def test_status_in_a_fresh_process_says_it_is_empty():
    """A fresh process has no workers: one line says so and points to
    ``status --url`` (where ComfyUI's workers are), then the probe."""
    result = cli("status")
    assert result.returncode == 0, result.stderr
    first, *rest = result.stdout.splitlines()
    assert first.startswith("no workers in this process")
    assert "python -m comfy_standin status --url" in first
    assert "pool (" not in result.stdout  # no empty pool dump
    assert "boards attached" not in result.stdout
    assert rest[0].startswith("GPU probe")


def test_status_json_parses():
    result = cli("status", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["workers"] == [] and data["boards"] == []
    # The demo's --impl names, one vocabulary.
    assert data["implementation"] == "c"
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
    worker_side, fd = Board.make(4, generation=3)
    worker_side.close()  # the worker closed it: reads say "not attached"
    with Board.adopt(fd, 4, generation=3) as board:
        os.close(fd)
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
    # The key status --json uses for the same summary.
    assert set(data) == {"probe", "probe_summary"}
    assert data["probe_summary"]["devices"] == len(data["probe"]["devices"])


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
    cuda = data["probe_summary"]["libraries"]["cuda"]
    assert cuda["loaded"] is False and missing in cuda["explanation"]


def test_probe_require_gpu_exit_code():
    result = cli("probe", "--require-gpu",
                 env={"COMFY_STANDIN_PROBE_DISABLE": "1"})
    assert result.returncode == 3
    assert "disabled by COMFY_STANDIN_PROBE_DISABLE" in result.stdout
    # Why, on stderr, one line: in every output mode.
    for mode in ((), ("-q",), ("--json",)):
        result = cli("probe", "--require-gpu", *mode,
                     env={"COMFY_STANDIN_PROBE_DISABLE": "1"})
        assert result.returncode == 3
        assert result.stderr == (
            "probe: no GPU readable: CUDA driver not loaded (disabled); "
            "NVML not loaded (disabled)\n")
    missing = "/nonexistent/libnvidia-ml-for-test.so.1"
    result = cli("probe", "--require-gpu", "-q",
                 env={"COMFY_STANDIN_LIBCUDA": missing,
                      "COMFY_STANDIN_LIBNVML": missing})
    assert result.returncode == 3
    assert result.stderr.count("\n") == 1
    assert f"NVML not loaded ({missing}: cannot open" in result.stderr


def test_no_gpu_reason_names_a_library_that_found_no_device():
    summary = _status.probe_summary({
        "cuda": {"loaded": True, "error": None},
        "nvml": {"loaded": True, "error": "nvmlDeviceGetCount: no device"},
        "devices": []})
    assert _status.no_gpu_reason(summary) == (
        "no GPU readable: CUDA driver loaded, no device; NVML loaded, no "
        "device (nvmlDeviceGetCount: no device)")


def test_json_never_prints_a_bare_infinity(monkeypatch, capsys):
    """--json is JSON for any reader: a non-finite number is refused in
    one line naming where it is, and nothing goes to stdout."""
    import comfy_standin as cs
    from comfy_standin import __main__ as main

    import logging

    result = cs.probe()
    result["devices"] = [{"index": 0, "free": float("inf")}]
    monkeypatch.setattr(cs, "probe", lambda: result)
    # --json sets the package's log level for the process: put it back.
    logger = logging.getLogger("comfy_standin")
    monkeypatch.setattr(logger, "level", logger.level)
    assert main.main(["probe", "--json"]) == main.EXIT_FAILED
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith(
        " probe: --json: probe.devices[0].free (inf) is not a finite "
        "number; printed nothing (JSON has no such number)\n"), err
    assert err.count("\n") == 1


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
    assert cli("nonsense").returncode == 2
    assert cli("demo", "--impl", "rust").returncode == 2


# ---------------------------------------------------------------------------
# conventions every subcommand follows (docs/cli.md)

SUBCOMMANDS = ["demo", "status", "probe", "selfcheck"]
MARK = "COMFY_STANDIN_TEST_RUN"


def mark(value: str) -> str:
    """MARK's value for `value` in this test run: another run on the
    machine (another CI lane) marks its demos apart."""
    return f"{value}-{os.getpid()}"


def console_script() -> str:
    """The ``comfy-standin`` entry point installed next to this Python
    (pip installs it with the package; its absence is a failure)."""
    path = os.path.join(os.path.dirname(sys.executable), "comfy-standin")
    assert os.access(path, os.X_OK), f"no console script at {path}"
    return path


def run(argv: list[str], env: dict[str, str] | None = None, **kwargs):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(argv, capture_output=True, text=True,
                          timeout=TIMEOUT, env=full_env, **kwargs)


def test_version_names_the_program_as_invoked():
    import comfy_standin

    result = cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"python -m comfy_standin {comfy_standin.__version__}")
    result = run([console_script(), "--version"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"comfy-standin {comfy_standin.__version__}")


@pytest.mark.parametrize("sub", [None, *SUBCOMMANDS])
def test_usage_names_the_program_as_invoked(sub):
    tail = [sub] if sub else []
    module = cli(*tail, "--help")
    script = run([console_script(), *tail, "--help"])
    assert module.returncode == script.returncode == 0
    name = " ".join(["usage: python -m comfy_standin", *tail])
    assert module.stdout.startswith(name), module.stdout
    assert script.stdout.startswith(
        " ".join(["usage: comfy-standin", *tail])), script.stdout
    assert "__main__.py" not in module.stdout + script.stdout


def test_no_subcommand_is_a_usage_error_on_stderr():
    for result in (cli(), run([console_script()])):
        assert result.returncode == 2
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert lines[0].startswith("usage: ")
        assert any(": error: " in line for line in lines), result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["demo"], ["status"],
                                  ["probe"], ["selfcheck"],
                                  ["demo", "--json"]])
def test_a_closed_pipe_ends_quietly(argv):
    """``comfy-standin demo | head``: the reader has gone before the
    first write; every write fails with EPIPE.  No traceback, the normal
    exit code, and the demo still cleans up."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone already
    try:
        result = subprocess.run(
            [sys.executable, "-m", "comfy_standin", *argv],
            stdout=write_end, stderr=subprocess.PIPE, text=True,
            timeout=TIMEOUT, env={**os.environ, MARK: mark("pipe")},
        )
    finally:
        os.close(write_end)
    assert result.stderr == "", result.stderr
    # 0: for the demo that includes its own check that none of its board
    # segments is left in /dev/shm.
    assert result.returncode == 0
    assert marked_processes(mark("pipe")) == []


def marked_processes(value: str) -> list[int]:
    """Live processes carrying MARK=value in their environment (a demo
    worker inherits it from the demo that started it)."""
    needle = f"{MARK}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ and state != "Z":
            found.append(int(entry))
    return found


def interrupt_demo(signum: int, delay: float, tag: str, group: bool):
    """Start the demo, wait for its first line (its handlers are in
    place from then on), wait `delay` more, send `signum` (to its whole
    process group when `group`, as a terminal's Ctrl-C does).  Returns
    the exit code, stdout, stderr and the demo's segments left over."""
    process = subprocess.Popen(
        # --verbose names each board as it is made: other processes on
        # the machine may have segments of their own in /dev/shm.
        [sys.executable, "-m", "comfy_standin", "demo", "--verbose"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, MARK: tag, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        first = process.stdout.readline()
        assert first.startswith("comfy_standin "), first
        if delay:
            time.sleep(delay)  # where in the demo the signal lands
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        out, err = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    made = re.findall(r"\[board\] created (/csb[0-9a-f]+)", out)
    left = {"/dev/shm" + name for name in made} & segments()
    return process.returncode, first + out, err, left


# The demo takes a few hundred ms: these land before, between and after
# the workers start, in the scenes, and in the clean-up.
DELAYS = [0.0, 0.005, 0.01, 0.02, 0.04, 0.05, 0.06, 0.1, 0.2]


@pytest.mark.parametrize("delay", DELAYS)
def test_sigterm_cleans_up_and_exits_143(delay):
    tag = mark(f"term-{delay}")
    code, out, err, left = interrupt_demo(signal.SIGTERM, delay, tag,
                                          group=False)
    if code in (0, -signal.SIGTERM):
        # The demo had finished before the signal came (0), or it came in
        # the last moment of interpreter exit, after main() had put the
        # default handler back (-15): the run was complete and said so.
        assert "checks held" in out, (code, err)
    else:
        assert code == 143, (code, err)
        assert err.splitlines() == [
            "python -m comfy_standin: terminated; cleaned up"], err
    assert left == set()
    assert marked_processes(tag) == []


@pytest.mark.parametrize("gone", ["handoff", "stdout"])
def test_a_demo_worker_whose_host_is_gone_exits_quietly(gone):
    """The demo ends its workers when interrupted; one still sending its
    board, or its greeting, meets a closed socket or pipe: it exits 1 with
    nothing on stderr (which is the interrupted host's terminal), not with
    a BrokenPipeError traceback."""
    handoff = Handoff()
    read_end, write_end = os.pipe()
    if gone == "handoff":
        handoff.close()
    else:
        os.close(read_end)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "comfy_standin._demo_worker"],
            stdin=subprocess.PIPE, stdout=write_end, stderr=subprocess.PIPE,
            env={**os.environ, ENV_VAR: handoff.spec},
        )
    finally:
        os.close(write_end)
    try:
        _, err = process.communicate(timeout=TIMEOUT)
    finally:
        if gone == "handoff":
            os.close(read_end)
        else:
            handoff.close()
    assert (process.returncode, err.decode()) == (1, "")


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05])
def test_ctrl_c_cleans_up_and_exits_130(delay):
    tag = mark(f"int-{delay}")
    code, out, err, left = interrupt_demo(signal.SIGINT, delay, tag,
                                          group=True)
    if code in (0, -signal.SIGINT):  # finished first (see above)
        assert "checks held" in out, (code, err)
    else:
        assert code == 130, (code, err)
        assert err.splitlines() == [
            "python -m comfy_standin: interrupted; cleaned up"], err
    assert left == set()
    assert marked_processes(tag) == []


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_json_on_every_subcommand(sub):
    result = cli(sub, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # the whole of stdout is JSON
    assert isinstance(data, dict) and data


def test_demo_json_has_each_step_answer_and_check():
    result = cli("demo", "--json", "--impl", "reference")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["implementation"] == "reference"
    titles = [step["title"] for step in data["steps"]]
    assert titles[:5] == [t for t in titles if t[0].isdigit()]
    assert len(data["checks"]) >= 20
    assert all(c["ok"] and c["claim"] and c["step"] for c in data["checks"])
    first = data["steps"][0]
    (table,) = first["models"][:1]
    unet = next(m for m in table["models"] if m["model"] == "A/unet")
    assert unet["model_size"] == 4 << 30
    assert unet["loaded_size"] == unet["receipt"] == 5 << 29
    assert unet["source"] == "load echo" and unet["host"] is False
    pressure = data["steps"][2]["free_memory"][0]
    assert [c["name"] for c in pressure["candidates"]][0] == "A/unet"
    assert pressure["ended_short"] is False
    killed = data["steps"][3]["free_memory"][0]
    assert killed["ended_short"] is True
    assert killed["evictions"][0]["card_got_back"] == 0
    glossary = {term for step in data["steps"] for term in step["glossary"]}
    assert glossary == set(_demo.GLOSSARY)


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_quiet_prints_the_result_line_only(sub):
    result = cli(sub, "--quiet")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1, result.stdout
    assert result.stderr == ""


def test_verbose_says_more():
    quiet = cli("demo", "--no-status").stdout
    loud = cli("demo", "--no-status", "--verbose").stdout
    assert "[wire] model_partial_unload" in loud
    assert "[wire]" not in quiet
    assert len(loud.splitlines()) > len(quiet.splitlines())
    assert len(cli("selfcheck", "-v").stdout) > len(cli("selfcheck").stdout)
    assert "raw probe result" in cli("probe", "-v").stdout
    # A fresh process has no workers: -v still adds the raw probe.
    assert "raw probe result" in cli("status", "-v").stdout
    assert "raw probe result" not in cli("status").stdout
    both = cli("demo", "-q", "-v")
    assert both.returncode == 2 and "not allowed" in both.stderr


@pytest.mark.parametrize("sub", ["demo", "status", "probe", "selfcheck",
                                 "install-node", "uninstall-node"])
def test_verbose_help_says_what_it_does_for_the_command(sub):
    """Each command's -v help is its own; the demo's wire log is the
    demo's alone."""
    from benchload import TOOLS_DIR, load_bench

    from comfy_standin import __main__ as main

    clidoc = load_bench("clidoc", folder=TOOLS_DIR)
    helps = {name: next(a.help for a in parser._actions
                        if a.dest == "verbose")
             for name, (parser, _) in clidoc.subcommands(
                 main.build_parser()).items()}
    verbose = types.SimpleNamespace(help=helps[sub])
    assert list(helps.values()).count(verbose.help) == 1, helps
    assert verbose.help != main.VERBOSE_HELP
    assert ("worker" in verbose.help) == (sub == "demo"), verbose.help
    shown = " ".join(cli(sub, "--help").stdout.split())
    assert " ".join(verbose.help.split()) in shown


def run_on_a_terminal(argv: list[str], env: dict[str, str]) -> str:
    """Runs the command with its stdout on a pseudo-terminal."""
    import pty

    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "comfy_standin", *argv],
            stdout=follower, stderr=subprocess.PIPE, env=env,
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        process.wait(timeout=TIMEOUT)
    finally:
        os.close(leader)
    assert process.returncode == 0
    return b"".join(chunks).decode()


@pytest.mark.parametrize("sub", ["demo", "selfcheck"])
def test_colour_only_on_a_terminal_and_never_with_no_color(sub):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "TERM")}
    env["TERM"] = "xterm"
    assert "\033[" in run_on_a_terminal([sub], env)
    assert "\033[" not in run_on_a_terminal([sub], {**env, "NO_COLOR": "1"})
    assert "\033[" not in run_on_a_terminal([sub], {**env, "TERM": "dumb"})
    piped = run([sys.executable, "-m", "comfy_standin", sub], env=env)
    assert "\033[" not in piped.stdout
    assert "\033[" not in cli(sub, "--json").stdout
