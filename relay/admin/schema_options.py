"""What `relay migrate` builds on request, beside the migrations: a shard count's
indexes (`--shards N`), a fairness grouping's (`--fairness-group`), the key index taken
away or back (`--without-key-index`, `--with-key-index`) and the NOTIFY trigger
(`--notify-trigger`). Each idempotent, each index built CONCURRENTLY."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psycopg
from psycopg import sql

from relay.drain.fairness import FairnessGroup
from relay.errors import MigrationError
from relay.observe.logging import get_logger
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import db

log = get_logger("relay.migrate")

# The fair fetch's walk over keys, and the one index besides the primary
# key that every row the app inserts enters: RELAY_FAIRNESS=off reads neither it nor a
# shard count's own (`relay migrate --without-key-index`).
KEY_INDEX = "outbox_key_hash_idx"


def shard_index_names(shards: int) -> tuple[str, str]:
    """The two indexes a count of `shards` needs: unsent rows that are due by id, and
    by key hash."""
    return f"outbox_shards_{shards}_due_idx", f"outbox_shards_{shards}_due_key_hash_idx"


def shard_index_state(conn: db.Conn, shards: int) -> dict[str, bool]:
    """Each index `shards` needs: built and valid (False: absent, or an invalid leftover
    of a CONCURRENTLY build that failed)."""
    return index_state(conn, shard_index_names(shards))


def index_state(conn: db.Conn, names: Sequence[str]) -> dict[str, bool]:
    """Each of these indexes of the outbox: built and valid."""
    found = _found(conn, names)
    return {name: found.get(name, False) for name in names}


def _found(conn: db.Conn, names: Sequence[str]) -> dict[str, bool]:
    """Those of these indexes of the outbox that exist, each with whether it is valid
    (an invalid one is the leftover of a CONCURRENTLY build that failed)."""
    return {
        r["name"]: bool(r["valid"])
        for r in conn.execute(QUERIES.shard_index_state, {"names": list(names)})
    }


@contextmanager
def _concurrently(settings: CommonSettings) -> Iterator[db.Conn]:
    """A session for CREATE / DROP INDEX CONCURRENTLY (outside a transaction, with no
    statement timeout to cut a build short); its errors are migration errors."""
    with db.connect(settings, purpose="migrate") as conn:
        conn.autocommit = True
        conn.execute(QUERIES.migrations_no_timeout)
        try:
            yield conn
        except psycopg.Error as exc:
            raise MigrationError(db.describe_error(exc)) from exc


def create_shard_indexes(settings: CommonSettings, shards: int) -> list[str]:
    """`relay migrate --shards N`: build (CONCURRENTLY, so the app's inserts go on) the
    indexes that let each of N shards fetch only its own rows: the one by key only while
    the outbox has its key index (`--without-key-index` took both away, and a later run
    must not bring one back). Idempotent; an invalid leftover of a failed build is
    dropped and built again. Returns the names built."""
    if shards < 2:
        return []
    built: list[str] = []
    with _concurrently(settings) as conn:
        keyed = KEY_INDEX in _found(conn, [KEY_INDEX])
        names = shard_index_names(shards)[: 2 if keyed else 1]
        state = shard_index_state(conn, shards)
        for name, query in zip(
            names, (QUERIES.shard_index_unsent, QUERIES.shard_index_keys), strict=False
        ):
            if state[name]:
                continue
            index = sql.Identifier(name)
            # An invalid leftover of a build that failed half-way goes first.
            conn.execute(sql.SQL(QUERIES.shard_index_drop).format(index=index))
            conn.execute(sql.SQL(query).format(index=index, shards=sql.Literal(shards)))
            built.append(name)
            log.info("migration.shard_index", name=name, shards=shards)
    return built


def set_key_index(settings: CommonSettings, wanted: bool) -> list[str]:
    """`relay migrate --with-key-index` / `--without-key-index`: build (CONCURRENTLY, as
    0100_schema.sql does) or drop (CONCURRENTLY) the fair fetch's key index; dropping
    it, every shard count's key index too (`relay migrate --shards N` builds a count's
    again only with the outbox's). Only once every relay runs with RELAY_FAIRNESS=off
    may they go: a fair fetch without them reads the whole backlog
    (docs/howto/lean-writes.md). Idempotent; an invalid leftover of a failed build is
    dropped first. Returns the names built or dropped."""
    changed: list[str] = []
    with _concurrently(settings) as conn:
        names = [KEY_INDEX]
        if not wanted:
            names += [r["name"] for r in conn.execute(QUERIES.shard_key_indexes)]
        valid = _found(conn, names)
        for name in names:
            index = sql.Identifier(name)
            if wanted and valid.get(name):
                continue
            if name in valid:  # not wanted, or an invalid leftover
                conn.execute(sql.SQL(QUERIES.shard_index_drop).format(index=index))
            if wanted:
                conn.execute(sql.SQL(QUERIES.key_index).format(index=index))
            if wanted or name in valid:
                changed.append(name)
    log.info("migration.key_index", wanted=wanted, changed=changed)
    return changed


def create_fairness_index(settings: CommonSettings, group: FairnessGroup, shards: int) -> bool:
    """`relay migrate --fairness-group SPEC`: build (CONCURRENTLY) the index the round
    over `group`'s groups walks, for a shard count. Idempotent, as the shard indexes.
    Whether it was built now."""
    name = group.index_name(shards)
    index = sql.Identifier(name)
    with _concurrently(settings) as conn:
        if index_state(conn, [name])[name]:
            return False
        conn.execute(sql.SQL(QUERIES.shard_index_drop).format(index=index))
        shard_column = (
            sql.SQL("outbox_shard(key, id, {}),").format(sql.Literal(shards))
            if shards > 1
            else sql.SQL("")
        )
        conn.execute(
            sql.SQL(QUERIES.fairness_index).format(
                index=index,
                shard_column=shard_column,
                kind=sql.Literal(group.kind),
                arg=sql.Literal(group.arg),
            )
        )
        comment = f"RELAY_FAIRNESS_GROUP={group.spec}" + (
            f" with RELAY_SHARDS={shards}" if shards > 1 else ""
        )
        comment_on = sql.SQL(QUERIES.fairness_index_comment)
        conn.execute(comment_on.format(index=index, comment=sql.Literal(comment)))
    log.info("migration.fairness_index", name=name, group=group.spec, shards=shards)
    return True


def set_notify_trigger(settings: CommonSettings, channel: str | None) -> None:
    """`relay migrate --notify-trigger CHANNEL` (or `--drop-notify-trigger`: None): the
    outbox's optional NOTIFY trigger for plain-SQL apps (docs/howto/wake-up.md, "Instant
    wake-up")."""
    with db.connect(settings, purpose="migrate") as conn:
        try:
            if channel is None:
                conn.execute(QUERIES.notify_trigger_drop)
            else:
                conn.execute(
                    sql.SQL(QUERIES.notify_trigger_create).format(channel=sql.Literal(channel))
                )
        except psycopg.Error as exc:
            raise MigrationError(db.describe_error(exc)) from exc
    log.info("migration.notify_trigger", channel=channel, present=channel is not None)
