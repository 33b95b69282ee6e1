"""ComfyUI itself, as a user runs it: its own ``main.py --cpu`` from the
tree ``COMFY_STANDIN_COMFYUI`` names (copied first: ComfyUI writes
``user/``, ``output/``, ``temp/``, ``custom_nodes/``), with comfy-standin
switched on by ``install-node``, and the repository's own comfy-env pack
(tests/packs/standin-e2e-pack, one node) whose environment is a venv of
another CPython minor version with torch and numpy and nothing of ours.

ComfyUI runs under the Python that runs pytest, or the one
``COMFY_STANDIN_COMFYUI_PYTHON`` names; it must have ComfyUI's
requirements, comfy-env and comfy-standin (the README, "What the tests
need").  comfy-env finds the pack's environment where it keeps pixi's
(``$COMFY_ENV_ROOT/envs/<pack>_<abi>/.pixi/envs/default``: the path is
asked of comfy-env itself) and starts it through pixi
(``$HOME/.comfy-env/pixi/<version>/pixi``: here a launcher of
tests/comfy_env_harness.py, with HOME a temporary folder).  The pack's
environment has torch because comfy-env's worker needs it in a ComfyUI
that has torch: the spawn round-trips a torch tensor through the worker
(``SubprocessWorker.verify_transport``), and a worker without torch fails
every call.

Each test is one ComfyUI start (one scenario), its log shown when it
fails; ``COMFY_STANDIN_SCREENSHOT=path`` writes the page as the first
scenario shows it (docs/img/vram-page.png is made so).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from browser import READ_PAGE, Browser
from comfy_env_harness import (
    fake_pixi,
    make_pack_env,
    make_venv,
    other_pythons,
)

pytestmark = [
    pytest.mark.comfyui,
    # comfy-env is ComfyUI's here; -m "not comfy_env" leaves these out
    pytest.mark.comfy_env,
    # the pack environment's torch comes from PyPI
    pytest.mark.network,
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="boards are memfds: Linux"),
]

TREE = "COMFY_STANDIN_COMFYUI"
PYTHON = "COMFY_STANDIN_COMFYUI_PYTHON"
SCREENSHOT = "COMFY_STANDIN_SCREENSHOT"
KEEP_ENVS = "COMFY_STANDIN_PACK_ENVS"

PACK = "standin-e2e-pack"
PACK_SOURCE = Path(__file__).resolve().parent / "packs" / PACK
MiB = 1 << 20
#: Bounds a broken run only (ComfyUI's start, a prompt, a reading); no
#: test asserts a duration.
LIMIT = 300.0

#: What the copy of the tree leaves out: a user's models, outputs,
#: other custom nodes, virtual environments and git history.
NOT_COPIED = {".git", "models", "input", "output", "temp", "user",
              "custom_nodes", "venv", ".venv", "__pycache__"}

#: A traceback frame in code of comfy-standin's: the package, the node
#: entry, the worker-side publisher.
OUR_FRAME = re.compile(
    r'File "[^"]*(comfy_standin|comfy-standin-switch)[^"]*", line \d+')

#: What ComfyUI's Python is asked before anything starts.
ABOUT_PYTHON = """
import importlib.metadata as md, json, sys
import comfy_standin
from comfy_standin.integrations import comfy_env as adapter
print(json.dumps({
    "minor": "%d.%d" % sys.version_info[:2],
    "comfy_standin": comfy_standin.__version__,
    "comfy_env": md.version("comfy-env"),
    "supported": [v for v, what in adapter.TESTED_COMFY_ENV.items()
                  if what == "full"],
    "torch": md.version("torch"),
}))
"""

#: Where comfy-env (ComfyUI's, with this HOME and COMFY_ENV_ROOT) looks
#: for pixi and for the pack's environment.
ASK_COMFY_ENV = """
import json, sys
from pathlib import Path
import comfy_env.pixi
from comfy_env.environment import cache
pack = Path(sys.argv[1])
name = cache.get_env_name(pack, pack / "nodes" / "comfy-env.toml")
print(json.dumps({"pixi": comfy_env.pixi.PIXI,
                  "env": str(cache.get_workspace_env_dir(None, name))}))
