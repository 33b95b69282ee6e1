"""GET /comfy_standin/status on ComfyUI's own HTTP server (read-only).

The node entry (``install-node``) calls ``register_with_comfyui()`` while
ComfyUI loads custom nodes; the route is added the way custom nodes add
theirs, through ``server.PromptServer.instance.routes``.  The answer is
``payload()`` as JSON: this process's default pool (workers, charges,
stand-ins with their receipts, boards, holds), ComfyUI's published
reserve and the GPU probe.  Nothing is written and nothing secret is
served: no environment, no IPC keys, only what ``status`` prints.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ROUTE = "/comfy_standin/status"
#: The live VRAM page (a static file that reads ROUTE).
PAGE_ROUTE = "/comfy_standin/"


def payload() -> dict[str, Any]:
    """What the route answers; also what ``status --url`` renders."""
    import comfy_standin as cs

    from . import _status
    from .integrations import comfy_env as adapter

    pool = cs.default_pool()
    status = _status.collect(pool)
    status["held"] = len(pool.held())
    mm = sys.modules.get("comfy.model_management")
    reserve = getattr(mm, "EXTRA_RESERVED_VRAM", None)
    charges = [w["charge"]["charge"] for w in status["workers"]]
    probe = cs.probe()
    return {
        "format": 1,
        "comfy_standin": cs.__version__,
        "pid": os.getpid(),
        "adapter_installed": adapter.installed(),
        "pool": status,
        "reserve": {
            "extra_reserved_vram": (
                int(reserve) if isinstance(reserve, (int, float)) else None
            ),
            "worker_charges": sum(charges),
        },
        "probe": probe,
        "probe_summary": _status.probe_summary(probe),
    }


def payload_json() -> bytes:
    return json.dumps(payload(), sort_keys=True, default=str).encode()


async def handle(request: Any) -> Any:
    """The aiohttp handler (aiohttp is ComfyUI's server)."""
    from aiohttp import web

    return web.Response(body=payload_json(),
                        content_type="application/json")


def register_with_comfyui() -> bool:
    """Adds the route to ComfyUI's server when one is being set up.

    Returns False (and changes nothing) outside ComfyUI: no ``server``
    module with a ``PromptServer.instance``.  Never imports ComfyUI."""
    server = sys.modules.get("server")
    prompt_server = getattr(getattr(server, "PromptServer", None),
                            "instance", None)
    routes = getattr(prompt_server, "routes", None)
    if routes is None:
        return False
    if _registered_on and _registered_on[0] is routes:
        return True  # once per server: aiohttp refuses a second GET
    routes.get(ROUTE)(handle)
    _registered_on[:] = [routes]
    return True


_registered_on: list[Any] = []
