"""Which comfy-env gets what, against the comfy-env installed here.

The adapter checks every name of comfy-env it touches (``HOOKS``) and
lists the releases it was tested with (``TESTED_COMFY_ENV``: "full" or
"receipts"; any other release is refused).  CI runs this module once per
release, each in a virtual environment of its own (.ci/compat-matrix:
every release of the table, and 0.4.38, the newest one refused); the
suite runs it against its own comfy-env.  For the release installed:

- install() does what the table says, in one log line: stand-ins and
  live boards, stand-ins on receipts only, or nothing at all (comfy-env
  untouched), and the node entry ComfyUI loads says no more;
- told nothing of the release, the checks alone come to the table's
  verdict: the table records what they find;
- each check can fail: a name removed or reshaped in comfy-env refuses
  the install (a name of the stand-in swap) or turns boards off (of the
  board's), and says which in the line;
- a failure half way through install() puts back what it had swapped;
- where the adapter installs, every test of tests/test_comfy_env_e2e.py
  that drives comfy-env's real worker without torch (imported here, so
  it runs against this release); where it wires boards, those of
  tests/test_comfy_env_board.py that need nothing but a worker; where it
  does not, a real worker on receipts with nothing of the board in it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import pathlib
import re
import sys

import fakes
import pytest
import test_comfy_env_board
import test_comfy_env_e2e

import comfy_standin as cs
from comfy_standin import _node
from comfy_standin import __main__ as cli
from comfy_standin.integrations import _shapes
from comfy_standin.integrations import comfy_env as adapter

from comfy_env_harness import MiB, Host, host_namespace, standin_of

# Every test here needs comfy-env (conftest fails them when it is
# missing; -m "not comfy_env" leaves them out).
pytestmark = pytest.mark.comfy_env


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("comfy-env")
    except importlib.metadata.PackageNotFoundError:
        return None  # every test here fails saying so (conftest)


VERSION = _installed_version()
#: What the table gives the installed release: "full", "receipts" or
#: "refused" (a release it does not list).  Without comfy-env, the tests
#: of the newest release are collected (each fails saying comfy-env is
#: missing, or -m "not comfy_env" leaves them out): the collection, and
#: so tools/counts.py, is the same with or without comfy-env.
TIER = "full" if VERSION is None else adapter.TESTED_COMFY_ENV.get(
    VERSION, "refused")
#: What install() swaps in this release, in order.
SWAPS = [h for h in adapter.HOOKS
         if h.wrap is not None and (TIER == "full" or not h.board)]
_MISSING = object()


def snapshot() -> dict[tuple[str, str], object]:
    """Every name of ``HOOKS`` as comfy-env has it now."""
    names = {}
    for hook in adapter.HOOKS:
        try:
            owner = _shapes.resolve(hook.target)
        except (ImportError, AttributeError):
            continue
        names[(hook.target, hook.name)] = getattr(owner, hook.name, _MISSING)
    return names


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


def lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "comfy_standin"]


def the_line(caplog) -> logging.LogRecord:
    said = lines(caplog)
    assert len(said) == 1, [r.getMessage() for r in said]
    return said[0]


def said(line: str, hook: _shapes.Hook, reason: str) -> bool:
    """Whether `line` gives `reason` for `hook` ("a, b: reason")."""
    name = re.escape(_shapes.where(hook))
    return re.search(rf"(^|[(; ]){name}(, [\w.]+)*: {re.escape(reason)}",
                     line) is not None


def failing(board: bool) -> list[str]:
    """The checks of this comfy-env that fail, of the board's or not."""
    return [_shapes.where(h) for h in adapter.HOOKS
            if h.board == board and _shapes.mismatch(h) is not None]


@pytest.fixture
def fresh(mm, monkeypatch, caplog):
    """comfy-env as installed, the adapter not in it, every log line of
    the test captured; what HOOKS names before the test."""
    importlib.import_module("comfy_env.isolation.model_patcher")
    monkeypatch.delenv("COMFY_STANDIN_NO_BOARD", raising=False)
    monkeypatch.setattr(adapter, "_warned", set())
    assert not adapter.installed()
    caplog.set_level(logging.DEBUG, logger="comfy_standin")
    before = snapshot()
    pressure = cs.default_pool().on_pressure
    try:
        yield before
    finally:
        adapter.uninstall()
        assert cs.default_pool().on_pressure is pressure


