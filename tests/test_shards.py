"""Shards, the database half: each shard's fetch reads its own rows
through its own index, every key lives in one shard, and the lease group lets only one
shard count drain at a time, fencing the old count when it changes."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY, generate_latest
from psycopg import IsolationLevel
from psycopg.rows import dict_row

from relay.admin.schema_options import create_shard_indexes, shard_index_names
from relay.daemon.configs import lag_config
from relay.drain.batch import BatchLimits
from relay.lease.protocol import Acquired, LostRace, OtherShardCount, Shard
from relay.observe import lag
from relay.observe.metrics import Health
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import connection, db, fetch
from relay.store import lease as protocol
from relay.store.port import Fetched
from relay.store.postgres import drain_session_setup
from tests.conftest import SettingsFactory, relay_command, relay_env, start_relay
from tests.harness.kafka import TansuBroker, consume
from tests.support import (
    assert_per_key_order,
    dedup_by_message_id,
    insert_rows,
    keyed_rows,
    plan_nodes,
    scalar,
    wait_until,
)

Conn = psycopg.Connection[dict[str, Any]]
SHARDS = 4
LIMITS = BatchLimits(rows=500, bytes=8 << 20, per_key=500)


def rr_conn(dsn: str) -> Conn:
    conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row)
    conn.isolation_level = IsolationLevel.REPEATABLE_READ
    return conn


def fetch_shard(dsn: str, shard: int, limits: BatchLimits = LIMITS) -> Fetched:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        return fetch.fetch_batch(conn, limits, "{}", shards=SHARDS, shard=shard)


def test_each_shard_fetches_only_its_rows_and_every_key_lives_in_one(database: str) -> None:
    create_shard_indexes(CommonSettings(database_url=database), SHARDS)
    insert_rows(database, "t", keyed_rows(keys=40, per_key=5))
    insert_rows(database, "t", [(None, b"no key") for _ in range(40)])
    owner: dict[int, int] = {}
    for shard in range(SHARDS):
        for message in fetch_shard(database, shard).messages:
            assert message.id not in owner, (
                f"row {message.id} in shards {owner[message.id]}, {shard}"
            )
            owner[message.id] = shard
    assert len(owner) == 240, "every unsent row is in exactly one shard"
    keys = {
        row[0]: {
            owner[row[1]]
            for row in psycopg.connect(database).execute(
                "SELECT key, id FROM outbox WHERE key = %s", (row[0],)
            )
        }
        for row in psycopg.connect(database).execute(
            "SELECT DISTINCT key FROM outbox WHERE key IS NOT NULL"
        )
    }
    assert all(len(shards) == 1 for shards in keys.values()), "a key split across shards"
    spread = Counter(owner.values())
    assert len(spread) == SHARDS and min(spread.values()) >= 20, f"uneven: {spread}"


def test_a_shard_fetch_reads_its_own_index_not_the_others_rows(database: str) -> None:
    """The EXPLAIN guard: with 4 shards and a backlog of 40,000 rows, a fetch of 100 rows
    of shard 0 walks outbox_shards_4_idx in id order and stops at 100: its cost does
    not grow with the backlog, nor with the other shards' rows."""
    create_shard_indexes(CommonSettings(database_url=database), SHARDS)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 't', 'k' || (g % 400), 'x' FROM generate_series(1, 40000) AS g"
        )
        conn.execute("ANALYZE outbox")
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        scans = explain_fetch_head(conn, limit=100, shards=SHARDS)
    unsent, _ = shard_index_names(SHARDS)
    assert (unsent, 100) in scans, scans


def test_a_big_shard_batch_still_walks_the_index_in_id_order(database: str) -> None:
    """A batch that is a sizeable part of its shard's backlog (500 of ~20,000): the
    shard index leads with the hash, uncorrelated with the table, so the planner would
    rather bitmap-scan every unsent row of the shard and sort them (found by the
    benchmark: PostgreSQL's CPU per message doubled). The drain session must walk the
    index in id order and stop at the batch."""
    shards = 2
    create_shard_indexes(CommonSettings(database_url=database), shards)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 't', 'k' || (g % 200), repeat('x', 200)::bytea"
            " FROM generate_series(1, 40000) AS g"
        )
        conn.execute("VACUUM ANALYZE outbox")
        drain_session_setup(conn)
        scans = explain_fetch_head(conn, limit=500, shards=shards)
    assert not any("Bitmap" in name for name, _ in scans), scans
    assert (shard_index_names(shards)[0], 500) in scans, scans


