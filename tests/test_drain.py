"""The drain loop against real PostgreSQL and a real Kafka-protocol broker."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
from prometheus_client import REGISTRY

from relay.drain.loop import Drainer
from relay.drain.sizing import FLOOR_ROWS
from relay.message import OutboxMessage
from relay.sinks.base import ACKED, OnePhase, Outcome, Result
from relay.sinks.kafka.sink import KafkaSink
from relay.store import repository
from tests.conftest import SettingsFactory
from tests.harness.kafka import TansuBroker, consume
from tests.harness.postgres import PostgresServer
from tests.support import (
    OVERTAKE_SETTINGS,
    assert_no_key_overtakes_itself,
    assert_per_key_order,
    dedup_by_message_id,
    insert_rows,
    keyed_rows,
    running_relay,
    scalar,
    unsent_count,
    wait_until,
)


def test_rows_across_keys_are_all_delivered_in_key_order(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    ids = insert_rows(database, topic, keyed_rows(keys=10, per_key=60), headers={"trace": "t-1"})
    with psycopg.connect(database) as conn:
        created = {
            str(r[0]): r[1]
            for r in conn.execute("SELECT message_id, created_at FROM outbox").fetchall()
        }
    message_ids = set(created)
    with running_relay(make_settings(batch_size=50)):
        wait_until(lambda: scalar(database, "SELECT count(*) FROM outbox") == 0, timeout=30)
    records = consume(kafka.bootstrap_servers, topic, min_count=len(ids), timeout=30)
    unique = dedup_by_message_id(records)
    assert {r.headers["message-id"].decode() for r in unique} == message_ids
    assert all(r.headers["trace"] == b"t-1" for r in unique)
    for r in unique:
        # RFC 3339 in UTC, to the microsecond, whatever the database's TimeZone.
        text = r.headers["created-at"].decode()
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", text), text
        assert datetime.fromisoformat(text) == created[r.headers["message-id"].decode()]
    assert_per_key_order(records)


def test_a_row_that_commits_late_is_still_delivered(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """The cursor-poller bug: a lower id committed after higher ids were sent."""
    with psycopg.connect(database) as slow, running_relay(make_settings()):
        late = slow.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES (%s, 'late', 'late:0') RETURNING id",
            (topic,),
        ).fetchone()
        assert late is not None
        ids = insert_rows(database, topic, keyed_rows(keys=3, per_key=10))
        assert late[0] < min(ids)
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox") == 0,
            timeout=20,
            message="the early committers to be sent",
        )
        slow.commit()
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox WHERE key = 'late'") == 0,
            timeout=20,
            message="the late row to be sent",
        )
    records = consume(kafka.bootstrap_servers, topic, min_count=31, timeout=30)
    assert b"late:0" in {r.value for r in records}


def test_poison_rows_are_dead_lettered_and_the_rest_flow(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES ('no spaces allowed', 'k0', 'x')"
        )
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, headers) VALUES (%s, 'k1', 'x', '[1, 2]')",
            (topic,),
        )
        conn.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k2', %s)", (topic, b"x" * 20_000)
        )
    good = insert_rows(database, topic, keyed_rows(keys=3, per_key=5))
    # The relay's own size screen set above the producer's limit: the producer refuses.
    settings = make_settings(
        kafka={"message_max_bytes": "10000"}, message_max_bytes=1 << 20, retention_seconds=3600
    )
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, timeout=20)
    with psycopg.connect(database) as conn:
        dead = conn.execute(
            "SELECT key, dead_letter_reason FROM outbox_dead_letters ORDER BY id"
        ).fetchall()
        sent = conn.execute("SELECT count(*) FROM outbox_sent").fetchone()
    assert [k for k, _ in dead] == ["k0", "k1", "k2"]
    assert "invalid Kafka topic name" in dead[0][1]
    assert "headers must be a JSON object" in dead[1][1]
    assert "MSG_SIZE_TOO_LARGE" in dead[2][1]
    assert sent == (len(good),)
    records = consume(kafka.bootstrap_servers, topic, min_count=len(good), timeout=30)
    assert len(dedup_by_message_id(records)) == len(good)
    assert_per_key_order(records)  # k0..k2's later rows flowed after their poison row


class ScriptedSink(OnePhase):
    """A sink that fails chosen keys a set number of times: the drain loop's unit under
    test is the database side (per-key blocking, backoff, dead-lettering), for real.
    The drain loop reads its next batch between `start_publish` and `wait`."""

    name = "scripted"
    serial_per_key = False
    max_publish_seconds = 5.0

    def __init__(self, failures: dict[str, int], outcome: Outcome = Outcome.RETRY) -> None:
        self.failures = dict(failures)
        self.outcome = outcome
        self.delivered: list[tuple[str | None, bytes | None]] = []
        self.lock = threading.Lock()

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        results = []
        blocked: set[str | None] = set()
        for m in messages:
            if m.key in blocked:
                results.append(Result(Outcome.SKIPPED))
            elif self.failures.get(m.key or "", 0) > 0:
                self.failures[m.key or ""] -= 1
                blocked.add(m.key)
                results.append(Result(self.outcome, "HTTP 503 from scripted sink"))
            else:
                with self.lock:
                    self.delivered.append((m.key, m.payload))
                results.append(ACKED)
        return results

    def check(self, timeout: float) -> str:
        return "scripted"

    def close(self) -> None:
        pass


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Callable[..., ScriptedSink]:
    def install(failures: dict[str, int], outcome: Outcome = Outcome.RETRY) -> ScriptedSink:
        sink = ScriptedSink(failures, outcome)
        monkeypatch.setattr("relay.daemon.app.create_sink", lambda _settings, _tracing=None: sink)
        return sink

    return install


def test_a_failing_key_waits_in_backoff_while_other_keys_flow(
    make_settings: SettingsFactory,
    database: str,
    scripted: Callable[..., ScriptedSink],
) -> None:
    sink = scripted({"k0": 3})
    insert_rows(database, "t", keyed_rows(keys=4, per_key=5))
    settings = make_settings(retry_base_seconds=0.3, retry_max_seconds=0.3, max_attempts=10)
    with running_relay(settings):
        # Other keys finish while k0 is still backing off.
        wait_until(lambda: sum(1 for k, _ in sink.delivered if k != "k0") == 15, timeout=10)
        assert not any(k == "k0" for k, _ in sink.delivered)

        def k0_head() -> tuple[Any, ...] | None:
            # The batch's settle runs beside the next fetch: wait for it to land.
            with psycopg.connect(database) as conn:
                row = conn.execute(
                    "SELECT attempts, last_error, next_attempt_at IS NOT NULL FROM outbox"
                    " WHERE key = 'k0' ORDER BY id LIMIT 1"
                ).fetchone()
            return row if row is not None and row[0] >= 1 else None

        row = wait_until(k0_head, timeout=5)
        assert "503" in row[1] and row[2]
        wait_until(lambda: unsent_count(database) == 0, timeout=20)
    k0 = [p for k, p in sink.delivered if k == "k0"]
    assert k0 == [f"k0:{i}".encode() for i in range(5)]


def test_pipelined_settle_neither_republishes_nor_lets_a_key_overtake(
    make_settings: SettingsFactory,
    database: str,
    scripted: Callable[..., ScriptedSink],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch N+1 is fetched and published while N is still being settled. Slow settles
    make that overlap certain: N's rows must not be fetched again (no duplicates in a
    run without faults), and a key whose row failed in N must not have its later rows
    published before that row's retry (k0:1 is fetched while k0:0's backoff is not yet
    written)."""
    real_settle = repository.settle

    def slow_settle(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)
        return real_settle(*args, **kwargs)

    monkeypatch.setattr("relay.store.postgres.repository.settle", slow_settle)
    sink = scripted({"k0": 1})
    rows = [(f"k{n % 2}", f"k{n % 2}:{n // 2}".encode()) for n in range(12)]
    insert_rows(database, "t", rows)
    settings = make_settings(batch_size=2, retry_base_seconds=0.1, retry_max_seconds=0.1)
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, timeout=30)
    assert sorted(sink.delivered) == sorted(rows)  # each exactly once
    assert [p for k, p in sink.delivered if k == "k0"] == [f"k0:{i}".encode() for i in range(6)]


