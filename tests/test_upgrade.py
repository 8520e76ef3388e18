"""Upgrades: the schema a fresh install applies (one file), and a database the previous
release migrated (0001-0022), brought to it by 0023 and, once the rollout is done, 0024,
with a relay of that release running beside this one, nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay.admin.migrate import migrate, schema_state
from relay.errors import MigrationError
from relay.settings import CommonSettings
from relay.store import db
from tests.conftest import REPO, relay_command, relay_env
from tests.harness.kafka import TansuBroker, consume
from tests.harness.postgres import PostgresServer, find_pg_bin
from tests.support import (
    dedup_by_message_id,
    insert_rows,
    outbox_indexes,
    unsent_count,
    wait_until,
)
from tests.test_operations import run_cli

# The release before 1.0: its migrations are 0001-0022; 0023 and 0024 bring a database
# it migrated to the schema migrations/0100_schema.sql builds on a fresh one.
PREVIOUS = "ee987a1"
SCHEMA_FILE = "0100_schema.sql"
STEPS = ("0023_one_outbox.sql", "0024_one_outbox_retire.sql")

# What a fresh outbox carries, and which of them an app's INSERT writes (a partial
# index whose predicate a new row fails costs the insert nothing).
INDEXES = {
    "outbox_pkey": "the id, and the fetch's walk in id order",
    "outbox_key_hash_idx": "the fair fetch's walk over keys (written by every insert)",
    "outbox_waiting_idx": "rows in a backoff or scheduled, holding their keys back",
}
WRITTEN_BY_EVERY_INSERT = {"outbox_pkey", "outbox_key_hash_idx"}


def test_a_fresh_outbox_carries_only_the_indexes_this_release_reads(database: str) -> None:
    assert set(outbox_indexes(database)) == set(INDEXES)
    # Which ones a plain INSERT writes: an index gains an entry per row it holds.
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT 't', 'k' || g % 10, 'x' FROM generate_series(1, 1000) g"
        )
        grown = {
            name
            for (name,) in conn.execute(
                "SELECT indexrelname FROM pg_stat_user_indexes"
                " WHERE relname = 'outbox' AND pg_relation_size(indexrelid) > 8192"
            )
        }
    assert grown == WRITTEN_BY_EVERY_INSERT


def release(commit: str, tmp_path: Path) -> Path:
    """The relay as it was at `commit`, from the repository's history (with its
    migrations: a release that checks the schema at start-up reads them)."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", commit, "relay", "migrations"],
            check=True,
            capture_output=True,
        ).stdout
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"needs the repository's history (a full clone): {exc.stderr.decode()}")
    folder = tmp_path / f"release-{commit}"
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def start(
    code: Path, dsn: str, kafka: TansuBroker, replica: str, **extra: str
) -> subprocess.Popen[str]:
    env = relay_env(
        dsn,
        kafka.bootstrap_servers,
        PYTHONPATH=str(code),
        RELAY_REPLICA_ID=replica,
        RELAY_LEASE_TTL_SECONDS="3",
        RELAY_BATCH_SIZE="50",
        **extra,
    )
    return subprocess.Popen(
        relay_command("run"),
        env=env,
        cwd=code,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return err


def stop_cleanly(process: subprocess.Popen[str]) -> None:
    """Stop a relay and check it logged no traceback on the way."""
    err = stop(process)
    assert "Traceback" not in err, err[-2000:]


def relay_migrate(dsn: str) -> str:
    done = subprocess.run(
        relay_command("migrate"), env=relay_env(dsn), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def every_row_arrived_in_order(
    kafka: TansuBroker, topic: str, rows: list[tuple[str, bytes]]
) -> None:
    """Each row once at least (after dedup, exactly these), each key's in its order."""
    records = dedup_by_message_id(consume(kafka.bootstrap_servers, topic, min_count=len(rows)))
    assert sorted((r.key, r.value) for r in records) == sorted(rows)
    for key in {k for k, _ in rows}:
        assert [r.value for r in records if r.key == key] == [p for k, p in rows if k == key]


def holder(dsn: str) -> str | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT holder FROM leases WHERE expires_at > now() ORDER BY epoch DESC LIMIT 1"
        ).fetchone()
    return None if row is None else str(row[0])


def dead_letters(dsn: str) -> dict[str, int]:
    """How many dead letters each place holds: moved out, and marked in place (while
    the outbox has the column for it, until 0024)."""
    with psycopg.connect(dsn) as conn:
        marks = conn.execute(
            "SELECT count(*) FROM information_schema.columns"
            " WHERE table_name = 'outbox' AND column_name = 'dead_lettered_at'"
        )
        in_place = (
            int(
                scalar_of(
                    conn.execute("SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL")
                )
            )
            if scalar_of(marks)
            else 0
        )
        moved = int(scalar_of(conn.execute("SELECT count(*) FROM outbox_dead")))
        return {"moved": moved, "in place": in_place}


def scalar_of(cursor: psycopg.Cursor[tuple[Any, ...]]) -> Any:
    row = cursor.fetchone()
    assert row is not None
    return row[0]


def schedule(dsn: str, topic: str, key: str, payload: bytes, seconds: float) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " VALUES (%s, %s, %s, now() + make_interval(secs => %s))",
            (topic, key, payload, seconds),
        )


