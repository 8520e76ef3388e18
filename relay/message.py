"""One outbox row as the relay carries it from the database to a sink."""

from __future__ import annotations

from operator import attrgetter
from typing import NamedTuple

from relay.errors import MalformedRow

__all__ = [
    "DUE_EPOCH",
    "ID",
    "KEY",
    "READY",
    "REPLAY_HEADER",
    "RESERVED_HEADERS",
    "TOPIC",
    "MalformedRow",
    "OutboxMessage",
]

RESERVED_HEADERS = ("message-id", "created-at")
# The header a replayed row carries (`relay replay`), its value the
# replay's id. Unlike the two above it is a row header, sent on as the row's others
# are; the replay sets it, so an app may not.
REPLAY_HEADER = "relay-replay"


class OutboxMessage(NamedTuple):
    """Field order = the columns of `fetch_head` and `fetch_batch`.

    A named tuple so the fetch makes it straight from psycopg's row tuple, in C
    (relay/store/fetch.py, _MAKE_MESSAGE): one object per row the relay ever moves, made without
    a line of Python.
    """

    id: int
    message_id: str  # the row's uuid, canonical text
    topic: str
    key: str | None
    payload: bytes | None
    # The row's own headers as PostgreSQL prints them, [name, value] pairs (a 2-D text
    # array), in no meaningful order; nulls and the reserved names already left out by
    # the query. Never parsed here: a jsonb value Python's json could not load (a
    # 5,000-digit number, deep nesting) never reaches Python as anything but text.
    headers: list[list[str]] | None
    # Why the row cannot be sent as it is (too large, a NULL an own table allowed,
    # headers that are no object of scalars): it is dead-lettered with this reason.
    unsendable: str | None
    created_at: str  # RFC 3339, UTC, microseconds: the `created-at` header as sent
    # When the row became due, in Unix seconds: created_at, or its available_at if later
    # (a scheduled row); the end-to-end latency counts from it.
    due_epoch: float
    attempts: int
    # The fetch's verdict (fetch_head): the row may be sent now (not in backoff, its key
    # not held), and it fits the batch's byte bound. Always true in a batch.
    ready: bool = True
    within: bool = True

    def row_headers(self) -> list[tuple[str, str]]:
        """The row's own headers as (name, text) pairs, byte for byte as written:
        strings as they are, numbers and booleans in their JSON text."""
        if self.unsendable is not None:
            raise MalformedRow(self.unsendable)
        pairs = self.headers
        if not pairs:
            return []
        return [(name, value) for name, value in pairs]

    def header(self, name: str) -> str | None:
        """The value of the row's first header called `name` (given in lower case,
        compared case-insensitively), read in place; None without one."""
        pairs = self.headers
        if pairs:
            for key, value in pairs:
                if key.lower() == name:
                    return value
        return None

    def header_pairs(self) -> list[tuple[str, str | bytes | None]]:
        """Row headers plus `message-id` and `created-at`, for confluent-kafka (which
        encodes text values as UTF-8). The relay's own headers always win over the row's.
        """
        if self.headers is None and self.unsendable is None:  # the usual row
            return [("message-id", self.message_id), ("created-at", self.created_at)]
        pairs: list[tuple[str, str | bytes | None]] = []
        pairs.extend(self.row_headers())
        pairs.append(("message-id", self.message_id))
        pairs.append(("created-at", self.created_at))
        return pairs


# Field getters for `map()` over a batch: the loop over its rows stays in C.
ID = attrgetter("id")
TOPIC = attrgetter("topic")
KEY = attrgetter("key")
DUE_EPOCH = attrgetter("due_epoch")
READY = attrgetter("ready")
