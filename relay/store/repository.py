"""The drain loop's database operations, each one named statement from relay/sql/."""

from __future__ import annotations

from datetime import datetime

import psycopg
from psycopg import sql
from psycopg.rows import class_row

from relay import failpoints
from relay.drain.batch import SentRows, SetAside, Settlement, id_text
from relay.lease.protocol import LeaseToken
from relay.sql import QUERIES
from relay.store.db import Conn
from relay.store.fetch import id_array
from relay.store.port import Promoted
from relay.store.rows import LeaseRow, ReplicaRow


def promote_due(
    conn: Conn, limit: int, *, shards: int = 1, shard: int = 0, set_aside: SetAside
) -> Promoted:
    """Let scheduled rows that are due into the drain. With
    `set_aside` "move" (the relay's own outbox), those moved out into
    outbox_scheduled first, then the rows scheduled for later moved out."""
    params = {"limit": limit, "shards": shards, "shard": shard}
    let_in = 0
    more_to_move = False
    if set_aside == "move":
        moves = conn.execute(QUERIES.schedule_moves, params).fetchone()
        assert moves is not None  # a SELECT of two function calls: always one row
        let_in = int(moves["let_in"])
        more_to_move = bool(moves["more"]) or int(moves["parked"]) >= limit
    row = conn.execute(QUERIES.promote_due, params).fetchone()
    assert row is not None  # a SELECT of two scalar subqueries: always one row
    next_due = row["next_due_in_seconds"]
    if more_to_move:
        next_due = 0.0  # more rows to let in or set aside: look again at once
    return Promoted(let_in + int(row["promoted"]), None if next_due is None else float(next_due))


def settle(
    conn: Conn,
    token: LeaseToken,
    ttl: float,
    settlement: Settlement,
    *,
    sent_rows: SentRows,
    set_aside: SetAside,
) -> datetime | None:
    """Write a batch's outcomes in ONE fenced transaction (and move its dead letters too
    large for it in a second); None if we were fenced out, else the database time at
    which the fence held (for the `batch.settled` event).

    The lease check comes first and renews the lease; if it matches no row a newer
    holder exists, and the whole transaction rolls back: a zombie marks nothing. A batch
    wholly acknowledged (the usual one) settles in one statement that does the same.
    """
    if not (settlement.retry_ids or settlement.dead_ids or settlement.paused_ids):
        failpoints.hit("in_settle")
        fenced = conn.execute(
            SETTLE_ACKNOWLEDGED[sent_rows],
            {
                "name": token.name,
                "holder": token.holder,
                "epoch": token.epoch,
                "ttl": ttl,
                "ids": sent_array(settlement),
            },
        ).fetchone()
        return None if fenced is None else fenced["at"]
    dead = {
        "ids": settlement.dead_ids,
        "attempted": settlement.dead_attempted,
        "reasons": settlement.dead_reasons,
    }
    fence = {"name": token.name, "holder": token.holder, "epoch": token.epoch, "ttl": ttl}
    moved = 0
    with conn.transaction():
        fenced = conn.execute(QUERIES.lease_renew, fence).fetchone()
        if fenced is None:
            raise psycopg.Rollback  # nothing of this batch may land
        if settlement.sent:
            conn.execute(SETTLE_SENT[sent_rows], {"ids": sent_array(settlement)})
        if settlement.retry_ids:
            conn.execute(
                QUERIES.record_failures,
                {
                    "ids": settlement.retry_ids,
                    "attempted": settlement.retry_attempted,
                    "delays": settlement.retry_delays,
                    "errors": settlement.retry_errors,
                },
            )
        if settlement.paused_ids:
            park_paused(conn, settlement)
        if settlement.dead_ids:
            done = conn.execute(DEAD_LETTER[set_aside], dead)
            moved = len(settlement.dead_ids)
            if set_aside == "move":
                row = done.fetchone()
                moved = 0 if row is None else int(row["moved"])
        failpoints.hit("in_settle")
    if fenced is None:
        return None
    if moved < len(settlement.dead_ids):
        _move_large_dead_letters(conn, fence, dead)
    fenced_at: datetime = fenced["at"]
    return fenced_at


def park_paused(conn: Conn, settlement: Settlement) -> None:
    """Park the rows of paused topics, under their pause locks (drain.sql, pause_lock)."""
    conn.execute(QUERIES.pause_lock, {"topics": sorted(settlement.paused_topics)})
    conn.execute(QUERIES.park_paused, {"ids": settlement.paused_ids})


def paused_topics(conn: Conn) -> frozenset[str]:
    return frozenset(str(row["topic"]) for row in conn.execute(QUERIES.paused_topics))


def unpark_resumed(conn: Conn) -> int:
    return conn.execute(QUERIES.unpark_resumed).rowcount


