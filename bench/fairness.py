"""Fairness, blocked keys and big rows: the figures behind the fetch's promises.

- blocked backlog: one key waits out a retry backoff with a deep backlog behind it; how
  long 250 rows of 50 other keys, committed then, take to be delivered, and what one
  fetch costs with that backlog in front.
- hot key: one key with a large backlog in front; how long the other keys' rows,
  committed while it drains, take, against the time to drain the hot key.
- big rows: peak RSS of a relay process draining 400 KB rows, with the default
  RELAY_BATCH_MAX_BYTES and with the byte bound effectively off (the baseline).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from bench.common import DUE, TOPIC, relay_settings
from bench.processes import holder, rss_mib, start_relay, stop, wait_for
from relay.drain.batch import BatchLimits, a_fifth
from relay.settings import Settings
from relay.store import connection, fetch
from tests.support import running_relay

OTHERS = 50
DEFAULT_BATCH: int = Settings.model_fields["batch_size"].default
PER_OTHER = 5


def _fill(conn: psycopg.Connection[Any], key: str, rows: int, payload_bytes: int = 200) -> None:
    conn.execute(
        "INSERT INTO outbox (topic, key, payload)"
        " SELECT %s, %s, convert_to(repeat('x', %s), 'UTF8') FROM generate_series(1, %s)",
        (TOPIC, key, payload_bytes, rows),
    )


def commit_others(conn: psycopg.Connection[Any], table: str = "outbox") -> float:
    """Insert the other keys' rows into `table` in one transaction; the commit time."""
    with conn.transaction():
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (topic, key, payload)"
                " SELECT %s, 'o' || (g %% %s), 'o' FROM generate_series(1, %s) g"
            ).format(sql.Identifier(table)),
            (TOPIC, OTHERS, OTHERS * PER_OTHER),
        )
    return time.monotonic()


def _left(conn: psycopg.Connection[Any], key: str) -> int:
    """Unsent rows of `key` (an index range of outbox_key_hash_idx)."""
    row = conn.execute(
        "SELECT count(*) FROM outbox"
        " WHERE outbox_key_hash(key) = outbox_key_hash(%(key)s) AND key = %(key)s AND " + DUE,
        {"key": key},
    ).fetchone()
    return 0 if row is None else int(row[0])


def _others_left(conn: psycopg.Connection[Any]) -> bool:
    """Any unsent row of the other keys ('o0'...'o49'), by one short index range, so
    polling it does not load the database the relay is being measured on."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM outbox WHERE outbox_key_hash(key) = ANY(ARRAY("
        "SELECT outbox_key_hash('o' || g) FROM generate_series(0, %s - 1) AS g))"
        " AND key LIKE 'o%%' AND " + DUE + ")",
        (OTHERS,),
    ).fetchone()
    return bool(row and row[0])


def _any_left(conn: psycopg.Connection[Any], key: str | None = None) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM outbox WHERE (%(key)s::text IS NULL"
        " OR (outbox_key_hash(key) = outbox_key_hash(%(key)s) AND key = %(key)s))"
        " AND " + DUE + ")",
        {"key": key},
    ).fetchone()
    return bool(row and row[0])


def _first_left(conn: psycopg.Connection[Any], key: str) -> int | None:
    row = conn.execute(
        "SELECT min(id) FROM outbox"
        " WHERE outbox_key_hash(key) = outbox_key_hash(%(key)s) AND key = %(key)s AND " + DUE,
        {"key": key},
    ).fetchone()
    return None if row is None else row[0]


def _wait(condition: Any, timeout: float, what: str) -> None:
    """Poll every 20 ms: gently, the relay under measurement shares the machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: timed out waiting for {what}")
        time.sleep(0.02)


def _fetch_ms(dsn: str, batch: int = DEFAULT_BATCH) -> float:
    """The fetch's median time over 21 calls, at the default batch and per-key cap (the
    drain asks for less when its sink is slow, never more)."""
    limits = BatchLimits(rows=batch, bytes=8 << 20, per_key=a_fifth(batch))
    times = []
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        fetch.fetch_batch(conn, limits)
        for _ in range(21):
            started = time.perf_counter()
            fetch.fetch_batch(conn, limits)
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def blocked_backlog(dsn: str, bootstrap: str, backlog: int) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, attempts, next_attempt_at)"
            " VALUES (%s, 'K', 'K', 1, now() + interval '1 hour')",
            (TOPIC,),
        )
        _fill(conn, "K", backlog)
        conn.execute("VACUUM ANALYZE outbox")
        with running_relay(relay_settings(dsn, bootstrap)):
            wait_for(lambda: holder(conn), 30, "a lease holder")
            committed = commit_others(conn)
            _wait(lambda: not _others_left(conn), 120, "the other keys")
            others_s = time.monotonic() - committed
        fetch_ms = _fetch_ms(dsn)
    return {"backlog_rows": backlog, "others_delivered_s": others_s, "fetch_ms": fetch_ms}


