"""RELAY_FAIRNESS=off and `relay migrate --without-key-index`: first in, first out, with
the primary key the only index a new row enters. On real PostgreSQL, and end to end over
Kafka: the migration's flags, the start-up checks, what the fetch reads and leaves, and
the console without the counts that index made cheap."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from relay.console import data
from relay.console.render import count
from relay.daemon.app import RelayApp
from relay.drain.batch import BatchLimits
from relay.message import OutboxMessage
from relay.settings import SettingsError
from relay.sql import QUERIES
from relay.store import fetch
from relay.store.postgres import drain_session_setup
from tests.conftest import (
    SettingsFactory,
    relay_command,
    relay_env,
    relay_migrate,
    relay_migrate_run,
)
from tests.harness.kafka import TansuBroker, consume
from tests.support import (
    assert_per_key_order,
    dedup_by_message_id,
    running_relay,
    scalar,
    wait_until,
)

IN_ORDER = BatchLimits(rows=100, bytes=8 << 20, per_key=20, fair=False)
KEY_INDEX_PRESENT = (
    "SELECT count(*) FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid"
    " WHERE c.relname = 'outbox_key_hash_idx' AND i.indisvalid"
)


def drop_key_index(database: str) -> None:
    relay_migrate(database, "--without-key-index")
    assert scalar(database, KEY_INDEX_PRESENT) == 0


def rows_of(database: str, key: str, count: int, payload_bytes: int = 0) -> list[int]:
    """`count` rows of `key`, payload `key:i` padded to `payload_bytes`; their ids."""
    with psycopg.connect(database, autocommit=True) as conn:
        return [
            int(r[0])
            for r in conn.execute(
                "INSERT INTO outbox (topic, key, payload)"
                " SELECT 't', %(key)s, convert_to(rpad(%(key)s || ':' || g,"
                "        greatest(%(pad)s, length(%(key)s || ':' || g)), ' '), 'UTF8')"
                " FROM generate_series(0, %(count)s - 1) AS g ORDER BY g RETURNING id",
                {"key": key, "count": count, "pad": payload_bytes},
            )
        ]


def back_off(database: str, key: str) -> None:
    """The key's first row failed and waits an hour: every later row of it waits too."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour',"
            " last_error = 'down' WHERE id = (SELECT min(id) FROM outbox WHERE key = %s)",
            (key,),
        )
        conn.execute("ANALYZE outbox")


def head_params(**overrides: Any) -> dict[str, Any]:
    """fetch_head's parameters for a batch of 100, nothing in flight."""
    return {
        "shards": 1,
        "shard": 0,
        "limit": 100,
        "in_flight": "{}",
        "in_flight_ranges": "{}",
        "held": [],
        "max_bytes": 8 << 20,
        "message_max": 1 << 20,
        "after": None,
        **overrides,
    }


def fetch_in_order(database: str, limits: BatchLimits = IN_ORDER) -> list[OutboxMessage]:
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        drain_session_setup(conn)  # as the drain's session plans
        return fetch.fetch_batch(conn, limits, "{}").messages


def test_migrate_drops_the_key_index_and_builds_it_again(database: str) -> None:
    dropped = relay_migrate_run(database, "--without-key-index")
    assert dropped.returncode == 0, dropped.stderr
    assert "key index: dropped outbox_key_hash_idx" in dropped.stdout
    assert scalar(database, KEY_INDEX_PRESENT) == 0
    again = relay_migrate_run(database, "--without-key-index")
    assert again.returncode == 0 and "key index: already gone" in again.stdout
    built = relay_migrate_run(database, "--with-key-index")
    assert built.returncode == 0 and "key index: built outbox_key_hash_idx" in built.stdout
    assert scalar(database, KEY_INDEX_PRESENT) == 1
    # The same index as 0100_schema.sql's: the fair fetch's plan tests read it by name.
    definition = scalar(database, "SELECT pg_get_indexdef('outbox_key_hash_idx'::regclass)")
    assert "outbox_key_hash(key), id" in definition and "promoted_at IS NOT NULL" in definition
    assert "already there" in relay_migrate_run(database, "--with-key-index").stdout


def test_migrate_refuses_to_drop_the_key_index_and_build_a_fairness_index(database: str) -> None:
    done = relay_migrate_run(database, "--without-key-index", "--fairness-group", "key-prefix::")
    assert done.returncode == 2
    assert "--without-key-index" in done.stderr
    assert scalar(database, KEY_INDEX_PRESENT) == 1


def outbox_indexes(database: str) -> set[str]:
    with psycopg.connect(database, autocommit=True) as conn:
        return {
            r[0]
            for r in conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'outbox'")
        }


