"""Mock of the MultiGPU work-unit reuse loop (``comfy/multigpu.py``).

Upstream, when preparing deep clones for extra GPUs with ``reuse_loaded``,
walks ``loaded_models()`` **unfiltered** and reuses the first patcher that
passes every check by calling its ``clone()``. docs/comfyui.md gives the
checks in this order (``DEFAULT_ORDER``): the patcher's ``model`` is None;
its ``load_device`` differs; its ``clone_base_uuid`` differs;
``getattr(P, "is_multigpu_base_clone", False)`` is falsy. A patcher that
fails any check is skipped.

The order is somebody else's line order, so :func:`reuse_loaded` takes any
order (and any subset) of the check names; :data:`ORDERS` names the ones
seen upstream, and :func:`rejections` says which checks reject a patcher
on their own, so a test can demand that a stand-in fails more than one.
"""

from __future__ import annotations

import itertools

from . import model_management as mm


def _model_none(p, model, device):
    return p.model is None


def _load_device(p, model, device):
    return p.load_device != device


def _clone_base_uuid(p, model, device):
    return p.clone_base_uuid != model.clone_base_uuid


def _multigpu_base_clone(p, model, device):
    return not getattr(p, "is_multigpu_base_clone", False)


#: check name -> predicate(P, model, device) that is True when P is skipped
CHECKS = {
    "model_none": _model_none,
    "load_device": _load_device,
    "clone_base_uuid": _clone_base_uuid,
    "multigpu_base_clone": _multigpu_base_clone,
}

DEFAULT_ORDER = (
    "model_none",
    "load_device",
    "clone_base_uuid",
    "multigpu_base_clone",
)

ORDERS = {
    # docs/comfyui.md, "comfy/multigpu.py"
    "facts": DEFAULT_ORDER,
    # the one-expression form found in stored upstream copies:
    # ``lm.model is not None and lm.clone_base_uuid == model.clone_base_uuid
    # and lm.load_device == device`` (no base-clone check)
    "upstream_and_chain": ("model_none", "clone_base_uuid", "load_device"),
}


def all_orders():
    """Every permutation of the four checks, and of each three of them."""
    names = tuple(CHECKS)
    out = list(itertools.permutations(names))
    for subset in itertools.combinations(names, 3):
        out.extend(itertools.permutations(subset))
    return out


#: what the last reuse_loaded() saw: (patcher name, rejecting check or None)
trace: list[tuple[str, str | None]] = []


def reuse_loaded(model, device, order=DEFAULT_ORDER):
    """Return ``P.clone()`` of the first loaded patcher passing every
    check, in ``order``; None when none passes.
    """
    del trace[:]
    for p in mm.loaded_models():
        rejected_by = None
        for name in order:
            if CHECKS[name](p, model, device):
                rejected_by = name
                break
        trace.append((_label(p), rejected_by))
        if rejected_by is None:
            return p.clone()
    return None


def rejections(p, model, device):
    """The set of checks that, each on its own, would skip ``p``."""
    return {name for name, check in CHECKS.items() if check(p, model, device)}


def _label(p):
    if p is None:
        return "None"
    return str(getattr(p, "name", None) or getattr(p, "model_id", None) or p)
