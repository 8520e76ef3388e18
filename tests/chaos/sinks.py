"""The sink under a chaos run: its server, how each replica reaches it, what a consumer
read from it, and how the broker faults kill or pause it.

The runner, the cluster and the faults see only `ChaosSink`; one class per sink says
what differs:

- Kafka (Tansu) keeps its log in memory: a killed broker comes back empty, so the kill
  first lets the recorder read everything (markers), and replicas reach it through a
  per-process mount namespace to be cut off alone (root only).
- NATS JetStream and RabbitMQ keep their streams and durable queues on disk: a kill is
  a plain SIGKILL and restart, and the recorder reads on across it. Each replica dials
  its own proxy on a loopback address of its own (no namespace needed: the client
  dials the URL it is given and nothing else), so the cut works without root.
- JetStream drops a message id it has already stored within the stream's duplicate
  window (`Nats-Msg-Id`): across every fault of a run, it must hold each row once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Protocol

import aio_pika
import nats
from nats.js.errors import NotFoundError

from tests.chaos.history import Delivered, parse_payload
from tests.chaos.recorder import KafkaRecorder, put_markers
from tests.conftest import relay_command
from tests.harness.kafka import TansuBroker, issue_producer_ids
from tests.harness.nats import NatsServer
from tests.harness.netcut import TcpProxy, loopback, namespaced, namespaces_available
from tests.harness.rabbitmq import RabbitmqServer
from tests.support import wait_until

if TYPE_CHECKING:
    from pathlib import Path

    from tests.chaos.cluster import Cluster, Replica

TOPIC = "chaos-orders"
POISON_TOPIC = "bad topic!"  # Kafka and NATS refuse the name; RabbitMQ routes it nowhere


class Recorder(Protocol):
    """A consumer thread that keeps every message the sink hands out, in its order."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def records(self) -> list[Delivered]: ...

    def ids(self) -> set[str]: ...


