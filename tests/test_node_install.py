"""``install-node`` / ``uninstall-node`` and the node entry they write.

The entry is loaded here the way ComfyUI loads a custom node (a module
spec from the folder's ``__init__.py``, named by the folder's path), with
the mock ``comfy`` package (tests/mockcomfy) and the real comfy-env;
tests/test_comfyui_server.py loads it in ComfyUI itself.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import types

import pytest
from aiohttp import web
from browser import add_routes_as_comfyui

from comfy_standin import __main__ as cli
from comfy_standin import _node, _server_route
from comfy_standin.integrations import comfy_env as adapter

MOCK_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         "mockcomfy")


@pytest.fixture
def comfyui(tmp_path):
    root = tmp_path / "ComfyUI"
    (root / "custom_nodes").mkdir(parents=True)
    (root / "main.py").write_text("# ComfyUI\n")
    return root


def run(*argv):
    out = io.StringIO()
    err = io.StringIO()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = cli.main(list(argv))
    finally:
        sys.stdout, sys.stderr = old
    return code, out.getvalue() + err.getvalue()


def entry(comfyui):
    return comfyui / "custom_nodes" / _node.NODE_DIR


def test_install_is_idempotent_and_says_what_it_did(comfyui):
    code, out = run("install-node", str(comfyui))
    assert code == 0
    assert "installed" in out and str(entry(comfyui)) in out
    assert "uninstall-node" in out
    assert sorted(os.listdir(entry(comfyui))) == ["__init__.py"]
    assert (entry(comfyui) / "__init__.py").read_text() == _node.template()
    code, out = run("install-node", str(comfyui))
    assert code == 0 and "already installed" in out
    # an older entry of ours is rewritten
    (entry(comfyui) / "__init__.py").write_text(
        f'"""{_node.MARKER}, format 0"""\n')
    code, out = run("install-node", str(comfyui))
    assert code == 0 and "updated" in out
    assert (entry(comfyui) / "__init__.py").read_text() == _node.template()


@pytest.mark.parametrize("missing", ["main.py", "custom_nodes"])
def test_install_refuses_what_is_not_a_comfyui(comfyui, missing):
    target = comfyui / missing
    if target.is_dir():
        target.rmdir()
    else:
        target.unlink()
    code, out = run("install-node", str(comfyui))
    assert code == _node.EXIT_REFUSED
    assert "not a ComfyUI folder" in out and missing in out
    assert not entry(comfyui).exists()
    code, out = run("uninstall-node", str(comfyui))
    assert code == _node.EXIT_REFUSED


def test_install_refuses_a_foreign_folder(comfyui):
    entry(comfyui).mkdir()
    (entry(comfyui) / "__init__.py").write_text("NODE_CLASS_MAPPINGS = {}\n")
    code, out = run("install-node", str(comfyui))
    assert code == _node.EXIT_REFUSED and "not written" in out
    code, out = run("uninstall-node", str(comfyui))
    assert code == _node.EXIT_REFUSED
    assert (entry(comfyui) / "__init__.py").exists()


def test_uninstall_removes_and_is_idempotent(comfyui):
    assert run("install-node", str(comfyui))[0] == 0
    (entry(comfyui) / "__pycache__").mkdir()
    cached = f"__init__.{sys.implementation.cache_tag}.pyc"
    (entry(comfyui) / "__pycache__" / cached).write_bytes(b"")
    code, out = run("uninstall-node", str(comfyui))
    assert code == 0 and "removed" in out
    assert not entry(comfyui).exists()
    code, out = run("uninstall-node", str(comfyui))
    assert code == 0 and "not installed" in out


def test_uninstall_verbose_lists_each_path(comfyui):
    assert run("install-node", str(comfyui))[0] == 0
    (entry(comfyui) / "notes.txt").write_text("mine")
    code, out = run("uninstall-node", "-v", str(comfyui))
    assert code == 0
    assert f"  removed {entry(comfyui) / '__init__.py'}" in out.splitlines()
    assert f"  kept {entry(comfyui) / 'notes.txt'}" in out.splitlines()
    assert "  removed" not in run("uninstall-node", str(comfyui))[1]


def test_uninstall_keeps_files_it_did_not_write(comfyui):
    assert run("install-node", str(comfyui))[0] == 0
    (entry(comfyui) / "notes.txt").write_text("mine")
    code, out = run("uninstall-node", str(comfyui))
    assert code == 0 and "kept" in out
    assert sorted(os.listdir(entry(comfyui))) == ["notes.txt"]


def load_like_comfyui(folder):
    """ComfyUI's custom-node import (nodes.py, load_custom_node): a spec
    from the folder's __init__.py, named by the folder's whole path with
    every "." made "_x_", in sys.modules before it runs."""
    name = str(folder).replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


@pytest.mark.comfy_env
def test_the_entry_switches_on_and_adds_the_route(comfyui, mm,
                                                   monkeypatch):
    from comfy_env.isolation import model_patcher

    import comfy_standin as cs

    routes = web.RouteTableDef()  # PromptServer.instance.routes
    server = types.ModuleType("server")
    server.PromptServer = types.SimpleNamespace(
        instance=types.SimpleNamespace(routes=routes))
    monkeypatch.setitem(sys.modules, "server", server)
    monkeypatch.setattr(_server_route, "_registered_on", [])
    assert run("install-node", str(comfyui))[0] == 0
    assert not adapter.installed()
    try:
        module = load_like_comfyui(entry(comfyui))
        assert module.NODE_CLASS_MAPPINGS == {}
        assert adapter.installed()
        assert model_patcher.SubprocessModelPatcher is cs.StandIn
        added = [(r.method, r.path, r.handler, r.kwargs) for r in routes]
        assert added == [
            ("GET", "/comfy_standin/status", _server_route.handle, {}),
            ("GET", "/comfy_standin/", _server_route.handle_page, {}),
        ]
        load_like_comfyui(entry(comfyui))  # a second load adds nothing
        assert len(list(routes)) == 2
        # What ComfyUI's PromptServer.add_routes then does with them.
        app = web.Application()
        add_routes_as_comfyui(app, routes)
        paths = sorted({r.resource.canonical for r in app.router.routes()})
        assert paths == ["/api/comfy_standin/", "/api/comfy_standin/status",
                         "/comfy_standin/", "/comfy_standin/status"]
    finally:
        adapter.uninstall()
    assert model_patcher.SubprocessModelPatcher is not cs.StandIn


def test_the_entry_never_breaks_comfyui_start(comfyui, monkeypatch,
                                               caplog):
    """comfy-env (or comfy) missing: one warning, ComfyUI goes on."""
    assert run("install-node", str(comfyui))[0] == 0

    def refuse():
        raise ImportError("No module named 'comfy_env'")

    monkeypatch.setattr(adapter, "install", refuse)
    caplog.set_level("WARNING", logger="comfy_standin")
    module = load_like_comfyui(entry(comfyui))
    assert module.NODE_CLASS_MAPPINGS == {}
    assert "not switched on" in caplog.text
    assert not adapter.installed()


@pytest.mark.comfy_env
def test_importing_the_package_changes_nothing_in_comfy_env():
    """No .pth, no import side effect: a process that imports
    comfy_standin and comfy-env keeps comfy-env's own stand-in class."""
    code = (
        "import comfy_standin, comfy_standin.integrations.comfy_env as a\n"
        "from comfy_env.isolation import model_patcher as m\n"
        "assert m.SubprocessModelPatcher is not comfy_standin.StandIn\n"
        "assert not a.installed()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=MOCK_ROOT)
    done = subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_no_pth_file_of_ours_in_the_environment():
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    ours = [
        os.path.join(d, name)
        for d in dirs if os.path.isdir(d)
        for name in os.listdir(d)
        if name.endswith(".pth")
        and "comfy_standin" in open(os.path.join(d, name)).read()
        and "editable" not in name  # meson-python's editable loader
    ]
    assert ours == []


def test_the_comfy_env_plugin_entry_point_is_declared():
    points = importlib.metadata.entry_points(group="comfy_env.plugins")
    ours = [p for p in points if p.name == "comfy_standin"]
    assert len(ours) == 1
    assert ours[0].load() is adapter.install


# ---------------------------------------------------------------------------
# the node entry never raises into ComfyUI's start or its add_routes


def comfyui_server(monkeypatch, routes=None, *, instance=True):
    """A ``server`` module as ComfyUI's main.py has made it when custom
    nodes load: ``PromptServer.instance.routes``, a RouteTableDef its
    own routes are on (`routes`: what to put there instead)."""
    if routes is None:
        routes = web.RouteTableDef()

        @routes.get("/system_stats")
        async def system_stats(request):  # ComfyUI's own, already there
            return web.json_response({})

    server = types.ModuleType("server")
    server.PromptServer = types.SimpleNamespace(
        instance=types.SimpleNamespace(routes=routes) if instance else None)
    monkeypatch.setitem(sys.modules, "server", server)
    monkeypatch.setattr(_server_route, "_registered_on", [])
    monkeypatch.setattr(_server_route, "_said", set())
    return routes


def load_entry_failing(comfyui, caplog):
    """Load the entry as ComfyUI does; the package's log lines."""
    assert run("install-node", str(comfyui))[0] == 0
    caplog.clear()
    caplog.set_level("INFO", logger="comfy_standin")
    module = load_like_comfyui(entry(comfyui))
    assert module.NODE_CLASS_MAPPINGS == {}
    return [r for r in caplog.records if r.name == "comfy_standin"
            and r.levelname == "WARNING"]


def serves_as_if_absent(routes):
    """What ComfyUI's add_routes does next runs, with none of ours."""
    app = web.Application()
    add_routes_as_comfyui(app, routes)
    paths = {r.resource.canonical for r in app.router.routes()}
    assert not any("comfy_standin" in p for p in paths), paths
    assert "/system_stats" in paths and "/api/system_stats" in paths


@pytest.fixture
def no_adapter(monkeypatch):
    """The adapter's part succeeds without touching comfy-env (these tests
    are about the routes)."""
    monkeypatch.setattr(adapter, "install", lambda: None)


def test_a_failure_halfway_leaves_no_route_behind(comfyui, monkeypatch,
                                                   caplog, no_adapter):
    routes = comfyui_server(monkeypatch)
    real = web.RouteTableDef.route
    calls = []

    def second_fails(self, method, path, **kwargs):
        if self is routes and path.startswith("/comfy_standin"):
            calls.append(path)
            if len(calls) == 2:
                raise MemoryError("no room for the page route")
        return real(self, method, path, **kwargs)

    monkeypatch.setattr(web.RouteTableDef, "route", second_fails)
    warnings = load_entry_failing(comfyui, caplog)
    assert calls == [_server_route.ROUTE, _server_route.PAGE_ROUTE]
    assert [w.getMessage() for w in warnings] == [
        "comfy_standin: no status route (MemoryError: no room for the "
        "page route)"]
    assert [r.path for r in routes] == ["/system_stats"]
    monkeypatch.setattr(web.RouteTableDef, "route", real)
    serves_as_if_absent(routes)


@pytest.mark.parametrize("routes, says", [
    ([], "PromptServer.instance.routes is list, not an aiohttp "
         "RouteTableDef"),
    (web.UrlDispatcher(), "is UrlDispatcher, not an aiohttp "
                          "RouteTableDef"),
])
def test_routes_that_are_not_a_route_table_are_refused(
        comfyui, monkeypatch, caplog, no_adapter, routes, says):
    comfyui_server(monkeypatch, routes)
    warnings = load_entry_failing(comfyui, caplog)
    assert len(warnings) == 1 and says in warnings[0].getMessage()
    assert warnings[0].getMessage().startswith(
        "comfy_standin: no status route (")
    assert not list(routes)


def test_a_server_without_routes_says_so_once(comfyui, monkeypatch, caplog,
                                              no_adapter):
    """A PromptServer.instance without ``routes``: one line, the first
    time only (the entry may be loaded again)."""
    server = types.ModuleType("server")
    server.PromptServer = types.SimpleNamespace(
        instance=types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "server", server)
    monkeypatch.setattr(_server_route, "_said", set())
    warnings = load_entry_failing(comfyui, caplog)
    assert [w.getMessage() for w in warnings] == [
        "comfy_standin: no status route (PromptServer.instance has no "
        "routes: a ComfyUI server this comfy_standin does not know)"]
    caplog.clear()
    load_like_comfyui(entry(comfyui))
    assert "no status route" not in caplog.text
    # Outside ComfyUI (no server module): nothing to say.
    monkeypatch.delitem(sys.modules, "server")
    assert _server_route.register_with_comfyui() is False
    assert "no status route" not in caplog.text


def test_a_path_another_node_serves_is_refused(comfyui, monkeypatch,
                                                caplog, no_adapter):
    """Two GETs on one path stop aiohttp (and ComfyUI) at start."""
    routes = comfyui_server(monkeypatch)

    @routes.get(_server_route.ROUTE)
    async def theirs(request):
        return web.json_response({})

    warnings = load_entry_failing(comfyui, caplog)
    assert [w.getMessage() for w in warnings] == [
        "comfy_standin: no status route (another custom node serves GET "
        "/comfy_standin/status)"]
    assert [r.handler for r in routes if "comfy" in r.path] == [theirs]


def test_what_aiohttp_would_refuse_is_not_added(comfyui, monkeypatch,
                                                 caplog, no_adapter):
    """A route ComfyUI's add_routes would stop on (here a path aiohttp
    refuses) is tried on an application of its own first."""
    routes = comfyui_server(monkeypatch)
    monkeypatch.setattr(_server_route, "PAGE_ROUTE", "comfy_standin/")
    doomed = web.RouteTableDef()
    doomed.get("comfy_standin/")(_server_route.handle_page)
    with pytest.raises(ValueError):  # what ComfyUI would have met
        add_routes_as_comfyui(web.Application(), doomed)
    warnings = load_entry_failing(comfyui, caplog)
    assert len(warnings) == 1
    assert warnings[0].getMessage().startswith(
        "comfy_standin: no status route (this aiohttp would refuse them "
        "at ComfyUI's start: ValueError: ")
    serves_as_if_absent(routes)


def test_no_comfy_standin_is_one_line(comfyui):
    """A Python without comfy_standin runs ComfyUI (-S: no site-packages):
    one line, and no route is tried."""
    assert run("install-node", str(comfyui))[0] == 0
    code = (
        "import importlib.util, logging, sys\n"
        "logging.basicConfig(format='%(levelname)s %(message)s')\n"
        f"spec = importlib.util.spec_from_file_location('entry', "
        f"{str(entry(comfyui) / '__init__.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'comfy_standin' not in sys.modules\n"
        "print(module.NODE_CLASS_MAPPINGS)\n"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code],
                          capture_output=True, text=True, timeout=120,
                          cwd=str(comfyui))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "{}\n"
    assert done.stderr.splitlines() == [
        "WARNING comfy_standin: not switched on (ModuleNotFoundError: No "
        "module named 'comfy_standin')"]


