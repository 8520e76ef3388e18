"""The sink contract: every sink, against its real server, keeps the same promises.

- per key, a refused message is never overtaken by a later one of its batch;
- an abandoned publish acknowledges nothing;
- a sink that reaches nothing answers "unavailable": rows untouched, no attempt spent;
- a message refused for good is dead-lettered with the reason, the rest flows;
- the message id is the row's, the same on every delivery; headers are carried;
- `relay check` connects, and fails when the server is not there.

Each sink is a `Target` (tests/sink_targets.py).
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from relay.message import OutboxMessage
from relay.settings import Settings
from relay.sinks import Outcome, Sink, create_sink
from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness.kafka import TansuBroker, consume
from tests.sink_targets import Received, Target
from tests.support import insert_rows, running_relay, scalar, unsent_count, wait_until

CREATED_AT = "2026-11-24T10:00:00.000000Z"


def message(
    topic: str, key: str | None, payload: str, headers: list[list[str]] | None = None
) -> OutboxMessage:
    return OutboxMessage(
        id=0,
        message_id=str(uuid.uuid4()),
        topic=topic,
        key=key,
        payload=payload.encode(),
        headers=headers,
        unsendable=None,
        created_at=CREATED_AT,
        due_epoch=0.0,
        attempts=0,
    )


@pytest.fixture
def open_sink(make_settings: SettingsFactory) -> Iterator[Callable[[dict[str, object]], Sink]]:
    opened: list[Sink] = []

    def open_(overrides: dict[str, object]) -> Sink:
        sink = create_sink(make_settings(**overrides))
        opened.append(sink)
        return sink

    yield open_
    for sink in opened:
        sink.close()


def by_key(received: list[Received]) -> dict[str | None, list[bytes]]:
    out: dict[str | None, list[bytes]] = {}
    for item in received:
        out.setdefault(item.key, []).append(item.payload)
    return out


def test_acknowledges_and_carries_id_and_headers(
    target: Target, open_sink: Callable[[dict[str, object]], Sink]
) -> None:
    sink = open_sink(target.settings())
    batch = [
        message(target.topic, "a", "a:0", [["trace", "t-1"], ["tenant", "acme"]]),
        message(target.topic, "a", "a:1"),
        message(target.topic, None, "keyless"),
    ]
    results = sink.start_publish(batch, lambda: False).wait()
    assert [r.outcome for r in results] == [Outcome.ACKED] * 3
    assert all(r.reached for r in results)
    received = {r.message_id: r for r in target.received(at_least=3)}
    assert set(received) == {m.message_id for m in batch}
    first = received[batch[0].message_id]
    assert first.payload == b"a:0" and first.key == "a"
    assert first.headers["trace"] == "t-1" and first.headers["tenant"] == "acme"
    assert first.headers["created-at"] == CREATED_AT
    assert received[batch[2].message_id].payload == b"keyless"


def test_kafka_records_carry_what_the_positional_produce_call_meant(
    kafka: TansuBroker, open_sink: Callable[[dict[str, object]], Sink]
) -> None:
    """The Kafka sink calls produce() by position (the cheapest form of the relay's
    hottest call): a confluent-kafka whose parameter order differs must fail here, as
    a key, value, header or timestamp in the wrong place."""
    topic = f"positional-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, partitions=1)
    sink = open_sink({"sink": "kafka", "kafka_bootstrap_servers": kafka.bootstrap_servers})
    sent = message(topic, "k-1", "v-1", [["trace", "t-1"]])
    before_ms = time.time() * 1000
    assert sink.start_publish([sent], lambda: False).wait()[0].outcome is Outcome.ACKED
    [record] = consume(kafka.bootstrap_servers, topic, min_count=1)
    assert (record.key, record.value) == ("k-1", b"v-1")
    assert record.headers == {
        "trace": b"t-1",
        "message-id": sent.message_id.encode(),
        "created-at": CREATED_AT.encode(),
    }
    assert before_ms - 1000 <= record.timestamp_ms <= time.time() * 1000 + 1000  # now


def test_a_refused_message_is_not_overtaken_by_its_key(
    target: Target, open_sink: Callable[[dict[str, object]], Sink]
) -> None:
    sink = open_sink(target.settings())
    batch = [
        message(target.topic, "a", "a:0"),
        message(target.refused_topic, "a", "a:1"),
        message(target.topic, "a", "a:2"),
        message(target.topic, "b", "b:0"),
    ]
    results = sink.start_publish(batch, lambda: False).wait()
    outcomes = [r.outcome for r in results]
    assert outcomes == [Outcome.ACKED, Outcome.DEAD, Outcome.SKIPPED, Outcome.ACKED], results
    assert results[1].error
    # A later message of b proves the batch was delivered; a:2 is not among it.
    assert (
        sink.start_publish([message(target.topic, "a", "a:3")], lambda: False).wait()[0].outcome
        is Outcome.ACKED
    )
    got = by_key(target.received(at_least=3))
    assert got["a"] == [b"a:0", b"a:3"]
    assert got["b"] == [b"b:0"]


def test_an_abandoned_publish_acknowledges_nothing(
    target: Target, open_sink: Callable[[dict[str, object]], Sink]
) -> None:
    sink = open_sink(target.settings())
    batch = [message(target.topic, "a", f"a:{i}") for i in range(5)]
    results = sink.start_publish(batch, lambda: True).wait()
    assert all(r.outcome is Outcome.SKIPPED for r in results), results
    marker = message(target.topic, "a", "marker")
    assert sink.start_publish([marker], lambda: False).wait()[0].outcome is Outcome.ACKED
    assert [r.payload for r in target.received(at_least=1)] == [b"marker"]


def test_unreachable_is_unavailable_not_a_failure_of_the_message(
    target: Target, open_sink: Callable[[dict[str, object]], Sink]
) -> None:
    sink = open_sink(target.unreachable())
    batch = [message(target.topic, "a", "a:0"), message(target.topic, "b", "b:0")]
    results = sink.start_publish(batch, lambda: False).wait()
    assert {r.outcome for r in results} <= {Outcome.UNAVAILABLE, Outcome.SKIPPED}, results
    assert any(r.outcome is Outcome.UNAVAILABLE for r in results)
    assert not any(r.reached for r in results)
    with pytest.raises(Exception):  # noqa: B017 - any error: the probe failed
        sink.check(timeout=3.0)


def test_the_same_row_sent_twice_keeps_its_message_id(
    target: Target, open_sink: Callable[[dict[str, object]], Sink]
) -> None:
    sink = open_sink(target.settings())
    once = message(target.topic, "a", "a:0")
    for _ in range(2):
        assert sink.start_publish([once], lambda: False).wait()[0].outcome is Outcome.ACKED
    marker = message(target.topic, "a", "marker")
    sink.start_publish([marker], lambda: False).wait()
    received = target.received(at_least=2)
    copies = [r for r in received if r.payload == b"a:0"]
    assert copies and {r.message_id for r in copies} == {once.message_id}
    # JetStream's duplicate window keeps one copy; the others deliver both (consumers
    # deduplicate by the id).
    assert len(copies) == (1 if target.name == "nats" else 2)


def test_the_relay_dead_letters_a_refused_row_and_delivers_the_rest(
    target: Target, make_settings: SettingsFactory, database: str
) -> None:
    insert_rows(database, target.topic, [("a", b"a:0")])
    insert_rows(database, target.refused_topic, [("a", b"a:1")], headers={"h": "v"})
    insert_rows(database, target.topic, [("a", b"a:2"), ("b", b"b:0")])
    with running_relay(make_settings(**target.settings())):
        wait_until(lambda: unsent_count(database) == 0, timeout=30)
    reason = scalar(
        database, "SELECT dead_letter_reason FROM outbox_dead_letters WHERE payload = 'a:1'"
    )
    assert reason, "the refused row carries its reason"
    got = by_key(target.received(at_least=3))
    assert got["a"] == [b"a:0", b"a:2"] and got["b"] == [b"b:0"]


def test_the_relay_leaves_rows_untouched_while_the_sink_is_unreachable(
    target: Target, make_settings: SettingsFactory, database: str
) -> None:
    from relay.observe import metrics

    insert_rows(database, target.topic, [("a", b"a:0"), ("b", b"b:0")])
    settings: Settings = make_settings(**target.unreachable())
    counter = metrics.MESSAGES.labels(settings.sink, target.topic, "unavailable")
    before = counter._value.get()
    with running_relay(settings):
        # Two publishes answered "unavailable": the drain backed off and came back.
        wait_until(lambda: counter._value.get() >= before + 3, timeout=30, interval=0.05)
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT attempts, next_attempt_at FROM outbox").fetchall()
    dead = scalar(database, "SELECT count(*) FROM outbox_dead")
    assert (rows, dead) == ([(0, None)] * 2, 0)


def test_relay_check_connects_and_fails_without_the_server(target: Target, relay_dsn: str) -> None:
    env = relay_env(relay_dsn, **target.env())
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert target.name.encode() in done.stdout
    unreachable = {
        f"RELAY_{name.upper()}": str(value)
        for name, value in target.unreachable().items()
        if name != "sink"
    }
    done = subprocess.run(
        relay_command("check"),
        env={**env, **unreachable},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert b"sink: FAILED" in done.stderr
