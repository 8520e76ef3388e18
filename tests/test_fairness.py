"""Fairness per tenant (RELAY_FAIRNESS_GROUP) on real PostgreSQL: a small tenant behind
a big one's backlog gets its share of the next batch, whatever the big one's rows or
keys; per-key order holds; the fetch's cost stays flat in any group's backlog; and end
to end over HTTP (20 ms a request) and Kafka, the small tenant's rows arrive while most
of the big one's still wait. Without the setting, each of these tests fails: the small
tenant waits behind every row of the big one."""

from __future__ import annotations

import dataclasses
import subprocess
import time

import psycopg
import pytest
from psycopg.rows import dict_row

from relay.admin.schema_options import create_fairness_index
from relay.daemon.app import RelayApp
from relay.drain import fairness
from relay.drain.batch import BatchLimits
from relay.errors import SettingsError
from relay.message import OutboxMessage
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import connection, fetch
from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness.kafka import TansuBroker, consume
from tests.harness.webhook import Reply, WebhookServer
from tests.support import (
    dedup_by_message_id,
    insert_rows,
    running_relay,
    unsent_count,
    wait_until,
)
from tests.test_fetch import _fetch_cost, fetch_from
from tests.test_settings import URL

BY_PREFIX = fairness.parse("key-prefix::")
BY_HEADER = fairness.parse("header:tenant")
LIMITS = BatchLimits(rows=100, bytes=8 << 20, per_key=4, fill=False)


def tenant_rows(tenant: str, keys: int, per_key: int) -> list[tuple[str, bytes]]:
    """Interleaved keys `tenant:kN`, so any 100 of them hold at most one row per key: a
    head that looks fair across keys. The payload says key and step."""
    return [
        (f"{tenant}:k{k}", f"{tenant}:k{k}:{i}".encode())
        for i in range(per_key)
        for k in range(keys)
    ]


def build_index(database: str, group: fairness.FairnessGroup, shards: int = 1) -> None:
    assert create_fairness_index(CommonSettings(database_url=database), group, shards)


def grouped(group: fairness.FairnessGroup | None) -> BatchLimits:
    return dataclasses.replace(LIMITS, group=group)


def in_key_order(rows: list[OutboxMessage]) -> None:
    """Each key's rows in the batch are its first ones, in order (`tenant:kN:i`, from 0)."""
    steps: dict[str | None, list[int]] = {}
    for row in rows:
        assert row.payload is not None
        steps.setdefault(row.key, []).append(int(row.payload.decode().rsplit(":", 1)[1]))
    for key, seen in steps.items():
        assert seen == list(range(len(seen))), (key, seen)


