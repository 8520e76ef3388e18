"""HTTP sink: one POST per message, keys in parallel, each key strictly in order.

Requests run on the sink's own asyncio loop through one pooled `httpx.AsyncClient`;
`KeyedSink` schedules them: per key, the next message is sent only after the previous
one was acknowledged; once one fails, the rest of its key is `SKIPPED` and goes out
after the failed row is settled (backed off or dead-lettered).

Outcomes, from the endpoint's answer:
- 2xx: acknowledged, the row is marked sent.
- 408, 425, 429, 500 and other 5xx, timeouts, a connection dropped mid-request: `RETRY`
  (the row backs off; `Retry-After` is honoured).
- 429 or 503 with a `Retry-After`: the origin (scheme, host, port) asked for a pause,
  and it is paused as a whole (`budgets`): no attempt is spent, its rows wait it
  out, other origins go on. Each origin's rate limit is kept there too.
- 502, 503, 504 and refused or failed connections, with ONE endpoint configured:
  `UNAVAILABLE` (the endpoint is down, not the message wrong): the whole sink backs off
  without spending attempts, so an outage does not dead-letter the outbox. With several
  endpoints (per-topic URLs on other hosts) they are `RETRY`: the down endpoint's rows
  back off on their own (spending attempts) and the other endpoints' rows keep flowing,
  even when the down one's backlog fills whole batches.
- Any other status (3xx, 4xx): `DEAD`, with the status and a bounded body snippet.

What a row decides is bounded: its topic fills `{topic}` as one path segment (a topic
that would make an empty or dot segment, and so another path, is `DEAD`), and the
credentials a request carries are its destination's (`destinations.destinations`),
never another's.

Long: a sink is one module by design (adding a sink touches its own modules only):
request building and signing and the classification of answers belong together.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit

import httpx
from prometheus_client import Counter, Histogram

from relay import __version__
from relay.message import MalformedRow, OutboxMessage
from relay.observe.logging import get_logger
from relay.observe.metrics import LATENCY_BUCKETS
from relay.settings import Settings
from relay.sinks.base import ACKED, Outcome, Result
from relay.sinks.cloudevents import CloudEvents, is_attribute_header, percent_encoded
from relay.sinks.http.budgets import OriginBudgets
from relay.sinks.http.destinations import (
    Destination,
    Origin,
    configured_origins,
    destinations,
    origin_limits,
    url_origin,
)
from relay.sinks.http.settings import HEADER_TOKEN, HttpSettings, signing_key
from relay.sinks.keyed import Batch, KeyedSink, Turn

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from relay.observe.tracing import Tracing
    from relay.sinks.http.tracing import RequestSpans

log = get_logger("relay.sinks.http")

REQUESTS = Counter(
    "relay_http_requests_total",
    "HTTP sink requests by response status code, or timeout / connect_error / error.",
    ["status"],
)
REQUEST_SECONDS = Histogram(
    "relay_http_request_duration_seconds",
    "HTTP sink request time, connect to last byte of the response read.",
    buckets=LATENCY_BUCKETS,
)

SNIPPET_CHARS = 200  # of a failed response body, kept in the dead-letter reason
_MAX_BODY_READ = 64 * 1024  # more than this of a response is not worth a connection
_RETRY_STATUSES = frozenset({408, 425, 429})
_DELTA_SECONDS = re.compile(r"[0-9]{1,10}")
# RFC 9110 field-value: visible ASCII and obs-text, inner spaces/tabs, no edge whitespace.
_FIELD_VALUE = re.compile(rb"[\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?")
_UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
# With a Retry-After, these speak for the whole origin: it is paused, no attempt spent.
_PAUSE_STATUSES = frozenset({429, 503})
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
    headers: list[tuple[str, bytes]] = field(repr=False)  # the credentials among them
    body: bytes
    origin: Origin | None = None  # whose budget it spends


_TOPIC = "{topic}"
# Path segments that are no segment of their own, as written or once decoded: clients
# and servers resolve "." and ".." away (RFC 3986 5.2.4); an empty one is no topic.
_NOT_SEGMENTS = frozenset({"", ".", ".."})
# Many receivers and proxies decode %2F (and some a second time, a proxy then the app)
# before they route: a topic must not hold a dot segment once decoded either.
_DECODINGS = 2
_DOTS = frozenset({".", ".."})
_SEPARATORS = re.compile(r"[/\\]")
_SHOWN_TOPIC_CHARS = 100


class UrlTemplate:
    """A destination URL with `{topic}` in it, filled so that a row's topic stays one
    path segment: quoted (no `/`, `?` or `#` of its own), never a segment the client
    resolves to another path, and checked against the path the client would send."""

    def __init__(self, template: str) -> None:
        self._template = template
        self._in_path = tuple(s for s in urlsplit(template).path.split("/") if _TOPIC in s)
        # The path the client sends for the template, around each `{topic}`.
        token = _placeholder(template)
        self._sent_parts = _sent_path(template.replace(_TOPIC, token)).split(token)

    def fill(self, topic: str) -> str:
        quoted = quote(topic, safe="")
        url = self._template.replace(_TOPIC, quoted)
        if self._in_path:
            self._check_path(topic, quoted, url)
        return url

    def _check_path(self, topic: str, quoted: str, url: str) -> None:
        for segment in self._in_path:
            text = segment.replace(_TOPIC, quoted)
            if unquote(text) in _NOT_SEGMENTS:
                raise MalformedRow(
                    f"topic {_shown(topic)} cannot go in the URL path: it would make an"
                    " empty, '.' or '..' segment, which changes the path"
                )
            for _ in range(_DECODINGS):
                text = unquote(text)
                if _DOTS.intersection(_SEPARATORS.split(text)):
                    raise MalformedRow(
                        f"topic {_shown(topic)} cannot go in the URL path: decoded, as many"
                        " receivers do, it holds a '.' or '..' segment, which climbs the path"
                    )
        if _sent_path(url) != quoted.join(self._sent_parts):
            raise MalformedRow(f"topic {_shown(topic)} would change the URL path sent")


def _placeholder(template: str) -> str:
    """A stand-in for the topic that the template does not hold, of characters that
    quoting and the client leave as they are."""
    n = 0
    while f"relaytopic{n}" in template:
        n += 1
    return f"relaytopic{n}"


def _sent_path(url: str) -> str:
    """The request target the client sends for `url` (dot segments resolved); a URL
    the client refuses (a topic tens of kilobytes long) is the row's fault."""
    try:
        return httpx.URL(url).raw_path.decode("ascii")
    except httpx.InvalidURL as exc:
        raise MalformedRow(f"the URL for this topic is invalid: {exc}") from None


