"""Bring your own outbox table, on real PostgreSQL and Kafka: a table in Debezium's
outbox event router layout, written by the app's own unchanged inserts, drains in order
per aggregateid beside the relay's own outbox, each with its lease."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import uuid
from typing import Any

import psycopg
import pytest

from relay.errors import SettingsError
from relay.settings import CommonSettings, Settings, load_settings
from relay.sql import QUERIES
from relay.store import connection, db, startup_checks
from tests.conftest import RELAY_ROLE, SettingsFactory, relay_command, relay_env
from tests.harness.kafka import Record, TansuBroker, consume
from tests.support import assert_per_key_order, insert_rows, running_relay, scalar, wait_until
from tests.test_pause import relay as relay_cli

TABLE = "inventory.outboxevent"
VIEW_SCHEMA = "relay_inventory_outboxevent"
# Debezium's documented outbox table (the outbox event router's defaults).
DEBEZIUM_TABLE = """
CREATE SCHEMA inventory;
CREATE TABLE inventory.outboxevent (
    id            uuid         NOT NULL PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid   varchar(255) NOT NULL,
    type          varchar(255) NOT NULL,
    payload       jsonb
);
"""
COLUMNS = {
    "topic": "aggregatetype",
    "key": "aggregateid",
    "message_id": "id",
    "header:type": "type",
}


def app_insert(dsn: str, topic: str, rows: list[tuple[str, int]]) -> None:
    """The app's own INSERT, exactly as it was before the relay: it knows nothing of it."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        for aggregate, step in rows:
            conn.execute(
                "INSERT INTO inventory.outboxevent (id, aggregatetype, aggregateid, type, payload)"
                " VALUES (gen_random_uuid(), %s, %s, 'OrderCreated', %s)",
                (topic, aggregate, json.dumps({"v": f"{aggregate}:{step}"})),
            )


def migrate_own_table(
    database: str, *extra: str, columns: dict[str, str] = COLUMNS, table: str = TABLE
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        relay_command("migrate", "--own-table", *extra),
        env=relay_env(database, RELAY_OUTBOX_TABLE=table, RELAY_OUTBOX_COLUMNS=json.dumps(columns)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def grant_view(database: str, schema: str = VIEW_SCHEMA) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {RELAY_ROLE}")
        conn.execute(
            f"GRANT SELECT, UPDATE, DELETE ON {schema}.outbox, {schema}.outbox_marked"
            f" TO {RELAY_ROLE}"
        )
        conn.execute(
            f"GRANT SELECT ON {schema}.outbox_dead_letters, {schema}.outbox_dead,"
            f" {schema}.outbox_scheduled, {schema}.outbox_paused TO {RELAY_ROLE}"
        )


@pytest.fixture
def debezium_table(database: str) -> str:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(DEBEZIUM_TABLE)
    return database


def per_aggregate_order(records: list[Record]) -> None:
    """Each record's value as `aggregate:step` (from the JSON payload), then per-key order."""
    assert_per_key_order(
        [dataclasses.replace(r, value=json.loads(r.value or b"")["v"].encode()) for r in records]
    )


def test_a_debezium_table_drains_in_order_per_aggregate_beside_the_relays_own_outbox(
    make_settings: SettingsFactory,
    debezium_table: str,
    kafka: TansuBroker,
) -> None:
    database = debezium_table
    events, own = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("order", "own"))
    kafka.create_topic(events, partitions=3)
    kafka.create_topic(own, partitions=1)
    before = [(f"agg{a}", step) for step in range(5) for a in range(4)]
    app_insert(database, events, before)  # rows already there: they drain too

    done = migrate_own_table(database)
    assert done.returncode == 0, done.stderr
    grant_view(database)
    after = [(f"agg{a}", step) for step in range(5, 10) for a in range(4)]
    app_insert(database, events, after)
    insert_rows(database, own, [("k", b"k:0"), ("k", b"k:1")])  # the relay's own outbox

    with (
        running_relay(make_settings(outbox_table=TABLE, lease_name="inventory")),
        running_relay(make_settings(replica_id="own-outbox")),
    ):
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM inventory.outboxevent") == 0,
            timeout=30,
            message="the Debezium table drained",
        )
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM public.outbox") == 0,
            timeout=30,
            message="the relay's own outbox drained",
        )
    records = consume(kafka.bootstrap_servers, events, min_count=40)
    per_aggregate_order(records)
    assert {json.loads(r.value or b"")["v"] for r in records} == {
        f"{a}:{s}" for a, s in before + after
    }
    assert all(r.headers["type"] == b"OrderCreated" for r in records)
    assert all(uuid.UUID(r.headers["message-id"].decode()) for r in records)
    assert [r.value for r in consume(kafka.bootstrap_servers, own, min_count=2)] == [
        b"k:0",
        b"k:1",
    ]
    leases = scalar(database, "SELECT string_agg(name, ',' ORDER BY name) FROM leases")
    assert leases == "default,inventory"
    # The app's columns are as they were; the relay's are its own.
    columns = scalar(
        database,
        "SELECT string_agg(attname, ',' ORDER BY attnum) FROM pg_attribute"
        " WHERE attrelid = 'inventory.outboxevent'::regclass AND attnum > 0"
        " AND NOT attisdropped",
    )
    assert columns.startswith("id,aggregatetype,aggregateid,type,payload,relay_")


