"""comfy-env's real worker, driven by comfy-env's own per-node call
path, for the board tests (tests/test_comfy_env_board.py,
tests/test_pack_env_board.py).

- :data:`PACK`: a throwaway pack whose "models" claim a CUDA device
  (duck-typed parameters), so comfy-env's census counts them resident with
  no GPU and no torch; its nodes move them with no message, probe the
  worker, and play a hostile neighbour.
- :func:`other_pythons`: CPythons of other minor versions than this one's
  (pyenv's, or on PATH), for pack environments like comfy-env's.
- :func:`make_pack_env`: a pack environment of such a Python with nothing
  of comfy_standin in it (numpy, which comfy-env's worker imports, and
  whatever else is asked), laid out as comfy-env lays out its pixi
  environments.
- :func:`fake_pixi`: a launcher standing where ``pixi run`` stands: it
  starts the environment's Python as a child (pixi does not exec), either
  closing every inherited descriptor or passing every one on.
- :class:`Host`: calls a node through ``metadata._call_in_worker`` and
  checks afterwards that no worker, board descriptor, mapping or handoff
  socket is left.
"""

from __future__ import annotations

import gc
import glob
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
import types
from typing import Any

import comfy_standin as cs
from comfy_standin.integrations import comfy_env as adapter

MiB = 1 << 20
MOCK_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         "mockcomfy")

PACK = textwrap.dedent('''
    import importlib.util
    import mmap
    import os
    import socket
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


    def _publisher():
        return sys.modules.get("_comfy_standin_publisher")


    class Node:
        def load(self, model_id, nbytes):
            import comfy_worker

            module = FakeModule(nbytes)
            _KEEP[model_id] = module
            comfy_worker.register_model(model_id, module, kind="unet")
            return (model_id,)

        def touch(self):
            return ("ok",)

        def reload(self, model_id):
            """The pack moves its model back onto the card itself: no
            message, no registration (comfy-env dedups on the module)."""
            _KEEP[model_id].to("cuda")
            return ("reloaded",)

        def move_quietly(self, model_id, gate, done):
            """Reply now; once the file `gate` exists a thread of the
            pack's moves the model to the CPU (no message, no seq bump),
            then writes the file `done`."""
            module = _KEEP[model_id]

            def later():
                deadline = time.monotonic() + 30
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
                module.to("cpu")
                open(done, "w").close()

            threading.Thread(target=later, daemon=True).start()
            return ("moving",)

        def where(self, model_id):
            return (_KEEP[model_id]._params[0].device.type,)

        def hold(self, started, gate, limit):
            """A long call: says it started (a file), then waits for the
            gate file, at most `limit` seconds."""
            open(started, "w").close()
            deadline = time.monotonic() + limit
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
            return ("held",)

        def scratch(self, nbytes, pinned, reported=True):
            """VRAM no registered model accounts for: a model the pack
            loads through the worker's own ComfyUI (a plain module with no
            parameters: comfy-env's hooks never see it) and `pinned` bytes
            nothing can free; with `reported`, comfy-aimdo's usage figure,
            which the worker reports as `held`, counts them with its
            models (without, only the driver sees them)."""
            import comfy.model_management as mm

            card = mm.sim.card(mm.CUDA0)
            model = mm.HostModel("scratch", nbytes)
            entry = mm.LoadedModel(model)
            entry.model_load(0)
            mm.current_loaded_models.insert(0, entry)
            _KEEP["scratch"] = model
            card.allocate("pinned-scratch", pinned)
            if not reported:
                return (card.used(),)
            control = types.ModuleType("comfy_aimdo.control")
            control.get_total_vram_usage = lambda: card.used() + sum(
                m._params[0].nbytes for m in _KEEP.values()
                if isinstance(m, FakeModule)
                and m._params[0].device.type == "cuda")
            sys.modules["comfy_aimdo"] = types.ModuleType("comfy_aimdo")
            sys.modules["comfy_aimdo.control"] = control
            return (card.used(),)

        def scratch_left(self):
            return (_KEEP["scratch"].loaded_size(),)

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

        def offload(self, model_id):
            """The pack moves its model off the card itself: no message."""
            _KEEP[model_id].to("cpu")
            return ("offloaded",)

        def reload_and_request(self, model_id, other_size):
            """In one call: the pack reloads its model (no message: a
            reload of a registered model bumps nothing), then loads another
            through ComfyUI's load_models_gpu, which comfy-env's worker
            shims to ask the host for VRAM first."""
            import comfy.model_management as mm

            _KEEP[model_id].to("cuda")
            probe = mm.HostModel("request-probe", other_size)
            mm.load_models_gpu([probe])
            return ("loaded",)

        def publisher(self):
            pub = _publisher()
            if pub is None:
                return (False, False, None)
            state = pub.state()
            hooked = getattr(_bump_seq(), "__wrapped__", None) is not None
            return (state["running"], hooked, state.get("failed"))

        def publisher_state(self):
            pub = _publisher()
            return (pub.state() if pub is not None else None,)

        def about(self):
            """What this worker process is and what it imported."""
            private = sys.path[0]
            ours = sorted(
                name for name, m in list(sys.modules.items())
                if (getattr(m, "__file__", None) or "").startswith(
                    private + os.sep))
            listing = sorted(n for n in os.listdir(private)
                             if n != "__pycache__")
            return ({
                "version": list(sys.version_info[:2]),
                "executable": sys.executable,
                "prefix": sys.prefix,
                "comfy_standin_found":
                    importlib.util.find_spec("comfy_standin") is not None,
                "comfy_standin_imported": "comfy_standin" in sys.modules,
                "private": private,
                "private_listing": listing,
                "imported_from_private": ours,
                "handoff_in_environ": "COMFY_STANDIN_BOARD" in os.environ,
                "pid": os.getpid(),
                "fds": {fd: _target(fd) for fd in os.listdir("/proc/self/fd")},
            },)

        def attack(self, victim_pid, host_pid):
            """Everything a hostile worker (or any process of the user)
            could try against another worker's board: its descriptors and
            mappings through /proc, the host's descriptors, and the
            victim's handoff socket with the token read from the victim's
            environment.  Returns what worked."""
            won = []
            for pid in (victim_pid, host_pid):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    target = _target(fd, pid)
                    if target and "csb-" in target:
                        won.append(f"descriptor {pid}/{fd}: {target}")
                try:
                    maps = open(f"/proc/{pid}/maps").read().splitlines()
                except OSError:
                    maps = []
                for line in maps:
                    if "csb-" not in line:
                        continue
                    span = line.split()[0]
                    start, end = (int(x, 16) for x in span.split("-"))
                    try:
                        fd = os.open(f"/proc/{pid}/map_files/{span}",
                                     os.O_RDWR)
                    except OSError:
                        continue
                    try:
                        length = min(end - start, os.fstat(fd).st_size)
                        m = mmap.mmap(fd, length, mmap.MAP_SHARED,
                                      mmap.PROT_READ | mmap.PROT_WRITE)
                        m[64:72] = b"\\xff" * 8
                        m.close()
                        won.append(f"wrote {pid}'s mapping {span}")
                    except OSError:
                        pass
                    try:
                        os.pwrite(fd, b"\\xff" * 8, 64)
                        won.append(f"pwrite into {pid}'s board {span}")
                    except OSError:
                        pass
                    finally:
                        os.close(fd)
            environ = open(f"/proc/{victim_pid}/environ", "rb").read()
            for item in environ.split(b"\\0"):
                if item.startswith(b"COMFY_STANDIN_BOARD="):
                    spec = item.split(b"=", 1)[1]
                    path, _, token = spec.partition(b":")[2].rpartition(
                        b":")
                    sock = socket.socket(socket.AF_UNIX,
                                         socket.SOCK_SEQPACKET)
                    try:
                        sock.settimeout(2)
                        sock.connect(path)
                        sock.send(token)
                        won.append("connected to the victim's handoff")
                    except OSError:
                        pass
                    finally:
                        sock.close()
            return (won,)


    def _target(fd, pid="self"):
        try:
            return os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            return None
''')


