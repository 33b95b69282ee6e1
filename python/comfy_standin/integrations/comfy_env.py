"""Opt-in adapter: make an installed comfy-env use ``comfy_standin.StandIn``.

Call once at start-up, before any worker registers a model (for instance
from a custom node package's ``__init__``)::

    from comfy_standin.integrations import comfy_env
    comfy_env.install()

What it swaps, all reversibly (``uninstall()``):

- ``comfy_env.isolation.model_patcher.SubprocessModelPatcher`` becomes
  ``comfy_standin.StandIn``, which takes the same keywords.  comfy-env
  imports the name at each registration, so new stand-ins are C ones;
  stand-ins created before ``install()`` stay comfy-env's own.
- ``comfy_env.state_sync.apply_echo``, ``apply_residency`` and
  ``apply_peak_raise`` route comfy_standin stand-ins to the C state sync
  and pass every other patcher to comfy-env's originals.  They keep
  comfy-env's calling contract: they never raise, a bad census entry is
  skipped (comfy_standin itself rejects the whole census; here the valid
  entries are then applied one by one, as comfy-env did), and
  ``apply_residency`` returns the ids whose receipt changed.

- ``comfy_env.isolation.pool._insert_loaded_model`` lists comfy_standin
  stand-ins through ``comfy_standin.register`` (so the pool holds them
  while ComfyUI lists them) and other patchers as before;
  ``_register_new_patchers`` (comfy-env's node boundary) is followed by
  ``default_pool().boundary(comfy.model_management)``: a stand-in ComfyUI
  dropped while its worker still holds it is listed again, finished
  registrations are released.
- The default pool's ``on_pressure`` (unset before) forwards the shortfall
  to comfy-env's own pressure hook (``model_patcher._ON_PRESSURE``, which
  asks idle workers to release from a thread), as comfy-env's patcher
  does in its ``partially_unload``.

comfy-env reads ``_residency_peak``, ``_residency_seq``,
``_worker_generation`` and friends off its stand-ins; ``StandIn`` answers
them read-only from the C ledger, so comfy-env's pool arithmetic runs
unchanged.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import comfy_standin as cs

__all__ = ["install", "installed", "uninstall"]

log = logging.getLogger("comfy_standin")

_PATCHER_MODULE = "comfy_env.isolation.model_patcher"
_SYNC_MODULE = "comfy_env.state_sync"
_SYNC_NAMES = ("apply_echo", "apply_residency", "apply_peak_raise")
_POOL_MODULE = "comfy_env.isolation.pool"
_POOL_NAMES = ("_insert_loaded_model", "_register_new_patchers")

# (module, attribute) -> the original object, while installed.
_originals: dict[tuple[str, str], Any] = {}


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    return bool(_originals)


def install() -> bool:
    """Swap comfy_standin into comfy-env.  Idempotent.

    Returns True when installed (now or before).  Raises ImportError when
    comfy-env (or the ``comfy`` package it imports) is not importable, so
    an opt-in that cannot take effect is never silent.
    """
    if _originals:
        return True
    patcher_module = importlib.import_module(_PATCHER_MODULE)
    sync_module = importlib.import_module(_SYNC_MODULE)
    originals = {
        (_PATCHER_MODULE, "SubprocessModelPatcher"): (
            patcher_module.SubprocessModelPatcher
        )
    }
    for name in _SYNC_NAMES:
        if hasattr(sync_module, name):
            originals[(_SYNC_MODULE, name)] = getattr(sync_module, name)
    wrappers = {
        "apply_echo": _wrap_apply_echo,
        "apply_residency": _wrap_apply_residency,
        "apply_peak_raise": _wrap_apply_peak_raise,
    }
    pool_module = importlib.import_module(_POOL_MODULE)
    for name in _POOL_NAMES:
        if hasattr(pool_module, name):
            originals[(_POOL_MODULE, name)] = getattr(pool_module, name)
    wrappers["_insert_loaded_model"] = _wrap_insert_loaded_model
    wrappers["_register_new_patchers"] = _wrap_register_new_patchers
    patcher_module.SubprocessModelPatcher = cs.StandIn
    for (module_name, name), original in originals.items():
        if module_name == _SYNC_MODULE:
            setattr(sync_module, name, wrappers[name](original))
        elif module_name == _POOL_MODULE:
            setattr(pool_module, name, wrappers[name](original))
    pool = cs.default_pool()
    if pool.on_pressure is None:
        pool.on_pressure = _forward_pressure
    _originals.update(originals)
    log.info("comfy_standin: installed into comfy-env")
    return True


def uninstall() -> None:
    """Put comfy-env's own objects back.  Idempotent."""
    while _originals:
        (module_name, name), original = _originals.popitem()
        setattr(importlib.import_module(module_name), name, original)
    pool = cs.default_pool()
    if pool.on_pressure is _forward_pressure:
        pool.on_pressure = None