def release_paused(conn: Conn, limit: int) -> tuple[int, bool]:
    """Up to `limit` held rows of resumed topics back into the outbox; and whether
    more are left."""
    row = conn.execute(QUERIES.release_paused, {"limit": limit}).fetchone()
    return (0, False) if row is None else (int(row["released"]), bool(row["more"]))


def _move_large_dead_letters(conn: Conn, fence: dict[str, object], dead: dict[str, object]) -> None:
    """The dead letters the settle left in the outbox for their size, moved out in a
    fenced transaction of their own without a statement timeout. Fenced out meanwhile:
    left for the new holder, which sends them again and gives up on them again."""
    with conn.transaction():
        if conn.execute(QUERIES.lease_renew, fence).fetchone() is None:
            raise psycopg.Rollback
        conn.execute(QUERIES.no_statement_timeout)
        conn.execute(QUERIES.dead_letter_move_rest, dead)


# A wholly acknowledged batch's one fenced statement, and the acknowledged rows' part of
# a settle transaction, by what is done with them.
def sent_array(settlement: Settlement) -> str:
    """The acknowledged ids as the settle statements' `::bigint[]` literal, from their
    text when the drain made it already."""
    text = settlement.sent_text if settlement.sent_text is not None else id_text(settlement.sent)
    return id_array([text])


SETTLE_ACKNOWLEDGED = {
    "delete": QUERIES.settle_delete_sent,
    "move": QUERIES.settle_move_sent,
    "mark": QUERIES.settle_mark_sent,
}
SETTLE_SENT = {"delete": QUERIES.delete_sent, "move": QUERIES.move_sent, "mark": QUERIES.mark_sent}
# The rows a settle gives up on, by where dead letters are kept: moved out (those too
# large to copy in the settle after it), or marked where they are (an own table).
DEAD_LETTER = {"move": QUERIES.dead_letter_move, "mark": QUERIES.dead_letter}


# outbox_sent's generations (its LIST partitions outbox_sent_0..3).
SENT_GENERATIONS = 4


def sent_history_problem(conn: Conn) -> str | None:
    """Why this session's role cannot keep sent rows in outbox_sent; None if it can."""
    row = conn.execute(QUERIES.sent_history_access).fetchone()
    assert row is not None
    if row["can_keep"] is None or row["can_read_generations"] is None:
        return "outbox_sent is missing: run `relay migrate`"
    if not (row["can_keep"] and row["can_read_generations"]):
        return (
            "the role may not write outbox_sent: run migrations/grants.sql again"
            " (INSERT on outbox_sent, SELECT and UPDATE on outbox_sent_generations)"
        )
    return None


def rotate_sent(conn: Conn, retention_seconds: float) -> int | None:
    """Retention mode: empty the oldest generation of outbox_sent and make it the
    current one, if it is time (`sent_generation_due`); which one, or None."""
    with conn.transaction():
        due = conn.execute(
            QUERIES.sent_generation_due,
            {"retention": retention_seconds, "generations": SENT_GENERATIONS},
        ).fetchone()
        if due is None:
            return None
        generation = int(due["generation"])
        partition = sql.Identifier(f"outbox_sent_{generation}")
        conn.execute(sql.SQL(QUERIES.sent_generation_empty).format(partition=partition))
        conn.execute(QUERIES.sent_generation_begin, {"generation": generation})
    return generation


def empty_sent_generations(conn: Conn, older_than_seconds: float) -> list[int]:
    """`relay purge --older-than`: empty every generation of outbox_sent (but the
    current one) whose rows are all older than that; which ones."""
    with conn.transaction():
        found = conn.execute(
            QUERIES.sent_generations_older_than,
            {"older_than": older_than_seconds, "generations": SENT_GENERATIONS},
        ).fetchall()
        emptied = [int(row["generation"]) for row in found]
        for generation in emptied:
            partition = sql.Identifier(f"outbox_sent_{generation}")
            conn.execute(sql.SQL(QUERIES.sent_generation_empty).format(partition=partition))
    return emptied


def purge_sent(conn: Conn, older_than_seconds: float, limit: int) -> int:
    cur = conn.execute(QUERIES.purge_sent, {"older_than": older_than_seconds, "limit": limit})
    return cur.rowcount


def lease_status(conn: Conn) -> list[LeaseRow]:
    with conn.cursor(row_factory=class_row(LeaseRow)) as cur:
        return cur.execute(QUERIES.lease_status).fetchall()


def lease_group_shards(conn: Conn) -> dict[str, int]:
    """Each lease group's shard count in force."""
    try:
        with conn.transaction():
            rows = conn.execute(QUERIES.lease_group_shards).fetchall()
    except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
        return {}
    return {str(r["name"]): int(r["shards"]) for r in rows}


def replica_status(conn: Conn) -> list[ReplicaRow]:
    """Every replica's last heartbeat."""
    try:
        with conn.transaction(), conn.cursor(row_factory=class_row(ReplicaRow)) as cur:
            return cur.execute(QUERIES.replica_status).fetchall()
    except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
        return []
