"""The live VRAM page and the status route, on a real aiohttp server
(tests/browser.py's ComfyServer: the node entry's routes in a
RouteTableDef, as ComfyUI's PromptServer has them) and in a real headless
Chromium (Debian's package) driven over DevTools.

The page is compared structurally with the JSON the same server answers:
elements present, every number equal, in four states: no workers, a
worker whose board (a real worker process publishing) is valid, a dead
worker, and the server gone.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
import struct
import urllib.error
import urllib.request

import fakes
import mock_fixtures
import pytest
from browser import READ_PAGE, Browser, ComfyServer
from test_board import Worker
from test_status_url import run as run_cli

import comfy_standin as cs
from comfy_standin import _server_route, _status

GiB = 1 << 30
MiB = 1 << 20
#: A launcher's pid (no such process: only shown).
LAUNCHER_PID = 4_000_001
#: The page's own minimum segment width.
MIN_SEGMENT_PX = int(re.search(r"MIN_SEGMENT_PX = (\d+);",
                               _server_route.PAGE_FILE.read_text()).group(1))


def get(url, method="GET"):
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def status_json(server):
    code, headers, body = get(server.url + _server_route.ROUTE)
    assert code == 200
    return json.loads(body)


class Scene:
    """ComfyUI's side of a picture: the mock model_management with host
    models, this process's default pool, stand-ins of fake workers."""

    def __init__(self):
        self.mm = mock_fixtures.mock_mm
        self.mm.reset()
        self.pool = cs.Pool()
        self.workers = []
        self.host_models = []  # held, as ComfyUI's node cache holds them
        self.boards = []
        self.board_workers = []

    def host_model(self, name, size, loaded=None):
        model = self.mm.HostModel(name, size)
        self.host_models.append(model)
        self.mm.load_models_gpu([model])
        if loaded is not None:
            entry = self.mm.loaded_entry(model)
            entry.model_unload(size - loaded)
        return model

    def worker(self, name, models):
        worker = fakes.FakeWorker(name, context_bytes=300 * MiB)
        standins = {}
        for model_id, size, resident in models:
            worker.add_model(model_id, size, resident=resident)
            standins[model_id] = cs.StandIn(
                worker, 1, model_id, size, self.mm.CUDA0, self.mm.CPU,
                kind=model_id.split("-")[0], pool=self.pool)
        cs.apply_residency(standins, worker.census())
        for s in standins.values():
            cs.register(self.mm, s)
        self.workers.append(worker)
        return worker, standins

    def board(self, standin, published):
        """A board attached to `standin`, published by a real worker
        process."""
        process = Worker(4, generation=1)
        board = process.board
        slot = standin.attach_board(board)
        assert process.ask(f"bind {slot} {board.tag(slot)}") == "ok"
        board.expected_owner = process.pid
        assert process.ask(f"publish {slot} {published}") == "ok"
        self.boards.append(board)
        self.board_workers.append(process)
        return board

    def close(self):
        for process in self.board_workers:
            process.close()
        for worker in self.workers:
            worker.kill()
            self.pool.worker_gone(worker)
        self.pool.boundary(self.mm)
        for board in self.boards:
            board.close()
        self.mm.reset()
        self.host_models.clear()


@contextlib.contextmanager
def scene(populated=True, compress=False):
    """A ComfyServer over a Scene (populated: host models and stand-ins
    of two workers, one with a board); `compress` as ComfyUI's
    --enable-compress-response-body."""
    saved = cs._default_pool
    picture = Scene()
    cs._default_pool = picture.pool
    server = ComfyServer(compress=compress)
    try:
        if populated:
            picture.host_model("SDXL-unet", 5 * GiB, loaded=3 * GiB)
            picture.host_model("clip-l", 1 * GiB)
            pack_a, a = picture.worker("pack-A", [("unet-hunyuan3d",
                                                   6 * GiB, 4 * GiB),
                                                  ("vae-hunyuan3d", GiB,
                                                   GiB)])
            # Started through a launcher that runs Python as its child:
            # comfy-env's process is the launcher, the board's handoff
            # peer (the publishing process) the worker Python.
            pack_a.pid = LAUNCHER_PID
            picture.board(a["unet-hunyuan3d"], 3 * GiB)
            b, _ = picture.worker("pack-B", [("sam-2", 2 * GiB, 2 * GiB)])
            b.add_cache(768 * MiB)  # its allocator cache: unlisted
            picture.pool.report(b, b.vram_report())
        yield server, picture
    finally:
        server.stop()
        picture.close()
        cs._default_pool = saved