def _others_behind_hot_key(conn: psycopg.Connection[Any]) -> tuple[float, float, int]:
    """With the relay draining hot key H: commit the other keys' rows once H flows;
    (commit time, seconds until they were all delivered, H's rows still waiting then)."""
    first = _first_left(conn, "H")
    _wait(lambda: _first_left(conn, "H") != first, 60, "the hot key flowing")
    committed = commit_others(conn)
    _wait(lambda: not _others_left(conn), 300, "the other keys")
    return committed, time.monotonic() - committed, _left(conn, "H")


def hot_key(dsn: str, bootstrap: str, backlog: int) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        _fill(conn, "H", backlog)
        conn.execute("VACUUM ANALYZE outbox")
        with running_relay(relay_settings(dsn, bootstrap)):
            committed, others_s, h_left = _others_behind_hot_key(conn)
            _wait(lambda: not _any_left(conn, "H"), 600, "the hot key drained")
            drained_s = time.monotonic() - committed
    return {
        "backlog_rows": backlog,
        "others_delivered_s": others_s,
        "hot_rows_left_then": h_left,
        "hot_drained_s": drained_s,
    }


def hot_key_http(dsn: str, backlog: int, delay_ms: int = 20) -> dict[str, float]:
    """The HTTP sink sends a key's rows one at a time: `backlog` rows of one key in
    front of an endpoint taking `delay_ms` a request are minutes of work."""
    from bench.http import Receiver

    with Receiver(delay_ms) as receiver, psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        _fill(conn, "H", backlog)
        conn.execute("VACUUM ANALYZE outbox")
        settings = relay_settings(dsn, None, sink="http", http_url=receiver.url)
        with running_relay(settings):
            _, others_s, h_left = _others_behind_hot_key(conn)
    return {
        "backlog_rows": backlog,
        "delay_ms": delay_ms,
        "others_delivered_s": others_s,
        "hot_rows_left_then": h_left,
    }


def big_rows(dsn: str, bootstrap: str, rows: int, max_bytes: int) -> dict[str, float]:
    """Peak RSS of a relay process draining `rows` rows of 400 KB."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        for key in range(10):
            _fill(conn, f"b{key}", rows // 10, payload_bytes=400_000)
        conn.execute("VACUUM ANALYZE outbox")
        proc = start_relay(dsn, bootstrap, RELAY_BATCH_MAX_BYTES=str(max_bytes))
        try:
            wait_for(lambda: holder(conn), 30, "a lease holder")
            peak = rss_mib(proc.pid)
            started = time.monotonic()
            while _any_left(conn):
                peak = max(peak, rss_mib(proc.pid))
                if time.monotonic() - started > 300:
                    raise TimeoutError("bench: big rows not drained in 300 s")
                time.sleep(0.05)
            drained = time.monotonic() - started
        finally:
            stop([proc])
    return {"rows": rows, "max_bytes": max_bytes, "rss_peak_mib": peak, "drain_s": drained}


def run(dsn: str, bootstrap: str, quick: bool) -> dict[str, Any]:
    backlog = 100_000 if quick else 300_000
    report: dict[str, Any] = {
        "blocked": blocked_backlog(dsn, bootstrap, backlog),
        "hot": hot_key(dsn, bootstrap, backlog),
        "hot_http": hot_key_http(dsn, 100_000),
        "big_rows": [
            big_rows(dsn, bootstrap, 300, 8 << 20),
            big_rows(dsn, bootstrap, 300, 1 << 40),
        ],
    }
    b, h = report["blocked"], report["hot"]
    print(
        f"\n8. a key in backoff with {b['backlog_rows']:,} rows behind it: 250 rows of"
        f" {OTHERS} other keys delivered in {b['others_delivered_s']:.2f} s; the fetch at"
        f" batch {DEFAULT_BATCH}: p50 {b['fetch_ms']:.1f} ms",
        flush=True,
    )
    print(
        f"9. a hot key with {h['backlog_rows']:,} rows in front: the other keys' 250 rows"
        f" in {h['others_delivered_s']:.2f} s ({h['hot_rows_left_then']:,} hot rows still"
        f" waiting then); the hot key drained in {h['hot_drained_s']:.1f} s",
        flush=True,
    )
    hh = report["hot_http"]
    print(
        f"9b. over HTTP ({hh['delay_ms']} ms a request, a key's rows one at a time), a hot"
        f" key with {hh['backlog_rows']:,} rows in front: the other keys' 250 rows in"
        f" {hh['others_delivered_s']:.2f} s ({hh['hot_rows_left_then']:,} hot rows still"
        " waiting then)",
        flush=True,
    )
    on, off = report["big_rows"]
    print(
        f"10. {on['rows']} rows of 400 KB: peak RSS {on['rss_peak_mib']:.0f} MiB with"
        f" RELAY_BATCH_MAX_BYTES={on['max_bytes']:,} ({on['drain_s']:.1f} s) vs"
        f" {off['rss_peak_mib']:.0f} MiB unbounded ({off['drain_s']:.1f} s)",
        flush=True,
    )
    return report
