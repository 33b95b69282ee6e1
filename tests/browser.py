"""Real parts for the live VRAM page's tests: an aiohttp server built as
ComfyUI's ``PromptServer`` builds its own, with the node entry's routes,
and a headless Chromium driven over the DevTools protocol (a websocket,
through aiohttp's client).

The README's screenshot comes from ComfyUI itself
(tests/test_comfyui_server.py), not from here.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import types
from typing import Any

from aiohttp import ClientSession, web

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str:
    """The browser; a missing one is an error (Debian: apt-get install
    chromium), never a skip."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(
        "no headless Chromium on PATH (tried "
        f"{', '.join(CHROMIUM_NAMES)}): on Debian/Ubuntu, apt-get install "
        "chromium; the live VRAM page's tests need it")


#: What a sanitizer run of the suite sets for the interpreter: not for
#: the browser (a preloaded ASan runtime under Chromium's allocator).
_NOT_FOR_THE_BROWSER = ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS",
                        "TSAN_OPTIONS", "PYTHONMALLOC")


def browser_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if key not in _NOT_FOR_THE_BROWSER}


class LoopThread:
    """An asyncio loop on a thread of its own; `run` waits for a
    coroutine's result (bounded)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever,
                                       daemon=True)
        self.thread.start()

    def run(self, coroutine: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(
            coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def add_routes_as_comfyui(app: Any, routes: Any,
                          web_root: str | None = None) -> None:
    """What ComfyUI's ``PromptServer.add_routes`` (server.py) does with
    ``PromptServer.instance.routes`` once every custom node has loaded:
    each ``web.RouteDef`` is added again under ``/api`` by calling
    ``RouteTableDef.route(method, "/api" + path)`` and passing the handler
    and the route's keywords to the decorator it returns (which takes the
    handler only), then both tables go onto the app; last, the frontend's
    folder is served as static files from ``/`` (`web_root`), behind
    every route added before it."""
    api_routes = web.RouteTableDef()
    for route in routes:
        if isinstance(route, web.RouteDef):
            api_routes.route(route.method, "/api" + route.path)(
                route.handler, **route.kwargs)
    app.add_routes(api_routes)
    app.add_routes(routes)
    if web_root is not None:
        app.add_routes([web.static("/", web_root)])


#: Paths whose responses ComfyUI's cache-control middleware gives a
#: Cache-Control header (when the handler set none).
_SCRIPTS = (".js", ".css")
_IMAGES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif",
           ".tiff", ".webp")


@web.middleware
async def cache_control(request: Any, handler: Any) -> Any:
    """ComfyUI's first middleware: scripts, styles and ``index*.json``
    get ``no-cache``, images a day (an hour for a 404) or ``no-cache``
    for a temporary redirect; any other response is left as it is.  A
    header the handler set is never replaced."""
    response = await handler(request)
    path = request.path
    name = path.rsplit("/", 1)[-1]
    if path.endswith(_SCRIPTS) or (name.startswith("index")
                                   and name.endswith(".json")):
        response.headers.setdefault("Cache-Control", "no-cache")
    elif path.lower().endswith(_IMAGES):
        if response.status == 404:
            response.headers.setdefault("Cache-Control",
                                        "public, max-age=3600")
        elif response.status in (200, 201, 202, 203, 204, 205, 206, 301,
                                 308):
            response.headers.setdefault("Cache-Control",
                                        "public, max-age=86400")
        elif response.status in (302, 303, 307):
            response.headers.setdefault("Cache-Control", "no-cache")
    return response


@web.middleware
async def compress_body(request: Any, handler: Any) -> Any:
    """``--enable-compress-response-body``: a JSON or plain-text
    response with a body is gzipped for a client that accepts gzip."""
    response = await handler(request)
    if (isinstance(response, web.Response)
            and response.content_type in ("application/json",
                                          "text/plain")
            and response.body
            and "gzip" in request.headers.get("Accept-Encoding", "")):
        response.enable_compression()
    return response


def _loopback(host: str | None) -> bool:
    import ipaddress

    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@web.middleware
async def origin_only(request: Any, handler: Any) -> Any:
    """ComfyUI's guard without ``--enable-cors-header``: a request to a
    loopback Host whose Origin names another host is answered 403 (ports
    compared only when both carry one); OPTIONS is answered 200, empty."""
    from urllib.parse import urlsplit

    host, origin = request.headers.get("Host"), request.headers.get(
        "Origin")
    if host and origin:
        to, by = urlsplit("//" + host.lower()), urlsplit(origin.lower())
        mine = to.hostname if by.port is None else host.lower()
        theirs = by.hostname if to.port is None else by.netloc
        if _loopback(to.hostname) and mine and theirs and mine != theirs:
            return web.Response(status=403)
    if request.method == "OPTIONS":
        return web.Response()
    return await handler(request)


def comfyui_middlewares(compress: bool = False) -> list[Any]:
    """The middlewares ComfyUI's ``PromptServer.__init__`` puts on its
    application, in its order (without ``--enable-cors-header``)."""
    return [cache_control, *([compress_body] if compress else []),
            origin_only]


class ComfyServer:
    """An aiohttp server on 127.0.0.1 built as ComfyUI builds its own:
    ComfyUI's middlewares, a RouteTableDef that the node entry's
    ``register_with_comfyui()`` filled (as ComfyUI's
    ``PromptServer.instance.routes`` is), added as ``add_routes`` adds
    it, and a frontend folder served from ``/`` behind it.
    ``compress``: as ``--enable-compress-response-body``."""

    def __init__(self, compress: bool = False) -> None:
        from comfy_standin import _server_route

        self.compress = compress
        self.web_root = tempfile.mkdtemp(prefix="cs-web-root-")
        with open(os.path.join(self.web_root, "index.html"), "w") as f:
            f.write("<!doctype html><title>ComfyUI</title>\n")
        self.routes = web.RouteTableDef()
        server = types.ModuleType("server")
        server.PromptServer = types.SimpleNamespace(  # type: ignore
            instance=types.SimpleNamespace(routes=self.routes))
        saved = sys.modules.get("server")
        sys.modules["server"] = server
        _server_route._registered_on.clear()
        try:
            assert _server_route.register_with_comfyui()
        finally:
            if saved is None:
                del sys.modules["server"]
            else:
                sys.modules["server"] = saved
        self.loop = LoopThread()
        self.loop.run(self._start())

    async def _start(self) -> None:
        app = web.Application(
            middlewares=comfyui_middlewares(self.compress))
        add_routes_as_comfyui(app, self.routes, self.web_root)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        """The server goes away (its port stops answering)."""
        if self.loop is not None:
            self.loop.run(self.runner.cleanup())
            self.loop.close()
            self.loop = None  # type: ignore[assignment]
            shutil.rmtree(self.web_root, ignore_errors=True)


class Browser:
    """Headless Chromium with one page, driven over DevTools."""

    def __init__(self, width: int = 1200, height: int = 900) -> None:
        self.profile = tempfile.mkdtemp(prefix="cs-chromium-")
        self.process = subprocess.Popen(
            [chromium_path(), "--headless=new", "--no-sandbox",
             "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--hide-scrollbars",
             f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", "--remote-debugging-address="
             "127.0.0.1", f"--window-size={width},{height}",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env=browser_environment())
        self.endpoint = self._endpoint()
        self.loop = LoopThread()
        self.ids = itertools.count(1)
        self.loop.run(self._connect(width, height))

    def _endpoint(self) -> str:
        """Chromium says its DevTools address on stderr; a thread reads it
        (and keeps draining, so Chromium never blocks on a full pipe)."""
        found: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.process.stderr is not None
            for line in self.process.stderr:
                match = re.search(r"DevTools listening on (ws://\S+)", line)
                if match and not found:
                    found.append(match.group(1))
                    ready.set()
            ready.set()  # chromium exited

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60) or not found:
            raise RuntimeError(
                f"chromium did not open DevTools (exit code "
                f"{self.process.poll()})")
        return found[0]

    async def _connect(self, width: int, height: int) -> None:
        self.session = ClientSession()
        self.ws = await self.session.ws_connect(self.endpoint,
                                                max_msg_size=0)
        target = await self._send("Target.createTarget",
                                  {"url": "about:blank"})
        attached = await self._send("Target.attachToTarget",
                                    {"targetId": target["targetId"],
                                     "flatten": True})
        self.page_session = attached["sessionId"]
        await self._send("Page.enable", {}, self.page_session)
        await self._send("Emulation.setDeviceMetricsOverride",
                         {"width": width, "height": height,
                          "deviceScaleFactor": 1, "mobile": False},
                         self.page_session)

    async def _send(self, method: str, params: dict[str, Any],
                    session: str | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"id": next(self.ids), "method": method,
                                   "params": params}
        if session:
            message["sessionId"] = session
        await self.ws.send_str(json.dumps(message))
        while True:
            reply = json.loads((await self.ws.receive(timeout=60)).data)
            if reply.get("id") == message["id"]:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def send(self, method: str, params: dict[str, Any]) -> Any:
        return self.loop.run(self._send(method, params, self.page_session))

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {
            "expression": expression, "returnByValue": True,
            "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: "
                               f"{result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout_ms: int = 20000) -> bool:
        """True once the JS `condition` holds in the page (the page's own
        timer polls it), False after `timeout_ms`."""
        return bool(self.evaluate(f"""
            new Promise(resolve => {{
              const start = Date.now();
              (function check() {{
                let ok = false;
                try {{ ok = Boolean({condition}); }} catch (e) {{}}
                if (ok) resolve(true);
                else if (Date.now() - start > {timeout_ms}) resolve(false);
                else setTimeout(check, 50);
              }})();
            }})"""))

    def screenshot(self, path: str) -> None:
        shot = self.send("Page.captureScreenshot", {"format": "png"})
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))

    def close(self) -> None:
        try:
            self.loop.run(self.session.close(), timeout=10)
        except Exception:  # noqa: BLE001 - the process is ended below
            pass
        self.loop.close()
        self.process.kill()
        self.process.wait(30)
        shutil.rmtree(self.profile, ignore_errors=True)


#: The page's state as data: what the tests compare with the JSON.
READ_PAGE = """(() => {
  const ds = el => Object.assign({}, el.dataset);
  return {
    conn: ds(document.getElementById("conn")),
    connText: document.getElementById("conn").textContent,
    stale: document.body.classList.contains("stale"),
    devices: [...document.querySelectorAll("section.device")].map(s => ({
      ...ds(s),
      title: s.querySelector("h2").textContent,
      segments: [...s.querySelectorAll(".seg")].map(g => ({
        ...ds(g), title: g.title,
        width: g.getBoundingClientRect().width})),
      reserveMarks: [...s.querySelectorAll(".reserve")].map(ds),
      legend: [...s.querySelectorAll(".legend > span")].map(e => ({
        ...ds(e), text: e.textContent})),
      order: [...s.querySelectorAll("table.order tr[data-index]")].map(
        r => ({...ds(r), why: r.querySelector(".why").textContent})),
      barWidth: s.querySelector(".bar").getBoundingClientRect().width,
    })),
    workers: [...document.querySelectorAll(".worker")].map(w => ({
      ...ds(w), text: w.textContent,
      models: [...w.querySelectorAll("tr.model")].map(ds)})),
    noWorkers: document.getElementById("no-workers") !== null,
  };
})()"""
