"""The RabbitMQ sink beyond the contract: the node killed mid-drain loses nothing, and
the AMQP message carries what the README says."""

from __future__ import annotations

import threading
import uuid

import aio_pika
import pytest

from relay.message import MalformedRow, OutboxMessage
from relay.sinks import create_sink
from relay.sinks.base import Outcome, Result
from relay.sinks.rabbitmq.sink import message_for
from tests.conftest import SettingsFactory
from tests.harness.rabbitmq import Queued, RabbitmqServer
from tests.support import (
    SteadyWriter,
    failed_deliveries,
    insert_rows,
    running_relay,
    scalar,
    unsent_count,
    wait_until,
)

pytestmark = pytest.mark.slow


def assert_all_in_key_order(queued: list[Queued], total: int) -> None:
    """After deduplication by message id (RabbitMQ keeps no window): every row, each
    key's steps in order."""
    seen: set[str] = set()
    steps: dict[str, list[int]] = {}
    for m in queued:
        if m.message_id in seen:
            continue
        seen.add(m.message_id)
        key, step = m.body.decode().split(":")
        assert m.headers["message-key"] == key
        steps.setdefault(key, []).append(int(step))
    assert len(seen) == total, f"{len(seen)} of {total} delivered"
    for key, got in steps.items():
        assert got == sorted(got), f"key {key} out of order: {got}"


def test_a_node_killed_mid_drain_loses_nothing_and_dead_letters_nothing(
    make_settings: SettingsFactory, database: str, rabbitmq_server: RabbitmqServer
) -> None:
    queue = f"orders-{uuid.uuid4().hex[:8]}"
    rabbitmq_server.declare_queue(queue)
    rabbitmq_server.persist_definitions()  # the crash below must not take the queue
    settings = make_settings(
        sink="rabbitmq", rabbitmq_url=rabbitmq_server.url, sink_timeout_seconds=2.0
    )
    with running_relay(settings):
        # The writer goes on until the relay saw the kill, so the kill always meets rows
        # to deliver however fast the first ones drained.
        seen = threading.Event()
        writer = SteadyWriter(database, queue, steps=30, until=seen.is_set)
        try:
            wait_until(
                lambda: len(rabbitmq_server.read_queue(queue)) >= 50, timeout=30, interval=0.2
            )
            failed = failed_deliveries("rabbitmq", queue)
            rabbitmq_server.kill()
            # The kill landed mid-drain: the relay saw publishes fail against the dead node.
            wait_until(
                lambda: failed_deliveries("rabbitmq", queue) > failed,
                timeout=30,
                message="a publish to the killed node failed",
            )
            assert unsent_count(database) > 0, "nothing was left to deliver at the kill"
        finally:
            seen.set()
        rabbitmq_server.start()  # the same node, port and data again
        writer.join(timeout=70)
        assert not writer.is_alive()
        wait_until(lambda: unsent_count(database) == 0, timeout=90, interval=0.2)
    assert scalar(database, "SELECT count(*) FROM outbox_dead_letters") == 0
    assert_all_in_key_order(rabbitmq_server.read_queue(queue), total=writer.written)


def test_a_routing_key_no_queue_could_have_is_dead_lettered_and_its_key_goes_on(
    make_settings: SettingsFactory, database: str, rabbitmq_server: RabbitmqServer
) -> None:
    """Returned, and not even a valid queue name (the client refuses to ask about it):
    dead-lettered, not retried as "unavailable" forever with its key stuck behind it
    (what the first version of the recovering-queue check did; the chaos run found it)."""
    queue = f"orders-{uuid.uuid4().hex[:8]}"
    rabbitmq_server.declare_queue(queue)
    settings = make_settings(sink="rabbitmq", rabbitmq_url=rabbitmq_server.url)
    insert_rows(database, "bad topic!", [("k0", b"k0:0")])
    insert_rows(database, queue, [("k0", b"k0:1")])
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, timeout=30, interval=0.1)
    reason = scalar(
        database, "SELECT dead_letter_reason FROM outbox_dead_letters WHERE topic = 'bad topic!'"
    )
    assert reason is not None and "unroutable" in reason, reason
    assert [m.body for m in rabbitmq_server.read_queue(queue)] == [b"k0:1"]


