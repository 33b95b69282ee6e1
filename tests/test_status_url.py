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
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import fakes
import pytest
import rawhttp

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
    sleeps = []
    real_sleep = time.sleep

    def sleep(seconds):
        # Only the command's own waits (the main thread); the test server
        # and library threads sleep as usual.
        if threading.current_thread() is not threading.main_thread():
            return real_sleep(seconds)
        sleeps.append(seconds)
        if len(sleeps) >= 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", sleep)
    with serving(comfyui_route) as url:
        code, out, err = run("status", "--url", url, "--watch", "0.5")
    assert code == cli.EXIT_INTERRUPTED
    assert err.endswith("interrupted; cleaned up\n")
    assert sleeps == [0.5, 0.5]
    assert out.count("ComfyUI at") == 2


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "inf"])
def test_watch_needs_positive_seconds(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["status", "--watch", bad])
    assert exc.value.code == 2


# ---------------------------------------------------------------------------
# a hostile or broken server: one line on stderr, exit 1, within the
# deadline, whatever answers (tests/rawhttp.py plays each reply)


def good_answer():
    """A well-formed status answer with one worker, one model, a board."""
    return json.loads(_server_route.payload_json()) | {
        "pool": {
            "implementation": "c", "floor": 300 << 20,
            "process_local": False, "graveyard": 0, "held": 1,
            "workers": [{
                "worker": "pack", "pid": 4242, "launcher_pid": 4241,
                "generation": 1, "alive": True, "in_flight": 0, "unlisted": 0,
                "charge": {"charge": GiB + (300 << 20), "sum_sizes": 2 * GiB,
                           "sum_loaded": GiB, "sum_peak": GiB, "held": GiB,
                           "reading": 0, "floor": 300 << 20,
                           "in_flight": 0, "models": 1, "alive": True,
                           "held_from_reading": False},
                "models": [{
                    "model_id": "unet-x", "kind": "unet", "size": 2 * GiB,
                    "generation": 1, "load_device": "cuda:0",
                    "loaded": GiB, "seq": 3,
                    "age_seconds": 0.5, "source": "census",
                    "stale": False, "eviction_deferred": False,
                    "bad_replies": 0,
                    "board": {"name": "memfd:csb-1", "slot": 0,
                              "status": "valid", "loaded": GiB},
                }],
            }],
            "boards": [{"name": "memfd:csb-1", "slots": 4,
                        "generation": 1, "owner_pid": 4242,
                        "expected_owner": 4242, "attached": True,
                        "worker_gone": False,
                        "closed": False, "models": ["unet-x"]}],
        },
    }


def one_line_failure(code, out, err):
    assert code == cli.EXIT_FAILED, (code, out, err)
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("status: ")
    assert "Traceback" not in err and "internal error" not in err


def test_the_good_answer_renders():
    with rawhttp.ScriptedServer() as server:
        server.reply = [(0, rawhttp.json_response(good_answer()))]
        code, out, err = run("status", "--url", server.url)
    assert code == 0, err
    assert "unet-x" in out and "board memfd:csb-1 slot 0: valid" in out


@pytest.mark.parametrize("mutate, field", [
    (lambda a: a.update(pool={}), "answer.pool.implementation is missing"),
    (lambda a: a["pool"].update(workers="w"), "answer.pool.workers"),
    (lambda a: a["pool"].update(floor="300"), "answer.pool.floor"),
    (lambda a: a.update(reserve=[]), "answer.reserve"),
    (lambda a: a["probe"].update(devices=[1, 2]), "answer.probe.devices[0]"),
    (lambda a: a["pool"]["workers"][0].update(charge=None),
     "answer.pool.workers[0].charge"),
    (lambda a: a["pool"]["workers"][0]["models"][0].update(size=10 ** 30),
     "answer.pool.workers[0].models[0].size"),
    (lambda a: a["pool"]["workers"][0]["models"][0].update(board=[]),
     "answer.pool.workers[0].models[0].board"),
    (lambda a: a["pool"]["boards"][0].update(models=[7]),
     "answer.pool.boards[0].models[0]"),
])
def test_a_wrong_shape_is_one_line(mutate, field):
    answer = good_answer()
    mutate(answer)
    with rawhttp.ScriptedServer() as server:
        server.reply = [(0, rawhttp.json_response(answer))]
        code, out, err = run("status", "--url", server.url)
    one_line_failure(code, out, err)
    assert "not a comfy_standin status answer" in err and field in err


