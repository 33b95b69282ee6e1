"""``status --url``: a running ComfyUI's status over HTTP.

A real HTTP server on 127.0.0.1 (http.server, in a thread) answers
GET /comfy_standin/status with the route's own payload function, as the
node entry makes ComfyUI's server do.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import socket
import sys
import threading

import fakes
import pytest

import comfy_standin as cs
from comfy_standin import __main__ as cli
from comfy_standin import _server_route, _status

GiB = 1 << 30


@contextlib.contextmanager
def serving(answer):
    """An HTTP server on 127.0.0.1; `answer(path)` -> (code, bytes)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            code, body = answer(self.path)
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def comfyui_route(path):
    if path == _server_route.ROUTE:
        return 200, _server_route.payload_json()
    return 404, b"{}"


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = cli.main(list(argv))
    finally:
        sys.stdout, sys.stderr = old
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def registered(mm):
    """A stand-in registered in the default pool (what comfy-env uses)."""
    pool = cs.default_pool()
    worker = fakes.FakeWorker("remote-w")
    worker.add_model("unet-x", 2 * GiB, resident=2 * GiB)
    s = cs.StandIn(worker, 1, "unet-x", 2 * GiB, "cuda:0", "cpu",
                   kind="unet")
    cs.apply_residency({"unet-x": s}, worker.census())
    cs.register(mm, s)
    yield s
    worker.kill()
    pool.boundary(mm)


def test_status_url_prints_a_running_comfyui(registered):
    with serving(comfyui_route) as url:
        code, out, err = run("status", "--url", url)
    assert code == 0, err
    assert f"ComfyUI at {url}: pid {os.getpid()}" in out
    assert "unet-x" in out and "2.00 GiB of 2.00 GiB" in out
    assert "source census" in out
    assert "GPU probe" in out


def test_status_url_json(registered):
    with serving(comfyui_route) as url:
        code, out, _ = run("status", "--url", url, "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) >= {"pool", "reserve", "probe", "adapter_installed"}
    models = [m for w in data["pool"]["workers"] for m in w["models"]]
    assert any(m["model_id"] == "unet-x" and m["loaded"] == 2 * GiB
               for m in models)
    assert data["pool"]["held"] >= 1
    assert data["reserve"]["extra_reserved_vram"] == 400 * (1 << 20)


def test_the_payload_serves_no_environment(registered, monkeypatch):
    monkeypatch.setenv("COMFY_ENV_IPC_AUTHKEY", "s3cr3t-sentinel-key")
    body = _server_route.payload_json().decode()
    assert "s3cr3t-sentinel-key" not in body


def test_a_comfyui_without_the_entry_says_so():
    with serving(lambda path: (404, b"404: Not Found")) as url:
        code, out, err = run("status", "--url", url)
    assert code == cli.EXIT_FAILED and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "install-node" in err


def test_nothing_answering_is_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = run("status", "--url", f"http://127.0.0.1:{port}")
    assert code == cli.EXIT_FAILED and out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("status: nothing answers at")


def test_not_a_status_answer():
    with serving(lambda path: (200, b'"hello"')) as url:
        code, _, err = run("status", "--url", url)
    assert code == cli.EXIT_FAILED
    assert "not a comfy_standin status answer" in err


def test_url_without_value_is_comfyuis_address():
    args = cli.build_parser().parse_args(["status", "--url"])
    assert args.url == _status.DEFAULT_URL == "http://127.0.0.1:8188"


def test_watch_prints_until_interrupted(registered, monkeypatch):
    import threading
    import time

    sleeps = []
    real_sleep = time.sleep

    def sleep(seconds):
        # Only the command's own waits (the main thread); the test server
        # and library threads sleep as usual.
        if threading.current_thread() is not threading.main_thread():
            return real_sleep(seconds)
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", sleep)
    with serving(comfyui_route) as url:
        code, out, _ = run("status", "--url", url, "--watch", "0.5")
    assert code == 0
    assert sleeps == [0.5, 0.5]
    assert out.count("ComfyUI at") == 2


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "inf"])
def test_watch_needs_positive_seconds(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["status", "--watch", bad])
    assert exc.value.code == 2
