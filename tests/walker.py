"""What a memory profiler's or leak hunter's ``gc.callbacks`` hook does:
walk ``gc.get_objects()`` and use what it finds.  On CPython 3.10 and 3.11
a collection, so such a hook, can run inside any allocation of a tracked
object, so it meets every object of the C module the collector can reach
in whatever state its constructor left it at that allocation; none may
crash it (tests/test_gc.py, and ``--stress=walker`` in tests/stress.py).

``touch(obj)`` reads every public attribute of an object of one of the C
module's types and calls every public method that changes nothing
(``READS``, with its arguments), swallowing ``Exception`` only.  A method
that changes state is listed in ``MUTATORS`` and left alone: the hook runs
in the middle of the tests' own work.  ``unclassified()`` names a method
that is in neither, so a new one is walked or excluded on purpose.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

from comfy_standin import _core

TYPES: tuple[type, ...] = (
    _core.StandIn, _core.CloneBaseSentinel,
    _core.WorkerBooks, _core.Ledger, _core.ModelRecord, _core.Board,
)

#: Methods that change nothing, with the arguments they are called with
#: (None: the object itself, where a method takes one of its kind).
READS: dict[str, dict[str, tuple[Any, ...]]] = {
    "StandIn": {
        "model_size": (), "loaded_size": (), "current_loaded_device": (),
        "is_dynamic": (), "is_clone": (None,), "model_dtype": (),
        "model_patches_to": ("cpu",), "model_patches_models": (),
        "get_nested_additional_models": (), "lowvram_patch_counter": (),
        "receipt": (), "clone": (), "add_patches": ({},),
        "add_hook_patches": ({},),
    },
    "WorkerBooks": {"charge": (), "standins": (), "find": ("m",)},
    "Ledger": {"keys": (), "books": (), "total_charge": (), "find": (None,),
               "reread_boards": ()},
    "ModelRecord": {"read": ()},
    "Board": {"assigned_size": (0,), "find": ("m",), "read": (0,),
              "status": (0,), "tag": (0,)},
}

#: Methods that change what the tests look at (or make boards): not called.
MUTATORS: dict[str, frozenset[str]] = {
    "StandIn": frozenset({"partially_load", "partially_unload", "detach",
                          "attach_board", "detach_board", "_worker_gone"}),
    "WorkerBooks": frozenset({"register", "bump", "gone", "begin_call",
                              "end_call", "set_report", "set_reading",
                              "apply_census"}),
    "Ledger": frozenset({"worker", "forget", "reserve"}),
    "Board": frozenset({"add_sampler", "adopt", "assign", "bind", "close",
                        "create", "heartbeat", "make", "open", "poll_owner",
                        "publish", "release", "remove_sampler", "unlink",
                        "worker_gone"}),
}


#: Attributes that make an object on their first read: read only once
#: made, so the walker changes nothing a test looks at (the object made,
#: when found, is walked in its own right).  ``model`` makes nothing: it
#: is the stand-in itself.
LAZY: dict[str, tuple[str, type]] = {
    "clone_base_uuid": ("StandIn", _core.CloneBaseSentinel),
}


def _members(cls: type) -> Iterable[tuple[str, Any]]:
    for name in dir(cls):
        if name.startswith("__"):
            continue
        for klass in cls.__mro__:
            if name in klass.__dict__:
                yield name, klass.__dict__[name]
                break


def _is_attribute(raw: Any) -> bool:
    return type(raw).__name__ in ("getset_descriptor", "member_descriptor")


def unclassified() -> list[str]:
    """Public methods of TYPES that are neither in READS nor MUTATORS."""
    missing = []
    for cls in TYPES:
        reads = READS.get(cls.__name__, {})
        mutators = MUTATORS.get(cls.__name__, frozenset())
        for name, raw in _members(cls):
            if not _is_attribute(raw) and name not in reads \
                    and name not in mutators:
                missing.append(f"{cls.__name__}.{name}")
    return missing


def _swallow(call: Callable[..., Any], *args: Any) -> Any:
    try:
        return call(*args)
    except Exception:  # noqa: BLE001 -- a hook must not fail the host
        return None


def touch(obj: Any, found: list[Any] | None = None) -> None:
    """Uses every public member of `obj` that changes nothing.  Objects
    of TYPES reached through it (a stand-in's board and sentinel; its
    ``model`` is itself) are appended to `found` when given."""
    cls = type(obj)
    reads = READS.get(cls.__name__, {})
    made = {type(o) for o in gc.get_referents(obj)}
    _swallow(repr, obj)
    for name, raw in _members(cls):
        lazy = LAZY.get(name)
        if lazy and lazy[0] == cls.__name__ and lazy[1] not in made:
            continue
        if _is_attribute(raw):
            value = _swallow(getattr, obj, name)
            if found is not None:
                if type(value) in TYPES:
                    found.append(value)
                elif isinstance(value, tuple) and value \
                        and type(value[0]) in TYPES:
                    found.append(value[0])  # StandIn.board: (board, slot)
        elif name in reads:
            args = tuple(obj if a is None else a for a in reads[name])
            _swallow(getattr(obj, name), *args)


def walk(objects: Iterable[Any]) -> int:
    """Touches every object of TYPES among `objects`, and what it reaches;
    returns how many were touched."""
    todo = [o for o in objects if type(o) in TYPES]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        touch(obj, todo)
    return len(seen)


class Walker:
    """A ``gc.callbacks`` hook that, at the start of every collection,
    walks ``gc.get_objects()``: the whole heap, or with `young` the two
    youngest generations (what was tracked in the last few collections:
    an object under construction is there), and the whole heap when the
    oldest generation is collected."""

    def __init__(self, young: bool = False) -> None:
        self.young = young
        self.walks = 0
        self.touched = 0
        self._inside = False

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase != "start" or self._inside:
            return
        self._inside = True
        try:
            if self.young and info.get("generation", 2) < 2:
                objects = gc.get_objects(0) + gc.get_objects(1)
            else:
                objects = gc.get_objects()
            self.touched += walk(objects)
            self.walks += 1
        finally:
            self._inside = False

    def install(self) -> None:
        gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