def _shown(topic: str) -> str:
    """A topic for a dead-letter reason: a row's topic can be of any length."""
    if len(topic) <= _SHOWN_TOPIC_CHARS:
        return repr(topic)
    return repr(topic[:_SHOWN_TOPIC_CHARS]) + "..."


@dataclass(frozen=True, slots=True)
class _Route:
    """A destination ready to send to: its URL, and the credentials that go there."""

    url: UrlTemplate
    credentials: tuple[tuple[str, bytes], ...]  # the auth header, if any
    key: bytes | None  # the signing key, if any
    origin: Origin


def _route(destination: Destination) -> _Route:
    credentials: tuple[tuple[str, bytes], ...] = ()
    if destination.auth is not None:
        name, value = destination.auth
        credentials = ((name, value.get_secret_value().encode()),)
    key = None if destination.signing_secret is None else signing_key(destination.signing_secret)
    return _Route(UrlTemplate(destination.url), credentials, key, url_origin(destination.url))


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
    if not (status in _RETRY_STATUSES or status >= 500 or status in also_retry):
        return Result(Outcome.DEAD, text, reached=True)
    seconds = parse_retry_after(retry_after, retry_cap)
    # A pause asked for: the origin's, not this row's fault (0 asks for none).
    pause = status in _PAUSE_STATUSES and bool(seconds)
    outcome = Outcome.UNAVAILABLE if status in _UNAVAILABLE_STATUSES else Outcome.RETRY
    return Result(outcome, text, seconds, collateral=pause, reached=True)


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

    def __init__(self, settings: HttpSettings, cloudevents: CloudEvents | None = None) -> None:
        self._cloudevents = cloudevents
        self._content_type = settings.http_content_type
        self._allow = settings.http_forward_allowlist
        found = destinations(settings)
        # A row may not replace what the relay sends on its own behalf (credentials),
        # whichever destination it goes to.
        auth_names = {d.auth[0].lower() for d in found.values() if d.auth is not None}
        self._reserved = (
            _NOT_FORWARDED | auth_names | {settings.http_auth_header_name.lower(), "user-agent"}
        )
        default = found.pop(None, None)
        self._default = None if default is None else _route(default)
        self._routes = {topic: _route(d) for topic, d in found.items() if topic is not None}

    def url_for(self, topic: str) -> str:
        return self._route_for(topic).url.fill(topic)

    def origin_of(self, topic: str) -> Origin | None:
        """The origin a row of `topic` goes to; None if none (it is dead-lettered)."""
        route = self._routes.get(topic, self._default)
        return None if route is None else route.origin

    def _route_for(self, topic: str) -> _Route:
        route = self._routes.get(topic, self._default)
        if route is None:
            raise MalformedRow(
                f"no URL for topic {_shown(topic)} (set RELAY_HTTP_URL or RELAY_HTTP_TOPIC_URLS)"
            )
        return route

    def build(self, message: OutboxMessage, timestamp: int | None = None) -> Request:
        route = self._route_for(message.topic)
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
            if self._cloudevents is not None and is_attribute_header(lower):
                continue  # the relay's attributes, not a row's look-alikes
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
        if self._cloudevents is not None:
            headers.extend(cloudevents_headers(self._cloudevents, message))
        headers.extend(route.credentials)
        if route.key is not None:
            ts = int(time.time()) if timestamp is None else timestamp
            headers.append(("webhook-id", message_id.encode()))
            headers.append(("webhook-timestamp", str(ts).encode()))
            headers.append(("webhook-signature", sign(route.key, message_id, ts, body).encode()))
        return Request(route.url.fill(message.topic), headers, body, route.origin)


