"""Fairness per tenant (issue 35, RELAY_FAIRNESS_GROUP=key-prefix::): a small tenant
behind a big one's backlog, with and without grouping, in one run.

    ./dev bench --only tenants [--quick]

Scenes, at the defaults (RELAY_BATCH_SIZE=1000; HTTP: 16 requests in flight):
- `http`: every request takes `DELAY_MS`; tenant A's rows (12,000 on 1,500 keys) first,
  then B's 20 rows on 5 keys, both committed before the relay starts: seconds until
  B's last row is delivered, and how many of A's were delivered by then;
- `http` `committed_later`: A's rows committed before the start, B's `LATER_S` after it,
  while A's are being sent: seconds from B's commit to its last row's delivery;
- `kafka`: the same rows over Kafka, at 5,000 messages a second
  (RELAY_MAX_MESSAGES_PER_SECOND, so that the scene lasts a few seconds);
- `fetch_cost`: the grouped fetch statement alone (EXPLAIN ANALYZE: execution time and
  the rows its scans touch) with 1, 100,000 and 1,000,000 waiting rows of A (a tenth
  of those with --quick) beside B's: flat once the head is full, whatever one group's
  backlog.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg

from bench.common import relay_settings
from relay.admin.schema_options import create_fairness_index
from relay.drain import fairness
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import connection
from tests.harness.webhook import Reply, WebhookServer
from tests.support import running_relay, wait_until

GROUP = fairness.parse("key-prefix::")
DELAY_MS = 20
A_KEYS, A_PER_KEY = 1500, 8
B_KEYS, B_PER_KEY = 5, 4
LATER_S = 1.0


Ids = tuple[int, int]  # a tenant's rows: the first id and the last


def _commit(dsn: str, tenant: str, keys: int, per_key: int) -> Ids:
    """Interleaved keys `tenant:kN`; the payload is the tenant."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "WITH added AS ("
            "  INSERT INTO outbox (topic, key, payload)"
            "  SELECT 'bench', %(t)s || ':k' || (g %% %(keys)s), convert_to(%(t)s, 'UTF8')"
            "  FROM generate_series(0, %(n)s - 1) g ORDER BY g"
            "  RETURNING id)"
            " SELECT min(id), max(id) FROM added",
            {"t": tenant, "keys": keys, "n": keys * per_key},
        ).fetchone()
        conn.execute("ANALYZE outbox")
    assert row is not None
    return int(row[0]), int(row[1])


def _reset(dsn: str) -> Ids:
    """An empty outbox, then A's rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    return _commit(dsn, "A", A_KEYS, A_PER_KEY)


def _unsent(dsn: str, ids: Ids) -> int:
    """A tenant's rows not sent yet (sent rows leave the outbox): a walk of the primary
    key over its ids, so polling costs the scene nothing."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox WHERE id BETWEEN %s AND %s", ids).fetchone()
    return int(row[0]) if row else 0


def _scene(dsn: str, values: dict[str, Any]) -> dict[str, Any]:
    """Seconds to B's last row, A's rows sent by then, and seconds to drain all."""
    a_ids = _reset(dsn)
    b_ids = _commit(dsn, "B", B_KEYS, B_PER_KEY)
    a_rows = A_KEYS * A_PER_KEY
    started = time.monotonic()
    with running_relay(relay_settings(dsn, values.pop("bootstrap", None), **values)):
        wait_until(lambda: _unsent(dsn, b_ids) == 0, 600, message="B delivered")
        b_done = time.monotonic() - started
        a_by_then = a_rows - _unsent(dsn, a_ids)
        wait_until(lambda: _unsent(dsn, a_ids) == 0, 600, message="A delivered")
        all_done = time.monotonic() - started
    return {
        "b_last_s": round(b_done, 2),
        "a_sent_by_then": a_by_then,
        "a_sent_by_then_pct": round(100 * a_by_then / a_rows, 1),
        "all_s": round(all_done, 2),
    }


