"""`relay migrate`: apply migrations/*.sql in order, once each, from any number of replicas."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import psycopg

from relay.errors import MigrationError
from relay.observe.logging import get_logger
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import db

log = get_logger("relay.migrate")

_FILE = re.compile(r"^(?P<version>\d{4})_[a-z0-9_]+\.sql$")
# A migration that finds the database not ready for it yet (rows an earlier release left
# that it must not strand, say) raises this SQLSTATE, saying why: it is rolled back and
# waits for a later run, as one waiting for a rollout does.
WAITS_SQLSTATE = "RLW01"


# A migration that removes what relays of an earlier release read says which migration
# those relays predate: it is applied only once that one was applied by an earlier run.
_AFTER_ROLLOUT = re.compile(r"^-- after-rollout-of: (?P<version>\d{4})$", re.MULTILINE)
# A schema file for a fresh database says which migrations of an earlier release it
# stands for: a database that ran all of them has it already.
_REPLACES = re.compile(r"^-- replaces: (?P<first>\d{4})-(?P<last>\d{4})$", re.MULTILINE)


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

    @property
    def replaces(self) -> frozenset[str]:
        """The versions this file stands for on a database that ran them all."""
        found = _REPLACES.search(self.sql)
        if not found:
            return frozenset()
        first, last = int(found["first"]), int(found["last"])
        return frozenset(f"{n:04d}" for n in range(first, last + 1))

    def held_by(self, applied: set[str] | dict[str, str]) -> bool:
        """Whether a database with `applied` has this file's schema: it ran this file,
        or every migration the file replaces."""
        return self.version in applied or (bool(self.replaces) and self.replaces <= set(applied))


def _standing(migrations: list[Migration], applied: set[str]) -> dict[str, str]:
    """What each migration is to a database with `applied`: "held" (applied, or its
    schema there by other files), "due" (to apply), or "stepped" (a schema file whose
    upgrade steps, the files among those it replaces, bring the database to it).

    A schema file replaces the migrations of an earlier release and the steps that
    upgrade a database that release migrated. A fresh database takes the schema file
    alone and holds its steps; one the earlier release migrated takes the steps and
    then holds the schema file."""
    standing = {m.version: "held" if m.held_by(applied) else "due" for m in migrations}
    for schema in migrations:
        if not schema.replaces:
            continue
        if schema.version in applied or not schema.replaces & applied:
            # Applied, or due on a fresh database: its steps are not for this one.
            for step in migrations:
                if step.version in schema.replaces:
                    standing[step.version] = "held"
        elif standing[schema.version] == "due":
            standing[schema.version] = "stepped"
    return standing


@dataclass(frozen=True, slots=True)
class Migrated:
    """What a `relay migrate` run did."""

    applied: list[str]
    # The migrations held back until a rolling upgrade is done, and why (one line
    # each); None when none is.
    waiting: str | None = None


def migrations_dir() -> Path:
    """Inside an installed wheel the files ship as relay/migrations; in a checkout they
    live at the top of the repository, where a DBA finds them."""
    packaged = Path(str(resources.files("relay"))) / "migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "migrations"


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
    read: it waits while this run is the one that applied NNNN, since replicas of that
    earlier release may still be running; a fresh database (nothing applied yet) has
    none, and takes everything at once. The migrations after a waiting one still go
    in: this release's relays need them, and nothing a later migration does can need
    what a waiting one does (a test holds every after-rollout file to retiring: it
    drops and replaces, and creates no table, index, type or column).
    """
    # Those that only retire indexes go last: one that fails (its lock timeout) then
    # leaves nothing this release needs unapplied.
    migrations = sorted(load(directory), key=lambda m: m.after_rollout_of is not None)
    applied_now: list[str] = []
    waiting: list[str] = []
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
            _check_replaced_whole(migrations, applied)
            standing = _standing(migrations, set(applied))
            for migration in migrations:
                if migration.version in applied:
                    _check_unchanged(migration, applied[migration.version])
                    continue
                if standing[migration.version] != "due":
                    continue
                waits = _waits_for_rollout(migration, applied)
                if waits is not None:
                    log.warning("migration.waiting", name=migration.name, reason=waits)
                    waiting.append(waits)
                    continue
                try:
                    with conn.transaction():
                        # A migration file is trusted SQL shipped with the relay.
                        conn.execute(migration.sql)
                        conn.execute(
                            QUERIES.migrations_record,
                            {"version": migration.version, "checksum": migration.checksum},
                        )
                except psycopg.Error as exc:
                    # Only a migration that retires may wait: this release needs every
                    # other one (`missing`), and the ones after it may build on it.
                    if exc.sqlstate != WAITS_SQLSTATE or migration.after_rollout_of is None:
                        raise
                    waits = f"{migration.name} waits: {exc.diag.message_primary}"
                    log.warning("migration.waiting", name=migration.name, reason=waits)
                    waiting.append(waits)
                    continue
                applied_now.append(migration.name)
                log.info("migration.applied", name=migration.name)
        except psycopg.Error as exc:
            raise MigrationError(db.describe_error(exc)) from exc
        finally:
            if not conn.closed and not conn.broken:
                conn.execute(QUERIES.migrations_unlock)
    return Migrated(applied_now, "\n".join(waiting) or None)


