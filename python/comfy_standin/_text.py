"""Text from outside, made safe for one log or terminal line.

A worker's error text, a census entry, a reply field, a file name read
from a shared folder: any of it may be huge, span lines, or carry
terminal escapes (a screen clear, an OSC 52 clipboard write, a bidi
override that reorders what a reader sees).  ``visible()`` turns such a
value into a bounded, single-line, printable string before it reaches a
log record, a status answer or a terminal.
"""

from __future__ import annotations

import reprlib

__all__ = ["LOG_TEXT_LIMIT", "visible"]

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


def visible(value: object, limit: int = LOG_TEXT_LIMIT) -> str:
    """`value` as at most `limit` printable characters on one line.

    A ``str`` is used as it is (no quotes); anything else through a
    bounded ``reprlib`` repr, so a huge container is not rendered whole.
    Every character ``str.isprintable()`` rejects (control characters,
    line and paragraph separators, bidi and other format characters, lone
    surrogates from undecodable file names) is shown as a Python escape
    (``\\x1b``, ``\\u202e``).  Longer text is cut and ends with
    ``...[+N chars]``.  Never raises an ``Exception``: an object whose
    repr fails reads ``<TYPE instance at 0x...>``."""
    limit = max(1, int(limit))
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
    out: list[str] = []
    used = 0
    for index, ch in enumerate(text):
        piece = ch if ch.isprintable() else _escape(ch)
        if used + len(piece) > limit:
            return "".join(out) + f"...[+{len(text) - index} chars]"
        out.append(piece)
        used += len(piece)
    return "".join(out)
