"""Prometheus metrics, and the small HTTP server for /metrics, /healthz and /readyz.

Metric objects live here so every module records through one vocabulary; the names
follow Prometheus conventions (`relay_` prefix, base units, `_total` counters).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

LEASE_HELD = Gauge("relay_lease_held", "1 if this replica holds the lease, else 0.", ["lease"])
LEASE_EPOCH = Gauge("relay_lease_epoch", "Latest lease epoch this replica has seen.", ["lease"])
LEASE_ACQUISITIONS = Counter(
    "relay_lease_acquisitions_total", "Times this replica acquired the lease.", ["lease"]
)
LEASE_LOSSES = Counter(
    "relay_lease_losses_total",
    "Times this replica stopped holding the lease, by reason.",
    ["lease", "reason"],
)
MESSAGES = Counter(
    "relay_messages_total",
    "Messages handed to the sink, by outcome (acked, retry, dead, unavailable).",
    ["sink", "topic", "outcome"],
)
DEAD_LETTERED = Counter(
    "relay_dead_lettered_total", "Rows moved to the dead-letter state.", ["sink", "topic"]
)
BATCH_SIZE = Histogram(
    "relay_batch_size",
    "Rows per fetched batch.",
    buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 2000, 5000),
)
PUBLISH_SECONDS = Histogram(
    "relay_publish_duration_seconds",
    "Time to publish a batch and collect every ack.",
    ["sink"],
    buckets=LATENCY_BUCKETS,
)
SETTLE_SECONDS = Histogram(
    "relay_mark_duration_seconds",
    "Time of the fenced transaction that settles a batch.",
    buckets=LATENCY_BUCKETS,
)
END_TO_END_SECONDS = Histogram(
    "relay_end_to_end_latency_seconds",
    "Row created_at (database clock) to sink acknowledgement (relay clock).",
    ["sink"],
    buckets=LATENCY_BUCKETS,
)
HTTP_REQUESTS = Counter(
    "relay_http_requests_total",
    "HTTP sink requests by response status code, or timeout / connect_error / error.",
    ["status"],
)
HTTP_REQUEST_SECONDS = Histogram(
    "relay_http_request_duration_seconds",
    "HTTP sink request time, connect to last byte of the response read.",
    buckets=LATENCY_BUCKETS,
)
BUILD_INFO = Info("relay_build", "Version and sink of this relay process.")


def lease_transition(lease: str, *, held: bool, epoch: int, reason: str | None = None) -> None:
    LEASE_HELD.labels(lease).set(1 if held else 0)
    LEASE_EPOCH.labels(lease).set(epoch)
    if held:
        LEASE_ACQUISITIONS.labels(lease).inc()
    else:
        LEASE_LOSSES.labels(lease, reason or "unknown").inc()


def lease_observed(lease: str, epoch: int) -> None:
    LEASE_HELD.labels(lease).set(0)
    LEASE_EPOCH.labels(lease).set(epoch)


class Health:
    """Heartbeats the probes read: the main loop's, and the last good database round trip."""

    def __init__(self, stale_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.stale_after = stale_after
        self._loop_beat = clock()
        self.db_ok: Callable[[], bool] = lambda: False

    def beat(self) -> None:
        self._loop_beat = self._clock()

    def alive(self) -> bool:
        return self._clock() - self._loop_beat < self.stale_after


class MetricsServer:
    """Serves /metrics, /healthz, /readyz on the configured address only."""

    def __init__(self, host: str, port: int, health: Health) -> None:
        health_ref = health

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok = health_ref.alive()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"loop stalled\n")
                elif path == "/readyz":
                    ok = health_ref.db_ok()
                    self._send(200 if ok else 503, b"ready\n" if ok else b"database unreachable\n")
                else:
                    self._send(404, b"not found\n")

            def _send(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # scrapes every few seconds would drown the useful log lines

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="relay-metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
