"""Real parts for the live VRAM page's tests: ComfyUI's aiohttp server
with the node entry's routes, and a headless Chromium driven over the
DevTools protocol (a websocket, through aiohttp's client).

``python tests/browser.py docs/img/vram-page.png`` writes the README's
screenshot from the scene ``scene()`` builds.
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


def add_routes_as_comfyui(app: Any, routes: Any) -> None:
    """What ComfyUI's ``PromptServer.add_routes`` (server.py) does with
    ``PromptServer.instance.routes`` once every custom node has loaded:
    each ``web.RouteDef`` is added again under ``/api`` by calling
    ``RouteTableDef.route(method, "/api" + path)`` and passing the handler
    and the route's keywords to the decorator it returns (which takes the
    handler only), then both tables go onto the app."""
    api_routes = web.RouteTableDef()
    for route in routes:
        if isinstance(route, web.RouteDef):
            api_routes.route(route.method, "/api" + route.path)(
                route.handler, **route.kwargs)
    app.add_routes(api_routes)
    app.add_routes(routes)


class ComfyServer:
    """An aiohttp server on 127.0.0.1 whose routes are a RouteTableDef
    that the node entry's ``register_with_comfyui()`` filled, as ComfyUI's
    ``PromptServer.instance.routes`` is."""

    def __init__(self) -> None:
        from comfy_standin import _server_route

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
        app = web.Application()
        add_routes_as_comfyui(app, self.routes)
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


def main(argv: list[str]) -> int:
    """Write the README's screenshot of the page (see scene())."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_vram_page import scene

    with scene() as (server, _):
        browser = Browser(1100, 820)
        try:
            browser.goto(server.url + "/comfy_standin/")
            assert browser.wait_for(
                'document.getElementById("conn").dataset.state === "up"')
            browser.screenshot(argv[0])
        finally:
            browser.close()
            server.stop()
    print(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
