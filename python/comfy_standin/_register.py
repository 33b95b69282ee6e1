"""Putting a stand-in into ComfyUI's loaded-model list (docs/architecture.md).

Shared by both implementations: it only touches ComfyUI objects.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import pool as _pool


def register(mm: Any, s: Any) -> Any:
    """Insert stand-in `s` into ``mm.current_loaded_models``.

    `mm` is ``comfy.model_management`` (or a faithful mock).  Returns the
    ``LoadedModel`` entry.  Registering a stand-in that is already listed
    returns its entry (with ``currently_used`` reset to False) instead of
    adding a second one.

    ``currently_used`` is False unconditionally: six of the seven readers
    of the list outside model_management filter on it, which keeps the
    stand-in's size out of their arithmetic (docs/architecture.md, inaccuracy
    3).  The entry gets ``real_model`` and a ``model_finalizer`` like an entry
    that ``LoadedModel.model_load`` set up, because ``model_unload`` detaches
    the finalizer unconditionally.  ``atexit`` is off: at interpreter exit
    ``cleanup_models`` may find model_management half torn down.

    ComfyUI's entry holds its model only weakly.  A comfy_standin stand-in
    is therefore held by its pool from here on, whoever else holds it, and
    listed again at each ``pool.boundary()`` while its model is on the card
    (ComfyUI may have unloaded it since); it is released at the first
    boundary after its worker lost the model or died or restarted; never
    inside ``free_memory`` (docs/semantics.md "The pool").
    """
    _hold(s)
    for entry in list(mm.current_loaded_models):
        if getattr(entry, "model", None) is s:
            entry.currently_used = False
            return entry
    inner = s.model
    entry = mm.LoadedModel(s)
    entry.currently_used = False
    entry.real_model = weakref.ref(inner)
    finalizer = weakref.finalize(inner, mm.cleanup_models)
    finalizer.atexit = False
    entry.model_finalizer = finalizer
    mm.current_loaded_models.insert(0, entry)
    return entry


def _hold(s: Any) -> None:
    """The stand-in's pool keeps it alive while registered; objects that
    are not comfy_standin stand-ins (comfy-env's own patchers) are kept by
    whoever made them, as before."""
    try:
        owner = getattr(s, "pool", None)
    except Exception:  # noqa: BLE001 - a foreign patcher's __getattr__
        return
    if isinstance(owner, _pool.Pool):
        owner._hold(s)
