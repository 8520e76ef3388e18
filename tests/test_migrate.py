"""`relay migrate`: idempotent, safe from several replicas at once, exact schema."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psycopg
import pytest

from relay.admin.migrate import migrate, migrations_dir, schema_state
from relay.settings import CommonSettings
from relay.store import db
from tests.conftest import REPO, relay_command, relay_env


def run_migrate(dsn: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        relay_command("migrate"),
        env=relay_env(dsn),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )


def test_four_concurrent_migrators_apply_each_file_once(empty_db: str) -> None:
    procs = [run_migrate(empty_db) for _ in range(4)]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outputs
    applied = [out.decode() for out, _ in outputs]
    files = sorted(p.name for p in migrations_dir().glob("0*.sql"))
    # The schema file, and the two upgrade steps a fresh database does not take.
    assert files == ["0023_one_outbox.sql", "0024_one_outbox_retire.sql", "0100_schema.sql"]
    assert sum("0100_schema.sql" in text for text in applied) == 1
    assert not any("0023" in text or "0024" in text for text in applied), applied
    with psycopg.connect(empty_db) as conn:
        rows = conn.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
    assert rows == [("0100",)]


def test_migrate_twice_is_a_no_op(empty_db: str) -> None:
    first = run_migrate(empty_db).communicate(timeout=60)[0].decode()
    second = run_migrate(empty_db).communicate(timeout=60)[0].decode()
    assert first.startswith("applied 1 migration(s)")
    assert second.strip() == "applied 0 migration(s)"


def test_the_schema_version_stops_before_a_migration_that_waits_for_a_rollout(
    empty_db: str, tmp_path: Path
) -> None:
    """A migration that waits for a rollout lets later ones in (relay/admin/migrate.py). The
    schema's version is then the last one with every earlier one applied, and the one
    waiting is named: the highest applied would claim the waiting one is in."""
    files = {
        "0001_table.sql": "CREATE TABLE t (id integer); CREATE INDEX t_old_idx ON t (id);",
        "0002_index.sql": "CREATE INDEX t_new_idx ON t (id DESC);",
        "0003_retire.sql": "-- after-rollout-of: 0002\nDROP INDEX t_old_idx;",
        "0004_column.sql": "ALTER TABLE t ADD COLUMN note text;",
    }
    settings = CommonSettings(database_url=empty_db)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        if name == "0001_table.sql":  # the release before: its relays read t_old_idx
            assert migrate(settings, tmp_path).applied == [name]
    upgrade = migrate(settings, tmp_path)
    assert upgrade.applied == ["0002_index.sql", "0004_column.sql"]
    with db.connect(settings, purpose="test") as conn:
        state = schema_state(conn, tmp_path)
    assert (state.version, state.not_applied) == ("0002", ["0003_retire.sql"])
    assert state.describe() == "0002; not applied: 0003_retire.sql"
    migrate(settings, tmp_path)
    with db.connect(settings, purpose="test") as conn:
        state = schema_state(conn, tmp_path)
    assert (state.version, state.not_applied, state.describe()) == ("0004", [], "0004")
    (tmp_path / "0004_column.sql").unlink()  # an older release's view of this database
    with db.connect(settings, purpose="test") as conn:
        state = schema_state(conn, tmp_path)
    assert state.describe() == "0003; applied by a newer release: 0004"


def test_the_outbox_has_twelve_columns_and_three_indexes(database: str) -> None:
    """The 1.0 outbox: the app's columns, then the bookkeeping of a row still to send;
    the primary key, the key hash walk of rows the drain may take, and the rows waiting."""
    with psycopg.connect(database) as conn:
        columns = conn.execute(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns"
            " WHERE table_name = 'outbox' ORDER BY ordinal_position"
        ).fetchall()
        indexes: dict[str, str] = dict(
            conn.execute(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'outbox'"
            ).fetchall()
        )
    stamp = "timestamp with time zone"
    assert columns == [
        ("id", "bigint", "NO"),
        ("message_id", "uuid", "NO"),
        ("topic", "text", "NO"),
        ("key", "text", "YES"),
        ("payload", "bytea", "YES"),
        ("headers", "jsonb", "YES"),
        ("created_at", stamp, "NO"),
        ("attempts", "integer", "NO"),
        ("next_attempt_at", stamp, "YES"),
        ("last_error", "text", "YES"),
        ("available_at", stamp, "YES"),
        ("promoted_at", stamp, "YES"),
    ]
    assert set(indexes) == {"outbox_pkey", "outbox_key_hash_idx", "outbox_waiting_idx"}
    assert indexes["outbox_key_hash_idx"].endswith(
        "(outbox_key_hash(key), id) WHERE ((available_at IS NULL) OR (promoted_at IS NOT NULL))"
    )
    assert indexes["outbox_waiting_idx"].endswith(
        "(key, id) WHERE ((next_attempt_at IS NOT NULL)"
        " OR ((available_at IS NOT NULL) AND (promoted_at IS NULL)))"
    )


def test_relay_role_has_exactly_the_granted_rights(relay_dsn: str) -> None:
    """The least-privilege role can drain, and cannot write outbox rows or DDL."""
    with psycopg.connect(relay_dsn, autocommit=True) as conn:
        conn.execute("SELECT id FROM outbox LIMIT 1")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO outbox (topic) VALUES ('t')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("TRUNCATE outbox")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM schema_migrations")
