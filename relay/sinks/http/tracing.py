"""The HTTP sink's span per request (RELAY_TRACING): `POST`, a CLIENT span that is a
child of the message's own trace context, whose context the request carries on as its
`traceparent` (the row's replaced), so the endpoint's work joins the app's trace under
the relay's request.

Imported only with tracing on (`http._request_spans`): it imports OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.trace import Span, SpanKind

from relay.message import OutboxMessage
from relay.observe.tracing import TRACE_HEADERS, Tracing
from relay.sinks.base import Outcome, Result


class RequestSpans:
    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing

    @contextmanager
    def request(
        self, message: OutboxMessage, url: str, headers: list[tuple[str, bytes]]
    ) -> Iterator[tuple[Span, list[tuple[str, bytes]]]]:
        """The request's span, current while the block runs; yields it and the
        request's headers with its own trace context in place of the row's."""
        parts = urlsplit(url)
        # Not url.full: webhook URLs often carry a token (RELAY_HTTP_URL is a secret),
        # and a tracing backend is read by more people than the relay's settings.
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "url.scheme": parts.scheme,
            "server.address": parts.hostname or "",
            "messaging.message.id": message.message_id,
        }
        if parts.port is not None:
            attributes["server.port"] = parts.port
        with self._tracing.tracer.start_as_current_span(
            "POST",
            context=self._tracing.context_of(message),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        ) as span:
            sent = [(n, v) for n, v in headers if n.lower() not in TRACE_HEADERS]
            sent.extend(
                (name, value.encode()) for name, value in self._tracing.trace_headers().items()
            )
            yield span, sent

    @staticmethod
    def answered(span: Span, result: Result) -> None:
        """Mark the span failed unless the endpoint accepted the message (inside the
        block: an ended span takes no status)."""
        if result.outcome is not Outcome.ACKED:
            Tracing.failed(span, result.error or "not accepted", result.outcome.value)
