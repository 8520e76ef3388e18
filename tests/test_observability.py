"""Metrics as an operator reads them: two `relay run` replicas scraped over HTTP, and a real
Prometheus evaluating the expressions alerts are written with; /metrics kept bounded
whatever the app's topics, and the server answering through a flood of clients."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql

from relay.observe.lag import LagSample, measure, publish
from relay.observe.metrics import (
    OTHER_TOPIC,
    TOPIC_LABEL_MAX_CHARS,
    TOPIC_PAUSED,
    Health,
    TopicLabels,
)
from relay.observe.server import (
    CONNECTION_TIMEOUT_SECONDS,
    HANDLER_THREADS,
    MAX_CONNECTIONS,
    MetricsServer,
)
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import db
from relay.store.connection import ORDERED_WALKS, apply_settings
from tests.conftest import SettingsFactory, relay_env, start_relay
from tests.harness import free_port
from tests.harness.kafka import TansuBroker
from tests.harness.postgres import PostgresServer
from tests.harness.prometheus import PrometheusServer
from tests.support import (
    http_get,
    insert_rows,
    keyed_rows,
    metric,
    plan_nodes,
    running_relay,
    scalar,
    scrape,
    unsent_count,
    wait_until,
)

pytestmark = pytest.mark.slow

LEASE = {"lease": "default"}


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    port: int

    def value(self, name: str, **labels: str) -> float | None:
        return metric(self.port, name, **labels)

    def held(self) -> float | None:
        return self.value("relay_lease_held", **LEASE)

    def age(self) -> float:
        return self.value("relay_outbox_oldest_unsent_age_seconds") or 0.0


@pytest.fixture
def replicas(relay_dsn: str, kafka: TansuBroker, tmp_path: Path) -> Iterator[list[Replica]]:
    started = []
    for n in range(2):
        port = free_port()
        env = relay_env(
            relay_dsn,
            kafka.bootstrap_servers,
            RELAY_LEASE_TTL_SECONDS="3",
            RELAY_SINK_TIMEOUT_SECONDS="3",
            RELAY_METRICS_PORT=str(port),
            RELAY_LAG_SAMPLE_SECONDS="0.2",
        )
        started.append(Replica(start_relay(env, tmp_path / f"relay-{n}.log"), port))
    yield started
    for replica in started:
        if replica.proc.poll() is None:
            replica.proc.kill()
        replica.proc.wait(timeout=10)


def leader_and_standby(replicas: list[Replica]) -> tuple[Replica, Replica] | None:
    held = [r.held() for r in replicas]
    if sorted(h for h in held if h is not None) != [0.0, 1.0]:
        return None
    leader = replicas[held.index(1.0)]
    return leader, next(r for r in replicas if r is not leader)


def test_metrics_show_one_holder_the_lag_while_the_broker_is_down_and_the_failover(
    replicas: list[Replica], database: str, kafka: TansuBroker, topic: str
) -> None:
    leader, standby = wait_until(
        lambda: leader_and_standby(replicas), timeout=20, message="held=1 on exactly one"
    )
    epoch = leader.value("relay_lease_epoch", **LEASE)
    assert epoch is not None and epoch >= 1
    wait_until(lambda: standby.value("relay_lease_epoch", **LEASE) == epoch, timeout=5)
    for replica in (leader, standby):
        assert http_get(f"http://127.0.0.1:{replica.port}/healthz")[0] == 200
        assert http_get(f"http://127.0.0.1:{replica.port}/readyz")[0] == 200
        assert replica.value("relay_lease_losses_total", reason="fenced", **LEASE) == 0.0

    # A normal drain: rows go out, the leader counts them, both replicas see no lag.
    insert_rows(database, topic, keyed_rows(keys=2, per_key=10))
    wait_until(lambda: scalar(database, "SELECT count(*) FROM outbox") == 0, timeout=20)
    acked = {"sink": "kafka", "topic": topic, "outcome": "acked"}
    wait_until(lambda: leader.value("relay_messages_total", **acked) == 20, timeout=5)

    # The sink goes down: the lag age grows on every replica, standby included.
    kafka.pause()
    try:
        insert_rows(database, topic, keyed_rows(keys=2, per_key=5, start=10))
        first = wait_until(lambda: standby.age() >= 1.5 and standby.age(), timeout=10)
        wait_until(lambda: standby.age() >= first + 1.0, timeout=10, message="age to grow")
        assert leader.age() >= first
        for replica in (leader, standby):
            assert replica.value("relay_outbox_unsent_rows") == 10.0
        assert leader.value("relay_lease_held", **LEASE) == 1.0  # an outage is no lease loss
    finally:
        kafka.resume()
    # ... and falls back to zero once the rows are delivered.
    wait_until(
        lambda: all(r.age() == 0.0 and r.value("relay_outbox_unsent_rows") == 0 for r in replicas),
        timeout=30,
        message="lag back to zero on both replicas",
    )

    # Failover: SIGTERM the leader; the standby takes the lease at the next epoch.
    leader.proc.send_signal(signal.SIGTERM)
    assert leader.proc.wait(timeout=20) == 0
    wait_until(lambda: standby.held() == 1.0, timeout=10, message="the standby to take over")
    assert standby.value("relay_lease_epoch", **LEASE) == epoch + 1
    assert standby.value("relay_lease_acquisitions_total", **LEASE) == 1.0
    since = standby.value("relay_lease_seconds_since_renewal", **LEASE)
    assert since is not None and since < 3.0


def test_prometheus_sees_exactly_one_holder_across_a_crash(
    replicas: list[Replica], database: str, topic: str
) -> None:
    wait_until(lambda: leader_and_standby(replicas), timeout=20, message="a leader")
    with PrometheusServer([f"127.0.0.1:{r.port}" for r in replicas]) as prom:
        wait_until(prom.targets_up, timeout=20, interval=0.2, message="targets up")
        wait_until(lambda: prom.targets_up() == 2, timeout=20, interval=0.2)

        def one_holder() -> bool:
            return prom.query('sum(relay_lease_held{lease="default"}) == 1') != []

        wait_until(one_holder, timeout=15, interval=0.2, message="sum(relay_lease_held) == 1")
        # Both replicas report lag; the lag alert's expression is quiet on an empty outbox.
        wait_until(
            lambda: prom.query("count(relay_outbox_oldest_unsent_age_seconds) == 2"),
            timeout=10,
            interval=0.2,
        )
        assert prom.query("max(relay_outbox_oldest_unsent_age_seconds) > 60") == []

        # SIGKILL the leader: its series go stale, the survivor takes over at epoch 2.
        leader = next(r for r in replicas if r.held() == 1.0)
        os.kill(leader.proc.pid, signal.SIGKILL)
        wait_until(lambda: prom.targets_up() == 1, timeout=15, interval=0.2)
        wait_until(
            lambda: prom.query('max(relay_lease_epoch{lease="default"}) == 2') and one_holder(),
            timeout=20,
            interval=0.2,
            message="one holder again, at epoch 2",
        )
        insert_rows(database, topic, keyed_rows(keys=1, per_key=3))
        wait_until(
            lambda: prom.query(
                f'sum(relay_messages_total{{topic="{topic}",outcome="acked"}}) == 3'
            ),
            timeout=20,
            interval=0.2,
        )


def test_lag_sample_counts_blocked_and_dead_rows_and_stops_at_the_cap(database: str) -> None:
    """The gauges' definitions, on rows placed by hand: k0's head is backing off, so k0's
    later rows wait behind it; k1 flows; two rows are dead-lettered."""
    insert_rows(database, "t", keyed_rows(keys=2, per_key=3))  # k0:0 k1:0 k0:1 k1:1 ...
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour',"
            " created_at = now() - interval '42 seconds'"
            " WHERE id = (SELECT min(id) FROM outbox WHERE key = 'k0')"
        )
        conn.execute(
            "SELECT outbox_dead_letter(ARRAY[(SELECT max(id) FROM outbox WHERE key = 'k1')],"
            " ARRAY[1], ARRAY['test'])"
        )
        conn.execute(
            "INSERT INTO outbox_dead (id, message_id, topic, key, payload, created_at,"
            " attempts, dead_lettered_at, dead_letter_reason)"
            " VALUES (nextval(pg_get_serial_sequence('outbox', 'id')), gen_random_uuid(),"
            " 't', 'k9', 'x', now(), 1, now(), 'test')"
        )
    with psycopg.connect(database, autocommit=True, row_factory=psycopg.rows.dict_row) as conn:
        sample = measure(conn, cap=1_000)
        assert (sample.unsent, sample.blocked, sample.dead_lettered) == (5, 3, 2)
        assert 42.0 <= sample.oldest_unsent_age_seconds < 60.0
        capped = measure(conn, cap=2)
        assert (capped.unsent, capped.blocked, capped.dead_lettered) == (2, 2, 2)
        conn.execute("DELETE FROM outbox")
        empty = measure(conn, cap=1_000)
        assert (empty.unsent, empty.oldest_unsent_age_seconds, empty.blocked) == (0, 0.0, 0)


def test_lag_sample_reads_indexes_only_never_the_whole_table(database: str) -> None:
    """The cost claim in the README holds only while the planner walks the indexes:
    with a backlog of 50,000 rows and 20,000 scheduled for later (moved out into
    outbox_scheduled), no step may scan either table."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 't', 'k' || (g % 100), 'x' FROM generate_series(1, 50000) AS g"
        )
        insert_rows(database, "t", keyed_rows(keys=3, per_key=3))
        conn.execute(
            "UPDATE outbox SET attempts = 1, next_attempt_at = now()"
            " WHERE id = (SELECT max(id) FROM outbox)"
        )
        # 20,000 rows scheduled for tomorrow, moved out of the outbox as the relay does.
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " SELECT 't', 's' || g, 'x', now() + interval '1 day'"
            " FROM generate_series(1, 20000) AS g"
        )
        conn.execute("SELECT outbox_park_scheduled(20000)")
        conn.execute("ANALYZE outbox")
        conn.execute("ANALYZE outbox_scheduled")
        with conn.transaction():  # planned as the lag sampler plans it (relay/observe/lag.py)
            apply_settings(conn, ORDERED_WALKS, local=True)
            row = conn.execute(
                "EXPLAIN (FORMAT JSON) " + QUERIES.lag_sample,
                {"cap": 100_000, "age_window": 1000},
            ).fetchone()
    assert row is not None
    plan = json.dumps(row[0])
    # outbox_dead holds dead letters only, outbox_scheduled rows scheduled for later
    # only: a count of them, up to the cap, may read them in order; outbox_paused_topics
    # holds a row per topic an operator paused.
    scans = {(n["Node Type"], n.get("Relation Name")) for n in plan_nodes(row[0][0]["Plan"])}
    assert {s for s in scans if s[0] in ("Seq Scan", "Bitmap Heap Scan")} <= {
        ("Seq Scan", "outbox_dead"),
        ("Seq Scan", "outbox_scheduled"),
        ("Seq Scan", "outbox_paused_topics"),
    }, plan
    for index in (
        "outbox_pkey",
        "outbox_waiting_idx",
        "outbox_key_hash_idx",
        "outbox_scheduled_due_idx",
    ):
        assert index in plan