def test_with_shards_the_drop_takes_every_counts_key_index_and_none_comes_back(
    database: str,
) -> None:
    relay_migrate(database, "--shards", "3")
    relay_migrate(database, "--shards", "5")
    done = relay_migrate_run(database, "--without-key-index")
    assert done.returncode == 0, done.stderr
    names = outbox_indexes(database)
    assert {"outbox_shards_3_due_idx", "outbox_shards_5_due_idx"} <= names
    assert not {n for n in names if "key_hash" in n}, names
    # A deploy's usual `relay migrate --shards N` builds no key index back ...
    relay_migrate(database, "--shards", "3")
    relay_migrate(database, "--shards", "4")
    names = outbox_indexes(database)
    assert "outbox_shards_4_due_idx" in names
    assert not {n for n in names if "key_hash" in n}, names
    # ... until the key index is asked for: then a count's comes with it.
    relay_migrate(database, "--with-key-index", "--shards", "3")
    names = outbox_indexes(database)
    assert {"outbox_key_hash_idx", "outbox_shards_3_due_key_hash_idx"} <= names


def test_fair_fetch_without_the_key_index_stops_start_up_naming_the_setting(
    make_settings: SettingsFactory, database: str
) -> None:
    drop_key_index(database)
    with pytest.raises(SettingsError) as caught:
        RelayApp(make_settings()).run()
    assert caught.value.name == "RELAY_FAIRNESS"
    assert "relay migrate --with-key-index" in str(caught.value)
    assert "RELAY_FAIRNESS=off" in str(caught.value)


def test_fairness_off_with_a_fairness_group_stops_start_up(database: str) -> None:
    env = relay_env(
        database, "127.0.0.1:1", RELAY_FAIRNESS="off", RELAY_FAIRNESS_GROUP="key-prefix::"
    )
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "RELAY_FAIRNESS_GROUP" in done.stderr.decode()


def test_a_bad_fairness_value_stops_start_up_naming_it(database: str) -> None:
    env = relay_env(database, "127.0.0.1:1", RELAY_FAIRNESS="tenants")
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "RELAY_FAIRNESS" in done.stderr.decode()


def test_in_order_a_hot_key_in_front_fills_the_batch_and_the_others_wait(database: str) -> None:
    """First in, first out: what fairness off gives up, shown."""
    drop_key_index(database)
    hot = rows_of(database, "H", 300)
    rows_of(database, "k", 5)
    assert [m.id for m in fetch_in_order(database)] == hot[:100]


def test_in_order_a_key_in_backoff_is_passed_for_up_to_sixteen_windows(database: str) -> None:
    drop_key_index(database)
    rows_of(database, "B", 250)  # windows of 100: 1 and 2 all B, 3 half B
    others = rows_of(database, "o", 10)
    back_off(database, "B")
    batch = fetch_in_order(database)
    assert [m.id for m in batch] == others
    # With windows of 16 rows the first 6 others sit in the sixteenth; of 15, past it:
    # then they wait for B. The bound, documented (RELAY_FAIRNESS).
    assert [m.id for m in fetch_in_order(database, dataclasses.replace(IN_ORDER, rows=16))] == (
        others[:6]
    )
    assert fetch_in_order(database, dataclasses.replace(IN_ORDER, rows=15)) == []


class _EndsTheBackoffAfterTheFirstWindow(psycopg.Cursor[Any]):
    """The drain session's cursor, but that a backoff runs out (committed on another
    connection) once the first window is read: between two windows of the walk."""

    database = ""
    windows = 0

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if query is QUERIES.fetch_head:
            type(self).windows += 1
            if type(self).windows == 2:
                with psycopg.connect(self.database, autocommit=True) as other:
                    other.execute(
                        "UPDATE outbox SET next_attempt_at = now() - interval '1 second'"
                        " WHERE next_attempt_at IS NOT NULL"
                    )
        return super().execute(query, params, **kwargs)


def test_in_order_a_walk_reads_every_window_in_one_snapshot(database: str) -> None:
    """A backoff that runs out between two windows must not let the key's later rows
    go while its first row is left behind in an earlier window."""
    drop_key_index(database)
    b = rows_of(database, "B", 15)  # window 1 (10 rows): all B, not ready
    o = rows_of(database, "o", 3)  # window 2: B's last 5, then o
    back_off(database, "B")
    _EndsTheBackoffAfterTheFirstWindow.database = database
    with psycopg.connect(
        database,
        autocommit=True,
        row_factory=dict_row,
        cursor_factory=_EndsTheBackoffAfterTheFirstWindow,
    ) as conn:
        drain_session_setup(conn)
        batch = fetch.fetch_batch(conn, dataclasses.replace(IN_ORDER, rows=10), "{}").messages
    ids = [m.id for m in batch]
    taken_b = [i for i in ids if i in b]
    assert taken_b == b[: len(taken_b)], f"B's rows {taken_b} without their first ones"
    # Read again in one snapshot after the backoff ran out: B from its first row.
    assert ids == b[:10]
    assert not set(o) & set(ids)


