"""CloudEvents in binary content mode (RELAY_CLOUDEVENTS_SOURCE): what every sink shares.

An event's context attributes come from its row, the same whatever the sink; each sink's
binding, in its own module, turns them into its headers with its prefix and value type.
The row's payload is the event's data, unchanged.

    specversion      1.0
    id               the row's message id (also the `message-id` header)
    source           RELAY_CLOUDEVENTS_SOURCE
    type             the row's header named by `type` header, else its topic
    time             the row's created_at (RFC 3339, UTC)
    subject          the row's key, when it has one
    datacontenttype  the row's `content-type` header; a protocol with a content type of
                     its own (HTTP, Kafka, AMQP) carries it there, so `attributes` leaves
                     it out and a binding without one (NATS) adds `datacontenttype`

A row's own header posing as one of these attributes (`is_attribute_header`) gives way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from relay.message import OutboxMessage

if TYPE_CHECKING:
    from relay.settings import Settings

SPECVERSION = "1.0"
# Text header values (the HTTP binding, 3.1.3.2, which NATS's follows): printable ASCII
# but space, '"' and '%' as they are, the rest percent-encoded as UTF-8.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')


# The row header whose value is the event's `type` (lower-case, as headers are matched);
# a row without it gets its topic.
TYPE_HEADER = "type"


@dataclass(frozen=True, slots=True)
class CloudEvents:
    source: str
    type_header: str  # lower-case

    @classmethod
    def from_settings(cls, settings: Settings) -> CloudEvents | None:
        if settings.cloudevents_source is None:
            return None
        return cls(settings.cloudevents_source, TYPE_HEADER)

    def attributes(self, message: OutboxMessage) -> list[tuple[str, str]]:
        """The context attributes but `datacontenttype`, unprefixed, in the spec's order:
        what a binding sends, under its own prefix, in its own value type."""
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

    @staticmethod
    def datacontenttype(message: OutboxMessage) -> str | None:
        """The row's content type, for a binding whose protocol has no place of its own
        for it; None without one (an empty one is none)."""
        return message.header("content-type") or None


def percent_encoded(value: str) -> str:
    """An attribute's value as a text header carries it (HTTP's rule, NATS's too)."""
    return quote(value, safe=_HEADER_SAFE)


PREFIXES = ("ce-", "ce_", "cloudevents_", "cloudevents:")
# The attributes the relay sets: a row's header of one of these names (any prefix) is
# dropped in binary mode. Others (extensions, dataschema) are the app's to send.
OWN_ATTRIBUTES = frozenset(
    {"specversion", "id", "source", "type", "time", "subject", "datacontenttype"}
)


def is_attribute_header(name: str) -> bool:
    """A row header that would pose as one of the relay's context attributes: whatever
    the sink's prefix, a binding drops it from the row's headers."""
    lower = name.lower()
    for prefix in PREFIXES:
        if lower.startswith(prefix):
            return lower[len(prefix) :] in OWN_ATTRIBUTES
    return False