def test_install_does_what_the_table_says(fresh, caplog):
    result = adapter.install()
    record = the_line(caplog)
    line = record.getMessage()
    after = snapshot()
    if TIER == "refused":
        assert result is False and not adapter.installed()
        assert same(after, fresh), "a refusal changed comfy-env"
        assert record.levelno == logging.WARNING
        assert line.startswith(
            f"comfy_standin: not switched on: comfy-env {VERSION} ")
        assert line.endswith("; comfy-env keeps its own stand-ins")
        shape = failing(board=False)
        if shape:
            assert "is not the shape comfy_standin checked" in line
            assert all(name in line for name in shape), (shape, line)
        else:
            assert "is not a version comfy_standin was tested with" in line
        return
    assert result is True and adapter.installed()
    changed = {k for k in fresh if after[k] is not fresh[k]}
    assert changed == {(h.target, h.name) for h in SWAPS}
    for hook in SWAPS:
        new, old = after[(hook.target, hook.name)], fresh[(hook.target,
                                                         hook.name)]
        assert new is cs.StandIn or new.__wrapped__ is old
    if TIER == "full":
        assert record.levelno == logging.INFO
        assert line == (f"comfy_standin: switched on for comfy-env "
                        f"{VERSION}: stand-ins and live boards")
        assert failing(board=True) == []
    else:
        assert record.levelno == logging.WARNING
        assert line.startswith(
            f"comfy_standin: switched on for comfy-env {VERSION}: stand-ins "
            f"use receipts only, no live boards (")
        board = failing(board=True)
        assert board and all(name in line for name in board), (board, line)
    adapter.uninstall()
    assert same(snapshot(), fresh), "uninstall() left something swapped"


def test_the_checks_alone_come_to_the_tables_verdict(fresh, monkeypatch):
    """Told this release gets everything, the checks of HOOKS still give
    what the table says: the table adds nothing to what they find."""
    monkeypatch.setitem(adapter.TESTED_COMFY_ENV, VERSION, "full")
    found = adapter._plan(VERSION).verdict
    expected = {"full": "full", "receipts": "receipts",
                "refused": "shape"}[TIER]
    assert found == expected, (
        f"comfy-env {VERSION}: the checks find {found!r}, the table says "
        f"{TIER!r}; run this module against it and put what it finds "
        f"in TESTED_COMFY_ENV")


def test_the_node_entry_says_one_line(fresh, tmp_path, caplog, monkeypatch):
    """What ComfyUI's log gets from the node entry that install-node
    writes: install()'s one line about comfy-env, nothing more."""
    root = tmp_path / "ComfyUI"
    (root / "custom_nodes").mkdir(parents=True)
    (root / "main.py").write_text("# ComfyUI\n")
    assert cli.main(["install-node", str(root)]) == 0
    folder = root / "custom_nodes" / _node.NODE_DIR
    spec = importlib.util.spec_from_file_location(
        folder.name, folder / "__init__.py",
        submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, folder.name, module)
    caplog.clear()
    spec.loader.exec_module(module)
    switched = [r.getMessage() for r in lines(caplog)
                if "switched on" in r.getMessage()]
    assert len(switched) == 1, switched
    assert adapter.installed() is (TIER != "refused")


def test_a_name_set_after_construction_is_one_instances_have(monkeypatch):
    """comfy-env 0.4.40 to 0.4.42 set ``_last_vram_report`` on a worker's
    first frame, not in ``__init__``: the adapter reads it with a default,
    so the check takes a name any function of the class assigns."""

    class Worker:
        def __init__(self):
            self.name = "w"

        def _on_frame(self, report):
            self._last_vram_report = report

    module = type(sys)("standin_shapes_probe")
    module.Worker = Worker
    monkeypatch.setitem(sys.modules, module.__name__, module)
    hook = _shapes.Hook(module.__name__, "Worker", "class",
                        reads=("name", "_last_vram_report"))
    assert _shapes.mismatch(hook) is None
    assert _shapes.mismatch(hook._replace(reads=("sys_path",))) == (
        "instances have no sys_path")