def cloudevents_headers(
    cloudevents: CloudEvents, message: OutboxMessage
) -> list[tuple[str, bytes]]:
    """The HTTP binding: `ce-` headers, values percent-encoded where needed (3.1.3.2)."""
    return [
        ("ce-" + name, percent_encoded(value).encode("ascii"))
        for name, value in cloudevents.attributes(message)
    ]


def _is_token(name: str) -> bool:
    return HEADER_TOKEN.fullmatch(name) is not None


def ssl_context(settings: Settings) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=settings.sink_tls_ca_file)
    if not settings.http_tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if settings.sink_tls_cert_file:
        context.load_cert_chain(settings.sink_tls_cert_file, settings.sink_tls_key_file)
    return context


DEFAULT_TIMEOUT_SECONDS = 30.0  # RELAY_SINK_TIMEOUT_SECONDS unset
DEFAULT_MAX_IN_FLIGHT = 16  # RELAY_SINK_MAX_IN_FLIGHT unset
CONNECT_TIMEOUT_SECONDS = 5.0  # TCP and TLS; never past the whole request's timeout
# How long sending a request or reading its answer may go without a byte moving; never
# past the whole request's timeout (RELAY_SINK_TIMEOUT_SECONDS).
IDLE_TIMEOUT_SECONDS = 10.0