def tenants(rows: list[OutboxMessage]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        name = (row.key or "").split(":", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_a_small_tenant_gets_its_share_of_the_next_batch(database: str) -> None:
    """Tenant A's 2,400 rows on 300 keys, then B's 12 rows on 3 keys: the next batch
    holds all of B's (an equal share is 50 rows each), the rest is A's, each key a
    prefix of its rows. Without grouping, the batch is A's 100 oldest rows."""
    insert_rows(database, "t", tenant_rows("A", keys=300, per_key=8))
    insert_rows(database, "t", tenant_rows("B", keys=3, per_key=4))
    build_index(database, BY_PREFIX)
    plain = fetch_from(database, grouped(None)).messages
    assert tenants(plain) == {"A": 100}
    fair = fetch_from(database, grouped(BY_PREFIX)).messages
    assert tenants(fair) == {"A": 88, "B": 12}
    assert len(fair) == LIMITS.rows
    in_key_order(fair)


def test_groups_by_a_header_and_rows_without_it_are_a_group_of_their_own(
    database: str,
) -> None:
    insert_rows(database, "t", tenant_rows("A", keys=300, per_key=4), headers={"tenant": "a"})
    insert_rows(database, "t", tenant_rows("B", keys=2, per_key=3), headers={"tenant": "b"})
    insert_rows(database, "t", tenant_rows("C", keys=2, per_key=2))  # no tenant header
    build_index(database, BY_HEADER)
    fair = fetch_from(database, grouped(BY_HEADER)).messages
    assert tenants(fair) == {"A": 90, "B": 6, "C": 4}
    in_key_order(fair)


def test_the_round_goes_over_more_groups_than_a_batch_holds(database: str) -> None:
    """250 groups of one row each behind a full head of A: a batch of 100 cannot give
    each its share, so the round over groups goes on where it stopped, and every group
    is served within a few fetches."""
    insert_rows(database, "t", tenant_rows("A", keys=300, per_key=2))
    insert_rows(database, "t", [(f"g{n:03}:k", b"g:k:0") for n in range(250)])
    build_index(database, BY_PREFIX)
    served: set[str] = set()
    after: str | None = None
    limits = grouped(BY_PREFIX)
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        for _ in range(6):
            connection.keep_settings(conn, connection.CUSTOM_PLANS)
            fetched = fetch.fetch_batch(conn, limits, "{}", None, after_group=after)
            served |= {name for name in tenants(fetched.messages) if name.startswith("g")}
            ids = [m.id for m in fetched.messages]
            conn.execute("DELETE FROM outbox WHERE id = ANY(%s)", (ids,))
            after = fetched.walked_group
    assert len(served) == 250


def test_the_grouped_fetch_costs_the_same_at_any_backlog_of_one_group(database: str) -> None:
    """The rows the grouped fetch touches (every scan node's rows x loops) with 1 and
    with 60,000 of A's rows waiting: bounded by the batch, not A's backlog; and the
    round over groups reads the grouping's index."""
    insert_rows(database, "t", tenant_rows("A", keys=100, per_key=2))
    insert_rows(database, "t", tenant_rows("B", keys=3, per_key=2))
    build_index(database, BY_PREFIX)
    limits = grouped(BY_PREFIX)
    small = _fetch_cost(database, limits)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 't', 'A:k' || (g % 3000), 'x' FROM generate_series(1, 60000) AS g"
        )
        conn.execute("ANALYZE outbox")
    large = _fetch_cost(database, limits)
    assert large < 3 * small + 500, (small, large)
    with psycopg.connect(database, autocommit=True) as conn:
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        plan = "\n".join(
            str(r[0])
            for r in conn.execute(
                "EXPLAIN " + QUERIES.fetch_batch,
                {
                    "limit": 100,
                    "max_bytes": 1 << 20,
                    "message_max": 1 << 20,
                    "after": None,
                    "key_cap": 4,
                    "fill": False,
                    "in_flight": "{}",
                    "in_flight_ranges": "{}",
                    "held": [],
                    "shards": 1,
                    "shard": 0,
                    "after_key": None,
                    "grouped": True,
                    "group_kind": BY_PREFIX.kind,
                    "group_arg": BY_PREFIX.arg,
                    "after_group": None,
                },
            )
        )
    assert BY_PREFIX.index_name() in plan, plan


def test_with_header_grouping_a_key_alternating_groups_costs_no_more_at_any_backlog(
    database: str,
) -> None:
    """Header grouping, key Z's rows alternating between tenants a and b behind a full
    head: each group's share stops at an earlier row of Z in the other group (per-key
    order), but the walk for that share is bounded by the share, not by Z's backlog.
    Before, the walk went on past every such row to fill the share: all of Z's rows,
    each with a probe, on every fetch (405,000 buffers at 200,000 rows)."""
    insert_rows(database, "t", tenant_rows("N", keys=150, per_key=1), headers={"tenant": "n"})
    build_index(database, BY_HEADER)

    def alternating(first: int, last: int) -> None:
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox (topic, key, payload, headers)"
                " SELECT 't', 'Z', convert_to('Z:' || g, 'UTF8'),"
                "        jsonb_build_object('tenant', CASE WHEN g %% 2 = 0 THEN 'a' ELSE 'b' END)"
                " FROM generate_series(%s::integer, %s::integer) AS g",
                (first, last),
            )
            conn.execute("ANALYZE outbox")

    alternating(1, 20)
    small = _fetch_cost(database, grouped(BY_HEADER))
    alternating(21, 20_000)
    large = _fetch_cost(database, grouped(BY_HEADER))
    assert large < 3 * small + 500, (small, large)
    fair = fetch_from(database, grouped(BY_HEADER)).messages
    z = [m.payload for m in fair if m.key == "Z"]
    assert z == [b"Z:1"], z  # Z's first row past the head only: its second is b's


def test_a_bad_fairness_group_stops_start_up_naming_it() -> None:
    env = relay_env(URL, "127.0.0.1:1", RELAY_FAIRNESS_GROUP="tenant")
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "RELAY_FAIRNESS_GROUP" in done.stderr.decode()
    assert "key-prefix:<delimiter>" in done.stderr.decode()


