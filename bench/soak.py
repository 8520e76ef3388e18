"""Soak: the outbox's footprint over time at a fixed commit rate, in each mode (issue 36).

    ./dev bench --only soak [--quick] [--minutes M]

A `relay run` process drains while the app commits `RATE` rows a second (one row per
transaction, 200 B, 100 keys), for `minutes` in delete mode (RELAY_RETENTION_SECONDS=0)
and then as long in retention mode. The retention is a fifth of the soak, so that the
history turns over several times (RELAY_PURGE_INTERVAL_SECONDS 5): what is measured is
the steady state, not the first fill. Every `SAMPLE_SECONDS` it records, for `outbox`
(table and its indexes) and `outbox_sent` (the history, retention mode): total size,
live and dead tuples (pg_stat_user_tables), the unsent backlog, and the drain's fetch
statement (`fetch_head`, the batch it would read now) timed by EXPLAIN ANALYZE. Flat
lines are the goal: the outbox's size and dead tuples bounded by the backlog and
autovacuum, the history's by the retention (its generations emptied whole, never
row by row), the fetch's time independent of how long the relay has run.

Default 30 minutes per mode (--quick: 3).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from bench.common import KEYS, PAYLOAD, TOPIC
from bench.processes import start_relay, stop
from relay.sql import QUERIES
from relay.store import connection

RATE = 500  # rows a second, committed one per transaction
SAMPLE_SECONDS = 30.0


def _commit_at_rate(dsn: str, rate: int, until: threading.Event) -> int:
    """One row per transaction, paced to `rate` a second; rows committed."""
    committed = 0
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not until.is_set():
            conn.execute(
                "INSERT INTO outbox (topic, key, payload) VALUES (%s, %s, %s)",
                (TOPIC, f"k{committed % KEYS}", PAYLOAD),
            )
            committed += 1
            ahead = committed / rate - (time.monotonic() - started)
            if ahead > 0:
                until.wait(ahead)
    return committed


def _sample(conn: psycopg.Connection[Any], started: float) -> dict[str, Any]:
    stats = {
        row[0]: (int(row[1]), int(row[2]), int(row[3]))
        for row in conn.execute(
            "SELECT c.relname, pg_total_relation_size(c.oid),"
            " coalesce(sum(s.n_live_tup), 0), coalesce(sum(s.n_dead_tup), 0)"
            " FROM pg_class AS c"
            " LEFT JOIN pg_inherits AS i ON i.inhparent = c.oid"
            " LEFT JOIN pg_stat_user_tables AS s ON s.relid IN (c.oid, i.inhrelid)"
            " WHERE c.relname IN ('outbox', 'outbox_sent') GROUP BY c.relname, c.oid"
        )
    }
    history_bytes = conn.execute(
        "SELECT coalesce(sum(pg_total_relation_size(inhrelid)), 0)"
        " FROM pg_inherits WHERE inhparent = 'outbox_sent'::regclass"
    ).fetchone()
    # The outbox holds only rows still to send: the backlog is every row of it.
    unsent = conn.execute("SELECT count(*) FROM outbox").fetchone()
    plan = conn.execute(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + QUERIES.fetch_head,
        {
            "limit": 1000,
            "max_bytes": 8 << 20,
            "message_max": 1 << 20,
            "after": None,
            "in_flight": "{}",
            "in_flight_ranges": "{}",
            "held": [],
            "shards": 1,
            "shard": 0,
        },
    ).fetchone()
    assert plan is not None and unsent is not None and history_bytes is not None
    head = plan[0][0]
    outbox = stats.get("outbox", (0, 0, 0))
    history = stats.get("outbox_sent", (0, 0, 0))
    return {
        "t_s": round(time.monotonic() - started),
        "unsent": int(unsent[0]),
        "outbox_mib": round(outbox[0] / 2**20, 2),
        "outbox_live": outbox[1],
        "outbox_dead": outbox[2],
        "history_mib": round(int(history_bytes[0]) / 2**20, 2),
        "history_live": history[1],
        "history_dead": history[2],
        "fetch_ms": round(float(head["Planning Time"]) + float(head["Execution Time"]), 2),
    }


def _mode(dsn: str, bootstrap: str, retention: float, minutes: float) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox, outbox_sent")
        conn.execute("VACUUM ANALYZE outbox")
    relay = start_relay(
        dsn,
        bootstrap,
        RELAY_RETENTION_SECONDS=f"{retention:g}",
        RELAY_PURGE_INTERVAL_SECONDS="5",
    )
    stop_commits = threading.Event()
    committed: list[int] = []
    writer = threading.Thread(
        target=lambda: committed.append(_commit_at_rate(dsn, RATE, stop_commits)), daemon=True
    )
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    writer.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            connection.keep_settings(conn, connection.CUSTOM_PLANS)
            ends = started + minutes * 60
            while time.monotonic() < ends:
                time.sleep(min(SAMPLE_SECONDS, max(0.0, ends - time.monotonic())))
                samples.append(_sample(conn, started))
                print("      " + ", ".join(f"{k} {v}" for k, v in samples[-1].items()), flush=True)
    finally:
        stop_commits.set()
        writer.join(30)
        stop([relay])
    half = samples[len(samples) // 2 :]
    return {
        "retention_s": retention,
        "minutes": minutes,
        "committed": committed[0] if committed else 0,
        "samples": samples,
        "second_half_max": {
            key: max(s[key] for s in half)
            for key in ("outbox_mib", "outbox_dead", "history_mib", "fetch_ms", "unsent")
        },
        "first_sample": samples[0] if samples else None,
    }


def run(dsn: str, bootstrap: str, minutes: float) -> dict[str, Any]:
    report: dict[str, Any] = {"rate": RATE, "sample_s": SAMPLE_SECONDS}
    print(f"  soak: {RATE} rows/s for {minutes:g} min in each mode", flush=True)
    for name, retention in (("delete", 0.0), ("retention", minutes * 60 / 5)):
        print(f"    {name} mode (RELAY_RETENTION_SECONDS={retention:g})", flush=True)
        report[name] = _mode(dsn, bootstrap, retention, minutes)
    return report
