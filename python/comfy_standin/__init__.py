"""comfy_standin: honest, cheap stand-ins for subprocess-held models in
ComfyUI's VRAM management.

The names here are the C implementation (``comfy_standin._core``); the
pure-Python reference of the same contract is ``comfy_standin._reference``.
See docs/semantics.md for the contract in detail.
"""

import sys as _sys
import threading as _threading
from typing import Optional as _Optional

from . import pool as _pool
from ._core import (
    Board,
    CloneBaseSentinel,
    EchoError,
    Ledger,
    StandIn,
    StandInModule,
    WorkerBooks,
    WorkerGoneError,
    apply_echo,
    apply_residency,
    probe,
    raise_peak,
)
from .pool import register

__version__ = "0.1.0"

__all__ = [
    "Board",
    "CloneBaseSentinel",
    "EchoError",
    "Ledger",
    "Pool",
    "StandIn",
    "StandInModule",
    "WorkerBooks",
    "WorkerGoneError",
    "apply_echo",
    "apply_residency",
    "default_pool",
    "probe",
    "raise_peak",
    "register",
]


class Pool(_pool.Pool):
    """Per-worker charges over the C ledger (docs/reserve.md)."""

    _impl = _sys.modules[__name__]


_default_pool: _Optional[Pool] = None
_default_pool_lock = _threading.Lock()


def default_pool() -> Pool:
    """The process-wide pool stand-ins use when given none."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = Pool()
        return _default_pool



def __dir__() -> list[str]:
    """The API only: ``__all__`` and ``__version__`` (the module's own
    imports and private helpers stay reachable but unlisted)."""
    return sorted([*__all__, "__version__"])
