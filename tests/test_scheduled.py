"""Scheduled delivery (available_at, migration 0008) on real PostgreSQL and Kafka: a row
is not published before its time by the database clock, holds back the later rows of
its key meanwhile, is not lag until due, and a large schedule costs the fetch nothing."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg.rows import dict_row

import relay
from relay import lag, repository
from relay.errors import MigrationError
from relay.migrate import create_shard_indexes, migrate, shard_index_names
from relay.queries import QUERIES
from relay.settings import CommonSettings
from tests.conftest import SettingsFactory, relay_migrate
from tests.harness.kafka import TansuBroker, consume
from tests.support import (
    assert_per_key_order,
    outbox_indexes,
    running_relay,
    scalar,
    wait_until,
)
from tests.test_fetch import _fetch_cost, fetch

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
    with psycopg.connect(database) as conn, conn.transaction():
        relay.enqueue(conn, topic, "k:0", key="k", delay=DELAY)
        relay.enqueue(conn, topic, "k:1", key="k")  # behind it: waits with it
        relay.enqueue(conn, topic, "other:0", key="other")  # another key: goes now
    due = scalar(database, "SELECT available_at FROM outbox WHERE payload = 'k:0'")
    assert due is not None

    # Retention mode, so every row keeps its sent_at (database clock).
    with (
        running_relay(make_settings(retention_seconds=3600)),
        psycopg.connect(database, autocommit=True, row_factory=dict_row) as sampler,
    ):
        wait_until(lambda: sent(database, "other:0"), timeout=20, message="the other key")
        # Until k:0 is due, by the database clock, neither row of its key goes.
        waited = 0
        while scalar(database, "SELECT now() < %s - interval '100 ms'", (due,)):
            assert not sent(database, "k:0") and not sent(database, "k:1")
            sample = lag.measure(sampler, 100)
            assert sample.scheduled == 1 and sample.next_due_in_seconds is not None
            assert sample.unsent == 1  # k:1, held back; the scheduled row is not lag
            waited += 1
            time.sleep(0.05)
        assert waited > 0, "the relay took longer than the delay to start: nothing shown"
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
    records = consume(kafka.bootstrap_servers, topic, min_count=3)
    assert_per_key_order(records)
    assert [r.value for r in records if r.key == "k"][:2] == [b"k:0", b"k:1"]


def test_a_large_schedule_costs_the_fetch_nothing(database: str) -> None:
    """30,000 rows scheduled for later, in front, each its own key: the fetch finds the
    rows due behind them through the drain indexes they are not in."""
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
    rows = fetch(database)
    assert len(rows) == 50 and {r.payload for r in rows} == {b"a"}
    cost = _fetch_cost(database)
    assert cost < 1_000, cost


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

        first = repository.promote_due(conn, 2)
        assert first.rows == 2
        assert first.next_due_in is not None and 3500 < first.next_due_in <= 3600
        promoted = conn.execute(
            "SELECT payload FROM outbox WHERE promoted_at IS NOT NULL ORDER BY id"
        ).fetchall()
        assert [r["payload"] for r in promoted] == [b"early", b"mid"]  # soonest due first
        # 'late' (id 1) is due but not in yet: the later rows of key k wait for it.
        assert [m.payload for m in fetch(database)] == [b"mid"]

        assert repository.promote_due(conn, 2).rows == 1
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


OLD_SHARD_INDEXES = (  # what `relay migrate --shards 3` built before scheduled delivery
    "CREATE INDEX outbox_shards_3_idx ON outbox (outbox_shard(key, id, 3), id)"
    " WHERE sent_at IS NULL AND dead_lettered_at IS NULL",
    "CREATE INDEX outbox_shards_3_key_idx ON outbox (outbox_shard(key, id, 3), key, id)"
    " WHERE sent_at IS NULL AND dead_lettered_at IS NULL",
)


def test_an_upgrade_keeps_the_previous_releases_indexes_for_a_rolling_upgrade(
    db_at_0007: str,
) -> None:
    with psycopg.connect(db_at_0007, autocommit=True) as conn:
        for statement in OLD_SHARD_INDEXES:
            conn.execute(statement)
    before = outbox_indexes(db_at_0007)
    migrated = migrate(CommonSettings(database_url=db_at_0007))
    assert migrated.waiting is not None and "0010" in migrated.waiting  # tests/test_upgrade.py
    after = outbox_indexes(db_at_0007)
    # A relay of the previous release, still running, reads exactly these.
    for name in ("outbox_unsent_idx", "outbox_key_idx", "outbox_shards_3_idx"):
        assert after[name] == before[name]
    for name in ("outbox_due_idx", "outbox_due_key_idx"):
        assert "promoted_at IS NOT NULL" in after[name], after[name]
    # This release's shard indexes are built by `relay migrate --shards 3` again.
    assert create_shard_indexes(CommonSettings(database_url=db_at_0007), 3) == list(
        shard_index_names(3)
    )


def test_a_dba_can_build_the_indexes_concurrently_first_and_a_failed_build_is_named(
    db_at_0007: str,
) -> None:
    with psycopg.connect(db_at_0007, autocommit=True) as conn:
        conn.execute(  # as migration 0008 does, by hand
            "ALTER TABLE outbox ADD COLUMN available_at timestamptz,"
            " ADD COLUMN promoted_at timestamptz"
        )
        conn.execute(
            "CREATE INDEX CONCURRENTLY outbox_due_idx ON outbox (id)"
            " WHERE sent_at IS NULL AND dead_lettered_at IS NULL"
            " AND (available_at IS NULL OR promoted_at IS NOT NULL)"
        )
        conn.execute("UPDATE pg_index SET indisvalid = false"  # a build that failed
                     " WHERE indexrelid = 'outbox_due_idx'::regclass")  # fmt: skip
    with pytest.raises(MigrationError, match="outbox_due_idx"):
        migrate(CommonSettings(database_url=db_at_0007))
    with psycopg.connect(db_at_0007, autocommit=True) as conn:
        conn.execute("DROP INDEX outbox_due_idx")
        conn.execute(
            "CREATE INDEX CONCURRENTLY outbox_due_idx ON outbox (id)"
            " WHERE sent_at IS NULL AND dead_lettered_at IS NULL"
            " AND (available_at IS NULL OR promoted_at IS NOT NULL)"
        )
    applied = migrate(CommonSettings(database_url=db_at_0007)).applied  # 0008 went in before
    # 0009 now, 0010 waiting for the rollout (the later ones go in beside it).
    assert [name[:4] for name in applied if name[:4] <= "0010"] == ["0009"]
    assert "outbox_scheduled_key_idx" in outbox_indexes(db_at_0007)


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
        conn.execute(QUERIES.force_custom_plans)
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at) VALUES"
            " ('t', 'k', 'x', now() - interval '30 seconds'),"
            " ('t', 'k', 'y', now() + interval '1 hour')"
        )
        shards = lag.measure_shards(conn, 2, 100)
    assert sum(s.unsent for s in shards) == 1
    assert 30 <= max(s.oldest_unsent_age_seconds for s in shards) < 60