def explain_fetch_head(
    conn: psycopg.Connection[Any], *, limit: int, shards: int
) -> list[tuple[str, int]]:
    """Shard 0's fetch_head, run under EXPLAIN ANALYZE: each scan and the rows it read."""
    params: dict[str, Any] = {
        "limit": limit,
        "max_bytes": 1 << 30,
        "message_max": 1 << 30,
        "after": None,
        "in_flight": "{}",
        "in_flight_ranges": "{}",
        "held": [],
        "shards": shards,
        "shard": 0,
    }
    row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + QUERIES.fetch_head, params).fetchone()
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return index_scans(plan[0]["Plan"])


def index_scans(node: dict[str, Any]) -> list[tuple[str, int]]:
    found = []
    if "Scan" in node["Node Type"]:
        found.append((node.get("Index Name", node["Node Type"]), node["Actual Rows"]))
    for child in node.get("Plans", []):
        found += index_scans(child)
    return found


def test_lag_per_shard_reads_each_shard_index_and_adds_up_to_the_total(database: str) -> None:
    """Each shard's backlog and oldest age, through its own index (no sequential scan of
    the outbox), agree with a plain count; the parts add up to the unsharded total."""
    create_shard_indexes(CommonSettings(database_url=database), SHARDS)
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, created_at)"
            " SELECT 't', 'k' || (g % 97), 'x', now() - make_interval(secs => 10000 - g)"
            " FROM generate_series(1, 20000) AS g"
        )
        conn.execute("DELETE FROM outbox WHERE id % 3 = 0")
        conn.execute("ANALYZE outbox")
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        with conn.transaction():  # planned as measure_shards plans it
            connection.apply_settings(conn, connection.ORDERED_WALKS, local=True)
            explain = conn.execute(
                "EXPLAIN (FORMAT JSON) " + QUERIES.lag_sample_shards,
                {"shards": SHARDS, "cap": 100, "age_window": 100},
            ).fetchone()
        parts = lag.measure_shards(conn, SHARDS, 1_000_000)
        capped = lag.measure_shards(conn, SHARDS, 100)
        expected = conn.execute(
            "SELECT outbox_shard(key, id, %(n)s) AS shard, count(*) AS unsent,"
            " extract(epoch FROM now() - min(created_at))::float8 AS oldest"
            " FROM outbox GROUP BY 1 ORDER BY 1",
            {"n": SHARDS},
        ).fetchall()
        total = lag.measure(conn, 1_000_000)
    assert explain is not None
    plan = json.dumps(explain["QUERY PLAN"])
    # outbox_paused_topics holds a row per topic an operator paused.
    scans = {
        (n["Node Type"], n.get("Relation Name"))
        for n in plan_nodes(explain["QUERY PLAN"][0]["Plan"])
    }
    assert {s for s in scans if s[0] == "Seq Scan"} <= {("Seq Scan", "outbox_paused_topics")}, plan
    assert shard_index_names(SHARDS)[0] in plan, plan
    assert [p.shard for p in parts] == list(range(SHARDS))
    assert [p.unsent for p in parts] == [int(e["unsent"]) for e in expected]
    for part, row in zip(parts, expected, strict=True):
        assert abs(part.oldest_unsent_age_seconds - row["oldest"]) < 5, (part, row)
    assert sum(p.unsent for p in parts) == total.unsent
    assert max(p.oldest_unsent_age_seconds for p in parts) == pytest.approx(
        total.oldest_unsent_age_seconds, abs=5
    )
    # The cap is shared among the shards: a sample reads what an unsharded one would.
    assert all(p.unsent == p.count_cap == 25 for p in capped), capped


