"""Text from outside, made safe for one log or terminal line.

A worker's error text, a census entry, a reply field, a file name read
from a shared folder: any of it may be huge, span lines, or carry
terminal escapes (a screen clear, an OSC 52 clipboard write, a bidi
override that reorders what a reader sees).  ``visible()`` turns such a
value into a bounded, single-line, printable string before it reaches a
log record, a status answer or a terminal.  ``json_text()`` is the one
way the package writes JSON: never a bare ``NaN`` or ``Infinity``.
"""

from __future__ import annotations

import json
import math
import reprlib
from typing import Any

__all__ = ["LOG_TEXT_LIMIT", "NotJSON", "json_text", "visible"]

#: Characters of outside text kept in one log line or status field.
LOG_TEXT_LIMIT = 200

_repr = reprlib.Repr()
_repr.maxstring = LOG_TEXT_LIMIT
_repr.maxother = LOG_TEXT_LIMIT
_repr.maxlevel = 3

#: Escapes for the control characters people recognise.
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _shown(text: str, budget: int, stop: int = -1) -> tuple[list[str], int]:
    """Escaped pieces of `text` filling at most `budget` characters, and
    how many characters of `text` they cover: from its start, or, with
    `stop` (an index), backwards from its end down to `stop`."""
    out: list[str] = []
    used = 0
    if stop < 0:
        indices: range = range(len(text))
    else:
        indices = range(len(text) - 1, stop - 1, -1)
    for i in indices:
        ch = text[i]
        piece = ch if ch.isprintable() else _escape(ch)
        if used + len(piece) > budget:
            break
        out.append(piece)
        used += len(piece)
    if stop >= 0:
        out.reverse()
    return out, len(out)


def visible(value: object, limit: int = LOG_TEXT_LIMIT, *,
            tail: int = 0) -> str:
    """`value` as at most `limit` printable characters on one line.

    A ``str`` is used as it is (no quotes); anything else through a
    bounded ``reprlib`` repr, so a huge container is not rendered whole.
    Every character ``str.isprintable()`` rejects (control characters,
    line and paragraph separators, bidi and other format characters, lone
    surrogates from undecodable file names) is shown as a Python escape
    (``\\x1b``, ``\\u202e``).  Longer text is cut, and the cut says how
    much went: ``...[+N chars]`` at the end, or, with `tail`, in the
    middle, keeping the last `tail` characters (a log line whose own
    words close it).  Never raises an ``Exception``: an object whose repr
    fails reads ``<TYPE instance at 0x...>``."""
    limit = max(1, int(limit))
    tail = max(0, min(int(tail), limit // 2))
    if isinstance(value, str):
        text = str.__str__(value)  # a subclass's own methods do not run
    else:
        try:
            text = _repr.repr(value)
        except Exception:  # noqa: BLE001 - a broken __repr__ is its own
            text = f"<unprintable {type(value).__name__}>"
        if not isinstance(text, str):
            text = f"<unprintable {type(value).__name__}>"
        text = str.__str__(text)
    head, covered = _shown(text, limit)
    if covered == len(text):
        return "".join(head)
    head, covered = _shown(text, limit - tail)
    end, end_covered = _shown(text, tail, stop=covered)
    cut = len(text) - covered - end_covered
    return "".join(head) + f"...[+{cut} chars]" + "".join(end)


class NotJSON(ValueError):
    """Data with a number JSON has no form for (NaN, an infinity)."""


def _non_finite(data: Any, where: str = "") -> str | None:
    """The path of the first non-finite float in `data`, else None."""
    stack = [(data, where)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return f"{path or 'the value'} ({value!r})"
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{visible(k, 40)}" if path
                          else visible(k, 40)) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def json_text(data: Any, **options: Any) -> str:
    """`data` as JSON (``json.dumps`` `options`; ``default=str``), or
    NotJSON naming where a non-finite number is: JSON has none, and a
    bare ``Infinity`` is not JSON to any other reader."""
    try:
        return json.dumps(data, allow_nan=False, default=str, **options)
    except ValueError:
        where = _non_finite(data)
        if where is None:
            raise
        raise NotJSON(f"{where} is not a finite number") from None
