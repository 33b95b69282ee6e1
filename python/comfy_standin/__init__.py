"""comfy_standin: stand-ins in ComfyUI's loaded-model list for the models
comfy-env's worker processes hold.

The names here are the C implementation (``comfy_standin._core``); the
pure-Python reference of the same contract is ``comfy_standin._reference``
(docs/semantics.md).
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
    """``__all__`` and ``__version__``: private names stay unlisted."""
    return sorted([*__all__, "__version__"])
