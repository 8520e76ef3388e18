"""What every benchmark section shares: the outbox loaders and in-process settings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from confluent_kafka import KafkaError, Message, Producer
from psycopg import sql

from relay.settings import Settings

PAYLOAD = b"x" * 200
KEYS = 100
TOPIC = "bench"
# The relay's producer guarantees, for the bench's own bare loops (the relay's own
# config is relay/sinks/kafka/sink.py's producer_config).
BARE_PRODUCER = {
    "enable.idempotence": True,
    "acks": "all",
    "compression.type": "lz4",
    "linger.ms": 5,
}
# The outbox holds only rows still to send (sent rows are deleted or moved into
# outbox_sent, dead letters into outbox_dead), so "unsent" is every row of it. "Due", a row
# the drain may take (not scheduled for later, or let in), as the drain's statements
# (relay/sql/drain.sql, fragment drainable) and outbox_key_hash_idx's predicate state it,
# word for word: the benchmark's probes by key hash read that index, as the relay's do.
DUE = "(available_at IS NULL OR promoted_at IS NOT NULL)"


def produce_batch(
    producer: Producer,
    batch: Sequence[tuple[Any, ...]],
    report: Callable[[KafkaError | None, Message], None],
) -> int:
    """The bench's own bare loops' publish: every row of `batch` (id, message_id, topic,
    key, payload, created_at) produced with the relay's record headers, positionally as
    the relay's sink calls produce(), waiting for room when librdkafka's queue is full;
    then flush. How many are still undelivered."""
    produce = producer.produce
    for _id, message_id, topic, key, payload, created_at in batch:
        headers = [("message-id", message_id), ("created-at", created_at)]
        while True:
            try:
                produce(topic, payload, key, -1, report, None, 0, headers)
                break
            except BufferError:
                producer.poll(0.01)
    return int(producer.flush(60))


def preload_history(dsn: str, rows: int) -> None:
    """`rows` sent rows kept in retention mode: in outbox_sent's current generation."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox_sent")
        conn.execute(
            "INSERT INTO outbox_sent (generation, id, message_id, topic, key, payload,"
            " created_at, attempts, sent_at)"
            " SELECT 0, -g, gen_random_uuid(), %s, 'k' || (g %% %s), %s, now(), 0, now()"
            " FROM generate_series(1, %s) g",
            (TOPIC, KEYS, PAYLOAD, rows),
        )
        conn.execute("VACUUM ANALYZE outbox_sent")


def preload(
    dsn: str,
    rows: int,
    *,
    truncate: bool = True,
    headers: str | None = None,
    table: str = "outbox",
) -> None:
    """`rows` outbox rows over 100 keys (each with the JSON object `headers`, if
    given), then ANALYZE. `table`: another table that takes the app's columns (topic,
    key, payload, headers) with the outbox's defaults for the rest (bench/baselines.py's
    minimal one)."""
    name = sql.Identifier(table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        if truncate:
            conn.execute(sql.SQL("TRUNCATE {}").format(name))
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (topic, key, payload, headers)"
                " SELECT %s, 'k' || (g %% %s), %s, %s::jsonb"
                " FROM generate_series(1, %s) g"
            ).format(name),
            (TOPIC, KEYS, PAYLOAD, headers, rows),
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(name))


def first_unsent_id(conn: psycopg.Connection[Any]) -> int | None:
    """The lowest id still to send: every row of the outbox is (one descent of its
    primary key)."""
    row = conn.execute("SELECT min(id) FROM outbox").fetchone()
    return None if row is None else row[0]


def relay_settings(dsn: str, bootstrap: str | None, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": dsn,
        "kafka_bootstrap_servers": bootstrap,
        "metrics_port": 0,
        "log_level": "warning",
    }
    values.update(overrides)
    return Settings(**values)