def test_a_prefetched_row_waits_for_its_keys_failure_even_when_that_settle_landed(
    make_settings: SettingsFactory,
    database: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """k0:1 is prefetched while k0:0 is being published; k0:0 fails. Each step waits
    for the batch being settled to land first, so nothing is in flight when the
    prefetched k0:1 comes up: it must still wait for k0:0's retry."""
    sink = ScriptedSink({"k0": 1})
    monkeypatch.setattr("relay.daemon.app.create_sink", lambda _settings, _tracing=None: sink)
    real_step = Drainer._step

    def step_slowly(self: Drainer, token: Any) -> None:
        pipeline = self._pipeline
        wait_until(lambda: not pipeline.settling or pipeline.landed, timeout=10)
        real_step(self, token)

    monkeypatch.setattr(Drainer, "_step", step_slowly)
    rows = [(f"k{n % 2}", f"k{n % 2}:{n // 2}".encode()) for n in range(8)]
    insert_rows(database, "t", rows)
    settings = make_settings(batch_size=2, retry_base_seconds=0.1, retry_max_seconds=0.1)
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, timeout=30)
    assert sorted(sink.delivered) == sorted(rows)
    assert [p for k, p in sink.delivered if k == "k0"] == [f"k0:{i}".encode() for i in range(4)]


