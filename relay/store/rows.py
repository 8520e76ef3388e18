"""Typed rows for what operators read: `relay status` and `relay dead-letter list`.

Field names and order are the columns of the named statements in relay/sql/ (psycopg
builds these by name with `class_row`, so a renamed column fails loudly, not as a
missing dict key in a table printer); `--json` prints them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """`lease_status`: one lease, with the database's view of its expiry."""

    name: str
    lease_group: str  # the lease it is a shard of (its own name with one shard)
    shards: int
    shard: int
    holder: str | None
    epoch: int
    expires_at: datetime
    live: bool
    seconds_to_expiry: float
    acquired_at: datetime | None
    renewed_at: datetime | None
    released_at: datetime | None


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """`replica_status`: a replica's last heartbeat."""

    lease_name: str
    replica_id: str
    started_at: datetime
    seen_at: datetime
    sink_ok: bool
    sink_error: str | None
    seconds_since_seen: float


@dataclass(frozen=True, slots=True)
class DeadLetterRow:
    """`dead_letter_list`: a dead-lettered row, without its payload."""

    id: int
    message_id: UUID
    topic: str
    key: str | None
    attempts: int
    dead_lettered_at: datetime
    dead_letter_reason: str | None