"""


def fail(message: str) -> None:
    pytest.fail(message, pytrace=False)


def run(argv: list[str], env: dict[str, str] | None = None,
        timeout: float = LIMIT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True,
                          timeout=timeout, env=env)


def wait_until(predicate: Any, what: str, log: Any = None,
               limit: float = LIMIT) -> Any:
    """predicate()'s first truthy value, polled; the limit bounds a
    broken run only."""
    deadline = time.monotonic() + limit
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = f"\n... ComfyUI's log ends:\n{log()[-4000:]}" if log else ""
            raise AssertionError(f"never saw: {what}{tail}")
        time.sleep(0.1)


def copy_tree(source: Path, target: Path) -> None:
    """The tree without what NOT_COPIED names, writable (the source may
    be read-only), with an empty custom_nodes (a git checkout has one)."""
    def ignore(directory: str, names: list[str]) -> set[str]:
        return NOT_COPIED & set(names) if Path(directory) == source else {
            "__pycache__"} & set(names)

    shutil.copytree(source, target, ignore=ignore, symlinks=True)
    for directory, _, _ in os.walk(target):
        os.chmod(directory, 0o755)
    (target / "custom_nodes").mkdir()


def has_torch(venv: Path, version: str) -> bool:
    """Whether the venv imports numpy and torch of that version."""
    python = venv / "bin" / "python"
    if not python.exists():
        return False
    done = run([str(python), "-c",
                "import numpy, torch; print(torch.__version__)"])
    return done.returncode == 0 and done.stdout.startswith(version)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Setup:
    """Everything the scenarios share: ComfyUI's Python, the copied tree
    with the pack in it, the pack's environment, the launchers."""

    def __init__(self, base: Path) -> None:
        tree = os.environ[TREE]
        source = Path(tree).expanduser().resolve()
        if not ((source / "main.py").is_file()
                and (source / "server.py").is_file()):
            fail(f"{TREE}={tree}: not a ComfyUI folder (no main.py and "
                 f"server.py there)")
        self.python = os.environ.get(PYTHON) or sys.executable
        about = run([self.python, "-c", ABOUT_PYTHON])
        if about.returncode != 0:
            fail(f"ComfyUI's Python ({self.python}; set {PYTHON} to "
                 f"another) cannot import comfy_standin, comfy-env or "
                 f"torch: install ComfyUI's requirements, comfy-env and "
                 f"comfy-standin into it.\n{about.stderr[-2000:]}")
        self.about = json.loads(about.stdout)
        if self.about["comfy_env"] not in self.about["supported"]:
            fail(f"ComfyUI's Python has comfy-env "
                 f"{self.about['comfy_env']}; live boards are checked "
                 f"against {self.about['supported']}: install one of them")
        self.base = base
        self.tree = base / "ComfyUI"
        copy_tree(source, self.tree)
        shutil.copytree(PACK_SOURCE, self.tree / "custom_nodes" / PACK,
                        ignore=shutil.ignore_patterns("__pycache__"))
        self.home = base / "home"
        self.tmp = base / "tmp"
        self.home.mkdir()
        self.tmp.mkdir()
        # Nothing of this run's own settings (COMFY_STANDIN_*, pytest's)
        # reaches ComfyUI: a user's COMFY_STANDIN_NO_BOARD would turn
        # boards off.
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("COMFY_STANDIN_")
                    and k not in ("PYTEST_ADDOPTS", "PYTHONPATH")}
        self.env.update(HOME=str(self.home), TMPDIR=str(self.tmp),
                        COMFY_ENV_ROOT=str(base / "comfy-env"),
                        PYTHONUNBUFFERED="1")
        where = run([self.python, "-c", ASK_COMFY_ENV,
                     str(self.tree / "custom_nodes" / PACK)], env=self.env)
        assert where.returncode == 0, where.stderr
        paths = json.loads(where.stdout)
        self.pixi = Path(paths["pixi"])
        self.pack_env = Path(paths["env"])
        self.pack_minor, pack_python = self._pack_python()
        self._make_pack_env(pack_python)
        launchers = base / "launchers"
        launchers.mkdir()
        self.launchers = {
            "pixi-close": fake_pixi(launchers, close_fds=True),
            "pixi-keep": fake_pixi(launchers, close_fds=False),
        }

    def _make_pack_env(self, python: str) -> None:
        """The pack's environment where comfy-env looks for it: made
        there, or linked there from the folder COMFY_STANDIN_PACK_ENVS
        names, which keeps one venv per Python and torch
        (``3.13-torch==2.14.1``) for the next run (made there when it is
        missing or does not import numpy and that torch)."""
        version = self.about["torch"].split("+")[0]
        packages = ("numpy", f"torch=={version}")
        kept = os.environ.get(KEEP_ENVS)
        if not kept:
            made = make_pack_env(self.base / "comfy-env", python,
                                 self.pack_env.parents[2].name, packages)
            assert made == self.pack_env, (made, self.pack_env)
            return
        venv = Path(kept).expanduser().resolve() / (
            f"{self.pack_minor}-torch=={version}")
        if not has_torch(venv, version):
            shutil.rmtree(venv, ignore_errors=True)
            make_venv(venv, python, packages)
        self.pack_env.parent.mkdir(parents=True)
        self.pack_env.symlink_to(venv, target_is_directory=True)

    def _pack_python(self) -> tuple[str, str]:
        """The newest CPython minor other than ComfyUI's this machine has
        (the pack's environment: comfy-env's are often another)."""
        found = {minor: python for minor, python in other_pythons().items()
                 if minor != self.about["minor"]}
        here = "%d.%d" % sys.version_info[:2]
        if here != self.about["minor"]:
            found[here] = sys.executable
        if not found:
            fail(f"the pack's environment needs a CPython other than "
                 f"ComfyUI's {self.about['minor']} (3.10-3.13, on PATH or "
                 f"under ~/.pyenv/versions): install one, e.g. `pyenv "
                 f"install 3.12`")
        minor = max(found, key=lambda v: tuple(map(int, v.split("."))))
        return minor, found[minor]

    def cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """``python -m comfy_standin ...`` with ComfyUI's Python."""
        return run([self.python, "-m", "comfy_standin", *argv],
                   env=self.env)


