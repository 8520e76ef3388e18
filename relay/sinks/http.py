"""HTTP sink: one POST per message, keys in parallel, each key strictly in order.

The drain loop's `publish()` is synchronous; the requests run on an asyncio loop owned
by this sink (one thread, one pooled `httpx.AsyncClient`), so hundreds of keys can be
in flight without a thread each. Per key, the next message is sent only after the
previous one was acknowledged; once one fails, the rest of its key is `SKIPPED` and
goes out after the failed row is settled (backed off or dead-lettered).

Outcomes, from the endpoint's answer:
- 2xx: acknowledged, the row is marked sent.
- 408, 425, 429, 500 and other 5xx, timeouts, a connection dropped mid-request: `RETRY`
  (the row backs off; `Retry-After` is honoured).
- 502, 503, 504 and refused or failed connections, with ONE endpoint configured:
  `UNAVAILABLE` (the endpoint is down, not the message wrong): the whole sink backs off
  without spending attempts, so an outage does not dead-letter the outbox. With several
  endpoints (per-topic URLs on other hosts) they are `RETRY`: the down endpoint's rows
  back off on their own (spending attempts) and the other endpoints' rows keep flowing,
  even when the down one's backlog fills whole batches.
- Any other status (3xx, 4xx): `DEAD`, with the status and a bounded body snippet.

Long: a sink is one module by design (adding a sink touches one module): request
building and signing, classification of answers, and the per-key scheduling on the
sink's own event loop belong together.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import hmac
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TypeVar
from urllib.parse import quote

import httpx

from relay import __version__, metrics
from relay.logging import get_logger
from relay.message import MalformedRow, OutboxMessage
from relay.settings import Settings
from relay.sinks.base import ACKED, SKIPPED, Outcome, Result
from relay.sinks.http_settings import HEADER_TOKEN, configured_origins, signing_key

log = get_logger("relay.sinks.http")
T = TypeVar("T")

SNIPPET_CHARS = 200  # of a failed response body, kept in the dead-letter reason
_MAX_BODY_READ = 64 * 1024  # more than this of a response is not worth a connection
_RETRY_STATUSES = frozenset({408, 425, 429})
_DELTA_SECONDS = re.compile(r"[0-9]{1,10}")
# RFC 9110 field-value: visible ASCII and obs-text, inner spaces/tabs, no edge whitespace.
_FIELD_VALUE = re.compile(rb"[\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?")
_UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
# Never taken from a row: they describe the connection or the body, or are the relay's.
_NOT_FORWARDED = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "message-id",
        "message-topic",
        "message-key",
        "created-at",
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
    }
)


@dataclass(frozen=True, slots=True)
class Request:
    url: str
    headers: list[tuple[str, bytes]]
    body: bytes


def sign(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks `webhook-signature`: HMAC-SHA256 over `id.timestamp.body`."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def parse_retry_after(value: str | None, cap: float, now: datetime | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header (delta-seconds or an HTTP-date)."""
    if not value:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        seconds = float(value)
    else:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return min(max(seconds, 0.0), cap)


def snippet(body: bytes) -> str:
    text = body[: SNIPPET_CHARS * 4].decode("utf-8", errors="replace")
    text = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return text[:SNIPPET_CHARS] + ("..." if len(text) > SNIPPET_CHARS else "")


def classify_response(
    status: int,
    retry_after: str | None,
    body: bytes,
    retry_cap: float,
    also_retry: frozenset[int] = frozenset(),
) -> Result:
    if 200 <= status < 300:
        return ACKED
    text = f"HTTP {status}"
    if body:
        text += f": {snippet(body)}"
    if status in _UNAVAILABLE_STATUSES:
        return Result(
            Outcome.UNAVAILABLE, text, parse_retry_after(retry_after, retry_cap), reached=True
        )
    if status in _RETRY_STATUSES or status >= 500 or status in also_retry:
        return Result(Outcome.RETRY, text, parse_retry_after(retry_after, retry_cap), reached=True)
    return Result(Outcome.DEAD, text, reached=True)


def classify_error(exc: Exception) -> Result:
    """A request that got no HTTP answer. Refused or unreachable: the endpoint is down."""
    if isinstance(exc, httpx.LocalProtocolError):
        # Our own request was invalid; its message may quote a header (a secret).
        return Result(Outcome.DEAD, f"{type(exc).__name__}: request rejected by the client")
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return Result(Outcome.UNAVAILABLE, text)
    # Read/write timeouts and dropped connections: the endpoint may have processed it.
    return Result(Outcome.RETRY, text)


def _header_value(name: str, value: str) -> bytes:
    encoded = value.encode()
    if encoded and not _FIELD_VALUE.fullmatch(encoded):
        raise MalformedRow(
            f"header {name!r} is not a valid HTTP header value"
            " (control characters, or leading/trailing whitespace)"
        )
    return encoded