def test_the_lag_sampler_exports_each_shard_beside_the_total(
    make_settings: SettingsFactory, database: str
) -> None:
    create_shard_indexes(CommonSettings(database_url=database), SHARDS)
    insert_rows(database, "t", keyed_rows(keys=20, per_key=3))
    settings = make_settings(shards=SHARDS)
    sampler = lag.LagSampler(
        lag_config(settings), lambda purpose: db.connect(settings, purpose=purpose), Health()
    )
    try:
        assert sampler.sample_once() is not None
        text = generate_latest(REGISTRY).decode()
    finally:
        sampler.stop()
        lag.SHARD_LAG.set("", [])
    per_shard = {
        line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("relay_outbox_shard_unsent_rows{")
    }
    assert set(per_shard) == {f'lease="default",shard="{n}"' for n in range(SHARDS)}, text
    assert sum(per_shard.values()) == 60
    assert "relay_outbox_unsent_rows 60.0" in text
    assert 'relay_outbox_shard_oldest_unsent_age_seconds{lease="default",shard="0"}' in text


def test_a_paused_topic_is_no_shard_lag_as_it_is_no_lag(database: str) -> None:
    """A shard's oldest age leaves a paused topic's rows out, as the outbox's does, so a
    dashboard of shards shows no lag growing for a pause."""
    create_shard_indexes(CommonSettings(database_url=database), SHARDS)
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, created_at)"
            " SELECT 'held', 'k' || g, 'x', now() - interval '1 hour'"
            " FROM generate_series(1, 200) AS g"
        )
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, created_at)"
            " SELECT 'flowing', 'k' || g, 'x', now() - interval '10 seconds'"
            " FROM generate_series(1, 200) AS g"
        )
        connection.keep_settings(conn, connection.CUSTOM_PLANS)
        before = lag.measure_shards(conn, SHARDS, 1_000_000)
        conn.execute("SELECT outbox_pause('held', 'ana', NULL, 'cli')")
        after = lag.measure_shards(conn, SHARDS, 1_000_000)
        total = lag.measure(conn, 1_000_000)
    assert all(p.oldest_unsent_age_seconds > 3000 for p in before), before
    assert all(5 < p.oldest_unsent_age_seconds < 600 for p in after), after
    assert max(p.oldest_unsent_age_seconds for p in after) == pytest.approx(
        total.oldest_unsent_age_seconds, abs=5
    )
    assert sum(p.unsent for p in after) == 400  # paused rows are still unsent


def test_without_shards_no_shard_lag_series_exist(make_settings: SettingsFactory) -> None:
    settings = make_settings()
    sampler = lag.LagSampler(
        lag_config(settings), lambda purpose: db.connect(settings, purpose=purpose), Health()
    )
    try:
        assert sampler.sample_once() is not None
        text = generate_latest(REGISTRY).decode()
    finally:
        sampler.stop()
    assert "relay_outbox_shard_" not in text


def test_status_shows_each_shard_with_its_holder_and_backlog(
    relay_dsn: str, database: str, kafka: TansuBroker
) -> None:
    create_shard_indexes(CommonSettings(database_url=database), SHARDS)
    with rr_conn(relay_dsn) as conn:
        for n in range(SHARDS):
            shard = Shard("default", n, SHARDS)
            protocol.ensure_row(conn, shard.name, shard)
        first = Shard("default", 1, SHARDS)
        assert isinstance(protocol.try_acquire(conn, first.name, "r9", 30, first), Acquired)
    insert_rows(database, "t", keyed_rows(keys=30, per_key=2))
    env = relay_env(relay_dsn, kafka.bootstrap_servers)
    done = subprocess.run(
        relay_command("status", "--json"), env=env, capture_output=True, timeout=60, check=True
    )
    status = json.loads(done.stdout)
    shards = status["outbox"]["shards"]
    assert [s["shard"] for s in shards] == list(range(SHARDS))
    assert {s["lease_group"] for s in shards} == {"default"}
    assert sum(s["unsent"] for s in shards) == status["outbox"]["unsent"] == 60
    held = [lease for lease in status["leases"] if lease["live"]]
    assert [(lease["shard"], lease["holder"]) for lease in held] == [(1, "r9")]
    table = subprocess.run(
        relay_command("status"), env=env, capture_output=True, timeout=60, check=True
    ).stdout.decode()
    assert "UNSENT" in table and "OLDEST UNSENT" in table, table
    line = next(row for row in table.splitlines() if row.startswith("default") and "r9" in row)
    assert line.split()[1] == f"1/{SHARDS}", line


