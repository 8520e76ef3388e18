"""The drain's store in memory: an outbox and its lease rows in a list, for the fast tests
of the drain loop (`./dev test --unit`) and for reading the protocol without SQL.

It keeps the rules the loop relies on: id order, rows in flight and held keys left out,
a key blocked by an earlier row in backoff or not yet due, the per-key cap, the byte
bounds, the settle fenced on the lease's holder and epoch, all of it at once, and the
lease rows' compare-and-swap by the store's clock. It does not model the fair rounds
over keys and fairness groups (relay/sql/drain.sql's `fetch_batch`) nor the shard
count's group row (`lease_group_claim`), all tested on PostgreSQL: a batch here is the
head, capped per key.

Long: one model of the whole store port (the lease's rows, the read, the settle), since
the loop's rules hold only across all three at once.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from relay.drain.batch import BatchLimits, SentRows, Settlement
from relay.lease.protocol import Acquired, Attempt, HeldByOther, LeaseToken
from relay.message import OutboxMessage
from relay.store.port import Fetched, FetchRequest, Promoted, StoreError


@dataclass(slots=True)
class Row:
    """One outbox row; times are on the store's clock."""

    id: int
    topic: str
    key: str | None
    payload: bytes
    created: float
    available_at: float | None = None  # scheduled: not fetched before, until promoted
    promoted: bool = False
    attempts: int = 0
    next_attempt_at: float | None = None
    last_error: str | None = None
    sent: bool = False
    deleted: bool = False
    dead_reason: str | None = None

    @property
    def unsent(self) -> bool:
        return not (self.sent or self.deleted or self.dead_reason is not None)

    @property
    def waiting(self) -> bool:
        """Not yet let into the drain: a scheduled row not promoted."""
        return self.available_at is not None and not self.promoted


@dataclass(slots=True)
class LeaseRow:
    holder: str | None = None
    epoch: int = 0
    expires: float = 0.0
    released: bool = False