class RequestBuilder:
    """Turns a row into the request to send: URL, headers, body (no I/O, testable)."""

    def __init__(self, settings: Settings) -> None:
        self._default_url = settings.http_url
        self._topic_urls = settings.http_topic_urls
        self._content_type = settings.http_content_type
        self._allow = settings.http_forward_allowlist
        # A row may not replace what the relay sends on its own behalf (credentials).
        self._reserved = _NOT_FORWARDED | {settings.http_auth_header_name.lower(), "user-agent"}
        self._key = (
            signing_key(settings.http_signing_secret)
            if settings.http_signing_secret is not None
            else None
        )

    def url_for(self, topic: str) -> str:
        url = self._topic_urls.get(topic, self._default_url)
        if url is None:
            raise MalformedRow(
                f"no URL for topic {topic!r} (set RELAY_HTTP_URL or RELAY_HTTP_TOPIC_URLS)"
            )
        return url.replace("{topic}", quote(topic, safe=""))

    def build(self, message: OutboxMessage, timestamp: int | None = None) -> Request:
        body = message.payload or b""
        headers: list[tuple[str, bytes]] = []
        content_type = self._content_type
        for name, text in message.row_headers():
            lower = name.lower()
            if lower in self._reserved:
                continue
            if lower == "content-type":
                content_type = text  # the row's own content type always wins
                continue
            if self._allow is not None and lower not in self._allow:
                continue
            if not _is_token(name):
                raise MalformedRow(f"header name {name!r} is not a valid HTTP header name")
            headers.append((name, _header_value(name, text)))
        message_id = message.message_id
        headers.append(("content-type", _header_value("content-type", content_type)))
        headers.append(("message-id", message_id.encode()))
        headers.append(("message-topic", quote(message.topic, safe="").encode()))
        if message.key is not None:
            headers.append(("message-key", quote(message.key, safe="").encode()))
        headers.append(("created-at", message.created_at.encode()))
        if self._key is not None:
            ts = int(time.time()) if timestamp is None else timestamp
            headers.append(("webhook-id", message_id.encode()))
            headers.append(("webhook-timestamp", str(ts).encode()))
            headers.append(("webhook-signature", sign(self._key, message_id, ts, body).encode()))
        return Request(self.url_for(message.topic), headers, body)


def _is_token(name: str) -> bool:
    return HEADER_TOKEN.fullmatch(name) is not None


def ssl_context(settings: Settings) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=settings.http_ca_file)
    if not settings.http_tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if settings.http_client_cert_file:
        context.load_cert_chain(settings.http_client_cert_file, settings.http_client_key_file)
    return context


