"""The small HTTP server for /metrics, /healthz and /readyz, built to survive slow and
many clients: one event loop holds every connection, each with a deadline, and a
request reaches a thread only once its head has arrived, a few at a time. Kubelet
probes and Prometheus scrapes come through a flood of idle connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.registry import CollectorRegistry

from relay.observe.logging import get_logger
from relay.observe.metrics import Health

__all__ = ["CONNECTION_TIMEOUT_SECONDS", "HANDLER_THREADS", "MAX_CONNECTIONS", "MetricsServer"]

log = get_logger("relay.metrics")

# Every connection's deadline to send its request head, then again to take its answer:
# a client that sends nothing, or dribbles bytes, is dropped after it.
CONNECTION_TIMEOUT_SECONDS = 5.0
# Threads that build answers (a scrape runs every collector); the event loop's thread
# holds every connection, so idle ones cost a socket, never a thread.
HANDLER_THREADS = 4
# Open connections at most; past it the one that has waited longest for its request
# head is dropped, so a flood of idle connections cannot keep a scrape out.
MAX_CONNECTIONS = 256
REQUEST_HEAD_MAX_BYTES = 8192
LISTEN_BACKLOG = 128


def _http_response(status: int, body: bytes, ctype: str = "text/plain") -> bytes:
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _request_path(head: bytes) -> str | bytes:
    """The path of a GET request head, or the whole answer to any other request."""
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _http_response(400, b"bad request\n")
    if parts[0] != "GET":
        return _http_response(405, b"only GET\n")
    return parts[1].split("?", 1)[0]


class Endpoints:
    """What /metrics, /healthz and /readyz answer (on a handler thread)."""

    def __init__(self, health: Health, registry: CollectorRegistry = REGISTRY) -> None:
        self._health = health
        self._registry = registry

    def answer(self, path: str) -> bytes:
        if path == "/metrics":
            return _http_response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)
        if path == "/healthz":
            stalled = self._health.stalled()
            beats = self._health.describe()
            if stalled:
                return _http_response(503, f"stalled: {' '.join(stalled)} ({beats})\n".encode())
            return _http_response(200, f"ok ({beats})\n".encode())
        if path == "/readyz":
            ok = self._health.db_ok()
            return _http_response(
                200 if ok else 503, b"ready\n" if ok else b"database unreachable\n"
            )
        return _http_response(404, b"not found\n")


class MetricsServer:
    """Serves /metrics, /healthz, /readyz on the configured address only.

    It survives slow and many clients: one event loop holds the connections, each with
    a deadline (CONNECTION_TIMEOUT_SECONDS); a request is handed to a thread only once
    its head has arrived, and at most HANDLER_THREADS at a time. Kubelet probes and
    Prometheus scrapes come through a flood of idle connections.
    """

    def __init__(
        self,
        host: str,
        port: int,
        health: Health,
        *,
        timeout: float = CONNECTION_TIMEOUT_SECONDS,
        handlers: int = HANDLER_THREADS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._endpoints = Endpoints(health)
        self._timeout = timeout
        self._max_connections = max_connections
        # Bound here, so a taken port fails the constructor (relay/daemon/app.py reports it).
        self._socket = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self._loop = asyncio.new_event_loop()
        self._slots = asyncio.Semaphore(handlers)
        self._stopping = asyncio.Event()
        # Oldest first: the connections still reading their request head, which may be
        # dropped for a newer one; and those being answered, which may not.
        self._reading: dict[asyncio.StreamWriter, None] = {}
        self._answering: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._run, name="relay-metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()
        self._socket.close()

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        server = await asyncio.start_server(
            self._connection, sock=self._socket, backlog=LISTEN_BACKLOG,
            limit=REQUEST_HEAD_MAX_BYTES,
        )  # fmt: skip
        async with server:
            await self._stopping.wait()
            connections = asyncio.all_tasks() - {asyncio.current_task()}
            for task in connections:
                task.cancel()
            await asyncio.gather(*connections, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not self._admit(writer):
                return
            async with asyncio.timeout(self._timeout):
                head = await reader.readuntil(b"\r\n\r\n")
            if writer not in self._reading:
                return  # dropped for a newer connection while its head came in
            del self._reading[writer]
            self._answering.add(writer)
            async with asyncio.timeout(self._timeout):
                writer.write(await self._answer(head))
                writer.close()
                await writer.wait_closed()
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a client too slow, gone, or sending a head too long: dropped below
        finally:
            self._reading.pop(writer, None)
            self._answering.discard(writer)
            writer.transport.abort()  # a no-op after a clean close

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Room for one more connection: at the cap, the one that has waited longest
        for its request head goes. False if every open connection is being answered."""
        if len(self._reading) + len(self._answering) >= self._max_connections:
            if not self._reading:
                return False
            oldest = next(iter(self._reading))
            del self._reading[oldest]
            oldest.transport.abort()
        self._reading[writer] = None
        return True

    async def _answer(self, head: bytes) -> bytes:
        path = _request_path(head)
        if isinstance(path, bytes):
            return path
        await self._slots.acquire()
        answered: asyncio.Future[bytes] = self._loop.create_future()
        threading.Thread(
            target=self._handle, args=(path, answered), name="relay-metrics-handler", daemon=True
        ).start()
        return await answered

    def _handle(self, path: str, answered: asyncio.Future[bytes]) -> None:
        """On a handler thread; its slot is freed when it ends, not when the connection
        does, so a collector that hangs holds its thread's slot and no more appear."""
        try:
            response = self._endpoints.answer(path)
        except Exception:
            log.exception("metrics.answer_failed", path=path)
            response = _http_response(500, b"internal error\n")
        with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped
            self._loop.call_soon_threadsafe(self._answered, answered, response)

    def _answered(self, answered: asyncio.Future[bytes], response: bytes) -> None:
        self._slots.release()
        if not answered.done():
            answered.set_result(response)
