"""Retention mode (RELAY_RETENTION_SECONDS > 0) on real PostgreSQL and
Kafka: a settle moves the acknowledged rows out of the outbox into outbox_sent's
current generation, under the same fence; the purge empties the oldest generation
whole, and only once every row in it is older than the retention; the runtime role
needs no DDL for any of it."""

from __future__ import annotations

import threading

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg.rows import dict_row

from relay.daemon.app import RelayApp
from relay.errors import SettingsError
from relay.sql import QUERIES
from relay.store import repository
from relay.store.purge import Purger
from tests.conftest import SettingsFactory, relay_env
from tests.harness.kafka import TansuBroker, consume
from tests.harness.webhook import Reply, WebhookServer
from tests.support import (
    assert_per_key_order,
    dedup_by_message_id,
    insert_rows,
    keyed_rows,
    running_relay,
    scalar,
    unsent_count,
    wait_until,
)
from tests.test_operations import run_cli

HOUR = 3600.0


def generations(dsn: str) -> dict[int, str]:
    """Each generation's start, as text ('-infinity' for one never begun)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT generation, started_at::text FROM outbox_sent_generations"
        ).fetchall()
    return {int(g): str(at) for g, at in rows}


def set_started(dsn: str, **ago: str | None) -> None:
    """generation g began `ago['g<g>']` ago (an interval), or never (None)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name, interval in ago.items():
            conn.execute(
                "UPDATE outbox_sent_generations SET started_at ="
                " CASE WHEN %(i)s::interval IS NULL THEN '-infinity'"
                " ELSE now() - %(i)s::interval END WHERE generation = %(g)s",
                {"i": interval, "g": int(name[1:])},
            )


