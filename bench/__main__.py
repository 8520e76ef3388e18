"""Benchmark: the relay's end-to-end drain rate against the raw database limit.

    ./dev bench [--rows N] [--batch 500 ...]
    ./dev bench --sink http [--rows N] [--in-flight 16]     (see bench/http.py)

Starts its own PostgreSQL (fsync ON) and Tansu broker, then for each batch size:
  raw    a bare loop: SELECT the next batch through the partial index, DELETE it
  relay  the real relay (one replica) draining the same number of pre-loaded rows
and prints rows/s and the ratio relay/raw, measured in the same run. Results also go to
bench/results/<timestamp>.json. Absolute numbers drift on a shared machine; compare ratios.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from relay.app import RelayApp
from relay.migrate import migrate
from relay.queries import QUERIES
from relay.settings import CommonSettings, Settings
from tests.harness.kafka import TansuBroker
from tests.harness.postgres import PostgresServer

PAYLOAD = b"x" * 200


def preload(dsn: str, rows: int, topic: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %s, 'k' || (g %% 100), %s FROM generate_series(1, %s) g",
            (topic, PAYLOAD, rows),
        )
        conn.execute("VACUUM ANALYZE outbox")


def raw_drain(dsn: str, batch: int) -> float:
    """rows/s of the bare select+delete loop, one transaction a batch."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        total = 0
        started = time.perf_counter()
        while True:
            with conn.transaction():
                rows = conn.execute(QUERIES.fetch_batch, {"limit": batch}).fetchall()
                if not rows:
                    break
                conn.execute(QUERIES.delete_sent, {"ids": [r[0] for r in rows]})
            total += len(rows)
        return total / (time.perf_counter() - started)


def relay_drain(dsn: str, bootstrap: str, batch: int, rows: int) -> float:
    settings = Settings(
        database_url=dsn,
        kafka_bootstrap_servers=bootstrap,
        batch_size=batch,
        metrics_enabled=False,
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


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("--sink", choices=["kafka", "http"], default="kafka")
    parser.add_argument("--rows", type=int, default=None, help="50000 (kafka), 10000 (http)")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--in-flight", type=int, default=16, help="RELAY_HTTP_MAX_IN_FLIGHT")
    args = parser.parse_args()

    from relay.logging import configure

    configure("console", "warning")
    if args.sink == "http":
        return bench_http(args.rows or 10_000, args.batch or [500], args.in_flight)
    args.rows = args.rows or 50_000
    args.batch = args.batch or [100, 500, 2000]
    results: list[dict[str, float | int]] = []
    with (
        PostgresServer(Path(tempfile.mkdtemp(prefix="relay-bench-pg-")), durable=True) as pg,
        TansuBroker() as broker,
    ):
        dsn = pg.create_database("bench")
        migrate(CommonSettings(database_url=dsn))
        broker.create_topic("bench", partitions=3)
        print(f"{'batch':>6} {'raw rows/s':>12} {'relay rows/s':>13} {'ratio':>6}")
        for batch in args.batch:
            preload(dsn, args.rows, "bench")
            raw = raw_drain(dsn, batch)
            preload(dsn, args.rows, "bench")
            relay = relay_drain(dsn, broker.bootstrap_servers, batch, args.rows)
            results.append(
                {
                    "batch": batch,
                    "rows": args.rows,
                    "raw": raw,
                    "relay": relay,
                    "ratio": relay / raw,
                }
            )
            print(f"{batch:>6} {raw:>12,.0f} {relay:>13,.0f} {relay / raw:>6.2f}", flush=True)
    save({"mode": "delete", "sink": "kafka", "results": results})
    return 0


def bench_http(rows: int, batches: list[int], in_flight: int) -> int:
    from bench import http

    with PostgresServer(Path(tempfile.mkdtemp(prefix="relay-bench-pg-")), durable=True) as pg:
        dsn = pg.create_database("bench")
        migrate(CommonSettings(database_url=dsn))
        results = http.run(dsn, rows, batches, in_flight)
    save({"mode": "delete", "sink": "http", "results": results})
    return 0


def save(report: dict[str, object]) -> None:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"written {path}")


if __name__ == "__main__":
    raise SystemExit(main())
