"""Scheduled delivery (available_at) on real PostgreSQL and Kafka: a row
is not published before its time by the database clock, holds back the later rows of
its key meanwhile, is not lag until due, and a large schedule costs the fetch nothing."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg.rows import dict_row

import relay
from relay.admin.schema_options import shard_index_names
from relay.observe import lag
from relay.store import connection, repository
from tests.conftest import SettingsFactory, relay_migrate
from tests.harness.kafka import TansuBroker, consume
from tests.support import (
    assert_per_key_order,
    outbox_indexes,
    running_relay,
    scalar,
    wait_until,
)
from tests.test_fetch import _fetch_cost, fetch, head_scans

DELAY = 4.0  # seconds: long enough to watch the row wait, short enough for a test


def sent(dsn: str, payload: str) -> bool:
    return bool(
        scalar(
            dsn, "SELECT EXISTS (SELECT FROM outbox_sent WHERE payload = %s)", (payload.encode(),)
        )
    )


def test_a_scheduled_row_waits_for_its_time_and_holds_back_its_key(
    make_settings: SettingsFactory, database: str, topic: str, kafka: TansuBroker
) -> None:
    # Retention mode, so every row keeps its sent_at (database clock).
    with (
        running_relay(make_settings(retention_seconds=3600)),
        psycopg.connect(database, autocommit=True, row_factory=dict_row) as sampler,
    ):
        # The relay drains first, so its start-up (however slow the machine) is not part
        # of the delay the rows below are watched through.
        with psycopg.connect(database) as conn, conn.transaction():
            relay.enqueue(conn, topic, "warm:0", key="warm")
        wait_until(lambda: sent(database, "warm:0"), timeout=30, message="the relay drains")
        with psycopg.connect(database) as conn, conn.transaction():
            relay.enqueue(conn, topic, "k:0", key="k", delay=DELAY)
            relay.enqueue(conn, topic, "k:1", key="k")  # behind it: waits with it
            relay.enqueue(conn, topic, "other:0", key="other")  # another key: goes now
            # Read in the writing transaction: once committed, the drain's next pass
            # may move the row out into outbox_scheduled at any moment.
            row = conn.execute("SELECT available_at FROM outbox WHERE payload = 'k:0'").fetchone()
            assert row is not None
            due = row[0]
        # Until k:0 is due, by the database clock, neither row of its key goes. The
        # sample comes first and the clock with what was sent by then after it, in one
        # statement (one snapshot): when that still reads early, the sample was taken
        # before the row was due. The first sample follows the commit at once, so the
        # window is watched however long the other key's row takes on a busy machine.
        waited = 0
        while True:
            sample = lag.measure(sampler, 100)
            snapshot = sampler.execute(
                "SELECT now() < %s - interval '100 ms' AS early, EXISTS (SELECT FROM"
                " outbox_sent WHERE payload IN ('k:0', 'k:1')) AS sent_any,"
                " EXISTS (SELECT FROM outbox_sent WHERE payload = 'other:0') AS other_sent",
                (due,),
            ).fetchone()
            assert snapshot is not None
            if not snapshot["early"]:
                break
            assert not snapshot["sent_any"]
            assert sample.scheduled == 1 and sample.next_due_in_seconds is not None
            # k:1, held back, and other:0 until it is sent (the sample is read before the
            # snapshot: it may still count a row the snapshot sees sent); the scheduled
            # row is no lag.
            assert sample.unsent in ((1, 2) if snapshot["other_sent"] else (2,)), sample
            waited += 1
            time.sleep(0.05)
        assert waited > 0, "the row was due before the first sample: nothing shown"
        wait_until(lambda: sent(database, "other:0"), timeout=20, message="the other key")
        wait_until(
            lambda: sent(database, "k:0") and sent(database, "k:1"),
            timeout=DELAY + 10,
            message="the scheduled row and the one behind it, once due",
        )
    first, second = (
        scalar(database, "SELECT sent_at FROM outbox_sent WHERE payload = %s", (p,))
        for p in (b"k:0", b"k:1")
    )
    assert first >= due and second >= first
    records = consume(kafka.bootstrap_servers, topic, min_count=4)
    assert_per_key_order(records)
    assert [r.value for r in records if r.key == "k"][:2] == [b"k:0", b"k:1"]


def test_a_large_schedule_costs_the_fetch_nothing(database: str) -> None:
    """30,000 rows scheduled for later, in front, each its own key: once the drain's
    pass moved them out of the outbox, the fetch finds the rows due
    behind them without stepping over them."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " SELECT 't', 's' || g, 'x', now() + interval '1 hour'"
            " FROM generate_series(1, 30000) AS g"
        )
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 't', 'a' || (g % 20), 'a' FROM generate_series(1, 50) AS g"
        )
        conn.execute("ANALYZE outbox")
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        promoted = repository.promote_due(conn, 50_000, set_aside="move")
        assert promoted.rows == 0
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 30_000
        conn.execute("ANALYZE outbox_scheduled")
    assert len(fetch(database)) == 50
    cost = _fetch_cost(database)
    assert cost < 1_000, cost


