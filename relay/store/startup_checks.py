"""What `relay run` checks of the database before it starts: each setting's schema
objects, and the migrations this release reads.

Each check refuses (SettingsError: exit 2, naming the setting and the command to run)
what would otherwise fail, or walk a whole table, on every round. A database that does
not answer now is no reason not to start: the check is skipped with a warning, and the
elector waits the outage out.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable

import psycopg

from relay.admin.migrate import missing
from relay.admin.schema_options import KEY_INDEX, index_state, shard_index_names
from relay.drain import fairness
from relay.observe.logging import get_logger
from relay.settings import Settings, SettingsError
from relay.sql import QUERIES
from relay.store import connection, db, repository
from relay.store.own_table import index_prefix

log = get_logger(__name__)


def run(settings: Settings) -> None:
    """Every check the settings call for, in order."""
    checks: list[Callable[[db.Conn, Settings], None]] = [schema]
    if settings.notify_channel is not None:
        checks.append(listen_session)
    if settings.shards > 1:
        checks.append(shard_indexes)
    elif settings.outbox_table is None:
        checks.append(key_index)
    if settings.fairness_group is not None:
        checks.append(fairness_index)
    if settings.sent_rows == "move":
        checks.append(sent_history)
    if settings.set_aside == "move":
        checks.append(dead_letters)
    if settings.outbox_table is not None:
        checks.append(own_table_key_index)  # db.connect checks the view itself
    try:
        conn = db.connect(settings, purpose="check")
    except psycopg.Error as exc:
        log.warning("startup.checks_skipped", error=db.describe_error(exc))
        return
    with conn:
        for check in checks:
            try:
                check(conn, settings)
            except psycopg.Error as exc:
                log.warning(
                    "startup.check_skipped", check=check.__name__, error=db.describe_error(exc)
                )
                if conn.broken:
                    return


def schema(conn: db.Conn, _settings: Settings) -> None:
    """PostgreSQL 14 or later (the fetch leaves out rows in flight by multirange), and
    the migrations this release reads, or its statements fail every round (a relay
    deployed before `relay migrate` ran)."""
    version = conn.info.server_version
    if version < 140000:
        raise SettingsError(
            "RELAY_DATABASE_URL",
            f"the server runs PostgreSQL {version // 10000}: this release needs 14 or later"
            " (its multiranges leave the rows in flight out of each fetch)",
        )
    lacking = missing(conn)
    if lacking:
        raise SettingsError(
            "RELAY_DATABASE_URL",
            f"the database lacks {', '.join(lacking)}: run `relay migrate` first",
        )


def listen_session(conn: db.Conn, settings: Settings) -> None:
    """RELAY_NOTIFY_CHANNEL through a transaction pooler: LISTEN needs a session of its
    own (RELAY_DATABASE_DIRECT_URL), or the listener would retry its refusal forever."""
    if (
        isinstance(conn, connection.RelayConnection)
        and conn.pooled
        and not settings.database_direct_url
    ):
        raise SettingsError("RELAY_DATABASE_DIRECT_URL", db.needs_direct("listen", direct=False))


def key_index(conn: db.Conn, settings: Settings) -> None:
    """RELAY_FAIRNESS=keys: the key index, or every fetch that shares a batch out would
    read the whole backlog to find the keys. With `off`, nothing reads it: say so if the
    app still pays for it."""
    present = index_state(conn, [KEY_INDEX])[KEY_INDEX]
    if settings.fairness == "keys" and not present:
        raise SettingsError(
            "RELAY_FAIRNESS",
            f"keys (the default) reads the index {KEY_INDEX}, which is missing: run `relay"
            " migrate --with-key-index`, or set RELAY_FAIRNESS=off (first in, first out)",
        )
    if settings.fairness == "off" and present:
        log.info(
            "startup.key_index_unread",
            index=KEY_INDEX,
            hint="with every relay at RELAY_FAIRNESS=off, `relay migrate --without-key-index`"
            " spares the app's inserts this index",
        )


def shard_indexes(conn: db.Conn, settings: Settings) -> None:
    """With shards, their indexes: without them every shard's fetch would read the
    whole backlog. RELAY_FAIRNESS=off reads only the first, by id."""
    names = shard_index_names(settings.shards)[: 1 if settings.fairness == "off" else 2]
    absent = [name for name, ok in index_state(conn, names).items() if not ok]
    if absent:
        raise SettingsError(
            "RELAY_SHARDS",
            f"{settings.shards} shards need the indexes {', '.join(absent)}:"
            f" run `relay migrate --shards {settings.shards}` first",
        )


def fairness_index(conn: db.Conn, settings: Settings) -> None:
    """RELAY_FAIRNESS_GROUP: its index, or each fetch with a full head would read every
    waiting row to find the groups."""
    assert settings.fairness_group is not None
    group = fairness.parse(settings.fairness_group)
    name = group.index_name(settings.shards)
    if not index_state(conn, [name])[name]:
        shards = f" --shards {settings.shards}" if settings.shards > 1 else ""
        raise SettingsError(
            "RELAY_FAIRNESS_GROUP",
            f"{group.spec} needs the index {name}: run"
            f" `relay migrate --fairness-group {shlex.quote(group.spec)}{shards}` first",
        )


def dead_letters(conn: db.Conn, _settings: Settings) -> None:
    """Without the grant to move dead letters out every settle that gives up on a row
    would fail, and the drain publish that batch again and again."""
    row = conn.execute(QUERIES.dead_letter_access).fetchone()
    if row is not None and row["can_move"] is False:
        raise SettingsError(
            "RELAY_DATABASE_URL",
            "the role may not move dead letters, scheduled rows and paused topics' rows"
            " out of the outbox: run migrations/grants.sql again (EXECUTE on"
            " outbox_dead_letter, outbox_park_scheduled, outbox_let_in, outbox_hold_paused"
            " and outbox_release_paused, SELECT on outbox_scheduled and outbox_paused)",
        )


def sent_history(conn: db.Conn, _settings: Settings) -> None:
    """Retention mode: without outbox_sent or its grants every settle would fail and
    the drain publish the same batch again and again."""
    problem = repository.sent_history_problem(conn)
    if problem is not None:
        raise SettingsError("RELAY_RETENTION_SECONDS", f"keeping sent rows: {problem}")


def own_table_key_index(conn: db.Conn, settings: Settings) -> None:
    """RELAY_OUTBOX_TABLE with a key: the index the round over keys walks is on the
    key's hash. An earlier release's `--own-table` built it on the
    whole key, and the fair fetch would then read the table once per key."""
    row = conn.execute(
        QUERIES.own_table_key_index_check,
        {"table": settings.outbox_table, "prefix": index_prefix(settings) + "key_"},
    ).fetchone()
    if row is not None and row["keyed"] and not row["hashed"]:
        raise SettingsError(
            "RELAY_OUTBOX_TABLE",
            f"{settings.outbox_table}'s key index is an earlier release's (on the whole key):"
            " run `relay migrate --own-table` again",
        )
