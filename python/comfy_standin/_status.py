"""The status of a pool and of the GPU probe, here or in a running ComfyUI.

- ``collect(pool)``: a pool's workers, charges, stand-ins' receipts and
  boards as JSON-able data (what ``status --json`` prints and the status
  route serves); ``render`` makes it text.
- ``probe_summary`` and ``render_probe``: ``comfy_standin.probe()`` in
  words, saying which library did not load and why.
- ``fetch`` and ``render_remote`` (``status --url``): a running ComfyUI's
  status route read within one deadline, size and depth bounded, and
  checked against ``ANSWER``, the answer's schema.
"""

from __future__ import annotations

import http.client
import io
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from . import pool as _pool_module
from ._text import LOG_TEXT_LIMIT, visible

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
        "load_device": str(s.load_device),
        "loaded": loaded,
        "seq": seq,
        "age_seconds": round(age, 3),
        "source": source,
        "stale": s.stale,
        "eviction_deferred": s.eviction_deferred,
        "bad_replies": s.bad_replies,
        "board": _board_view(s),
    }


def _worker_name(worker: Any) -> str:
    """What a user knows the worker by: its ``name`` (comfy-env's
    SubprocessWorker is named after its pack's folder), else its repr; a
    worker whose repr raises is named by its type (a worker object is
    the adapter's or a pack's code)."""
    try:
        name = getattr(worker, "name", None)
    except Exception:  # noqa: BLE001 - a property that raises: no name
        name = None
    if type(name) is str and name:
        return name
    try:
        text = repr(worker)
    except Exception as exc:  # noqa: BLE001 - status must still print
        return (f"<{type(worker).__name__} object; its repr raised "
                f"{type(exc).__name__}>")
    return text if isinstance(text, str) else "<repr not a str>"


def _pid_of(worker: Any) -> int | None:
    try:
        return _pool_module._default_pid_of(worker)
    except Exception:  # noqa: BLE001 - a property that raises: unknown
        return None


def _python_pid(pool: Any, worker: Any, standins: list[Any]) -> int | None:
    """The worker Python's own pid, as its board handoff checked it (the
    peer of the handoff socket): the board the pool holds for `worker`,
    else one its stand-ins read.  None without a board."""
    held = pool._boards.get(id(worker))
    boards = [held[1]] if held is not None and held[0] is worker else []
    boards += [s.board[0] for s in standins if s.board is not None]
    for board in boards:
        if board.closed:
            continue
        owner = board.expected_owner
        if type(owner) is int and owner > 0:
            return owner
    return None


def collect(pool: Any) -> dict[str, Any]:
    """A JSON-able picture of `pool` (docs/cli.md, ``status``)."""
    by_worker = pool.standins()
    workers = []
    boards: dict[str, dict[str, Any]] = {}
    unlisted_by_worker = pool.unlisted()
    for worker in pool._ledger.keys():
        books = pool._ledger.find(worker)
        if books is None:
            continue
        charge = books.charge()
        unlisted = unlisted_by_worker.get(worker, 0)
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
        # Under a launcher that runs Python as its child (pixi, a shell
        # script that forks), the process comfy-env started is the
        # launcher: the handoff's peer is the worker Python itself.
        spawned = _pid_of(worker)
        pid = _python_pid(pool, worker, standins) or spawned
        workers.append({
            "worker": _worker_name(worker)[:LOG_TEXT_LIMIT],
            "pid": pid,
            "launcher_pid": spawned if spawned not in (None, pid) else None,
            "generation": books.generation,
            "alive": books.alive,
            "in_flight": books.in_flight,
            "charge": charge,
            "unlisted": unlisted,
            "models": [_standin_view(s) for s in standins],
        })
    return {
        "implementation": implementation_name(pool),
        "floor": pool.floor,
        "process_local": pool.process_local,
        "workers": workers,
        "graveyard": pool.graveyard_size(),
        "boards": list(boards.values()),
    }


def charge_text(charge: dict[str, Any]) -> str:
    """A worker's charge and what it is made of (docs/reserve.md): the
    floor is charged to every live worker however little it holds."""
    total, floor = charge["charge"], charge["floor"]
    if not charge["alive"]:
        return (f"charge {_gib(total)} (gone: its memory went back with "
                f"its process)")
    floor_text = (f"floor {_gib(floor)} (per process: CUDA context and "
                  f"handles, Pool.floor)")
    if charge["in_flight"]:
        return (f"charge {_gib(total)} = {floor_text} + sizes "
                f"{_gib(charge['sum_sizes'])} (in flight: all it could "
                f"load)")
    # A reading is the driver's figure for the worker's process (0: none).
    figures = [("loaded", charge["sum_loaded"]),
               ("peak", charge["sum_peak"]), ("held", charge["held"]),
               ("driver's reading", charge["reading"] or None)]
    largest = max(value or 0 for _, value in figures)
    return (f"charge {_gib(total)} = {floor_text} + {_gib(largest)}, the "
            f"largest of "
            + ", ".join(f"{name} {_gib(value)}" for name, value in figures))