def keep_in(dsn: str, generation: int, rows: int, sent_ago: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox_sent (generation, id, message_id, topic, key, created_at,"
            " attempts, sent_at)"
            " SELECT %s, g, gen_random_uuid(), 't', 'k', now(), 0, now() - %s::interval"
            " FROM generate_series(1, %s) AS g",
            (generation, sent_ago, rows),
        )


def kept(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT generation, count(*) FROM outbox_sent GROUP BY generation"
        ).fetchall()
    return {int(g): int(n) for g, n in rows}


def test_a_relay_in_retention_mode_moves_what_it_sent_out_of_the_outbox(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """Every row delivered is in outbox_sent's current generation with its sent_at and
    what the app wrote; the outbox is empty, so no index of it holds a sent row."""
    ids = insert_rows(database, topic, keyed_rows(keys=5, per_key=40))
    with running_relay(make_settings(retention_seconds=HOUR)):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    records = dedup_by_message_id(consume(kafka.bootstrap_servers, topic, min_count=200))
    assert_per_key_order(records)
    assert scalar(database, "SELECT count(*) FROM outbox") == 0
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        rows = conn.execute(
            "SELECT id, generation, topic, key, payload, sent_at >= created_at AS after"
            " FROM outbox_sent ORDER BY id"
        ).fetchall()
    assert [r["id"] for r in rows] == ids
    assert {r["generation"] for r in rows} == {0}
    assert all(r["after"] and r["topic"] == topic for r in rows)
    assert {(r["key"], bytes(r["payload"])) for r in rows} == {
        (k, p) for k, p in keyed_rows(keys=5, per_key=40)
    }


def test_the_oldest_generation_is_emptied_whole_once_the_current_one_is_old_enough(
    database: str, relay_dsn: str
) -> None:
    """As the runtime role (no DDL): not while the current generation is younger than a
    third of the retention, nor while the one after the oldest began less than a
    retention ago (its rows could be younger); then one TRUNCATE, and the emptied one
    is current."""
    keep_in(database, 1, 50, "5 hours")
    keep_in(database, 0, 20, "10 minutes")
    set_started(database, g0="10 minutes")  # 1, 2, 3 never began
    with psycopg.connect(relay_dsn, autocommit=True, row_factory=dict_row) as conn:
        assert repository.rotate_sent(conn, HOUR) is None  # 0 is current for 10 min only
        set_started(database, g0="30 minutes", g2="50 minutes")
        assert repository.rotate_sent(conn, HOUR) is None  # 1's rows may be 50 min old
        set_started(database, g2="70 minutes", g3="2 hours", g1="3 hours")
        # Now 0 is current (30 min, past a third of an hour) but 1, the next, is not
        # the oldest that began: 2 began after it, 70 minutes ago, so 1's rows are older
        # than the retention.
        assert repository.rotate_sent(conn, HOUR) == 1
        assert repository.rotate_sent(conn, HOUR) is None  # 1 began just now
    assert kept(database) == {0: 20}
    started = generations(database)
    assert max(started, key=lambda g: started[g]) == 1


def test_the_purge_thread_rotates_and_the_cli_empties_old_generations(
    make_settings: SettingsFactory, database: str, relay_dsn: str
) -> None:
    """The leader's purge thread does the rotation at its interval; `relay purge
    --older-than` empties every generation but the current whose rows are all older."""
    keep_in(database, 2, 10, "4 hours")
    keep_in(database, 3, 10, "3 hours")
    keep_in(database, 0, 10, "1 minute")
    set_started(database, g2="5 hours", g3="3 hours", g0="90 minutes", g1=None)
    settings = make_settings(retention_seconds=HOUR, purge_interval_seconds=0.1)
    with running_relay(settings) as app:
        assert isinstance(app.purger, Purger)
        wait_until(
            lambda: (
                kept(database).get(1) is None
                and max(generations(database).items(), key=lambda item: item[1])[0] == 1
            ),
            10,
            message="generation 1 became current",
        )
    # 1 was empty anyway; 2 (all older than 3 hours) and 3 are not current any more.
    done = run_cli(relay_env(relay_dsn), "purge", "--older-than", "2h")
    assert done.returncode == 0, done.stderr
    assert "emptied 1 generation(s) of outbox_sent older than 7200s: 2" in done.stdout.decode()
    assert kept(database) == {3: 10, 0: 10}


def test_a_rotation_that_waits_on_a_reader_is_tried_again_at_the_next_run(
    make_settings: SettingsFactory, database: str
) -> None:
    """A reader of the generation due holds the rotation's TRUNCATE past the lock
    timeout: the run gives the rotation up till the next one, and counts no error."""
    keep_in(database, 1, 10, "5 hours")
    set_started(database, g0="30 minutes", g2="70 minutes", g3="2 hours", g1="3 hours")
    errors = REGISTRY.get_sample_value("relay_purge_errors_total") or 0.0
    settings = make_settings(
        retention_seconds=HOUR, purge_interval_seconds=0.1, database_lock_timeout_seconds=0.2
    )
    with psycopg.connect(database) as reader:
        reader.execute("SELECT count(*) FROM outbox_sent_1").fetchone()  # holds its lock
        with running_relay(settings) as app:
            assert isinstance(app.purger, Purger)
            purger = app.purger
            wait_until(
                lambda: purger.rotations_put_off >= 2, timeout=10, message="two runs put it off"
            )
            assert kept(database).get(1) == 10  # not emptied: its reader is still there
            reader.rollback()
            wait_until(
                lambda: kept(database).get(1) is None,
                timeout=10,
                message="the rotation at a later run",
            )
    assert (REGISTRY.get_sample_value("relay_purge_errors_total") or 0.0) == errors


def test_the_runtime_role_may_move_and_rotate_but_not_more(database: str, relay_dsn: str) -> None:
    """settle_move_sent and move_sent as the relay's role; it may not drop or alter the
    history, nor write it but through the settle."""
    ids = insert_rows(database, "t", [("k", b"1"), ("k", b"2")])
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO leases (name, holder, epoch, expires_at)"
            " VALUES ('keep', 'test', 1, now() + interval '1 minute')"
        )
    with psycopg.connect(relay_dsn, autocommit=True, row_factory=dict_row) as conn:
        fenced = conn.execute(
            QUERIES.settle_move_sent,
            {"name": "keep", "holder": "test", "epoch": 1, "ttl": 60.0, "ids": ids[:1]},
        ).fetchone()
        assert fenced is not None
        with conn.transaction():
            conn.execute(QUERIES.move_sent, {"ids": ids[1:]})
        for forbidden in (
            "DROP TABLE outbox_sent_1",
            "ALTER TABLE outbox_sent DETACH PARTITION outbox_sent_1",
            "DELETE FROM outbox_sent",
            "UPDATE outbox_sent SET topic = 'x'",
        ):
            try:
                with conn.transaction():
                    conn.execute(forbidden)
            except psycopg.errors.InsufficientPrivilege:
                continue
            raise AssertionError(f"the runtime role could: {forbidden}")
    assert kept(database) == {0: 2}


# --- review ----------------------------------------------------------------------


def test_a_settle_landing_in_the_old_generation_during_a_rotation_is_before_the_new_one_began(
    database: str, relay_dsn: str
) -> None:
    """The rotation's timing argument: every row of a generation was sent before the next
    generation began. A rotation waits for its TRUNCATE (a reader of the generation it
    empties, up to RELAY_DATABASE_LOCK_TIMEOUT_SECONDS, or the other leader's FOR UPDATE);
    a settle meanwhile still lands in the old current generation, stamped sent now. The
    new generation must not be said to have begun before those rows were sent (it is
    stamped with the rotation's transaction start now, so the old generation is emptied
    up to that wait before its last rows are a retention old)."""
    ids = insert_rows(database, "t", [("k", b"1"), ("k", b"2")])
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO leases (name, holder, epoch, expires_at)"
            " VALUES ('keep', 'test', 1, now() + interval '1 minute')"
        )
    set_started(database, g0="30 minutes")  # 0 current, 1 next: due now
    reader = psycopg.connect(database)  # a reader of generation 1, in a transaction
    reader.execute("SELECT count(*) FROM outbox_sent_1")
    rotated: list[int | None] = []

    def rotate() -> None:
        with psycopg.connect(relay_dsn, autocommit=True, row_factory=dict_row) as conn:
            rotated.append(repository.rotate_sent(conn, HOUR))

    rotation = threading.Thread(target=rotate)
    rotation.start()
    try:
        wait_until(
            lambda: (
                scalar(
                    database,
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()",
                )
                == 1
            ),
            10,
            message="the rotation's TRUNCATE to wait on the reader",
        )
        with psycopg.connect(relay_dsn, autocommit=True, row_factory=dict_row) as settling:
            fenced = settling.execute(
                QUERIES.settle_move_sent,
                {"name": "keep", "holder": "test", "epoch": 1, "ttl": 60.0, "ids": ids},
            ).fetchone()
            assert fenced is not None
    finally:
        reader.commit()
        reader.close()
        rotation.join(timeout=10)
    assert rotated == [1]
    late = scalar(
        database,
        "SELECT count(*) FROM outbox_sent AS s WHERE s.generation = 0 AND s.sent_at >"
        " (SELECT started_at FROM outbox_sent_generations WHERE generation = 1)",
    )
    assert late == 0, f"{late} row(s) of generation 0 sent after generation 1 began"