def test_a_server_that_raises_is_one_line(comfyui, monkeypatch, caplog,
                                          no_adapter):
    """Reading ComfyUI's server raises (an exception whose text cannot be
    read, even): one line, nothing added, ComfyUI goes on."""
    class Unprintable(RuntimeError):
        def __str__(self):
            raise ValueError("no text")

    class Server:
        @property
        def instance(self):
            raise Unprintable()

    server = types.ModuleType("server")
    server.PromptServer = Server()
    monkeypatch.setitem(sys.modules, "server", server)
    monkeypatch.setattr(_server_route, "_said", set())
    warnings = load_entry_failing(comfyui, caplog)
    assert [w.getMessage() for w in warnings] == [
        "comfy_standin: no status route (Unprintable: (its text cannot be "
        "read))"]


def test_an_exception_that_cannot_be_shown_is_still_one_line(
        comfyui, monkeypatch, caplog):
    class Unprintable(RuntimeError):
        def __str__(self):
            raise ValueError("no text")

    def install():
        raise Unprintable()

    comfyui_server(monkeypatch)
    monkeypatch.setattr(adapter, "install", install)
    warnings = load_entry_failing(comfyui, caplog)
    assert [w.getMessage() for w in warnings] == [
        "comfy_standin: not switched on (Unprintable)"]
