"""End-to-end demo on throwaway servers: two replicas, sample traffic, a crash, a takeover.

Everything it starts (PostgreSQL, the Tansu broker, two relays) is stopped on exit,
normal or Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg

from relay.admin.migrate import migrations_dir
from tests.harness.kafka import TansuBroker, consume
from tests.harness.postgres import PostgresServer
from tests.support import scalar, wait_until

REPO = Path(__file__).resolve().parent.parent
TOPIC = "orders"
KEYS = 8


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def relay_env(dsn: str, bootstrap: str, n: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(
        {
            "RELAY_DATABASE_URL": dsn,
            "RELAY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "RELAY_LOG_FORMAT": "console",
            "RELAY_LEASE_TTL_SECONDS": "4",
            "RELAY_METRICS_PORT": str(19100 + n),
            "RELAY_REPLICA_ID": f"replica-{n}:{n}",
            "PYTHONPATH": str(REPO),
        }
    )
    return env


def pump_logs(proc: subprocess.Popen[bytes], name: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        text = line.decode(errors="replace").rstrip()
        if any(
            word in text for word in ("lease.", "relay.started", "relay.stopped", "dead_letter")
        ):
            print(f"  [{name}] {text}", flush=True)


def insert(dsn: str, start: int, count: int) -> None:
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO outbox (topic, key, payload, headers) VALUES (%s, %s, %s, %s)",
            [
                (
                    TOPIC,
                    f"customer-{i % KEYS}",
                    f'{{"order": {i}}}'.encode(),
                    '{"content-type": "application/json"}',
                )
                for i in range(start, start + count)
            ],
        )


def _drained(dsn: str) -> bool:
    return bool(scalar(dsn, "SELECT count(*) FROM outbox") == 0)


def holder(dsn: str) -> tuple[str | None, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT CASE WHEN expires_at > now() THEN holder END, epoch FROM leases"
            " WHERE name = 'default'"
        ).fetchone()
    return (row[0], row[1]) if row else (None, 0)


def main() -> int:
    pg = PostgresServer(Path(tempfile.mkdtemp(prefix="relay-demo-pg-")))
    broker = TansuBroker()
    relays: dict[str, subprocess.Popen[bytes]] = {}
    try:
        say("starting PostgreSQL and the Tansu broker on loopback")
        pg.start()
        broker.start()
        dsn = pg.create_database("app")
        broker.create_topic(TOPIC, partitions=3)
        print(f"  postgres: 127.0.0.1:{pg.port}   kafka: {broker.bootstrap_servers}")

        say("relay migrate (as the schema owner), then least-privilege grants")
        env0 = relay_env(dsn, broker.bootstrap_servers, 0)
        subprocess.run([sys.executable, "-m", "relay", "migrate"], env=env0, check=True)
        pg.execute("CREATE ROLE relay LOGIN PASSWORD 'relay'")
        pg.execute((migrations_dir() / "grants.sql").read_text(), dbname="app")
        relay_dsn = pg.dsn("app", user="relay", password="relay")

        say("starting two relay replicas (as the 'relay' role)")
        for n in (1, 2):
            proc = subprocess.Popen(
                [sys.executable, "-m", "relay", "run"],
                env=relay_env(relay_dsn, broker.bootstrap_servers, n),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            relays[f"replica-{n}"] = proc
            threading.Thread(target=pump_logs, args=(proc, f"replica-{n}"), daemon=True).start()
        wait_until(lambda: holder(dsn)[0] is not None, timeout=30, message="a lease holder")
        leader, epoch = holder(dsn)
        print(f"  lease held by {leader} (epoch {epoch})")

        say("the app inserts 5000 orders across 8 customers (keys)")
        started = time.monotonic()
        insert(dsn, 0, 5000)
        wait_until(lambda: _drained(dsn), timeout=30, message="the drain")
        took = time.monotonic() - started
        print(f"  drained 5000 rows in {took:.2f}s ({5000 / took:,.0f} rows/s, insert included)")

        say("consuming them back from Kafka")
        records = consume(broker.bootstrap_servers, TOPIC, min_count=5000, timeout=30)
        for record in records[:3]:
            print(
                f"  key={record.key} value={record.value!r} "
                f"message-id={record.headers['message-id'].decode()}"
            )
        print(
            f"  ... {len(records)} records; per key: {dict(sorted(Counter(r.key for r in records).items()))}"
        )

        assert leader is not None
        victim = leader.split(":")[0]
        say(f"SIGKILL the leader ({victim}) while more orders arrive")
        insert(dsn, 5000, 2000)
        relays[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: holder(dsn)[0] not in (None, leader), timeout=30, message="a new holder")
        new_leader, new_epoch = holder(dsn)
        print(
            f"  {new_leader} took over in {time.monotonic() - killed:.2f}s "
            f"(ttl 4s), epoch {epoch} -> {new_epoch}"
        )
        wait_until(lambda: _drained(dsn), timeout=30, message="the drain after takeover")
        records = consume(broker.bootstrap_servers, TOPIC, min_count=7000, timeout=30)
        unique = {r.headers["message-id"] for r in records}
        print(
            f"  delivered {len(unique)} distinct messages of 7000 "
            f"({len(records) - len(unique)} duplicate(s) from the batch in flight at the crash)"
        )

        say("relay status")
        subprocess.run([sys.executable, "-m", "relay", "status"], env=env0, check=True)
        return 0 if len(unique) == 7000 else 1
    except KeyboardInterrupt:
        print("\ninterrupted")
        return 130
    finally:
        say("stopping everything the demo started")
        for proc in relays.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in relays.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        broker.stop()
        pg.stop()


if __name__ == "__main__":
    raise SystemExit(main())
