"""The store interfaces of the drain and the elector (pure: no database driver here).

Three sessions per lane, each owned by one thread: the drain loop reads (`ReadStore`),
the settler writes outcomes (`SettleStore`), so the next batch is read while the last is
being settled, and the elector runs the lease protocol (`LeaseStore`). A failed
statement raises `StoreError`, its session already closed, so the loop's next try
starts on a fresh one; rows published but not settled stay unsent (a duplicate, never
a loss). `reset()` closes the session after any other failure (a bug, an interrupt).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from relay.drain.batch import BatchLimits, IdSet, SentRows, Settlement
from relay.lease.protocol import Attempt, LeaseToken
from relay.message import OutboxMessage


class StoreError(Exception):
    """A statement failed (the database is down, the session was cut, a timeout): the
    message says what the database said, without the statement's parameters."""


@dataclass(slots=True)
class Fetched:
    messages: list[OutboxMessage]
    # Where the round over keys stopped (the next fetch's `after_key`: a key's hash, as
    # the round goes); None when the head needed no sharing out, or the round went
    # all the way round.
    walked_to: int | None = None
    # Where the round over fairness groups stopped (the next fetch's `after_group`).
    walked_group: str | None = None
    # The fair statement ran (then `walked_to` and `walked_group` are meaningful).
    fair: bool = False
    # ... went round every key and found nobody to share with: the head's batch.
    alone: bool = False


@dataclass(frozen=True, slots=True)
class Promoted:
    """What a pass of `promote_due` did, and when to look again."""

    rows: int
    next_due_in: float | None  # seconds until the next scheduled row is due; None: none


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """What the drain asks of a fetch (docs/concepts/delivery-guarantees.md, "Fair across
    keys, at a bounded cost"): the next batch of unsent rows in id order, minus
    `left_out` (the rows published and not settled) and the `held` keys; a key blocked
    by an earlier waiting row skipped. `after_key`: where the round over keys starts (a
    key's hash); with `limits.group`, fair across groups first, from `after_group`.
    `share_busy_keys`: look past a head that one key fills for others to share with.
    `paused`: the paused topics, whose rows the store holds out of the drain."""

    limits: BatchLimits
    left_out: tuple[IdSet, ...] = ()
    held: frozenset[str] = frozenset()
    after_key: int | None = None
    after_group: str | None = None
    share_busy_keys: bool = True
    paused: frozenset[str] = frozenset()


class ReadStore(Protocol):
    """The drain loop's session: the fetch and the promotion of scheduled rows, of the
    store's one shard."""

    def fetch(self, request: FetchRequest) -> Fetched:
        """The next batch `request` asks for."""
        ...

    def promote_due(self, limit: int) -> Promoted:
        """Let at most `limit` scheduled rows that are due into the drain."""
        ...

    def paused_topics(self) -> frozenset[str]:
        """The topics paused now (`relay pause`), of every shard."""
        ...

    def unpark_resumed(self) -> int:
        """Let go the rows parked for a pause that is over; how many."""
        ...

    def release_paused(self, limit: int) -> tuple[int, bool]:
        """Move up to `limit` rows held out of the outbox for a pause that is over back
        into it; how many, and whether more are left."""
        ...

    def interrupt(self) -> None:
        """From another thread: cancel the statement the session is running, if any."""
        ...

    def close(self) -> None: ...


class SettleStore(Protocol):
    """The settler's session."""

    def settle(
        self, token: LeaseToken, settlement: Settlement, *, ttl: float, sent_rows: SentRows
    ) -> datetime | None:
        """Write a batch's outcomes atomically, fenced on `token` (and renew the lease
        by `ttl`); None if a newer holder fenced us out and nothing was written, else
        the store's time at which the fence held."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class DrainStore(Protocol):
    """Opens the two sessions of one lane (one shard)."""

    def reading(self) -> ReadStore: ...

    def settling(self) -> SettleStore: ...


class LeaseStore(Protocol):
    """The elector's session, for one lease row (relay/lease/protocol.py has the protocol)."""

    def try_acquire(self, holder: str, ttl: float) -> Attempt:
        """One compare-and-swap attempt on the row (and its group's shard count)."""
        ...

    def renew(self, token: LeaseToken, ttl: float) -> bool:
        """Extend the lease by `ttl`; False once a newer holder took it, or it was
        released (fencing)."""
        ...

    def release(self, token: LeaseToken) -> bool:
        """Expire the row now, so a standby takes it at its next poll."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None: ...