class ComfyUI:
    """One start of ComfyUI's main.py on 127.0.0.1, in its own process
    group, its output in a log file; stop() ends it as Ctrl-C does."""

    def __init__(self, setup: Setup, launcher: str, name: str,
                 options: tuple[str, ...] = ()) -> None:
        self.setup = setup
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        setup.pixi.parent.mkdir(parents=True, exist_ok=True)
        if setup.pixi.is_symlink() or setup.pixi.exists():
            setup.pixi.unlink()
        setup.pixi.symlink_to(setup.launchers[launcher])
        self.log_path = setup.base / f"comfyui-{name}.log"
        self.worker_log_path = setup.tmp / "comfy_worker_debug.log"
        if self.worker_log_path.exists():
            self.worker_log_path.unlink()
        self.workers: list[int] = []
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # A shell's background job ignores SIGINT, and its children
            # inherit that; ComfyUI is to take Ctrl-C as in a terminal.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        with open(self.log_path, "wb") as log:
            # --verbose DEBUG: ComfyUI then names each model it unloads.
            self.process = subprocess.Popen(
                [setup.python, "main.py", "--cpu", "--listen", "127.0.0.1",
                 "--port", str(self.port), "--verbose", "DEBUG",
                 *options],
                cwd=setup.tree, env=setup.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)

    def wait_up(self) -> None:
        wait_until(self._up, "GET /system_stats answer 200", self.log)

    def _up(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(
                f"ComfyUI exited with {self.process.returncode} before it "
                f"listened:\n{self.log()[-6000:]}")
        try:
            return self.get("/system_stats")[0] == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_log(self) -> str:
        try:
            return self.worker_log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        return self.request("GET", path)

    def request(self, method: str, path: str,
                body: Any = None) -> tuple[int, dict[str, str], bytes]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, dict(reply.headers), reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def status(self, path: str = "/comfy_standin/status") -> dict[str, Any]:
        code, headers, body = self.get(path)
        assert code == 200, (path, code, body[:500])
        assert headers["Content-Type"].startswith("application/json")
        return json.loads(body)

    def prompt(self, **inputs: Any) -> dict[str, Any]:
        """Queues the pack's node through ComfyUI's /prompt and returns
        what its worker said about itself once the prompt has run."""
        graph = {"1": {"class_type": "StandinE2ELoad", "inputs": {
            "model_id": "e2e-unet", "megabytes": 8, "kind": "fake",
            "register": True, "move_when": "", **inputs}}}
        code, _, body = self.request("POST", "/prompt", {
            "prompt": graph, "client_id": uuid.uuid4().hex})
        assert code == 200, body[:2000]
        prompt_id = json.loads(body)["prompt_id"]

        def done() -> Any:
            code, _, body = self.get(f"/history/{prompt_id}")
            entry = json.loads(body).get(prompt_id) if code == 200 else None
            finished = entry and (entry["status"]["completed"]
                                  or entry["status"]["status_str"] == "error")
            return entry if finished else None

        entry = wait_until(done, f"prompt {prompt_id} done", self.log)
        assert entry["status"]["status_str"] == "success", (
            json.dumps(entry["status"])[:3000])
        (ran,) = entry["outputs"]["1"]["worker"]
        if ran["pid"] not in self.workers:
            self.workers.append(ran["pid"])
        return ran

    def free(self, done: Any, what: str) -> Any:
        """``POST /free {"unload_models": true}`` (what ComfyUI's menu
        sends) until done() holds.  Sent again while it does not: ComfyUI's
        prompt worker misses the wake-up of a /free that comes while it
        collects garbage after a prompt, and then sleeps until the next
        prompt or 1000 s (a user clicks again)."""
        deadline = time.monotonic() + LIMIT
        while True:
            code, _, _ = self.request("POST", "/free",
                                      {"unload_models": True})
            assert code == 200
            try:
                return wait_until(done, what, self.log, limit=2.0)
            except AssertionError:
                if time.monotonic() > deadline:
                    raise

    def stop(self) -> None:
        """SIGINT to the process group (what Ctrl-C in ComfyUI's terminal
        sends); ComfyUI then shuts comfy-env's workers down."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
                raise AssertionError(
                    "ComfyUI did not stop on SIGINT") from None
        try:  # nothing of its process group outlives it
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        else:
            raise AssertionError("a process of ComfyUI's group outlived it")
        left = []
        for pid in self.workers:
            try:
                wait_until(lambda pid=pid: not os.path.exists(
                    f"/proc/{pid}"), f"worker {pid} gone", limit=30)
            except AssertionError:
                left.append(pid)
                os.kill(pid, signal.SIGKILL)
        assert not left, f"workers left running after ComfyUI: {left}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("comfyui"))


@pytest.fixture
def start(setup: Setup, request: pytest.FixtureRequest) -> Any:
    """start(launcher, *options) -> a running ComfyUI (options: more of
    main.py's); stopped after the test, its log (and its workers') shown
    in the report of a failed test."""
    started: list[ComfyUI] = []
    request.node.logs_on_failure = []

    def begin(launcher: str, *options: str) -> ComfyUI:
        name = f"{request.node.name}-{len(started)}"
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
        comfyui = ComfyUI(setup, launcher, name, options)
        started.append(comfyui)
        request.node.logs_on_failure += [
            (f"ComfyUI's log ({comfyui.log_path})", comfyui.log),
            ("comfy-env's worker log", lambda: comfyui.worker_log()[-20000:]),
        ]
        comfyui.wait_up()
        return comfyui

    yield begin
    for comfyui in started:
        comfyui.stop()


def our_lines(log: str) -> list[str]:
    """The lines comfy-standin logged (each begins with its name)."""
    return [line for line in log.splitlines()
            if line.startswith("comfy_standin:")]


def assert_no_traceback_through_us(*logs: str) -> None:
    frames = [m.group(0) for log in logs for m in OUR_FRAME.finditer(log)]
    assert frames == [], frames


def model_of(status: dict[str, Any], model_id: str) -> dict[str, Any] | None:
    for worker in status["pool"]["workers"]:
        for model in worker["models"]:
            if model["model_id"] == model_id:
                return model
    return None


def received(worker_log: str) -> int:
    """How many messages comfy-env's worker has read: its debug log
    numbers each read ("Waiting for request #N")."""
    return max(map(int, re.findall(r"Waiting for request #(\d+)",
                                   worker_log)), default=0)


def moves_asked(worker_log: str) -> list[str]:
    """The models the host had the worker move (model_to_device)."""
    return re.findall(r"\] model_to_device: '([^']*)' ->", worker_log)


def listed(status: dict[str, Any]) -> list[str]:
    """Model ids of the comfy_standin stand-ins in ComfyUI's
    current_loaded_models."""
    return [m["standin"]["model_id"] for m in status["comfyui"]["models"]
            if m.get("standin")]


@pytest.mark.parametrize("launcher, options", [
    ("pixi-close", ()),
    ("pixi-keep", ("--enable-compress-response-body",)),
], ids=["pixi-close", "pixi-keep-compressed"])
def test_a_users_comfyui_with_the_node_entry(setup, start, launcher,
                                             options):
    """The README's path, in ComfyUI's own server: install-node, a
    start, the pack's first prompt, the board, a move with no message,
    /free, the page, ComfyUI's frontend; nothing of ours in a
    traceback.  Through a launcher that closes inherited descriptors and
    one that passes them on (both run the worker's Python as a child),
    the second with ComfyUI gzipping JSON for clients that ask (the
    page's browser does)."""
    done = setup.cli("install-node", str(setup.tree))
    assert done.returncode == 0, done.stdout + done.stderr
    comfyui = start(launcher, *options)
    assert "comfy_standin: switched on for comfy-env" in comfyui.log()

    for path in ("/comfy_standin/status", "/api/comfy_standin/status"):
        answer = comfyui.status(path)
        assert answer["pid"] == comfyui.process.pid
        assert answer["adapter_installed"] is True

    # The pack's FIRST prompt: a model of 8 MiB comfy-env counts resident.
    moved = setup.base / f"move-{launcher}"
    ran = comfyui.prompt(model_id="e2e-unet", move_when=str(moved))
    assert ran["version"] == setup.pack_minor != setup.about["minor"]
    assert Path(ran["executable"]).parent.parent == setup.pack_env
    model = wait_until(
        lambda: (m := model_of(comfyui.status(), "e2e-unet"))
        and m["board"] and m["board"]["status"] == "valid" and m,
        "e2e-unet valid on its board", comfyui.log)
    assert model["size"] == model["loaded"] == 8 * MiB
    (board,) = [b for b in comfyui.status()["pool"]["boards"]
                if b["name"] == model["board"]["name"]]
    # The board is the worker Python's; its parent is the launcher, the
    # process comfy-env spawned.
    assert board["owner_pid"] == board["expected_owner"] == ran["pid"]
    with open(f"/proc/{ran['pid']}/stat") as f:
        launcher_pid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{launcher_pid}/cmdline", "rb") as f:
        assert str(setup.pixi).encode() in f.read()
    comfyui.workers.append(launcher_pid)

    for argv in (["--url", comfyui.url], ["--url", comfyui.url, "--json"]):
        done = setup.cli("status", *argv)
        assert done.returncode == 0, done.stdout + done.stderr
    text = setup.cli("status", "--url", comfyui.url).stdout
    assert re.search(r"e2e-unet .*slot \d+: valid", text), text
    shown = model_of(json.loads(setup.cli("status", "--url", comfyui.url,
                                          "--json").stdout), "e2e-unet")
    assert shown and shown["board"]["status"] == "valid"

    # The worker moves its model off the card after its call, telling
    # nobody: the host reads it on the board, and sent nothing.
    before = received(comfyui.worker_log())
    moved.touch()
    model = wait_until(
        lambda: (m := model_of(comfyui.status(), "e2e-unet"))
        and m["loaded"] == 0 and m,
        "the move on the board", comfyui.log)
    assert model["source"] == "board" and model["board"]["loaded"] == 0
    assert received(comfyui.worker_log()) == before

    # A torch model on the CPU: comfy-env registers a module by itself
    # only when it lands on CUDA (nothing new is listed), so the pack
    # registers it; comfy-env counts nothing of it on the card, and
    # neither does the board.
    comfyui.prompt(model_id="e2e-torch-unregistered", megabytes=1,
                   kind="torch", register=False)
    assert sorted(listed(comfyui.status())) == ["e2e-unet"]
    comfyui.prompt(model_id="e2e-torch", megabytes=1, kind="torch")
    torch_model = wait_until(
        lambda: (m := model_of(comfyui.status(), "e2e-torch"))
        and m["board"] and m["board"]["status"] == "valid" and m,
        "e2e-torch valid on its board", comfyui.log)
    assert torch_model["size"] == MiB and torch_model["loaded"] == 0
    assert torch_model["board"]["loaded"] == 0

    comfyui.prompt(model_id="e2e-unet-2")
    wait_until(lambda: (m := model_of(comfyui.status(), "e2e-unet-2"))
               and m["board"] and m["board"]["status"] == "valid"
               and m["loaded"] == 8 * MiB, "e2e-unet-2 resident",
               comfyui.log)
    assert sorted(listed(comfyui.status())) == [
        "e2e-torch", "e2e-unet", "e2e-unet-2"]

    check_the_page(setup, comfyui, ran["pid"], launcher_pid,
                   screenshot=launcher == "pixi-close")

    # ComfyUI's own frontend is still what / serves.
    web_root = re.search(r"\[Prompt Server\] web root: (.*)",
                         comfyui.log()).group(1).strip()
    code, _, body = comfyui.get("/")
    assert code == 200
    assert body == (Path(web_root) / "index.html").read_bytes()

    # /free, as ComfyUI's menu sends it: ComfyUI unloads every model.
    # Each stand-in leaves the list (evicted, none deferred); only the
    # model on the card is sent to the CPU, the two the board reads at
    # 0 bytes cost no message.
    assert moves_asked(comfyui.worker_log()) == []
    comfyui.free(lambda: not listed(comfyui.status()),
                 "every stand-in unloaded")
    after = comfyui.status()
    for model_id in ("e2e-unet", "e2e-torch", "e2e-unet-2"):
        model = model_of(after, model_id)
        assert model["loaded"] == 0 and not model["eviction_deferred"]
    assert model_of(after, "e2e-unet-2")["board"]["loaded"] == 0
    assert moves_asked(comfyui.worker_log()) == ["e2e-unet-2"]
    # ComfyUI names the class of ``patcher.model``: the stand-in itself.
    assert len(re.findall(r"Unloading StandIn\b", comfyui.log())) == 3

    comfyui.stop()
    log = comfyui.log()
    lines = our_lines(log)
    print("comfy_standin in ComfyUI's log:", *lines, sep="\n  ")
    # the node entry's one line: what comfy-env got, nothing before it
    assert lines[0] == (f"comfy_standin: switched on for comfy-env "
                        f"{setup.about['comfy_env']}: stand-ins and live "
                        f"boards"), lines
    assert sum("switched on" in line for line in lines) == 1, lines
    assert not [line for line in lines if "not switched on" in line
                or "no status route" in line or "receipts only" in line]
    assert_no_traceback_through_us(log, comfyui.worker_log())


def check_the_page(setup: Setup, comfyui: ComfyUI, worker_pid: int,
                   launcher_pid: int, screenshot: bool) -> None:
    """The live VRAM page in headless Chromium: the worker by its pack's
    name and its Python's pid (not its launcher's), each model."""
    browser = Browser(1100, 820)
    try:
        browser.goto(comfyui.url + "/comfy_standin/")
        assert browser.wait_for(
            'document.getElementById("conn").dataset.state === "up"')
        path = os.environ.get(SCREENSHOT)
        if screenshot and path:
            browser.screenshot(path)
        page = browser.evaluate(READ_PAGE)
        (shown,) = page["workers"]
        text = shown["text"]
        assert PACK in text, text
        assert "SubprocessWorker" not in text, text  # not a Python repr
        # the worker's pid is its Python's; its launcher's, if shown, is
        # said to be the launcher's
        assert re.search(rf"\bpid {worker_pid}\b", text), text
        for shown_pid in re.finditer(rf"\b{launcher_pid}\b", text):
            before = text[max(0, shown_pid.start() - 20):shown_pid.start()]
            assert "launcher" in before, text
        assert sorted(m["modelId"] for m in shown["models"]) == [
            "e2e-torch", "e2e-unet", "e2e-unet-2"], shown["models"]
    finally:
        browser.close()


def test_uninstall_node_brings_back_comfy_envs_own_stand_in(setup, start):
    """After uninstall-node and a restart, nothing of comfy-standin runs
    in ComfyUI: no line of ours in its log, no route, and the model
    ComfyUI unloads at /free is comfy-env's own stand-in's."""
    assert setup.cli("install-node", str(setup.tree)).returncode == 0
    done = setup.cli("uninstall-node", str(setup.tree))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (setup.tree / "custom_nodes" / "comfy-standin-switch"
                ).exists()
    comfyui = start("pixi-close")
    assert comfyui.get("/comfy_standin/status")[0] == 404
    assert comfyui.get("/api/comfy_standin/status")[0] == 404
    comfyui.prompt(model_id="e2e-unet")
    comfyui.free(lambda: "Unloading SubprocessModel" in comfyui.log(),
                 "ComfyUI unloading comfy-env's own model")
    comfyui.stop()
    log = comfyui.log()
    assert "Unloading StandIn" not in log
    assert "comfy_standin" not in log
    assert_no_traceback_through_us(log, comfyui.worker_log())