def test_a_status_session_samples_the_lag_without_compiling_it(database: str) -> None:
    """With sorts off, PostgreSQL before 18 prices lag_sample far past jit_above_cost: a
    relay session must not JIT-compile it (half a second of CPU on every `relay status`
    or console page, past the console's statement timeout on a busy server)."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET jit = on").format(sql.Identifier(conn.info.dbname))
        )
    with db.connect(CommonSettings(database_url=database), purpose="status") as conn:
        with conn.transaction():  # as relay/observe/lag.py's measure plans it
            apply_settings(conn, ORDERED_WALKS, local=True)
            row = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + QUERIES.lag_sample,
                {"cap": 100, "age_window": 1000},
            ).fetchone()
        assert row is not None
        assert "JIT" not in row["QUERY PLAN"][0], row["QUERY PLAN"][0]["JIT"]
        assert measure(conn, 100).unsent == 0


def test_lag_sample_cost_follows_the_cap_not_the_number_of_failing_rows(database: str) -> None:
    """Failing rows with keys of their own (a failing topic of unique keys): ten times
    as many of them must not make a sample capped at 100 rows read many more pages."""

    def failing(count: int) -> None:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, attempts, next_attempt_at)"
            " SELECT 't', 'u' || g, 'x', 1, now() + interval '1 hour'"
            " FROM generate_series(1, %s) AS g",
            (count,),
        )
        conn.execute("VACUUM ANALYZE outbox")

    def pages() -> int:
        with conn.transaction():  # planned as the lag sampler plans it
            apply_settings(conn, ORDERED_WALKS, local=True)
            row = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + QUERIES.lag_sample,
                {"cap": 100, "age_window": 1000},
            ).fetchone()
        assert row is not None
        top = row[0][0]["Plan"]
        return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])

    with psycopg.connect(database, autocommit=True) as conn:
        failing(3_000)
        few = pages()
        failing(27_000)
        many = pages()
        sample = conn.execute(QUERIES.lag_sample, {"cap": 100, "age_window": 1000}).fetchone()
    assert many < 2 * few + 50, f"{few} pages with 3,000 failing rows, {many} with 30,000"
    assert sample is not None
    assert sample[0] == 100 and sample[2] == 100  # unsent and blocked, both capped


def test_a_lease_lost_to_failing_renewals_counts_as_error_not_expired(
    make_settings: SettingsFactory, database: str
) -> None:
    """Renewals that fail on the database until the local deadline passes: reason=error.
    (Revoking UPDATE on leases makes every renewal fail, deterministically.)"""
    lease = f"err-{uuid.uuid4().hex[:6]}"

    def losses(reason: str) -> float:
        return (
            REGISTRY.get_sample_value(
                "relay_lease_losses_total", {"lease": lease, "reason": reason}
            )
            or 0.0
        )

    with running_relay(make_settings(lease_name=lease)) as app:
        wait_until(lambda: app.lease.token() is not None, timeout=10, message="the lease")
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("REVOKE UPDATE ON leases FROM relay")
        wait_until(lambda: losses("error") == 1.0, timeout=10, message="a loss by error")
        assert losses("expired") == 0.0
        assert REGISTRY.get_sample_value("relay_lease_held", {"lease": lease}) == 0.0


def test_a_leader_whose_database_freezes_drops_the_lease_gauge_and_readiness_in_time(
    make_settings: SettingsFactory, pg: PostgresServer
) -> None:
    """Before: the gauge followed the elector, stuck inside a renewal the frozen server
    never answers (10 s and more), and readiness counted the leader's turns that had
    nothing to renew as database contact, so /readyz stayed 200 for a second or more past
    its window. Now both follow the last real round trip: 0 at the local deadline
    (ttl - margin), 503 within max(3 x standby poll, ttl)."""
    lease = f"frozen-{uuid.uuid4().hex[:6]}"
    port = free_port()
    settings = make_settings(lease_name=lease, metrics_port=port, lag_sample_seconds=0)
    window = max(3 * settings.standby_poll_seconds, settings.lease_ttl_seconds)

    def held() -> float | None:
        return REGISTRY.get_sample_value("relay_lease_held", {"lease": lease})

    with running_relay(settings) as app:
        wait_until(lambda: held() == 1.0, timeout=10, message="the lease")
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 10, message="ready"
        )
        pg.pause()
        try:
            frozen = time.monotonic()
            wait_until(lambda: held() == 0.0, timeout=settings.lease_ttl_seconds + 1.0)
            gauge_zero = time.monotonic() - frozen
            wait_until(
                lambda: http_get(f"http://127.0.0.1:{port}/readyz", timeout=1)[0] == 503,
                timeout=window + 2.0,
            )
            unready = time.monotonic() - frozen
            assert app.lease.token() is None
        finally:
            pg.resume()
    assert gauge_zero <= settings.lease_ttl_seconds - settings.safety_margin + 0.3, gauge_zero
    assert unready <= window + 0.3, unready


# --- the topic label cap (RELAY_METRICS_TOPIC_LABELS) ---


@pytest.mark.unit
def test_a_paused_topics_series_stays_until_it_is_resumed_and_then_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each sample sets the paused topics' series before it removes a resumed one's, so
    no scrape meets a still-paused topic without its series."""

    def paused(topic: str) -> float | None:
        return REGISTRY.get_sample_value("relay_topic_paused_seconds", {"topic": topic})

    removed: list[tuple[str, float | None]] = []
    real_remove = TOPIC_PAUSED.remove

    def remove(topic: str) -> None:  # what a scrape would see just before the removal
        removed.append((topic, paused("still")))
        real_remove(topic)

    monkeypatch.setattr(TOPIC_PAUSED, "remove", remove)
    publish(LagSample(0, 0.0, 0, 0, 100, paused_topics={"gone": 5.0, "still": 1.0}))
    publish(LagSample(0, 0.0, 0, 0, 100, paused_topics={"still": 2.0}))
    assert (paused("gone"), paused("still")) == (None, 2.0)
    assert removed == [("gone", 2.0)]
    publish(LagSample(0, 0.0, 0, 0, 100))
    assert paused("still") is None


