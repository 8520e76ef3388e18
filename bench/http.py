"""HTTP sink benchmark: the relay's delivery rate against the client's own limit.

    ./dev bench --sink http [--rows N] [--batch 500] [--in-flight 16]

The endpoint (bench/receiver.py) runs in its own process. For each batch size:
  raw    httpx.AsyncClient POSTing the same payloads with the same concurrency, no database
  relay  the real relay draining the same number of pre-loaded rows (100 keys)
The ratio relay/raw is what the sink and the drain loop cost on top of HTTP itself.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import psycopg

from relay.daemon.app import RelayApp
from relay.settings import Settings
from tests.harness import free_port
from tests.support import wait_until

PAYLOAD = b'{"order": 1, "amount": "12.50", "currency": "EUR", "note": "' + b"x" * 140 + b'"}'


class Receiver:
    def __init__(self, delay_ms: int = 0) -> None:
        self.delay_ms = delay_ms
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hooks"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Receiver:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.receiver", str(self.port), str(self.delay_ms)]
        )
        wait_until(self._up, 10, message="bench receiver listening")
        return self

    def _up(self) -> bool:
        try:
            return httpx.post(self.url, content=b"").status_code == 204
        except httpx.TransportError:
            return False

    def __exit__(self, *_: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)


def raw_post(url: str, rows: int, in_flight: int) -> float:
    """Requests/s of a bare AsyncClient loop with `in_flight` concurrent POSTs."""

    async def run() -> float:
        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        async with httpx.AsyncClient(limits=limits) as client:
            remaining = iter(range(rows))

            async def worker() -> None:
                for _ in remaining:
                    response = await client.post(url, content=PAYLOAD)
                    response.raise_for_status()

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(in_flight)))
            return rows / (time.perf_counter() - started)

    return asyncio.run(run())


def relay_post(dsn: str, url: str, rows: int, batch: int, in_flight: int) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 'bench', 'k' || (g %% 100), %s FROM generate_series(1, %s) g",
            (PAYLOAD, rows),
        )
        conn.execute("VACUUM ANALYZE outbox")
    settings = Settings(
        database_url=dsn,
        sink="http",
        http_url=url,
        sink_max_in_flight=in_flight,
        batch_size=batch,
        metrics_port=0,
        log_level="warning",
    )
    app = RelayApp(settings)
    thread = threading.Thread(target=app.run, daemon=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        thread.start()
        while True:
            left = conn.execute("SELECT count(*) FROM outbox").fetchone()
            if left is not None and left[0] == 0:
                break
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
    app.shutdown.request()
    thread.join(timeout=30)
    return rows / elapsed


def run(dsn: str, rows: int, batches: list[int], in_flight: int) -> list[dict[str, float | int]]:
    results: list[dict[str, float | int]] = []
    with Receiver() as receiver:
        raw_post(receiver.url, min(rows, 500), in_flight)  # warm up both processes
        print(f"HTTP sink, {in_flight} in flight, {rows} rows of {len(PAYLOAD)} bytes")
        print(f"{'batch':>6} {'raw req/s':>12} {'relay msg/s':>13} {'ratio':>6}")
        for batch in batches:
            raw = raw_post(receiver.url, rows, in_flight)
            relay = relay_post(dsn, receiver.url, rows, batch, in_flight)
            results.append(
                {"batch": batch, "rows": rows, "in_flight": in_flight, "raw": raw, "relay": relay}
            )
            print(f"{batch:>6} {raw:>12,.0f} {relay:>13,.0f} {relay / raw:>6.2f}", flush=True)
    return results
