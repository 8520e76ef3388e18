"""A real HTTP/1.1 webhook receiver on loopback, scriptable per request.

It records every request it answers (headers, body, when it started and ended), so tests
can check order, overlap and retries from what the endpoint saw. `stop()` closes the
listening socket and every kept-alive connection: the relay sees the endpoint go away.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from tests.harness import Service, free_port


@dataclass
class Delivery:
    """One request as the endpoint saw it."""

    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    attempt: int  # 1 for the first request carrying this message-id, 2 for the next...
    started: float  # time.monotonic() when the request had been read
    ended: float = 0.0  # when the answer was about to be written
    status: int = 0  # 0: the client was gone before the answer could be written

    @property
    def message_id(self) -> str:
        return self.headers.get("message-id", "")

    @property
    def key(self) -> str | None:
        raw = self.headers.get("message-key")
        return None if raw is None else unquote(raw)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    delay: float = 0.0  # seconds to hold the request before answering


Responder = Callable[[Delivery], Reply]


def always_ok(_: Delivery) -> Reply:
    return Reply()


class LimitedTo:
    """A receiver's rate limit: a request beyond `limit` in the last `window` seconds
    (by arrival) is answered 429 with `Retry-After: 1`; the others go to `inner`."""

    def __init__(self, limit: int, inner: Responder = always_ok, window: float = 1.0) -> None:
        self.limit = limit
        self.inner = inner
        self.window = window
        self.refused = 0
        self._accepted: deque[float] = deque()
        self._lock = threading.Lock()

    def __call__(self, delivery: Delivery) -> Reply:
        with self._lock:
            now = time.monotonic()  # taken under the lock: arrivals in order
            while self._accepted and now - self._accepted[0] >= self.window:
                self._accepted.popleft()
            if len(self._accepted) >= self.limit:
                self.refused += 1
                return Reply(429, headers={"Retry-After": "1"}, body=b"rate limited")
            self._accepted.append(now)
        return self.inner(delivery)


def most_in_a_window(deliveries: list[Delivery], window: float = 1.0) -> int:
    """The most requests that arrived within any `window` seconds."""
    starts = sorted(d.started for d in deliveries)
    most, first = 0, 0
    for last, start in enumerate(starts):
        while start - starts[first] >= window:
            first += 1
        most = max(most, last - first + 1)
    return most


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # The default backlog of 5 drops connection attempts made at once (a pool opening
    # its connections), and a dropped SYN is retried only after a second.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: Any, owner: WebhookServer) -> None:
        self.owner = owner
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # clients that gave up (timeouts) close mid-answer; that is the point


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real endpoints do
    server: _Server

    def do_POST(self) -> None:
        owner = self.server.owner
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            return  # the client died mid-request: nothing was delivered
        headers = {name.lower(): value for name, value in self.headers.items()}
        delivery = owner._begin(self.path, headers, body)
        reply = owner.respond(delivery)
        if reply.delay:
            time.sleep(reply.delay)
        answered_at = time.monotonic()
        try:
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)
            self.wfile.flush()
        except OSError:
            owner._end(delivery, 0, answered_at)  # the client had gone: it saw no answer
            raise
        owner._end(delivery, reply.status, answered_at)

    def log_message(self, format: str, *args: object) -> None:
        return


class WebhookServer(Service):
    def __init__(self, respond: Responder = always_ok, port: int | None = None) -> None:
        self.respond = respond
        self.port = port or free_port()
        self.deliveries: list[Delivery] = []
        self._attempts: dict[str, int] = {}
        self._in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server = _Server(("127.0.0.1", self.port), _Handler, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with server.connections_lock:
            open_connections = list(server.connections)
        for conn in open_connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    # --- called by the handler threads ---

    def _begin(self, path: str, headers: dict[str, str], body: bytes) -> Delivery:
        with self._lock:
            mid = headers.get("message-id", "")
            self._attempts[mid] = self._attempts.get(mid, 0) + 1
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            return Delivery(path, headers, body, self._attempts[mid], time.monotonic())

    def _end(self, delivery: Delivery, status: int, answered_at: float) -> None:
        with self._lock:
            self._in_flight -= 1
            delivery.ended = answered_at
            delivery.status = status
            self.deliveries.append(delivery)

    # --- reading what happened ---

    def history(self) -> list[Delivery]:
        """Answered requests, in the order their answers were written: by the time taken
        just before each answer went out, not by when its handler thread got to record
        it (a client that read answer A may send request B on another connection, whose
        thread can record B first)."""
        with self._lock:
            return sorted(self.deliveries, key=lambda d: d.ended)

    def acked(self) -> list[Delivery]:
        return [d for d in self.history() if d.ok]

    def acked_ids(self) -> set[str]:
        return {d.message_id for d in self.acked()}