# ---------------------------------------------------------------------------
# the routes, through aiohttp


def test_the_status_route_runs_in_aiohttp():
    with scene() as (server, picture):
        code, headers, body = get(server.url + _server_route.ROUTE)
        assert code == 200
        assert headers["Content-Type"].startswith("application/json")
        assert headers["Cache-Control"] == "no-store"
        data = json.loads(body)
        assert data["pid"] > 0 and data["format"] == 1
        models = [m["model_id"] for w in data["pool"]["workers"]
                  for m in w["models"]]
        assert sorted(models) == ["sam-2", "unet-hunyuan3d",
                                  "vae-hunyuan3d"]
        comfy = data["comfyui"]
        assert comfy["available"] is True
        assert len(comfy["models"]) == len(picture.mm.current_loaded_models)
        device = comfy["devices"]["cuda:0"]
        assert device["total"] == 24 * GiB
        assert device["free"] == picture.mm.get_free_memory(
            picture.mm.CUDA0)
        # Read-only: GET (and the HEAD aiohttp serves for a GET route, as
        # for ComfyUI's own), nothing else, nothing else under the prefix;
        # ComfyUI's /api copy answers the same.
        assert get(server.url + _server_route.ROUTE, "HEAD")[0] == 200
        for method in ("POST", "PUT", "DELETE"):
            assert get(server.url + _server_route.ROUTE, method)[0] == 405
        assert get(server.url + "/comfy_standin/other")[0] == 404
        code, _, api_body = get(server.url + "/api" + _server_route.ROUTE)
        assert code == 200 and json.loads(api_body)["pid"] == data["pid"]
        assert get(server.url + "/api" + _server_route.PAGE_ROUTE)[0] == 200


