"""One outbox row as the relay carries it from the database to a sink."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

RESERVED_HEADERS = ("message-id", "created-at")


class MalformedRow(ValueError):
    """The row cannot be published as it is; retrying will not help (dead-letter it)."""


@dataclass(slots=True)
class OutboxMessage:
    """Field order = the columns of `fetch_batch` (rows are built positionally)."""

    id: int
    message_id: str  # the row's uuid, canonical text
    topic: str
    key: str | None
    payload: bytes | None
    headers: Any
    created_at: str  # RFC 3339, UTC, microseconds: the `created-at` header as sent
    created_epoch: float  # the same instant in Unix seconds, for end-to-end latency
    attempts: int

    def row_headers(self) -> list[tuple[str, str]]:
        """The row's own headers as text, validated; the relay's reserved names dropped.

        Row headers must be a JSON object of scalars; strings are kept as they are,
        other scalars in their JSON form, nulls are left out.
        """
        if self.headers is None:
            return []
        if not isinstance(self.headers, dict):
            raise MalformedRow(f"headers must be a JSON object, got {type(self.headers).__name__}")
        pairs: list[tuple[str, str]] = []
        for name, value in self.headers.items():
            if name.lower() in RESERVED_HEADERS or value is None:
                continue
            if isinstance(value, str):
                pairs.append((name, value))
            elif isinstance(value, bool | int | float):
                pairs.append((name, json.dumps(value)))
            else:
                raise MalformedRow(
                    f"header {name!r} must be a string or scalar, got {type(value).__name__}"
                )
        return pairs

    def header_pairs(self) -> list[tuple[str, str | bytes | None]]:
        """Row headers plus `message-id` and `created-at`, for confluent-kafka (which
        encodes text values as UTF-8). The relay's own headers always win over the row's.
        """
        pairs: list[tuple[str, str | bytes | None]] = []
        if self.headers is not None:
            pairs.extend(self.row_headers())
        pairs.append(("message-id", self.message_id))
        pairs.append(("created-at", self.created_at))
        return pairs
