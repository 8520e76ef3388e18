"""CloudEvents in binary content mode (RELAY_CLOUDEVENTS=binary).

The row's payload is the event's data, unchanged; its context attributes travel as
headers, named as each protocol binding says: `ce-` for HTTP and NATS, `ce_` for Kafka,
and `ce-` for RabbitMQ (as the CloudEvents SDK for Python reads it). `datacontenttype`
is the message's own content type (the row's `content-type` header), which each sink
already carries its way.

    specversion  1.0
    id           the row's message id (also the `message-id` header)
    source       RELAY_CLOUDEVENTS_SOURCE
    type         the row's header named by RELAY_CLOUDEVENTS_TYPE_HEADER, else its topic
    time         the row's created_at (RFC 3339, UTC)
    subject      the row's key, when it has one
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from relay.message import OutboxMessage

if TYPE_CHECKING:
    from relay.settings import Settings

SPECVERSION = "1.0"
# HTTP and NATS header values: printable ASCII but space, '"' and '%' as they are, the
# rest percent-encoded as UTF-8 (the HTTP binding, 3.1.3.2).
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')


@dataclass(frozen=True, slots=True)
class CloudEvents:
    source: str
    type_header: str  # lower-case

    @classmethod
    def from_settings(cls, settings: Settings) -> CloudEvents | None:
        if settings.cloudevents is None:
            return None
        assert settings.cloudevents_source is not None  # required with it (settings.py)
        return cls(settings.cloudevents_source, settings.cloudevents_type_header.lower())

    def attributes(self, message: OutboxMessage) -> list[tuple[str, str]]:
        """The context attributes, unprefixed, in the spec's order."""
        # Never empty (the spec): an empty type header is no type header.
        event_type = message.header(self.type_header) or message.topic
        attributes = [
            ("specversion", SPECVERSION),
            ("id", message.message_id),
            ("source", self.source),
            ("type", event_type),
            ("time", message.created_at),
        ]
        if message.key:  # an empty subject is no subject (the spec: non-empty)
            attributes.append(("subject", message.key))
        return attributes

    def kafka_headers(self, message: OutboxMessage) -> list[tuple[str, str | bytes | None]]:
        """`OutboxMessage.header_pairs` plus the `ce_` attributes; a row's own `ce_*`
        headers give way to them."""
        if message.headers is None and message.header_error is None:  # the usual row
            pairs = message.header_pairs()
        else:
            pairs = [(n, v) for n, v in message.header_pairs() if not is_attribute_header(n)]
        pairs.extend([("ce_" + name, value) for name, value in self.attributes(message)])
        return pairs

    def http_headers(self, message: OutboxMessage) -> list[tuple[str, bytes]]:
        """The `ce-` headers of the HTTP binding, values percent-encoded where needed."""
        return [
            ("ce-" + name, quote(value, safe=_HEADER_SAFE).encode("ascii"))
            for name, value in self.attributes(message)
        ]

    def nats_headers(self, message: OutboxMessage) -> dict[str, str]:
        """The NATS binding's binary mode (NATS 2.2+ headers): as HTTP's, `ce-`, with
        the content type as `ce-datacontenttype` too (that binding's rule)."""
        headers = {
            "ce-" + name: quote(value, safe=_HEADER_SAFE)
            for name, value in self.attributes(message)
        }
        content_type = message.header("content-type")
        if content_type:
            headers["ce-datacontenttype"] = quote(content_type, safe=_HEADER_SAFE)
        return headers

    def rabbitmq_headers(self, message: OutboxMessage) -> dict[str, str]:
        """AMQP 0-9-1 has no binding of its own (the AMQP one is for 1.0): `ce-` header
        table entries, values as they are (a table holds UTF-8), as the CloudEvents SDK
        for Python reads a RabbitMQ message."""
        return {"ce-" + name: value for name, value in self.attributes(message)}


PREFIXES = ("ce-", "ce_", "cloudevents_", "cloudevents:")
# The attributes the relay sets: a row's header of one of these names (any prefix) is
# dropped in binary mode. Others (extensions, dataschema) are the app's to send.
OWN_ATTRIBUTES = frozenset(
    {"specversion", "id", "source", "type", "time", "subject", "datacontenttype"}
)


def is_attribute_header(name: str) -> bool:
    """A row header that would pose as one of the relay's context attributes."""
    lower = name.lower()
    for prefix in PREFIXES:
        if lower.startswith(prefix):
            return lower[len(prefix) :] in OWN_ATTRIBUTES
    return False