def test_a_row_past_max_attempts_is_dead_lettered_and_its_key_moves_on(
    make_settings: SettingsFactory,
    database: str,
    scripted: Callable[..., ScriptedSink],
) -> None:
    sink = scripted({"k0": 1_000})
    insert_rows(database, "t", [("k0", b"k0:0")])
    scripted_tail = insert_rows(database, "t", [("k1", b"k1:0")])
    settings = make_settings(retry_base_seconds=0.05, retry_max_seconds=0.05, max_attempts=3)
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, timeout=20)
    reason, attempts = psycopg.connect(database).execute(
        "SELECT dead_letter_reason, attempts FROM outbox_dead_letters WHERE key = 'k0'"
    ).fetchone() or (None, None)
    assert attempts == 3
    assert reason == "gave up after 3 attempts: HTTP 503 from scripted sink"
    assert ("k1", b"k1:0") in sink.delivered and scripted_tail


def test_one_sick_topic_backs_off_per_row_while_the_sink_is_up(
    make_settings: SettingsFactory, database: str, scripted: Callable[..., ScriptedSink]
) -> None:
    """'Unavailable' for some rows while others are acked is not a sink outage: those
    rows back off and are dead-lettered in the end, and the rest keeps flowing."""
    sink = scripted({"sick": 1_000}, Outcome.UNAVAILABLE)
    insert_rows(database, "t", [("sick", b"sick:0")])
    settings = make_settings(retry_base_seconds=0.05, retry_max_seconds=0.05, max_attempts=3)
    sent = 0

    def traffic_flows_until_sick_is_dead() -> bool:
        nonlocal sent
        insert_rows(database, "t", [(f"k{sent % 3}", f"k{sent % 3}:{sent // 3}".encode())])
        sent += 1
        return (
            unsent_count(database) <= 1
            and scalar(database, "SELECT count(*) FROM outbox_dead_letters") == 1
        )

    with running_relay(settings):
        wait_until(traffic_flows_until_sick_is_dead, timeout=20)
        wait_until(lambda: unsent_count(database) == 0, timeout=20)
    assert {k for k, _ in sink.delivered} == {"k0", "k1", "k2"}
    assert len(sink.delivered) == sent
    reason = scalar(
        database, "SELECT dead_letter_reason FROM outbox_dead_letters WHERE key = 'sick'"
    )
    assert reason == "gave up after 3 attempts: HTTP 503 from scripted sink"


def test_retention_keeps_sent_rows_then_purges_them(
    make_settings: SettingsFactory, database: str, topic: str
) -> None:
    insert_rows(database, topic, keyed_rows(keys=2, per_key=10))
    settings = make_settings(retention_seconds=1.0, purge_interval_seconds=0.2)
    with running_relay(settings):
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox_sent") == 20,
            timeout=20,
            message="rows kept, out of the outbox",
        )
        assert scalar(database, "SELECT count(*) FROM outbox") == 0
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox_sent") == 0,
            timeout=20,
            message="the purge to empty their generation after the retention",
        )


