"""What the comfy-env adapter checks in comfy-env before it touches it.

One ``Hook`` per name of comfy-env the adapter replaces, wraps or reads
(the table is ``HOOKS`` in integrations/comfy_env.py); ``mismatch()``
says why one does not hold in the comfy-env that is installed.  Nothing
here changes comfy-env or calls into it: it reads signatures, class
attributes and code objects only.
"""

from __future__ import annotations

import dis
import importlib
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Hook", "assigned", "defined", "mismatch", "resolve", "signature",
           "where"]


class Hook(NamedTuple):
    """One name of comfy-env and what is checked about it."""

    #: "package.module", or "package.module:Class" for a class attribute.
    target: str
    name: str
    #: "(a, b=1)": a callable (not abstract) of that signature,
    #: annotations aside (a class: its constructor's); "dict": a dict;
    #: "class": a class; "present": any value.
    shape: str
    #: original -> what install() puts in its place; None: only read.
    wrap: Callable[[Any], Any] | None = None
    #: Needed by the live board only: a mismatch turns boards off and
    #: leaves the stand-ins on receipts; any other refuses the install.
    board: bool = False
    #: The adapter reads these: of a class, attributes its instances
    #: have (class attributes, or set by one of its functions); of a
    #: function, its local variables (read by a frame walk).
    reads: tuple[str, ...] = ()
    #: Of a class: every attribute it defines is one of these (a new one
    #: may be read off the objects comfy_standin puts in its place).
    only: frozenset[str] | None = None


def where(hook: Hook) -> str:
    """`hook`'s name as a log line gives it: "pool._insert_loaded_model",
    "subprocess.SubprocessWorker.shutdown"."""
    module, _, cls = hook.target.partition(":")
    parts = [module.rpartition(".")[2], *([cls] if cls else []), hook.name]
    return ".".join(parts)


def resolve(target: str) -> Any:
    """The module, or the class, `target` names (importing the module)."""
    module, _, cls = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


def signature(obj: Any) -> str:
    """`obj`'s signature without annotations: "(p, resident, seq=None)"."""
    sig = inspect.signature(obj)
    plain = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=plain,
                           return_annotation=sig.empty))


def _stored(function: Any) -> set[str]:
    """The attribute names `function`'s own code assigns (``x.name =``)."""
    if not inspect.isfunction(function):
        return set()
    return {i.argval for i in dis.get_instructions(function)
            if i.opname == "STORE_ATTR"}


def defined(cls: type) -> set[str]:
    """What instances of `cls` have: its attributes (inherited ones too,
    but no dunders) and what the ``__init__`` of it and of its bases
    assign."""
    names = {n for n in dir(cls) if not (n.startswith("__")
                                         and n.endswith("__"))}
    for base in cls.__mro__:
        names |= _stored(vars(base).get("__init__"))
    return names


def assigned(cls: type) -> set[str]:
    """What instances of `cls` may have: ``defined(cls)`` and what any
    function of it or of its bases assigns (comfy-env 0.4.40 sets
    ``_last_vram_report`` on its first frame, not in ``__init__``; the
    adapter reads such names with a default)."""
    names = defined(cls)
    for base in cls.__mro__:
        for value in vars(base).values():
            names |= _stored(getattr(value, "__func__", value))
    return names


def mismatch(hook: Hook) -> str | None:
    """Why `hook` does not hold in the installed comfy-env, or None."""
    try:
        owner = resolve(hook.target)
    except ImportError as exc:
        return f"cannot import {hook.target.partition(':')[0]} ({exc})"
    except AttributeError:
        return f"has no {hook.target.partition(':')[2]}"
    if not hasattr(owner, hook.name):
        return "is missing"
    value = getattr(owner, hook.name)
    if hook.shape == "dict":
        if not isinstance(value, dict):
            return f"is a {type(value).__name__}, not a dict"
    elif hook.shape == "class":
        if not isinstance(value, type):
            return f"is a {type(value).__name__}, not a class"
    elif hook.shape != "present":
        if not callable(value):
            return f"is a {type(value).__name__}, not callable"
        if getattr(value, "__isabstractmethod__", False):
            return "is abstract"
        try:
            found = signature(value)
        except (TypeError, ValueError) as exc:
            return f"has no signature to check ({exc})"
        if found != hook.shape:
            return f"is {found}, not {hook.shape}"
    if hook.reads:
        if isinstance(value, type):
            have = assigned(value)
            what = "instances have no"
        else:
            code = getattr(value, "__code__", None)
            have = set(code.co_varnames + code.co_cellvars) if code else set()
            what = "has no local"
        missing = [n for n in hook.reads if n not in have]
        if missing:
            return f"{what} {', '.join(missing)}"
    if hook.only is not None and isinstance(value, type):
        extra = sorted(defined(value) - hook.only)
        if extra:
            return f"has {', '.join(extra)}, which was never checked"
    return None
