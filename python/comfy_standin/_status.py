"""What ``python -m comfy_standin status`` and ``probe`` print.

``collect(pool)`` gathers a pool's workers, their charges, their
stand-ins' receipts (age and source) and the boards attached, as plain
JSON-able data; ``render`` makes it readable.  ``probe_summary`` and
``render_probe`` do the same for ``comfy_standin.probe()``, saying which
library failed to load and why when there is no GPU.
"""

from __future__ import annotations

import os
from typing import Any

from . import pool as _pool_module

_LIBRARIES = {
    "cuda": ("CUDA driver", "libcuda.so.1", "COMFY_STANDIN_LIBCUDA"),
    "nvml": ("NVML", "libnvidia-ml.so.1", "COMFY_STANDIN_LIBNVML"),
}


def _gib(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1 << 30:
        return f"{n / (1 << 20):.0f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


# ---------------------------------------------------------------------------
# the pool


def _board_view(s: Any) -> dict[str, Any] | None:
    attached = s.board
    if attached is None:
        return None
    board, slot = attached
    if board.closed:
        return {"name": None, "slot": slot, "status": "board closed",
                "loaded": None}
    try:
        reading = board.read(slot, s.size)
        status = board.status(slot, s.size)
    except (ValueError, OSError) as exc:  # closed meanwhile
        return {"name": None, "slot": slot, "status": str(exc),
                "loaded": None}
    return {
        "name": board.name,
        "slot": slot,
        "status": status,
        "loaded": None if reading is None else reading[0],
    }


def _board_summary(board: Any) -> dict[str, Any]:
    """A board's header as the host sees it; a closed board (its worker
    gone and the host done with it) says only that."""
    if board.closed:
        return {"name": f"(closed board {id(board):#x})", "closed": True,
                "models": []}
    return {
        "name": board.name,
        "slots": board.slots,
        "generation": board.generation,
        "owner_pid": board.owner_pid,
        "expected_owner": board.expected_owner,
        "attached": board.attached,
        "linked": board.linked,
        "worker_gone": board.owner_is_gone,
        "closed": False,
        "models": [],
    }


def _standin_view(s: Any) -> dict[str, Any]:
    loaded, seq, age, source = s.receipt()
    return {
        "model_id": s.model_id,
        "kind": s.kind,
        "size": s.size,
        "generation": s.worker_generation,
        "loaded": loaded,
        "seq": seq,
        "age_seconds": round(age, 3),
        "source": source,
        "stale": s.stale,
        "eviction_deferred": s.eviction_deferred,
        "bad_replies": s.bad_replies,
        "board": _board_view(s),
    }


def collect(pool: Any) -> dict[str, Any]:
    """A JSON-able picture of `pool` (docs/cli.md, ``status``)."""
    by_worker = pool.standins()
    workers = []
    boards: dict[str, dict[str, Any]] = {}
    for worker in pool._ledger.keys():
        books = pool._ledger.find(worker)
        if books is None:
            continue
        charge = books.charge()
        standins = sorted(
            by_worker.get(worker, []),
            key=lambda s: (s.worker_generation, s.model_id),
        )
        for s in standins:
            if s.board is not None:
                view = _board_summary(s.board[0])
                boards.setdefault(view["name"], view)["models"].append(
                    s.model_id
                )
        workers.append({
            "worker": repr(worker),
            "pid": _pool_module._default_pid_of(worker),
            "generation": books.generation,
            "alive": books.alive,
            "in_flight": books.in_flight,
            "charge": charge,
            "models": [_standin_view(s) for s in standins],
        })
    return {
        "implementation": pool._impl.__name__,
        "floor": pool.floor,
        "process_local": pool.process_local,
        "workers": workers,
        "graveyard": pool.graveyard_size(),
        "boards": list(boards.values()),
    }


def summary_line(status: dict[str, Any], result: dict[str, Any]) -> str:
    """``status --quiet``: one line."""
    workers = status["workers"]
    alive = sum(1 for w in workers if w["alive"])
    models = sum(len(w["models"]) for w in workers)
    return (
        f"{len(workers)} worker(s) ({alive} alive), {models} stand-in(s), "
        f"{len(status['boards'])} board(s); "
        + probe_line(probe_summary(result))
    )


def render(status: dict[str, Any], probe: bool = True,
           no_workers: str | None = None) -> str:
    lines = [
        f"pool ({status['implementation']}): floor "
        f"{_gib(status['floor'])} per worker, free memory "
        f"{'process-local' if status['process_local'] else 'device-wide'}"
    ]
    if not status["workers"]:
        lines.append(no_workers or (
            "  no workers: nothing has registered a stand-in in this "
            "process (status reads this process's pool; comfy-env fills "
            "it inside ComfyUI)"
        ))
    for w in status["workers"]:
        ch = w["charge"]
        state = "alive" if w["alive"] else "gone"
        if w["in_flight"]:
            state += f", {w['in_flight']} call(s) in flight"
        lines.append(
            f"  worker {w['worker']} pid {w['pid']} generation "
            f"{w['generation']}: {state}; charge {_gib(ch['charge'])} "
            f"(loaded {_gib(ch['sum_loaded'])}, peak {_gib(ch['sum_peak'])}, "
            f"held {_gib(ch['held'])}, floor {_gib(ch['floor'])})"
        )
        if not w["models"]:
            lines.append("    no stand-ins left (a gone worker's are "
                         "dropped at the boundary)")
        for m in w["models"]:
            flags = [f for f in ("stale", "eviction_deferred") if m[f]]
            board = m["board"]
            where = (
                f"; board {board['name'] or ''} slot {board['slot']}: "
                f"{board['status']}"
                if board else "; no board"
            )
            lines.append(
                f"    {m['model_id']:<12} {m['kind']:<8} "
                f"{_gib(m['loaded'])} of {_gib(m['size'])}, seq {m['seq']}, "
                f"{m['age_seconds']:.1f} s ago, source {m['source']}"
                f"{where}" + (f" [{', '.join(flags)}]" if flags else "")
            )
    if status["graveyard"]:
        lines.append(
            f"  graveyard: {status['graveyard']} stand-in(s) of dead or "
            f"restarted workers, kept until the next boundary"
        )
    if status["boards"]:
        lines.append("  boards attached:")
        for b in status["boards"]:
            if b["closed"]:
                lines.append(f"    {b['name']}: closed; models "
                             f"{', '.join(b['models'])}")
                continue
            lines.append(
                f"    {b['name']}: {b['slots']} slots, generation "
                f"{b['generation']}, owner pid {b['owner_pid']} (expected "
                f"{b['expected_owner']}), "
                f"{'host holds a way in' if b['linked'] else 'handed over'}"
                f"{', worker gone' if b.get('worker_gone') else ''}"
                f"{', closed' if b['closed'] else ''}; models "
                f"{', '.join(b['models'])}"
            )
    else:
        lines.append("  boards attached: none")
    if probe and "probe" in status:
        lines.append(render_probe(status["probe"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the probe


def _why(key: str, info: dict[str, Any]) -> str:
    """A reader's explanation of a library that did not load."""
    name, soname, variable = _LIBRARIES[key]
    error = info.get("error") or "unknown reason"
    if error == "disabled":
        return (f"{name}: not loaded: disabled by "
                f"COMFY_STANDIN_PROBE_DISABLE")
    hint = ""
    if "cannot open shared object" in error or "No such file" in error:
        hint = (
            f" (no NVIDIA driver on this machine, or {soname} is not on "
            f"the loader's path; {variable} can name it)"
        )
    elif "NO_DEVICE" in error or "DRIVER_NOT_LOADED" in error:
        hint = " (the library loaded but found no usable GPU)"
    override = os.environ.get(variable)
    if override:
        hint += f" [{variable}={override}]"
    return f"{name}: not loaded: {error}{hint}"


def probe_summary(result: dict[str, Any]) -> dict[str, Any]:
    devices = result.get("devices") or []
    libraries = {}
    for key in _LIBRARIES:
        info = result.get(key) or {}
        libraries[key] = {
            "loaded": bool(info.get("loaded")),
            "path": info.get("path"),
            "error": info.get("error"),
            "explanation": None if info.get("loaded") else _why(key, info),
        }
    return {
        "gpu": bool(devices),
        "devices": len(devices),
        "libraries": libraries,
    }


def probe_line(summary: dict[str, Any]) -> str:
    """``probe --quiet``: one line."""
    if summary["gpu"]:
        return f"GPU: {summary['devices']} device(s) readable"
    missing = [key for key, lib in summary["libraries"].items()
               if not lib["loaded"]]
    return ("GPU: none readable"
            + (f" ({', '.join(missing)} not loaded)" if missing else ""))


def render_probe(result: dict[str, Any]) -> str:
    lines = ["GPU probe (dlopen, no CUDA context created):"]
    for key, (name, _, _) in _LIBRARIES.items():
        info = result.get(key) or {}
        if info.get("loaded"):
            version = info.get("driver_version")
            extra = (
                ", already loaded in this process"
                if info.get("preloaded") else ""
            )
            lines.append(
                f"  {name}: loaded from {info.get('path')}, driver CUDA "
                f"version {version}{extra}"
                + (f"; error: {info['error']}" if info.get("error") else "")
            )
        else:
            lines.append("  " + _why(key, info))
    devices = result.get("devices") or []
    if not devices:
        lines.append(
            "  devices: none readable; stand-ins still work (they never "
            "need the probe), the pool just has no per-process readings"
        )
    for d in devices:
        lines.append(
            f"  cuda:{d.get('index')} {d.get('name')} ({d.get('uuid')}): "
            f"total {_gib(d.get('total'))}, free {_gib(d.get('free'))} "
            f"[{d.get('source')}]"
            + (f"; error: {d['error']}" if d.get("error") else "")
        )
        processes = d.get("processes")
        if processes is None:
            lines.append("    processes: not readable")
        else:
            for pid, used in sorted(processes.items()):
                lines.append(f"    pid {pid}: "
                             f"{'hidden' if used is None else _gib(used)}")
            if d.get("processes_truncated"):
                lines.append("    (more processes than listed)")
    if result.get("devices_truncated"):
        lines.append("  (more devices than listed)")
    elapsed = result.get("elapsed_ns")
    if elapsed is not None:
        lines.append(f"  probe took {elapsed / 1e6:.2f} ms")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# a running ComfyUI (status --url)

#: ComfyUI's default --listen address and --port.
DEFAULT_URL = "http://127.0.0.1:8188"


class RemoteError(Exception):
    """The one-line reason ``status --url`` could not read a ComfyUI."""


def fetch(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET ``URL/comfy_standin/status``; RemoteError says why not."""
    import json
    import urllib.error
    import urllib.request

    from ._server_route import ROUTE

    base = url.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    target = base + ROUTE
    try:
        with urllib.request.urlopen(target, timeout=timeout) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise RemoteError(
                f"{base} answers but has no {ROUTE}: install the node "
                f"entry (python -m comfy_standin install-node "
                f"PATH_TO_COMFYUI) and restart ComfyUI"
            ) from None
        raise RemoteError(f"{target}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RemoteError(
            f"nothing answers at {base} ({reason}); is ComfyUI running "
            f"there?"
        ) from None
    try:
        data = json.loads(body)
    except ValueError:
        raise RemoteError(f"{target}: the answer is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("pool"), dict):
        raise RemoteError(f"{target}: not a comfy_standin status answer")
    return data


def render_remote(data: dict[str, Any], url: str) -> str:
    """A running ComfyUI's status, printed like the local one."""
    reserve = data.get("reserve") or {}
    pool = data["pool"]
    lines = [
        f"ComfyUI at {url}: pid {data.get('pid')}, comfy_standin "
        f"{data.get('comfy_standin')}, adapter "
        f"{'installed' if data.get('adapter_installed') else 'NOT installed'}"
        f"; reserve published {_gib(reserve.get('extra_reserved_vram'))}, "
        f"worker charges {_gib(reserve.get('worker_charges'))}; "
        f"{pool.get('held', 0)} registered stand-in(s) held",
        render(pool, probe=False, no_workers=(
            "  no workers yet: no comfy-env node has registered a model "
            "in this ComfyUI since it started"
        )),
    ]
    if isinstance(data.get("probe"), dict):
        lines.append(render_probe(data["probe"]))
    return "\n".join(lines)
