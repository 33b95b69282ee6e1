"""Two read-only GET routes on ComfyUI's own HTTP server.

The node entry (``install-node``) calls ``register_with_comfyui()`` while
ComfyUI loads custom nodes; the routes are added the way custom nodes add
theirs, on ``server.PromptServer.instance.routes``:

- ``GET /comfy_standin/status``: ``payload()`` as JSON: the default pool,
  ComfyUI's published reserve, the GPU probe, and a read of
  ``comfy.model_management`` (its loaded models, free memory per device,
  the order its ``free_memory`` would evict in);
- ``GET /comfy_standin/``: the live VRAM page (``page/vram.html``), a file
  that reads the status every two seconds.

Nothing is written and nothing secret is served (docs/cli.md, "What
ComfyUI's server answers").  The answer is built off the event loop, on
one thread of its own, and never raises: a part that cannot be read says
why in its place.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import comfy_standin as cs

from ._status import (
    PAGE_ROUTE,
    ROUTE,
    _gib,
    _worker_name,
    collect,
    probe_summary,
)
from ._text import NotJSON, json_text, visible

PAGE_FILE = Path(__file__).with_name("page") / "vram.html"

#: Entries of current_loaded_models read per request.
MAX_ENTRIES = 256
#: Seconds a request waits for the status before answering 503.
BUILD_TIMEOUT = 5.0
_TEXT_LIMIT = 200


def _short(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text[:_TEXT_LIMIT]


def _failed(exc: BaseException) -> str:
    """'Type: text' of `exc`, cut short; said even when its str() raises."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot say why
        text = "(its text cannot be read)"
    return _short(f"{type(exc).__name__}: {text}")


def _int_or_none(value: object) -> int | None:
    """A byte count as the status answer carries one (an integer of at
    most 64 bits, docs/cli.md), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value) if -2**64 < value < 2**64 else None
    if isinstance(value, float) and value == value and abs(value) < 2**63:
        return int(value)
    return None


# ---------------------------------------------------------------------------
# ComfyUI's own view: current_loaded_models and free memory


def _call(obj: Any, name: str) -> Any:
    """obj.name(), or None when it fails (any Exception)."""
    try:
        return getattr(obj, name)()
    except Exception:  # noqa: BLE001 - a model we cannot read is shown so
        return None


def _entry_view(index: int, entry: Any) -> dict[str, Any]:
    """One LoadedModel as ComfyUI's free_memory sees it."""
    view: dict[str, Any] = {"index": index}
    try:
        view["device"] = str(entry.device)
        view["currently_used"] = bool(entry.currently_used)
        view["dead"] = bool(_call(entry, "is_dead"))
        patcher = entry.model
        view["size"] = _int_or_none(_call(entry, "model_memory"))
        view["loaded"] = _int_or_none(_call(entry, "model_loaded_memory"))
        view["offloaded"] = _int_or_none(
            _call(entry, "model_offloaded_memory"))
        if patcher is None:
            view.update(patcher=None, model=None, dynamic=False,
                        refcount=None, standin=None)
            return view
        # free_memory counts the reference its own call passes; this
        # frame holds one more (the local name).
        view["refcount"] = sys.getrefcount(patcher) - 1
        view["patcher"] = _short(type(patcher).__name__)
        view["model"] = _short(type(getattr(patcher, "model", None))
                               .__name__)
        view["dynamic"] = _call(patcher, "is_dynamic") is True
        view["standin"] = None
        if type(patcher).__module__.startswith("comfy_standin"):
            view["standin"] = {"worker": _short(_worker_name(
                patcher.worker)), "model_id": _short(patcher.model_id)}
        del patcher
    except Exception as exc:  # noqa: BLE001 - said in its place
        view["error"] = _failed(exc)
    return view