def test_a_schedule_moved_out_after_the_statistics_saw_it_costs_the_fetch_nothing(
    database: str,
) -> None:
    """Found in review: statistics taken while 20,000 rows scheduled for later sat in the
    outbox; the pass moves them out and a backlog of 100,000 arrives. fetch_head's one
    look for scheduled rows still in the outbox, an EXISTS planned for many matches, read
    the whole outbox to find none (a seq scan, 100,000 rows every fetch); it is one
    descent of outbox_scheduled_idx."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")  # stay stale
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " SELECT 't', 's' || g, 'x', now() + interval '1 day'"
            " FROM generate_series(1, 20000) AS g"
        )
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 't', 'k' || (g % 100), 'x' FROM generate_series(1, 100) AS g"
        )
        conn.execute("ANALYZE outbox")
        repository.promote_due(conn, 50_000, set_aside="move")
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 20_000
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 't', 'k' || (g % 100), 'x' FROM generate_series(1, 100000) AS g"
        )
    scans = head_scans(database)
    assert not [s for s in scans if s[0] == "Seq Scan"], scans
    assert sum(read for *_, read in scans) < 5_000, [s for s in scans if s[3] > 0]


def test_rows_scheduled_for_later_wait_outside_the_outbox_and_come_back_under_their_ids(
    database: str,
) -> None:
    """Migration 0020: a pass moves the rows scheduled for later into outbox_scheduled,
    where they still hold back the later rows of their key and count as scheduled; once
    due, a pass lets them back in under their ids, in their id's place."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        ids = [
            row["id"]
            for row in conn.execute(
                "INSERT INTO outbox (topic, key, payload, available_at) VALUES"
                " ('t', 'k', 'soon', now() + interval '2 seconds'),"
                " ('t', 'k', 'behind', NULL),"
                " ('t', 'j', 'free', NULL),"
                " ('t', 'j', 'later', now() + interval '1 hour') RETURNING id"
            ).fetchall()
        ]
        first = repository.promote_due(conn, 10, set_aside="move")
        assert first.rows == 0 and first.next_due_in is not None and first.next_due_in <= 2
        parked = conn.execute("SELECT id FROM outbox_scheduled ORDER BY id").fetchall()
        assert [r["id"] for r in parked] == [ids[0], ids[3]]
        assert [m.payload for m in fetch(database)] == [b"free"]  # 'behind' waits for k
        sample = lag.measure(conn, 100)
        assert (sample.unsent, sample.scheduled) == (2, 2)
        wait_until(
            lambda: repository.promote_due(conn, 10, set_aside="move").rows == 1,
            timeout=10,
            message="the row, once due, let back in",
        )
        back = conn.execute(
            "SELECT id, promoted_at IS NOT NULL AS let_in FROM outbox WHERE payload = 'soon'"
        ).fetchone()
        assert back == {"id": ids[0], "let_in": True}
        assert [m.payload for m in fetch(database)] == [b"soon", b"behind", b"free"]
        sample = lag.measure(conn, 100)
        assert (sample.unsent, sample.scheduled) == (3, 1)
        assert sample.next_due_in_seconds is not None and sample.next_due_in_seconds > 3500


