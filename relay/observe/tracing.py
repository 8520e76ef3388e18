"""OpenTelemetry tracing, opt-in (RELAY_TRACING=true; the `otel` extra).

The relay joins the app's traces without a span per message: the W3C trace context a
row carries (`traceparent`, `tracestate` headers, which `relay.enqueue` writes when the
app has a span) travels on to the consumer in the message's headers, as every sink
forwards a row's headers. The relay adds one span per published batch, `publish
<topic>` (PRODUCER), *linked* to the trace of each message in it (a link costs a few
dozen bytes in one export; a span per message would cost a span's whole life cycle per
row), with events for when the batch was fetched and acknowledged, and handed to the
settle. A sink may add spans of its own (the HTTP sink: one per request, in
relay/sinks/http/tracing.py) from `tracer`, a row's `context_of` and `trace_headers`.

The exporter is OTLP over HTTP, configured by the standard OTEL_* variables
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_BSP_*...). Off, nothing here is
imported and the drain loop pays one `is None` test per batch.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from relay import __version__
from relay.errors import SettingsError
from relay.message import OutboxMessage
from relay.observe.logging import library_logger

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanContext, Tracer

    from relay.settings import Settings

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
_lock = threading.Lock()
_made: list[Tracing] = []  # the process's one Tracing, once made


def configure(settings: Settings) -> Tracing | None:
    """The process's tracing, made once (every lane's loop and sink share it)."""
    if not settings.tracing:
        return None
    with _lock:
        if not _made:
            _made.append(Tracing(settings.sink, settings.batch_size))
        return _made[0]


def shutdown(timeout: float = 3.0) -> None:
    """Export what is buffered (at the end of `relay run`), waiting `timeout` at most:
    with the collector down the SDK would retry for 30 s, past the pod's grace period."""
    with _lock:
        while _made:
            stopping = threading.Thread(
                target=_made.pop().shutdown, name="relay-otel-shutdown", daemon=True
            )
            stopping.start()
            stopping.join(timeout)


# W3C trace context: version-traceid-parentid-flags; a future version (not ff) may add
# fields after these, which a reader of version 00 ignores.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?")


def _span_context(traceparent: str) -> SpanContext | None:
    """The span context a `traceparent` value names, read directly: a batch span links
    every message, and the propagator's Context per row cost more than the rest of the
    link. None if it is not a valid one by the W3C rules."""
    from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID, SpanContext, TraceFlags

    match = _TRACEPARENT.fullmatch(traceparent.strip(" \t"))
    if match is None or match[1] == "ff" or (match[1] == "00" and match[5]):
        return None
    trace_id, span_id = int(match[2], 16), int(match[3], 16)
    if trace_id == INVALID_TRACE_ID or span_id == INVALID_SPAN_ID:
        return None
    return SpanContext(trace_id, span_id, True, TraceFlags(int(match[4], 16)))


class Tracing:
    def __init__(self, system: str, max_links: int = 128) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import SpanLimits, TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            raise SettingsError(
                "RELAY_TRACING",
                "needs the OpenTelemetry packages: pip install 'pg-outbox-relay[otel]'",
            ) from None
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win; else "relay", not the
        # SDK's unknown_service.
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "relay"}))
        # A link per message: the SDK keeps 128 by default and a batch is up to
        # RELAY_BATCH_SIZE (OTEL_SPAN_LINK_COUNT_LIMIT, if set, still wins).
        limit = os.environ.get("OTEL_SPAN_LINK_COUNT_LIMIT")
        self._provider = TracerProvider(
            resource=resource,
            span_limits=SpanLimits(max_links=int(limit) if limit else max(128, max_links)),
        )
        # The SDK's own complaints (an unreachable collector) as the relay's log lines.
        library_logger("opentelemetry", "otel.log")
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self._tracer = self._provider.get_tracer("relay", __version__)
        self._propagator = TraceContextTextMapPropagator()
        self._system = system

    @property
    def tracer(self) -> Tracer:
        """The relay's tracer, for a sink's own spans."""
        return self._tracer

    def context_of(self, message: OutboxMessage) -> Context | None:
        """The context the row's `traceparent` carries; None without a valid one."""
        from opentelemetry import trace

        traceparent = message.header("traceparent")  # the one the batch span links
        if traceparent is None:
            return None
        carrier = {"traceparent": traceparent}
        tracestate = message.header("tracestate")
        if tracestate is not None:
            carrier["tracestate"] = tracestate
        context = self._propagator.extract(carrier)
        if not trace.get_current_span(context).get_span_context().is_valid:
            return None
        return context

    def trace_headers(self) -> dict[str, str]:
        """The current span's context as W3C headers (`traceparent`, and `tracestate`
        if it has one), for a request to carry on."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        return carrier

    def start_batch(self, messages: Sequence[OutboxMessage], fetched_ns: int) -> Span:
        """The span of one published batch, linked to its messages' traces; the caller
        adds events and ends it."""
        from opentelemetry.trace import Link, SpanKind

        links = []
        for message in messages:
            traceparent = message.header("traceparent")
            if traceparent is not None:
                context = _span_context(traceparent)
                if context is not None:
                    links.append(Link(context))
        topics = {m.topic for m in messages}
        topic = next(iter(topics)) if len(topics) == 1 else "(several)"
        attributes: dict[str, Any] = {
            "messaging.system": self._system,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.batch.message_count": len(messages),
        }
        if len(topics) == 1:
            attributes["messaging.destination.name"] = topic
        span = self._tracer.start_span(
            f"publish {topic}",
            kind=SpanKind.PRODUCER,
            links=links,
            attributes=attributes,
            start_time=fetched_ns,
        )
        span.add_event("fetched", timestamp=fetched_ns)
        return span

    @staticmethod
    def failed(span: Span, error: str, kind: str) -> None:
        """Mark a span failed (a delivery the sink did not accept, a database error)."""
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error[:200]))
        span.set_attribute("error.type", kind)

    def shutdown(self) -> None:
        self._provider.shutdown()
