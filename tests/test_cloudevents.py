"""CloudEvents in binary content mode (RELAY_CLOUDEVENTS_SOURCE): what the relay sends
over HTTP (to a real server) and Kafka (a real broker) is read back as CloudEvents by the
CloudEvents SDK for Python on the receiving side; RabbitMQ's and NATS's headers are
checked by the same SDK (RabbitMQ) or by the binding's rules (NATS)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat

from relay.errors import SettingsError
from relay.message import OutboxMessage
from relay.sinks.cloudevents import CloudEvents
from relay.sinks.nats.sink import headers_for
from relay.sinks.rabbitmq.sink import message_for
from tests.conftest import SettingsFactory
from tests.harness.kafka import TansuBroker, consume
from tests.harness.webhook import WebhookServer
from tests.support import running_relay, scalar, unsent_count, wait_until

SOURCE = "/orders-service"
CE = {"cloudevents_source": SOURCE}


def write_events(dsn: str, topic: str) -> list[dict[str, Any]]:
    """Two rows: a typed JSON event keyed by an order (a key that needs percent-encoding
    in an HTTP header), and a bare row whose type falls back to its topic."""
    rows = [
        (
            "order 42/ü",
            b'{"status": "paid"}',
            {"content-type": "application/json", "type": "com.example.order.paid", "ce-id": "x"},
        ),
        (None, b"\x00\x01", None),
    ]
    with psycopg.connect(dsn) as conn, conn.transaction():
        for key, payload, headers in rows:
            conn.execute(
                "INSERT INTO outbox (topic, key, payload, headers) VALUES (%s, %s, %s, %s)",
                (topic, key, payload, None if headers is None else json.dumps(headers)),
            )
        found = conn.execute(
            "SELECT message_id::text, key, created_at FROM outbox ORDER BY id"
        ).fetchall()
    return [{"id": m, "key": k, "created_at": c} for m, k, c in found]


def check(event: Any, row: dict[str, Any], topic: str) -> None:
    assert event.get_specversion() == "1.0"
    assert event.get_id() == row["id"]  # the row's own ce-id header does not win
    assert event.get_source() == SOURCE
    assert isinstance(event.get_time(), datetime)
    assert event.get_time() == row["created_at"]
    if row["key"] is None:
        assert event.get_type() == topic
        assert event.get_subject() is None
    else:
        assert event.get_type() == "com.example.order.paid"
        assert event.get_subject() == row["key"]
        assert event.get_datacontenttype() == "application/json"
        assert event.get_data() == {"status": "paid"}


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    with WebhookServer() as srv:
        yield srv


def test_http_requests_are_cloudevents_to_the_sdk(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    rows = write_events(database, "orders")
    settings = make_settings(sink="http", http_url=server.url + "/hooks/{topic}", **CE)
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    by_id = {d.headers["message-id"]: d for d in server.history()}
    assert len(by_id) == 2
    for row in rows:
        delivery = by_id[row["id"]]
        event = ce_http.from_binary(
            ce_http.HTTPMessage(headers=delivery.headers, body=delivery.body), JSONFormat()
        )
        check(event, row, "orders")
        assert delivery.headers["ce-subject" if row["key"] else "ce-type"] in (
            "order%2042/%C3%BC",
            "orders",
        )


def test_kafka_records_are_cloudevents_to_the_sdk(
    make_settings: SettingsFactory, database: str, topic: str, kafka: TansuBroker
) -> None:
    rows = write_events(database, topic)
    with running_relay(make_settings(**CE)):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    records = {
        r.headers["message-id"].decode(): r
        for r in consume(kafka.bootstrap_servers, topic, min_count=2)
    }
    for row in rows:
        record = records[row["id"]]
        event = ce_kafka.from_binary(
            ce_kafka.KafkaMessage(
                headers=record.headers,
                key=None if record.key is None else record.key.encode(),
                value=record.value or b"",
            ),
            JSONFormat(),
        )
        check(event, row, topic)


def message(key: str | None, headers: list[list[str]] | None) -> OutboxMessage:
    return OutboxMessage(
        id=1,
        message_id="0b6b7a0e-8f3c-4c1e-9a57-1d2c3b4a5f60",
        topic="orders",
        key=key,
        payload=b'{"status": "paid"}',
        headers=headers,
        unsendable=None,
        created_at="2026-11-25T10:00:00.000000Z",
        due_epoch=0.0,
        attempts=0,
    )


@pytest.mark.unit
def test_rabbitmq_and_nats_messages_carry_the_attributes_by_their_binding() -> None:
    ce = CloudEvents(SOURCE, "type")
    row = message(
        "order 42/ü", [["content-type", "application/json"], ["type", "t.paid"], ["ce-id", "x"]]
    )
    amqp = message_for(row, ce)
    event = ce_rabbitmq.from_binary(
        ce_rabbitmq.RabbitMQMessage(
            headers={k: str(v) for k, v in amqp.headers.items()},
            content_type=amqp.content_type,
            body=amqp.body,
        ),
        JSONFormat(),
    )
    assert (event.get_id(), event.get_type(), event.get_subject()) == (
        row.message_id,
        "t.paid",
        "order 42/ü",
    )
    assert event.get_data() == {"status": "paid"}
    nats = headers_for(row, ce)
    assert nats["ce-id"] == row.message_id and nats["ce-source"] == SOURCE
    assert nats["ce-subject"] == "order%2042/%C3%BC"  # percent-encoded as HTTP's
    assert nats["ce-time"] == row.created_at and nats["ce-specversion"] == "1.0"
    assert nats["ce-datacontenttype"] == "application/json"  # the NATS binding's rule
    # Off: not one ce- header, the row's own passed on as before.
    assert "ce-source" not in headers_for(row) and headers_for(row)["ce-id"] == "x"
    # An empty type falls back to the topic, an empty key is no subject; the app's own
    # extension attributes go through.
    odd = message("", [["type", ""], ["ce-dataschema", "https://example.com/s"]])
    attributes = dict(ce.attributes(odd))
    assert attributes["type"] == "orders" and "subject" not in attributes
    assert headers_for(odd, ce)["ce-dataschema"] == "https://example.com/s"


def test_cloudevents_need_a_uri_reference_for_a_source(make_settings: SettingsFactory) -> None:
    with pytest.raises(SettingsError, match="RELAY_CLOUDEVENTS_SOURCE"):
        make_settings(cloudevents_source="/orders service")


def test_off_by_default_nothing_changes(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    write_events(database, "orders")
    with running_relay(make_settings(sink="http", http_url=server.url + "/h")):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    assert all(
        not any(name.startswith("ce-") and name != "ce-id" for name in d.headers)
        for d in server.history()
    )
    assert scalar(database, "SELECT count(*) FROM outbox") == 0


@pytest.mark.unit
def test_each_sinks_binding_sends_the_shared_attributes_its_own_way() -> None:
    """The bytes each binding sends, pinned: `ce_` text for Kafka, `ce-` percent-encoded
    for HTTP (bytes) and NATS (with `ce-datacontenttype`), `ce-` as they are for
    RabbitMQ; a row's look-alikes (any prefix, any case) give way in every sink."""
    from relay.sinks.http.settings import HttpSettings
    from relay.sinks.http.sink import RequestBuilder
    from relay.sinks.kafka.sink import record_headers

    ce = CloudEvents(SOURCE, "type")
    row = message(
        "order 42/ü",
        [
            ["content-type", "application/json"],
            ["type", "t.paid"],
            ["ce-id", "x"],
            ["CE_Source", "s"],
        ],
    )
    mid, time = row.message_id, row.created_at
    attributes = [
        ("specversion", "1.0"),
        ("id", mid),
        ("source", SOURCE),
        ("type", "t.paid"),
        ("time", time),
    ]
    as_is = [*attributes, ("subject", "order 42/ü")]
    encoded = [*attributes, ("subject", "order%2042/%C3%BC")]

    def ce_headers(headers: list[tuple[str, Any]], prefix: str) -> list[tuple[str, Any]]:
        return [(n[3:], v) for n, v in headers if n.lower().startswith(prefix)]

    kafka = record_headers(ce)(row)
    assert ce_headers(kafka, "ce_") == as_is
    assert kafka[:2] == [("content-type", "application/json"), ("type", "t.paid")]
    assert not ce_headers(kafka, "ce-")
    # The usual row (no headers of its own) takes the short way to the same attributes.
    usual = record_headers(ce)(row._replace(headers=None))
    assert usual[:2] == [("message-id", mid), ("created-at", time)]
    assert ce_headers(usual, "ce_") == [*attributes[:3], ("type", "orders"), *as_is[4:]]
    assert record_headers(None) is OutboxMessage.header_pairs  # off: not a call more

    http = RequestBuilder(HttpSettings(http_url="https://h/in"), ce).build(row).headers
    assert ce_headers(http, "ce-") == [(n, v.encode()) for n, v in encoded]
    assert ce_headers(list(headers_for(row, ce).items()), "ce-") == [
        *encoded,
        ("datacontenttype", "application/json"),
    ]
    amqp = message_for(row, ce).headers
    assert ce_headers(list(amqp.items()), "ce-") == as_is
