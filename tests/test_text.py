"""``comfy_standin._text.visible``: outside text made safe for one line."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from comfy_standin._text import LOG_TEXT_LIMIT, visible

SUFFIX = re.compile(r"\.\.\.\[\+\d+ chars\]\Z")


@given(st.text(), st.integers(min_value=1, max_value=300))
def test_any_text_becomes_one_bounded_printable_line(text, limit):
    shown = visible(text, limit)
    assert shown.isprintable()
    body = SUFFIX.sub("", shown)
    assert len(body) <= limit
    if all(ch.isprintable() for ch in text) and len(text) <= limit:
        assert shown == text  # nothing to make safe: unchanged
    shown.encode("utf-8")  # lone surrogates were escaped


def test_terminal_escapes_are_shown_not_sent():
    assert visible("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert visible("\x1b]52;c;cHduZWQ=\x07") == "\\x1b]52;c;cHduZWQ=\\x07"
    assert visible("x\ny\r\tz") == "x\\ny\\r\\tz"
    assert visible("\u202eevil") == "\\u202eevil"  # bidi override
    assert visible("a\u2028b") == "a\\u2028b"  # line separator
    assert visible("bad\udcffname") == "bad\\udcffname"
    assert visible("\U000e0001") == "\\U000e0001"


def test_long_text_is_cut_and_says_how_much():
    shown = visible("x" * (1 << 20))
    assert shown == "x" * LOG_TEXT_LIMIT + f"...[+{(1 << 20) - 200} chars]"
    assert visible("\x00" * 10, 8) == "\\x00\\x00...[+8 chars]"


def test_other_objects_through_a_bounded_repr():
    assert visible(5) == "5"
    assert len(visible(list(range(10**6)))) < 100  # not rendered whole
    assert visible(b"\x1b") == "b'\\x1b'"

    class Broken:
        def __repr__(self):
            raise RuntimeError("no")

    assert visible(Broken()).startswith("<Broken instance at 0x")


def test_a_str_subclass_runs_none_of_its_code():
    class Loud(str):
        def __str__(self):
            raise AssertionError("ran")

        def __iter__(self):
            raise AssertionError("ran")

    assert visible(Loud("ok\n")) == "ok\\n"


def test_tail_keeps_the_end_of_a_line():
    line = "comfy_standin: worker w failed (" + "y" * 5000 + "); receipts only"
    shown = visible(line, 100, tail=20)
    assert shown.startswith("comfy_standin: worker w failed (yyy")
    assert shown.endswith("yyyy); receipts only")
    assert "...[+" in shown and shown.isprintable()
    assert visible("short", 100, tail=20) == "short"


@given(st.text(), st.integers(min_value=1, max_value=300),
       st.integers(min_value=0, max_value=300))
def test_tail_is_bounded_too(text, limit, tail):
    shown = visible(text, limit, tail=tail)
    assert shown.isprintable()
    assert len(re.sub(r"\.\.\.\[\+\d+ chars\]", "", shown, count=1)) <= limit
