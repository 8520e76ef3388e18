"""One outbox row as the relay carries it from the database to a sink."""

from __future__ import annotations

from dataclasses import dataclass

from relay.errors import MalformedRow

__all__ = ["RESERVED_HEADERS", "MalformedRow", "OutboxMessage"]

RESERVED_HEADERS = ("message-id", "created-at")


@dataclass(slots=True)
class OutboxMessage:
    """Field order = the columns of `fetch_batch` (rows are built positionally)."""

    id: int
    message_id: str  # the row's uuid, canonical text
    topic: str
    key: str | None
    payload: bytes | None
    # The row's own headers as PostgreSQL prints them, flat: [name, value, name, ...];
    # nulls and the reserved names already left out by the query. Never parsed here: a
    # jsonb value Python's json could not load (a 5,000-digit number, deep nesting)
    # never reaches Python as anything but text.
    headers: list[str] | None
    header_error: str | None  # why the headers cannot be sent as they are (dead-letter)
    created_at: str  # RFC 3339, UTC, microseconds: the `created-at` header as sent
    created_epoch: float  # the same instant in Unix seconds, for end-to-end latency
    attempts: int

    def row_headers(self) -> list[tuple[str, str]]:
        """The row's own headers as (name, text) pairs, byte for byte as written:
        strings as they are, numbers and booleans in their JSON text."""
        if self.header_error is not None:
            raise MalformedRow(self.header_error)
        flat = self.headers
        if not flat:
            return []
        return list(zip(flat[::2], flat[1::2], strict=True))

    def header_pairs(self) -> list[tuple[str, str | bytes | None]]:
        """Row headers plus `message-id` and `created-at`, for confluent-kafka (which
        encodes text values as UTF-8). The relay's own headers always win over the row's.
        """
        if self.headers is None and self.header_error is None:  # the usual row
            return [("message-id", self.message_id), ("created-at", self.created_at)]
        pairs: list[tuple[str, str | bytes | None]] = []
        pairs.extend(self.row_headers())
        pairs.append(("message-id", self.message_id))
        pairs.append(("created-at", self.created_at))
        return pairs
