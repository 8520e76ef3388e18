"""The NATS JetStream sink beyond the contract: no duplicates across a leader crash
(JetStream's duplicate window and `Nats-Msg-Id`), and a server killed mid-drain."""

from __future__ import annotations

import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.message import OutboxMessage
from relay.sinks.nats.sink import headers_for
from tests.conftest import SettingsFactory, relay_env, start_relay
from tests.harness import free_port
from tests.harness.nats import NatsServer, Stored
from tests.support import (
    SteadyWriter,
    failed_deliveries,
    metric,
    running_relay,
    scalar,
    unsent_count,
    wait_until,
)

pytestmark = pytest.mark.slow


def assert_each_once_in_key_order(stored: list[Stored], total: int) -> None:
    ids = [m.message_id for m in stored]
    assert len(set(ids)) == len(ids), f"{len(ids) - len(set(ids))} duplicates in the stream"
    assert len(ids) == total, f"{len(ids)} of {total} in the stream"
    steps: dict[str, list[int]] = {}
    for m in stored:
        key, step = m.data.decode().split(":")
        assert m.key == key
        steps.setdefault(key, []).append(int(step))
    for key, seen in steps.items():
        assert seen == sorted(seen), f"key {key} out of order: {seen}"


@pytest.fixture
def stream(nats_server: NatsServer) -> Iterator[tuple[str, str]]:
    suffix = uuid.uuid4().hex[:8]
    subject, name = f"orders.{suffix}", f"ORDERS_{suffix}"
    nats_server.create_stream(name, [subject])
    yield subject, name


def test_jetstream_holds_each_row_once_after_the_leader_dies_between_ack_and_mark(
    relay_dsn: str,
    database: str,
    nats_server: NatsServer,
    stream: tuple[str, str],
    tmp_path: Path,
) -> None:
    subject, name = stream
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir()
    ports = [free_port(), free_port()]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for n, port in enumerate(ports):
            env = relay_env(
                relay_dsn,
                RELAY_SINK="nats",
                RELAY_NATS_URL=nats_server.url,
                RELAY_LEASE_TTL_SECONDS="3",
                RELAY_BATCH_SIZE="50",
                RELAY_METRICS_PORT=str(port),
                RELAY_FAILPOINTS=str(failpoints),
            )
            procs.append(start_relay(env, tmp_path / f"relay-{n}.log"))
        # The writer goes on until a replica has died, so the armed point always meets
        # a publish however fast the first rows drain.
        writer = SteadyWriter(
            database, subject, steps=40, until=lambda: any(p.poll() is not None for p in procs)
        )
        wait_until(lambda: len(nats_server.read_stream(name)) >= 100, timeout=30, interval=0.1)
        # The leader dies after its next batch is acknowledged and before it is marked:
        # the survivor publishes that batch again.
        (failpoints / "after_publish").touch()
        dead = wait_until(
            lambda: next((p for p in procs if p.poll() is not None), None), timeout=20
        )
        survivor = ports[1 - procs.index(dead)]
        writer.join(timeout=70)
        assert not writer.is_alive()
        wait_until(lambda: unsent_count(database) == 0, timeout=30, interval=0.1)
        assert_each_once_in_key_order(nats_server.read_stream(name), total=writer.written)
        # The crash did cost a redelivery, and JetStream dropped it.
        duplicates = wait_until(lambda: metric(survivor, "relay_nats_duplicates_total"), timeout=10)
        assert duplicates >= 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_a_server_killed_mid_drain_loses_nothing_and_dead_letters_nothing(
    make_settings: SettingsFactory, database: str
) -> None:
    with NatsServer() as server:
        suffix = uuid.uuid4().hex[:8]
        subject, name = f"orders.{suffix}", f"ORDERS_{suffix}"
        server.create_stream(name, [subject])
        settings = make_settings(sink="nats", nats_url=server.url, sink_timeout_seconds=1.0)
        with running_relay(settings):
            # The writer goes on until the relay saw the outage, so the outage always
            # meets rows to deliver however fast the first ones drained.
            seen = threading.Event()
            writer = SteadyWriter(database, subject, steps=30, until=seen.is_set)
            try:
                wait_until(lambda: len(server.read_stream(name)) >= 50, timeout=30, interval=0.1)
                failed = failed_deliveries("nats", subject)
                server.kill()
                # An outage, not a blip: the relay saw publishes fail against it.
                wait_until(
                    lambda: failed_deliveries("nats", subject) > failed,
                    timeout=30,
                    message="a publish to the dead server failed",
                )
                assert unsent_count(database) > 0, "nothing was left to deliver at the outage"
            finally:
                seen.set()
            server.start()
            writer.join(timeout=70)
            assert not writer.is_alive()
            wait_until(lambda: unsent_count(database) == 0, timeout=60, interval=0.1)
        assert scalar(database, "SELECT count(*) FROM outbox_dead_letters") == 0
        assert_each_once_in_key_order(server.read_stream(name), total=writer.written)


@pytest.mark.unit
def test_headers_steer_nothing_and_break_no_line() -> None:
    def msg(headers: list[list[str]], key: str | None = "k") -> OutboxMessage:
        return OutboxMessage(1, "m-1", "t", key, b"", headers, None, "now", 0.0, 0)

    sent = headers_for(msg([["Nats-Expected-Stream", "OTHER"], ["Nats-Msg-Id", "x"], ["a", "b"]]))
    assert sent == {
        "a": "b",
        "message-id": "m-1",
        "created-at": "now",
        "message-key": "k",
        "Nats-Msg-Id": "m-1",
    }
    from relay.message import MalformedRow

    with pytest.raises(MalformedRow, match="line break"):
        headers_for(msg([["a", "x\r\nNats-Msg-Id: y"]]))
    with pytest.raises(MalformedRow, match="header name"):
        headers_for(msg([["a b", "x"]]))