def _is_ours(p: Any) -> bool:
    return isinstance(p, cs.StandIn)


def _wrap_apply_echo(original: Any) -> Any:
    def apply_echo(
        p: Any,
        resident: int,
        seq: int | None = None,
        unmapped: bool = False,
        in_flight: bool = False,
    ) -> None:
        if not _is_ours(p):
            return original(p, resident, seq=seq, unmapped=unmapped,
                            in_flight=in_flight)
        try:
            # comfy-env's contract: clamp, never raise.
            value = 0 if unmapped else max(0, min(int(resident), p.size))
            cs.apply_echo(p, value, seq=None if seq is None else int(seq),
                          unmapped=unmapped, in_flight=in_flight)
        except Exception as exc:  # an echo must not fail an eviction
            log.warning("comfy_standin: echo for %r ignored: %s",
                        p.model_id, exc)
        return None

    apply_echo.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_echo


def _wrap_apply_residency(original: Any) -> Any:
    def apply_residency(
        patchers: dict[str, Any],
        census: list[dict[str, Any]],
        log: Any = None,
    ) -> list[str]:
        ours = {k: p for k, p in (patchers or {}).items() if _is_ours(p)}
        theirs = {k: p for k, p in (patchers or {}).items() if not _is_ours(p)}
        changed: list[str] = []
        entries = list(census or [])
        if theirs:
            changed += original(theirs, entries, log=log)
        mine = [
            e for e in entries
            if isinstance(e, dict) and e.get("id") in ours
        ]
        if not mine:
            return changed
        before = {e["id"]: ours[e["id"]].loaded_size() for e in mine}
        try:
            cs.apply_residency(ours, mine)
        except cs.EchoError as exc:
            _note(log, f"[comfy-standin] census rejected whole ({exc}); "
                       f"applying its valid entries one by one")
            for entry in mine:
                try:
                    cs.apply_residency(ours, [entry])
                except cs.EchoError as entry_exc:
                    _note(log, f"[comfy-standin] census entry skipped: "
                               f"{entry_exc}")
        changed += [
            mid for mid in before if ours[mid].loaded_size() != before[mid]
        ]
        return changed

    apply_residency.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_residency


def _wrap_apply_peak_raise(original: Any) -> Any:
    def apply_peak_raise(
        patchers: dict[str, Any], census: list[dict[str, Any]]
    ) -> None:
        theirs = {k: p for k, p in (patchers or {}).items() if not _is_ours(p)}
        if theirs:
            original(theirs, census)
        for entry in census or []:
            try:
                p = (patchers or {}).get(entry.get("id"))
                if _is_ours(p):
                    cs.raise_peak(p, max(0, int(entry.get("resident", 0))))
            except Exception:
                continue  # comfy-env's contract: never raises

    apply_peak_raise.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_peak_raise


def _forward_pressure(shortfall: int) -> None:
    """A stand-in freed less than ComfyUI asked: comfy-env's hook posts
    the ask to idle workers and returns (it is debounced)."""
    hook = getattr(
        importlib.import_module(_PATCHER_MODULE), "_ON_PRESSURE", None
    )
    if hook is not None:
        hook(shortfall)


def _wrap_insert_loaded_model(original: Any) -> Any:
    def _insert_loaded_model(p: Any) -> Any:
        if not _is_ours(p):
            return original(p)
        return cs.register(
            importlib.import_module("comfy.model_management"), p
        )

    _insert_loaded_model.__wrapped__ = original  # type: ignore[attr-defined]
    return _insert_loaded_model


def _wrap_register_new_patchers(original: Any) -> Any:
    def _register_new_patchers(env_dir: Any, worker: Any,
                               generation: Any) -> Any:
        try:
            return original(env_dir, worker, generation)
        finally:
            # comfy-env's boundary: outside free_memory by construction.
            try:
                restored = cs.default_pool().boundary(
                    importlib.import_module("comfy.model_management")
                )
                for s in restored:
                    log.warning(
                        "comfy_standin: listed %r again: ComfyUI dropped "
                        "it while its worker still holds it", s.model_id,
                    )
            except Exception:
                log.exception("comfy_standin: boundary failed (ignored)")

    _register_new_patchers.__wrapped__ = original  # type: ignore[attr-defined]
    return _register_new_patchers


def _note(log_fn: Any, message: str) -> None:
    if log_fn is not None:
        try:
            log_fn(message)
            return
        except Exception:
            pass
    log.warning("%s", message)
