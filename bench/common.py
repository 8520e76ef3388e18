"""What every benchmark section shares: the outbox loaders and a relay run to empty."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from relay.settings import Settings
from tests.support import running_relay

PAYLOAD = b"x" * 200
KEYS = 100
TOPIC = "bench"


def preload(dsn: str, rows: int, *, sent: bool = False, truncate: bool = True) -> None:
    """`rows` outbox rows over 100 keys (already sent ones with `sent`), then ANALYZE."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if truncate:
            conn.execute("TRUNCATE outbox")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, sent_at)"
            " SELECT %s, 'k' || (g %% %s), %s, CASE WHEN %s THEN now() END"
            " FROM generate_series(1, %s) g",
            (TOPIC, KEYS, PAYLOAD, sent, rows),
        )
        conn.execute("VACUUM ANALYZE outbox")


def first_unsent_id(conn: psycopg.Connection[Any]) -> int | None:
    row = conn.execute(
        "SELECT min(id) FROM outbox WHERE sent_at IS NULL AND dead_lettered_at IS NULL"
    ).fetchone()
    return None if row is None else row[0]


def relay_settings(dsn: str, bootstrap: str | None, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": dsn,
        "kafka_bootstrap_servers": bootstrap,
        "metrics_enabled": False,
        "log_level": "warning",
    }
    values.update(overrides)
    return Settings(**values)


def drain_rate(settings: Settings, rows: int) -> float:
    """rows/s of an in-process relay draining pre-loaded rows (ids contiguous).

    The clock starts when the first batch is settled, so start-up (lease, producer
    connect) is not counted; the rows are those left at that moment.
    """
    dsn = settings.database_url.get_secret_value()
    with psycopg.connect(dsn, autocommit=True) as conn:
        first = first_unsent_id(conn)
        row = conn.execute("SELECT max(id) FROM outbox").fetchone()
        assert first is not None and row is not None
        last = int(row[0])
        with running_relay(settings):
            while (current := first_unsent_id(conn)) == first:
                time.sleep(0.002)
            started = time.perf_counter()
            left = 0 if current is None else last - current + 1
            # Every poll takes the GIL from the in-process relay: poll gently.
            while first_unsent_id(conn) is not None:
                time.sleep(0.02)
            elapsed = time.perf_counter() - started
    return left / elapsed
