"""Replay (`relay replay`, the console's replay): the rows of a topic (and key) kept as
sent in a time range, put back into the outbox as new rows, in their original order.

The statement (relay/sql/replay.sql) and its function (`outbox_replay`, migrations/0100_schema.sql)
decide what is copied and copy it with its audit entry, in one statement; this module
names the request, reads the answer, and says why a replay was, or would be, refused.
"""

from __future__ import annotations

import getpass
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from psycopg.rows import class_row

from relay.sql import QUERIES
from relay.store.db import Conn

# The most rows one replay puts back (`relay replay --max-rows` raises it; the console's
# is its bulk cap). Over it a replay is refused, never cut short: half a range replayed
# would look like all of it.
MAX_ROWS = 100_000

When = datetime | timedelta  # an instant, or this long before now (the database's clock)
Via = Literal["cli", "console", "api"]


@dataclass(frozen=True, slots=True)
class Request:
    """What to replay: rows of `topic` (and `key`) sent from `since` up to `until`
    (None: now)."""

    topic: str
    since: When
    until: When | None = None
    key: str | None = None

    def params(self) -> dict[str, Any]:
        def instant(value: When | None) -> datetime | None:
            return value if isinstance(value, datetime) else None

        def ago(value: When | None) -> float | None:
            return value.total_seconds() if isinstance(value, timedelta) else None

        return {
            "topic": self.topic,
            "key": self.key,
            "since": instant(self.since),
            "since_ago": ago(self.since),
            "until": instant(self.until),
            "until_ago": ago(self.until),
        }


@dataclass(frozen=True, slots=True)
class Replay:
    """The answer of `replay` (its columns): the range as used, the history's span (None:
    nothing kept), how many rows match, and for a replay made its id (its audit entry's,
    the `relay-replay` header's value), how many rows went in, and the first and last
    new outbox id."""

    sent_from: datetime
    sent_until: datetime
    kept_since: datetime | None
    kept_until: datetime | None
    matching: int
    replay_id: int | None
    replayed: int | None  # rows the outbox took (fewer if an app's trigger dropped some)
    first_id: int | None
    last_id: int | None


def count(conn: Conn, request: Request) -> Replay:
    """How many rows a replay would put back (a dry run; the console's confirmation)."""
    return _run(conn, request, max_rows=0, expected=None, actor=None, via=None)


def replay(
    conn: Conn,
    request: Request,
    *,
    max_rows: int,
    actor: str,
    via: Via,
    expected: int | None = None,
) -> Replay:
    """Put the rows back, if `refusal` finds nothing against it (and, given `expected`,
    exactly that many match); else change nothing. `replay_id` says which."""
    return _run(conn, request, max_rows=max_rows, expected=expected, actor=actor, via=via)


def _run(
    conn: Conn,
    request: Request,
    *,
    max_rows: int,
    expected: int | None,
    actor: str | None,
    via: Via | None,
) -> Replay:
    params = {
        **request.params(),
        "max_rows": max_rows,
        "expected": expected,
        "actor": actor,
        "via": via,
    }
    with conn.cursor(row_factory=class_row(Replay)) as cur:
        found = cur.execute(QUERIES.replay, params).fetchone()
    assert found is not None  # one row, always
    return found


def refusal(found: Replay, max_rows: int) -> str | None:
    """Why these rows may not be replayed, if so: no history, a range that starts before
    it (rows sent then may be gone), or more rows than `max_rows`. None: they may (zero
    rows matching is nothing to do, not a refusal)."""
    if found.sent_until <= found.sent_from:
        return (
            f"the range is empty: it starts at {stamp(found.sent_from)} and ends at"
            f" {stamp(found.sent_until)} (never later than now)"
        )
    if found.kept_since is None:
        return (
            "no sent rows are kept (outbox_sent is empty): retention is off"
            " (RELAY_RETENTION_SECONDS=0), or nothing was sent since it was turned on"
        )
    if found.sent_from < found.kept_since:
        return (
            f"the range starts at {stamp(found.sent_from)}, before the oldest row kept (sent"
            f" at {stamp(found.kept_since)}): rows sent before then may be gone, and the"
            f" replay would miss them; start at {stamp(found.kept_since)} or later"
        )
    if found.matching > max_rows:
        return (
            f"{found.matching:,} rows match, more than the {max_rows:,} one replay may put"
            " back: narrow the range or the key"
        )
    return None


def describe(request: Request, found: Replay) -> str:
    """`topic orders (key k-1) sent from ... to ...`, the range as used."""
    key = "" if request.key is None else f" (key {request.key!r})"
    return (
        f"topic {request.topic!r}{key} sent from {stamp(found.sent_from)}"
        f" to {stamp(found.sent_until)}"
    )


def kept(found: Replay) -> str:
    """The history's span, for a message about it."""
    if found.kept_since is None or found.kept_until is None:
        return "no sent rows are kept"
    return f"the rows kept were sent from {stamp(found.kept_since)} to {stamp(found.kept_until)}"


def stamp(value: datetime) -> str:
    """UTC, ISO 8601 to the microsecond: what `--since` takes back exactly."""
    return value.astimezone(UTC).isoformat()


def shell_user() -> str:
    """Who runs `relay replay`, for the audit: the OS user, or `cli` if it has no name."""
    try:
        return getpass.getuser() or "cli"
    except (OSError, KeyError):
        return "cli"