def test_promotion_lets_due_rows_in_soonest_first_and_says_when_next(database: str) -> None:
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at) VALUES"
            " ('t', 'k', 'late', now() - interval '1 second'),"
            " ('t', 'k', 'early', now() - interval '3 seconds'),"
            " ('t', 'j', 'mid', now() - interval '2 seconds'),"
            " ('t', 'k', 'future', now() + interval '1 hour')"
        )
        assert fetch(database) == []  # nothing let in yet

        first = repository.promote_due(conn, 2, set_aside="move")
        assert first.rows == 2
        assert first.next_due_in is not None and 3500 < first.next_due_in <= 3600
        promoted = conn.execute(
            "SELECT payload FROM outbox WHERE promoted_at IS NOT NULL ORDER BY id"
        ).fetchall()
        assert [r["payload"] for r in promoted] == [b"early", b"mid"]  # soonest due first
        # 'late' (id 1) is due but not in yet: the later rows of key k wait for it.
        assert [m.payload for m in fetch(database)] == [b"mid"]

        assert repository.promote_due(conn, 2, set_aside="move").rows == 1
        assert [m.payload for m in fetch(database)] == [b"late", b"early", b"mid"]
        # The rows keep the app's available_at; the latency counts from it.
        rows = fetch(database)
        due = conn.execute(
            "SELECT extract(epoch FROM available_at)::float8 AS e FROM outbox ORDER BY id LIMIT 1"
        ).fetchone()
        assert due is not None and rows[0].due_epoch == pytest.approx(due["e"])


def test_a_row_due_and_not_let_in_is_lag_and_one_not_due_is_not(database: str) -> None:
    """No relay runs: a row overdue by 30 s is lag of 30 s; one due in an hour is only
    counted as scheduled."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at) VALUES"
            " ('t', 'k', 'x', now() + interval '1 hour')"
        )
        sample = lag.measure(conn, 100)
        assert (sample.unsent, sample.scheduled) == (0, 1)
        assert sample.oldest_unsent_age_seconds == 0
        assert sample.next_due_in_seconds is not None and sample.next_due_in_seconds > 3500
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at) VALUES"
            " ('t', 'j', 'y', now() - interval '30 seconds')"
        )
        sample = lag.measure(conn, 100)
        assert (sample.unsent, sample.scheduled) == (1, 1)
        assert 30 <= sample.oldest_unsent_age_seconds < 60


def test_enqueue_says_when_by_the_database_clock_and_refuses_ambiguity(database: str) -> None:
    at = datetime.now(UTC) + timedelta(minutes=5)
    with psycopg.connect(database) as conn, conn.transaction():
        relay.enqueue(conn, "t", b"a", key="k", available_at=at)
        relay.enqueue(conn, "t", b"b", key="k", delay=timedelta(seconds=90))
        relay.enqueue(conn, "t", b"c", key="k", delay=0)  # not scheduled
        rows = conn.execute(
            "SELECT available_at, extract(epoch FROM available_at - now())::float8"
            " FROM outbox ORDER BY id"
        ).fetchall()
    assert rows[0][0] == at
    assert rows[1][1] == pytest.approx(90.0)
    assert rows[2][0] is None
    with psycopg.connect(database) as conn:
        for bad, error in (
            ({"available_at": datetime(2030, 1, 1)}, ValueError),  # naive: which zone?
            ({"available_at": at, "delay": 1}, ValueError),
            ({"delay": -1}, ValueError),
            ({"delay": float("nan")}, ValueError),
            ({"delay": "5"}, TypeError),
        ):
            with pytest.raises(error):
                relay.enqueue(conn, "t", b"x", **bad)


def test_new_shard_indexes_leave_out_scheduled_rows(database: str) -> None:
    relay_migrate(database, "--shards", "2")
    found = outbox_indexes(database)
    defs = [found[name] for name in shard_index_names(2)]
    assert all("promoted_at IS NOT NULL" in d for d in defs), defs


def test_a_promoted_row_at_the_head_does_not_hide_a_longer_wait_behind_it(database: str) -> None:
    """Found in review: the oldest age was the lowest id's, and a scheduled row promoted
    10 s ago sits at its old id, in front of a row waiting for 6 hours."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, created_at, available_at, promoted_at)"
            " VALUES ('t', 'a', 'x', now() - interval '1 day', now() - interval '10 seconds',"
            "         now())"
        )
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, created_at)"
            " VALUES ('t', 'b', 'y', now() - interval '6 hours')"
        )
        sample = lag.measure(conn, 100)
    assert sample.unsent == 2
    assert 6 * 3600 <= sample.oldest_unsent_age_seconds < 6 * 3600 + 60