class HttpSink:
    name = "http"
    serial_per_key = True

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._builder = RequestBuilder(settings)
        self._ssl = ssl_context(settings)
        self._retry_cap = settings.retry_max_seconds
        self._also_retry = settings.http_retry_status_codes
        self._total_timeout = settings.http_timeout_seconds
        # identity: a compressed answer from a hostile endpoint cannot inflate in memory.
        self._static_headers: dict[str, str] = {
            "user-agent": f"relay/{__version__}",
            "accept-encoding": "identity",
        }
        self._single_endpoint = len(configured_origins(settings)) == 1
        if not settings.http_tls_verify:
            log.warning("http.tls_verify_disabled", reason="RELAY_HTTP_TLS_VERIFY=false")
        self._closed = False
        if settings.http_auth_header_value is not None:
            self._static_headers[settings.http_auth_header_name] = (
                settings.http_auth_header_value.get_secret_value()
            )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="relay-http", daemon=True
        )
        self._thread.start()
        self._client = self._on_loop(self._make_client()).result()

    async def _make_client(self) -> httpx.AsyncClient:
        limit = self._settings.http_max_in_flight
        return httpx.AsyncClient(
            verify=self._ssl,
            timeout=httpx.Timeout(
                connect=self._settings.http_connect_timeout_seconds,
                read=self._settings.http_read_timeout_seconds,
                write=self._settings.http_read_timeout_seconds,
                pool=self._settings.http_timeout_seconds,
            ),
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
            follow_redirects=False,  # a redirect is the endpoint's answer: dead-letter it
            headers=self._static_headers,
            trust_env=False,  # proxies come from settings, not a stray HTTP_PROXY
        )

    def _on_loop(self, coro: Coroutine[object, object, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # --- publishing ---

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        if self._closed:
            raise RuntimeError("HttpSink.publish() after close()")
        results: list[Result | None] = [None] * len(messages)
        done = threading.Event()
        future = self._on_loop(self._deliver(messages, results, done))
        while True:
            try:
                future.result(timeout=0.05)
                break
            except concurrent.futures.TimeoutError:
                if abandon():
                    # Lease gone or shutdown overdue: stop now. Requests cut off may
                    # still have landed; their rows stay unsent (a duplicate, never a loss).
                    future.cancel()
                    if not done.wait(2.0):
                        log.warning("http.cancel_slow", pending=results.count(None))
                    break
            except concurrent.futures.CancelledError:
                break
        return [SKIPPED if result is None else result for result in list(results)]

    async def _deliver(
        self,
        messages: Sequence[OutboxMessage],
        results: list[Result | None],
        done: threading.Event,
    ) -> None:
        chains: dict[str, list[int]] = {}
        for index, message in enumerate(messages):
            # A row without a key has no order to keep: it is a chain of its own.
            chain = message.key if message.key is not None else f"\0{index}"
            chains.setdefault(chain, []).append(index)
        slots = asyncio.Semaphore(self._settings.http_max_in_flight)
        # A key with many rows must not hold the batch (and every other key's acks)
        # for rows x latency: past this, no new request starts; the rest go next batch.
        stop_starting = time.monotonic() + self._total_timeout
        try:
            async with asyncio.TaskGroup() as group:
                for indexes in chains.values():
                    group.create_task(
                        self._deliver_chain(messages, indexes, results, slots, stop_starting)
                    )
        finally:
            done.set()

    async def _deliver_chain(
        self,
        messages: Sequence[OutboxMessage],
        indexes: list[int],
        results: list[Result | None],
        slots: asyncio.Semaphore,
        stop_starting: float,
    ) -> None:
        for index in indexes:
            if time.monotonic() > stop_starting:
                return  # left SKIPPED: unsent, untouched, first in the next batch
            async with slots:
                # Again once a slot is ours: against an endpoint that never answers,
                # the wait for a slot is itself a request timeout, and starting then
                # would stretch the batch by one timeout per round of slots.
                if time.monotonic() > stop_starting:
                    return
                result = await self._send(messages[index])
            results[index] = result
            if result.outcome is not Outcome.ACKED:
                return  # the rest of this key waits for this row to be settled

    async def _send(self, message: OutboxMessage) -> Result:
        try:
            request = self._builder.build(message)
        except MalformedRow as exc:
            return Result(Outcome.DEAD, str(exc))
        except UnicodeError:
            return Result(Outcome.DEAD, "a header cannot be encoded")
        result = await self._post(request)
        if result.outcome is Outcome.UNAVAILABLE and not self._single_endpoint:
            # One endpoint among several: its outage must not pause the others.
            return Result(Outcome.RETRY, result.error, result.retry_after, reached=result.reached)
        return result

    async def _post(self, request: Request) -> Result:
        started = time.monotonic()
        status = "error"
        try:
            async with asyncio.timeout(self._total_timeout):
                response = await self._client.send(
                    self._client.build_request(
                        "POST",
                        request.url,
                        headers=[(name.encode(), value) for name, value in request.headers],
                        content=request.body,
                    ),
                    stream=True,
                )
                try:
                    status = str(response.status_code)
                    if response.is_success:
                        return ACKED  # decided by the status line; the body is not needed
                    body = await _read_capped(response)
                finally:
                    await response.aclose()
            return classify_response(
                response.status_code,
                response.headers.get("retry-after"),
                body,
                self._retry_cap,
                self._also_retry,
            )
        except TimeoutError:
            status = "timeout"
            return Result(Outcome.RETRY, f"no answer within {self._total_timeout:g}s")
        except httpx.TimeoutException as exc:
            status = "timeout"
            return classify_error(exc)
        except httpx.HTTPError as exc:
            status = "connect_error" if isinstance(exc, httpx.ConnectError) else "error"
            return classify_error(exc)
        except Exception as exc:
            # A bug here must not take the other keys' requests down with it. The
            # message of an unknown error may quote a header: only its type is kept.
            log.exception("http.unexpected_error", error_type=type(exc).__name__)
            return Result(Outcome.RETRY, f"unexpected error: {type(exc).__name__}")
        finally:
            metrics.HTTP_REQUESTS.labels(status).inc()
            metrics.HTTP_REQUEST_SECONDS.observe(time.monotonic() - started)

    # --- the rest of the Sink interface ---

    def check(self, timeout: float) -> str:
        """Open a TCP (and TLS) connection to every configured endpoint."""
        reached: list[str] = []
        for scheme, host, port in sorted(configured_origins(self._settings)):
            with socket.create_connection((host, port), timeout=timeout) as sock:
                if scheme == "https":
                    with self._ssl.wrap_socket(sock, server_hostname=host):
                        pass
            reached.append(f"{scheme}://{host}:{port}")
        return "http: reachable " + ", ".join(reached)

    def flush(self, timeout: float) -> int:
        return 0  # publish() returns only when every request has an outcome

    def reset(self) -> None:
        return  # nothing outlives a publish() call

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._on_loop(self._wind_down()).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _wind_down(self) -> None:
        """Cancel what an abandoned publish left running, then close the pool."""
        current = asyncio.current_task()
        leftovers = [task for task in asyncio.all_tasks() if task is not current]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        await self._client.aclose()


async def _read_capped(response: httpx.Response) -> bytes:
    """The body, or its first 64 KiB: an endpoint's essay is not worth reading whole."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        chunks.append(chunk)
        size += len(chunk)
        if size >= _MAX_BODY_READ:
            break
    return b"".join(chunks)
