"""What every benchmark section shares: the outbox loaders and in-process settings."""

from __future__ import annotations

from typing import Any

import psycopg

from relay.settings import Settings

PAYLOAD = b"x" * 200
KEYS = 100
TOPIC = "bench"


def preload(
    dsn: str, rows: int, *, sent: bool = False, truncate: bool = True, headers: str | None = None
) -> None:
    """`rows` outbox rows over 100 keys (already sent ones with `sent`; each with the
    JSON object `headers`, if given), then ANALYZE."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if truncate:
            conn.execute("TRUNCATE outbox")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, sent_at, headers)"
            " SELECT %s, 'k' || (g %% %s), %s, CASE WHEN %s THEN now() END, %s::jsonb"
            " FROM generate_series(1, %s) g",
            (TOPIC, KEYS, PAYLOAD, sent, headers, rows),
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