def test_shard_indexes_are_built_once_and_rebuilt_if_invalid(database: str) -> None:
    settings = CommonSettings(database_url=database)
    assert create_shard_indexes(settings, SHARDS) == list(shard_index_names(SHARDS))
    assert create_shard_indexes(settings, SHARDS) == []
    unsent, _ = shard_index_names(SHARDS)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass", (unsent,)
        )
    assert create_shard_indexes(settings, SHARDS) == [unsent]
    assert scalar(
        database, "SELECT indisvalid FROM pg_index WHERE indexrelid = %s::regclass", (unsent,)
    )


def test_a_new_shard_count_waits_for_the_old_and_then_fences_it(relay_dsn: str) -> None:
    one = Shard("orders")
    two = [Shard("orders", n, 2) for n in range(2)]
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        protocol.ensure_row(a, one.name, one)
        for shard in two:
            protocol.ensure_row(b, shard.name, shard)
        old = protocol.try_acquire(a, one.name, "old", 60.0, one)
        assert isinstance(old, Acquired)
        # A replica of the new count waits while the old count's lease is live...
        waiting = protocol.try_acquire(b, two[0].name, "new", 60.0, two[0])
        assert isinstance(waiting, OtherShardCount) and waiting.lease == "orders"
        # ... takes over once it ends (here: released) ...
        assert protocol.release(a, old.token)
        taken = [protocol.try_acquire(b, s.name, "new", 60.0, s) for s in two]
        assert all(isinstance(t, Acquired) for t in taken), taken
        # ... and the old count is fenced: its holder can neither renew nor come back
        # while the new count holds its leases.
        assert not protocol.renew(a, old.token, 60.0)
        again = protocol.try_acquire(a, one.name, "old", 60.0, one)
        assert isinstance(again, OtherShardCount)
    assert scalar(relay_dsn, "SELECT shards FROM lease_groups WHERE name = 'orders'") == 2


def test_an_expired_old_count_lease_is_fenced_by_the_switch(relay_dsn: str) -> None:
    """A holder of the old count, paused past its expiry, must not renew after the new
    count took over: nobody took ITS row, so only the switch's fence stops it."""
    one, new = Shard("paused"), Shard("paused", 1, 2)
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        protocol.ensure_row(a, one.name, one)
        protocol.ensure_row(b, new.name, new)
        old = protocol.try_acquire(a, one.name, "old", 0.2, one)
        assert isinstance(old, Acquired)
        a.execute("SELECT pg_sleep(0.3)")
        assert isinstance(protocol.try_acquire(b, new.name, "new", 60.0, new), Acquired)
        assert not protocol.renew(a, old.token, 60.0), "the old count's zombie renewed"


