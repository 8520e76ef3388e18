"""The console's database work: the relay's own repository functions and statements
where the CLI already has them (leases, heartbeats, lag, requeue), and the console's
named statements (relay/sql/console.sql) for the rest.

Long: every database call the console makes, each a few lines: the console's whole
footprint on the database, in one place for a DBA to read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from psycopg.types.json import Jsonb

from relay.admin import dead_letters, replay, status
from relay.admin.migrate import SchemaState
from relay.drain.batch import SetAside
from relay.observe import lag
from relay.observe.logging import get_logger
from relay.sql import QUERIES
from relay.store import db
from relay.store.rows import LeaseRow, ReplicaRow

log = get_logger("relay.console")

Action = Literal["requeue", "discard"]
CHUNK = 5_000  # ids per statement of a bulk change (one transaction for all of them)
AUDIT_IDS_SHOWN = 500  # row ids an audit entry's page lists before "… and N more"


# --- filters -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Filter:
    """The dead-letter search; every part optional."""

    topic: str | None = None
    key: str | None = None
    reason: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def params(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "key": self.key,
            "reason": self.reason,
            "since": self.since,
            "until": self.until,
        }

    def as_json(self) -> dict[str, str]:
        return {
            name: value.isoformat() if isinstance(value, datetime) else value
            for name, value in self.params().items()
            if value is not None
        }

    @property
    def empty(self) -> bool:
        return not self.as_json()


# --- overview --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Overview:
    leases: list[LeaseRow]
    replicas: list[ReplicaRow]
    sample: lag.LagSample
    blocked_keys: int
    shard_lag: dict[tuple[str, int], lag.ShardLag]
    schema: SchemaState


def overview(conn: db.Conn, cap: int) -> Overview:
    """What `relay status` reads (relay/admin/status.py), and the blocked keys' count."""
    found = status.read_status(conn, cap)
    row = conn.execute(QUERIES.console_blocked_key_count, {"cap": cap}).fetchone()
    return Overview(
        leases=found.leases,
        replicas=found.replicas,
        sample=found.sample,
        blocked_keys=int(row["blocked_keys"]) if row else 0,
        shard_lag=found.shard_lag,
        schema=found.schema,
    )


# --- dead letters ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Page:
    rows: list[dict[str, Any]]
    more_after: bool  # a next page exists
    more_before: bool  # a previous page exists
    matching: int  # counted up to the cap
    cap: int


def dead_letter_page(
    conn: db.Conn,
    search: Filter,
    *,
    after: int | None,
    before: int | None,
    limit: int,
    cap: int,
) -> Page:
    """A keyset page by id: `after` (next) or `before` (previous), else the first.

    Each page, and each look for a row beyond it (whether to offer Next or Previous), is
    one walk of outbox_dead_letters by id from a cursor. A previous page that would run
    past the first matching row is the first page instead, full."""
    params = search.params()

    def forward(cursor: int, count: int) -> list[dict[str, Any]]:
        query = QUERIES.console_dead_letter_page_after
        return conn.execute(query, {**params, "after": cursor, "limit": count}).fetchall()

    def backward(cursor: int, count: int) -> list[dict[str, Any]]:
        query = QUERIES.console_dead_letter_page_before
        return conn.execute(query, {**params, "before": cursor, "limit": count}).fetchall()

    rows: list[dict[str, Any]] | None = None
    if before is not None:
        earlier = backward(before, limit + 1)
        if len(earlier) > limit:
            rows = list(reversed(earlier[:limit]))
            more_after, more_before = bool(forward(rows[-1]["id"], 1)), True
        else:
            after = None  # it would run past the first row: the first page, full
    if rows is None:
        rows = forward(after or 0, limit + 1)
        more_after = len(rows) > limit
        rows = rows[:limit]
        more_before = bool(after and rows and backward(rows[0]["id"], 1))
    counted = conn.execute(
        QUERIES.console_dead_letter_count, {**search.params(), "cap": cap}
    ).fetchone()
    return Page(rows, more_after, more_before, int(counted["matching"]) if counted else 0, cap)


def row(conn: db.Conn, row_id: int, preview: int) -> dict[str, Any] | None:
    return conn.execute(QUERIES.console_row, {"id": row_id, "preview": preview}).fetchone()


def blocked_keys(conn: db.Conn, limit: int, cap: int) -> list[dict[str, Any]]:
    """Without the key index (RELAY_FAIRNESS=off), no count of the rows behind each key
    (None): it would walk the rest of the outbox per key."""
    counted = conn.execute(QUERIES.console_blocked_keys_counted).fetchone()
    statement = (
        QUERIES.console_blocked_keys
        if counted is None or counted["counted"]
        else QUERIES.console_blocked_keys_uncounted
    )
    return conn.execute(statement, {"limit": limit, "cap": cap}).fetchall()


# --- changes ---------------------------------------------------------------------------


class Changed(Exception):
    """The rows to change are not the ones the operator confirmed (someone else
    requeued, discarded or the drain dead-lettered more since): nothing was changed."""

    def __init__(self, confirmed: int, now: int) -> None:
        if confirmed == now:
            text = f"the {now} row(s) matching now are not the {confirmed} confirmed"
        else:
            text = f"{confirmed} row(s) were confirmed, {now} match now"
        super().__init__(text)
        self.confirmed = confirmed
        self.now = now


class TooMany(Exception):
    """More rows match than one change may touch (`ConsoleSettings.bulk_cap`)."""


