"""comfy_standin: honest, cheap stand-ins for subprocess-held models in
ComfyUI's VRAM management.

The names here are the C implementation (``comfy_standin._core``); the
pure-Python reference of the same contract is ``comfy_standin._reference``.
See docs/semantics.md for the contract in detail.
"""

from __future__ import annotations

import sys
import threading

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
from ._register import register

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

    _impl = sys.modules[__name__]


_default_pool: Pool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> Pool:
    """The process-wide pool stand-ins use when given none."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = Pool()
        return _default_pool