def _why_first(first: dict[str, Any], second: dict[str, Any] | None) -> str:
    """Why free_memory's sort puts `first` ahead of `second`."""
    if second is None:
        return "the only model ComfyUI could evict on this device"
    a, b = first["key"], second["key"]
    if a[0] != b[0]:
        return (f"the most offloaded ({_gib(-a[0])} offloaded, the next "
                f"{_gib(-b[0])}): free_memory finishes the cheapest "
                f"eviction first")
    if a[1] != b[1]:
        return (f"as offloaded as the next; fewer references ({a[1]} "
                f"against {b[1]}; approximate: counted at this request)")
    if a[2] != b[2]:
        return (f"as offloaded and as referenced as the next; smaller "
                f"({_gib(a[2])} against {_gib(b[2])})")
    return (f"ties with the next on offloaded bytes, references and size; "
            f"earlier in current_loaded_models (index {a[3]})")


def eviction_order(models: list[dict[str, Any]]) -> dict[str, Any]:
    """Per device, the entries in the order ComfyUI's free_memory tries
    them: not dead, sorted by (-offloaded, refcount, size, index)."""
    by_device: dict[str, list[dict[str, Any]]] = {}
    for view in models:
        if view.get("dead") or "error" in view:
            continue
        key = (-(view.get("offloaded") or 0), view.get("refcount") or 0,
               view.get("size") or 0, view["index"])
        by_device.setdefault(view["device"], []).append(
            {"index": view["index"], "key": key})
    order: dict[str, Any] = {}
    for device, candidates in by_device.items():
        candidates.sort(key=lambda c: c["key"])
        second = candidates[1] if len(candidates) > 1 else None
        order[device] = {
            "order": [c["index"] for c in candidates],
            "next": candidates[0]["index"],
            "why": _why_first(candidates[0], second),
        }
    return order


def _device_memory(mm: Any, devices: dict[str, Any]) -> dict[str, Any]:
    memory = {}
    for name, device in devices.items():
        view: dict[str, Any] = {}
        for key, function in (("free", "get_free_memory"),
                              ("total", "get_total_memory")):
            try:
                view[key] = _int_or_none(getattr(mm, function)(device))
            except Exception as exc:  # noqa: BLE001 - said in its place
                view[key] = None
                view[f"{key}_error"] = _failed(exc)
        memory[name] = view
    return memory


def comfyui_view() -> dict[str, Any]:
    """What ComfyUI's model_management holds, read without changing it:
    its loaded models (the first MAX_ENTRIES), free and total memory per
    device they are on (or ComfyUI's torch device), the eviction order."""
    mm = sys.modules.get("comfy.model_management")
    if mm is None:
        return {"available": False,
                "why": "comfy.model_management is not loaded here"}
    try:
        entries = list(mm.current_loaded_models)  # one copy, under the GIL
    except Exception as exc:  # noqa: BLE001 - said in its place
        return {"available": False, "why": _failed(exc)}
    models = [_entry_view(i, e) for i, e in
              enumerate(entries[:MAX_ENTRIES])]
    devices: dict[str, Any] = {}
    for entry in entries[:MAX_ENTRIES]:
        try:
            device = entry.device
            if getattr(device, "type", str(device)) != "cpu":
                devices.setdefault(str(device), device)
        except Exception:  # noqa: BLE001 - its model view says why
            continue
    del entries
    if not devices:
        try:
            device = mm.get_torch_device()
            devices[str(device)] = device
        except Exception:  # noqa: BLE001 - no device: no bar
            pass
    return {
        "available": True,
        "models": models,
        "models_truncated": len(models) == MAX_ENTRIES,
        "devices": _device_memory(mm, devices),
        "eviction": eviction_order(models),
    }


# ---------------------------------------------------------------------------
# the answer


