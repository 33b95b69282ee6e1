"""A real HTTP server on 127.0.0.1 that says exactly what a test scripts.

``ScriptedServer`` accepts connections on a thread; for each, it reads the
request head, then plays the current `reply`: a list of ``(pause, bytes)``
steps (sleep `pause` seconds, then send the bytes) and closes.  A client
that gave up is not an error.  The test changes ``server.reply`` between
requests; ``server.requests`` keeps each request head it read.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

Steps = list[tuple[float, bytes]]


def response(body: bytes, status: str = "200 OK",
             content_type: str | None = "application/json",
             length: int | None = None,
             headers: tuple[str, ...] = ()) -> bytes:
    """A whole HTTP/1.1 response; `length` overrides Content-Length
    (None: the body's own; -1: no Content-Length header)."""
    lines = [f"HTTP/1.1 {status}"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if length != -1:
        size = len(body) if length is None else length
        lines.append(f"Content-Length: {size}")
    lines.extend(headers)
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_response(data: Any, **kwargs: Any) -> bytes:
    return response(json.dumps(data).encode(), **kwargs)


class ScriptedServer:
    def __init__(self, reply: Steps | None = None) -> None:
        self.reply: Steps = reply or [(0.0, response(b"{}"))]
        self.requests: list[bytes] = []
        #: Per connection the client closed before the script ended: how
        #: many of the script's steps had been sent.
        self.hung_up_after: list[int] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            thread = threading.Thread(target=self._serve, args=(conn,),
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        steps = list(self.reply)
        with conn:
            conn.settimeout(5)
            head = b""
            try:
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                self.requests.append(head)
                sent = 0
                for pause, data in steps:
                    if pause and self._stop.wait(pause):
                        return
                    if data:
                        try:
                            conn.sendall(data)
                        except OSError:  # the client gave up
                            self.hung_up_after.append(sent)
                            return
                    sent += 1
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                return  # the client gave up: its business

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._acceptor.join()
        for thread in self._threads:
            thread.join(10)

    def __enter__(self) -> ScriptedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drip(data: bytes, every: float) -> Steps:
    """`data` one byte at a time, `every` seconds apart."""
    return [(every, data[i:i + 1]) for i in range(len(data))]