def test_each_shards_lag_counts_its_rows_due_and_not_let_in(database: str) -> None:
    """Found in review: the per-shard count left out what the total counts."""
    relay_migrate(database, "--shards", "2")
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at) VALUES"
            " ('t', 'k', 'x', now() - interval '30 seconds'),"
            " ('t', 'k', 'y', now() + interval '1 hour')"
        )
        shards = lag.measure_shards(conn, 2, 100)
    assert sum(s.unsent for s in shards) == 1
    assert 30 <= max(s.oldest_unsent_age_seconds for s in shards) < 60


def test_a_pass_with_nothing_to_move_fires_no_statement_trigger(database: str) -> None:
    """Found in review: the NOTIFY trigger is statement-level, so an INSERT of no rows
    fires it; a pass that let in nothing woke every relay listening, whose wake-up ran
    another pass: an idle relay looped. A pass moves nothing unless a row is due."""
    relay_migrate(database, "--notify-trigger", "wake")
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("LISTEN wake")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " VALUES ('t', 'k', 'later', now() + interval '1 hour')"
        )
        assert len(list(conn.notifies(timeout=1.0, stop_after=1))) == 1  # the app's own
        with psycopg.connect(database, autocommit=True, row_factory=dict_row) as relay:
            for _ in range(3):  # the first moves the row out; the others find nothing
                repository.promote_due(relay, 10, set_aside="move")
        assert list(conn.notifies(timeout=1.0, stop_after=1)) == []


def test_an_idle_pass_writes_nothing(database: str) -> None:
    """The drain's pass runs up to ten times a second when idle (the default poll): with
    a row parked for later and nothing to move, it must take no transaction id, so it
    writes no WAL and its commit has nothing to flush. A row lock on the parking flag
    (the first fix of the rollback race) made every pass such a commit."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " VALUES ('t', 'k', 'later', now() + interval '1 hour')"
        )
        repository.promote_due(conn, 100, set_aside="move")
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 1
    with psycopg.connect(database, row_factory=dict_row) as conn:  # one transaction
        repository.promote_due(conn, 100, set_aside="move")
        xid = conn.execute("SELECT pg_current_xact_id_if_assigned() AS xid").fetchone()
        assert xid == {"xid": None}


def test_a_row_the_outbox_refuses_to_take_back_is_dead_lettered_and_the_rest_go_in(
    database: str,
) -> None:
    """Found in review: an app's constraint the parked row no longer meets failed every
    pass, and the pass runs before the fetch: the lane stopped for every key. Now that
    row becomes a dead letter with the reason; the columns the app added go and come
    back with the others."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 'none'")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, tenant, available_at) VALUES"
            " ('t', 'a', 'fine', 'acme', now() + interval '2 seconds'),"
            " ('t', 'b', 'refused', 'acme', now() + interval '2 seconds')"
        )
        assert repository.promote_due(conn, 10, set_aside="move").rows == 0
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 2
        conn.execute("ALTER TABLE outbox ADD CONSTRAINT no_refused CHECK (payload <> 'refused')")
        wait_until(
            lambda: repository.promote_due(conn, 10, set_aside="move").rows == 1,
            timeout=10,
            message="the due rows, one let in",
        )
        back = conn.execute("SELECT payload, tenant FROM outbox").fetchall()
        assert back == [{"payload": b"fine", "tenant": "acme"}]
        dead = conn.execute("SELECT key, dead_letter_reason FROM outbox_dead").fetchall()
        assert [d["key"] for d in dead] == ["b"]
        assert "no_refused" in dead[0]["dead_letter_reason"]
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 0