def missing(conn: db.Conn, directory: Path | None = None) -> list[str]:
    """The migrations this release's relay needs and the database lacks: every one but
    those that only retire what an earlier release read, which wait for a rollout."""
    applied = {r["version"] for r in conn.execute(QUERIES.migrations_applied)}
    known = load(directory)
    standing = _standing(known, applied)
    return [m.name for m in known if m.after_rollout_of is None and standing[m.version] == "due"]


@dataclass(frozen=True, slots=True)
class SchemaState:
    """Where a database's schema stands, as this release counts it."""

    # The last of this release's migrations with every one before it applied (None:
    # none applied); not the highest applied, which may be past one still waiting.
    version: str | None
    not_applied: list[str]  # this release's migrations the database lacks, by name
    newer: list[str] = field(default_factory=list)  # applied, unknown to this release

    def describe(self) -> str:
        """`0100`, or `0100; not applied: 0101_retire_x.sql` (one that waits
        for a rollout, or a database an older `relay migrate` left behind), and the
        versions a newer release applied, if any."""
        parts = [self.version or "none"]
        if self.not_applied:
            parts.append(f"not applied: {', '.join(self.not_applied)}")
        if self.newer:
            parts.append(f"applied by a newer release: {', '.join(self.newer)}")
        return "; ".join(parts)


def schema_state(conn: db.Conn, directory: Path | None = None) -> SchemaState:
    applied = {r["version"] for r in conn.execute(QUERIES.migrations_applied)}
    version: str | None = None
    not_applied: list[str] = []
    known = load(directory)  # in version order
    standing = _standing(known, applied)
    for migration in known:
        if standing[migration.version] == "stepped":
            # On its way there by its steps: as far as the earlier release's files went.
            version = version or max(migration.replaces & applied)
        elif standing[migration.version] == "due":
            not_applied.append(migration.name)
        elif not not_applied:
            version = migration.version
    newer = sorted(applied - {v for m in known for v in (m.version, *m.replaces)})
    return SchemaState(version, not_applied, newer)


def _check_replaced_whole(migrations: list[Migration], applied: dict[str, str]) -> None:
    """A database that ran only some of the migrations a schema file replaces, and lacks
    one this release has no file of, was left by a build from before that file: neither
    the file nor the rest of them can apply."""
    files = {m.version for m in migrations}
    for migration in migrations:
        ran = migration.replaces & set(applied)
        lost = migration.replaces - ran - files
        if ran and lost and migration.version not in applied:
            missing_ones = sorted(lost)
            raise MigrationError(
                f"this database ran migrations {min(ran)}-{max(ran)} of the schema before"
                f" {migration.name} but not {', '.join(missing_ones)}: bring it to"
                f" {max(lost)} with a build of the relay from before"
                f" {migration.name} (its migrations/ folder), then run `relay migrate` again"
            )


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