def test_the_routes_under_comfyuis_middlewares():
    """ComfyUI's middlewares stand in front of the routes as in front of
    its own: a body compressed for a client that asks (the status
    client does not, and reads it), headers of ours kept, a foreign
    Origin refused, the frontend's static root behind the page."""
    from comfy_standin import __main__ as cli

    with scene(compress=True) as (server, _):
        url = server.url + _server_route.ROUTE
        request = urllib.request.Request(
            url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.headers["Content-Encoding"] == "gzip"
            data = json.loads(gzip.decompress(reply.read()))
        assert data["format"] == 1
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["status", "--url", server.url, "--json"]) == 0
        assert json.loads(out.getvalue())["pid"] == data["pid"]
        code, headers, body = get(server.url + _server_route.PAGE_ROUTE)
        assert code == 200 and headers["Cache-Control"] == "no-cache"
        assert body == _server_route.PAGE_FILE.read_bytes()
        request = urllib.request.Request(
            url, headers={"Origin": "http://elsewhere.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 403
        code, _, body = get(server.url + "/index.html")
        assert code == 200 and b"<title>ComfyUI</title>" in body


def test_the_eviction_order_is_free_memorys():
    """The route's order for cuda:0 is the order the mock's free_memory
    (faithful to ComfyUI's) then really tries."""
    with scene() as (server, picture):
        picture.host_model("lora-small", 512 * MiB, loaded=256 * MiB)
        data = status_json(server)
        eviction = data["comfyui"]["eviction"]["cuda:0"]
        picture.mm.free_memory(1, picture.mm.CUDA0)
        record = picture.mm.free_memory_log[-1]
        tried = [key[-1] for key, _ in record["candidates"]]
        assert eviction["order"] == tried
        assert eviction["next"] == tried[0]
        first = next(m for m in data["comfyui"]["models"]
                     if m["index"] == tried[0])
        assert first["offloaded"] == max(
            m["offloaded"] for m in data["comfyui"]["models"])
        assert "the most offloaded" in eviction["why"]


def test_why_names_the_deciding_key():
    def views(*keys):
        return [{"index": i, "device": "cuda:0", "offloaded": -k[0],
                 "refcount": k[1], "size": k[2]}
                for i, k in enumerate(keys)]

    why = _server_route.eviction_order
    assert "fewer references (2 against 3" in why(
        views((-5, 3, 1), (-5, 2, 1)))["cuda:0"]["why"]
    assert "smaller (1 MiB against 2 MiB)" in why(
        views((0, 2, 2 * MiB), (0, 2, MiB)))["cuda:0"]["why"]
    assert "earlier in current_loaded_models (index 0)" in why(
        views((0, 2, 1), (0, 2, 1)))["cuda:0"]["why"]
    assert "the only model" in why(views((0, 2, 1)))["cuda:0"]["why"]
    dead = views((0, 2, 1), (-9, 1, 1))
    dead[1]["dead"] = True
    assert why(dead)["cuda:0"]["order"] == [0]


def test_the_route_never_raises(monkeypatch):
    """A model whose methods raise, and a pool that raises, are said in
    their place; the answer is still JSON."""
    class Broken:
        device = "cuda:0"
        currently_used = False

        @property
        def model(self):
            raise RuntimeError("patcher gone wrong")

        def is_dead(self):
            raise RuntimeError("no")

    with scene(populated=False) as (server, picture):
        picture.mm.current_loaded_models.append(Broken())
        monkeypatch.setattr(cs, "default_pool", lambda: 1 / 0)
        data = status_json(server)
        picture.mm.current_loaded_models.pop()
    assert "ZeroDivisionError" in data["pool_error"]
    (broken,) = data["comfyui"]["models"]
    assert "patcher gone wrong" in broken["error"]
    assert data["comfyui"]["eviction"] == {}


def test_the_page_route_serves_one_self_contained_file():
    with scene(populated=False) as (server, _):
        code, headers, body = get(server.url + _server_route.PAGE_ROUTE)
    assert code == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy
    assert "connect-src 'self'" in policy
    assert policy.count("'sha256-") == 2  # its one script, its one style
    assert "unsafe" not in policy
    text = body.decode()
    assert text == _server_route.PAGE_FILE.read_text()
    # Nothing loaded from elsewhere, nothing written into the page as HTML.
    for banned in ("http://", "https://", "src=", "<link", "@import",
                   "innerHTML", "outerHTML", "insertAdjacentHTML",
                   "document.write", "eval("):
        assert banned not in text, banned


# ---------------------------------------------------------------------------
# the page, in Chromium


@pytest.fixture(scope="module")
def browser():
    running = Browser()
    yield running
    running.close()


def read(browser):
    return browser.evaluate(READ_PAGE)


def open_page(browser, server, condition="true"):
    browser.goto(server.url + _server_route.PAGE_ROUTE)
    assert browser.wait_for(
        'document.getElementById("conn").dataset.state === "up" && '
        + condition), read(browser)["connText"]


def check_device(page_device, data):
    """The device's bar and order against the JSON."""
    name = page_device["device"]
    memory = data["comfyui"]["devices"][name]
    assert int(page_device["total"]) == memory["total"]
    assert int(page_device["free"]) == memory["free"]
    assert int(page_device["reserve"]) == data["reserve"][
        "extra_reserved_vram"]
    segments = page_device["segments"]
    by_index = {m["index"]: m for m in data["comfyui"]["models"]}
    host = [s for s in segments if s["kind"] == "comfyui"]
    assert sorted(int(s["bytes"]) for s in host) == sorted(
        m["loaded"] for m in data["comfyui"]["models"]
        if m["device"] == name and not m["standin"] and m["loaded"])
    for s in host:
        assert int(s["bytes"]) == by_index[int(s["index"])]["loaded"]
    standins = [s for s in segments if s["kind"] == "standin"]
    assert sorted(int(s["bytes"]) for s in standins) == sorted(
        m["loaded"] for w in data["pool"]["workers"] for m in w["models"]
        if m["load_device"] == name and m["loaded"])
    (free,) = [s for s in segments if s["kind"] == "free"]
    assert int(free["bytes"]) == memory["free"]
    total_shown = sum(int(s["bytes"]) for s in segments)
    assert total_shown >= memory["total"]
    # Each segment is MIN_SEGMENT_PX wide plus its share of the rest of
    # the bar, in proportion to its bytes: a small model is seen.
    rest = page_device["barWidth"] - MIN_SEGMENT_PX * len(segments)
    for s in segments:
        share = int(s["bytes"]) / max(total_shown, memory["total"])
        assert s["width"] >= MIN_SEGMENT_PX - 0.5, s
        assert abs(s["width"] - MIN_SEGMENT_PX - share * rest) < 2.5, s
    # One legend entry per segment, in the bar's order, with its bytes.
    assert [(e["kind"], e["bytes"]) for e in page_device["legend"]] == [
        (s["kind"], s["bytes"]) for s in segments]
    for entry, s in zip(page_device["legend"], segments, strict=True):
        assert entry["text"].startswith(s["title"]), (entry, s)
    (reserve,) = page_device["reserveMarks"]
    assert int(reserve["bytes"]) == min(
        data["reserve"]["extra_reserved_vram"], memory["free"])
    eviction = data["comfyui"]["eviction"][name]
    rows = page_device["order"]
    assert [int(r["index"]) for r in rows] == eviction["order"]
    for rank, row in enumerate(rows):
        model = by_index[int(row["index"])]
        assert int(row["rank"]) == rank
        assert (row["next"] == "true") == (model["index"]
                                           == eviction["next"])
        assert int(row["loaded"]) == model["loaded"]
        assert int(row["offloaded"]) == model["offloaded"]
        assert int(row["size"]) == model["size"]
        assert int(row["refcount"]) == model["refcount"]
    assert rows[0]["why"] == eviction["why"]
    nexts = [s for s in segments if "next" in s.get("class", "")]
    del nexts  # the outline is cosmetic; the order table is the record


def check_workers(page, data):
    workers = data["pool"]["workers"]
    assert len(page["workers"]) == len(workers)
    for shown, worker in zip(page["workers"], workers, strict=True):
        assert shown["worker"] == worker["worker"]
        assert shown["text"].startswith(f"{worker['worker']} pid ")
        assert shown["pid"] == str(worker["pid"] or "")
        assert shown["launcherPid"] == str(worker["launcher_pid"] or "")
        if worker["launcher_pid"] is not None:
            assert (f"pid {worker['pid']} (started through launcher pid "
                    f"{worker['launcher_pid']})") in shown["text"]
        assert (shown["alive"] == "true") == worker["alive"]
        assert int(shown["charge"]) == worker["charge"]["charge"]
        assert int(shown["unlisted"]) == worker["unlisted"]
        assert int(shown["floor"]) == worker["charge"]["floor"]
        # The line the text status prints, word for word.
        assert _status.charge_text(worker["charge"]) in shown["text"]
        assert [m["modelId"] for m in shown["models"]] == [
            m["model_id"] for m in worker["models"]]
        for row, model in zip(shown["models"], worker["models"],
                              strict=True):
            assert int(row["loaded"]) == model["loaded"]
            assert int(row["size"]) == model["size"]
            assert row["source"] == model["source"]
            board = model["board"]
            if board is None:
                assert row["boardStatus"] == ""
            else:
                assert row["boardStatus"] == board["status"]
                assert row["boardLoaded"] == (
                    "" if board["loaded"] is None else str(board["loaded"]))


@pytest.mark.browser
def test_page_with_no_workers(browser):
    with scene(populated=False) as (server, picture):
        picture.host_model("SDXL-unet", 5 * GiB, loaded=3 * GiB)
        open_page(browser, server)
        page, data = read(browser), status_json(server)
    assert data["pool"]["workers"] == []
    assert page["noWorkers"] and page["workers"] == []
    assert not page["stale"]
    assert f"ComfyUI pid {data['pid']}" in page["connText"]
    (device,) = page["devices"]
    check_device(device, data)
    assert [s["kind"] for s in device["segments"]] == ["comfyui", "free"]


@pytest.mark.browser
def test_page_with_a_valid_board_then_a_dead_worker(browser, tmp_path):
    with scene() as (server, picture):
        open_page(browser, server,
                  'document.querySelectorAll(".worker").length === 2')
        page, data = read(browser), status_json(server)
        check_workers(page, data)
        (device,) = page["devices"]
        check_device(device, data)
        launched = data["pool"]["workers"][0]
        assert launched["worker"] == "pack-A"
        assert launched["launcher_pid"] == LAUNCHER_PID
        assert launched["pid"] == picture.board_workers[0].pid
        boarded = [m for w in page["workers"] for m in w["models"]
                   if m["boardStatus"]]
        assert [(m["modelId"], m["boardStatus"], m["boardLoaded"])
                for m in boarded] == [("unet-hunyuan3d", "valid",
                                       str(3 * GiB))]
        assert {s["kind"] for s in device["segments"]} == {
            "comfyui", "standin", "other", "free"}

        # A screenshot of this state: a PNG of the viewport's size.
        shot = tmp_path / "page.png"
        browser.screenshot(str(shot))
        head = shot.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", head[16:24]) == (1200, 900)

        # Worker B dies: the page says gone, its model reads 0.
        dead = picture.workers[1]
        dead.kill()
        picture.pool.worker_gone(dead)
        assert browser.wait_for(
            'document.querySelector(".worker[data-alive=\\"false\\"]")')
        page, data = read(browser), status_json(server)
        check_workers(page, data)
        check_device(page["devices"][0], data)
        (gone,) = [w for w in page["workers"] if w["alive"] == "false"]
        assert "gone" in gone["text"]
        assert [m["source"] for m in gone["models"]] == ["worker gone"]
        assert [m["loaded"] for m in gone["models"]] == ["0"]


@pytest.mark.browser
def test_a_small_model_is_seen(browser):
    """8 MiB on a 24 GiB card is a third of a pixel in proportion: its
    segment is drawn MIN_SEGMENT_PX wide and has a legend entry."""
    with scene(populated=False) as (server, picture):
        picture.host_model("SDXL-unet", 5 * GiB)
        picture.worker("pack-small", [("lora-tiny", 8 * MiB, 8 * MiB)])
        open_page(browser, server, 'document.querySelector(".worker")')
        page, data = read(browser), status_json(server)
    (device,) = page["devices"]
    check_device(device, data)
    (tiny,) = [s for s in device["segments"] if s["kind"] == "standin"]
    assert int(tiny["bytes"]) == 8 * MiB
    assert tiny["width"] >= MIN_SEGMENT_PX - 0.5
    (entry,) = [e for e in device["legend"] if e["kind"] == "standin"]
    assert entry["text"] == ("worker pack-small: lora-tiny (loaded per "
                             "census): 8 MiB")


@pytest.mark.browser
def test_page_says_when_the_server_is_gone(browser):
    with scene() as (server, _):
        open_page(browser, server)
        before = read(browser)
        server.stop()
        assert browser.wait_for(
            'document.getElementById("conn").dataset.state === "down"')
        page = read(browser)
    assert page["stale"]
    assert "not answering since" in page["connText"]
    assert "showing the data of" in page["connText"]
    # The last data stays, greyed, until the server is back.
    assert page["devices"] == before["devices"]


def test_a_stuck_status_answers_503_and_never_blocks_the_loop(monkeypatch):
    """The answer is built on its own thread: while it is stuck (a pool
    lock held by a long eviction), the page still loads and the status
    answers 503 after BUILD_TIMEOUT."""
    import threading

    release = threading.Event()
    real = _server_route.payload_json

    def stuck():
        release.wait(30)
        return real()

    monkeypatch.setattr(_server_route, "BUILD_TIMEOUT", 0.3)
    monkeypatch.setattr(_server_route, "payload_json", stuck)
    with scene(populated=False) as (server, _):
        try:
            code, _, body = get(server.url + _server_route.ROUTE)
            assert code == 503 and b"took over 0.3 s" in body
            assert get(server.url + _server_route.PAGE_ROUTE)[0] == 200
            # status --url says what the route said.
            code, out, err = run_cli("status", "--url", server.url)
            assert (code, out) == (1, "")
            assert err.endswith(": HTTP 503 Service Unavailable: the "
                                "status took over 0.3 s\n"), err
        finally:
            release.set()
        monkeypatch.setattr(_server_route, "payload_json", real)
        assert get(server.url + _server_route.ROUTE)[0] == 200


def test_a_non_finite_number_is_an_error_answer_not_bad_json(monkeypatch):
    """The route never sends a bare Infinity: 500 with {"error": ...}
    naming the field, which status --url shows."""
    real = _server_route.payload

    def with_infinity():
        answer = real()
        answer["reserve"]["extra_reserved_vram"] = float("inf")
        return answer

    monkeypatch.setattr(_server_route, "payload", with_infinity)
    with scene(populated=False) as (server, _):
        code, headers, body = get(server.url + _server_route.ROUTE)
        assert code == 500
        assert headers["Content-Type"].startswith("application/json")
        assert json.loads(body) == {"error": (
            "the status cannot be sent: reserve.extra_reserved_vram (inf) "
            "is not a finite number")}
        code, out, err = run_cli("status", "--url", server.url)
    assert (code, out) == (1, "")
    assert err.endswith("HTTP 500 Internal Server Error: the status cannot "
                        "be sent: reserve.extra_reserved_vram (inf) is not "
                        "a finite number\n"), err