def test_a_fairness_group_without_its_index_stops_start_up(
    make_settings: SettingsFactory, database: str
) -> None:
    app = RelayApp(make_settings(fairness_group="key-prefix::"))
    with pytest.raises(SettingsError) as caught:
        app.run()
    assert caught.value.name == "RELAY_FAIRNESS_GROUP"
    assert "relay migrate --fairness-group key-prefix::" in str(caught.value)


@pytest.mark.parametrize("group", ["key-prefix::", None])
def test_over_http_a_small_tenant_arrives_while_the_big_one_waits(
    make_settings: SettingsFactory, database: str, group: str | None
) -> None:
    """A receiver taking 20 ms a request, 8 in flight (about 400 rows a second); tenant
    A's 1,200 rows on 150 keys in front, B's 20 rows on 5 keys committed after them.
    Grouped: B's rows are all delivered while most of A's still wait. Not grouped
    (the second case, which shows what the test measures): B's come last."""
    with WebhookServer(lambda d: Reply(200, delay=0.02)) as receiver:
        insert_rows(database, "t", tenant_rows("A", keys=150, per_key=8))
        insert_rows(database, "t", tenant_rows("B", keys=5, per_key=4))
        if group is not None:
            build_index(database, fairness.parse(group))
        settings = make_settings(
            sink="http",
            http_url=receiver.url + "/hooks/{topic}",
            sink_max_in_flight=8,
            fairness_group=group,
        )
        with running_relay(settings):
            wait_until(
                lambda: sum(1 for d in receiver.acked() if d.body.startswith(b"B:")) == 20,
                60,
                message="tenant B delivered",
            )
            a_before_b = sum(1 for d in receiver.acked() if d.body.startswith(b"A:"))
            wait_until(lambda: unsent_count(database) == 0, 60, message="outbox drained")
        history = receiver.history()
    if group is None:
        assert a_before_b > 1000, a_before_b
        return
    assert a_before_b < 400, f"{a_before_b} of A's 1,200 rows went before B's 20"
    by_key: dict[str, list[int]] = {}
    for d in history:
        key, step = d.body.decode().rsplit(":", 1)
        by_key.setdefault(key, []).append(int(step))
    assert all(steps == sorted(steps) for steps in by_key.values())


def test_over_http_a_small_tenant_committed_mid_drain_waits_for_few_of_the_big_ones_rows(
    make_settings: SettingsFactory, database: str
) -> None:
    """At the defaults (RELAY_BATCH_SIZE=1000, 16 requests in flight), a receiver taking
    20 ms a request: tenant B commits 20 rows on 5 keys while A's 4,000 rows on 500 keys
    are being sent. A row committed mid-drain waits for the batch being published, the one
    read ahead and its own (where B's rows come after A's, in id order). Batches sized by
    time (relay/drain/sizing.py) are 0.4 s of the receiver's rate each, so fewer than
    800 of A's rows (about 320) arrive between B's commit and B's last row, whatever the
    machine's speed; with fixed batches of 1,000 it was about 2,460, and B's own batch
    alone puts about 980 of A's before it."""
    with WebhookServer(lambda d: Reply(200, delay=0.02)) as receiver:
        insert_rows(database, "t", tenant_rows("A", keys=500, per_key=8))
        build_index(database, BY_PREFIX)
        settings = make_settings(
            sink="http",
            http_url=receiver.url + "/hooks/{topic}",
            batch_size=1000,
            fairness_group=BY_PREFIX.spec,
        )
        assert settings.sink_max_in_flight is None  # the default: 16
        with running_relay(settings):
            wait_until(lambda: len(receiver.acked()) >= 500, 60, message="A being sent")
            insert_rows(database, "t", tenant_rows("B", keys=5, per_key=4))
            committed = time.monotonic()
            wait_until(
                lambda: sum(1 for d in receiver.acked() if d.body.startswith(b"B:")) == 20,
                60,
                message="tenant B delivered",
            )
        history = receiver.history()
    b_last = max(d.started for d in history if d.body.startswith(b"B:"))
    a_between = [d for d in history if d.body.startswith(b"A:") and committed < d.started < b_last]
    assert len(a_between) < 800, (
        f"{len(a_between)} of A's rows arrived between B's commit and B's last"
    )
    assert sum(1 for d in history if d.body.startswith(b"A:")) < 4000  # A was still waiting
    by_key: dict[str, list[int]] = {}
    for d in sorted(history, key=lambda d: d.started):
        key, step = d.body.decode().rsplit(":", 1)
        by_key.setdefault(key, []).append(int(step))
    assert all(steps == sorted(steps) for steps in by_key.values())