def park_due_soon(conn: psycopg.Connection[dict[str, object]], dsn: str, values: str) -> None:
    """Rows due in 2 s, moved out by a pass; then waits until they are due."""
    conn.execute(f"INSERT INTO outbox (topic, key, payload{values}")
    assert repository.promote_due(conn, 100, set_aside="move").rows == 0
    assert scalar(dsn, "SELECT count(*) FROM outbox") == 0
    wait_until(
        lambda: scalar(dsn, "SELECT bool_and(available_at <= now()) FROM outbox_scheduled"),
        timeout=10,
        message="the parked rows due",
    )


def test_a_row_an_insert_trigger_drops_on_the_way_back_is_dead_lettered_not_lost(
    database: str,
) -> None:
    """Found in review: the move back deleted from outbox_scheduled whatever it read,
    and a BEFORE INSERT trigger returning NULL made the row vanish. A row leaves only once
    the outbox took it; a column the app added while it was parked gets its default."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        park_due_soon(
            conn,
            database,
            ", available_at) VALUES ('t', 'a', 'kept', now() + interval '2 seconds'),"
            " ('t', 'b', 'dropped', now() + interval '2 seconds')",
        )
        conn.execute("ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 'none'")
        conn.execute(
            "CREATE FUNCTION drop_b() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN IF NEW.key = 'b' THEN RETURN NULL; END IF; RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER drop_b BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION drop_b()"
        )
        assert repository.promote_due(conn, 100, set_aside="move").rows == 1
        back = conn.execute("SELECT key, tenant FROM outbox").fetchall()
        assert back == [{"key": "a", "tenant": "none"}]
        dead = conn.execute("SELECT key, dead_letter_reason FROM outbox_dead").fetchall()
        assert [d["key"] for d in dead] == ["b"]
        assert "trigger" in dead[0]["dead_letter_reason"]
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 0


def test_columns_added_while_a_row_is_parked_come_back_as_an_insert_would_write_them(
    database: str,
) -> None:
    """Found in the second review: an identity column, a domain's default, a NOT NULL
    domain with a column default, added while the row was out; each the value an INSERT
    that leaves the column out writes (the first two came back NULL, the third failed
    every row with extra on the domain's check)."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN tenant text")
        park_due_soon(
            conn,
            database,
            ", tenant, available_at) VALUES ('t', 'a', 'x', 'acme', now() + interval '2 seconds')",
        )
        conn.execute("ALTER TABLE outbox ADD COLUMN seq bigint GENERATED BY DEFAULT AS IDENTITY")
        conn.execute("CREATE DOMAIN prio AS int DEFAULT 7")
        conn.execute("CREATE DOMAIN weight AS int NOT NULL")
        conn.execute("ALTER TABLE outbox ADD COLUMN p prio, ADD COLUMN w weight DEFAULT 5")
        assert repository.promote_due(conn, 100, set_aside="move").rows == 1
        row = conn.execute("SELECT tenant, seq, p, w FROM outbox").fetchone()
        assert row == {"tenant": "acme", "seq": 1, "p": 7, "w": 5}
        assert scalar(database, "SELECT count(*) FROM outbox_dead") == 0


def test_a_deferred_constraint_refusing_a_row_on_the_way_back_fails_only_that_row(
    database: str,
) -> None:
    """Found in the second review: a deferred foreign key is checked at commit, past the
    move's handling, and failed every pass. It is checked in the move."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("CREATE TABLE customer (id int PRIMARY KEY)")
        conn.execute("INSERT INTO customer VALUES (1), (2)")
        conn.execute(
            "ALTER TABLE outbox ADD COLUMN customer_id int"
            " REFERENCES customer DEFERRABLE INITIALLY DEFERRED"
        )
        park_due_soon(
            conn,
            database,
            ", customer_id, available_at) VALUES"
            " ('t', 'a', 'x', 1, now() + interval '2 seconds'),"
            " ('t', 'b', 'y', 2, now() + interval '2 seconds')",
        )
        conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_customer_id_fkey")
        conn.execute("DELETE FROM customer WHERE id = 2")
        conn.execute(
            "ALTER TABLE outbox ADD FOREIGN KEY (customer_id)"
            " REFERENCES customer DEFERRABLE INITIALLY DEFERRED"
        )
        assert repository.promote_due(conn, 100, set_aside="move").rows == 1
        dead = conn.execute("SELECT key FROM outbox_dead").fetchall()
        assert dead == [{"key": "b"}]


def test_a_rollback_unpark_waits_for_a_pass_under_way_and_strands_no_row(
    database: str,
) -> None:
    """Found in the second review: a replica of this release still running during the
    rollback's outbox_unpark_all parked a row its snapshot no longer saw; the row stayed
    out with parking off, and the earlier release would never publish it."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " VALUES ('t', 'k', 'a', now() + interval '1 hour')"
        )
        assert conn.execute("SELECT outbox_park_scheduled(10)").fetchone() == (1,)
        with psycopg.connect(database) as operator:
            assert operator.execute("SELECT outbox_unpark_all()").fetchone() == (1,)
            parked: list[object] = []

            def replica_pass() -> None:
                with psycopg.connect(database, autocommit=True) as replica:
                    replica.execute(
                        "INSERT INTO outbox (topic, key, payload, available_at)"
                        " VALUES ('t', 'k', 'b', now() + interval '1 hour')"
                    )
                    parked.append(replica.execute("SELECT outbox_park_scheduled(10)").fetchone())

            thread = threading.Thread(target=replica_pass)
            thread.start()
            wait_until(
                lambda: (
                    conn.execute(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND query LIKE '%%outbox_park_scheduled%%'"
                    ).fetchone()
                    == (1,)
                ),
                timeout=10,
                message="the replica's pass waiting for the rollback",
            )
            operator.commit()
            thread.join(timeout=10)
        assert parked == [(0,)]
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 0
        assert scalar(database, "SELECT count(*) FROM outbox WHERE promoted_at IS NULL") == 2


