"""OpenTelemetry end to end on real servers: the app's trace context, written by
`relay.enqueue` inside a span, reaches the consumer (a Kafka record's headers, an HTTP
request's), and the relay's own spans reach a real OTLP/HTTP endpoint with the right
links (a batch span) and parent (an HTTP request span)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider

import relay
from tests.conftest import REPO, relay_env, start_relay
from tests.harness.kafka import TansuBroker, consume
from tests.harness.otlp import OtlpReceiver, ReceivedSpan
from tests.harness.webhook import WebhookServer
from tests.support import unsent_count, wait_until

APP = TracerProvider().get_tracer("the-app")  # the app's own tracer, not the relay's


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def enqueue_traced(database: str, topic: str, traced: int = 3) -> tuple[str, str]:
    """`traced` rows written inside the app's span, one outside any: (trace id, span id)."""
    with APP.start_as_current_span("checkout") as span:
        with psycopg.connect(database) as conn, conn.transaction():
            for n in range(traced):
                relay.enqueue(conn, topic, f"traced-{n}".encode(), key="k")
        context = span.get_span_context()
    with psycopg.connect(database) as conn, conn.transaction():
        relay.enqueue(conn, topic, b"untraced", key="other")
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def run_relay(
    relay_dsn: str, database: str, receiver: OtlpReceiver, tmp_path: Path, **extra: str
) -> None:
    """A `relay run` process with tracing on, until the outbox is drained; then SIGTERM,
    which exports the spans still buffered."""
    env = relay_env(
        relay_dsn,
        RELAY_TRACING="true",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",
        **extra,
    )
    proc = start_relay(env, tmp_path / "relay.log")
    try:
        wait_until(lambda: unsent_count(database) == 0, 60, message="outbox drained")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, (tmp_path / "relay.log").read_text()[-3000:]


def relay_spans(receiver: OtlpReceiver, kind: str) -> list[ReceivedSpan]:
    # "relay": the default service name (no OTEL_SERVICE_NAME here).
    return [s for s in receiver.spans() if s.service == "relay" and s.kind == kind]


def test_kafka_carries_the_apps_trace_and_the_batch_span_links_to_it(
    relay_dsn: str, database: str, topic: str, kafka: TansuBroker, receiver: OtlpReceiver,
    tmp_path: Path,
) -> None:  # fmt: skip
    # More than the SDK's default 128 links a span keeps: every message is linked.
    trace_id, span_id = enqueue_traced(database, topic, traced=300)
    run_relay(
        relay_dsn,
        database,
        receiver,
        tmp_path,
        RELAY_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
    )
    records = consume(kafka.bootstrap_servers, topic, min_count=301)
    traced = [r for r in records if r.value != b"untraced"]
    assert len(traced) == 300
    assert all(
        r.headers["traceparent"].decode().split("-")[1:3] == [trace_id, span_id] for r in traced
    )
    assert not any("traceparent" in r.headers for r in records if r.value == b"untraced")

    wait_until(lambda: relay_spans(receiver, "PRODUCER"), 10, message="the batch spans exported")
    batches = relay_spans(receiver, "PRODUCER")
    assert all(s.name == f"publish {topic}" for s in batches)
    assert all(s.attributes["messaging.system"] == "kafka" for s in batches)
    links = [link for s in batches for link in s.links]
    assert links.count((trace_id, span_id)) == 300  # one per traced message, not the other
    assert sum(s.attributes["messaging.batch.message_count"] for s in batches) == 301
    assert all({"fetched", "acknowledged", "settle"} <= set(s.events) for s in batches)
    assert all(s.parent_span_id == "" for s in batches)  # linked, not parented