def test_in_order_the_walk_stops_at_a_key_cut_by_its_cap(database: str) -> None:
    """A sink that sends a key's rows one at a time takes `per_key` of a key: its later
    rows must go before any later row of that key, so no window past the cut is read."""
    drop_key_index(database)
    rows_of(database, "B", 100)
    c = rows_of(database, "C", 10)
    rows_of(database, "B", 100)
    d = rows_of(database, "D", 3)
    back_off(database, "B")
    limits = dataclasses.replace(IN_ORDER, per_key=4, fill=False)
    batch = fetch_in_order(database, limits)
    assert [m.id for m in batch] == c[:4]
    assert not set(d) & {m.id for m in batch}


def test_in_order_a_walk_keeps_to_the_byte_bound(database: str) -> None:
    drop_key_index(database)
    first = rows_of(database, "A", 30, payload_bytes=1000)  # 30 of window 1's 100
    rows_of(database, "B", 70)
    back_off(database, "B")
    second = rows_of(database, "C", 50, payload_bytes=1000)
    limits = dataclasses.replace(IN_ORDER, bytes=40_000)
    batch = fetch_in_order(database, limits)
    ids = [m.id for m in batch]
    assert ids == first + second[: len(ids) - len(first)]
    assert len(ids) > len(first), "the walk went on past window 1"
    assert sum(len(m.payload or b"") + len(m.key or "") + len(m.topic) for m in batch) <= 40_000


def test_in_order_the_fetch_walks_the_primary_key_from_where_it_is_told(database: str) -> None:
    drop_key_index(database)
    ids = rows_of(database, "A", 1000)
    params = head_params(after=ids[500])
    with psycopg.connect(database, autocommit=True) as conn:
        drain_session_setup(conn)
        row = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + QUERIES.fetch_head, params
        ).fetchone()
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    scans: list[tuple[str, str | None, int]] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "outbox" and node.get("Actual Loops", 0):
            read = float(node["Actual Rows"]) + float(node.get("Rows Removed by Filter", 0))
            scans.append((node["Node Type"], node.get("Index Name"), int(read)))
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    main = [s for s in scans if s[1] == "outbox_pkey"]
    assert main and main[0][0] == "Index Scan" and main[0][2] <= 100, scans
    assert not [s for s in scans if s[0] == "Seq Scan"], scans


def test_in_order_a_relay_drains_everything_in_order_per_key(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    drop_key_index(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %(topic)s, k, convert_to(k || ':' || g, 'UTF8')"
            " FROM generate_series(0, 99) AS g, unnest(ARRAY['H', 'a', 'b', 'c']) AS k"
            " ORDER BY g, k",
            {"topic": topic},
        )
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %(topic)s, 'H', convert_to('H:' || g, 'UTF8')"
            " FROM generate_series(100, 2599) AS g ORDER BY g",
            {"topic": topic},
        )
    with running_relay(make_settings(fairness="off")) as app:
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox") == 0, 60, message="drained"
        )
        assert not app.shutdown.requested
    records = consume(kafka.bootstrap_servers, topic, min_count=2_900, timeout=60)
    assert len(dedup_by_message_id(records)) == 2_900
    assert_per_key_order(records)


def test_the_console_shows_blocked_keys_without_counting_behind_them(database: str) -> None:
    rows_of(database, "B", 5)
    back_off(database, "B")
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        counted = data.blocked_keys(conn, 10, 100)
        assert [(r["key"], r["waiting_behind"]) for r in counted] == [("B", 4)]
        conn.execute("DROP INDEX outbox_key_hash_idx")
        uncounted = data.blocked_keys(conn, 10, 100)
        assert [(r["key"], r["waiting_behind"]) for r in uncounted] == [("B", None)]
    assert count(None, 100) == "-"
    assert count(100, 100) == "≥ 100"


def test_in_order_with_shards_each_fetches_its_rows_by_its_index_in_id_order(
    database: str,
) -> None:
    relay_migrate(database, "--shards", "3", "--without-key-index")
    ids = rows_of(database, "x", 1) + [i for k in range(30) for i in rows_of(database, f"k{k}", 3)]
    seen: list[int] = []
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        drain_session_setup(conn)
        for shard in range(3):
            batch = fetch.fetch_batch(conn, IN_ORDER, "{}", shards=3, shard=shard).messages
            assert [m.id for m in batch] == sorted(m.id for m in batch)
            seen += [m.id for m in batch]
        plan = conn.execute(
            "EXPLAIN " + QUERIES.fetch_head,
            head_params(shards=3, shard=1),
        ).fetchall()
    assert sorted(seen) == sorted(ids)
    text = "\n".join(r["QUERY PLAN"] for r in plan)
    # The head's walk (the per-row probes below it run only if a gate finds a row).
    assert "Index Scan using outbox_shards_3_due_idx on outbox o_1" in text, text
