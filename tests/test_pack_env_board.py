"""The live board in a comfy-env pack whose environment has another Python
and nothing of comfy_standin, started directly or through a launcher
(comfy-env 0.4.46's real worker, spawned by comfy-env's own code).

comfy-env runs each pack in an environment of its own (a pixi environment
under ``<root>/envs/<pack>/.pixi/envs/default``, started through ``pixi
run``), often of another CPython minor version than ComfyUI's.  Here such
environments are venvs of the oldest and newest other CPython this machine
has (numpy only: comfy-env's worker imports it), in comfy-env's layout, and
``pixi`` is a stand-in launcher that either closes every inherited
descriptor or passes every one on (tests/comfy_env_harness.py).

Also here: who can reach a board (the worker that made it, and the host
read-only; nobody through /proc, nobody through the handoff socket, and
no other user can keep it out by flooding that socket), the synchronous
publish before the worker asks the host for VRAM, and the board's
generation from the start.

A machine without another CPython minor version fails these tests with a
message saying which to install; it never skips them.
"""

from __future__ import annotations

import logging
import mmap
import os
import pathlib
import re
import sys

import pytest

import comfy_standin as cs
from comfy_standin._handoff import Handoff
from comfy_standin.integrations import comfy_env as adapter

from comfy_env_harness import (
    MiB,
    Host,
    fake_pixi,
    make_pack_env,
    other_pythons,
    standin_of,
    wait_for,
)
from flooder import Flooder

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="boards are memfds: Linux"),
    # comfy-env's real worker (conftest fails these when comfy-env is
    # missing; -m "not comfy_env" leaves them out).
    pytest.mark.comfy_env,
]

HERE = "%d.%d" % sys.version_info[:2]


def _chosen_pythons() -> list[str]:
    found = other_pythons()
    if not found:
        return ["missing"]
    minors = sorted(found, key=lambda v: tuple(map(int, v.split("."))))
    return sorted({minors[0], minors[-1]})


@pytest.fixture(scope="session")
def pack_envs(tmp_path_factory):
    """minor version -> a comfy-env-style pack environment of that Python
    (made once per session)."""
    found = other_pythons()
    root = tmp_path_factory.mktemp("comfy-env-root")
    return found, root, {}


def _pack_env(pack_envs, minor: str) -> pathlib.Path:
    found, root, made = pack_envs
    assert minor in found, (
        f"these tests need a CPython other than {HERE} for the pack's "
        f"environment (found none of 3.10-3.13 on PATH or under "
        f"~/.pyenv/versions): install one, e.g. `pyenv install 3.10`")
    if minor not in made:
        made[minor] = make_pack_env(root, found[minor],
                                    f"pack-{minor.replace('.', '')}")
    return made[minor]


@pytest.fixture
def launch(mm, monkeypatch, tmp_path, pack_envs):
    """launch(minor, launcher) -> a Host whose pack runs in an environment
    of CPython `minor`, started directly, or through a launcher that closes
    or keeps inherited descriptors."""
    monkeypatch.setattr(mm, "processing_interrupted", lambda: False,
                        raising=False)
    monkeypatch.setattr(adapter, "_warned", set())
    hosts: list[Host] = []

    def start(minor: str, launcher: str = "direct") -> Host:
        env = _pack_env(pack_envs, minor)
        if launcher == "direct":
            # Not under a .pixi directory: comfy-env runs its bin/python.
            direct = tmp_path / f"direct-{minor}"
            if not direct.exists():
                direct.symlink_to(env, target_is_directory=True)
            env_dir = direct
        else:
            import comfy_env.pixi

            pixi = fake_pixi(tmp_path, close_fds=launcher == "pixi-close")
            monkeypatch.setattr(comfy_env.pixi, "PIXI", str(pixi))
            env_dir = env
        host = Host(mm, tmp_path / f"pack-{len(hosts)}", env_dir)
        hosts.append(host)
        return host

    try:
        yield start
    finally:
        for host in hosts:
            host.close()


LAUNCHERS = ("direct", "pixi-close", "pixi-keep")