def test_an_http_request_is_a_child_of_the_messages_context_and_carries_its_own(
    relay_dsn: str, database: str, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    with WebhookServer() as server:
        trace_id, span_id = enqueue_traced(database, "orders")
        run_relay(
            relay_dsn, database, receiver, tmp_path,
            RELAY_SINK="http", RELAY_HTTP_URL=server.url + "/hooks/{topic}",
        )  # fmt: skip
        deliveries = [d for d in server.history() if d.body != b"untraced"]
    assert len(deliveries) == 3
    wait_until(lambda: len(relay_spans(receiver, "CLIENT")) >= 4, 10, message="request spans")
    requests = {s.span_id: s for s in relay_spans(receiver, "CLIENT")}
    for delivery in deliveries:
        _, trace, parent, _ = delivery.headers["traceparent"].split("-")
        assert trace == trace_id  # the app's trace goes on to the endpoint...
        span = requests[parent]  # ... under the relay's request span
        assert span.parent_span_id == span_id and span.trace_id == trace_id
        assert span.name == "POST" and span.attributes["http.request.method"] == "POST"
        assert 200 <= span.attributes["http.response.status_code"] < 300
        # The URL may hold a token: only where it goes is exported, never url.full.
        assert "url.full" not in span.attributes
        assert span.attributes["server.address"] == "127.0.0.1"
    # The untraced row's request starts a trace of its own.
    untraced = [s for s in requests.values() if s.parent_span_id == ""]
    assert len(untraced) == 1 and untraced[0].trace_id != trace_id


def test_enqueue_keeps_the_apps_own_trace_headers_whole_and_can_leave_them_out(
    database: str,
) -> None:
    own = "00-11111111111111111111111111111111-2222222222222222-01"
    with (
        APP.start_as_current_span("checkout"),
        psycopg.connect(database) as conn,
        conn.transaction(),
    ):
        relay.enqueue(conn, "t", b"own", headers={"Traceparent": own})
        relay.enqueue(conn, "t", b"none", trace_context=False)
        rows: dict[bytes, object] = dict(
            conn.execute("SELECT payload, headers FROM outbox").fetchall()
        )
    assert rows[b"own"] == {"Traceparent": own}  # no tracestate of another trace beside it
    assert rows[b"none"] is None


@pytest.mark.unit
def test_a_batch_span_links_a_traceparent_whatever_the_case_of_its_name() -> None:
    from relay.message import OutboxMessage
    from relay.observe.tracing import Tracing

    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rows = [
        OutboxMessage(n, str(n), "t", "k", b"", [[name, traceparent]], None, "", 0.0, 0)
        for n, name in enumerate(("traceparent", "Traceparent", "x-other"))
    ]
    tracing = Tracing("kafka")
    try:
        span = tracing.start_batch(rows, 0)  # never ended: nothing to export
        links = [link.context.span_id for link in span.links]  # type: ignore[attr-defined]
        assert links == [0x00F067AA0BA902B7] * 2
    finally:
        tracing.shutdown()


def test_an_http_request_span_replaces_the_rows_trace_context_with_its_own(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.message import OutboxMessage
    from relay.observe.tracing import Tracing
    from relay.sinks.base import Outcome, Result
    from relay.sinks.http.tracing import RequestSpans

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    own = [["TraceParent", f"00-{trace_id}-{parent}-01"], ["tracestate", "vendor=1"]]
    row = OutboxMessage(1, "m-1", "t", "k", b"", own, None, "", 0.0, 0)
    tracing = Tracing("http")
    spans = RequestSpans(tracing)
    forwarded = [("TraceParent", own[0][1].encode()), ("tracestate", b"vendor=1"), ("x-a", b"1")]
    try:
        url = "https://hooks.example:8443/in?token=secret"
        with spans.request(row, url, forwarded) as (span, headers):
            spans.answered(span, Result(Outcome.RETRY, "HTTP 500"))
    finally:
        tracing.shutdown()
    sent = dict(headers)
    assert [n for n, _ in headers] == ["x-a", "traceparent", "tracestate"]  # the row's, gone
    _, trace, span_id, _ = sent["traceparent"].decode().split("-")
    assert trace == trace_id and sent["tracestate"] == b"vendor=1"
    (exported,) = relay_spans(receiver, "CLIENT")
    assert (exported.span_id, exported.parent_span_id) == (span_id, parent)
    assert exported.attributes["server.address"] == "hooks.example"
    assert exported.attributes["server.port"] == 8443
    assert exported.attributes["error.type"] == "retry"
    assert not any("secret" in str(value) for value in exported.attributes.values())


def test_with_tracing_off_no_module_imports_opentelemetry(tmp_path: Path) -> None:
    """Off, OpenTelemetry (an extra; tens of milliseconds to import) stays unloaded:
    the loop's and every sink's modules, an HTTP sink made and closed."""
    script = """
import sys
from relay.daemon import app
from relay.observe import tracing
from relay.settings import Settings
from relay.sinks.kafka import sink as kafka
from relay.sinks.nats import sink as nats
from relay.sinks.rabbitmq import sink as rabbitmq
from relay.sinks.http.sink import HttpSink
settings = Settings(
    database_url="postgresql://h/db", sink="http", http_url="http://127.0.0.1:9/h",
    cloudevents_source="/s",
)
assert tracing.configure(settings) is None
HttpSink(settings).close()
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "OTEL_"))}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