if TIER != "refused":
    # ---- the checks, each made to fail (where the adapter installs) ----

    #: Classes whose attributes are checked too: removing one fails
    #: those checks as well.
    OWNERS = {h for h in adapter.HOOKS
              if any(o.target == f"{h.target}:{h.name}"
                     for o in adapter.HOOKS)}

    @pytest.mark.parametrize(
        "hook", [h for h in adapter.HOOKS if h not in OWNERS],
        ids=_shapes.where)
    def test_a_name_gone_from_comfy_env(fresh, monkeypatch, caplog, hook):
        """One name removed: of the stand-in swap, the install refuses
        with comfy-env as it was; of the board's, stand-ins use
        receipts.  The line names it either way."""
        monkeypatch.delattr(_shapes.resolve(hook.target), hook.name,
                            raising=False)
        before = snapshot()
        result = adapter.install()
        line = the_line(caplog).getMessage()
        # (a method its base declares abstract is left behind)
        assert said(line, hook, "is missing") \
            or said(line, hook, "is abstract"), line
        if hook.board:
            assert result is True
            assert "stand-ins use receipts only, no live boards" in line
            assert not any(h.board for h in adapter.HOOKS
                           if (h.target, h.name) in adapter._originals)
        else:
            assert result is False and not adapter.installed()
            assert "is not the shape comfy_standin checked" in line
            assert same(snapshot(), before)

    @pytest.mark.parametrize("hook", sorted(OWNERS, key=_shapes.where),
                             ids=_shapes.where)
    def test_a_class_gone_from_comfy_env_refuses(fresh, monkeypatch, caplog,
                                                 hook):
        monkeypatch.delattr(_shapes.resolve(hook.target), hook.name)
        before = snapshot()
        assert adapter.install() is False
        line = the_line(caplog).getMessage()
        assert f"has no {hook.name}" in line, line
        assert same(snapshot(), before)

    def test_a_changed_signature_refuses(fresh, monkeypatch, caplog):
        state_sync = importlib.import_module("comfy_env.state_sync")

        def apply_echo(p, resident, seq=None):
            return None

        monkeypatch.setattr(state_sync, "apply_echo", apply_echo)
        before = snapshot()
        assert adapter.install() is False
        line = the_line(caplog).getMessage()
        assert ("state_sync.apply_echo: is (p, resident, seq=None), not "
                "(p, resident, seq=None, unmapped=False, in_flight=False)"
                ) in line, line
        assert same(snapshot(), before)

    def test_a_patcher_with_an_attribute_never_checked_refuses(
            fresh, monkeypatch, caplog):
        """comfy-env may read whatever its own patcher has off the
        stand-in that replaces it: one attribute more is refused."""
        patchers = importlib.import_module(
            "comfy_env.isolation.model_patcher")
        base = patchers.SubprocessModelPatcher

        class Patcher(base):
            def __init__(self, worker, worker_generation, model_id,
                         model_size, load_device, offload_device,
                         kind="other"):
                super().__init__(worker, worker_generation, model_id,
                                 model_size, load_device, offload_device,
                                 kind)
                self._last_touch = None

        monkeypatch.setattr(patchers, "SubprocessModelPatcher", Patcher)
        before = snapshot()
        assert adapter.install() is False
        line = the_line(caplog).getMessage()
        assert ("model_patcher.SubprocessModelPatcher: has _last_touch, "
                "which was never checked") in line, line
        assert same(snapshot(), before)

    def test_what_the_board_reads_gone_turns_boards_off(fresh, monkeypatch,
                                                        caplog):
        """A worker whose __init__ sets no sys_path, a spawn path without
        the local the generation is read from, a worker table that is not
        a dict: stand-ins on receipts, each reason in the one line."""
        spawn = importlib.import_module(
            "comfy_env.isolation.workers.subprocess")
        pool = importlib.import_module("comfy_env.isolation.pool")

        def __init__(self, python, working_dir=None, sys_path=None,
                     env=None, name=None, health_check_timeout=0.0):
            self.name, self._process, self._lock = name, None, None
            self._last_vram_report, self._calls_in_flight = None, 0

        def _get_or_create_worker(env_dir, working_dir, sys_path,
                                  env_vars=None, health_check_timeout=0.0):
            return None

        monkeypatch.setattr(spawn.SubprocessWorker, "__init__", __init__)
        monkeypatch.setattr(pool, "_get_or_create_worker",
                            _get_or_create_worker)
        monkeypatch.setattr(pool, "_WORKER_POOL", [])
        assert adapter.install() is True
        record = the_line(caplog)
        line = record.getMessage()
        assert record.levelno == logging.WARNING
        assert "stand-ins use receipts only, no live boards" in line
        for reason in ("subprocess.SubprocessWorker: instances have no "
                       "sys_path",
                       "pool._get_or_create_worker: has no local gen",
                       "pool._WORKER_POOL: is a list, not a dict"):
            assert reason in line, (reason, line)
        assert not any(h.board for h in adapter.HOOKS
                       if (h.target, h.name) in adapter._originals)

    def test_a_release_not_in_the_table_is_refused(fresh, monkeypatch,
                                                   caplog):
        monkeypatch.setattr(adapter, "_comfy_env_version", lambda: "0.4.99")
        assert adapter.install() is False
        assert same(snapshot(), fresh)
        tested = ", ".join(adapter.TESTED_COMFY_ENV)
        assert the_line(caplog).getMessage() == (
            f"comfy_standin: not switched on: comfy-env 0.4.99 is not a "
            f"version comfy_standin was tested with ({tested}); comfy-env "
            f"keeps its own stand-ins")

    @pytest.mark.parametrize("hook", SWAPS, ids=_shapes.where)
    def test_a_failure_half_way_puts_back_what_was_swapped(
            fresh, monkeypatch, caplog, hook):
        def broken(original):
            raise RuntimeError("cannot wrap this")

        monkeypatch.setattr(adapter, "HOOKS", tuple(
            h._replace(wrap=broken) if h is hook else h
            for h in adapter.HOOKS))
        assert adapter.install() is False and not adapter.installed()
        assert same(snapshot(), fresh)
        assert the_line(caplog).getMessage() == (
            f"comfy_standin: not switched on: putting "
            f"{_shapes.where(hook)} into comfy-env {VERSION} failed "
            f"(RuntimeError: cannot wrap this); comfy-env is as it was")

    def test_an_interrupt_half_way_puts_back_and_propagates(fresh,
                                                           monkeypatch,
                                                           caplog):
        hook = SWAPS[len(SWAPS) // 2]

        def interrupted(original):
            raise KeyboardInterrupt

        monkeypatch.setattr(adapter, "HOOKS", tuple(
            h._replace(wrap=interrupted) if h is hook else h
            for h in adapter.HOOKS))
        with pytest.raises(KeyboardInterrupt):
            adapter.install()
        assert not adapter.installed() and same(snapshot(), fresh)
        assert lines(caplog) == []

    def test_comfy_env_reads_nothing_off_a_patcher_that_standin_lacks():
        """StandIn answers everything comfy-env's patcher (and its
        model) has but their own helpers, and no code of this comfy-env
        but the patcher's own uses those helpers."""
        s = cs.StandIn(worker=fakes.FakeWorker("w"), worker_generation=1,
                       model_id="m", model_size=MiB, load_device="cuda:0",
                       offload_device="cpu", pool=cs.Pool(floor=0))
        assert sorted(n for n in adapter._PATCHER_SURFACE
                      if not hasattr(s, n)) == []
        assert sorted(n for n in adapter._MODULE_SURFACE
                      if not hasattr(s.model, n)) == []
        package = importlib.import_module("comfy_env")
        root = pathlib.Path(package.__file__).parent
        helpers = adapter._PATCHER_OWN | adapter._MODULE_OWN
        used = []
        for path in sorted(root.rglob("*.py")):
            if path.name == "model_patcher.py":
                continue
            text = path.read_text(encoding="utf-8")
            used += [f"{path.relative_to(root)}: {name}" for name in helpers
                     if re.search(rf"\b{name}\b" if name.isupper()
                                  else rf"\.{name}\b", text)]
        assert used == []

    # ---- comfy-env's real worker with the adapter installed ----
    from test_comfy_env_e2e import host  # noqa: F401 - their fixture

    for _name, _test in list(vars(test_comfy_env_e2e).items()):
        if _name.startswith("test_") and "host" in inspect.signature(
                _test).parameters and not any(
                    m.name == "torch_worker"
                    for m in getattr(_test, "pytestmark", ())):
            globals()[_name] = _test  # (torch: 0.4.46 only, .ci/run)
    del _name, _test


if TIER == "full":
    @pytest.fixture
    def board_host(mm, monkeypatch, tmp_path):
        """test_comfy_env_board.py's host, under a name of its own."""
        monkeypatch.setattr(mm, "processing_interrupted", lambda: False,
                            raising=False)
        monkeypatch.setattr(adapter, "_warned", set())
        harness = Host(mm, tmp_path / "pack", pathlib.Path(sys.prefix))
        try:
            yield host_namespace(harness)
        finally:
            harness.close()

    BOARD_TESTS = [
        test for name, test in vars(test_comfy_env_board).items()
        if name.startswith("test_")
        and list(inspect.signature(test).parameters) == ["host"]
    ]

    @pytest.mark.parametrize("board_test", BOARD_TESTS,
                             ids=lambda test: test.__name__)
    def test_the_board(board_host, board_test):
        board_test(board_host)


if TIER == "receipts":
    def test_a_real_worker_on_receipts_has_nothing_of_the_board(
            mm, monkeypatch, tmp_path, caplog):
        monkeypatch.setattr(mm, "processing_interrupted", lambda: False,
                            raising=False)
        monkeypatch.delenv("COMFY_STANDIN_NO_BOARD", raising=False)
        host = Host(mm, tmp_path / "pack", pathlib.Path(sys.prefix),
                    boards=False)
        try:
            assert adapter.install() is True
            host.call("load", model_id="r", nbytes=2 * MiB)
            worker, _ = host.current()
            s = standin_of(mm, "r")
            assert type(s) is cs.StandIn and s.board is None
            host.call("touch")
            assert s.receipt()[3] == "census" and s.loaded_size() == 2 * MiB
            # no publisher in the worker, no handoff in its environment
            assert host.call("publisher") == [False, False, None]
            assert not host.call("about")[0]["handoff_in_environ"]
        finally:
            host.close()
