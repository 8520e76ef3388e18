"""`relay migrate`: apply migrations/*.sql in order, once each, from any number of replicas."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import psycopg
from psycopg import sql

from relay import db
from relay.errors import MigrationError
from relay.fairness import FairnessGroup
from relay.logging import get_logger
from relay.queries import QUERIES
from relay.settings import CommonSettings

log = get_logger("relay.migrate")

_FILE = re.compile(r"^(?P<version>\d{4})_[a-z0-9_]+\.sql$")
# A migration that removes what relays of an earlier release read says which migration
# those relays predate: it is applied only once that one was applied by an earlier run.
_AFTER_ROLLOUT = re.compile(r"^-- after-rollout-of: (?P<version>\d{4})$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Migration:
    version: str
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def after_rollout_of(self) -> str | None:
        found = _AFTER_ROLLOUT.search(self.sql)
        return found["version"] if found else None


@dataclass(frozen=True, slots=True)
class Migrated:
    """What a `relay migrate` run did."""

    applied: list[str]
    # The first migration held back until a rolling upgrade is done, and why; the ones
    # after it wait too (migrations apply in order).
    waiting: str | None = None


def migrations_dir() -> Path:
    """Inside an installed wheel the files ship as relay/migrations; in a checkout they
    live at the top of the repository, where a DBA finds them."""
    packaged = Path(str(resources.files("relay"))) / "migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "migrations"


def load(directory: Path | None = None) -> list[Migration]:
    folder = directory or migrations_dir()
    found = []
    for path in sorted(folder.glob("*.sql")):
        match = _FILE.match(path.name)
        if match:  # grants.sql and other helpers are not migrations
            found.append(Migration(match["version"], path.name, path.read_text("utf-8")))
    if not found:
        raise MigrationError(f"no migrations found in {folder}")
    return found


def migrate(settings: CommonSettings, directory: Path | None = None) -> Migrated:
    """Apply what is pending, in order, each in its transaction. Safe to run concurrently.

    A migration marked `-- after-rollout-of: NNNN` drops what relays from before NNNN
    read: it waits (and so do the later ones) while this run is the one that applied
    NNNN, since replicas of that earlier release may still be running; a fresh database
    (nothing applied yet) has none, and takes everything at once.
    """
    migrations = load(directory)
    applied_now: list[str] = []
    waiting: str | None = None
    with db.connect(settings, purpose="migrate") as conn:
        # DDL may wait behind the app's traffic; do not let the relay's own timeouts
        # (meant for the hot path) cut a migration short.
        conn.execute(QUERIES.migrations_no_timeout)
        conn.execute(QUERIES.migrations_lock)
        try:
            conn.execute(QUERIES.migrations_table)
            applied = {
                r["version"]: r["checksum"] for r in conn.execute(QUERIES.migrations_applied)
            }
            for migration in migrations:
                if migration.version in applied:
                    _check_unchanged(migration, applied[migration.version])
                    continue
                waiting = _waits_for_rollout(migration, applied)
                if waiting is not None:
                    log.warning("migration.waiting", name=migration.name, reason=waiting)
                    break
                with conn.transaction():
                    # A migration file is trusted SQL shipped with the relay.
                    conn.execute(migration.sql)
                    conn.execute(
                        QUERIES.migrations_record,
                        {"version": migration.version, "checksum": migration.checksum},
                    )
                applied_now.append(migration.name)
                log.info("migration.applied", name=migration.name)
        except psycopg.Error as exc:
            raise MigrationError(db.describe_error(exc)) from exc
        finally:
            if not conn.closed and not conn.broken:
                conn.execute(QUERIES.migrations_unlock)
    return Migrated(applied_now, waiting)


def _check_unchanged(migration: Migration, checksum: str) -> None:
    if checksum != migration.checksum:
        raise MigrationError(
            f"{migration.name} was changed after it was applied; add a new migration instead"
        )


def _waits_for_rollout(migration: Migration, applied_before: dict[str, str]) -> str | None:
    """Why `migration` may not run in this run, if it may not."""
    needs = migration.after_rollout_of
    if needs is None or not applied_before or needs in applied_before:
        return None
    return (
        f"{migration.name} waits: it drops what relays from before migration {needs}"
        f" read, and this run applied {needs}; run `relay migrate` again once every"
        " replica runs this release"
    )


def shard_index_names(shards: int) -> tuple[str, str]:
    """The two indexes a count of `shards` needs: unsent rows that are due by id, and
    their keys. (`outbox_shards_N_idx` and `_key_idx`, built before scheduled delivery,
    also held rows not yet due; a relay of that release still reads them.)"""
    return f"outbox_shards_{shards}_due_idx", f"outbox_shards_{shards}_due_key_idx"


def shard_index_state(conn: db.Conn, shards: int) -> dict[str, bool]:
    """Each index `shards` needs: built and valid (False: absent, or an invalid leftover
    of a CONCURRENTLY build that failed)."""
    return index_state(conn, shard_index_names(shards))


def index_state(conn: db.Conn, names: Sequence[str]) -> dict[str, bool]:
    """Each of these indexes of the outbox: built and valid."""
    found = {
        r["name"]: bool(r["valid"])
        for r in conn.execute(QUERIES.shard_index_state, {"names": list(names)})
    }
    return {name: found.get(name, False) for name in names}


def create_shard_indexes(settings: CommonSettings, shards: int) -> list[str]:
    """`relay migrate --shards N`: build (CONCURRENTLY, so the app's inserts go on) the
    indexes that let each of N shards fetch only its own rows. Idempotent; an invalid
    leftover of a failed build is dropped and built again. Returns the names built."""
    if shards < 2:
        return []
    names = shard_index_names(shards)
    built: list[str] = []
    with db.connect(settings, purpose="migrate") as conn:
        conn.autocommit = True  # CREATE INDEX CONCURRENTLY runs outside a transaction
        conn.execute(QUERIES.migrations_no_timeout)
        try:
            state = shard_index_state(conn, shards)
            for name, query in zip(
                names, (QUERIES.shard_index_unsent, QUERIES.shard_index_keys), strict=True
            ):
                if state[name]:
                    continue
                index = sql.Identifier(name)
                # An invalid leftover of a build that failed half-way goes first.
                conn.execute(sql.SQL(QUERIES.shard_index_drop).format(index=index))
                conn.execute(sql.SQL(query).format(index=index, shards=sql.Literal(shards)))
                built.append(name)
                log.info("migration.shard_index", name=name, shards=shards)
        except psycopg.Error as exc:
            raise MigrationError(db.describe_error(exc)) from exc
    return built


def create_fairness_index(settings: CommonSettings, group: FairnessGroup, shards: int) -> bool:
    """`relay migrate --fairness-group SPEC`: build (CONCURRENTLY) the index the round
    over `group`'s groups walks, for a shard count. Idempotent, as the shard indexes.
    Whether it was built now."""
    name = group.index_name(shards)
    index = sql.Identifier(name)
    with db.connect(settings, purpose="migrate") as conn:
        conn.autocommit = True  # CREATE INDEX CONCURRENTLY runs outside a transaction
        conn.execute(QUERIES.migrations_no_timeout)
        try:
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
            conn.execute(
                sql.SQL(QUERIES.fairness_index_comment).format(
                    index=index, comment=sql.Literal(comment)
                )
            )
        except psycopg.Error as exc:
            raise MigrationError(db.describe_error(exc)) from exc
    log.info("migration.fairness_index", name=name, group=group.spec, shards=shards)
    return True


def set_notify_trigger(settings: CommonSettings, channel: str | None) -> None:
    """`relay migrate --notify-trigger CHANNEL` (or `--drop-notify-trigger`: None): the
    outbox's optional NOTIFY trigger for plain-SQL apps (README "Instant wake-up")."""
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
