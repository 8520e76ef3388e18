"""Each sink as the contract suite (tests/test_sink_contract.py) drives it: the settings
that route to a fresh destination on its real server, a topic it refuses for good, a
configuration that reaches nothing, and what a consumer received.

A new sink joins the contract by adding one `Target` here and a line in `TARGETS`.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pytest

from tests.harness import free_port
from tests.harness.kafka import TansuBroker, consume
from tests.harness.nats import NatsServer, Stored
from tests.harness.rabbitmq import Queued, RabbitmqServer
from tests.harness.webhook import Delivery, Reply, WebhookServer


@dataclass(frozen=True, slots=True)
class Received:
    """One message as a consumer of the sink sees it."""

    key: str | None
    payload: bytes
    headers: dict[str, str]

    @property
    def message_id(self) -> str:
        return self.headers["message-id"]


class Target(Protocol):
    name: str
    topic: str  # rows of this topic are delivered
    refused_topic: str  # rows of this topic are refused for good (dead-lettered)

    def settings(self) -> dict[str, Any]:
        """make_settings overrides that route `topic` to a fresh destination."""
        ...

    def env(self) -> dict[str, str]:
        """The same as RELAY_* variables, for a `relay` subprocess."""
        ...

    def unreachable(self) -> dict[str, Any]:
        """make_settings overrides under which the sink reaches no server."""
        ...

    def received(self, at_least: int, timeout: float = 20.0) -> list[Received]:
        """What a consumer got, in delivery order, once `at_least` arrived."""
        ...


class KafkaTarget:
    name = "kafka"

    def __init__(self, broker: TansuBroker) -> None:
        self._broker = broker
        self.topic = f"contract-{uuid.uuid4().hex[:8]}"
        broker.create_topic(self.topic, partitions=3)
        self.refused_topic = "not a topic!"  # Kafka's topic name rule refuses it

    def settings(self) -> dict[str, Any]:
        return {"sink": "kafka", "kafka_bootstrap_servers": self._broker.bootstrap_servers}

    def env(self) -> dict[str, str]:
        return {
            "RELAY_SINK": "kafka",
            "RELAY_KAFKA_BOOTSTRAP_SERVERS": self._broker.bootstrap_servers,
        }

    def unreachable(self) -> dict[str, Any]:
        return {
            "sink": "kafka",
            "kafka_bootstrap_servers": f"127.0.0.1:{free_port()}",
            "sink_timeout_seconds": 1.5,
        }

    def received(self, at_least: int, timeout: float = 20.0) -> list[Received]:
        records = consume(
            self._broker.bootstrap_servers, self.topic, min_count=at_least, timeout=timeout
        )
        records.sort(key=lambda r: (r.partition, r.offset))  # per key: delivery order
        return [
            Received(r.key, r.value or b"", {k: v.decode() for k, v in r.headers.items()})
            for r in records
        ]


class HttpTarget:
    name = "http"

    def __init__(self, server: WebhookServer) -> None:
        self._server = server
        self.topic = f"contract-{uuid.uuid4().hex[:8]}"
        self.refused_topic = f"refused-{uuid.uuid4().hex[:8]}"  # the endpoint answers 422

    def settings(self) -> dict[str, Any]:
        return {"sink": "http", "http_url": self._server.url + "/{topic}"}

    def env(self) -> dict[str, str]:
        return {"RELAY_SINK": "http", "RELAY_HTTP_URL": self._server.url + "/{topic}"}

    def unreachable(self) -> dict[str, Any]:
        return {"sink": "http", "http_url": f"http://127.0.0.1:{free_port()}/x"}

    def received(self, at_least: int, timeout: float = 20.0) -> list[Received]:
        from tests.support import wait_until

        def mine() -> list[Delivery]:
            return [d for d in self._server.acked() if d.path == f"/{self.topic}"]

        wait_until(lambda: len(mine()) >= at_least, timeout, message=f"{at_least} requests")
        return [Received(d.key, d.body, d.headers) for d in mine()]


def refuse_refused(delivery: Delivery) -> Reply:
    return Reply(422, body=b"no such thing") if "/refused-" in delivery.path else Reply(200)


class NatsTarget:
    name = "nats"

    def __init__(self, server: NatsServer) -> None:
        self._server = server
        suffix = uuid.uuid4().hex[:8]
        self.topic = f"contract.{suffix}"
        self.refused_topic = f"nostream.{suffix}"  # no stream takes it
        self.stream = f"CONTRACT_{suffix}"
        server.create_stream(self.stream, [self.topic])

    def settings(self) -> dict[str, Any]:
        return {"sink": "nats", "nats_url": self._server.url}

    def env(self) -> dict[str, str]:
        return {"RELAY_SINK": "nats", "RELAY_NATS_URL": self._server.url}

    def unreachable(self) -> dict[str, Any]:
        return {"sink": "nats", "nats_url": f"nats://127.0.0.1:{free_port()}"}

    def received(self, at_least: int, timeout: float = 20.0) -> list[Received]:
        from tests.support import wait_until

        def enough() -> list[Stored] | None:
            stored = self._server.read_stream(self.stream)
            return stored if len(stored) >= at_least else None

        stored = wait_until(enough, timeout, interval=0.1, message=f"{at_least} in {self.stream}")
        return [Received(m.key, m.data, m.headers) for m in stored]


class RabbitmqTarget:
    name = "rabbitmq"

    def __init__(self, server: RabbitmqServer) -> None:
        self._server = server
        suffix = uuid.uuid4().hex[:8]
        self.topic = f"contract-{suffix}"  # a queue, through the default exchange
        self.refused_topic = f"noqueue-{suffix}"  # unroutable: no queue of that name
        server.declare_queue(self.topic)

    def settings(self) -> dict[str, Any]:
        return {"sink": "rabbitmq", "rabbitmq_url": self._server.url}

    def env(self) -> dict[str, str]:
        return {"RELAY_SINK": "rabbitmq", "RELAY_RABBITMQ_URL": self._server.url}

    def unreachable(self) -> dict[str, Any]:
        return {"sink": "rabbitmq", "rabbitmq_url": f"amqp://guest:guest@127.0.0.1:{free_port()}/"}

    def received(self, at_least: int, timeout: float = 20.0) -> list[Received]:
        from tests.support import wait_until

        def enough() -> list[Queued] | None:
            queued = self._server.read_queue(self.topic)
            return queued if len(queued) >= at_least else None

        queued = wait_until(enough, timeout, interval=0.1, message=f"{at_least} in {self.topic}")
        assert all(m.persistent for m in queued)
        return [
            Received(
                m.headers.get("message-key"), m.body, {**m.headers, "message-id": m.message_id}
            )
            for m in queued
        ]


TARGETS = ("kafka", "http", "nats", "rabbitmq")


@pytest.fixture(scope="session")
def webhook_for_contract() -> Iterator[WebhookServer]:
    with WebhookServer(refuse_refused) as server:
        yield server


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[RabbitmqServer]:
    pgrep = subprocess.run(["pgrep", "-x", "epmd"], check=False, capture_output=True)
    epmd_before = pgrep.returncode == 0
    with RabbitmqServer() as server:
        yield server
    if not epmd_before:  # Erlang's port mapper daemon, started by the node: ours to stop
        subprocess.run(["pkill", "-x", "epmd"], check=False)


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "kafka":
        return KafkaTarget(request.getfixturevalue("kafka"))
    if request.param == "http":
        return HttpTarget(request.getfixturevalue("webhook_for_contract"))
    if request.param == "nats":
        return NatsTarget(request.getfixturevalue("nats_server"))
    if request.param == "rabbitmq":
        return RabbitmqTarget(request.getfixturevalue("rabbitmq_server"))
    raise AssertionError(request.param)
