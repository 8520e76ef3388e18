"""The fetch: the next batch of rows to publish, fair across keys (`fetch_head`, and
`fetch_batch` when the head must be shared out) or first in, first out
(RELAY_FAIRNESS=off), each a named statement of relay/sql/drain.sql."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, cast

from psycopg.rows import RowMaker, tuple_row

from relay.drain.batch import BatchLimits, IdSet
from relay.message import KEY, READY, OutboxMessage
from relay.sql import QUERIES
from relay.store.db import Conn
from relay.store.hold import held_first
from relay.store.port import Fetched, FetchRequest


def fetch(
    conn: Conn, request: FetchRequest, *, shards: int = 1, shard: int = 0, hold: bool = False
) -> Fetched:
    """`request` as the fetch statements take it. `hold`: the rows of its paused topics
    met at the head move out into outbox_paused (the relay's own outbox; an own table's
    are parked in place by the settle)."""
    ids, ranges = left_out_literals(request.left_out)
    return fetch_batch(
        conn,
        request.limits,
        ids,
        request.after_key,
        held=sorted(request.held),
        share_busy_keys=request.share_busy_keys,
        shards=shards,
        shard=shard,
        after_group=request.after_group,
        in_flight_ranges=ranges,
        paused=request.paused if hold else frozenset(),
    )


def left_out_literals(parts: Sequence[IdSet]) -> tuple[str, str]:
    """The rows in flight as the fetch leaves them out: an array literal (`::bigint[]`)
    of the ids of batches with gaps and the stragglers, and a multirange literal
    (`::int8multirange`) of the spans of the others."""
    ids = id_array(part.text for part in parts if part.span is None)
    spans = ",".join(f"[{p.span[0]},{p.span[1]}]" for p in parts if p.span is not None)
    return ids, "{" + spans + "}"


def id_array(parts: Iterable[str]) -> str:
    """`{1,2,3}` from `id_text` parts: the literal PostgreSQL parses as the `::bigint[]`
    a statement casts it to."""
    return "{" + ",".join(part for part in parts if part) + "}"


def fetch_batch(
    conn: Conn,
    limits: BatchLimits,
    in_flight: str = "{}",
    after_key: int | None = None,
    *,
    held: Sequence[str] = (),
    share_busy_keys: bool = True,
    shards: int = 1,
    shard: int = 0,
    after_group: str | None = None,
    in_flight_ranges: str = "{}",
    paused: frozenset[str] = frozenset(),
) -> Fetched:
    """The next batch (docs/concepts/delivery-guarantees.md, "Fair across keys, at a bounded cost").

    `in_flight`: ids (an `id_array`) published but not settled yet: left out; and
    `in_flight_ranges` (a multirange literal), runs of such ids without a gap.
    `after_key`: where the round over keys starts if the head must be shared out.
    `held`: keys whose rows are not ready (an earlier row is in flight): like a key in
    backoff, they make a full head share out, so other keys are found past them.

    One cheap statement in the usual case (`fetch_head`); the fair one (`fetch_batch`)
    only when the head holds rows it may not send while it is full, or more rows of
    one key than the cap: planning and running it costs a few times more.
    `share_busy_keys=False` skips the second reason where the cap may be filled past
    anyway (`limits.fill`): the caller's way to look for other keys less often while
    a key drains alone.
    `shards`, `shard`: with more than one shard, only that shard's rows.
    With `limits.group` (RELAY_FAIRNESS_GROUP), a full head is shared out too: groups
    past it may wait. `after_group`: where the round over groups starts.
    `paused`: topics whose rows met in the head are held out of the outbox before the
    batch is made (`hold_paused`), so the head is fetched again without them.
    """
    params: dict[str, Any] = {
        "shards": shards,
        "shard": shard,
        "limit": limits.rows,
        "in_flight": in_flight,
        "in_flight_ranges": in_flight_ranges,
        "held": list(held),
        "max_bytes": limits.bytes,
        "message_max": limits.message_bytes,
        "after": None,
    }
    if not limits.fair:
        return Fetched(_fetch_in_order(conn, limits, params, paused))
    # Messages made from each row in C (OutboxMessage is a named tuple whose fields
    # are the columns, see _MAKE_MESSAGE): this runs for every row the relay moves.
    # Binary results: numbers, booleans and the payload's bytes arrive as they are,
    # with no text to parse (bytea as text would be hex, twice the bytes).
    with conn.cursor(row_factory=_messages, binary=True) as cur:
        head = cur.execute(QUERIES.fetch_head, params).fetchall()
        head = held_first(conn, cur, head, paused, params)
        if not _needs_sharing(head, limits, share_busy_keys or not limits.fill):
            return Fetched(_within_bytes(head))
    group = limits.group
    params.update(
        key_cap=limits.per_key,
        fill=limits.fill,
        after_key=after_key,
        grouped=group is not None,
        group_kind=group.kind if group else None,
        group_arg=group.arg if group else None,
        after_group=after_group,
    )
    with conn.cursor(row_factory=tuple_row, binary=True) as cur:  # rows, then the walks
        *rows, last = cur.execute(QUERIES.fetch_batch, params).fetchall()
    walked_to, walked_group = last[-2:]
    ids = [row[0] for row in rows]
    # Not when a round stopped partway (say, at a run of keys in backoff): keys or
    # groups beyond it may be waiting.
    alone = (
        walked_to is None
        and walked_group is None
        and ids == [m.id for m in head[: len(ids)] if m.ready]
    )
    return Fetched([_MAKE_MESSAGE(row[:-2]) for row in rows], walked_to, walked_group, True, alone)


# tuple.__new__ with the class: the named tuple made in C from psycopg's row tuple
# (namedtuple's own _make is a Python function around the same call). The columns are
# the fields, in order: tests/test_fetch.py pins both statements' projections.
_MAKE_MESSAGE = cast("RowMaker[OutboxMessage]", partial(tuple.__new__, OutboxMessage))


# RELAY_FAIRNESS=off: how many windows of a batch's rows by id one fetch reads past rows it
# may not send now, before it stops: once some rows are found, and while none are. Each
# window is one fetch_head.
WINDOWS_IN_ORDER = 4
WINDOWS_WHILE_EMPTY = 16


def _fetch_in_order(
    conn: Conn, limits: BatchLimits, params: dict[str, Any], paused: frozenset[str]
) -> list[OutboxMessage]:
    """RELAY_FAIRNESS=off: first in, first out, by fetch_head alone (the primary key's
    walk; no key index read): the ready rows in id order up to the bounds, and where
    the sink sends a key's rows one at a time (`limits.fill` False) each key's first
    `per_key` of them. A window that gave fewer than half a batch, because rows in it
    may not go now, and cut nothing, is walked past from its last id: up to
    WINDOWS_IN_ORDER windows, WINDOWS_WHILE_EMPTY while nothing is found.

    The walk is order-safe only in one snapshot with one now(): there a row that may
    not go holds back every later row of its key in every window (the same probes),
    where a backoff running out, or a late commit or a let-in below the window, between
    two windows of their own would let a key's later rows go first. So the first window
    runs alone, as the usual fetch, and a walk past it runs again from the start in one
    read-only REPEATABLE READ transaction. A cut (bytes, the cap, room) stops the walk:
    the rows it left must go before any later row of their key."""
    with conn.cursor(row_factory=_messages, binary=True) as cur:
        if paused:  # the paused topics' rows held first, as the fair fetch holds them
            held_first(
                conn, cur, cur.execute(QUERIES.fetch_head, params).fetchall(), paused, params
            )
        batch, walk_on = _walk(cur, limits, params, 1)
        if not walk_on:
            return batch
        with conn.transaction():
            cur.execute(QUERIES.one_snapshot)
            batch, _ = _walk(cur, limits, params, WINDOWS_WHILE_EMPTY)
    return batch


def _walk(
    cur: Any, limits: BatchLimits, params: dict[str, Any], windows: int
) -> tuple[list[OutboxMessage], bool]:
    """Up to `windows` windows (WINDOWS_IN_ORDER once rows are found): the batch, and
    whether the walk stopped for want of windows alone."""
    batch: list[OutboxMessage] = []
    taken: Counter[str] = Counter()
    room_bytes = limits.bytes
    for read in range(1, windows + 1):
        window: list[OutboxMessage] = cur.execute(QUERIES.fetch_head, params).fetchall()
        if read == 1 and window and _all_taken(window, limits):
            return window, False  # the usual window, all of it: nothing to walk past
        cut = False
        for message in window:
            if not message.ready:
                continue
            # fetch_head's first ready row comes whole even past the byte room (so a
            # fetch is never empty): past the first window, with rows taken, a cut.
            size = _size(message)
            if not message.within or len(batch) == limits.rows or (batch and size > room_bytes):
                cut = True
                break
            if not limits.fill and message.key is not None:
                if taken[message.key] >= limits.per_key:
                    cut = True  # this key's later rows wait; other keys go on
                    continue
                taken[message.key] += 1
            batch.append(message)
            room_bytes -= size
        if cut or len(window) < limits.rows or len(batch) * 2 >= limits.rows:
            return batch, False
        if read >= (min(windows, WINDOWS_IN_ORDER) if batch else windows):
            return batch, True
        params = {**params, "after": window[-1].id, "max_bytes": room_bytes}
    return batch, True


def _all_taken(window: list[OutboxMessage], limits: BatchLimits) -> bool:
    """Every row of the window goes, in C (map, Counter): all ready, the last within
    the byte bound (`within` turns false only past it), no key past its cap."""
    if not (window[-1].within and all(map(READY, window))):
        return False
    if limits.fill:
        return True
    counts = Counter(map(KEY, window))
    counts.pop(None, None)
    return not counts or max(counts.values()) <= limits.per_key


def _size(message: OutboxMessage) -> int:
    """About the bytes fetch_head's `row_size` counted for a row it gave with its
    payload, for the byte room left to the next window (its headers as the pairs the
    relay holds, not as stored)."""
    size = len(message.payload or b"") + len(message.topic.encode())
    size += len((message.key or "").encode())
    for name, value in message.headers or ():
        size += len(name.encode()) + len(value.encode())
    return size


def _messages(_cursor: Any) -> RowMaker[OutboxMessage]:
    return _MAKE_MESSAGE


def _needs_sharing(head: list[OutboxMessage], limits: BatchLimits, busy_keys: bool) -> bool:
    """fetch_batch's "crowded" (a full head holding rows it may not send), or a key
    with more ready rows than the cap (then the cap or the others' share applies).
    The usual head is all ready: then both walks over it stay in C (map, Counter)."""
    all_ready = all(map(READY, head))
    if len(head) == limits.rows and not all_ready:
        return True
    if not busy_keys:
        return False
    if limits.group is not None and len(head) == limits.rows:
        return True  # other groups may wait past a full head
    if all_ready:
        counts = Counter(map(KEY, head))
        counts.pop(None, None)
    else:
        counts = Counter(m.key for m in head if m.ready and m.key is not None)
    return bool(counts) and max(counts.values()) > limits.per_key


def _within_bytes(head: list[OutboxMessage]) -> list[OutboxMessage]:
    """The ready rows up to the byte bound (fetch_head's `within`), in id order."""
    if head and head[-1].within and all(map(READY, head)):
        return head  # `within` only turns false past the bound: all of it fits
    batch: list[OutboxMessage] = []
    for message in head:
        if message.ready:
            if not message.within:
                break
            batch.append(message)
    return batch