def test_two_shard_counts_racing_never_both_acquire(relay_dsn: str) -> None:
    """Write skew: each transaction alone sees no live lease of the other count. The
    group row both must update makes the later one lose (40001), never both win."""
    one, two = Shard("skew"), Shard("skew", 0, 2)
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        protocol.ensure_row(a, one.name, one)
        protocol.ensure_row(b, two.name, two)
        for _ in range(10):
            barrier = threading.Barrier(2)
            results: list[object] = []
            threads = [
                threading.Thread(target=_race, args=(barrier, results, a, one, "a")),
                threading.Thread(target=_race, args=(barrier, results, b, two, "b")),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            winners = [r for r in results if isinstance(r, Acquired)]
            assert len(winners) <= 1, results
            assert all(isinstance(r, Acquired | LostRace | OtherShardCount) for r in results)
            for w in winners:
                assert isinstance(w, Acquired)
                protocol.release(a if w.token.holder == "a" else b, w.token)


def _race(
    barrier: threading.Barrier, results: list[object], conn: Conn, shard: Shard, holder: str
) -> None:
    barrier.wait()
    results.append(protocol.try_acquire(conn, shard.name, holder, 60.0, shard))


# --- several replicas draining at once ---------------------------------------------


def shard_leases(dsn: str) -> dict[int, str | None]:
    """shard -> live holder, for the 8-shard lease group `default`."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT shard, CASE WHEN expires_at > now() THEN holder END FROM leases"
            " WHERE lease_group = 'default' AND shards = %s",
            (EIGHT,),
        ).fetchall()
    return {int(r[0]): r[1] for r in rows}


def shares(dsn: str) -> Counter[str | None]:
    return Counter(shard_leases(dsn).values())


def balanced(dsn: str, replicas: set[str]) -> Counter[str | None] | None:
    """Every shard held, by exactly these replicas, each within its fair share."""
    held = shares(dsn)
    cap = -(-EIGHT // len(replicas))
    fair = (
        sum(held.values()) == EIGHT
        and set(held) == replicas
        and all(n <= cap for n in held.values())
    )
    return held if fair else None


EIGHT = 8


@pytest.fixture
def sharded(
    relay_dsn: str, database: str, kafka: TansuBroker, tmp_path: Path
) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    create_shard_indexes(CommonSettings(database_url=database), EIGHT)
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> subprocess.Popen[bytes]:
        env = relay_env(
            relay_dsn,
            kafka.bootstrap_servers,
            RELAY_SHARDS=str(EIGHT),
            RELAY_REPLICA_ID=name,
            RELAY_LEASE_TTL_SECONDS="3",
            RELAY_BATCH_SIZE="50",
        )
        proc = start_relay(env, tmp_path / f"relay-{name}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.slow
def test_replicas_share_the_shards_fairly_and_keep_per_key_order(
    sharded: Callable[[str], subprocess.Popen[bytes]], database: str, topic: str, kafka: TansuBroker
) -> None:
    """Two replicas split 8 shards 4 and 4 and both drain; a third joins and each ends
    with at most 3; one is SIGKILLed and its shards are taken by the other two; every
    row arrives, each key in order."""
    sharded("r0")
    sharded("r1")
    wait_until(lambda: balanced(database, {"r0", "r1"}), timeout=20, message="2 x 4 shards")
    insert_rows(database, topic, keyed_rows(keys=40, per_key=10))
    r2 = sharded("r2")
    held = wait_until(
        lambda: balanced(database, {"r0", "r1", "r2"}), timeout=30, message="3 replicas sharing"
    )
    assert held["r2"] >= 2, held
    print(f"shares with three: {dict(held)}")
    insert_rows(database, topic, keyed_rows(keys=40, per_key=10, start=10))
    r2.kill()
    killed = time.monotonic()
    wait_until(lambda: balanced(database, {"r0", "r1"}), timeout=15, message="r2's shards taken")
    print(f"r2 killed: shards taken in {time.monotonic() - killed:.2f}s")
    insert_rows(database, topic, keyed_rows(keys=40, per_key=10, start=20))
    wait_until(
        lambda: scalar(database, "SELECT count(*) FROM outbox") == 0,
        timeout=30,
        message="everything sent",
    )
    records = consume(kafka.bootstrap_servers, topic, min_count=1200, timeout=30)
    assert len(dedup_by_message_id(records)) == 1200
    assert_per_key_order(records)
    drained_by = scalar(
        database,
        "SELECT count(DISTINCT holder) FROM leases WHERE lease_group = 'default' AND epoch > 0",
    )
    assert drained_by >= 2


def test_a_replica_refuses_to_start_without_the_shard_indexes(
    relay_dsn: str, kafka: TansuBroker
) -> None:
    env = relay_env(relay_dsn, kafka.bootstrap_servers, RELAY_SHARDS="4")
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2, done
    err = done.stderr.decode()
    assert "RELAY_SHARDS" in err and "relay migrate --shards 4" in err, err
