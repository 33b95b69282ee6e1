"""The ``status --url`` client against whatever a server may say.

Hypothesis generates replies (the status shape with any field replaced by
any JSON value, arbitrary JSON, deep nesting, raw bytes, any status code
and content type, wrong lengths, truncated and chunked bodies, pauses and
drips past the deadline, oversized bodies) and a real HTTP server on
127.0.0.1 (tests/rawhttp.py) plays each one to the real client
(``comfy_standin.__main__.main``).  Whatever it is: exit 0 with readable
output, or exit 1 with one line on stderr; never a traceback, never the
"internal error" fallback; within the deadline; memory bounded by a small
multiple of the body cap.
"""

from __future__ import annotations

import io
import json
import sys
import time
import tracemalloc

import pytest
import rawhttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_status_url import good_answer

from comfy_standin import __main__ as cli
from comfy_standin import _status

TIMEOUT = 0.5  # the client's --timeout in these runs
SLACK = 3.0  # scheduling on a loaded CI machine, sanitizer builds

json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.text(alphabet=st.characters(max_codepoint=0x3000), max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.text(max_size=10), children, max_size=5),
    ),
    max_leaves=30,
)


def paths(value, prefix=()):
    """Every path to a value inside `value`."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths(item, prefix + (i,))


GOOD = good_answer()
GOOD_PATHS = [p for p in paths(GOOD) if p]


@st.composite
def mutated_answers(draw):
    """The status shape with one to three values replaced or removed."""
    answer = json.loads(json.dumps(GOOD))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(GOOD_PATHS))
        parent = answer
        try:
            for key in path[:-1]:
                parent = parent[key]
            if draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed the path
    return json.dumps(answer).encode()


@st.composite
def nested(draw):
    depth = draw(st.integers(1, 3000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    return b'{"pool":' + opener * depth + b"0" + closer * depth + b"}"


bodies = st.one_of(
    st.just(json.dumps(GOOD).encode()),
    mutated_answers(),
    json_values.map(lambda v: json.dumps(v).encode()),
    nested(),
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b'{"pool": NaN}', b"\xef\xbb\xbf{}",
                     json.dumps(GOOD).encode()[:100]]),
)

content_types = st.one_of(
    st.sampled_from(["application/json", "application/json; charset=utf-8",
                     "APPLICATION/JSON", "text/html", "text/plain",
                     "application/jsonx", None]),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e),
            max_size=30),
)
statuses = st.one_of(
    st.sampled_from(["200 OK"] * 6 + [
        "301 Moved Permanently", "302 Found", "307 Temporary Redirect",
        "404 Not Found", "500 Internal Server Error", "204 No Content"]),
    st.integers(100, 599).map(lambda code: f"{code} Whatever"),
)


@st.composite
def replies(draw):
    """(steps for the server, --json?)"""
    body = draw(bodies)
    framing = draw(st.sampled_from(
        ["exact", "exact", "none", "short", "long", "chunked",
         "bad chunked", "oversized", "declared oversized"]))
    length = None
    headers: tuple[str, ...] = ()
    if draw(st.booleans()):
        headers += ("Location: " + draw(st.text(
            alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xff),
            max_size=30)),)
    if framing == "none":
        length = -1
    elif framing == "short":
        length = max(0, len(body) - draw(st.integers(1, 50)))
    elif framing == "long":
        length = len(body) + draw(st.integers(1, 50))
    elif framing == "declared oversized":
        length = _status.MAX_BODY + draw(st.integers(1, 1 << 30))
    elif framing == "oversized":
        body = b" " * (_status.MAX_BODY + 1) + body
        length = draw(st.sampled_from([None, -1]))
    if framing in ("chunked", "bad chunked"):
        chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        if framing == "bad chunked":
            chunks = chunks[:draw(st.integers(0, len(chunks) - 1))]
        data = rawhttp.response(chunks, draw(statuses),
                                draw(content_types), length=-1,
                                headers=headers
                                + ("Transfer-Encoding: chunked",))
    else:
        data = rawhttp.response(body, draw(statuses), draw(content_types),
                                length=length, headers=headers)
    if draw(st.integers(0, 9)) == 0:
        data = draw(st.binary(max_size=300))  # not HTTP at all
    timing = draw(st.sampled_from(["whole"] * 6 + ["pieces", "late",
                                                   "drip"]))
    if timing == "whole":
        steps = [(0.0, data)]
    elif timing == "pieces":
        cut = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
        edges = [0, *cut, len(data)]
        steps = [(0.01, data[edges[i]:edges[i + 1]])
                 for i in range(len(edges) - 1)]
    elif timing == "late":  # the whole reply after the deadline
        steps = [(TIMEOUT + 0.2, data)]
    else:  # each byte in time, the whole not
        steps = rawhttp.drip(data[:40], TIMEOUT / 4) + [(0.0, data[40:])]
    return steps, draw(st.booleans())


@pytest.fixture(scope="module")
def server():
    with rawhttp.ScriptedServer() as running:
        yield running


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = cli.main(list(argv))
    finally:
        sys.stdout, sys.stderr = saved
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(reply=replies())
def test_any_reply_is_an_answer_or_one_line(server, reply):
    steps, as_json = reply
    server.reply = steps
    argv = ["status", "--url", server.url, "--timeout", str(TIMEOUT)]
    if as_json:
        argv.append("--json")
    tracemalloc.start()
    start = time.monotonic()
    try:
        code, out, err = run(*argv)
        elapsed = time.monotonic() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The documented deadline (--timeout), a contract rather than a speed:
    # a client without one stays as long as a slow reply lasts (minutes).
    assert elapsed < TIMEOUT + SLACK, elapsed
    assert peak < 12 * _status.MAX_BODY, peak
    assert "Traceback" not in err and "internal error" not in err, err
    if code == cli.EXIT_OK:
        assert err == "" and out
        if as_json:
            json.loads(out)
        else:
            assert all(ch == "\n" or ch.isprintable() for ch in out), out
            assert out.startswith("ComfyUI at ")
    else:
        assert code == cli.EXIT_FAILED, (code, err)
        assert out == ""
        assert err.startswith("status: ") and err.count("\n") == 1, err
        assert err[:-1].isprintable(), err