def _publishing(host: Host) -> dict:
    """The worker's publisher state, failing with why when it publishes
    nothing (its refusal, or the host's log lines of this test)."""
    (state,) = host.call("publisher_state")
    assert isinstance(state, dict) and "library" in state, (
        f"the worker publishes no board: {state!r}; the host logged: "
        f"{sorted(adapter._warned)!r}")
    return state


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("minor", _chosen_pythons())
def test_another_python_with_nothing_installed_publishes(launch, minor,
                                                         launcher):
    adapter.install()
    host = launch(minor, launcher)
    host.call("load", model_id="unet-p", nbytes=4 * MiB)
    worker, generation = host.current()
    (about,) = host.call("about")
    # The pack's own Python, another minor version, without comfy_standin:
    # the only thing of ours it imported is the publisher, from a private
    # directory first on its path that holds nothing else.
    assert about["version"] == [int(x) for x in minor.split(".")] \
        and minor != HERE
    assert not about["comfy_standin_found"]
    assert about["private_listing"] == ["_comfy_standin_publisher.py"]
    assert about["imported_from_private"] == ["_comfy_standin_publisher"]
    assert not about["handoff_in_environ"]
    assert not [t for t in about["fds"].values() if t and "csb-" in t]
    state = _publishing(host)
    assert state["library"] == adapter._board_library()
    assert sorted(state["hooks"]) == ["bump", "load", "reply",
                                     "request_vram_budget"]

    s = standin_of(host.mm, "unet-p")
    assert type(s) is cs.StandIn
    board, slot = s.board
    assert board.generation == generation == s.worker_generation
    assert board.owner_pid == board.expected_owner == about["pid"]
    wait_for(lambda: board.status(slot) == "valid", "the first reading")
    assert board.read(slot)[0] == 4 * MiB

    host.call("move_later", model_id="unet-p", delay=0.2)
    calls = worker._call_counter
    wait_for(lambda: s.loaded_size() == 0, "the move on the board")
    assert s.receipt()[3] == "board"
    assert worker._call_counter == calls  # no message was sent


@pytest.mark.parametrize("minor", _chosen_pythons())
def test_a_comfy_standin_installed_in_the_pack_is_not_used(launch, minor):
    """A pack environment that has some comfy_standin of its own (here one
    that would fail if anything imported it): the worker still runs the
    host's publisher, and the board is valid."""
    adapter.install()
    host = launch(minor, "pixi-close")
    site = next(pathlib.Path(host.spec[0]).glob("lib/python*/site-packages"))
    fake = site / "comfy_standin"
    fake.mkdir(exist_ok=True)
    (fake / "__init__.py").write_text(
        "raise ImportError('the pack environment's own comfy_standin "
        "was imported')\n")
    (site / "comfy_standin-0.0.1.dist-info").mkdir(exist_ok=True)
    try:
        host.call("load", model_id="m", nbytes=2 * MiB)
        (about,) = host.call("about")
        assert about["comfy_standin_found"]  # it is there ...
        assert not about["comfy_standin_imported"]  # ... and unused
        s = standin_of(host.mm, "m")
        board, slot = s.board
        wait_for(lambda: board.status(slot) == "valid", "the reading")
    finally:
        import shutil

        shutil.rmtree(fake, ignore_errors=True)
        shutil.rmtree(site / "comfy_standin-0.0.1.dist-info",
                      ignore_errors=True)


def test_a_layout_mismatch_is_one_line_and_receipts(launch, monkeypatch,
                                                    caplog):
    """The host reads another layout than the worker's library writes (as
    after an upgrade under a running ComfyUI): the worker refuses, one log
    line, receipts; nothing raises into the worker or the host."""
    minor = _chosen_pythons()[0]
    monkeypatch.setattr(adapter, "_board_layout", lambda library: 99)
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        adapter.install()
        host = launch(minor)
        host.call("load", model_id="a", nbytes=MiB)
        host.call("load", model_id="b", nbytes=MiB)
    lines = [r.getMessage() for r in caplog.records
             if "receipts only" in r.getMessage()]
    assert len(lines) == 1 and "layout" in lines[0], lines
    worker, _ = host.current()
    assert worker.is_alive()
    s = standin_of(host.mm, "a")
    assert s.board is None
    host.call("touch")
    assert s.receipt()[3] == "census" and s.loaded_size() == MiB