def _committed_later(dsn: str, values: dict[str, Any]) -> dict[str, Any]:
    """B committed LATER_S after the relay started, while A's rows are being sent:
    seconds from B's commit to its last row settled (after its delivery was
    acknowledged, so an upper bound on the arrival), and A's rows sent meanwhile."""
    a_ids = _reset(dsn)
    a_rows = A_KEYS * A_PER_KEY
    started = time.monotonic()
    with running_relay(relay_settings(dsn, values.pop("bootstrap", None), **values)):
        time.sleep(max(0.0, started + LATER_S - time.monotonic()))
        a_before = a_rows - _unsent(dsn, a_ids)
        b_ids = _commit(dsn, "B", B_KEYS, B_PER_KEY)
        committed = time.monotonic()
        wait_until(lambda: _unsent(dsn, b_ids) == 0, 600, interval=0.01, message="B delivered")
        b_done = time.monotonic() - committed
        a_meanwhile = a_rows - _unsent(dsn, a_ids) - a_before
    return {
        "b_last_after_commit_s": round(b_done, 2),
        "a_sent_before_b_commit": a_before,
        "a_sent_meanwhile": a_meanwhile,
    }


def _fetch_cost(dsn: str) -> dict[str, float]:
    params = {
        "limit": 1000,
        "max_bytes": 8 << 20,
        "message_max": 1 << 20,
        "key_cap": 200,
        "fill": True,
        "in_flight": "{}",
        "in_flight_ranges": "{}",
        "held": [],
        "shards": 1,
        "shard": 0,
        "after_key": None,
        "grouped": True,
        "group_kind": GROUP.kind,
        "group_arg": GROUP.arg,
        "after_group": None,
    }
    times: list[float] = []
    touched = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        for _ in range(7):
            row = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + QUERIES.fetch_batch, params
            ).fetchone()
            assert row is not None
            plan = row[0][0]
            times.append(float(plan["Execution Time"]) + float(plan["Planning Time"]))
            touched = _rows_touched(plan["Plan"])
    times.sort()
    return {"ms_median": round(times[len(times) // 2], 2), "rows_touched": touched}


def _rows_touched(node: dict[str, Any]) -> int:
    own = 0
    if "Scan" in node["Node Type"] and node.get("Relation Name") == "outbox":
        own = int(node.get("Actual Rows", 0)) * int(node.get("Actual Loops", 1))
    return own + sum(_rows_touched(child) for child in node.get("Plans", []))


def _waiting_a(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 'bench', 'A:k' || (g %% 3000), 'A' FROM generate_series(1, %s) g",
            (rows,),
        )
    _commit(dsn, "B", B_KEYS, B_PER_KEY)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox")


def run(dsn: str, bootstrap: str, quick: bool) -> dict[str, Any]:
    create_fairness_index(CommonSettings(database_url=dsn), GROUP, 1)
    report: dict[str, Any] = {
        "group": GROUP.spec,
        "a_rows": A_KEYS * A_PER_KEY,
        "a_keys": A_KEYS,
        "b_rows": B_KEYS * B_PER_KEY,
        "b_keys": B_KEYS,
    }
    with WebhookServer(lambda _: Reply(200, delay=DELAY_MS / 1000)) as receiver:
        http = {"sink": "http", "http_url": receiver.url + "/in", "sink_max_in_flight": 16}
        report["http"] = {
            "delay_ms": DELAY_MS,
            "grouped": _scene(dsn, {**http, "fairness_group": GROUP.spec}),
            "not_grouped": _scene(dsn, dict(http)),
            "committed_later": _committed_later(dsn, {**http, "fairness_group": GROUP.spec}),
        }
    kafka = {"bootstrap": bootstrap, "max_messages_per_second": 5000}
    report["kafka"] = {
        "max_messages_per_second": 5000,
        "grouped": _scene(dsn, {**kafka, "fairness_group": GROUP.spec}),
        "not_grouped": _scene(dsn, dict(kafka)),
        "committed_later": _committed_later(dsn, {**kafka, "fairness_group": GROUP.spec}),
    }
    big = 100_000 if quick else 1_000_000
    cost: dict[str, Any] = {}
    for waiting in (1, big // 10, big):
        _waiting_a(dsn, waiting)
        cost[f"a_waiting_{waiting}"] = _fetch_cost(dsn)
    report["fetch_cost"] = cost
    return report


if __name__ == "__main__":
    import sys

    from bench.__main__ import servers

    with servers() as (dsn, bootstrap):
        print(json.dumps(run(dsn, bootstrap, "--quick" in sys.argv), indent=2))