def test_the_fetch_reads_the_tables_own_indexes_through_the_view(
    make_settings: SettingsFactory, debezium_table: str
) -> None:
    database = debezium_table
    app_insert(database, "t", [(f"agg{n % 50}", n) for n in range(3000)])
    assert migrate_own_table(database).returncode == 0
    grant_view(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ANALYZE inventory.outboxevent")
    settings = make_settings(outbox_table=TABLE, lease_name="inventory")
    params: dict[str, Any] = {
        "limit": 100,
        "max_bytes": 1 << 20,
        "message_max": 1 << 30,
        "after": None,
        "in_flight": "{}",
        "in_flight_ranges": "{}",
        "held": [],
    }
    params |= {"shards": 1, "shard": 0}
    with db.connect(settings, purpose="drain") as conn:
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        plan = "\n".join(
            r["QUERY PLAN"] for r in conn.execute("EXPLAIN " + QUERIES.fetch_head, params)
        )
        rows = conn.execute(QUERIES.fetch_head, params).fetchall()
    assert "outboxevent_relay_unsent_" in plan, plan
    assert "outboxevent_relay_waiting_" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert len(rows) == 100 and all(r["ready"] for r in rows)
    # The settle and the failures find rows by id (relay_id, added by the migration).
    ids = "{" + ",".join(str(r["id"]) for r in rows[:10]) + "}"
    with db.connect(settings, purpose="drain") as conn:
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        for statement, args in (
            (QUERIES.delete_sent, {"ids": ids}),
            (
                QUERIES.record_failures,
                {"ids": ids, "attempted": [1] * 10, "delays": [1.0] * 10, "errors": ["e"] * 10},
            ),
            (QUERIES.dead_letter, {"ids": ids, "attempted": [1] * 10, "reasons": ["r"] * 10}),
        ):
            plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN " + statement, args))
            # By id: the table's index on relay_id, or the one on its unsent rows' relay_id
            # (the view holds those only).
            by_id = re.search(r"Index Cond: \(relay_id = (ANY|f\.id)", plan) is not None
            assert by_id and "Seq Scan" not in plan, plan


def test_dry_run_prints_the_sql_and_changes_nothing(debezium_table: str) -> None:
    done = migrate_own_table(debezium_table, "--dry-run")
    assert done.returncode == 0, done.stderr
    for expected in (
        'ALTER TABLE "inventory"."outboxevent"',
        "relay_id bigint GENERATED ALWAYS AS IDENTITY",
        'CREATE OR REPLACE VIEW "relay_inventory_outboxevent"."outbox"',
        '"t"."aggregateid"::text AS key',
        'jsonb_build_object(\'type\', "t"."type")',
        'CREATE INDEX IF NOT EXISTS "outboxevent_relay_unsent_',
    ):
        assert expected in done.stdout, (expected, done.stdout)
    assert scalar(debezium_table, "SELECT to_regnamespace(%s)", (VIEW_SCHEMA,)) is None
    assert scalar(debezium_table, "SELECT count(*) FROM schema_migrations") > 0  # as before
    assert (
        scalar(
            debezium_table,
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'inventory.outboxevent'::regclass"
            " AND attname LIKE 'relay%%'",
        )
        == 0
    )


def test_an_own_table_needs_its_lease_name_and_its_view(
    make_settings: SettingsFactory, debezium_table: str
) -> None:
    with pytest.raises(SettingsError, match="RELAY_LEASE_NAME"):
        make_settings(outbox_table=TABLE)
    with pytest.raises(ValueError, match="outbox_columns"):
        Settings(database_url="postgresql://x@h/d", outbox_columns={"topik": "a"})
    with pytest.raises(ValueError, match="relay's own table"):
        make_settings(outbox_table="public.outbox", lease_name="x")
    settings = make_settings(outbox_table=TABLE, lease_name="inventory")
    with pytest.raises(SettingsError, match="relay migrate --own-table"):
        db.connect(settings, purpose="drain")


def test_a_rerun_with_a_new_mapping_keeps_the_grants_and_replaces_stale_indexes(
    make_settings: SettingsFactory, debezium_table: str
) -> None:
    database = debezium_table
    assert migrate_own_table(database).returncode == 0
    grant_view(database)

    def relay_indexes() -> set[str]:
        return set(
            scalar(
                database,
                "SELECT string_agg(indexname, ',') FROM pg_indexes"
                " WHERE tablename = 'outboxevent' AND indexname LIKE 'outboxevent_relay_%%'",
            ).split(",")
        )

    before = relay_indexes()
    done = migrate_own_table(database, columns={**COLUMNS, "key": "type"})  # by event type
    assert done.returncode == 0, done.stderr
    after = relay_indexes()
    stale = before - after
    assert {n.rsplit("_", 1)[0] for n in stale} == {
        "outboxevent_relay_key",
        "outboxevent_relay_waiting",
    }, (before, after)
    assert all("type" in d for d in indexes_of(database, after - before))
    # The grants survived (CREATE OR REPLACE): the relay role still reads the view.
    settings = make_settings(outbox_table=TABLE, lease_name="inventory")
    with db.connect(settings, purpose="status") as conn:
        conn.execute("SELECT count(*) FROM outbox").fetchone()


def test_a_key_index_of_an_earlier_release_stops_start_up_until_own_table_runs_again(
    make_settings: SettingsFactory, debezium_table: str
) -> None:
    """An earlier release's `--own-table` built the key index on the whole key; this
    release's fair fetch walks the key's hash, and without that index
    would read the table once per key (found in review: 5.5 s a fetch at 100,000 rows)."""
    database = debezium_table
    assert migrate_own_table(database).returncode == 0
    grant_view(database)
    settings = make_settings(outbox_table=TABLE, lease_name="inventory")
    startup_checks.run(settings)  # as built by this release
    with psycopg.connect(database, autocommit=True) as conn:
        hashed = scalar(
            database,
            "SELECT indexname FROM pg_indexes WHERE tablename = 'outboxevent'"
            " AND indexdef LIKE '%%outbox_key_hash(%%'",
        )
        conn.execute(f"DROP INDEX inventory.{hashed}")
        conn.execute(  # as the earlier release built it
            "CREATE INDEX outboxevent_relay_key_0e0e0e0e ON inventory.outboxevent"
            " ((aggregateid::text), relay_id)"
        )
    with pytest.raises(SettingsError, match=r"RELAY_OUTBOX_TABLE.*relay migrate --own-table"):
        startup_checks.run(settings)
    assert migrate_own_table(database).returncode == 0
    startup_checks.run(settings)


def indexes_of(database: str, names: set[str]) -> list[str]:
    with psycopg.connect(database) as conn:
        return [
            row[0]
            for row in conn.execute(
                "SELECT indexdef FROM pg_indexes WHERE indexname = ANY(%s)", (list(names),)
            )
        ]


def test_a_timestamp_without_time_zone_is_refused_with_the_setting_named(
    debezium_table: str,
) -> None:
    with psycopg.connect(debezium_table, autocommit=True) as conn:
        conn.execute("ALTER TABLE inventory.outboxevent ADD COLUMN available_at timestamp")
    done = migrate_own_table(debezium_table, "--dry-run")
    assert done.returncode == 2
    assert "RELAY_OUTBOX_COLUMNS" in done.stderr and "timestamptz" in done.stderr


@pytest.mark.unit
def test_a_mapping_that_is_not_json_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", "postgresql://x@h/d")
    monkeypatch.setenv("RELAY_OUTBOX_COLUMNS", "{bad")
    with pytest.raises(SettingsError, match="RELAY_OUTBOX_COLUMNS: is not valid JSON"):
        load_settings(CommonSettings)
    monkeypatch.setenv("RELAY_OUTBOX_COLUMNS", '{"topic": 1}')
    with pytest.raises(SettingsError, match=r"^RELAY_OUTBOX_COLUMNS:"):
        load_settings(CommonSettings)


def test_a_paused_topic_of_an_own_table_waits_parked_and_goes_in_order_once_resumed(
    make_settings: SettingsFactory,
    debezium_table: str,
    relay_dsn: str,
    kafka: TansuBroker,
) -> None:
    """`relay pause` holds an own table's topic as it holds the relay's own outbox's:
    the first row of each aggregate parked in the table (relay_next_attempt_at), the
    rest behind it, nothing attempted; resumed, all of it goes, in order."""
    database = debezium_table
    events = f"order-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(events, partitions=3)
    assert migrate_own_table(database).returncode == 0
    grant_view(database)
    paused = relay_cli(relay_dsn, "pause", events)
    assert paused.returncode == 0, paused.stderr
    rows = [(f"agg{a}", step) for step in range(3) for a in range(4)]
    app_insert(database, events, rows)
    parked = (
        "SELECT count(*) FROM inventory.outboxevent WHERE relay_next_attempt_at = 'infinity'"
        " AND relay_attempts = 0"
    )
    with running_relay(make_settings(outbox_table=TABLE, lease_name="inventory")):
        wait_until(lambda: scalar(database, parked) == 4, timeout=30, message="heads parked")
        assert scalar(database, "SELECT count(*) FROM inventory.outboxevent") == 12
        resumed = relay_cli(relay_dsn, "resume", events)
        assert resumed.returncode == 0, resumed.stderr
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM inventory.outboxevent") == 0,
            timeout=30,
            message="the table drained once resumed",
        )
    records = consume(kafka.bootstrap_servers, events, min_count=12)
    per_aggregate_order(records)
    assert len(records) == 12
