"""What an operator sees: /metrics, /healthz, /readyz, `relay status`, `relay check`."""

from __future__ import annotations

import json
import subprocess
import uuid

import psycopg
import pytest

from relay.admin.cli import health_url
from relay.admin.migrate import migrations_dir
from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness import free_port
from tests.harness.kafka import TansuBroker, consume
from tests.harness.postgres import PostgresServer
from tests.support import (
    assert_per_key_order,
    dedup_by_message_id,
    http_get,
    insert_rows,
    keyed_rows,
    running_relay,
    scalar,
    wait_until,
)
from tests.test_own_table import COLUMNS, DEBEZIUM_TABLE, TABLE, migrate_own_table

get = http_get

LATEST_MIGRATION = max(p.name[:4] for p in migrations_dir().glob("0*.sql"))


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(
        relay_command(*args), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    return done


def test_metrics_and_probes_report_the_leader_and_its_work(
    make_settings: SettingsFactory, database: str, topic: str
) -> None:
    port = free_port()
    settings = make_settings(metrics_port=port, lease_name="metrics")
    base = f"http://127.0.0.1:{port}"
    with running_relay(settings):
        wait_until(
            lambda: 'relay_lease_held{lease="metrics"} 1.0' in get(f"{base}/metrics")[1], timeout=10
        )
        insert_rows(database, topic, keyed_rows(keys=2, per_key=5))
        wait_until(lambda: scalar(database, "SELECT count(*) FROM outbox") == 0, timeout=20)
        status, body = get(f"{base}/metrics")
        assert status == 200
        assert f'relay_messages_total{{outcome="acked",sink="kafka",topic="{topic}"}} 10.0' in body
        assert "relay_end_to_end_latency_seconds_count" in body
        assert get(f"{base}/healthz")[0] == 200
        assert get(f"{base}/readyz")[0] == 200
        assert get(f"{base}/nope")[0] == 404


def test_healthcheck_probes_the_configured_metrics_address(
    make_settings: SettingsFactory, relay_dsn: str
) -> None:
    """`relay healthcheck` (the image's HEALTHCHECK) follows RELAY_METRICS_HOST/PORT and
    fails clearly when nothing answers there."""
    port = free_port()
    host = "127.0.0.2"  # loopback, but not the default: the probe must follow the setting
    env = relay_env(
        relay_dsn,
        "127.0.0.1:9",  # valid settings need a broker address; the probe never uses it
        RELAY_METRICS_HOST=host,
        RELAY_METRICS_PORT=str(port),
    )
    down = subprocess.run(
        relay_command("healthcheck"), env=env, capture_output=True, timeout=60, check=False
    )
    assert down.returncode == 1
    assert f"unhealthy: http://{host}:{port}/healthz".encode() in down.stderr
    settings = make_settings(metrics_host=host, metrics_port=port)
    with running_relay(settings):
        wait_until(lambda: get(f"http://{host}:{port}/healthz")[0] == 200, timeout=10)
        assert b"healthy" in run_cli(env, "healthcheck").stdout
    off = run_cli(
        relay_env(relay_dsn, "127.0.0.1:9"), "healthcheck"
    )  # metrics disabled: nothing to probe
    assert b"nothing to probe" in off.stdout


@pytest.mark.unit
def test_healthcheck_probes_a_wildcard_bind_on_loopback() -> None:
    assert health_url("0.0.0.0", 9108) == "http://127.0.0.1:9108/healthz"  # noqa: S104
    assert health_url("::", 9108) == "http://[::1]:9108/healthz"
    assert health_url("10.1.2.3", 80) == "http://10.1.2.3:80/healthz"


def test_status_shows_the_holder_and_check_fails_clearly_without_a_password_leak(
    make_settings: SettingsFactory, relay_dsn: str, kafka: TansuBroker
) -> None:
    with running_relay(make_settings(replica_id="replica-under-test")):
        wait_until(
            lambda: scalar(relay_dsn, "SELECT holder FROM leases WHERE expires_at > now()"),
            timeout=10,
        )
        env = relay_env(relay_dsn, kafka.bootstrap_servers)
        done = subprocess.run(
            relay_command("status", "--json"), env=env, capture_output=True, timeout=60, check=True
        )
        status = json.loads(done.stdout)
        assert status["leases"][0]["holder"] == "replica-under-test"
        assert status["leases"][0]["live"] is True
        assert 0 < status["leases"][0]["seconds_to_expiry"] <= 3.0
        assert status["schema_version"] == LATEST_MIGRATION
        # Its heartbeat: the leader reports the sink reachable (it delivered, or idles).
        wait_until(
            lambda: scalar(relay_dsn, "SELECT count(*) FROM replicas WHERE sink_ok") == 1,
            timeout=10,
        )
        replicas = json.loads(run_cli(env, "status", "--json").stdout)["replicas"]
        assert [(r["replica_id"], r["sink_ok"]) for r in replicas] == [("replica-under-test", True)]
        assert status["outbox"] == {
            "unsent": 0,
            "oldest_unsent_age_seconds": 0.0,
            "blocked": 0,
            "dead_lettered": 0,
            "count_cap": 1_000_000,
            "scheduled": 0,
            "next_due_in_seconds": None,
            "paused": 0,
        }
        assert status["paused_topics"] == []
        table = run_cli(env, "status").stdout.decode()
        assert table.splitlines()[0].split() == [
            "LEASE", "STATE", "HOLDER", "EPOCH", "EXPIRES", "AT", "EXPIRES", "IN"
        ]  # fmt: skip
        assert "default  held   replica-under-test  1" in table
        assert "oldest unsent age   0.0s" in table
        assert "replica-under-test" in table.split("REPLICA", 1)[1]

        ok = subprocess.run(
            relay_command("check"), env=env, capture_output=True, timeout=60, check=False
        )
        assert ok.returncode == 0, ok.stderr
        assert b"settings: ok" in ok.stdout
        assert (
            f"database: ok (schema version {LATEST_MIGRATION}".encode() in ok.stdout
            and b"kafka: ok" in ok.stdout
        )

    bad_url = relay_dsn.replace(":relay-secret-pw@", ":wrong-pw-123@")
    env["RELAY_DATABASE_URL"] = bad_url
    bad = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    assert bad.returncode == 1
    assert b"database: FAILED" in bad.stderr and b"password authentication failed" in bad.stderr
    assert b"wrong-pw-123" not in bad.stdout + bad.stderr


def test_check_fails_clearly_on_a_dead_broker(relay_dsn: str) -> None:
    env = relay_env(relay_dsn, f"127.0.0.1:{free_port()}")
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert b"database: ok" in done.stdout
    assert b"sink: FAILED" in done.stderr
    assert b"relay-secret-pw" not in done.stdout + done.stderr


def test_check_fails_clearly_on_an_unmigrated_database(pg: PostgresServer) -> None:
    name = f"t_{uuid.uuid4().hex[:12]}"
    env = relay_env(pg.create_database(name), "127.0.0.1:9")
    try:
        done = subprocess.run(
            relay_command("check"), env=env, capture_output=True, timeout=60, check=False
        )
    finally:
        pg.drop_database(name)
    assert done.returncode == 1
    assert b"database: FAILED: no migration applied (run `relay migrate`)" in done.stderr


def dead_count(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM outbox_dead_letters"))


def test_dead_letters_are_listed_then_requeued_and_delivered_in_key_order(
    make_settings: SettingsFactory, database: str, relay_dsn: str, kafka: TansuBroker, topic: str
) -> None:
    """A bad topic mapping dead-letters every row; once fixed, requeueing by key and by id
    delivers them all, each key in its original order."""
    insert_rows(database, topic, keyed_rows(keys=2, per_key=4))
    with running_relay(make_settings(topic_map={topic: "not a topic!"})):
        wait_until(lambda: dead_count(database) == 8, timeout=20, message="8 dead letters")
    env = relay_env(relay_dsn)

    k0 = json.loads(run_cli(env, "dead-letter", "list", "--key", "k0", "--json").stdout)
    assert [row["key"] for row in k0] == ["k0"] * 4
    assert [row["id"] for row in k0] == sorted(row["id"] for row in k0)
    assert "invalid Kafka topic name 'not a topic!'" in k0[0]["dead_letter_reason"]
    listed = run_cli(env, "dead-letter", "list", "--topic", topic, "--limit", "3")
    assert len(listed.stdout.decode().splitlines()) == 1 + 3  # header + rows
    assert b"3 dead-lettered row(s) (more exist" in listed.stderr

    dry = run_cli(env, "dead-letter", "requeue", "--all", "--dry-run")
    assert dry.stdout.startswith(b"would requeue 8 row(s)")
    assert dead_count(database) == 8

    with running_relay(make_settings()):
        done = run_cli(env, "dead-letter", "requeue", "--key", "k0")
        assert done.stdout.decode().strip() == "requeued 4 row(s): " + " ".join(
            str(row["id"]) for row in k0
        )
        wait_until(
            lambda: (
                dead_count(database) == 4 and scalar(database, "SELECT count(*) FROM outbox") == 0
            ),
            timeout=20,
        )
        k1 = json.loads(run_cli(env, "dead-letter", "list", "--json").stdout)
        ids = [str(row["id"]) for row in k1]
        # Only the last of k1's dead letters would overtake the three before it: warned.
        partial = run_cli(env, "dead-letter", "requeue", "--id", ids[-1], "--dry-run")
        assert b"warning: earlier dead letters of key(s) 'k1' stay" in partial.stderr
        done = run_cli(env, "dead-letter", "requeue", "--id", *ids, "999999")
        assert done.stdout.startswith(b"requeued 4 row(s)")
        assert b"not requeued: 999999" in done.stderr
        assert b"warning" not in done.stderr
        wait_until(lambda: scalar(database, "SELECT count(*) FROM outbox") == 0, timeout=20)
    records = consume(kafka.bootstrap_servers, topic, min_count=8, timeout=30)
    assert len(dedup_by_message_id(records)) == 8
    assert_per_key_order(records)


def test_a_dead_letter_keeps_the_columns_the_app_added_and_a_requeue_restores_them(
    database: str, relay_dsn: str
) -> None:
    """An app that added its own NOT NULL column to the outbox: its value survives the
    move into outbox_dead and back (a requeue would otherwise fail on the column, or
    put back its default); the move never reads a row whole as JSON."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 'none'")
        conn.execute('ALTER TABLE outbox ADD COLUMN "Weight" numeric')
        (row_id,) = conn.execute(
            'INSERT INTO outbox (topic, key, payload, tenant, "Weight")'
            " VALUES ('t', 'k', 'x', 'acme', 2.5) RETURNING id"
        ).fetchone() or (0,)
    with psycopg.connect(relay_dsn, autocommit=True) as conn:  # the runtime role
        conn.execute(
            "SELECT outbox_dead_letter(ARRAY[%s]::bigint[], ARRAY[1], ARRAY['HTTP 400'])",
            (row_id,),
        )
        kept = conn.execute("SELECT extra FROM outbox_dead WHERE id = %s", (row_id,))
        assert kept.fetchone() == ({"tenant": "acme", "Weight": 2.5},)
        back = conn.execute(
            "SELECT * FROM outbox_requeue(ARRAY[%s]::bigint[], NULL, false)", (row_id,)
        )
        assert back.fetchall() == [(row_id,)]
    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute(
            'SELECT tenant, "Weight", attempts FROM outbox WHERE id = %s', (row_id,)
        ).fetchone()
    assert row is not None and row[0] == "acme" and float(row[1]) == 2.5 and row[2] == 0


def test_a_requeue_restores_what_the_outbox_would_have_and_loses_nothing_it_refuses(
    database: str, relay_dsn: str
) -> None:
    """Found in review, each a way a requeue failed or lost a row: a generated column
    (written explicitly, it fails the INSERT); a column added while the row was dead
    (restored as NULL, not its default, so NOT NULL failed); 60 added columns
    (jsonb_build_object takes 100 arguments); a BEFORE INSERT trigger that drops the
    row (deleted from outbox_dead, inserted nowhere). The dropped row stays a dead
    letter."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE outbox ADD COLUMN size_kb int GENERATED ALWAYS AS"
            " (octet_length(payload) / 1024) STORED"
        )
        for n in range(60):
            conn.execute(f"ALTER TABLE outbox ADD COLUMN c{n} int DEFAULT {n}")
        ids = [
            row[0]
            for row in conn.execute(
                "INSERT INTO outbox (topic, key, payload, c59) VALUES"
                " ('t', 'k', 'kept', 590), ('t', 'drop', 'dropped', 1) RETURNING id"
            ).fetchall()
        ]
    with psycopg.connect(relay_dsn, autocommit=True) as conn:  # the runtime role
        conn.execute(
            "SELECT outbox_dead_letter(%s::bigint[], ARRAY[1, 1], ARRAY['x', 'x'])", (ids,)
        )
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 'none'")
        conn.execute(
            "CREATE FUNCTION drop_it() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN IF NEW.key = 'drop' THEN RETURN NULL; END IF; RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER drop_it BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION drop_it()"
        )
    with psycopg.connect(relay_dsn, autocommit=True) as conn:
        back = conn.execute("SELECT * FROM outbox_requeue(%s::bigint[], NULL, false)", (ids,))
        assert back.fetchall() == [(ids[0],)]
    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute(
            "SELECT c0, c59, tenant, size_kb FROM outbox WHERE id = %s", (ids[0],)
        ).fetchone()
        assert row == (0, 590, "none", 0)
        left = conn.execute("SELECT id FROM outbox_dead").fetchall()
        assert left == [(ids[1],)]


def test_purge_deletes_only_an_own_tables_sent_rows_past_the_cutoff(database: str) -> None:
    """An own table keeps its sent rows, marked (retention): `relay purge` deletes those
    sent before the cutoff, and no fresh sent row, dead letter or unsent row."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(DEBEZIUM_TABLE)
    migrated = migrate_own_table(database)
    assert migrated.returncode == 0, migrated.stderr
    ids = []
    with psycopg.connect(database, autocommit=True) as conn:
        for n in range(7):
            row = conn.execute(
                "INSERT INTO inventory.outboxevent (id, aggregatetype, aggregateid, type)"
                " VALUES (gen_random_uuid(), 't', %s, 'Created') RETURNING relay_id",
                (f"k{n}",),
            ).fetchone()
            assert row is not None
            ids.append(int(row[0]))
        # Everything is two days old; only the sent time decides what purge may delete.
        conn.execute(
            "UPDATE inventory.outboxevent SET relay_created_at = now() - interval '2 days'"
        )
        conn.execute(
            "UPDATE inventory.outboxevent SET relay_sent_at = now() - interval '2 days'"
            " WHERE relay_id = ANY(%s)",
            (ids[:3],),
        )
        conn.execute(
            "UPDATE inventory.outboxevent SET relay_sent_at = now() WHERE relay_id = %s", (ids[3],)
        )
        conn.execute(
            "UPDATE inventory.outboxevent SET relay_dead_lettered_at = now() - interval '2 days',"
            " relay_dead_letter_reason = 'test' WHERE relay_id = %s",
            (ids[4],),
        )
    env = relay_env(database, RELAY_OUTBOX_TABLE=TABLE, RELAY_OUTBOX_COLUMNS=json.dumps(COLUMNS))
    done = run_cli(env, "purge", "--older-than", "1d", "--batch-size", "2")
    assert done.stdout.decode().strip() == "purged 3 sent row(s) older than 86400s"
    with psycopg.connect(database) as conn:
        left = [
            r[0]
            for r in conn.execute("SELECT relay_id FROM inventory.outboxevent ORDER BY relay_id")
        ]
    assert left == ids[3:]  # the fresh sent row, the dead letter, the three unsent rows