def parked(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(scalar_of(conn.execute("SELECT count(*) FROM outbox_scheduled")))


@pytest.fixture
def previous_code(tmp_path: Path) -> Path:
    return release(PREVIOUS, tmp_path)


@pytest.fixture
def previous_db(pg: PostgresServer, previous_code: Path) -> Iterator[str]:
    """A database the previous release's own `relay migrate` made."""
    name = f"u_{uuid.uuid4().hex[:10]}"
    dsn = pg.create_database(name)
    env = {**relay_env(dsn), "PYTHONPATH": str(previous_code)}
    done = subprocess.run(
        relay_command("migrate"),
        env=env,
        cwd=previous_code,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "applied 22 migration(s)" in done.stdout, done.stdout
    yield dsn
    pg.drop_database(name)


def test_the_previous_release_is_in_the_history() -> None:
    """A guard for the tests below: PREVIOUS names a commit whose migrations are the
    ones the schema file replaces, and no schema file of its own."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", PREVIOUS, "migrations/"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "GIT_PAGER": "cat"},
    ).stdout.split()
    versions = sorted(Path(p).name[:4] for p in listed if Path(p).name[0].isdigit())
    assert versions == [f"{n:04d}" for n in range(1, 23)]


def schema_dump(dsn: str) -> list[str]:
    """The schema as pg_dump prints it, without its session-specific lines."""
    out = subprocess.run(
        [str(find_pg_bin() / "pg_dump"), "--schema-only", "--no-owner", "--no-privileges", dsn],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [
        line
        for line in out.splitlines()
        if not line.startswith(("--", "\\restrict", "\\unrestrict")) and line.strip()
    ]


def seeded_state(dsn: str) -> list[tuple[Any, ...]]:
    """The rows the schema itself writes."""
    with psycopg.connect(dsn) as conn:
        return [
            *conn.execute(
                "SELECT generation, isfinite(started_at) FROM outbox_sent_generations"
                " ORDER BY generation"
            ).fetchall(),
            *conn.execute("SELECT single, enabled FROM outbox_parking").fetchall(),
        ]


def upgrade(dsn: str) -> None:
    """`relay migrate` as a rolling upgrade runs it: once before the rollout (0023; 0024
    waits), once after it (0024)."""
    settings = CommonSettings(database_url=dsn)
    first = migrate(settings)
    assert first.applied == [STEPS[0]]
    assert first.waiting is not None and STEPS[1] in first.waiting
    assert migrate(settings).applied == [STEPS[1]]


def test_a_fresh_install_applies_one_file_and_an_upgraded_database_has_its_schema(
    empty_db: str, previous_db: str
) -> None:
    """The schema file is what 0023 and 0024 make of the previous release's schema,
    object for object: the same tables, columns, indexes, functions, views, types and
    comments as pg_dump prints them, and the same rows in the tables the schema fills."""
    migrated = migrate(CommonSettings(database_url=empty_db))
    assert migrated.applied == [SCHEMA_FILE] and migrated.waiting is None
    upgrade(previous_db)
    dumped = schema_dump(empty_db)
    assert "CREATE TABLE public.outbox (" in dumped and len(dumped) > 500
    assert dumped == schema_dump(previous_db)
    assert seeded_state(empty_db) == seeded_state(previous_db)


def test_a_database_the_previous_release_migrated_takes_the_two_steps(
    previous_db: str,
) -> None:
    settings = CommonSettings(database_url=previous_db)
    with db.connect(settings, purpose="test") as conn:
        before = schema_state(conn)
    assert (before.version, before.not_applied) == ("0022", list(STEPS))
    first = migrate(settings)
    assert first.applied == [STEPS[0]]
    with db.connect(settings, purpose="test") as conn:
        during = schema_state(conn)
    assert (during.version, during.not_applied) == ("0023", [STEPS[1]])
    assert migrate(settings).applied == [STEPS[1]]
    assert migrate(settings).applied == []
    with db.connect(settings, purpose="test") as conn:
        after = schema_state(conn)
    assert (after.version, after.not_applied, after.newer) == ("0100", [], [])


def test_a_database_left_part_way_through_the_previous_migrations_is_refused(
    empty_db: str, previous_code: Path, tmp_path: Path
) -> None:
    """Nothing applies to it: neither the schema file (its tables exist) nor the rest of
    the old migrations (this release has none); the error says how to go on."""
    folder = tmp_path / "up-to-0014"
    folder.mkdir()
    for path in sorted((previous_code / "migrations").glob("00*.sql")):
        if path.name[:4] <= "0014":
            shutil.copy(path, folder / path.name)
    migrate(CommonSettings(database_url=empty_db), folder)
    with pytest.raises(MigrationError, match=r"not 0015, 0016.*0022: bring it to 0022"):
        migrate(CommonSettings(database_url=empty_db))
    assert "outbox_due_key_hash_idx" not in outbox_indexes(empty_db)


def test_a_rolling_upgrade_from_the_previous_release_delivers_everything_in_order(
    previous_db: str, previous_code: Path, kafka: TansuBroker, topic: str
) -> None:
    """The previous release drains, dead-letters one topic's rows (mapped to a name no
    broker takes) and a row over 16 MiB (marked in place, as it does), and parks a row
    scheduled for later in outbox_scheduled; this release's `relay migrate` applies 0023
    (the marked row moved out), a relay of this release joins and takes over, and once
    the old one is gone a second `relay migrate` applies 0024. The scheduled row is let
    in when due, and every dead letter is still listed, then requeued (the mapping
    fixed) and delivered: every row arrives, each key in order; the large row, still
    too large, is dead-lettered again, moved out whole."""
    dsn = previous_db
    refused = f"{topic}-refused"
    kafka.create_topic(refused, partitions=3)
    bad_map = {"RELAY_TOPIC_MAP": json.dumps({refused: "not a topic!"})}
    now = [(f"k{n % 5}", f"k{n % 5}:{n}".encode()) for n in range(300)]
    later = ("k0", b"k0:scheduled")
    rows = [*now[:100], later, ("k0", b"k0:behind"), *now[100:]]
    bad = [(f"b{n % 3}", f"b{n % 3}:{n}".encode()) for n in range(60)]
    old = start(previous_code, dsn, kafka, "old", **bad_map)
    new: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: holder(dsn) == "old", timeout=20, message="old relay leads")
        insert_rows(dsn, topic, now[:100])
        insert_rows(dsn, refused, bad[:30])
        insert_rows(dsn, f"{topic}-huge", [("h", b"x" * (17 << 20))])
        schedule(dsn, topic, *later, seconds=8)
        insert_rows(dsn, topic, [("k0", b"k0:behind")])
        wait_until(lambda: parked(dsn) == 1, timeout=20, message="the old relay parks it")
        wait_until(lambda: dead_letters(dsn) == {"moved": 30, "in place": 1}, timeout=30)
        migrated = relay_migrate(dsn)
        assert migrated.startswith(f"applied 1 migration(s): {STEPS[0]}"), migrated
        assert f"{STEPS[1]} waits" in migrated, migrated
        assert dead_letters(dsn) == {"moved": 31, "in place": 0}
        new = start(REPO, dsn, kafka, "new", **bad_map)
        stop_cleanly(old)
        wait_until(lambda: holder(dsn) == "new", timeout=20, message="new takes over")
        assert relay_migrate(dsn).startswith(f"applied 1 migration(s): {STEPS[1]}")
        insert_rows(dsn, topic, now[100:200])
        insert_rows(dsn, refused, bad[30:])
        wait_until(lambda: dead_letters(dsn) == {"moved": 61, "in place": 0}, timeout=30)
        wait_until(
            lambda: parked(dsn) == 0 and unsent_count(dsn) == 0,
            timeout=30,
            message="the scheduled row let in, and everything sent",
        )
        env = relay_env(dsn)
        listed = json.loads(run_cli(env, "dead-letter", "list", "--json").stdout)
        assert len(listed) == 61 and [r["id"] for r in listed] == sorted(r["id"] for r in listed)
        stop_cleanly(new)
        new = start(REPO, dsn, kafka, "fixed")
        insert_rows(dsn, topic, now[200:])
        done = run_cli(env, "dead-letter", "requeue", "--all")
        assert done.stdout.startswith(b"requeued 61 row(s)"), done.stdout
        wait_until(lambda: unsent_count(dsn) == 0, timeout=60, message="all sent")
        assert dead_letters(dsn) == {"moved": 1, "in place": 0}
        with psycopg.connect(dsn) as conn:
            (size,) = conn.execute("SELECT octet_length(payload) FROM outbox_dead").fetchone() or (
                0,
            )
        assert size == 17 << 20
    finally:
        stop(old)
        if new is not None:
            stop_cleanly(new)
    every_row_arrived_in_order(kafka, topic, rows)
    every_row_arrived_in_order(kafka, refused, bad)