class MemoryStore:
    """A `DrainStore` whose sessions share one outbox, one lock and one clock. A test
    writes rows (`insert`), grants leases (`take`) and makes statements fail
    (`fail_next`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.rows: list[Row] = []
        self.leases: dict[str, LeaseRow] = {}
        self.paused: set[str] = set()  # a test pauses and resumes topics here
        self.settles = 0  # settles that committed
        self._failures = 0
        self.settles_fail_until = 0.0  # by the store's clock: every settle fails till then
        self._lock = threading.Lock()

    # --- what a test does ---

    def insert(
        self,
        key: str | None,
        payload: bytes,
        *,
        topic: str = "events",
        available_in: float | None = None,
    ) -> int:
        with self._lock:
            now = self.clock()
            row_id = len(self.rows) + 1
            available = None if available_in is None else now + available_in
            self.rows.append(Row(row_id, topic, key, payload, now, available))
            return row_id

    def take(self, name: str, holder: str, ttl: float = 30.0) -> LeaseToken:
        """The lease row taken by `holder` under a new epoch (fencing any older one)."""
        with self._lock:
            return self._take(name, holder, ttl)

    def _take(self, name: str, holder: str, ttl: float) -> LeaseToken:
        row = self.leases.setdefault(name, LeaseRow())
        row.holder, row.epoch, row.expires = holder, row.epoch + 1, self.clock() + ttl
        row.released = False
        return LeaseToken(name, holder, row.epoch)

    def fail_next(self, statements: int = 1) -> None:
        """The next `statements` statements fail, as a cut session would."""
        with self._lock:
            self._failures += statements

    def unsent(self) -> list[Row]:
        with self._lock:
            return [row for row in self.rows if row.unsent]

    def dead(self) -> list[Row]:
        with self._lock:
            return [row for row in self.rows if row.dead_reason is not None]

    # --- the lease rows ---

    def lease_session(self, name: str) -> MemoryLeaseStore:
        """A `LeaseStore` for the row `name`."""
        return MemoryLeaseStore(self, name)

    def try_acquire(self, name: str, holder: str, ttl: float) -> Attempt:
        with self._lock:
            self._statement()
            row = self.leases.setdefault(name, LeaseRow())
            now = self.clock()
            if row.expires > now and not row.released and row.holder != holder:
                return HeldByOther(row.holder, row.epoch)
            token = self._take(name, holder, ttl)
            return Acquired(token, datetime.fromtimestamp(now, UTC))

    def renew(self, token: LeaseToken, ttl: float) -> bool:
        with self._lock:
            self._statement()
            return self._renew(token, ttl)

    def _renew(self, token: LeaseToken, ttl: float) -> bool:
        """`lease_renew`, and the settles' fence: a row taken since, or released, is not
        ours any more (an expired one nobody took still is)."""
        row, ours = self.leases.get(token.name), (token.holder, token.epoch, False)
        if row is None or (row.holder, row.epoch, row.released) != ours:
            return False
        row.expires = self.clock() + ttl
        return True

    def release(self, token: LeaseToken) -> bool:
        with self._lock:
            self._statement()
            row = self.leases.get(token.name)
            if row is None or (row.holder, row.epoch) != (token.holder, token.epoch):
                return False
            row.expires, row.released = self.clock(), True
            return True

    # --- DrainStore ---

    def reading(self) -> MemoryStore:
        return self

    def settling(self) -> MemoryStore:
        return self

    # --- ReadStore ---

    def fetch(self, request: FetchRequest) -> Fetched:
        limits, held = request.limits, request.held
        with self._lock:
            self._statement()
            left_out = {row_id for part in request.left_out for row_id in part.ids}
            now = self.clock()
            blocked: set[str] = set(held)  # keys whose later rows may not be sent
            batch: list[OutboxMessage] = []
            per_key: Counter[str | None] = Counter()
            size = 0
            for row in self.rows:
                if not row.unsent or row.id in left_out:
                    continue
                ready = (
                    row.key not in blocked
                    and not row.waiting
                    and (row.next_attempt_at is None or row.next_attempt_at <= now)
                )
                if row.key is not None and (row.waiting or not _due(row, now)):
                    blocked.add(row.key)
                if not ready or (row.key is not None and per_key[row.key] >= limits.per_key):
                    continue
                message = _message(row, limits)
                size += len(row.payload)
                if batch and size > limits.bytes:
                    break
                batch.append(message)
                per_key[row.key] += 1
                if len(batch) == limits.rows:
                    break
            return Fetched(batch)

    def promote_due(self, limit: int) -> Promoted:
        with self._lock:
            self._statement()
            now = self.clock()
            waiting = [row for row in self.rows if row.unsent and row.waiting]
            due = [row for row in waiting if (row.available_at or 0.0) <= now][:limit]
            for row in due:
                row.promoted = True
            later = [
                row.available_at - now
                for row in waiting
                if not row.promoted and row.available_at is not None
            ]
            return Promoted(len(due), min(later) if later else None)

    def paused_topics(self) -> frozenset[str]:
        with self._lock:
            self._statement()
            return frozenset(self.paused)

    def unpark_resumed(self) -> int:
        with self._lock:
            self._statement()
            resumed = [
                row
                for row in self.rows
                if row.unsent and row.next_attempt_at == math.inf and row.topic not in self.paused
            ]
            for row in resumed:
                row.next_attempt_at = None
            return len(resumed)

    def release_paused(self, limit: int) -> tuple[int, bool]:
        """Nothing is held out of this store: its paused rows are parked in place."""
        return 0, False

    def interrupt(self) -> None:
        """A statement here never waits: nothing to cancel."""

    def reset(self) -> None:
        """Sessions are not modelled: nothing to open again."""

    def close(self) -> None:
        """Nothing to close."""

    # --- SettleStore ---

    def settle(
        self, token: LeaseToken, settlement: Settlement, *, ttl: float, sent_rows: SentRows
    ) -> datetime | None:
        with self._lock:
            self._statement()
            now = self.clock()
            if now < self.settles_fail_until:
                raise StoreError("permission denied for table outbox_sent (a test's fault)")
            if not self._renew(token, ttl):
                return None  # fenced: a newer holder, or released; nothing is written
            by_id = {row.id: row for row in self.rows}
            for row_id in settlement.sent:
                row = by_id[row_id]
                row.sent, row.deleted = True, sent_rows != "mark"
            for row_id, attempted, delay, error in zip(
                settlement.retry_ids,
                settlement.retry_attempted,
                settlement.retry_delays,
                settlement.retry_errors,
                strict=True,
            ):
                row = by_id[row_id]
                row.attempts += attempted
                row.next_attempt_at = now + delay
                row.last_error = error
            for row_id, attempted, reason in zip(
                settlement.dead_ids,
                settlement.dead_attempted,
                settlement.dead_reasons,
                strict=True,
            ):
                row = by_id[row_id]
                row.attempts += attempted
                row.dead_reason = reason
            for row_id in settlement.paused_ids:
                row = by_id[row_id]
                if row.topic in self.paused:  # else resumed meanwhile: sent later
                    row.next_attempt_at = math.inf
            self.settles += 1
            return datetime.fromtimestamp(now, UTC)

    def _statement(self) -> None:
        if self._failures:
            self._failures -= 1
            raise StoreError("connection to the database was lost (a test's fault)")


def _due(row: Row, now: float) -> bool:
    return row.next_attempt_at is None or row.next_attempt_at <= now


def _message(row: Row, limits: BatchLimits) -> OutboxMessage:
    too_big = len(row.payload) > limits.message_bytes
    created = datetime.fromtimestamp(row.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return OutboxMessage(
        id=row.id,
        message_id=f"00000000-0000-4000-8000-{row.id:012d}",
        topic=row.topic,
        key=row.key,
        payload=None if too_big else row.payload,
        headers=None,
        unsendable=(
            f"the row holds {len(row.payload)} bytes, over RELAY_MESSAGE_MAX_BYTES"
            f" ({limits.message_bytes})"
            if too_big
            else None
        ),
        created_at=created,
        due_epoch=row.available_at if row.available_at is not None else row.created,
        attempts=row.attempts,
    )


class MemoryLeaseStore:
    """One lease row of a `MemoryStore`, as the elector's session sees it."""

    def __init__(self, store: MemoryStore, name: str) -> None:
        self._store = store
        self._name = name

    def try_acquire(self, holder: str, ttl: float) -> Attempt:
        return self._store.try_acquire(self._name, holder, ttl)

    def renew(self, token: LeaseToken, ttl: float) -> bool:
        return self._store.renew(token, ttl)

    def release(self, token: LeaseToken) -> bool:
        return self._store.release(token)

    def reset(self) -> None:
        """Sessions are not modelled."""

    def close(self) -> None:
        """Nothing to close."""
