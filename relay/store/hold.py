"""A paused topic's rows held out of the outbox by the fetch (docs/operations/pause.md):
the rows of paused topics met in the head `fetch_head` read move into outbox_paused
(relay/sql/drain.sql, hold_paused) before the batch is made, so a paused backlog is
walked past once, by the move, not by every fetch. An own table's are parked in place
by the settle instead (relay/drain/screen.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relay.message import OutboxMessage
from relay.observe import metrics
from relay.sql import QUERIES
from relay.store.db import Conn

# How far past the head's first paused row one hold walks, in heads: a paused backlog
# interleaved with other rows leaves this many heads free of it per move. And how many
# holds one fetch runs while the head it reads again still starts with paused rows (a
# backlog of them ahead of the rest): a fetch that handed over nothing would make the
# drain wait out its idle poll before the next.
HOLD_HEADS = 8
HOLDS_A_FETCH = 8


def held_first(
    conn: Conn,
    cur: Any,
    head: list[OutboxMessage],
    paused: frozenset[str],
    params: dict[str, Any],
) -> list[OutboxMessage]:
    """`head`, or once the rows of `paused` topics in it are held (`hold_paused`, up to
    HOLDS_A_FETCH times while the head read again holds more), the head read again."""
    for _ in range(HOLDS_A_FETCH if paused else 0):
        if not hold_paused(conn, head, paused, params):
            break
        head = cur.execute(QUERIES.fetch_head, params).fetchall()
    return head


def hold_paused(
    conn: Conn, head: Sequence[OutboxMessage], paused: frozenset[str], params: dict[str, Any]
) -> bool:
    """Move the rows of `paused` topics out into outbox_paused, from the first of them in
    `head` on, over HOLD_HEADS heads' worth of rows (drain.sql, hold_paused): a paused
    backlog is then walked past once, not by every fetch. Whether any moved."""
    first = next((m.id for m in head if m.topic in paused), None)
    if first is None:
        return False
    row = conn.execute(
        QUERIES.hold_paused,
        {
            **params,
            "topics": sorted(paused),
            "from_id": first,
            "walk": HOLD_HEADS * params["limit"],
        },
    ).fetchone()
    held = 0 if row is None else int(row["held"])
    if held:
        metrics.PAUSED_ROWS_HELD.inc(held)
    return held > 0