def test_over_kafka_a_small_tenant_arrives_while_the_big_one_waits(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """At 2,000 messages a second (RELAY_MAX_MESSAGES_PER_SECOND, so the scene lasts),
    A's 6,000 rows on 1,500 keys, then B's 20 rows on 5 keys: B's last record is among
    the first 1,000 sent (about half a second), where without grouping it is last."""
    insert_rows(database, topic, tenant_rows("A", keys=1500, per_key=4))
    insert_rows(database, topic, tenant_rows("B", keys=5, per_key=4))
    build_index(database, BY_PREFIX)
    started = time.monotonic()
    with running_relay(
        make_settings(batch_size=1000, max_messages_per_second=2000, fairness_group=BY_PREFIX.spec)
    ):
        wait_until(lambda: unsent_count(database) == 0, 60, message="outbox drained")
    assert time.monotonic() - started > 2.0  # the cap held the scene open
    records = dedup_by_message_id(consume(kafka.bootstrap_servers, topic, min_count=6020))
    assert len(records) == 6020
    steps: dict[str | None, list[int]] = {}
    for record in records:
        assert record.value is not None
        steps.setdefault(record.key, []).append(int(record.value.decode().rsplit(":", 1)[1]))
    assert all(seen == sorted(seen) for seen in steps.values())
    records.sort(key=lambda r: (r.timestamp_ms, r.partition, r.offset))
    last_b = max(n for n, r in enumerate(records) if (r.key or "").startswith("B:"))
    assert last_b < 1000, f"B's last record was number {last_b} of 6,020"


def test_with_shards_each_shard_shares_its_own_rows_out_by_group(database: str) -> None:
    """RELAY_SHARDS=2: `relay migrate --fairness-group ... --shards 2` builds the index
    with the shard first; each shard's grouped fetch finds its own rows of B behind A's
    and reads that index."""
    insert_rows(database, "t", tenant_rows("A", keys=600, per_key=4))
    insert_rows(database, "t", tenant_rows("B", keys=6, per_key=2))
    build_index(database, BY_PREFIX, shards=2)
    found = 0
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        connection.keep_settings(conn, connection.ORDERED_WALKS)
        for shard in (0, 1):
            rows = fetch.fetch_batch(
                conn, grouped(BY_PREFIX), "{}", None, shards=2, shard=shard
            ).messages
            assert len(rows) == LIMITS.rows
            found += tenants(rows).get("B", 0)
            in_key_order(rows)
    assert found == 12


# --- review: header grouping and per-key order ------------------------------------


def test_with_header_grouping_a_key_whose_later_rows_carry_the_header_keeps_its_order(
    database: str,
) -> None:
    """Header grouping: the group is a row's, not a key's. Key X's first row has no tenant
    header (group ''), its second has tenant b: an app that starts tagging its rows, or
    a key whose rows change tenant. Behind a full head of A's (with a deep backlog of A
    and of '' too), b's share of the round holds X's second row while '''s share stops
    before X's first: the batch must not hold X's second row without its first."""
    insert_rows(database, "t", tenant_rows("A", keys=300, per_key=2), headers={"tenant": "a"})
    insert_rows(database, "t", tenant_rows("N", keys=300, per_key=1))  # no header: group ''
    insert_rows(database, "t", [("X", b"X:0")])  # no header: group ''
    insert_rows(database, "t", [("X", b"X:1")], headers={"tenant": "b"})
    build_index(database, BY_HEADER)
    fair = fetch_from(database, grouped(BY_HEADER)).messages
    assert len(fair) == LIMITS.rows
    in_key_order(fair)


def test_with_header_grouping_a_key_in_two_groups_is_chosen_as_a_prefix(database: str) -> None:
    """Both of key X's rows are in the pool (X:0 first after the head, in a's share; X:1,
    tenant b, b's first): chosen goes round the groups by each row's own group, so X:1
    (b's first) comes before X:0 (a's 101st) and the batch, cut at 100, holds X:1 alone."""
    insert_rows(database, "t", tenant_rows("A", keys=100, per_key=1), headers={"tenant": "a"})
    insert_rows(database, "t", [("X", b"X:0")], headers={"tenant": "a"})
    insert_rows(database, "t", tenant_rows("A", keys=200, per_key=1), headers={"tenant": "a"})
    insert_rows(database, "t", [("X", b"X:1")], headers={"tenant": "b"})
    build_index(database, BY_HEADER)
    fair = fetch_from(database, grouped(BY_HEADER)).messages
    assert len(fair) == LIMITS.rows
    in_key_order(fair)