def test_no_place_for_the_handoff_socket_is_one_line_and_receipts(
        launch, monkeypatch, tmp_path, caplog):
    """Every place for the handoff's private directory is too deep for a
    socket path (sun_path): no handoff is made, one log line says why for
    each place, the worker is never told of a handoff and runs on
    receipts; nothing raises into comfy-env or the worker."""
    from comfy_standin import _handoff

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(_handoff, "_parents", lambda: [str(deep)])
    minor = _chosen_pythons()[0]
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        adapter.install()
        host = launch(minor)
        host.call("load", model_id="a", nbytes=MiB)
        host.call("load", model_id="b", nbytes=MiB)
    lines = [r.getMessage() for r in caplog.records
             if "receipts only" in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(
        re.escape("comfy_standin: cannot make a board handoff socket (no "
                  f"private directory for the handoff socket ({deep}: a "
                  "socket path there has ") + r"\d+"
        + re.escape(" bytes, more than 107)): stand-ins use receipts only"),
        lines[0]), lines
    assert os.listdir(deep) == []
    (about,) = host.call("about")
    assert not about["handoff_in_environ"]
    s = standin_of(host.mm, "a")
    assert s.board is None
    assert s.receipt()[3] == "census" and s.loaded_size() == MiB


def test_no_process_but_the_worker_can_write_its_board(launch):
    """Two workers, each with its board.  Worker A, knowing everything in
    B's environment and the host's pid, tries every way in: B's and the
    host's descriptors and mappings through /proc (even writable opens of
    /proc/<pid>/map_files, which root may make), and B's handoff socket
    with B's token.  Nothing works, and B's board still reads B's bytes."""
    minor = _chosen_pythons()[0]
    adapter.install()
    a = launch(minor)
    b = launch(minor)
    a.call("load", model_id="a", nbytes=MiB)
    b.call("load", model_id="b", nbytes=3 * MiB)
    (about_b,) = b.call("about")
    sb = standin_of(b.mm, "b")
    board_b, slot_b = sb.board
    wait_for(lambda: board_b.status(slot_b) == "valid", "B's reading")
    # The host holds no descriptor of any board: only read-only mappings.
    host_fds = [os.readlink(f"/proc/self/fd/{fd}")
                for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [t for t in host_fds if "csb-" in t], host_fds
    with open("/proc/self/maps") as f:
        mine = [line.split() for line in f if "csb-" in line]
    assert mine and all("w" not in fields[1] for fields in mine), mine
    (won,) = a.call("attack", victim_pid=about_b["pid"],
                    host_pid=os.getpid())
    assert won == [], won
    assert board_b.status(slot_b) == "valid"
    assert board_b.read(slot_b)[0] == 3 * MiB


@pytest.mark.other_uid
def test_another_user_flooding_the_handoff_cannot_keep_the_board_out(
        launch, monkeypatch):
    """A process of another uid (nobody) floods every handoff socket it
    finds in /proc/net/unix, connecting as often as it can, from before
    comfy-env spawns the worker (each handoff made waits until the flooder
    has flooded it) until the board is taken.  comfy-env's real worker,
    started through a launcher that closes inherited descriptors, still
    hands its board over, and the flooder never got a connection."""
    minor = _chosen_pythons()[0]
    flooded: list[dict] = []
    with Flooder() as flooder:

        class FloodedFirst(Handoff):
            def __init__(self) -> None:
                super().__init__()
                flooded.append(flooder.flooded(self.path))

        monkeypatch.setattr(adapter, "Handoff", FloodedFirst)
        adapter.install()
        host = launch(minor, "pixi-close")
        host.call("load", model_id="f", nbytes=2 * MiB)
        s = standin_of(host.mm, "f")
        assert s.board is not None, "the worker's board was kept out"
        board, slot = s.board
        wait_for(lambda: board.status(slot) == "valid", "the reading")
        assert board.read(slot)[0] == 2 * MiB
        summary = flooder.stop()
    assert len(flooded) == 1, flooded
    path = flooded[0]["address"]
    assert flooded[0] == {"address": path, "connected": 0,
                          "error": "EACCES"}
    # EACCES, or ENOENT once the host had removed the path.
    assert summary[path]["connected"] == 0
    assert set(summary[path]["errors"]) <= {"EACCES", "ENOENT"}, summary


def test_the_attack_finds_a_board_that_is_not_write_sealed(launch):
    """The control for the test above: the same attack against a memfd
    that is not write-sealed, which the host holds and maps as it would a
    board it had made itself, gets in: the attack can see a way in."""
    minor = _chosen_pythons()[0]
    adapter.install()
    a = launch(minor)
    a.call("load", model_id="a", nbytes=MiB)
    size = cs._core.BOARD_HEADER_SIZE + 4 * cs._core.BOARD_SLOT_SIZE
    fd = os.memfd_create("csb-control", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        exposed = mmap.mmap(fd, size)
        try:
            (won,) = a.call("attack", victim_pid=os.getpid(),
                            host_pid=os.getpid())
            written = exposed[64:72]
        finally:
            exposed.close()
    finally:
        os.close(fd)
    assert any(w.startswith("descriptor") for w in won), won
    assert any(w.startswith("wrote") for w in won), won
    assert written == b"\xff" * 8


@pytest.mark.parametrize("minor", _chosen_pythons())
def test_back_to_back_loads_read_right_at_the_vram_request(launch,
                                                           monkeypatch,
                                                           minor):
    """In one node call the pack reloads its model (no message: comfy-env
    bumps nothing for a reload) and then loads another through ComfyUI's
    load_models_gpu, which comfy-env's worker shims to ask the host for
    VRAM; the host runs ComfyUI's free_memory inside that call.  With the
    sampler asleep (60 s), only the publisher's synchronous pass before
    the request can make the host see the reload: it must."""
    from comfy_env.isolation import pool as ce_pool

    monkeypatch.setattr(adapter, "SAMPLE_PERIOD", 60.0)
    seen: list[tuple[int, str]] = []
    original = ce_pool._handle_vram_budget

    def recording(request, worker_key=None):
        s = standin_of(host.mm, "unet-r")
        seen.append((s.loaded_size(), s.receipt()[3]))
        return original(request, worker_key=worker_key)

    monkeypatch.setattr(ce_pool, "_handle_vram_budget", recording)
    adapter.install()
    host = launch(minor)
    host.call("load", model_id="unet-r", nbytes=8 * MiB)
    host.call("offload", model_id="unet-r")
    s = standin_of(host.mm, "unet-r")
    assert s.loaded_size() == 0  # the census at the call's end said so
    host.call("reload_and_request", model_id="unet-r", other_size=MiB)
    assert seen == [(8 * MiB, "board")], seen
    state = _publishing(host)
    assert state["synced"].get("request_vram_budget") == 1
    assert state["synced"].get("load") == 1


def test_generation_from_the_start_and_a_new_board_per_process(launch):
    """The board carries comfy-env's generation from the spawn on (its
    pool record does not exist yet then), and a worker restarted by
    comfy-env gets a new board with the new generation."""
    minor = _chosen_pythons()[0]
    adapter.install()
    host = launch(minor)
    host.call("load", model_id="g", nbytes=MiB)
    worker, generation = host.current()
    s = standin_of(host.mm, "g")
    board, _ = s.board
    assert board.generation == generation == s.worker_generation > 0
    os.kill(worker._process.pid, 9)
    worker._process.wait(timeout=60)
    cs.default_pool().boundary(host.mm)
    host.call("load", model_id="g", nbytes=MiB)
    worker2, generation2 = host.current()
    s2 = standin_of(host.mm, "g")
    board2, slot2 = s2.board
    assert generation2 > generation
    assert board2 is not board and board2.generation == generation2
    wait_for(lambda: board2.status(slot2) == "valid", "the new reading")
