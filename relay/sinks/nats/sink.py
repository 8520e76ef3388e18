"""NATS JetStream sink on nats-py: one publish per message, delivered on its PubAck.

Each message carries `Nats-Msg-Id` = its message id, so JetStream's duplicate window
drops what the relay sends again after a crash between the ack and the mark: within
that window a stream holds every row once. Per key, the next publish starts only after
the previous one was acknowledged (`KeyedSink`), so a refused message is never
overtaken by a later one of its key.

Outcomes:
- PubAck: acknowledged (a `duplicate` ack too: the stream already has it).
- No stream bound to the subject (the publish had no responders and JetStream confirms
  no stream takes the subject), an invalid subject or header, a payload over the
  server's limit, a 400 from JetStream: `DEAD`, with the reason.
- Not connected, no ack within RELAY_SINK_TIMEOUT_SECONDS, a 503 from
  JetStream, no responders while a stream does take the subject (a server still
  recovering its streams): `UNAVAILABLE` (rows untouched, no attempt spent, the drain
  backs off).
  A publish that timed out may have been stored: sent again, the duplicate window
  drops it.
- Any other JetStream error (a stream full under `discard: new`, a 500): `RETRY`.

Long: the connection, the publishes and the reading of JetStream's answers share
one client and its state; the settings are apart (settings.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from typing import TYPE_CHECKING, Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client import Counter

from relay.message import MalformedRow, OutboxMessage
from relay.observe.logging import get_logger
from relay.settings import Settings
from relay.sinks.base import ACKED, Outcome, Result
from relay.sinks.cloudevents import CloudEvents, is_attribute_header, percent_encoded
from relay.sinks.keyed import KeyedSink
from relay.sinks.nats.settings import NatsSettings, nats_servers, subject_problem
from relay.sinks.settings import tls_files

if TYPE_CHECKING:  # loaded only with RELAY_TRACING (the otel extra)
    from relay.observe.tracing import Tracing

log = get_logger("relay.sinks.nats")

_CONNECT_BACKOFF_SECONDS = 0.5  # while the server is down, one connect attempt per this

DUPLICATES = Counter(
    "relay_nats_duplicates_total",
    "Publishes JetStream acknowledged as duplicates (Nats-Msg-Id seen within the stream's "
    "duplicate window): a message sent again after a crash or timeout, stored once.",
)
PUBLISH_ERRORS = Counter(
    "relay_nats_publish_errors_total", "JetStream publishes that failed, by kind.", ["kind"]
)

# Names the relay sets itself; a row's header of the same name is not forwarded.
_OWN_HEADERS = frozenset({"nats-msg-id", "message-id", "created-at", "message-key"})


def headers_for(message: OutboxMessage, cloudevents: CloudEvents | None = None) -> dict[str, str]:
    """The row's headers plus the relay's, as NATS headers (MIME-style text lines)."""
    headers: dict[str, str] = {}
    for name, value in message.row_headers():
        if name.lower() in _OWN_HEADERS or name.lower().startswith("nats-"):
            continue  # Nats-* headers steer JetStream (expected stream, TTL): not the app's
        if cloudevents is not None and is_attribute_header(name):
            continue
        if not name or any(ch in name for ch in ": \t\r\n") or not name.isprintable():
            raise MalformedRow(f"header name {name!r} is not a valid NATS header name")
        if "\r" in value or "\n" in value:
            raise MalformedRow(f"header {name!r} has a line break in its value")
        headers[name] = value
    headers["message-id"] = message.message_id
    headers["created-at"] = message.created_at
    if message.key is not None:
        if "\r" in message.key or "\n" in message.key:
            raise MalformedRow("the key has a line break: it cannot travel as a header")
        headers["message-key"] = message.key
    headers["Nats-Msg-Id"] = message.message_id
    if cloudevents is not None:
        headers.update(cloudevents_headers(cloudevents, message))
    return headers


def cloudevents_headers(cloudevents: CloudEvents, message: OutboxMessage) -> dict[str, str]:
    """The NATS binding's binary mode (NATS 2.2+ headers): as HTTP's, `ce-` and values
    percent-encoded, with the content type as `ce-datacontenttype` too (NATS has no
    content type of its own)."""
    headers = {
        "ce-" + name: percent_encoded(value) for name, value in cloudevents.attributes(message)
    }
    content_type = cloudevents.datacontenttype(message)
    if content_type is not None:
        headers["ce-datacontenttype"] = percent_encoded(content_type)
    return headers


def classify(exc: Exception) -> Result:
    """A publish that got no PubAck."""
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        PUBLISH_ERRORS.labels("no_stream").inc()
        return Result(Outcome.DEAD, "no JetStream stream takes this subject", reached=True)
    if isinstance(exc, nats.errors.MaxPayloadError):
        PUBLISH_ERRORS.labels("too_large").inc()
        return Result(Outcome.DEAD, f"message larger than the server's max_payload: {exc}")
    if isinstance(exc, nats.errors.BadSubjectError | nats.errors.BadHeaderError):
        PUBLISH_ERRORS.labels("invalid").inc()
        return Result(Outcome.DEAD, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        PUBLISH_ERRORS.labels("unavailable").inc()
        return Result(Outcome.UNAVAILABLE, f"JetStream unavailable: {exc}", reached=True)
    if isinstance(exc, nats.js.errors.BadRequestError):
        PUBLISH_ERRORS.labels("rejected").inc()
        return Result(Outcome.DEAD, f"JetStream refused it: {exc}", reached=True)
    if isinstance(exc, nats.js.errors.APIError):
        PUBLISH_ERRORS.labels("rejected").inc()
        return Result(Outcome.RETRY, f"JetStream refused it: {exc}", reached=True)
    if isinstance(exc, asyncio.TimeoutError):  # nats.errors.TimeoutError is one
        PUBLISH_ERRORS.labels("timeout").inc()
        return Result(Outcome.UNAVAILABLE, "no acknowledgement in time")
    PUBLISH_ERRORS.labels("connection").inc()
    return Result(Outcome.UNAVAILABLE, f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc))


DEFAULT_TIMEOUT_SECONDS = 5.0  # RELAY_SINK_TIMEOUT_SECONDS unset
DEFAULT_MAX_IN_FLIGHT = 64  # RELAY_SINK_MAX_IN_FLIGHT unset


class NatsSink(KeyedSink):
    name = "nats"

    def __init__(self, settings: Settings, tracing: Tracing | None = None) -> None:
        options = settings.sink_options(NatsSettings)
        self._options = options
        self._cloudevents = CloudEvents.from_settings(settings)
        self._client_name = f"relay-{settings.lease_name}"
        self._timeout = settings.sink_timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        self._topic_map = settings.topic_map
        self._tls = tls_files(settings)
        assert options.nats_url is not None  # required by the registry's rule
        self._servers = nats_servers(options.nats_url)
        self._subjects: dict[str, str] = {}  # outbox topic -> validated subject
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._connecting: asyncio.Lock | None = None
        self._retry_at = 0.0  # monotonic: no connect attempt before, after a failed one
        self._last_error = ""
        self._connect_failures: list[Exception] | None = None
        self._closing = False
        super().__init__(
            max_in_flight=settings.sink_max_in_flight or DEFAULT_MAX_IN_FLIGHT,
            batch_seconds=max(10.0, 3 * self._timeout),
        )

    def subject_for(self, message: OutboxMessage) -> str:
        subject = self._subjects.get(message.topic)
        if subject is None:
            subject = self._topic_map.get(message.topic, message.topic)
            problem = subject_problem(subject)
            if problem:
                raise MalformedRow(problem)
            if len(self._subjects) < 10_000:  # bounded: topics come from app rows
                self._subjects[message.topic] = subject
        return subject

    # --- the connection, opened on first use and kept reconnecting by nats-py ---

    async def _jetstream(self) -> JetStreamContext:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._nc is not None and self._nc.is_closed:
                self._nc, self._js = None, None  # closed for good (say, auth): start over
            if self._js is None:
                if time.monotonic() < self._retry_at:
                    raise ConnectionError(self._last_error)
                self._nc = await self._connect()
                self._js = self._nc.jetstream(timeout=self._timeout)
            return self._js

    async def _connect(self) -> Client:
        """The first connection. nats-py would try forever (it must reconnect forever
        once connected): here it ends once every server refused, or at the timeout,
        so a publish or a probe gets its answer."""
        failures = self._connect_failures = []
        client = Client()
        attempt = asyncio.ensure_future(client.connect(**self._connect_options()))
        deadline = time.monotonic() + self._timeout
        try:
            while not attempt.done():
                if len(failures) >= len(self._servers) or time.monotonic() > deadline:
                    attempt.cancel()
                    with contextlib.suppress(BaseException):
                        await attempt
                    last = failures[-1] if failures else TimeoutError("no answer")
                    raise ConnectionError(f"{type(last).__name__}: {last}")
                await asyncio.wait({attempt}, timeout=0.05)
            attempt.result()
            self._connect_failures = None
        except BaseException as exc:
            self._connect_failures = None
            self._retry_at = time.monotonic() + _CONNECT_BACKOFF_SECONDS
            self._last_error = f"{exc}" if isinstance(exc, ConnectionError) else repr(exc)
            with contextlib.suppress(Exception):
                await client.close()
            raise
        url = client.connected_url
        log.info("nats.connected", server=f"{url.hostname}:{url.port}" if url else "?")
        return client

    def _connect_options(self) -> dict[str, Any]:
        o = self._options
        ca_file, cert_file, key_file = self._tls
        tls: ssl.SSLContext | None = None
        if ca_file or cert_file or any(server.startswith("tls://") for server in self._servers):
            tls = ssl.create_default_context(cafile=ca_file)
            if cert_file:
                tls.load_cert_chain(cert_file, key_file)
        options: dict[str, Any] = {
            "servers": self._servers,
            "name": self._client_name,
            "connect_timeout": min(self._timeout, 5.0),
            # Once connected, nats-py reconnects forever in the background; publishes
            # meanwhile fail fast (`send`).
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
        }
        if tls is not None:
            options["tls"] = tls
        if o.nats_creds_file:
            options["user_credentials"] = o.nats_creds_file
        return options

    async def _on_error(self, exc: Exception) -> None:
        if self._connect_failures is not None:  # a first connect is counting its misses
            self._connect_failures.append(exc)
        log.debug("nats.client_error", error=f"{type(exc).__name__}: {exc}")

    async def _on_disconnected(self) -> None:
        # Not a first connect giving up, nor our own close.
        if self._connect_failures is None and not self._closing:
            log.warning("nats.disconnected")

    async def _on_reconnected(self) -> None:
        log.info("nats.reconnected")

    # --- publishing (KeyedSink schedules the keys) ---

    async def send(self, message: OutboxMessage) -> Result:
        try:
            subject = self.subject_for(message)
            headers = headers_for(message, self._cloudevents)
        except MalformedRow as exc:
            return Result(Outcome.DEAD, str(exc))
        try:
            js = await self._jetstream()
        except Exception as exc:
            return Result(Outcome.UNAVAILABLE, f"cannot connect to NATS: {exc}")
        if self._nc is None or not self._nc.is_connected:
            # Reconnecting: nats-py would buffer the publish until then; report now
            # and let the drain loop back off instead.
            return Result(Outcome.UNAVAILABLE, "not connected to NATS (reconnecting)")
        try:
            ack = await js.publish(
                subject, message.payload or b"", timeout=self._timeout, headers=headers
            )
        except nats.js.errors.NoStreamResponseError as exc:
            return await self._no_responders(js, subject, exc)
        except Exception as exc:
            return classify(exc)
        if ack.duplicate:
            DUPLICATES.inc()
        return ACKED

    async def _no_responders(self, js: JetStreamContext, subject: str, exc: Exception) -> Result:
        """Nobody answered the publish: no stream takes the subject (the message's
        fault: dead-letter it), or JetStream is not serving yet (a server restarting
        recovers its streams after it accepts clients; a cluster electing a stream
        leader): unavailable. Ask JetStream which it is."""
        try:
            await js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return classify(exc)  # JetStream answered: no stream for it
        except Exception as probe:
            PUBLISH_ERRORS.labels("unavailable").inc()
            return Result(Outcome.UNAVAILABLE, f"JetStream not answering: {type(probe).__name__}")
        PUBLISH_ERRORS.labels("unavailable").inc()
        return Result(
            Outcome.UNAVAILABLE,
            "the subject's stream exists but did not answer (starting up, or electing a leader)",
            reached=True,
        )

    # --- the rest of the Sink interface ---

    def check(self, timeout: float) -> str:
        """Connect (if not yet) and ask JetStream for the account's figures."""
        return self.run(self._check(), timeout)

    async def _check(self) -> str:
        js = await self._jetstream()
        info = await js.account_info()
        url = self._nc.connected_url if self._nc is not None else None
        where = f"{url.hostname}:{url.port}" if url else "?"
        return f"nats: connected to {where}, JetStream with {info.streams} stream(s)"

    async def stop(self) -> None:
        self._closing = True
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