def test_a_failing_purge_never_stalls_the_drain(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """Before: the purge ran inside the drain loop before each fetch; once it failed
    (here: no TRUNCATE privilege on the history's generations; in production a lock
    held by a reader of it, or a statement timeout) it failed again before every fetch,
    and nothing drained while /healthz stayed green."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "REVOKE TRUNCATE ON outbox_sent_0, outbox_sent_1, outbox_sent_2, outbox_sent_3"
            " FROM relay"
        )
    settings = make_settings(retention_seconds=0.2, purge_interval_seconds=0.2)
    errors_before = _sample("relay_purge_errors_total")
    with running_relay(settings):
        insert_rows(database, topic, keyed_rows(keys=2, per_key=5))
        wait_until(lambda: unsent_count(database) == 0, timeout=20, message="first rows sent")
        wait_until(
            lambda: _sample("relay_purge_errors_total") > errors_before,
            timeout=10,
            message="the purge to fail on rows past their retention",
        )
        for round_ in range(3):
            insert_rows(database, topic, keyed_rows(keys=2, per_key=5, start=5 * (round_ + 1)))
            wait_until(
                lambda: unsent_count(database) == 0,
                timeout=5,
                message="later rows sent while every purge fails",
            )
        assert scalar(database, "SELECT count(*) FROM outbox_sent") == 40  # none purged
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "GRANT TRUNCATE ON outbox_sent_0, outbox_sent_1, outbox_sent_2, outbox_sent_3"
                " TO relay"
            )
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox_sent") == 0,
            timeout=20,
            message="the purge to catch up once it can",
        )


def _sample(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    return 0.0 if value is None else value


def test_a_key_never_overtakes_its_own_failed_message_at_the_broker(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """The broker stalled (SIGSTOP). Tansu answers a bumped epoch with PRODUCER_FENCED,
    so here the case holds even without the fix; tests/test_sick_partition.py runs it
    on a cluster that accepts the bumped epoch, where the code before the fix failed."""

    @contextmanager
    def stalled() -> Iterator[None]:
        kafka.pause()
        try:
            yield
        finally:
            kafka.resume()

    assert_no_key_overtakes_itself(make_settings(**OVERTAKE_SETTINGS), database, topic, stalled)


def test_nothing_queued_is_sent_after_the_deadline_while_the_read_ahead_is_stuck(
    make_settings: SettingsFactory,
    database: str,
    kafka: TansuBroker,
    topic: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker stalls with a batch produced (ten messages on the wire, the rest
    queued), the read-ahead is stuck, and renewals fail, so the lease's local deadline
    passes. Before: the queued messages waited in librdkafka and went out when the
    broker came back, long after the deadline (a newer holder may be publishing by
    then). Now they are dropped at the deadline: by the loop's own wait for the batch's
    reports, which stops at the deadline, and by the deadline guard."""
    monkeypatch.setattr("relay.failpoints._DIRECTORY", str(tmp_path))
    settings = make_settings(
        batch_size=200,
        sink_timeout_seconds=60.0,
        kafka={"batch_num_messages": "2"},  # five requests in flight hold ten messages
    )
    stall = tmp_path / "stall_read_ahead"
    cuts = _sample("relay_publishing_cuts_total")
    with running_relay(settings) as app:
        sink = cast(KafkaSink, app.sink)
        insert_rows(database, topic, [("warm", b"warm:0")])
        wait_until(lambda: unsent_count(database) == 0, timeout=20, message="producer warm")
        kafka.pause()
        try:
            stall.touch()
            insert_rows(database, topic, [("K", f"K:{i}".encode()) for i in range(200)])
            # A batch sized by time starts at its floor (relay/drain/sizing.py): ten
            # of its 64 on the wire, the rest queued.
            wait_until(
                lambda: len(sink._producer) >= FLOOR_ROWS - 10,
                timeout=10,
                message="the batch produced, the read-ahead stuck",
            )
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute("REVOKE UPDATE ON leases FROM relay")
            wait_until(
                lambda: _sample("relay_publishing_cuts_total") > cuts,
                timeout=10,
                message="the deadline, and the cut",
            )
            assert app.lease.token() is None
            kafka.resume()
            sink._producer.flush(10)  # whatever it still holds goes out now
            early = [
                r for r in consume(kafka.bootstrap_servers, topic, min_count=1) if r.key == "K"
            ]
            assert len(early) <= 10, f"{len(early)} messages sent after the deadline"
        finally:
            kafka.resume()
            stall.unlink(missing_ok=True)
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute("GRANT UPDATE ON leases TO relay")
        wait_until(lambda: unsent_count(database) == 0, timeout=30, message="all delivered")
    records = consume(kafka.bootstrap_servers, topic, min_count=201, timeout=30)
    assert len(dedup_by_message_id(records)) == 201
    assert_per_key_order(records)


def test_a_stuck_read_ahead_does_not_hold_back_the_batch_being_published(
    make_settings: SettingsFactory,
    database: str,
    kafka: TansuBroker,
    topic: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The read of the next batch runs on the reader's thread while the loop publishes
    and settles the batch before it: with that read stuck (a slow database), the batch
    in hand is still delivered and settled; the loop waits for the read only when it
    needs the next batch. Before, the drain thread itself made the read between
    producing a batch and collecting its acknowledgements, so the batch settled only
    once the read came back."""
    monkeypatch.setattr("relay.failpoints._DIRECTORY", str(tmp_path))
    stall = tmp_path / "stall_read_ahead"
    with running_relay(make_settings(batch_size=500)):
        insert_rows(database, topic, [("warm", b"warm:0")])
        wait_until(lambda: unsent_count(database) == 0, timeout=20, message="producer warm")
        stall.touch()
        try:
            insert_rows(
                database, topic, [(f"k{i % 5}", f"k{i % 5}:{i}".encode()) for i in range(50)]
            )
            wait_until(
                lambda: unsent_count(database) == 0,
                timeout=20,
                message="the batch settled while the read after it is stuck",
            )
            assert stall.exists()  # the stall was still armed (it lasts 60 s at most)
        finally:
            stall.unlink(missing_ok=True)
        insert_rows(
            database, topic, [(f"k{i % 5}", f"k{i % 5}:{i}".encode()) for i in range(50, 80)]
        )
        wait_until(lambda: unsent_count(database) == 0, timeout=30, message="the rest delivered")
    records = consume(kafka.bootstrap_servers, topic, min_count=81, timeout=30)
    assert len(dedup_by_message_id(records)) == 81
    assert_per_key_order(records)


def test_a_read_stuck_on_the_database_does_not_hold_up_the_leases_release_at_stop(
    make_settings: SettingsFactory, database: str, topic: str
) -> None:
    """The drain's read waits on a lock the app holds (no lock or statement timeout to
    end it soon). Stopping cancels it: the lease is given up while the lock is still
    held, so a standby takes over at its next poll, not once the read gives up."""
    settings = make_settings(
        database_lock_timeout_seconds=0, database_statement_timeout_seconds=60.0
    )
    with running_relay(settings) as app, psycopg.connect(database) as locker:
        insert_rows(database, topic, [("warm", b"warm:0")])
        wait_until(lambda: unsent_count(database) == 0, timeout=20, message="warm")
        locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        wait_until(
            lambda: _waiting_on_a_lock(database, "relay:drain"),
            timeout=10,
            message="the drain's read waiting on the lock",
        )
        app.shutdown.request()
        wait_until(
            lambda: _lease_released(database, settings.lease_name),
            timeout=10,  # the read's statement timeout is a minute
            message="the lease released while the read is stuck",
        )
        assert _waiting_on_a_lock(database, "relay:drain") is False  # cancelled
        locker.rollback()


def _waiting_on_a_lock(dsn: str, application: str) -> bool:
    return bool(
        scalar(
            dsn,
            "SELECT count(*) > 0 FROM pg_stat_activity"
            " WHERE application_name = %s AND wait_event_type = 'Lock'",
            (application,),
        )
    )


def _lease_released(dsn: str, name: str) -> bool:
    return bool(
        scalar(
            dsn,
            "SELECT released_at IS NOT NULL AND expires_at <= now() FROM leases WHERE name = %s",
            (name,),
        )
    )


def test_broker_outage_marks_nothing_unacked_and_delivers_all_after(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """SIGSTOP the broker mid-drain: rows stay unsent (never marked without an ack),
    then everything arrives once it is back."""
    settings = make_settings(sink_timeout_seconds=2.0, retention_seconds=3600, batch_size=20)
    total = 0
    with running_relay(settings):
        total += len(insert_rows(database, topic, keyed_rows(keys=4, per_key=10)))
        wait_until(lambda: unsent_count(database) == 0, timeout=20)
        kafka.pause()
        try:
            total += len(insert_rows(database, topic, keyed_rows(keys=4, per_key=10, start=10)))
            # Wait until the relay has had deliveries time out against the dead broker.
            wait_until(
                lambda: _unavailable(topic) >= 1,
                timeout=15,
                message="delivery timeouts while the broker is stopped",
            )
            assert unsent_count(database) == 40, "a row was marked sent while the broker was down"
        finally:
            kafka.resume()
        wait_until(lambda: unsent_count(database) == 0, timeout=30)
        marked = {
            str(r[0])
            for r in psycopg.connect(database)
            .execute("SELECT message_id FROM outbox_sent")
            .fetchall()
        }
    records = consume(kafka.bootstrap_servers, topic, min_count=total, timeout=30)
    delivered = {r.headers["message-id"].decode() for r in records}
    assert marked == delivered
    assert len(marked) == total == 80
    assert_per_key_order(records)


def _unavailable(topic: str) -> float:
    value = REGISTRY.get_sample_value(
        "relay_messages_total", {"sink": "kafka", "topic": topic, "outcome": "unavailable"}
    )
    return value or 0.0


def test_broker_killed_mid_drain_marks_nothing_unacked_and_delivers_after_restart(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """SIGKILL the broker (its in-memory log dies with it), restart it on the same port:
    no row is marked while it is gone, and every row marked afterwards is in the new log."""
    settings = make_settings(sink_timeout_seconds=2.0, retention_seconds=3600, batch_size=20)
    with running_relay(settings):
        insert_rows(database, topic, keyed_rows(keys=4, per_key=10))
        wait_until(lambda: unsent_count(database) == 0, timeout=20)
        before = _marked(database)
        kafka.kill()
        try:
            insert_rows(database, topic, keyed_rows(keys=4, per_key=10, start=10))
            wait_until(
                lambda: _unavailable(topic) >= 1,
                timeout=15,
                message="delivery failures while the broker is dead",
            )
            assert _marked(database) == before, "a row was marked while the broker was dead"
        finally:
            kafka.start()
            kafka.create_topic(topic, partitions=3)
        wait_until(lambda: unsent_count(database) == 0, timeout=40)
        after = _marked(database) - before
    records = consume(kafka.bootstrap_servers, topic, min_count=len(after), timeout=30)
    assert len(after) == 40
    assert after <= {r.headers["message-id"].decode() for r in records}
    assert_per_key_order(records)


def test_a_broker_that_comes_back_empty_does_not_wedge_the_producer(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """Kill the broker and bring it straight back (empty: no producer state) before the
    next rows: the idempotent producer's old id is unknown there and every delivery
    times out. The sink must start a fresh producer rather than time out forever while
    it keeps the lease (found by the chaos suite)."""
    settings = make_settings(sink_timeout_seconds=2.0, batch_size=20)
    with running_relay(settings):
        insert_rows(database, topic, keyed_rows(keys=4, per_key=5))
        wait_until(lambda: unsent_count(database) == 0, timeout=20)
        kafka.kill()
        kafka.start()
        kafka.create_topic(topic, partitions=3)
        insert_rows(database, topic, keyed_rows(keys=4, per_key=5, start=5))
        wait_until(
            lambda: unsent_count(database) == 0,
            timeout=30,
            message="delivery to the restarted broker",
        )
    records = consume(kafka.bootstrap_servers, topic, min_count=20, timeout=30)
    assert len({r.headers["message-id"] for r in records}) == 20
    assert_per_key_order(records)


def test_database_restart_mid_drain_loses_nothing(
    make_settings: SettingsFactory,
    database: str,
    pg: PostgresServer,
    kafka: TansuBroker,
    topic: str,
) -> None:
    """PostgreSQL goes away (fast shutdown) and comes back: the relay reconnects, keeps
    or re-takes the lease, and delivers every row."""
    with running_relay(make_settings(batch_size=20)):
        first = insert_rows(database, topic, keyed_rows(keys=4, per_key=10))
        wait_until(lambda: unsent_count(database) == 0, timeout=20)
        pg.restart()
        second = insert_rows(database, topic, keyed_rows(keys=4, per_key=10, start=10))
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox") == 0,
            timeout=40,
            message="the drain to resume after the restart",
        )
    records = consume(kafka.bootstrap_servers, topic, min_count=len(first) + len(second))
    assert len(dedup_by_message_id(records)) == len(first) + len(second)
    assert_per_key_order(records)


def _marked(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT message_id FROM outbox_sent").fetchall()
    return {str(r[0]) for r in rows}