def payload() -> dict[str, Any]:
    """What the status route answers; also what ``status --url``
    renders.  Never raises: a part that fails is ``{"error": ...}``."""
    answer: dict[str, Any] = {
        "format": 1,
        "comfy_standin": cs.__version__,
        "pid": os.getpid(),
    }
    try:
        from .integrations import comfy_env as adapter

        answer["adapter_installed"] = bool(adapter.installed())
    except Exception:  # noqa: BLE001 - not installed, for this answer
        answer["adapter_installed"] = False
    try:
        pool = cs.default_pool()
        status = collect(pool)
        status["held"] = len(pool.held())
        answer["pool"] = status
        charges = sum(w["charge"]["charge"] for w in status["workers"])
    except Exception as exc:  # noqa: BLE001 - said in its place
        answer["pool_error"] = _failed(exc)
        charges = None
    mm = sys.modules.get("comfy.model_management")
    reserve = getattr(mm, "EXTRA_RESERVED_VRAM", None)
    answer["reserve"] = {"extra_reserved_vram": _int_or_none(reserve),
                         "worker_charges": charges}
    probe = cs.probe()
    answer["probe"] = probe
    answer["probe_summary"] = probe_summary(probe)
    try:
        answer["comfyui"] = comfyui_view()
    except Exception as exc:  # noqa: BLE001 - said in its place
        answer["comfyui"] = {"available": False, "why": _failed(exc)}
    return answer


def payload_json() -> bytes:
    """payload() as JSON; NotJSON when a number in it has no JSON form."""
    return json_text(payload(), sort_keys=True).encode()


# ---------------------------------------------------------------------------
# aiohttp (ComfyUI's server)

_builder: list[concurrent.futures.ThreadPoolExecutor] = []


def _build_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One thread builds answers: a pool lock held by a long eviction
    delays the status, never ComfyUI's event loop, and never piles up
    threads (requests queue behind it and answer 503 after
    BUILD_TIMEOUT)."""
    if not _builder:
        _builder.append(concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="comfy_standin status"))
    return _builder[0]


async def handle(request: Any) -> Any:
    """GET /comfy_standin/status."""
    import asyncio

    from aiohttp import web

    loop = asyncio.get_running_loop()
    try:
        body = await asyncio.wait_for(
            loop.run_in_executor(_build_thread(), payload_json),
            BUILD_TIMEOUT)
    except asyncio.TimeoutError:
        return _error(503, f"the status took over {BUILD_TIMEOUT:g} s")
    except NotJSON as exc:
        return _error(500, f"the status cannot be sent: {exc}")
    return web.Response(body=body, content_type="application/json",
                        headers={"Cache-Control": "no-store",
                                 "X-Content-Type-Options": "nosniff"})


def _error(status: int, text: str) -> Any:
    from aiohttp import web

    return web.json_response({"error": text}, status=status,
                             headers={"Cache-Control": "no-store"})


_page: list[tuple[bytes, str]] = []


def _csp_hash(source: str) -> str:
    digest = hashlib.sha256(source.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


def page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy: nothing but its
    own inline script and style (by hash) and reads of this server."""
    if not _page:
        text = PAGE_FILE.read_text(encoding="utf-8")
        scripts = re.findall(r"<script>(.*?)</script>", text, re.S)
        styles = re.findall(r"<style>(.*?)</style>", text, re.S)
        policy = "; ".join([
            "default-src 'none'",
            "script-src " + " ".join(map(_csp_hash, scripts)),
            "style-src " + " ".join(map(_csp_hash, styles)),
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ])
        _page.append((text.encode("utf-8"), policy))
    return _page[0]


async def handle_page(request: Any) -> Any:
    """GET /comfy_standin/: the live VRAM page."""
    from aiohttp import web

    body, policy = page()
    return web.Response(body=body, content_type="text/html",
                        charset="utf-8",
                        headers={"Content-Security-Policy": policy,
                                 "X-Content-Type-Options": "nosniff",
                                 "Referrer-Policy": "no-referrer",
                                 "Cache-Control": "no-cache"})