@pytest.mark.parametrize("body, says", [
    (b"[" * 40_000 + b"]" * 40_000, "nested too deeply"),
    (b'{"pool": ' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than 32"),
    (b"not json", "not JSON"),
    (b'{"pool": NaN}', "not JSON"),
    (b"\xff\xfe\x00", "not JSON"),
])
def test_bad_json_is_one_line(body, says):
    with rawhttp.ScriptedServer() as server:
        server.reply = [(0, rawhttp.response(body))]
        code, out, err = run("status", "--url", server.url)
    one_line_failure(code, out, err)
    assert says in err


@pytest.mark.parametrize("url, says", [
    ("http://HOST:PORT", "the port 'PORT' is not a number; expected "
                         "http://HOST[:PORT][/PATH] (PORT defaults to 8188)"),
    ("http://127.0.0.1:99999", "the port 99999 is not one of 1 to 65535"),
    ("http://", "names no host"),
    ("ftp://127.0.0.1/", "only http:// and https://"),
    ("http://127.0.0.1:8188/\x1b[2J", "not a URL"),
    ("http://user:pw@127.0.0.1:1", "credentials"),
    ("http://[::1", "an IPv6 address needs both brackets"),
])
def test_an_invalid_url_is_one_line(url, says):
    code, out, err = run("status", "--url", url)
    one_line_failure(code, out, err)
    assert says in err and "\x1b" not in err


@pytest.mark.parametrize("reply, says", [
    (rawhttp.response(b"", "302 Found", headers=("Location: http://x/",)),
     "a redirect to http://x/ (not followed"),
    (rawhttp.response(b"", "301 Moved", headers=("Location: \x1b]52;c;",)),
     "a redirect to \\x1b]52;c;"),
    (rawhttp.response(b"{}", content_type="text/html"),
     "the answer is text/html, not application/json"),
    (rawhttp.response(b"{}", content_type=None), "the answer is untyped"),
    (rawhttp.response(b"{}", "500 Internal Server Error"), "HTTP 500"),
    (rawhttp.response(b'{"pool": {}}', length=100), "cut short"),
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n10\r\n{\"po", "cut short"),
    (b"garbage\r\n\r\n", "nothing answers"),
    (b"", "nothing answers"),
])
def test_a_bad_reply_is_one_line(reply, says):
    with rawhttp.ScriptedServer([(0, reply)]) as server:
        code, out, err = run("status", "--url", server.url)
    one_line_failure(code, out, err)
    assert says in err, err


def test_a_dripping_server_cannot_hold_the_client():
    """One deadline for the whole request: a byte every 0.3 s keeps each
    read alive, but not the request."""
    body = json.dumps(good_answer()).encode()
    steps = rawhttp.drip(rawhttp.response(body), 0.3)
    with rawhttp.ScriptedServer(steps) as server:
        code, out, err = run("status", "--url", server.url,
                             "--timeout", "1")
        # The server sees the hang-up at its next byte.
        for _ in range(100):
            if server.hung_up_after:
                break
            time.sleep(0.1)
    one_line_failure(code, out, err)
    assert "within 1 s" in err
    # The client closed the request while the server was still dripping
    # (with a deadline per read it would have read all of it, 450 s).
    assert len(server.hung_up_after) == 1, server.hung_up_after
    assert server.hung_up_after[0] < len(steps) // 10, server.hung_up_after


def test_each_watch_round_has_the_deadline(monkeypatch):
    rounds = []
    real_sleep = time.sleep

    def sleep(seconds):
        # Only the command's own waits (the main thread); threads other
        # tests left behind sleep as usual.
        if threading.current_thread() is not threading.main_thread():
            return real_sleep(seconds)
        rounds.append(seconds)
        if len(rounds) >= 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", sleep)
    reply = [(0, b"HTTP/1.1 200 OK\r\n")] + rawhttp.drip(b"X: y\r\n" * 40,
                                                          0.1)
    with rawhttp.ScriptedServer(reply) as server:
        code, out, err = run("status", "--url", server.url, "--timeout",
                             "0.5", "--watch", "0.1")
    assert code == cli.EXIT_INTERRUPTED
    # Each round ended at its own deadline (the headers drip for 4 s).
    assert err.count("no answer within 0.5 s") == 2, err


def test_an_oversized_answer_is_refused_unread():
    """A declared length over the cap is refused before any body is
    read; an undeclared one is read in pieces and refused at the cap."""
    big = _status.MAX_BODY + 1
    with rawhttp.ScriptedServer([(0, rawhttp.response(b"", length=big))]) \
            as server:
        code, out, err = run("status", "--url", server.url)
    one_line_failure(code, out, err)
    assert f"the answer is {big} bytes, more than the 4 MiB" in err

    body = b" " * (_status.MAX_BODY + (1 << 20))
    with rawhttp.ScriptedServer(
            [(0, rawhttp.response(body, length=-1))]) as server:
        tracemalloc.start()
        try:
            code, out, err = run("status", "--url", server.url)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    one_line_failure(code, out, err)
    assert "more than the 4 MiB this client reads" in err
    assert peak < 2 * _status.MAX_BODY, peak


HOSTILE = "\x1b[2J\x1b]52;c;ZWNobyBoaQ==\x07\u202e\x9b31m"


def test_control_characters_are_shown_not_obeyed():
    answer = good_answer()
    worker = answer["pool"]["workers"][0]
    worker["worker"] = "w" + HOSTILE
    worker["models"][0]["model_id"] = "m" + HOSTILE
    worker["models"][0]["board"]["name"] = "b" + HOSTILE
    answer["pool"]["boards"][0]["models"] = ["m" + HOSTILE]
    answer["comfy_standin"] = "v" + HOSTILE
    answer["probe"]["cuda"]["error"] = "e" + HOSTILE
    with rawhttp.ScriptedServer([(0, rawhttp.json_response(answer))]) \
            as server:
        code, out, err = run("status", "--url", server.url)
        assert code == 0, err
        for bad in ("\x1b", "\x07", "\u202e", "\x9b"):
            assert bad not in out
        assert "w\\x1b[2J\\x1b]52;c;ZWNobyBoaQ==\\x07\\u202e\\x9b31m" in out
        assert "m\\x1b[2J" in out and "b\\x1b[2J" in out
        assert "v\\x1b[2J" in out and "e\\x1b[2J" in out
        # --json stays valid JSON with the text unchanged inside it.
        code, out, err = run("status", "--url", server.url, "--json")
    assert code == 0, err
    assert "\x1b" not in out and "\u202e" not in out
    assert json.loads(out)["pool"]["workers"][0]["worker"] == "w" + HOSTILE


def test_local_status_shows_control_characters_too(impl):
    pool = impl.Pool(process_local=False)
    s = impl.StandIn(worker=fakes.FakeWorker("w" + HOSTILE),
                     worker_generation=1, model_id="m" + HOSTILE,
                     model_size=GiB, load_device="cuda:0",
                     offload_device="cpu", kind="k" + HOSTILE, pool=pool)
    text = _status.render(_status.collect(pool), probe=False)
    assert "\x1b" not in text and "m\\x1b[2J" in text and "k\\x1b" in text
    del s


def test_a_long_text_is_cut():
    assert _status.visible("x" * 1000) == (
        "x" * _status.LOG_TEXT_LIMIT + "...[+800 chars]")


def test_watch_ends_with_130_on_ctrl_c():
    """docs/cli.md: Ctrl-C ends any command with 130, a watch too."""
    with rawhttp.ScriptedServer() as server:
        server.reply = [(0, rawhttp.json_response(good_answer()))]
        proc = subprocess.Popen(
            [sys.executable, "-m", "comfy_standin", "status", "--url",
             server.url, "--watch", "30"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().startswith("ComfyUI at")
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().endswith("interrupted; cleaned up")
    assert "Traceback" not in err


def test_many_small_objects_are_refused_before_parsing():
    """4 MiB of ``[{},{},...]`` would parse into ~190 MiB of dicts: the
    number of lists and objects is capped before json.loads."""
    body = b"[" + b"{}," * ((_status.MAX_BODY - 2) // 3) + b"{}]"
    assert len(body) <= _status.MAX_BODY
    with rawhttp.ScriptedServer(
            [(0, rawhttp.response(body))]) as server:
        tracemalloc.start()
        try:
            code, out, err = run("status", "--url", server.url)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    one_line_failure(code, out, err)
    assert "more than 50000 lists and objects" in err
    assert peak < 4 * _status.MAX_BODY, peak


def test_open_prints_the_page_address_without_a_display(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    code, out, err = run("status", "--url", "http://127.0.0.1:8188/x/",
                         "--open")
    assert (code, out, err) == (0, "http://127.0.0.1:8188/x/comfy_standin/\n",
                                "")
    code, out, _ = run("status", "--url", "--open", "--json")
    assert json.loads(out) == {
        "page": "http://127.0.0.1:8188/comfy_standin/", "opened": False}
    code, out, err = run("status", "--url", "http://HOST:PORT", "--open")
    one_line_failure(code, out, err)


def test_open_opens_a_browser_where_there_is_a_display(tmp_path):
    """With a display, webbrowser opens the page ($BROWSER names the
    program, as webbrowser documents)."""
    opened = tmp_path / "opened"
    fake = tmp_path / "fake-browser"
    fake.write_text(f"#!/bin/sh\necho \"$1\" > {opened}\n")
    fake.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "comfy_standin", "status", "--url",
         "http://127.0.0.1:1", "--open"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "DISPLAY": ":99", "BROWSER": str(fake)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "http://127.0.0.1:1/comfy_standin/\n"
    assert opened.read_text() == "http://127.0.0.1:1/comfy_standin/\n"


def test_open_needs_url():
    with pytest.raises(SystemExit) as exc:
        run("status", "--open")
    assert exc.value.code == cli.EXIT_USAGE


def test_status_survives_a_worker_whose_repr_raises_or_runs_long(impl):
    """The worker object is the adapter's (or a pack's) code: a repr that
    raises, or is a megabyte long, or a pid property that raises, must
    not take status (or the route) down."""
    class Odd(fakes.FakeWorker):
        def __init__(self, name, text):
            super().__init__(name)
            self.name = None  # no name: named by its repr
            self.text = text

        def __repr__(self):
            if self.text is None:
                raise RuntimeError("repr refused")
            return self.text

        @property
        def pid(self):
            raise RuntimeError("no pid")

    class NameRaises(Odd):
        @property
        def name(self):
            raise RuntimeError("no name")

        @name.setter
        def name(self, value):
            pass

    class Named(Odd):
        def __init__(self, name, text):
            super().__init__(name, text)
            self.name = name

    pool = impl.Pool(process_local=False)
    workers = [Odd("w0", None), Odd("w1", "x" * (1 << 20)),
               NameRaises("w2", "by-repr"), Named("p" * 1000, "r")]
    kept = [impl.StandIn(worker=w, worker_generation=1,
                         model_id="m", model_size=GiB, load_device="cuda:0",
                         offload_device="cpu", pool=pool)
            for w in workers]
    data = _status.collect(pool)
    names = sorted(w["worker"] for w in data["workers"])
    assert names == ["<Odd object; its repr raised RuntimeError>",
                     "by-repr", "p" * _status.LOG_TEXT_LIMIT,
                     "x" * _status.LOG_TEXT_LIMIT]
    assert [w["pid"] for w in data["workers"]] == [None] * 4
    assert "repr raised" in _status.render(data, probe=False)
    del kept


def test_a_no_break_space_in_an_error_is_shown():
    """Found by the property harness: a status line of one U+00A0 came
    back raw in the error line (a separator Python calls unprintable)."""
    with rawhttp.ScriptedServer([(0, b"\xa0")]) as server:
        code, out, err = run("status", "--url", server.url)
    one_line_failure(code, out, err)
    assert "\\xa0" in err and err[:-1].isprintable()


def test_a_library_override_is_shown_not_obeyed(monkeypatch):
    monkeypatch.setenv("COMFY_STANDIN_LIBCUDA", "/x\x1b[2J.so")
    text = _status.render_probe(
        {"cuda": {"loaded": False, "error": "cannot open shared object"}})
    assert "\x1b" not in text
    assert "[COMFY_STANDIN_LIBCUDA=/x\\x1b[2J.so]" in text


@pytest.mark.parametrize("given, port", [
    ("127.0.0.1", 8188), ("http://127.0.0.1", 8188),
    ("http://127.0.0.1/comfy/", 8188), ("localhost:9000", 9000),
    ("http://[::1]", 8188), ("http://127.0.0.1:80", 80),
    ("https://comfy.example/", 443), ("https://comfy.example:8188", 8188),
])
def test_a_url_without_a_port_is_comfyuis_port(given, port):
    """ComfyUI listens on 8188 unless told otherwise: a host, a
    host:port, or a URL without a port means 8188 (https: a proxy, 443);
    an explicit port is kept.  The address shown says which."""
    remote = _status.Remote(given)
    assert remote.port == port
    assert f":{port}" in remote.base


def test_a_host_alone_reaches_the_server():
    """``status --url 127.0.0.1:PORT`` (no scheme) reads the server."""
    with rawhttp.ScriptedServer() as server:
        server.reply = [(0, rawhttp.json_response(good_answer()))]
        host_port = server.url.split("://", 1)[1]
        code, out, err = run("status", "--url", host_port)
    assert code == 0, err
    assert out.startswith(f"ComfyUI at http://{host_port}: pid ")


def test_an_error_answer_says_what_the_route_said():
    """The route's own {"error": ...} (a 503 while the pool is busy)
    is in the line; anything else in an error answer is not read."""
    body = json.dumps({"error": "the status took over 5 s"}).encode()
    with rawhttp.ScriptedServer([(0, rawhttp.response(
            body, "503 Service Unavailable"))]) as server:
        code, out, err = run("status", "--url", server.url)
    one_line_failure(code, out, err)
    assert err.endswith(": HTTP 503 Service Unavailable: the status took "
                        "over 5 s\n"), err
    for odd in (b'{"error": 5}', b"[1]", b"{", b'{"error": "\x1b[2J"}'):
        with rawhttp.ScriptedServer([(0, rawhttp.response(
                odd, "500 Internal Server Error"))]) as server:
            code, out, err = run("status", "--url", server.url)
        one_line_failure(code, out, err)
        assert "\x1b" not in err


def test_json_never_passes_on_an_infinity():
    """1e999 in a field the client does not check parses to an infinity;
    --json would print a bare Infinity, which is not JSON: refused."""
    text = json.dumps(good_answer())
    body = text.replace('"elapsed_ns": ', '"future_field": 1e999, '
                        '"elapsed_ns": ')
    assert body != text
    with rawhttp.ScriptedServer([(0, rawhttp.response(body.encode()))]) \
            as server:
        code, out, err = run("status", "--url", server.url, "--json")
    one_line_failure(code, out, err)
    assert "not JSON (1e999 is not a finite number)" in err
