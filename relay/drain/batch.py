"""What a batch is, in the relay's own terms (pure: no database driver here): how big it
may be, its ids (and their text, made once), and what is written back for it once the
sink answered. The drain's parts pass these between them; relay/store/repository.py turns
them into statements.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from relay.drain.fairness import FairnessGroup

# What a settle does with the rows the sink acknowledged: delete them (the default),
# move them into outbox_sent (retention mode), or mark them sent where
# they are (retention mode with an own table, RELAY_OUTBOX_TABLE).
SentRows = Literal["delete", "move", "mark"]

# Where the drain keeps the rows it sets aside, dead letters and rows scheduled for
# later: moved into tables of the relay's own beside the outbox ("move": outbox_dead and
# outbox_scheduled), or left in the outbox, marked ("mark": an
# own table, RELAY_OUTBOX_TABLE).
SetAside = Literal["move", "mark"]


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """How big a batch may be, and how much of it one key may take (`fetch_batch`)."""

    rows: int
    bytes: int
    per_key: int
    # Fill the rest of the batch with more rows of busy keys when no other key waits.
    fill: bool = True
    # A row over this many bytes (payload, topic, key, headers) comes without them, with the
    # reason it is dead-lettered: the relay never loads a row it cannot send.
    message_bytes: int = 16 << 20
    # RELAY_FAIRNESS_GROUP: every waiting group's share first, then keys within groups.
    group: FairnessGroup | None = None
    # RELAY_FAIRNESS=off: first in, first out; the fetch never shares a batch out past the
    # head, so it needs no key index (relay/store/fetch.py, `_fetch_in_order`).
    fair: bool = True
    # The per-key cap is the default, `a_fifth` of the batch: `sized` keeps it a fifth of
    # the smaller batch a fetch asks for.
    per_key_fifth: bool = False

    def sized(self, rows: int) -> BatchLimits:
        """These limits for a batch of at most `rows` (relay/drain/sizing.py)."""
        rows = min(rows, self.rows)
        if rows == self.rows:
            return self
        per_key = a_fifth(rows) if self.per_key_fifth else self.per_key
        return replace(self, rows=rows, per_key=per_key)


def a_fifth(rows: int) -> int:
    """The default per-key cap where a key's rows may go out together: a key alone still
    fills whole batches, and four more keys find room beside a busy one."""
    return max(1, rows // 5)


@dataclass(slots=True)
class Settlement:
    """What to write back for one published batch."""

    sent: list[int] = field(default_factory=list)
    retry_ids: list[int] = field(default_factory=list)
    retry_attempted: list[int] = field(default_factory=list)  # 0: sent back, no attempt
    retry_delays: list[float] = field(default_factory=list)
    retry_errors: list[str] = field(default_factory=list)
    dead_ids: list[int] = field(default_factory=list)
    dead_attempted: list[int] = field(default_factory=list)
    dead_reasons: list[str] = field(default_factory=list)
    # Rows of paused topics, parked unsent until their topic is resumed, and the topics.
    paused_ids: list[int] = field(default_factory=list)
    paused_topics: set[str] = field(default_factory=set)
    sent_text: str | None = None  # `sent` as `id_text`, when the caller has it already

    def retry(self, row_id: int, delay: float, error: str, *, attempted: bool = True) -> None:
        self.retry_ids.append(row_id)
        self.retry_attempted.append(1 if attempted else 0)
        self.retry_delays.append(delay)
        self.retry_errors.append(error)

    def dead(self, row_id: int, reason: str, *, attempted: bool = True) -> None:
        self.dead_ids.append(row_id)
        self.dead_attempted.append(1 if attempted else 0)
        self.dead_reasons.append(reason)

    def park(self, row_id: int, topic: str) -> None:
        self.paused_ids.append(row_id)
        self.paused_topics.add(topic)

    def __bool__(self) -> bool:
        return bool(self.sent or self.retry_ids or self.dead_ids or self.paused_ids)


@dataclass(frozen=True, slots=True)
class IdSet:
    """Rows in flight: their `ids`; `text` (`id_text`), the same made once, for the
    statements that name them (the settle, a fetch that leaves them out); `span`
    (first, last) when they are every id from first to last, as a batch fetched in id
    order usually is: then a fetch may leave them out as one range, which the planner
    prices in one step where it prices an array element by element (0.2 ms a fetch at
    2,000 ids in flight)."""

    ids: tuple[int, ...] = ()
    text: str = ""
    span: tuple[int, int] | None = None


# A span may not end at bigint's last value: PostgreSQL stores [a, b] as [a, b + 1).
_LAST_BIGINT = 2**63 - 1


def id_set(ids: Iterable[int]) -> IdSet:
    """A batch's ids: their text, and their span if they leave no gap (a span stands for
    every id in it, so a repeated id must not pass for a missing one)."""
    values = tuple(ids)
    if not values:
        return IdSet()
    first, last = min(values), max(values)
    whole = (
        last - first + 1 == len(values) and last < _LAST_BIGINT and len(set(values)) == len(values)
    )
    return IdSet(values, id_text(values), (first, last) if whole else None)


def id_text(ids: Iterable[int]) -> str:
    """`1,2,3`: a batch's ids as text, made once and reused by every statement that
    names the batch (its settle, and each fetch's exclusion while it is in flight if it
    has gaps). One
    C-level join, where psycopg adapting a list element by element in Python was a
    tenth of the drain thread's time at batch 2000."""
    return ",".join(map(str, ids))