def test_a_lock_timeout_on_the_way_back_fails_the_pass_and_dead_letters_nothing(
    database: str,
) -> None:
    """Found in review: any error moving a row back made it a dead letter, a lock wait
    too. An error that may pass fails the pass, and the next one lets the row in."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("CREATE TABLE customer (id int PRIMARY KEY)")
        conn.execute("INSERT INTO customer VALUES (1)")
        conn.execute("ALTER TABLE outbox ADD COLUMN customer_id int REFERENCES customer")
        park_due_soon(
            conn,
            database,
            ", customer_id, available_at) VALUES ('t', 'a', 'x', 1, now() + interval '2 seconds')",
        )
        with psycopg.connect(database) as app:
            app.execute("SELECT * FROM customer WHERE id = 1 FOR UPDATE")  # held
            conn.execute("SET lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                repository.promote_due(conn, 100, set_aside="move")
            assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 1
            assert scalar(database, "SELECT count(*) FROM outbox_dead") == 0
        assert repository.promote_due(conn, 100, set_aside="move").rows == 1
        assert scalar(database, "SELECT count(*) FROM outbox_dead") == 0


def test_a_let_in_that_stops_at_its_bytes_says_to_look_again_at_once(database: str) -> None:
    """Found in review: the move back stops at 16 MiB, and the rows past it waited a
    whole idle poll (the next-due probe looks at rows due later only)."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " SELECT 't', 'k' || g, convert_to(repeat('x', 1000000), 'UTF8'),"
            "        now() + interval '2 seconds'"
            " FROM generate_series(1, 20) AS g"
        )
        while scalar(database, "SELECT count(*) FROM outbox") > 0:
            repository.promote_due(conn, 100, set_aside="move")
        wait_until(
            lambda: scalar(
                database, "SELECT bool_and(available_at <= now()) FROM outbox_scheduled"
            ),
            timeout=10,
            message="the parked rows due",
        )
        first = repository.promote_due(conn, 100, set_aside="move")
        assert 0 < first.rows < 20 and first.next_due_in == 0.0
        rest = repository.promote_due(conn, 100, set_aside="move")
        assert first.rows + rest.rows == 20 and rest.next_due_in is None


