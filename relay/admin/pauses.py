"""Pausing a topic (`relay pause`, `relay resume`, the console and its API): a paused
topic's rows wait in the outbox, unsent and unattempted, while every other topic flows.
The pause is a row of outbox_paused_topics, so it outlives restarts, takeovers and
deploys; the drains read it about once a second (relay/drain/pauses.py).

The change and its audit entry are one call of outbox_pause or outbox_resume
(relay/sql/pause.sql); this module names them and reads the answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import psycopg
from psycopg.rows import class_row

from relay.sql import QUERIES
from relay.store.db import Conn

Via = Literal["cli", "console", "api"]

# The longest topic a pause takes: as long as a topic may be in the relay's sinks.
MAX_TOPIC_CHARS = 1024


@dataclass(frozen=True, slots=True)
class Change:
    """The answer of a pause (`done`: paused now) or a resume (`done`: it was paused)."""

    done: bool
    paused_since: datetime | None
    audit_id: int | None


@dataclass(frozen=True, slots=True)
class PausedTopic:
    topic: str
    paused_by: str
    paused_at: datetime
    reason: str | None
    held_rows: int  # rows held: in outbox_paused, or parked in place (the first of a key)


def topic_problem(topic: str) -> str | None:
    """Why `topic` cannot be paused as given; None if it can."""
    if not topic.strip():
        return "the topic is empty"
    if len(topic) > MAX_TOPIC_CHARS:
        return f"the topic is longer than {MAX_TOPIC_CHARS} characters"
    if "\0" in topic:
        return "the topic holds a NUL character"  # no PostgreSQL text can
    return None


def pause(conn: Conn, topic: str, *, actor: str, via: Via, reason: str | None = None) -> Change:
    row = conn.execute(
        QUERIES.pause, {"topic": topic, "actor": actor, "via": via, "reason": reason or None}
    ).fetchone()
    assert row is not None  # a function call: one row
    return Change(bool(row["paused_now"]), row["paused_since"], row["audit_id"])


def resume(conn: Conn, topic: str, *, actor: str, via: Via) -> Change:
    row = conn.execute(QUERIES.resume, {"topic": topic, "actor": actor, "via": via}).fetchone()
    assert row is not None
    return Change(bool(row["resumed"]), row["paused_since"], row["audit_id"])


def paused_topics(conn: Conn) -> list[PausedTopic]:
    """Every paused topic; none where the schema has no pauses yet (before `relay
    migrate`) or the role may not read them."""
    try:
        with conn.transaction(), conn.cursor(row_factory=class_row(PausedTopic)) as cur:
            return cur.execute(QUERIES.paused_topic_list).fetchall()
    except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
        return []