@dataclass(frozen=True, slots=True)
class Target:
    """What an operator chose: rows by id, or every dead letter a filter matches."""

    ids: tuple[int, ...] = ()
    search: Filter | None = None

    def as_json(self) -> dict[str, Any]:
        if self.search is not None:
            return {"filter": self.search.as_json()}
        return {"ids": list(self.ids)}


def matching_ids(conn: db.Conn, target: Target, cap: int) -> list[int]:
    """The dead letters the target names, in id order (what a change would touch)."""
    if target.search is None:
        rows = conn.execute(QUERIES.console_dead_letters_of, {"ids": list(target.ids)})
    else:
        rows = conn.execute(
            QUERIES.console_dead_letter_ids, {**target.search.params(), "cap": cap + 1}
        )
    ids = [int(r["id"]) for r in rows.fetchall()]
    if len(ids) > cap:
        raise TooMany(f"more than {cap} dead letters match")
    return ids


def digest(ids: Sequence[int]) -> str:
    """Names a set of rows: the confirmation carries it, so a change by filter touches
    the very rows confirmed, not merely as many (one requeued and another dead-lettered
    in between would keep the count)."""
    return hashlib.sha256(",".join(map(str, sorted(ids))).encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Done:
    audit_id: int
    ids: list[int]
    note: str | None


def change(
    conn: db.Conn,
    actor: str,
    action: Action,
    target: Target,
    confirmed: int,
    cap: int,
    confirmed_digest: str | None = None,
    *,
    set_aside: SetAside,
) -> Done:
    """Requeue or discard exactly the rows confirmed (their count, and their `digest`
    when given), and record it, in one transaction.

    A requeue is `relay dead-letter requeue`'s: dead_letters.requeue_dead_letters on the
    ids in id order (they keep their ids, so per-key order holds among them), with its
    warning when earlier dead letters of the same key stay behind. `set_aside`: where
    dead letters are kept (an own table's are all in place).
    """
    discard = QUERIES.console_discard if set_aside == "move" else QUERIES.console_discard_in_place
    with conn.transaction():
        ids = matching_ids(conn, target, cap)
        if len(ids) != confirmed or (
            confirmed_digest is not None and digest(ids) != confirmed_digest
        ):
            raise Changed(confirmed, len(ids))
        done: list[int] = []
        note = None
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            if action == "requeue":
                done += dead_letters.requeue_dead_letters(conn, ids=chunk, set_aside=set_aside)
            else:
                rows = conn.execute(discard, {"ids": chunk}).fetchall()
                done += [int(r["id"]) for r in rows]
        done.sort()
        if len(done) != confirmed:
            raise Changed(confirmed, len(done))
        if action == "requeue":
            behind = dead_letters.dead_letters_left_behind(conn, done)
            if behind:
                note = (
                    "earlier dead letters of key(s) "
                    + ", ".join(repr(k) for k in behind)
                    + " stay dead-lettered; the requeued rows will be delivered before them"
                )
        entry = conn.execute(
            QUERIES.console_audit_record,
            {
                "actor": actor,
                "action": action,
                "target": Jsonb(target.as_json()),
                "row_count": len(done),
                "first_id": done[0] if done else None,
                "last_id": done[-1] if done else None,
                "row_ids": done,
                "note": note,
            },
        ).fetchone()
        assert entry is not None  # INSERT ... RETURNING: one row
    log.info("console.changed", actor=actor, action=action, rows=len(done), audit_id=entry["id"])
    return Done(int(entry["id"]), done, note)


# --- replay ----------------------------------------------------------------------------


class Refused(Exception):
    """A replay the history or the cap does not allow (relay/admin/replay.py, `refusal`):
    nothing was changed."""


def replay_count(conn: db.Conn, request: replay.Request, cap: int) -> replay.Replay:
    """What a replay would put back, for its confirmation; refused as `relay replay`
    refuses (no history, a range before it, more than `cap` rows)."""
    found = replay.count(conn, request)
    refused = replay.refusal(found, cap)
    if refused is not None:
        raise Refused(refused)
    return found


def replay_apply(
    conn: db.Conn,
    actor: str,
    request: replay.Request,
    confirmed: int,
    cap: int,
    via: replay.Via = "console",
) -> replay.Replay:
    """Replay exactly the `confirmed` count of rows, with its audit entry (one statement:
    outbox_replay), or nothing."""
    found = replay.replay(conn, request, max_rows=cap, actor=actor, via=via, expected=confirmed)
    refused = replay.refusal(found, cap)
    if refused is not None:
        raise Refused(refused)
    if found.replay_id is None:
        raise Changed(confirmed, found.matching)
    log.info("console.replayed", actor=actor, rows=found.replayed, audit_id=found.replay_id)
    return found


# --- audit -----------------------------------------------------------------------------


def audit_page(conn: db.Conn, before: int | None, limit: int) -> list[dict[str, Any]]:
    return conn.execute(QUERIES.console_audit_page, {"before": before, "limit": limit}).fetchall()


def audit_entry(conn: db.Conn, entry_id: int) -> dict[str, Any] | None:
    """An entry with its row ids' count and the first AUDIT_IDS_SHOWN of them (NULL for
    an entry recorded without them)."""
    return conn.execute(
        QUERIES.console_audit_entry, {"id": entry_id, "shown": AUDIT_IDS_SHOWN}
    ).fetchone()


def describe_target(target: Any) -> str:
    return json.dumps(target, sort_keys=True) if target is not None else ""
