"""RabbitMQ sink on aio-pika: persistent, mandatory publishes, delivered on the confirm.

Publisher confirms decide delivery: a row is marked sent only once the broker has taken
responsibility for its message. Publishes are `mandatory`, so a message no queue is
bound for comes back and is dead-lettered with the reason instead of being dropped.
Per key, the next publish starts only after the previous one was confirmed
(`KeyedSink`): a refused message is never overtaken by a later one of its key.

Outcomes:
- Basic.Ack: acknowledged.
- Basic.Return (no queue bound for the routing key), a routing key or header the AMQP
  encoding cannot carry, a message over the broker's size limit: `DEAD`. Through the
  default exchange a return for a queue that exists (a node still recovering it after a
  restart) is `UNAVAILABLE` instead: a passive declare tells the two apart. A node just
  restarted answers "no queue" even for a durable queue it has not recovered yet: for a
  queue that took messages on an earlier connection, that answer in the first
  _RECOVERY_SECONDS of a new connection is `UNAVAILABLE` too.
- Basic.Nack (the broker could not take it): `RETRY`.
- No connection, the channel or connection lost, no confirm in time, the exchange
  missing or access refused (a configuration the operator fixes; never the message's
  fault): `UNAVAILABLE`.

Long: the connection, the channel, the publishes and the reading of the broker's
answers share one client and its state; the outcome rules that need no client are
apart (outcomes.py), and so are the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from datetime import datetime
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aio_pika
import aiormq.exceptions
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractRobustConnection,
    FieldValue,
)

from relay.message import MalformedRow, OutboxMessage
from relay.observe.logging import get_logger
from relay.settings import Settings
from relay.sinks.base import ACKED, Outcome, Result
from relay.sinks.cloudevents import CloudEvents, is_attribute_header
from relay.sinks.keyed import KeyedSink
from relay.sinks.rabbitmq.outcomes import PUBLISH_ERRORS, classify, queue_is_absent
from relay.sinks.rabbitmq.settings import MAX_SHORTSTR, RabbitmqSettings, uses_tls
from relay.sinks.settings import tls_files

if TYPE_CHECKING:  # loaded only with RELAY_TRACING (the otel extra)
    from relay.observe.tracing import Tracing

log = get_logger("relay.sinks.rabbitmq")


# How long after a new connection a queue that took messages on an earlier one may be
# missing because the node is still recovering it. Past it the queue is taken for gone
# (deleted, or lost by the broker itself: a queue declared a moment before a crash may
# not survive it), and its messages are dead-lettered.
_RECOVERY_SECONDS = 30.0
_CONNECT_BACKOFF_SECONDS = 0.5  # while the broker is down, one connect attempt per this
_MAX_HEADER_NAME = 128  # RabbitMQ's limit on a field-table key
# Names the relay sets itself; `content-type` becomes the AMQP property.
_OWN_HEADERS = frozenset({"message-id", "created-at", "message-key", "content-type"})


def message_for(message: OutboxMessage, cloudevents: CloudEvents | None = None) -> aio_pika.Message:
    """The AMQP message of a row (no I/O, testable)."""
    headers: dict[str, FieldValue] = {}
    content_type: str | None = None
    for name, value in message.row_headers():
        lower = name.lower()
        if lower == "content-type":
            content_type = value
            continue
        if lower in _OWN_HEADERS:
            continue
        if cloudevents is not None and is_attribute_header(lower):
            continue
        if not name or len(name.encode()) > _MAX_HEADER_NAME:
            raise MalformedRow(f"header name {name[:40]!r}... is not 1-128 bytes")
        headers[name] = value
    headers["created-at"] = message.created_at
    if message.key is not None:
        headers["message-key"] = message.key
    if cloudevents is not None:
        headers.update(cloudevents_headers(cloudevents, message))
    if content_type is not None and len(content_type.encode()) > MAX_SHORTSTR:
        raise MalformedRow("the content-type header is over 255 bytes")
    return aio_pika.Message(
        body=message.payload or b"",
        headers=headers,
        message_id=message.message_id,
        content_type=content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=_timestamp(message.created_at),
    )


def cloudevents_headers(cloudevents: CloudEvents, message: OutboxMessage) -> dict[str, FieldValue]:
    """AMQP 0-9-1 has no binding of its own (the AMQP one is for 1.0): `ce-` header
    table entries, values as they are (a table holds UTF-8), as the CloudEvents SDK for
    Python reads a RabbitMQ message."""
    return {"ce-" + name: value for name, value in cloudevents.attributes(message)}


def _timestamp(created_at: str) -> datetime | None:
    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(created_at)
    return None


DEFAULT_TIMEOUT_SECONDS = 5.0  # RELAY_SINK_TIMEOUT_SECONDS unset
DEFAULT_MAX_IN_FLIGHT = 64  # RELAY_SINK_MAX_IN_FLIGHT unset


class RabbitmqSink(KeyedSink):
    name = "rabbitmq"

    def __init__(self, settings: Settings, tracing: Tracing | None = None) -> None:
        options = settings.sink_options(RabbitmqSettings)
        self._options = options
        self._cloudevents = CloudEvents.from_settings(settings)
        assert options.rabbitmq_url is not None  # required by the registry's rule
        self._url = options.rabbitmq_url.get_secret_value().strip()
        self._where = _where(self._url)
        self._exchange_name = options.rabbitmq_exchange
        self._timeout = settings.sink_timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        self._topic_map = settings.topic_map
        self._tls = tls_files(settings)
        self._connection_name = f"relay-{settings.lease_name}"
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._lock: asyncio.Lock | None = None
        self._retry_at = 0.0
        self._last_error = ""
        # Connections opened so far, when the current one opened, and by routing key the
        # connection on which its queue last took a message (_recovering).
        self._connections = 0
        self._connected_at = 0.0
        self._delivered: dict[str, int] = {}
        super().__init__(
            max_in_flight=settings.sink_max_in_flight or DEFAULT_MAX_IN_FLIGHT,
            batch_seconds=max(10.0, 3 * self._timeout),
        )

    def routing_key_for(self, message: OutboxMessage) -> str:
        key = self._topic_map.get(message.topic, message.topic)
        if len(key.encode()) > MAX_SHORTSTR:
            raise MalformedRow("the routing key is over 255 bytes")
        return key

    # --- connection and channel, opened on first use and again after a loss ---

    async def _ready_exchange(self) -> AbstractExchange:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._connection is None or self._connection.is_closed:
                if time.monotonic() < self._retry_at:
                    raise ConnectionError(self._last_error)
                self._connection, self._channel = await self._connect(), None
            if self._channel is None or self._channel.is_closed or self._exchange is None:
                self._channel = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
                self._exchange = (
                    self._channel.default_exchange
                    if not self._exchange_name
                    else await self._channel.get_exchange(self._exchange_name, ensure=False)
                )
            return self._exchange

    async def _connect(self) -> AbstractRobustConnection:
        try:
            connection = await asyncio.wait_for(
                aio_pika.connect(
                    self._url,
                    timeout=self._timeout,
                    ssl_context=self._ssl_context(),
                    client_properties={"connection_name": self._connection_name},
                ),
                self._timeout,
            )
        except BaseException as exc:
            self._retry_at = time.monotonic() + _CONNECT_BACKOFF_SECONDS
            # aiormq's messages name the host, never the password.
            self._last_error = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)
            raise
        self._connections += 1
        self._connected_at = time.monotonic()
        log.info("rabbitmq.connected", server=self._where)
        return connection  # type: ignore[return-value]  # connect() returns the plain kind

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not uses_tls(self._url):
            return None
        ca_file, cert_file, key_file = self._tls
        context = ssl.create_default_context(cafile=ca_file)
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
        return context

    # --- publishing (KeyedSink schedules the keys) ---

    async def send(self, message: OutboxMessage) -> Result:
        try:
            routing_key = self.routing_key_for(message)
            amqp_message = message_for(message, self._cloudevents)
        except MalformedRow as exc:
            return Result(Outcome.DEAD, str(exc))
        try:
            exchange = await self._ready_exchange()
        except Exception as exc:
            await self._drop(self._connection)
            return classify(exc, self._exchange_name)
        connection = self._connection
        try:
            await exchange.publish(
                amqp_message, routing_key=routing_key, mandatory=True, timeout=self._timeout
            )
        except aiormq.exceptions.PublishError as exc:
            return await self._returned(exc, routing_key)
        except Exception as exc:
            result = classify(exc, self._exchange_name)
            if not result.reached:  # the connection is suspect: the next send opens anew
                await self._drop(connection)
            return result
        self._delivered[routing_key] = self._connections
        return ACKED

    async def _returned(self, exc: Exception, routing_key: str) -> Result:
        """A mandatory publish came back. Through the default exchange that means no
        queue of that name (the message's fault: dead-letter it), or a queue that exists
        but is not running: a node recovering its queues after a crash returns messages
        for them, and answers a declare with NOT_FOUND too, in other words (seen under
        load: a whole backlog dead-lettered). Ask the broker which, with a passive
        declare on a channel of its own. A named exchange's bindings cannot be asked
        about over AMQP: a return there is dead-lettered."""
        if self._exchange_name or self._connection is None:
            return classify(exc, self._exchange_name)
        try:
            channel = await asyncio.wait_for(self._connection.channel(), self._timeout)
        except Exception as probe:
            PUBLISH_ERRORS.labels("unavailable").inc()
            return Result(Outcome.UNAVAILABLE, f"returned, and no channel to ask: {probe!r}")
        try:
            await asyncio.wait_for(channel.declare_queue(routing_key, passive=True), self._timeout)
        except aiormq.exceptions.ChannelNotFoundEntity as probe:
            if queue_is_absent(probe) and not self._recovering(routing_key):
                return classify(exc, self._exchange_name)
            PUBLISH_ERRORS.labels("unavailable").inc()
            return Result(
                Outcome.UNAVAILABLE, f"queue {routing_key!r} is not running: {probe}", reached=True
            )
        except ValueError:
            # The client refuses the name as a queue name at all (pamqp: "Invalid value
            # for queue"): no queue can take it.
            return classify(exc, self._exchange_name)
        except Exception as probe:
            PUBLISH_ERRORS.labels("unavailable").inc()
            return Result(Outcome.UNAVAILABLE, f"returned, and the queue check failed: {probe!r}")
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), 1.0)
        PUBLISH_ERRORS.labels("unavailable").inc()
        return Result(
            Outcome.UNAVAILABLE,
            f"queue {routing_key!r} exists but did not take the message (recovering?)",
            reached=True,
        )

    def _recovering(self, routing_key: str) -> bool:
        """The queue took messages on an earlier connection and this one is young: a
        node restarted after a crash says it has no such queue until it recovered it.
        One that goes missing while a connection it took messages on is open was
        deleted: its messages are dead-lettered at once."""
        earlier = self._delivered.get(routing_key)
        return (
            earlier is not None
            and earlier < self._connections
            and time.monotonic() - self._connected_at < _RECOVERY_SECONDS
        )

    async def _drop(self, connection: AbstractRobustConnection | None) -> None:
        """Forget `connection` if it is still the current one. aio-pika does not always
        mark a connection closed when its socket died, so a failure decides."""
        if connection is None or connection is not self._connection:
            return  # another send already replaced it
        self._connection, self._channel, self._exchange = None, None, None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(connection.close(), 1.0)

    # --- the rest of the Sink interface ---

    def check(self, timeout: float) -> str:
        """Connect, open a channel, and check that the exchange exists."""
        return self.run(self._check(), timeout)

    async def _check(self) -> str:
        connection = self._connection
        try:
            exchange = await self._ready_exchange()
            connection = self._connection
            if self._exchange_name and self._channel is not None:
                # Passive declare: fails (and closes the channel) if it does not exist.
                await self._channel.declare_exchange(self._exchange_name, passive=True)
        except Exception:
            # As after a failed send: a connection whose socket died is not always
            # marked closed, and a probe that kept it would fail for ever after the
            # node came back (a standby never able, a cut-off leader never replaced).
            await self._drop(connection)
            raise
        where = f"exchange {exchange.name!r}" if exchange.name else "the default exchange"
        return f"rabbitmq: connected to {self._where}, {where}"

    async def stop(self) -> None:
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.close()


def _where(url: str) -> str:
    parts = urlsplit(url)
    vhost = parts.path[1:] or "/"
    port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
    return f"{parts.hostname}:{port} vhost {vhost}"