def test_unpark_all_puts_every_parked_row_back_as_an_earlier_release_wrote_it(
    database: str,
) -> None:
    """The rollback past scheduled rows moved out (docs/howto/scheduled-delivery.md): parking off,
    every parked row back in the outbox under its id, not let in, its added columns
    restored; a later pass parks nothing."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN tenant text")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, tenant, available_at)"
            " VALUES ('t', 'k', 'later', 'acme', now() + interval '1 hour')"
        )
        repository.promote_due(conn, 100, set_aside="move")
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 1
        assert conn.execute("SELECT outbox_unpark_all() AS n").fetchone() == {"n": 1}
        row = conn.execute("SELECT tenant, promoted_at FROM outbox").fetchone()
        assert row == {"tenant": "acme", "promoted_at": None}
        repository.promote_due(conn, 100, set_aside="move")
        assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 0


def test_cancel_takes_back_a_row_scheduled_for_later_wherever_it_waits(database: str) -> None:
    """relay.cancel: a row scheduled for later is taken back, moved out into
    outbox_scheduled or still in the outbox; a row never scheduled, or let in once due,
    may be on its way to the sink and is left alone."""
    with psycopg.connect(database, row_factory=dict_row) as app:
        parked = relay.enqueue(app, "t", "parked", key="k", delay=3600)
        due = relay.enqueue(app, "t", "due", key="d", available_at=datetime.now(UTC))
        now = relay.enqueue(app, "t", "now", key="n")
        app.commit()
        with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
            assert repository.promote_due(conn, 10, set_aside="move").rows == 1  # 'due'
        waiting = relay.enqueue(app, "t", "waiting", key="w", delay=3600)
        app.commit()
        assert scalar(database, "SELECT array_agg(id) FROM outbox_scheduled") == [parked.id]

        assert relay.cancel(app, parked.id) is True
        assert relay.cancel(app, waiting.id) is True
        assert relay.cancel(app, due.id) is False
        assert relay.cancel(app, now.id) is False
        assert relay.cancel(app, parked.id) is False  # already taken back
        app.commit()
    assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 0
    assert [m.payload for m in fetch(database)] == [b"due", b"now"]


def test_cancel_finds_a_row_the_relay_moves_out_while_it_waits_for_the_row(
    database: str,
) -> None:
    """The race the cancel statement cannot see alone: the relay's pass locks the row to
    move it into outbox_scheduled; the app's DELETE waits, then finds the row gone from
    the outbox (its snapshot predates the move). The helper's second statement finds it
    where it went."""
    row_id = scalar(
        database,
        "INSERT INTO outbox (topic, key, payload, available_at)"
        " VALUES ('t', 'k', 'later', now() + interval '1 hour') RETURNING id",
    )
    with psycopg.connect(database) as mover:
        assert mover.execute("SELECT outbox_park_scheduled(10)").fetchone() == (1,)
        outcome: list[bool] = []

        def app_cancels() -> None:
            with psycopg.connect(database) as app:
                outcome.append(relay.cancel(app, row_id))
                app.commit()

        thread = threading.Thread(target=app_cancels)
        thread.start()
        with psycopg.connect(database, autocommit=True) as conn:
            wait_until(
                lambda: (
                    conn.execute(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND query LIKE '%%outbox_scheduled%%'"
                    ).fetchone()
                    == (1,)
                ),
                timeout=10,
                message="the app's cancel waiting for the row the pass holds",
            )
        mover.commit()
        thread.join(timeout=10)
    assert outcome == [True]
    assert scalar(database, "SELECT count(*) FROM outbox_scheduled") == 0
    assert scalar(database, "SELECT count(*) FROM outbox") == 0