class HttpSink(KeyedSink):
    name = "http"

    def __init__(self, settings: Settings, tracing: Tracing | None = None) -> None:
        options = settings.sink_options(HttpSettings)
        self._options = options
        self._builder = RequestBuilder(options, CloudEvents.from_settings(settings))
        self._spans = _request_spans(tracing)  # RELAY_TRACING: a span per request
        self._ssl = ssl_context(settings)
        self._retry_cap = settings.retry_max_seconds
        self._also_retry = options.http_retry_status_codes
        self._total_timeout = settings.sink_timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        self._max_in_flight = settings.sink_max_in_flight or DEFAULT_MAX_IN_FLIGHT
        # identity: a compressed answer from a hostile endpoint cannot inflate in memory.
        # Credentials are per destination: RequestBuilder adds them to each request.
        self._static_headers: dict[str, str] = {
            "user-agent": f"relay/{__version__}",
            "accept-encoding": "identity",
        }
        self._single_endpoint = len(configured_origins(options)) == 1
        self._budgets = OriginBudgets(
            origin_limits(options),
            lambda message: self._builder.origin_of(message.topic),
            single=self._single_endpoint,
            retry_cap=self._retry_cap,
        )
        if not options.http_tls_verify:
            log.warning("http.tls_verify_disabled", reason="RELAY_HTTP_TLS_VERIFY=false")
        super().__init__(max_in_flight=self._max_in_flight, batch_seconds=self._total_timeout)
        self._client = self.run(self._make_client(), timeout=30)

    async def _make_client(self) -> httpx.AsyncClient:
        limit = self._max_in_flight
        return httpx.AsyncClient(
            verify=self._ssl,
            timeout=httpx.Timeout(
                connect=min(CONNECT_TIMEOUT_SECONDS, self._total_timeout),
                read=min(IDLE_TIMEOUT_SECONDS, self._total_timeout),
                write=min(IDLE_TIMEOUT_SECONDS, self._total_timeout),
                pool=self._total_timeout,
            ),
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
            follow_redirects=False,  # a redirect is the endpoint's answer: dead-letter it
            headers=self._static_headers,
            trust_env=False,  # proxies come from settings, not a stray HTTP_PROXY
        )

    # --- publishing (KeyedSink schedules the keys) ---

    async def turn(self, message: OutboxMessage, batch: Batch) -> Result | Turn:
        return await self._budgets.turn(message, batch)

    async def send(self, message: OutboxMessage) -> Result:
        try:
            request = self._builder.build(message)
        except MalformedRow as exc:
            return Result(Outcome.DEAD, str(exc))
        except UnicodeError:
            return Result(Outcome.DEAD, "a header cannot be encoded")
        held = await self._budgets.starting(request.origin)
        if held is not None:
            return held
        if self._spans is None:
            result = await self._post(request)
        else:
            with self._spans.request(message, request.url, request.headers) as (span, headers):
                result = await self._post(Request(request.url, headers, request.body), span)
                self._spans.answered(span, result)
        result = self._budgets.answered(request.origin, result)
        if (
            result.outcome is Outcome.UNAVAILABLE
            and not result.collateral
            and not self._single_endpoint
        ):
            # One endpoint among several: its outage must not pause the others.
            return Result(Outcome.RETRY, result.error, result.retry_after, reached=result.reached)
        return result

    async def _post(self, request: Request, span: Span | None = None) -> Result:
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
                    if span is not None:
                        span.set_attribute("http.response.status_code", response.status_code)
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
        finally:
            REQUESTS.labels(status).inc()
            REQUEST_SECONDS.observe(time.monotonic() - started)

    # --- the rest of the Sink interface ---

    def check(self, timeout: float) -> str:
        """Open a TCP (and TLS) connection to every configured endpoint."""
        reached: list[str] = []
        for scheme, host, port in sorted(configured_origins(self._options)):
            with socket.create_connection((host, port), timeout=timeout) as sock:
                if scheme == "https":
                    with self._ssl.wrap_socket(sock, server_hostname=host):
                        pass
            reached.append(f"{scheme}://{host}:{port}")
        return "http: reachable " + ", ".join(reached)

    async def stop(self) -> None:
        await self._client.aclose()


def _request_spans(tracing: Tracing | None) -> RequestSpans | None:
    """A span per request with RELAY_TRACING, else None: OpenTelemetry is imported
    only then."""
    if tracing is None:
        return None
    from relay.sinks.http.tracing import RequestSpans

    return RequestSpans(tracing)


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