def version_of(python: str) -> str | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys, venv; "
             "print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def other_pythons() -> dict[str, str]:
    """minor version -> interpreter, for each supported CPython minor other
    than this one's that this machine has (on PATH or under pyenv)."""
    here = "%d.%d" % sys.version_info[:2]
    found: dict[str, str] = {}
    for minor in ("3.10", "3.11", "3.12", "3.13"):
        if minor == here:
            continue
        candidates = [shutil.which(f"python{minor}")] + sorted(glob.glob(
            os.path.expanduser(f"~/.pyenv/versions/{minor}.*/bin/python")))
        for candidate in candidates:
            if candidate and version_of(candidate) == minor:
                found[minor] = candidate
                break
    return found


def make_pack_env(root: pathlib.Path, python: str, pack: str,
                  packages: tuple[str, ...] = ("numpy",)) -> pathlib.Path:
    """comfy-env's layout: <root>/envs/<pack>/.pixi/envs/default, a venv of
    `python` with `packages` (numpy at least: comfy-env's worker imports
    it) and nothing of comfy_standin.  Returns the environment's
    directory."""
    env = make_venv(root / "envs" / pack / ".pixi" / "envs" / "default",
                    python, packages)
    (root / "envs" / pack / "pixi.toml").write_text("# comfy-env's manifest "
                                                    "(read by no one here)\n")
    return env


def make_venv(env: pathlib.Path, python: str,
              packages: tuple[str, ...]) -> pathlib.Path:
    """A venv of `python` at `env` with `packages` installed by pip."""
    subprocess.run([python, "-m", "venv", str(env)], check=True,
                   timeout=300)
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install",
                    "-q", "--disable-pip-version-check", *packages],
                   check=True, timeout=900)
    return env