class ChaosSink(Protocol):
    name: str
    publish_timeout: float  # the longest one publish waits before the relay sends it again
    exact: bool  # the server drops the relay's redeliveries: a run must show 0 duplicates

    @property
    def recorder(self) -> Recorder: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def attach(self, replica: Replica, n: int) -> None:
        """Give replica number `n` a proxy of its own, where the sink can cut one off."""
        ...

    def replica_env(self, replica: Replica) -> dict[str, str]: ...

    def replica_command(self, replica: Replica, workdir: Path) -> list[str] | None: ...

    def kill_and_restart(self, cluster: Cluster) -> str:
        """SIGKILL the server, start it again; the note for the fault's record."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class KafkaChaosSink:
    name = "kafka"
    exact = False

    def __init__(self, delivery_timeout: float) -> None:
        self.netcut = namespaces_available()
        self.broker = TansuBroker(advertised_host="localhost" if self.netcut else "127.0.0.1")
        self.partitions = 3
        self.publish_timeout = delivery_timeout
        self.recorder = KafkaRecorder(self.broker.bootstrap_servers, TOPIC, self.partitions)
        self.producer_id_floor = 0  # the highest idempotent producer id any broker issued

    def start(self) -> None:
        self.broker.start()
        self.broker.create_topic(TOPIC, self.partitions)

    def stop(self) -> None:
        self.broker.stop()

    def attach(self, replica: Replica, n: int) -> None:
        if self.netcut:
            upstream = ("127.0.0.1", self.broker.port)
            replica.proxy = TcpProxy(loopback(n), self.broker.port, upstream)

    def replica_env(self, replica: Replica) -> dict[str, str]:
        # A namespaced replica dials its own `localhost`: its proxy.
        bootstrap = (
            self.broker.advertised_bootstrap if replica.proxy else self.broker.bootstrap_servers
        )
        return {
            "RELAY_SINK": "kafka",
            "RELAY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "RELAY_SINK_TIMEOUT_SECONDS": str(self.publish_timeout),
        }

    def replica_command(self, replica: Replica, workdir: Path) -> list[str] | None:
        if replica.proxy is None:
            return None
        return namespaced(relay_command("run"), replica.proxy.host, workdir)

    def kill_and_restart(self, cluster: Cluster) -> str:
        """Tansu keeps its log in memory, so a killed broker comes back empty: records it
        acknowledged but nobody had read yet would vanish — the broker's loss, not the
        relay's. So the replicas are frozen for a moment, the recorder reads everything
        the old broker holds, and only then is it killed. What the relay sees is still a
        dead broker under its producer, with its batch possibly half acknowledged."""
        cluster.freeze_all()
        try:
            # Not the high watermarks: Tansu's lag its log by a batch (an acked batch
            # would vanish unread). A marker after everything, read back, proves it.
            markers = put_markers(self.broker.bootstrap_servers, TOPIC, self.partitions)
            wait_until(
                lambda: self.recorder.read_markers(markers),
                timeout=30,
                interval=0.05,
                message="the recorder to read every partition's marker",
            )
            if not self.recorder.suspend():
                raise AssertionError("recorder did not let go of the old broker")
            bootstrap = self.broker.bootstrap_servers
            issued = max(issue_producer_ids(bootstrap, 1))
            self.producer_id_floor = max(self.producer_id_floor, issued)
            self.broker.kill()
            self.broker.start()
            self.broker.create_topic(TOPIC, self.partitions)
            issue_producer_ids(bootstrap, self.producer_id_floor)
            self.recorder.resume()
        finally:
            cluster.thaw_all()
        return "replicas frozen"

    def pause(self) -> None:
        self.broker.pause()

    def resume(self) -> None:
        self.broker.resume()


class _ProxiedSink:
    """A sink whose replicas dial a URL: each gets its own proxy's address in it."""

    port: int

    def attach(self, replica: Replica, n: int) -> None:
        replica.proxy = TcpProxy(loopback(n), self.port, ("127.0.0.1", self.port))

    def replica_command(self, replica: Replica, workdir: Path) -> list[str] | None:
        return None

    @staticmethod
    def host(replica: Replica) -> str:
        return replica.proxy.host if replica.proxy else "127.0.0.1"


class NatsChaosSink(_ProxiedSink):
    name = "nats"
    exact = True
    publish_timeout = 2.0
    stream = "CHAOS"

    def __init__(self) -> None:
        self.server = NatsServer()
        self.port = self.server.port
        self.recorder = NatsRecorder(self.server.url, self.stream)

    def start(self) -> None:
        self.server.start()
        # The window covers a whole run: every redelivery of it is dropped by JetStream.
        self.server.create_stream(self.stream, [TOPIC], duplicate_window=3600.0)

    def stop(self) -> None:
        self.server.stop()

    def replica_env(self, replica: Replica) -> dict[str, str]:
        return {
            "RELAY_SINK": "nats",
            "RELAY_NATS_URL": f"nats://{self.host(replica)}:{self.port}",
            "RELAY_SINK_TIMEOUT_SECONDS": str(self.publish_timeout),
        }

    def kill_and_restart(self, cluster: Cluster) -> str:
        self.server.restart()
        return "stream on disk"

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        self.server.resume()


class RabbitmqChaosSink(_ProxiedSink):
    name = "rabbitmq"
    exact = False
    publish_timeout = 5.0

    def __init__(self) -> None:
        self.server = RabbitmqServer()
        self.port = self.server.port
        self.recorder = RabbitmqRecorder(self.server.url, TOPIC)

    def start(self) -> None:
        self.server.start()
        self.server.declare_queue(TOPIC)  # the default exchange routes the topic to it

    def stop(self) -> None:
        self.server.kill()

    def replica_env(self, replica: Replica) -> dict[str, str]:
        return {
            "RELAY_SINK": "rabbitmq",
            "RELAY_RABBITMQ_URL": f"amqp://guest:guest@{self.host(replica)}:{self.port}/",
            "RELAY_SINK_TIMEOUT_SECONDS": str(self.publish_timeout),
        }

    def kill_and_restart(self, cluster: Cluster) -> str:
        self.server.restart()
        return "queue on disk"

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        self.server.resume()


