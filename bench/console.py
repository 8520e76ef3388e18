"""The operators' console: how long a page of dead letters takes with 100,000 of them.

    ./dev bench --only console [--quick]     (its own PostgreSQL; a table at the end)

The console runs as `relay console` (its own process, as deployed) over a database
holding `rows` dead letters over 50 topics; a client logs in and times whole requests
(query, template, HTTP on loopback), the median of several, for: the first page, a deep
page (a keyset cursor near the end), a filtered page (one topic, reason substring), and
a row's page. The page query (outbox_dead_letters, the view over outbox_dead) is a walk
of outbox_dead's primary key from the cursor, so the deep page should cost what the
first does.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import psycopg

from tests.harness import free_port

TOKEN = "bench-console-token-0123456789"
TOPICS = 50


def _load(dsn: str, rows: int) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Dead letters as the relay keeps them: moved out of the outbox into outbox_dead,
        # under ids of the outbox's identity.
        conn.execute(
            "INSERT INTO outbox_dead (id, message_id, topic, key, payload, headers, created_at,"
            " attempts, dead_lettered_at, dead_letter_reason)"
            " SELECT nextval(pg_get_serial_sequence('outbox', 'id')), gen_random_uuid(),"
            " 'topic-' || (g %% %s), 'key-' || (g %% 1000),"
            " convert_to('{\"order\": ' || g || ', \"lines\": [1, 2, 3]}', 'UTF8'),"
            ' \'{"trace-id": "abc"}\', now(), 10, now() - make_interval(secs => %s - g),'
            " CASE WHEN g %% 7 = 0 THEN 'HTTP 422: schema violation' ELSE 'HTTP 400: bad'"
            " END FROM generate_series(1, %s) AS g",
            (TOPICS, rows, rows),
        )
        conn.execute("VACUUM ANALYZE outbox_dead")
        row = conn.execute("SELECT min(id), max(id) FROM outbox_dead").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _time(client: httpx.Client, path: str, runs: int) -> float:
    client.get(path).raise_for_status()  # warm: plan cache, template compile
    took = []
    for _ in range(runs):
        started = time.perf_counter()
        response = client.get(path)
        took.append(time.perf_counter() - started)
        response.raise_for_status()
    return statistics.median(took) * 1000


def run(dsn: str, quick: bool) -> dict[str, Any]:
    rows = 20_000 if quick else 100_000
    runs = 5 if quick else 15
    first_id, last_id = _load(dsn, rows)
    port = free_port()
    env = {
        "RELAY_DATABASE_URL": dsn,
        "RELAY_CONSOLE_TOKEN": TOKEN,
        "RELAY_CONSOLE_PORT": str(port),
        "RELAY_CONSOLE_COOKIE_SECURE": "false",  # plain HTTP on loopback
        "RELAY_LOG_FORMAT": "json",
        "PATH": "/usr/bin:/bin",
    }
    console = subprocess.Popen(
        [sys.executable, "-m", "relay", "console"], env=env, stderr=subprocess.PIPE
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, headers={"Origin": base}, timeout=10) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or console.poll() is not None:
                    raise RuntimeError("the console did not start")
                time.sleep(0.1)
            client.post("/login", data={"token": TOKEN, "next": "/"})
            deep = last_id - 100
            report = {
                "dead_letters": rows,
                "runs": runs,
                "first_page_ms": _time(client, "/dead-letters", runs),
                "deep_page_ms": _time(client, f"/dead-letters?after={deep}", runs),
                "filtered_page_ms": _time(
                    client, f"/dead-letters?topic=topic-7&reason=schema&after={deep // 2}", runs
                ),
                "row_page_ms": _time(client, f"/rows/{first_id + rows // 2}", runs),
            }
    finally:
        console.terminate()
        console.wait(timeout=10)
    print(f"\nconsole pages with {rows:,} dead letters (median of {runs}, whole requests)")
    for name in ("first_page_ms", "deep_page_ms", "filtered_page_ms", "row_page_ms"):
        print(f"  {name.removesuffix('_ms').replace('_', ' '):<14} {report[name]:8.1f} ms")
    return report