def fake_pixi(directory: pathlib.Path, close_fds: bool) -> pathlib.Path:
    """A stand-in for ``pixi run --as-is --manifest-path M -e ENV python
    SCRIPT``: runs the environment's Python as a child, closing every
    inherited descriptor but 0-2 (`close_fds`) or passing every one on."""
    path = directory / ("pixi-close" if close_fds else "pixi-keep")
    path.write_text(textwrap.dedent(f'''\
        #!{sys.executable}
        import os, subprocess, sys
        from pathlib import Path

        args = sys.argv[1:]
        manifest = Path(args[args.index("--manifest-path") + 1])
        env = args[args.index("-e") + 1]
        rest = args[args.index("-e") + 2:]
        assert rest[0] == "python", rest
        python = manifest.parent / ".pixi" / "envs" / env / "bin" / "python"
        close = {close_fds!r}
        if not close:  # hand on everything this launcher was given
            for fd in os.listdir("/proc/self/fd"):
                try:
                    os.set_inheritable(int(fd), True)
                except OSError:
                    pass
        proc = subprocess.Popen([str(python), *rest[1:]], close_fds=close)
        sys.exit(proc.wait())
        '''))
    path.chmod(0o755)
    return path


def same_python_env(root: pathlib.Path) -> pathlib.Path:
    """Another environment of this very Python that sees this one's
    packages (a .pth file): a second pack's worker without an install."""
    env = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip",
                    str(env)], check=True, timeout=300)
    here = [p for p in sys.path if p.endswith("site-packages")]
    site = env / "lib" / ("python%d.%d" % sys.version_info[:2]) \
        / "site-packages"
    (site / "here.pth").write_text("\n".join(here) + "\n")
    return env


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def fd_target(fd: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def board_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "csb-" in line]


def wait_for(predicate: Any, what: str, limit: float = 30.0) -> None:
    """Poll (no message is sent) until predicate() holds; the limit only
    bounds a broken run, it is not a speed claim."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.01)


def standin_of(mm: Any, model_id: str) -> Any:
    for entry in mm.current_loaded_models:
        s = entry.model
        if s is not None and getattr(s, "model_id", None) == model_id:
            return s
    return None


class Host:
    """ComfyUI's side: comfy-env's node call path into one pack whose
    environment is `env_dir`; with `boards`, a comfy-env the adapter
    wires live boards into."""

    def __init__(self, mm: Any, pack_dir: pathlib.Path,
                 env_dir: pathlib.Path, boards: bool = True) -> None:
        version = importlib.metadata.version("comfy-env")
        tier = adapter.TESTED_COMFY_ENV.get(version)
        wanted = ("full",) if boards else ("full", "receipts")
        assert tier in wanted, (
            f"the board tests drive the internals of the comfy-env "
            f"releases the adapter's TESTED_COMFY_ENV gives {wanted[0]!r}; "
            f"this environment has {version} ({tier or 'not tested'})")
        from comfy_env.isolation import metadata
        from comfy_env.isolation import pool as ce_pool

        self.mm = mm
        self._metadata = metadata
        self._pool = ce_pool
        pack_dir.mkdir(parents=True, exist_ok=True)
        (pack_dir / "boardpack.py").write_text(PACK)
        self.spec = (env_dir, pack_dir, [str(pack_dir), MOCK_ROOT], {},
                     120.0)
        self.workers: list[int] = []
        self._fds, self._maps = fds(), board_maps()

    def call(self, method: str, **kwargs: Any) -> Any:
        return self._metadata._call_in_worker(
            worker_spec=self.spec, module_name="boardpack",
            class_name="Node", method_name=method, self_state=None,
            kwargs=kwargs, node_name=f"Node.{method}",
        )

    def current(self) -> tuple[Any, int]:
        worker, gen = self._pool._WORKER_POOL[str(self.spec[0])]
        if worker._process.pid not in self.workers:
            self.workers.append(worker._process.pid)
        return worker, gen

    def close(self) -> None:
        """Shut every worker down and check nothing of any board is left:
        no worker process, no descriptor (board or socket), no mapping."""
        self._pool._shutdown_all_workers()
        adapter.uninstall()
        cs.default_pool().boundary(self.mm)
        gc.collect()
        for pid in self.workers:
            assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} left"
        left = {fd: fd_target(fd) for fd in fds() - self._fds}
        left = {fd: t for fd, t in left.items() if t is not None}
        assert not any("csb-" in t or "socket" in t
                       for t in left.values()), left
        assert board_maps() == self._maps, "a board mapping was left"


def host_namespace(host: Host) -> types.SimpleNamespace:
    return types.SimpleNamespace(mm=host.mm, call=host.call,
                                 current=host.current, workers=host.workers)