def implementation_name(pool: Any) -> str:
    """``c`` or ``reference``: the names ``demo --impl`` takes."""
    impl = getattr(pool, "_impl", None)
    name = getattr(impl, "__name__", "")
    return "reference" if name.endswith("._reference") else "c"


def no_workers_line(program: str) -> str:
    """Plain ``status`` where this process has no workers (a command line
    never has any: comfy-env registers them inside ComfyUI)."""
    return (
        f"no workers in this process: '{program} status' shows its own "
        f"pool, and only ComfyUI's process has workers; to see "
        f"ComfyUI's, run '{program} status --url [URL]' (default "
        f"{DEFAULT_URL})"
    )


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
    """`status` (from `collect`, or a checked remote answer's pool) as
    text; every string in it is made `visible` first."""
    status = _visible_tree(status)
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
        state = "alive" if w["alive"] else "gone"
        if w["in_flight"]:
            state += f", {w['in_flight']} call(s) in flight"
        launcher = (f" (started through launcher pid {w['launcher_pid']})"
                    if w.get("launcher_pid") is not None else "")
        lines.append(
            f"  worker {w['worker']} pid {w['pid'] or '-'}{launcher} "
            f"generation {w['generation']}: {state}; "
            + charge_text(w["charge"])
            + (f"; unlisted {_gib(w['unlisted'])} (held by the worker, "
               f"no listed model accounts for it)"
               if w.get("unlisted") else "")
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
            seq = "no seq yet" if m["seq"] is None else f"seq {m['seq']}"
            lines.append(
                f"    {m['model_id']:<12} {m['kind']:<8} "
                f"{_gib(m['loaded'])} of {_gib(m['size'])}, {seq}, "
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
                f"    {b['name']}: {b.get('slots')} slots, generation "
                f"{b.get('generation')}, owner pid {b.get('owner_pid')} "
                f"(expected {b.get('expected_owner')})"
                f"{', worker gone' if b.get('worker_gone') else ''}; models "
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
        hint += f" [{variable}={visible(override)}]"
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


def no_gpu_reason(summary: dict[str, Any]) -> str:
    """``probe --require-gpu`` without a GPU: why, in one line (each
    library: not loaded and why, or loaded with no device)."""
    parts = []
    for key, lib in summary["libraries"].items():
        name = _LIBRARIES[key][0]
        error = lib["error"]
        if lib["loaded"]:
            parts.append(f"{name} loaded, no device"
                         + (f" ({visible(error, 100)})" if error else ""))
        else:
            parts.append(f"{name} not loaded "
                         f"({visible(error or 'unknown reason', 100)})")
    return "no GPU readable: " + "; ".join(parts)


def render_probe(result: dict[str, Any]) -> str:
    """The probe's result as text, every string made `visible`."""
    result = _visible_tree(result)
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

#: What the node entry serves on ComfyUI's server (_server_route.py): the
#: status answer, and the live VRAM page that reads it.
ROUTE = "/comfy_standin/status"
PAGE_ROUTE = "/comfy_standin/"
#: ComfyUI's default --port, and with its default --listen address.
DEFAULT_PORT = 8188
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
#: What ``status --url`` takes, said in its errors.
URL_FORM = (f"http://HOST[:PORT][/PATH] (PORT defaults to {DEFAULT_PORT}), "
            f"e.g. {DEFAULT_URL}")
#: Seconds the whole request may take (connect, send, every read).
DEFAULT_TIMEOUT = 5.0
#: The largest answer read; a status of 100 workers is about 0.5 MiB.
MAX_BODY = 4 << 20
#: Deepest nesting of lists and objects accepted in an answer.
MAX_DEPTH = 32
#: Most lists and objects in an answer (a status has about five per
#: model): bounds the parsed answer's memory to a few times MAX_BODY,
#: where 4 MiB of ``[{},{},...]`` would parse into ~190 MiB of dicts.
MAX_CONTAINERS = 50_000
_READ_PIECE = 64 << 10


class RemoteError(Exception):
    """The one-line reason ``status --url`` could not read a ComfyUI."""


class Remote:
    """Where ``status --url`` reads: `base` as the user will recognise it
    (scheme, host, port, path prefix), and the parts to connect to.  A
    URL without a port is ComfyUI's own port, 8188 (https: 443, a proxy
    in front of ComfyUI); any other form is a RemoteError naming the
    part that is wrong."""

    def __init__(self, url: str) -> None:
        import urllib.parse

        text = url.strip()
        shown = visible(text)
        if not text:
            raise RemoteError(f"the URL is empty; expected {URL_FORM}")
        if not text.isprintable() or any(c.isspace() for c in text):
            raise RemoteError(f"{shown}: not a URL (it has spaces or "
                              f"control characters); expected {URL_FORM}")
        if "://" not in text:
            text = "http://" + text
        try:
            parts = urllib.parse.urlsplit(text)
        except ValueError:
            raise RemoteError(
                f"{shown}: not a URL (an IPv6 address needs both "
                f"brackets, e.g. http://[::1]:{DEFAULT_PORT}); expected "
                f"{URL_FORM}") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise RemoteError(f"{shown}: only http:// and https:// URLs "
                              f"are read; expected {URL_FORM}")
        if "@" in parts.netloc:
            raise RemoteError(f"{shown}: credentials in the URL are not "
                              f"sent; ComfyUI's server asks for none")
        if not parts.hostname:
            raise RemoteError(f"{shown}: the URL names no host; expected "
                              f"{URL_FORM}")
        # The port is what follows the host (after its brackets, for an
        # IPv6 address); urlsplit's own error for it names no part.
        after = parts.netloc.rpartition("]")[2] if "[" in parts.netloc \
            else parts.netloc
        _, colon, port_text = after.partition(":")
        if colon and port_text:
            if not (port_text.isascii() and port_text.isdigit()):
                raise RemoteError(
                    f"{shown}: the port {visible(port_text, 40)!r} is not "
                    f"a number; expected {URL_FORM}")
            port = int(port_text)
            if not 0 < port < 65536:
                raise RemoteError(
                    f"{shown}: the port {port} is not one of 1 to 65535; "
                    f"expected {URL_FORM}")
        else:
            port = 443 if scheme == "https" else DEFAULT_PORT
        self.scheme = scheme
        self.host = parts.hostname
        self.port = port
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.base = visible(f"{scheme}://{host}:{port}{self.prefix}")

    def url(self, route: str) -> str:
        return f"{self.base}{route}"


def _resolve(host: str, port: int, deadline: float) -> list[Any]:
    """getaddrinfo within the deadline (the resolver's own timeouts can
    be far longer: it runs in a daemon thread that is left to finish)."""
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                  flags=socket.AI_NUMERICHOST)
    result: list[Any] = []

    def lookup() -> None:
        try:
            result.append(socket.getaddrinfo(host, port,
                                             type=socket.SOCK_STREAM))
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            result.append(exc)

    thread = threading.Thread(target=lookup, name="comfy_standin resolve",
                              daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not result:
        raise TimeoutError(f"resolving {host} took too long")
    if isinstance(result[0], Exception):
        raise result[0]
    return list(result[0])


class _DeadlineIO:
    """A connected socket as http.client uses it, where every send and
    every receive gets only the time left before one deadline: a server
    that drips a byte at a time cannot hold the client past it."""

    def __init__(self, sock: Any, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        # As with a socket's own makefile(): the socket closes when the
        # connection and every reader made from it are closed.
        self._users = 1

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self._sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._arm()
        self._sock.sendall(data)

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        self._arm()
        return int(self._sock.recv_into(buffer, nbytes))

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        self._users += 1
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        self._users -= 1
        if self._users <= 0:
            self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    def __init__(self, io: _DeadlineIO) -> None:
        super().__init__()
        self._io = io

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._io.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._io.close()
        super().close()


def _connection(remote: Remote, deadline: float) -> Any:
    """An http.client connection whose every step keeps to `deadline`."""
    def create(address: tuple[str, int], timeout: Any = None,
               source_address: Any = None) -> Any:
        last: Exception = OSError(f"no address for {address[0]}")
        for family, kind, proto, _, sockaddr in _resolve(
                address[0], address[1], deadline)[:4]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline passed")
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(left)
                sock.connect(sockaddr)
            except OSError as exc:
                sock.close()
                last = exc
                continue
            return sock
        raise last

    base = (http.client.HTTPSConnection if remote.scheme == "https"
            else http.client.HTTPConnection)

    class Connection(base):  # type: ignore[valid-type,misc]
        def connect(self) -> None:
            self.timeout = max(0.001, deadline - time.monotonic())
            super().connect()
            self.sock = _DeadlineIO(self.sock, deadline)

    conn = Connection(remote.host, remote.port)
    conn._create_connection = create
    return conn


def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


def get(url: str, route: str, timeout: float = DEFAULT_TIMEOUT,
        accept: str = "application/json",
        max_body: int = MAX_BODY) -> bytes:
    """GET ``URL + route`` within `timeout` seconds overall; the body, of
    the `accept` media type, at most `max_body` bytes.  Any other
    outcome (no answer, a redirect, an error status, another type, a
    truncated or oversized body, the deadline) is a RemoteError."""
    deadline = time.monotonic() + timeout
    remote = Remote(url)
    target = remote.url(route)
    conn = _connection(remote, deadline)
    try:
        try:
            conn.request("GET", remote.prefix + route,
                         headers={"Accept": accept,
                                  "Connection": "close"})
            reply = conn.getresponse()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if isinstance(exc, TimeoutError):
                raise RemoteError(
                    f"{target}: no answer within {timeout:g} s"
                ) from None
            raise RemoteError(
                f"nothing answers at {remote.base} "
                f"({visible(_reason(exc))}); is ComfyUI running there?"
            ) from None
        status = reply.status
        if status == 404:
            raise RemoteError(
                f"{remote.base} answers but has no {route}: install the "
                f"node entry (python -m comfy_standin install-node "
                f"PATH_TO_COMFYUI) and restart ComfyUI"
            )
        if 300 <= status < 400:
            where = reply.getheader("Location") or "nowhere"
            raise RemoteError(
                f"{target}: HTTP {status}, a redirect to "
                f"{visible(where)} (not followed: give that address)"
            )
        if status != 200:
            said = _error_said(reply)
            raise RemoteError(f"{target}: HTTP {status} "
                              f"{visible(reply.reason)}"
                              + (f": {said}" if said else ""))
        kind = _media_type(reply.getheader("Content-Type"))
        if kind != accept:
            raise RemoteError(
                f"{target}: the answer is {visible(kind or 'untyped')}, "
                f"not {accept}"
            )
        # http.client has checked Content-Length (reply.length is None
        # without one, or when chunked).
        promised = reply.length
        if promised is not None and promised > max_body:
            raise RemoteError(
                f"{target}: the answer is {promised} bytes, more than "
                f"the {max_body >> 20} MiB this client reads"
            )
        pieces: list[bytes] = []
        size = 0
        try:
            while True:
                piece = reply.read(_READ_PIECE)
                if not piece:
                    break
                size += len(piece)
                if size > max_body:
                    raise RemoteError(
                        f"{target}: the answer is more than the "
                        f"{max_body >> 20} MiB this client reads"
                    )
                pieces.append(piece)
        except TimeoutError:
            raise RemoteError(
                f"{target}: the answer did not arrive whole within "
                f"{timeout:g} s"
            ) from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise RemoteError(
                f"{target}: the answer was cut short "
                f"({visible(_reason(exc))})"
            ) from None
        if promised is not None and size != promised:
            raise RemoteError(
                f"{target}: the answer was cut short ({size} of the "
                f"{promised} bytes promised)"
            )
        return b"".join(pieces)
    finally:
        conn.close()


def _error_said(reply: Any) -> str | None:
    """The route's own ``{"error": TEXT}`` of an error answer (500, 503),
    read within the request's deadline; None for anything else."""
    if _media_type(reply.getheader("Content-Type")) != "application/json" \
            or not 0 < (reply.length or 0) <= _READ_PIECE:
        return None
    try:
        said = json.loads(reply.read(_READ_PIECE),
                          parse_constant=_reject_constant,
                          parse_float=_finite)
    except (OSError, http.client.HTTPException, ValueError,
            RecursionError):
        return None
    error = said.get("error") if type(said) is dict else None
    return visible(error) if type(error) is str else None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, http.client.IncompleteRead):
        return f"{len(exc.partial)} bytes of the promised length"
    reason = getattr(exc, "reason", None) or exc
    return str(reason) or type(exc).__name__


# The status answer's schema (``_server_route.payload``): one table with
# three readers.  ``parse_answer`` checks every answer against it before
# anything is rendered (keys it does not name are let through, so a newer
# ComfyUI's answer still reads); the route's tests hold every answer the
# route can build to it strictly (no key it does not name,
# tests/test_status_schema.py); tools/clidoc.py writes docs/cli.md's field
# table from it.  Nesting is bounded by the table itself.

_INT_BOUND = 1 << 64


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string",
            bool: "a boolean", type(None): "null"}.get(
                type(value), "a number")


def _wrong(where: str, wanted: str, value: Any) -> RemoteError:
    return RemoteError(f"not a comfy_standin status answer: {where} "
                       f"should be {wanted}, is {_kind(value)}")


class Shape:
    """What one JSON value must be.  `kind` names it in docs/cli.md;
    `check` raises RemoteError naming the field (`where`)."""

    kind = ""

    def check(self, value: Any, where: str, strict: bool) -> None:
        raise NotImplementedError

    def fields(self, path: str) -> Iterator[tuple[str, Field]]:
        """(path, field) of every object field inside, depth first."""
        return iter(())


class _Scalar(Shape):
    def __init__(self, kind: str, wanted: str,
                 test: Callable[[Any], bool]) -> None:
        self.kind, self.wanted, self.test = kind, wanted, test

    def check(self, value: Any, where: str, strict: bool) -> None:
        if not self.test(value):
            raise _wrong(where, self.wanted, value)


INTEGER = _Scalar(
    "integer", "an integer of at most 64 bits",
    lambda v: type(v) is int and -_INT_BOUND < v < _INT_BOUND)
NUMBER = _Scalar(
    "number", "a finite number",
    lambda v: type(v) in (int, float) and math.isfinite(v)
    and -_INT_BOUND < v < _INT_BOUND)
STRING = _Scalar("string", "a string", lambda v: type(v) is str)
BOOLEAN = _Scalar("boolean", "true or false", lambda v: type(v) is bool)


class Nullable(Shape):
    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.kind = f"{shape.kind} or null"

    def check(self, value: Any, where: str, strict: bool) -> None:
        if value is not None:
            self.shape.check(value, where, strict)

    def fields(self, path: str) -> Iterator[tuple[str, Field]]:
        return self.shape.fields(path)


class ListOf(Shape):
    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.kind = "list of " + {"object": "objects", "integer": "integers",
                                  "string": "strings"}.get(shape.kind,
                                                           shape.kind)

    def check(self, value: Any, where: str, strict: bool) -> None:
        if type(value) is not list:
            raise _wrong(where, "a list", value)
        for i, item in enumerate(value):
            self.shape.check(item, f"{where}[{i}]", strict)

    def fields(self, path: str) -> Iterator[tuple[str, Field]]:
        return self.shape.fields(path + "[]")


class MapOf(Shape):
    """An object whose keys are names (`key` in the docs: a device, a
    pid) and whose values are all `shape`."""

    def __init__(self, key: str, shape: Shape) -> None:
        self.key, self.shape = key, shape
        self.kind = f"object of {key}: {shape.kind}"

    def check(self, value: Any, where: str, strict: bool) -> None:
        if type(value) is not dict:
            raise _wrong(where, "an object", value)
        for key, item in value.items():
            self.shape.check(item, f"{where}[{visible(key, 40)}]", strict)

    def fields(self, path: str) -> Iterator[tuple[str, Field]]:
        return self.shape.fields(f"{path}.{self.key}")


class Field(NamedTuple):
    shape: Shape
    required: bool
    doc: str


def always(shape: Shape, doc: str) -> Field:
    return Field(shape, True, doc)


def sometimes(shape: Shape, doc: str) -> Field:
    return Field(shape, False, doc)


class Object(Shape):
    """An object with the named fields; `either`: exactly one of these
    keys is present."""

    kind = "object"

    def __init__(self, fields: dict[str, Field],
                 either: tuple[str, ...] = ()) -> None:
        self.table = fields
        self.either = either

    def check(self, value: Any, where: str, strict: bool) -> None:
        if type(value) is not dict:
            raise _wrong(where, "an object", value)
        for key, field in self.table.items():
            if key in value:
                field.shape.check(value[key], f"{where}.{key}", strict)
            elif field.required:
                raise RemoteError(f"not a comfy_standin status answer: "
                                  f"{where}.{key} is missing")
        if self.either and sum(k in value for k in self.either) != 1:
            raise RemoteError(
                f"not a comfy_standin status answer: {where} should have "
                f"one of {' or '.join(self.either)}")
        if strict:
            for key in value:
                if key not in self.table:
                    raise RemoteError(
                        f"not a comfy_standin status answer: "
                        f"{where}.{visible(key, 40)} is not in the schema")

    def fields(self, path: str) -> Iterator[tuple[str, Field]]:
        for key, field in self.table.items():
            inner = f"{path}.{key}" if path else key
            yield inner, field
            yield from field.shape.fields(inner)


_BYTES = Nullable(INTEGER)

LIBRARY = Object({
    "loaded": always(BOOLEAN, "opened and initialised"),
    "error": always(Nullable(STRING), "why not loaded, or the first "
                    "library-level failure"),
    "path": always(Nullable(STRING), "the file it was loaded from"),
    "driver_version": always(Nullable(INTEGER), "the driver's CUDA "
                             "version number, e.g. 12040"),
    "preloaded": always(BOOLEAN, "this process had it loaded already"),
})
DEVICE = Object({
    "index": always(INTEGER, "the CUDA ordinal (`cuda:N`), else NVML's"),
    "nvml_index": always(Nullable(INTEGER), "the matching NVML device"),
    "name": always(Nullable(STRING), "from the driver, else NVML"),
    "uuid": always(Nullable(STRING), "`GPU-...`"),
    "total": always(_BYTES, "bytes"),
    "free": always(_BYTES, "device-wide free bytes"),
    "source": always(Nullable(STRING), "`nvml` or `cuda`: where total "
                     "and free came from"),
    "error": always(Nullable(STRING), "the first failure reading this "
                    "device"),
    "processes": always(Nullable(MapOf("PID", _BYTES)), "bytes used per "
                        "process id (null: hidden by the driver); null "
                        "when not readable"),
    "processes_error": always(Nullable(STRING), "why `processes` is "
                              "null"),
    "process_entry_size": always(Nullable(INTEGER), "the driver's entry "
                                 "size measured: 16, 24 or 32"),
    "processes_truncated": always(BOOLEAN, "more than 128 processes"),
})
PROBE = Object({
    "cuda": always(LIBRARY, "the CUDA driver (libcuda.so.1)"),
    "nvml": always(LIBRARY, "NVML (libnvidia-ml.so.1)"),
    "devices": always(ListOf(DEVICE), "one per device readable"),
    "devices_truncated": always(BOOLEAN, "more devices than listed"),
    "elapsed_ns": always(INTEGER, "how long the probe took"),
})
PROBE_SUMMARY = Object({
    "gpu": always(BOOLEAN, "a device is readable"),
    "devices": always(INTEGER, "how many"),
    "libraries": always(MapOf("LIBRARY", Object({
        "loaded": always(BOOLEAN, "as in `probe`"),
        "path": always(Nullable(STRING), "as in `probe`"),
        "error": always(Nullable(STRING), "as in `probe`"),
        "explanation": always(Nullable(STRING), "why it did not load, in "
                              "words (null when loaded)"),
    })), "`cuda` and `nvml`"),
})
BOARD_READING = Object({
    "name": always(Nullable(STRING), "the board's name (null once closed)"),
    "slot": always(INTEGER, "the model's slot"),
    "status": always(STRING, "the slot's reading: `valid`, `not "
                     "attached`, `stale heartbeat`, `dead owner`, `torn`, "
                     "`board closed`, ..."),
    "loaded": always(_BYTES, "the board's bytes when valid, else null"),
})
CHARGE = Object({
    "charge": always(INTEGER, "what the worker costs the card: 0 when "
                     "gone; in flight `sum_sizes` + `floor`; idle the "
                     "largest of `sum_loaded`, `sum_peak`, `held` and "
                     "`reading`, + `floor`"),
    "sum_sizes": always(INTEGER, "its models' sizes"),
    "sum_loaded": always(INTEGER, "what its stand-ins answer as loaded"),
    "sum_peak": always(INTEGER, "its models' admission peaks"),
    "held": always(INTEGER, "what the worker last reported holding"),
    "reading": always(INTEGER, "the driver's figure for the worker's "
                      "process (NVML, read by the probe with no message), "
                      "its CUDA context included; 0: no reading"),
    "floor": always(INTEGER, "the per-process floor (CUDA context and "
                    "handles, `Pool.floor`); 0 when gone"),
    "in_flight": always(INTEGER, "calls in flight"),
    "models": always(INTEGER, "models on its books"),
    "alive": always(BOOLEAN, "as the ledger has it"),
    "held_from_reading": always(BOOLEAN, "the driver's reading, not the "
                                "worker's report, set `held`"),
})
MODEL = Object({
    "model_id": always(STRING, "comfy-env's model key"),
    "kind": always(STRING, "`unet`, `vae`, ... (`other`)"),
    "size": always(INTEGER, "bytes"),
    "generation": always(INTEGER, "the worker generation it belongs to"),
    "load_device": always(STRING, "where it loads"),
    "loaded": always(INTEGER, "bytes on the card, what ComfyUI reads "
                     "(`loaded_size()`): the receipt, or the board's "
                     "reading when `source` is `board`"),
    "seq": always(Nullable(INTEGER), "the worker's sequence number of "
                  "the receipt; null before the worker's first word "
                  "(`source` `registered`)"),
    "age_seconds": always(NUMBER, "since `loaded` was written"),
    "source": always(STRING, "who said `loaded`: `registered`, `load "
                     "echo`, `unload echo`, `detach echo`, `census`, "
                     "`board`, `assigned`, `worker gone`"),
    "stale": always(BOOLEAN, "its worker is gone or restarted"),
    "eviction_deferred": always(BOOLEAN, "the worker refused the last "
                                "eviction"),
    "bad_replies": always(INTEGER, "replies refused as malformed"),
    "board": always(Nullable(BOARD_READING), "its board slot, null with "
                    "no board"),
})
WORKER = Object({
    "worker": always(STRING, "the worker's name (comfy-env's: the pack's "
                     "folder name), else its repr"),
    "pid": always(Nullable(INTEGER), "the worker Python's process id: "
                  "the board handoff's peer, else the process comfy-env "
                  "started"),
    "launcher_pid": always(Nullable(INTEGER), "the process comfy-env "
                           "started, when it is not the worker Python (a "
                           "launcher that runs Python as its child)"),
    "generation": always(INTEGER, "its process generation"),
    "alive": always(BOOLEAN, "false once it died"),
    "in_flight": always(INTEGER, "calls in flight"),
    "charge": always(CHARGE, "its charge and the figures it came from"),
    "models": always(ListOf(MODEL), "its stand-ins"),
    "unlisted": sometimes(INTEGER, "bytes the worker holds on the card that "
                       "none of its listed models accounts for (its "
                       "`held`, or the driver's `reading` less the "
                       "`floor`, less `sum_loaded`; `Pool.unlisted`)"),
})
BOARD = Object({
    "name": always(STRING, "the board's name"),
    "closed": always(BOOLEAN, "closed (its worker gone)"),
    "models": always(ListOf(STRING), "model ids on it"),
    "slots": sometimes(INTEGER, "slots (not when closed)"),
    "generation": sometimes(INTEGER, "the worker generation it is for"),
    "owner_pid": sometimes(Nullable(INTEGER), "the pid the worker wrote "
                           "in its header"),
    "expected_owner": sometimes(Nullable(INTEGER), "the pid the host "
                                "checked at the handoff"),
    "attached": sometimes(BOOLEAN, "the worker has mapped it"),
    "worker_gone": sometimes(BOOLEAN, "the host marked its worker gone"),
})
POOL = Object({
    "implementation": always(STRING, "`c` or `reference`"),
    "floor": always(INTEGER, "the per-process floor each live worker is "
                    "charged (CUDA context and handles)"),
    "process_local": always(BOOLEAN, "free memory is per process (WDDM)"),
    "workers": always(ListOf(WORKER), "one per worker on the books"),
    "graveyard": always(INTEGER, "stand-ins of dead or restarted workers "
                        "kept until the next boundary"),
    "boards": always(ListOf(BOARD), "boards the stand-ins are attached "
                     "to"),
    "held": sometimes(INTEGER, "registrations held for ComfyUI (the "
                      "route's answer only)"),
    "probe": sometimes(PROBE, "the probe (`status --json` only)"),
    "probe_summary": sometimes(PROBE_SUMMARY, "the probe in words "
                               "(`status --json` only)"),
})
ENTRY = Object({
    "index": always(INTEGER, "its index in `current_loaded_models`"),
    "device": sometimes(STRING, "its device"),
    "currently_used": sometimes(BOOLEAN, "ComfyUI's flag"),
    "dead": sometimes(BOOLEAN, "its model was collected"),
    "size": sometimes(_BYTES, "`model_memory()`"),
    "loaded": sometimes(_BYTES, "`model_loaded_memory()`"),
    "offloaded": sometimes(_BYTES, "`model_offloaded_memory()`"),
    "patcher": sometimes(Nullable(STRING), "the patcher's class"),
    "model": sometimes(Nullable(STRING), "the model's class"),
    "dynamic": sometimes(BOOLEAN, "`is_dynamic()`"),
    "refcount": sometimes(Nullable(INTEGER), "references to the patcher, "
                          "counted at this request"),
    "standin": sometimes(Nullable(Object({
        "worker": always(STRING, "as `pool.workers[].worker`"),
        "model_id": always(STRING, "as `pool.workers[].models[].model_id`"),
    })), "a comfy_standin stand-in's worker and model id, else null"),
    "error": sometimes(STRING, "why the rest could not be read"),
})
COMFYUI = Object({
    "available": always(BOOLEAN, "`comfy.model_management` was read"),
    "why": sometimes(STRING, "why not (when not available)"),
    "models": sometimes(ListOf(ENTRY), "`current_loaded_models`, the "
                        "first 256"),
    "models_truncated": sometimes(BOOLEAN, "there were more"),
    "devices": sometimes(MapOf("DEVICE", Object({
        "free": always(_BYTES, "`get_free_memory(device)`"),
        "total": always(_BYTES, "`get_total_memory(device)`"),
        "free_error": sometimes(STRING, "why free is null"),
        "total_error": sometimes(STRING, "why total is null"),
    })), "memory per device its models are on"),
    "eviction": sometimes(MapOf("DEVICE", Object({
        "order": always(ListOf(INTEGER), "indexes in the order "
                        "`free_memory` tries them"),
        "next": always(INTEGER, "the first"),
        "why": always(STRING, "why it is first"),
    })), "the eviction order per device"),
})
ANSWER = Object({
    "format": always(INTEGER, "1"),
    "comfy_standin": always(STRING, "the version ComfyUI runs"),
    "pid": always(INTEGER, "ComfyUI's process id"),
    "adapter_installed": always(BOOLEAN, "comfy-env builds comfy_standin "
                                "stand-ins"),
    "pool": sometimes(POOL, "the default pool, as `status --json` shows "
                      "it"),
    "pool_error": sometimes(STRING, "why the pool could not be read "
                            "(instead of `pool`)"),
    "reserve": always(Object({
        "extra_reserved_vram": always(_BYTES, "ComfyUI's published "
                                      "`EXTRA_RESERVED_VRAM`"),
        "worker_charges": always(_BYTES, "the sum of worker charges"),
    }), "the reserve"),
    "probe": always(PROBE, "the GPU probe (docs/probe.md)"),
    "probe_summary": always(PROBE_SUMMARY, "the probe in words"),
    "comfyui": always(COMFYUI, "a read of `comfy.model_management`"),
}, either=("pool", "pool_error"))


def check_answer(data: Any, strict: bool = False) -> None:
    """RemoteError unless `data` is of the status shape; `strict`: also
    unless every key in it is one the schema names."""
    ANSWER.check(data, "answer", strict)


def _depth_within(data: Any, limit: int) -> bool:
    """No list or object in `data` nested deeper than `limit` (walked
    without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = list(value.values())
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: a JSON number, but no float
        raise ValueError(f"{text[:24]} is not a finite number")
    return value


def parse_answer(body: bytes, where: str) -> dict[str, Any]:
    """A status answer from raw bytes: JSON (no NaN or Infinity), nested
    at most MAX_DEPTH deep, of the status shape; else RemoteError."""
    if body.count(b"{") + body.count(b"[") > MAX_CONTAINERS:
        raise RemoteError(f"{where}: the answer has more than "
                          f"{MAX_CONTAINERS} lists and objects; not a "
                          f"status")
    try:
        data = json.loads(body, parse_constant=_reject_constant,
                          parse_float=_finite)
    except RecursionError:
        raise RemoteError(f"{where}: the answer is nested too deeply "
                          f"to be a status") from None
    except ValueError as exc:  # includes UnicodeDecodeError
        raise RemoteError(f"{where}: the answer is not JSON "
                          f"({visible(str(exc), 80)})") from None
    if not _depth_within(data, MAX_DEPTH):
        raise RemoteError(f"{where}: the answer is nested deeper than "
                          f"{MAX_DEPTH} levels; not a status")
    try:
        check_answer(data)
    except RemoteError as exc:
        raise RemoteError(f"{where}: {exc}") from None
    return data  # type: ignore[no-any-return]


def fetch(url: str, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """GET ``URL/comfy_standin/status`` and check its shape; RemoteError
    says why not, in one line."""
    body = get(url, ROUTE, timeout)
    return parse_answer(body, Remote(url).url(ROUTE))


def page_address(url: str) -> str:
    """Where the live VRAM page of the ComfyUI at `url` is served."""
    return Remote(url).url(PAGE_ROUTE)


def _visible_tree(value: Any) -> Any:
    """A copy of checked data with every string made `visible`."""
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, list):
        return [_visible_tree(item) for item in value]
    if isinstance(value, dict):
        return {visible(key) if isinstance(key, str) else key:
                _visible_tree(item) for key, item in value.items()}
    return value


def render_remote(data: dict[str, Any], url: str) -> str:
    """A running ComfyUI's status (checked by `parse_answer`), printed
    like the local one, every string made `visible`."""
    data = _visible_tree(data)
    reserve = data["reserve"]
    pool = data.get("pool")
    held = f"{pool.get('held', 0)} registered stand-in(s) held" \
        if pool is not None else "its pool not readable"
    lines = [
        f"ComfyUI at {Remote(url).base}: pid {data['pid']}, comfy_standin "
        f"{data['comfy_standin']}, adapter "
        f"{'installed' if data['adapter_installed'] else 'NOT installed'}"
        f"; reserve published {_gib(reserve['extra_reserved_vram'])}, "
        f"worker charges {_gib(reserve['worker_charges'])}; {held}",
    ]
    if pool is None:
        lines.append(f"  the pool could not be read in ComfyUI's process: "
                     f"{data['pool_error']}")
    else:
        lines.append(render(pool, probe=False, no_workers=(
            "  no workers yet: no comfy-env node has registered a model "
            "in this ComfyUI since it started"
        )))
    lines.append(render_probe(data["probe"]))
    return "\n".join(lines)
