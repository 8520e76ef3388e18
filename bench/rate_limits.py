"""Rate limits per HTTP destination (issue 35): two origins, one limited to 40 requests
a second by the relay and answering 429 above 50 a second, the other not limited.

    python -m bench.rate_limits [--quick]      (its own PostgreSQL; JSON on stdout)

Scenes, each from a relay started on rows committed before it (in-process relay and
receivers on loopback, every request taking `DELAY_MS`):
- `no_limit_set`: the limited receiver alone, without the relay's limit: the requests it
  gets in its busiest second and the 429s it answers (its Retry-After pauses the
  origin, so fewer than issue 35 measured on main, where each 429 spent an attempt);
- `other_alone`: the other origin's rows alone, the time to its last row;
- `side_by_side`: both backlogs at once, the limited one committed first: the other
  origin's time again, the limited origin's busiest second, 429s, its drain time, and
  the rows it sent back to the outbox (no attempt spent).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client import REGISTRY

from bench.common import relay_settings
from relay.admin.migrate import migrate
from relay.settings import CommonSettings
from tests.harness.postgres import PostgresServer
from tests.harness.webhook import LimitedTo, Reply, WebhookServer, most_in_a_window
from tests.support import running_relay, wait_until

LIMIT = 40  # the relay's, requests a second
RECEIVER_LIMIT = 50  # the receiver answers 429 above this many a second
DELAY_MS = 20


def _commit(dsn: str, topic: str, keys: int, per_key: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %s, %s || (g %% %s), convert_to('x', 'UTF8')"
            " FROM generate_series(0, %s) g",
            (topic, topic, keys, keys * per_key - 1),
        )
        conn.execute("ANALYZE outbox")


def _unsent(dsn: str, topic: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox WHERE topic = %s", (topic,)).fetchone()
    return int(row[0]) if row else 0


def _deferred(origin: str) -> float:
    labels = {"origin": origin, "reason": "budget"}
    return REGISTRY.get_sample_value("relay_http_origin_deferred_rows_total", labels) or 0.0


def _drain(dsn: str, settings_values: dict[str, Any], topics: list[str]) -> float:
    """Seconds from the relay's start until every row of `topics` is sent."""
    started = time.monotonic()
    with running_relay(relay_settings(dsn, None, **settings_values)):
        wait_until(
            lambda: all(_unsent(dsn, topic) == 0 for topic in topics), 600, message="drained"
        )
    return time.monotonic() - started


def run(dsn: str, quick: bool) -> dict[str, Any]:
    limited_rows = (100, 2) if quick else (100, 4)  # keys, rows per key
    other_rows = (100, 10) if quick else (100, 20)
    delay = DELAY_MS / 1000
    report: dict[str, Any] = {
        "relay_limit": LIMIT,
        "receiver_limit": RECEIVER_LIMIT,
        "delay_ms": DELAY_MS,
    }
    base: dict[str, Any] = {
        "sink": "http",
        "sink_max_in_flight": 16,
        "retention_seconds": 3600.0,  # kept in outbox_sent: attempts can be read afterwards
    }
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    limiter = LimitedTo(RECEIVER_LIMIT, lambda _: Reply(200, delay=delay))
    with WebhookServer(limiter) as limited:
        _commit(dsn, "limited", *limited_rows)
        seconds = _drain(dsn, {**base, "http_url": limited.url + "/in"}, ["limited"])
        report["no_limit_set"] = {
            "rows": limited_rows[0] * limited_rows[1],
            "busiest_second": most_in_a_window(limited.history()),
            "answered_429": limiter.refused,
            "drain_s": round(seconds, 2),
        }
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    limiter = LimitedTo(RECEIVER_LIMIT, lambda _: Reply(200, delay=delay))
    with (
        WebhookServer(limiter) as limited,
        WebhookServer(lambda _: Reply(200, delay=delay)) as other,
    ):
        settings = {
            **base,
            "http_url": other.url + "/in",
            "http_topic_urls": {
                "limited": {"url": limited.url + "/in", "max_requests_per_second": LIMIT}
            },
        }
        _commit(dsn, "other", *other_rows)
        report["other_alone_s"] = round(_drain(dsn, settings, ["other"]), 2)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE outbox, outbox_sent")  # this scene's sent rows alone
        other.deliveries.clear()
        _commit(dsn, "limited", *limited_rows)
        _commit(dsn, "other", *other_rows)
        origin = f"http://127.0.0.1:{limited.port}"
        deferred_before = _deferred(origin)
        started = time.monotonic()
        with running_relay(relay_settings(dsn, None, **settings)):
            wait_until(lambda: _unsent(dsn, "other") == 0, 600, message="other drained")
            other_s = time.monotonic() - started
            wait_until(lambda: _unsent(dsn, "limited") == 0, 600, message="limited drained")
            limited_s = time.monotonic() - started
        with psycopg.connect(dsn, autocommit=True) as conn:
            # Sent rows leave the outbox: retention keeps them, attempts and all.
            row = conn.execute("SELECT max(attempts) FROM outbox_sent").fetchone()
        rows = limited_rows[0] * limited_rows[1]
        report["side_by_side"] = {
            "limited_rows": rows,
            "other_rows": other_rows[0] * other_rows[1],
            "other_s": round(other_s, 2),
            "limited_s": round(limited_s, 2),
            "limited_floor_s": round((rows - 1) / LIMIT, 2),
            "busiest_second": most_in_a_window(limited.history()),
            "answered_429": limiter.refused,
            "sent_back_rows": int(_deferred(origin) - deferred_before),
            "max_attempts": int(row[0]) if row and row[0] is not None else 0,
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from relay.observe.logging import configure

    configure("console", "warning")
    with PostgresServer(Path(tempfile.mkdtemp(prefix="relay-bench-rl-")), durable=True) as pg:
        dsn = pg.create_database("bench")
        migrate(CommonSettings(database_url=dsn))
        print(json.dumps(run(dsn, args.quick), indent=2))


if __name__ == "__main__":
    main()