@pytest.mark.parametrize("missing", ["grant", "migration"])
def test_a_relay_that_cannot_move_sent_rows_does_not_publish_them_again_and_again(
    make_settings: SettingsFactory, database: str, missing: str
) -> None:
    """Retention mode needs outbox_sent and grants.sql's new lines (INSERT on
    outbox_sent). An upgrade that runs the new relay before either (grants.sql not
    re-run, or the image rolled out before `relay migrate`) must be refused at start-up
    with a clear reason, as a missing shard or fairness index is: the settle fails
    every time, and the drain would publish the same batch again some six times a
    second, for ever, never moving on."""
    with psycopg.connect(database, autocommit=True) as conn:
        if missing == "grant":
            conn.execute("REVOKE INSERT ON outbox_sent FROM relay")
        else:
            conn.execute("DROP TABLE outbox_sent, outbox_sent_generations")
    with WebhookServer(lambda d: Reply(200)) as receiver:
        insert_rows(database, "t", [("k", b"1"), ("k", b"2")])
        settings = make_settings(
            sink="http", http_url=receiver.url + "/hooks/{topic}", retention_seconds=HOUR
        )
        app = RelayApp(settings)
        outcome: list[object] = []

        def run() -> None:
            try:
                outcome.append(app.run())
            except BaseException as exc:  # what run() ended with is the point
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=3.0)
        app.shutdown.request()
        thread.join(timeout=30)
        deliveries = len(receiver.acked())
    assert deliveries <= 2, f"2 rows delivered {deliveries} times"
    assert outcome and isinstance(outcome[0], SettingsError), outcome
    assert outcome[0].name == "RELAY_RETENTION_SECONDS"
