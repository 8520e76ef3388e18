"""Dead letters for operators (`relay dead-letter`, the console): list them, requeue
them, and name the keys whose earlier dead letters a requeue leaves behind. Where they
are kept (`SetAside`) picks the requeue's statement: an own table's are all in place."""

from __future__ import annotations

from collections.abc import Sequence

from psycopg.rows import class_row

from relay.drain.batch import SetAside
from relay.sql import QUERIES
from relay.store.db import Conn
from relay.store.rows import DeadLetterRow


def dead_letters(
    conn: Conn, *, topic: str | None, key: str | None, limit: int
) -> list[DeadLetterRow]:
    with conn.cursor(row_factory=class_row(DeadLetterRow)) as cur:
        return cur.execute(
            QUERIES.dead_letter_list, {"topic": topic, "key": key, "limit": limit}
        ).fetchall()


def requeue_dead_letters(
    conn: Conn,
    *,
    ids: Sequence[int] = (),
    key: str | None = None,
    everything: bool = False,
    set_aside: SetAside,
) -> list[int]:
    """Back into the drain, by id; `set_aside` says where dead letters are kept (an
    own table's are all in place)."""
    statement = (
        QUERIES.dead_letter_requeue if set_aside == "move" else QUERIES.dead_letter_requeue_in_place
    )
    rows = conn.execute(statement, {"ids": list(ids), "key": key, "all": everything}).fetchall()
    return sorted(int(r["id"]) for r in rows)


def dead_letters_left_behind(conn: Conn, ids: Sequence[int]) -> list[str]:
    rows = conn.execute(QUERIES.dead_letters_left_behind, {"ids": list(ids)}).fetchall()
    return [str(r["key"]) for r in rows]