@pytest.mark.unit
def test_topic_labels_keep_the_first_topics_and_count_the_rest_as_other() -> None:
    labels = TopicLabels(2)
    assert [labels.label(t) for t in ("a", "b", "c", "a", "d", "b")] == [
        "a", "b", OTHER_TOPIC, "a", OTHER_TOPIC, "b",
    ]  # fmt: skip
    # Neither a topic too long for a label nor the bucket's own name takes a slot.
    labels = TopicLabels(1)
    assert labels.label("x" * (TOPIC_LABEL_MAX_CHARS + 1)) == OTHER_TOPIC
    assert labels.label(OTHER_TOPIC) == OTHER_TOPIC
    assert labels.label("x" * TOPIC_LABEL_MAX_CHARS) == "x" * TOPIC_LABEL_MAX_CHARS
    labels.reset(0)
    assert {labels.label(t) for t in ("a", "b", "x" * TOPIC_LABEL_MAX_CHARS)} == {OTHER_TOPIC}
    labels.reset(1)
    assert (labels.label("b"), labels.label("a")) == ("b", OTHER_TOPIC)


@pytest.mark.unit
def test_topic_labels_admit_exactly_the_cap_under_concurrent_drains() -> None:
    """Shard drain threads label at the same time: exactly the cap is kept, and every
    topic has one label throughout (a kept topic never counts under _other)."""
    cap, threads, topics = 50, 8, [f"t{n}" for n in range(500)]
    labels = TopicLabels(cap)
    start = threading.Barrier(threads)
    given: list[set[tuple[str, str]]] = [set() for _ in range(threads)]

    def drain(index: int) -> None:
        start.wait()
        for _ in range(3):
            for topic in topics[index:] + topics[:index]:
                given[index].add((topic, labels.label(topic)))

    workers = [threading.Thread(target=drain, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    by_topic: dict[str, set[str]] = {}
    for topic, label in set().union(*given):
        by_topic.setdefault(topic, set()).add(label)
    assert all(len(values) == 1 for values in by_topic.values())
    kept = {topic for topic, values in by_topic.items() if values == {topic}}
    assert len(kept) == cap
    assert labels.label("t-new") == OTHER_TOPIC


def _series_by_topic(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **match: str
) -> dict[str, float]:
    """One counter's values by topic, summed over the series whose labels include `match`."""
    found: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        named = dict(labels)
        if sample == name and match.items() <= named.items():
            found[named["topic"]] = found.get(named["topic"], 0.0) + value
    return found


def test_metrics_carry_at_most_the_capped_topics_and_the_counts_add_up(
    database: str, relay_dsn: str, kafka: TansuBroker, tmp_path: Path
) -> None:
    """Six topics delivered and two dead-lettered through a relay capped at three: /metrics
    names three topics and _other, and every row is counted once."""
    cap = 3
    run = uuid.uuid4().hex[:6]
    rows = {f"tenant-{run}-{n}": n + 1 for n in range(6)}
    for topic in rows:
        kafka.create_topic(topic, partitions=1)
    for topic, count in rows.items():
        insert_rows(database, topic, [(topic, f"{topic}:{i}".encode()) for i in range(count)])
    for n in range(2):
        insert_rows(database, f"no spaces allowed {run} {n}", [(f"bad-{n}", b"x")])
    port = free_port()
    env = relay_env(
        relay_dsn,
        kafka.bootstrap_servers,
        RELAY_METRICS_PORT=str(port),
        RELAY_METRICS_TOPIC_LABELS=str(cap),
    )
    proc = start_relay(env, tmp_path / "relay.log")
    try:
        wait_until(lambda: unsent_count(database) == 0, timeout=30, message="all rows settled")

        def counted() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
            samples = scrape(port)
            acked = _series_by_topic(samples, "relay_messages_total", outcome="acked")
            dead = _series_by_topic(samples, "relay_dead_lettered_total")
            return samples if sum(acked.values()) == 21 and sum(dead.values()) == 2 else None

        samples = wait_until(counted, timeout=10, message="every row counted")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    messages = _series_by_topic(samples, "relay_messages_total")
    acked = _series_by_topic(samples, "relay_messages_total", outcome="acked")
    dead = _series_by_topic(samples, "relay_dead_lettered_total")
    assert OTHER_TOPIC in messages
    assert len(set(messages) | set(dead)) <= cap + 1, sorted(set(messages) | set(dead))
    kept = set(acked) - {OTHER_TOPIC}
    assert kept <= set(rows)
    for topic in kept:
        assert acked[topic] == rows[topic], topic
    assert acked[OTHER_TOPIC] == sum(rows.values()) - sum(rows[t] for t in kept)
    assert sum(_series_by_topic(samples, "relay_messages_total", outcome="dead").values()) == 2


# --- the metrics server under slow and many clients ---


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # open, nothing to read
    except ConnectionResetError:
        return True


def test_the_metrics_server_answers_through_a_flood_of_idle_and_dribbling_clients() -> None:
    """More idle connections than the server keeps, a few half request lines and a
    client dribbling bytes: a scrape and a probe from another client still answer at
    once, the threads stay bounded, and the server drops every idle client itself."""
    health = Health()
    health.register("main", 60.0)
    server = MetricsServer("127.0.0.1", 0, health)
    server.start()
    address = ("127.0.0.1", server.port)
    base = f"http://127.0.0.1:{server.port}"
    clients: list[socket.socket] = []
    try:
        wait_until(lambda: http_get(f"{base}/healthz")[0] == 200, timeout=5)
        threads = threading.active_count()
        opened = time.monotonic()
        clients += [socket.create_connection(address) for _ in range(MAX_CONNECTIONS + 50)]
        half = [socket.create_connection(address) for _ in range(5)]
        for sock in half:
            sock.sendall(b"GET /metr")
        dribbler = socket.create_connection(address)
        dribbler.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        clients += [*half, dribbler]

        for path in ("/metrics", "/healthz"):
            asked = time.monotonic()
            status, body = http_get(f"{base}{path}", timeout=3)  # the kubelet probe's
            assert status == 200 and body, path
            assert time.monotonic() - asked < 2.0, path
        assert threading.active_count() <= threads + HANDLER_THREADS

        # A client that finishes its request within the deadline is answered.
        half[0].sendall(b"ics HTTP/1.1\r\nHost: relay\r\n\r\n")
        half[0].settimeout(2)
        assert half[0].makefile("rb").read().startswith(b"HTTP/1.1 200 OK")

        def dribbled_until_dropped() -> bool:
            try:
                dribbler.send(b"x")
            except OSError:
                return True
            return _closed_by_server(dribbler)

        wait_until(dribbled_until_dropped, timeout=CONNECTION_TIMEOUT_SECONDS + 2, interval=0.2)
        wait_until(
            lambda: all(_closed_by_server(sock) for sock in clients),
            timeout=CONNECTION_TIMEOUT_SECONDS + 2,
            interval=0.1,
            message="the server to drop every idle client",
        )
        assert time.monotonic() - opened >= CONNECTION_TIMEOUT_SECONDS - 0.5
        assert threading.active_count() <= threads + HANDLER_THREADS
        assert http_get(f"{base}/metrics", timeout=2)[0] == 200
    finally:
        for sock in clients:
            sock.close()
        server.stop()