def make_sink(name: str, delivery_timeout: float) -> ChaosSink:
    if name == "kafka":
        return KafkaChaosSink(delivery_timeout)
    if name == "nats":
        return NatsChaosSink()
    if name == "rabbitmq":
        return RabbitmqChaosSink()
    raise ValueError(f"no chaos sink {name!r} (kafka, nats, rabbitmq)")


class _AsyncRecorder:
    """A thread running one event loop that reads the server until stopped, reconnecting
    across kills; subclasses read, `_keep` stores."""

    def __init__(self, name: str) -> None:
        self._records: list[Delivered] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    @property
    def records(self) -> list[Delivered]:
        with self._lock:
            return list(self._records)

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._seen)

    def _keep(self, message_id: str, key: str | None, data: bytes, offset: int) -> None:
        parsed_key, seq = parse_payload(data)
        record = Delivered(
            message_id=message_id,
            key=key,
            seq=seq if parsed_key is not None else None,
            offset=offset,
        )
        with self._lock:
            self._records.append(record)
            self._seen.add(message_id)

    def _seen_before(self, message_id: str) -> bool:
        with self._lock:
            return message_id in self._seen

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self._read()
            except Exception:  # the server is being killed or restarted: read on
                await asyncio.sleep(0.2)

    async def _read(self) -> None:
        raise NotImplementedError


class NatsRecorder(_AsyncRecorder):
    """Reads the stream by sequence number: stateless, so a server restart costs nothing
    but a reconnect, and the stream's order is the delivery order."""

    def __init__(self, url: str, stream: str) -> None:
        super().__init__("chaos-recorder-nats")
        self._url = url
        self._stream = stream
        self._next_seq = 1

    async def _read(self) -> None:
        nc = await nats.connect(
            self._url, connect_timeout=2, allow_reconnect=False, error_cb=_quiet
        )
        try:
            js = nc.jetstream(timeout=2)
            while not self._stop.is_set():
                try:
                    msg = await js.get_msg(self._stream, self._next_seq)
                except NotFoundError:
                    await asyncio.sleep(0.05)  # not stored yet
                    continue
                headers = msg.headers or {}
                self._keep(
                    headers.get("message-id", ""),
                    headers.get("message-key"),
                    msg.data or b"",
                    self._next_seq,
                )
                self._next_seq += 1
        finally:
            with contextlib.suppress(Exception):
                await nc.close()


async def _quiet(exc: Exception) -> None:
    return  # a killed server is the point; nats-py would print it


class RabbitmqRecorder(_AsyncRecorder):
    """Consumes the durable queue with manual acks: a message is taken off the queue only
    after it was recorded. One the broker hands out again (`redelivered`, our ack lost in
    a kill) and that was recorded already is not counted twice: that copy is the
    broker's, not the relay's."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__("chaos-recorder-rabbitmq")
        self._url = url
        self._queue = queue
        self._received = 0

    async def _read(self) -> None:
        connection = await aio_pika.connect(self._url, timeout=3)
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=500)
            queue = await channel.declare_queue(self._queue, durable=True, passive=True)
            async with queue.iterator() as messages:
                while not self._stop.is_set():
                    try:
                        message = await asyncio.wait_for(messages.__anext__(), timeout=0.2)
                    except TimeoutError:
                        if connection.is_closed:
                            return
                        continue
                    message_id = message.message_id or ""
                    if not (message.redelivered and self._seen_before(message_id)):
                        key = (message.headers or {}).get("message-key")
                        if isinstance(key, bytes):
                            key = key.decode()
                        self._received += 1
                        self._keep(
                            message_id,
                            key if isinstance(key, str) else None,
                            message.body,
                            self._received,
                        )
                    await message.ack()
        finally:
            with contextlib.suppress(Exception):
                await connection.close()