class Refused(Exception):
    """Why the routes were not added: `kind` (a fixed word, the log-once
    key) and the text of the log line."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


def _ours(route: Any) -> bool:
    handler = getattr(route, "handler", None)
    return getattr(handler, "__module__", None) == __name__ and getattr(
        handler, "__name__", None) in ("handle", "handle_page")


def _as_comfyui_would(defs: list[Any]) -> None:
    """What ComfyUI's ``PromptServer.add_routes`` does with each route,
    on an application of our own: the route again under ``/api`` through
    ``RouteTableDef.route(method, "/api" + path)(handler,
    **route.kwargs)`` (a decorator that takes the handler alone), then
    both tables onto the app.  Whatever this aiohttp refuses here would
    have stopped ComfyUI at start."""
    from aiohttp import web

    app = web.Application()
    api = web.RouteTableDef()
    for route in defs:
        api.route(route.method, "/api" + route.path)(route.handler,
                                                      **route.kwargs)
    app.add_routes(api)
    app.add_routes(defs)


def add_routes(routes: Any) -> bool:
    """Both routes on ComfyUI's ``PromptServer.instance.routes`` (an
    aiohttp RouteTableDef), as ComfyUI registers its own: GET, no
    keywords (aiohttp serves HEAD for a GET route, as for ComfyUI's own).
    False when they are there already; Refused, with nothing added, when
    `routes` is not a RouteTableDef, another node serves either path, or
    this aiohttp would refuse them in ComfyUI's ``add_routes``; an
    exception while adding takes back what was added."""
    from aiohttp import web

    if type(routes) is not web.RouteTableDef \
            or type(getattr(routes, "_items", None)) is not list:
        raise Refused("table", f"PromptServer.instance.routes is "
                      f"{visible(type(routes).__qualname__, 80)}, not an "
                      f"aiohttp RouteTableDef")
    paths = (ROUTE, PAGE_ROUTE)
    taken = [r for r in routes if isinstance(r, web.RouteDef)
             and r.path in paths and r.method in ("GET", "*")]
    if taken and all(map(_ours, taken)):
        return False
    if taken:
        raise Refused("taken", f"another custom node serves GET "
                               f"{taken[0].path}")
    scratch = web.RouteTableDef()
    scratch.get(ROUTE)(handle)
    scratch.get(PAGE_ROUTE)(handle_page)
    try:
        _as_comfyui_would(list(scratch))
    except Exception as exc:  # noqa: BLE001 - said, and nothing added
        raise Refused("aiohttp", f"this aiohttp would refuse them at "
                      f"ComfyUI's start: {_failed(exc)}") from None
    items = routes._items
    before = len(items)
    try:
        for route in scratch:
            routes.route(route.method, route.path)(route.handler)
    except BaseException:
        del items[before:]  # none of ours left behind
        raise
    return True


log = logging.getLogger("comfy_standin")
_said: set[str] = set()


def _refuse(kind: str, why: str) -> bool:
    """One warning per kind of reason, per process; False."""
    if kind not in _said:
        _said.add(kind)
        log.warning("comfy_standin: no status route (%s)", why)
    return False


def register_with_comfyui() -> bool:
    """Adds the routes to ComfyUI's server when one is being set up;
    never raises an Exception.

    False, with nothing added, outside ComfyUI (no ``server`` module
    with a ``PromptServer``: silently) and when ComfyUI's server cannot
    take them (one warning line, docs/troubleshooting.md).  Never
    imports ComfyUI."""
    try:
        server = sys.modules.get("server")
        prompt_server = getattr(server, "PromptServer", None)
        if prompt_server is None:
            return False
        instance = getattr(prompt_server, "instance", None)
        if instance is None:
            return _refuse("instance", "ComfyUI's PromptServer has no "
                           "instance yet: its server is not set up")
        routes = getattr(instance, "routes", None)
        if routes is None:
            return _refuse("routes", "PromptServer.instance has no "
                           "routes: a ComfyUI server this comfy_standin "
                           "does not know")
        if _registered_on and _registered_on[0] is routes:
            return True  # once per server
        add_routes(routes)
        _registered_on[:] = [routes]
        return True
    except Refused as exc:
        return _refuse(exc.kind, str(exc))
    except Exception as exc:  # noqa: BLE001 - ComfyUI starts either way
        return _refuse(type(exc).__name__, _failed(exc))


_registered_on: list[Any] = []
