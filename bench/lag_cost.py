"""What the lag sampler costs on a large outbox: `python -m bench.lag_cost [--rows N]`.

Builds databases of N rows in a throwaway PostgreSQL (fsync off: only reads are timed)
and times the `lag_sample` query against a full `count(*)` of the backlog. Retention
mode: the sent rows are kept in outbox_sent (its current generation), the unsent ones
are the outbox, which holds only rows still to send:
  steady        1,000 unsent rows among N
  backlog_1pct  1 % of N unsent
  all_unsent    an outage backlog: all N rows unsent
each with 100 failing keys (their first unsent row backing off) and min(1,000, 10 %)
of the unsent rows dead-lettered (moved into outbox_dead, as the relay's settle does).
Prints the median of 5 runs (ms) and the buffers each query touched.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, LiteralString

import psycopg

from relay.admin.migrate import migrate
from relay.observe.lag import AGE_WINDOW
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import connection
from tests.harness.postgres import PostgresServer

# The outbox holds only rows still to send: the backlog is every row of it.
FULL_COUNT: LiteralString = "SELECT count(*) FROM outbox"


def build(dsn: str, rows: int, unsent: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Rows 1..sent were sent and are kept (retention mode: in outbox_sent), the rest
        # still to send, in the outbox under the ids after them.
        conn.execute(
            "INSERT INTO outbox_sent (generation, id, message_id, topic, key, payload,"
            "                         created_at, attempts, sent_at)"
            " SELECT 0, g, gen_random_uuid(), 't', 'k' || (g %% 10000),"
            "        convert_to(repeat('x', 100), 'UTF8'), now() - interval '1 hour', 0, now()"
            " FROM generate_series(1, %(sent)s) AS g",
            {"sent": rows - unsent},
        )
        conn.execute(
            "INSERT INTO outbox (id, topic, key, payload, created_at) OVERRIDING SYSTEM VALUE"
            " SELECT g, 't', 'k' || (g %% 10000), convert_to(repeat('x', 100), 'UTF8'),"
            "        now() - interval '1 hour'"
            " FROM generate_series(%(sent)s + 1, %(rows)s) AS g",
            {"rows": rows, "sent": rows - unsent},
        )
        conn.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), %s)", (rows,))
        # 100 failing keys: the first unsent row of 100 keys waits out a backoff.
        conn.execute(
            "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour'"
            " WHERE id IN (SELECT min(id) FROM outbox GROUP BY key ORDER BY key LIMIT 100)"
        )
        conn.execute(
            "SELECT outbox_dead_letter(array_agg(id), array_agg(0), array_agg('bench'::text))"
            " FROM (SELECT id FROM outbox"
            "       WHERE next_attempt_at IS NULL ORDER BY id DESC LIMIT %(dead)s) AS d",
            {"dead": min(1_000, unsent // 10)},
        )
        conn.execute("VACUUM ANALYZE outbox")
        conn.execute("VACUUM ANALYZE outbox_dead")
        conn.execute("VACUUM ANALYZE outbox_sent")


def timed(conn: psycopg.Connection[Any], sql: LiteralString, params: dict[str, Any]) -> float:
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        conn.execute(sql, params).fetchall()
        runs.append((time.perf_counter() - started) * 1000)
    return statistics.median(runs)


def buffers(conn: psycopg.Connection[Any], sql: LiteralString, params: dict[str, Any]) -> str:
    plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
    assert plan is not None
    top = plan[0][0]["Plan"]
    hits = top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
    return f"{hits} buffers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--cap", type=int, default=100_000)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="relay-lagcost-"))
    with PostgresServer(base) as server:
        scenarios = (
            ("steady", min(args.rows, 1_000)),
            ("backlog_1pct", args.rows // 100),
            ("all_unsent", args.rows),
        )
        for name, unsent in scenarios:
            dsn = server.create_database(name)
            migrate(CommonSettings(database_url=dsn))
            started = time.monotonic()
            build(dsn, args.rows, unsent)
            print(f"{name}: {args.rows:,} rows, {unsent:,} unsent", end="")
            print(f" (built in {time.monotonic() - started:.0f}s)")
            with psycopg.connect(dsn, autocommit=True) as conn:
                # As the sampler's session plans: custom plans, no JIT, ordered walks.
                connection.apply_settings(
                    conn,
                    {**connection.CUSTOM_PLANS, **connection.ORDERED_WALKS},
                    local=False,
                )
                params = {"cap": args.cap, "age_window": AGE_WINDOW}
                sample = conn.execute(QUERIES.lag_sample, params).fetchone()
                print(f"  lag_sample -> {sample}")
                for label, sql, p in (
                    (f"lag_sample (cap {args.cap:,})", QUERIES.lag_sample, params),
                    ("full count(*) of unsent", FULL_COUNT, {}),
                ):
                    ms = timed(conn, sql, p)
                    print(f"  {label:32} {ms:9.1f} ms  {buffers(conn, sql, p)}")


if __name__ == "__main__":
    main()