@pytest.mark.unit
def test_the_amqp_message_of_a_row() -> None:
    row = OutboxMessage(
        1,
        "6f1c-id",
        "orders",
        "k1",
        b"{}",
        [["content-type", "application/json"], ["tenant", "acme"], ["message-id", "forged"]],
        None,
        "2026-11-24T10:00:00.000000Z",
        0.0,
        0,
    )
    message = message_for(row)
    assert message.message_id == "6f1c-id"
    assert message.content_type == "application/json"
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.headers == {
        "tenant": "acme",
        "created-at": "2026-11-24T10:00:00.000000Z",
        "message-key": "k1",
    }
    long_name = OutboxMessage(1, "i", "t", None, b"", [["h" * 200, "v"]], None, "x", 0.0, 0)
    with pytest.raises(MalformedRow):
        message_for(long_name)


def test_a_standby_probe_reaches_a_restarted_node_again(
    make_settings: SettingsFactory, rabbitmq_server: RabbitmqServer
) -> None:
    """A standby's heartbeat probe (`check`) after the node was killed and came back:
    aio-pika may leave the dead connection not marked closed, and a probe that kept
    using it said "unreachable" forever, so a leader cut off from the broker later never
    saw an able peer to give way to (found by the RabbitMQ chaos run, seed 76364)."""
    sink = create_sink(make_settings(sink="rabbitmq", rabbitmq_url=rabbitmq_server.url))
    try:
        assert "connected" in sink.check(timeout=5.0)
        rabbitmq_server.restart()

        def reachable() -> bool:
            try:
                sink.check(timeout=2.0)
            except Exception:
                return False
            return True

        wait_until(reachable, timeout=60, interval=0.5, message="the probe to reconnect")
    finally:
        sink.close()


def test_a_queue_missing_just_after_a_restart_waits_and_one_deleted_meanwhile_is_dead(
    make_settings: SettingsFactory, rabbitmq_server: RabbitmqServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node restarted after a crash says it has no such queue until it recovered its
    durable queues (seconds, under load): messages for a queue that took messages before
    the restart wait (the sink is unavailable) instead of being dead-lettered. Here the
    queue is really gone (deleted before the restart), which looks the same to the sink
    until the grace ends. A queue deleted while the connection that fed it is open is
    dead-lettered at once."""
    from relay.sinks.rabbitmq import sink as rabbitmq

    kept, deleted = (f"q-{uuid.uuid4().hex[:8]}" for _ in range(2))
    for name in (kept, deleted):
        rabbitmq_server.declare_queue(name)
    sink = create_sink(make_settings(sink="rabbitmq", rabbitmq_url=rabbitmq_server.url))

    def send(queue: str, step: int) -> Result:
        row = OutboxMessage(step, f"m-{uuid.uuid4()}", queue, "k", b"x", None, None, "", 0.0, 0)
        return sink.start_publish([row], lambda: False).wait()[0]

    def delete(name: str) -> None:
        async def drop(connection: aio_pika.abc.AbstractConnection) -> None:
            channel = await connection.channel()
            await channel.queue_delete(name)

        rabbitmq_server.call(drop)

    try:
        assert send(deleted, 1).outcome is Outcome.ACKED
        delete(deleted)
        assert send(deleted, 2).outcome is Outcome.DEAD  # gone under an open connection
        assert send(kept, 3).outcome is Outcome.ACKED
        delete(kept)
        # The deletion on disk before the crash: a SIGKILL while it is only in the node's
        # memory brings the queue back (seen once in 20 runs), and every send is acked.
        rabbitmq_server.persist_definitions()
        rabbitmq_server.restart()

        def answered() -> Result | None:
            result = send(kept, 4)
            return result if "not running" in (result.error or "") else None

        waiting = wait_until(answered, timeout=60, interval=0.5, message="the sink to reconnect")
        assert waiting.outcome is Outcome.UNAVAILABLE
        monkeypatch.setattr(rabbitmq, "_RECOVERY_SECONDS", 0.0)
        assert send(kept, 5).outcome is Outcome.DEAD  # past the grace: dead-lettered
    finally:
        sink.close()
