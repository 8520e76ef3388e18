"""Upgrades: the index set a fresh outbox carries, and the rolling upgrades that retire
a previous release's indexes (migrations 0010 and 0017) or move its dead letters out of
the outbox (0019) with a relay of that release running beside this one, nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tarfile
from io import BytesIO
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay.admin.migrate import migrate, migrations_dir
from relay.settings import CommonSettings
from tests.conftest import REPO, relay_command, relay_env
from tests.harness.kafka import TansuBroker, consume
from tests.support import (
    dedup_by_message_id,
    insert_rows,
    outbox_indexes,
    unsent_count,
    wait_until,
)
from tests.test_operations import run_cli

# The relay before scheduled delivery (migrations 0008-0009), which reads
# outbox_unsent_idx and outbox_key_idx: "the previous release" of that upgrade.
BEFORE_0009 = "26f30cd^"
LEGACY = ("outbox_unsent_idx", "outbox_key_idx")
# The relay before the key hash index (migrations 0015-0017), which walks keys through
# outbox_due_key_idx.
BEFORE_0015 = "e0577bc"
# The relay before outbox_dead (migrations 0018-0019), which marks dead letters in place.
BEFORE_0018 = "1aa5bfd"
# The relay before outbox_scheduled (migrations 0020-0021), which knows no rows moved out.
BEFORE_0020 = "b04e16b"

# What a fresh outbox carries, and which of them an app's INSERT writes (a partial
# index whose predicate a new row fails costs the insert nothing).
INDEXES = {
    "outbox_pkey": "the id, and the fetch's walk in id order",
    "outbox_due_key_hash_idx": "the fair fetch's walk over keys (written by every insert)",
    "outbox_backoff_idx": "rows waiting out a backoff, blocking their keys",
    "outbox_failing_rows_idx": "rows that failed, for the lag and the CLI",
    "outbox_dead_letter_idx": "dead letters, for listing and requeueing",
    "outbox_sent_idx": "sent rows, for the retention purge",
    "outbox_scheduled_idx": "scheduled rows by due time, for their promotion",
    "outbox_scheduled_key_idx": "scheduled rows by key, blocking their keys",
}
WRITTEN_BY_EVERY_INSERT = {"outbox_pkey", "outbox_due_key_hash_idx"}


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


@pytest.fixture
def previous_release(tmp_path: Path) -> Path:
    """The relay of the release before 0009."""
    return release(BEFORE_0009, tmp_path)


def start(
    code: Path, dsn: str, kafka: TansuBroker, replica: str, **extra: str
) -> subprocess.Popen[str]:
    if code == REPO:
        # The earlier releases partition by CRC32: this one keeps their placement, as
        # docs/howto/upgrades.md says, so a key stays on its partition across the roll.
        extra = {"RELAY_KAFKA__PARTITIONER": "consistent_random", **extra}
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


def test_a_rolling_upgrade_retires_the_old_indexes_only_after_the_old_relays_are_gone(
    db_at_0007: str, previous_release: Path, kafka: TansuBroker, topic: str
) -> None:
    """The previous release drains; this release's `relay migrate` adds 0008-0009 and
    holds 0010 back; a relay of this release joins, the old one stops and the new one
    takes over; a second `relay migrate` drops the old indexes; the new relay goes on.
    Every row arrives, each key in order."""
    rows = [(f"k{n % 7}", f"k{n % 7}:{n // 7}".encode()) for n in range(700)]
    old = start(previous_release, db_at_0007, kafka, "old")
    new: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: holder(db_at_0007) == "old", timeout=20, message="old relay leads")
        insert_rows(db_at_0007, topic, rows[:200])
        output = relay_migrate(db_at_0007)
        assert "0008" in output and "0009" in output and "0010" not in output.splitlines()[0]
        assert "0010_retire_legacy_indexes.sql waits" in output, output
        # The migrations after it go in: this release's relay needs them.
        assert "0015_key_hash_index.sql" in output.splitlines()[0], output
        assert set(LEGACY) <= set(outbox_indexes(db_at_0007))
        insert_rows(db_at_0007, topic, rows[200:400])  # the old relay drains on
        new = start(REPO, db_at_0007, kafka, "new")
        wait_until(lambda: unsent_count(db_at_0007) < 300, timeout=30, message="old drains")
        stop_cleanly(old)
        wait_until(lambda: holder(db_at_0007) == "new", timeout=20, message="new takes over")
        insert_rows(db_at_0007, topic, rows[400:550])
        output = relay_migrate(db_at_0007)
        # 0010 goes in now, then any later migration that waited behind it.
        assert output.split(": ", 1)[1].startswith("0010_retire_legacy_indexes.sql"), output
        assert not set(LEGACY) & set(outbox_indexes(db_at_0007))
        insert_rows(db_at_0007, topic, rows[550:])
        wait_until(lambda: unsent_count(db_at_0007) == 0, timeout=60, message="all sent")
    finally:
        stop(old)
        if new is not None:
            stop_cleanly(new)
    every_row_arrived_in_order(kafka, topic, rows)


def test_a_database_upgraded_from_0009_drops_the_old_indexes_at_once(
    db_at_0007: str, tmp_path: Path
) -> None:
    """Past 0009 (a release that no longer reads them runs everywhere), 0010 goes in."""
    folder = tmp_path / "migrations-0009"
    folder.mkdir()
    for path in sorted(migrations_dir().glob("000[89]_*.sql")):
        shutil.copy(path, folder / path.name)
    for path in sorted(migrations_dir().glob("000[1-7]_*.sql")):
        shutil.copy(path, folder / path.name)
    assert [n[:4] for n in migrate(CommonSettings(database_url=db_at_0007), folder).applied] == [
        "0008",
        "0009",
    ]
    migrated = migrate(CommonSettings(database_url=db_at_0007))
    # 0010 goes in, after the migrations this release reads (those that only drop go
    # last, so that one failing its lock timeout leaves nothing needed unapplied) ...
    assert migrated.applied[-1] == "0010_retire_legacy_indexes.sql"
    # ... and 0017 waits behind the 0015 this run applied, as 0010 did behind 0009.
    assert migrated.waiting is not None and "0017" in migrated.waiting
    migrated = migrate(CommonSettings(database_url=db_at_0007))
    assert migrated.applied == [
        "0017_retire_key_index.sql",
        "0019_move_dead_letters.sql",
        "0021_park_scheduled_rows.sql",
    ]
    # ... and 0022 behind the 0021 this run applied: it wants the schedule moved out.
    assert migrated.waiting is not None and "0022" in migrated.waiting
    migrated = migrate(CommonSettings(database_url=db_at_0007))
    assert migrated.applied == ["0022_retire_due_index.sql"]
    assert migrated.waiting is None
    assert set(outbox_indexes(db_at_0007)) == set(INDEXES)


def test_a_rolling_upgrade_to_key_hashes_walks_keys_fairly_and_loses_nothing(
    db_at_0014: str, kafka: TansuBroker, topic: str, tmp_path: Path
) -> None:
    """The previous release (its fair fetch walks whole keys, outbox_due_key_idx)
    drains a hot key and six others (the hot key passes its cap in every head, so the
    fair fetch runs); this release's `relay migrate` adds 0015 and holds
    0017 back; a relay of this release joins and takes over, walking key hashes; a
    second `relay migrate` drops the whole-key index. Every row arrives, each key in
    order."""
    rows = [
        ("hot", f"hot:{n // 2}".encode()) if n % 2 else (f"k{n % 6}", f"k{n % 6}:{n}".encode())
        for n in range(1200)
    ]
    old = start(release(BEFORE_0015, tmp_path), db_at_0014, kafka, "old")
    new: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: holder(db_at_0014) == "old", timeout=20, message="old relay leads")
        insert_rows(db_at_0014, topic, rows[:400])
        output = relay_migrate(db_at_0014)
        assert "0015" in output and "0017_retire_key_index.sql waits" in output, output
        indexes = outbox_indexes(db_at_0014)
        assert {"outbox_due_key_idx", "outbox_due_key_hash_idx"} <= set(indexes)
        insert_rows(db_at_0014, topic, rows[400:700])  # the old relay drains on
        new = start(REPO, db_at_0014, kafka, "new")
        wait_until(lambda: unsent_count(db_at_0014) < 500, timeout=30, message="old drains")
        stop_cleanly(old)
        wait_until(lambda: holder(db_at_0014) == "new", timeout=20, message="new takes over")
        insert_rows(db_at_0014, topic, rows[700:1000])
        output = relay_migrate(db_at_0014)
        assert output.split(": ", 1)[1].startswith("0017_retire_key_index.sql"), output
        assert "outbox_due_key_idx" not in outbox_indexes(db_at_0014)
        insert_rows(db_at_0014, topic, rows[1000:])
        wait_until(lambda: unsent_count(db_at_0014) == 0, timeout=60, message="all sent")
    finally:
        stop(old)
        if new is not None:
            stop_cleanly(new)
    every_row_arrived_in_order(kafka, topic, rows)


def test_a_relay_deployed_before_its_migrations_refuses_to_start_and_says_what_to_run(
    db_at_0014: str, kafka: TansuBroker
) -> None:
    """Without 0015 the fair fetch would fail on every round; the relay says so at once.
    Once `relay migrate` ran (0017 waiting for the rollout, which it may), it starts."""
    env = relay_env(db_at_0014, kafka.bootstrap_servers)
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "RELAY_DATABASE_URL" in done.stderr and "0015_key_hash_index.sql" in done.stderr
    assert "relay migrate" in done.stderr and "0017" not in done.stderr
    assert "0017_retire_key_index.sql waits" in relay_migrate(db_at_0014)
    relay = start(REPO, db_at_0014, kafka, "new")
    try:
        wait_until(lambda: holder(db_at_0014) == "new", timeout=20, message="it starts")
    finally:
        err = stop(relay)
    assert "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize(
    ("commit", "last"),
    [(BEFORE_0009, "0007"), (BEFORE_0015, "0014"), (BEFORE_0018, "0017"), (BEFORE_0020, "0019")],
)
def test_the_previous_release_is_in_the_history(commit: str, last: str) -> None:
    """A guard for the upgrade tests: each previous release names a commit whose
    migrations stop where its test's database does (so its relay is one that reads
    the old indexes)."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", commit, "migrations/"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "GIT_PAGER": "cat"},
    ).stdout.split()
    assert max(Path(p).name for p in listed if Path(p).name[0].isdigit())[:4] == last


def dead_letters(dsn: str) -> dict[str, int]:
    """How many dead letters each place holds: moved out, and marked in place."""
    with psycopg.connect(dsn) as conn:
        in_place = conn.execute("SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL")
        exists = conn.execute("SELECT to_regclass('outbox_dead') IS NOT NULL").fetchone()
        moved = conn.execute("SELECT count(*) FROM outbox_dead") if exists == (True,) else None
        return {
            "moved": 0 if moved is None else int(scalar_of(moved)),
            "in place": int(scalar_of(in_place)),
        }


def scalar_of(cursor: psycopg.Cursor[tuple[Any, ...]]) -> Any:
    row = cursor.fetchone()
    assert row is not None
    return row[0]


def test_a_rolling_upgrade_moves_dead_letters_out_of_the_outbox_and_loses_none(
    db_at_0017: str, kafka: TansuBroker, topic: str, tmp_path: Path
) -> None:
    """The previous release dead-letters one topic's rows (mapped to a name no broker
    takes) by marking them in place; this release's `relay migrate` adds 0018 and holds
    0019 back; a relay of this release joins and takes over, moving the dead letters it
    makes into outbox_dead, while `relay dead-letter list` shows both kinds; a second
    `relay migrate` moves the old ones out. Then, the mapping fixed, a requeue of every
    dead letter delivers them: every row arrives, each key in order."""
    refused = f"{topic}-refused"
    kafka.create_topic(refused, partitions=3)
    bad_map = {"RELAY_KAFKA_TOPIC_MAP": json.dumps({refused: "not a topic!"})}
    good = [(f"k{n % 5}", f"k{n % 5}:{n}".encode()) for n in range(300)]
    bad = [(f"b{n % 3}", f"b{n % 3}:{n}".encode()) for n in range(60)]
    old = start(release(BEFORE_0018, tmp_path), db_at_0017, kafka, "old", **bad_map)
    new: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: holder(db_at_0017) == "old", timeout=20, message="old relay leads")
        insert_rows(db_at_0017, topic, good[:100])
        insert_rows(db_at_0017, refused, bad[:30])
        wait_until(lambda: dead_letters(db_at_0017)["in place"] == 30, timeout=30)
        output = relay_migrate(db_at_0017)
        assert "0018" in output and "0019_move_dead_letters.sql waits" in output, output
        insert_rows(db_at_0017, topic, good[100:200])  # the old relay drains on
        # This release names the map RELAY_TOPIC_MAP (1.0's one name for every sink).
        new = start(
            REPO, db_at_0017, kafka, "new", RELAY_TOPIC_MAP=bad_map["RELAY_KAFKA_TOPIC_MAP"]
        )
        stop_cleanly(old)
        wait_until(lambda: holder(db_at_0017) == "new", timeout=20, message="new takes over")
        insert_rows(db_at_0017, refused, bad[30:])
        wait_until(lambda: dead_letters(db_at_0017) == {"moved": 30, "in place": 30}, timeout=30)
        env = relay_env(db_at_0017)
        listed = json.loads(run_cli(env, "dead-letter", "list", "--json").stdout)
        assert len(listed) == 60 and [r["id"] for r in listed] == sorted(r["id"] for r in listed)
        output = relay_migrate(db_at_0017)
        assert output.split(": ", 1)[1].startswith("0019_move_dead_letters.sql"), output
        assert dead_letters(db_at_0017) == {"moved": 60, "in place": 0}
        moved = json.loads(run_cli(env, "dead-letter", "list", "--json").stdout)
        assert moved == listed  # the same rows, times, reasons and attempts
        stop_cleanly(new)
        new = start(REPO, db_at_0017, kafka, "fixed")
        insert_rows(db_at_0017, topic, good[200:])
        done = run_cli(env, "dead-letter", "requeue", "--all")
        assert done.stdout.startswith(b"requeued 60 row(s)"), done.stdout
        wait_until(lambda: unsent_count(db_at_0017) == 0, timeout=60, message="all sent")
        assert dead_letters(db_at_0017) == {"moved": 0, "in place": 0}
    finally:
        stop(old)
        if new is not None:
            stop_cleanly(new)
    every_row_arrived_in_order(kafka, topic, good)
    every_row_arrived_in_order(kafka, refused, bad)


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


def test_a_rolling_upgrade_moves_scheduled_rows_out_only_once_the_old_relays_are_gone(
    db_at_0019: str, kafka: TansuBroker, topic: str, tmp_path: Path
) -> None:
    """The previous release drains; this release's `relay migrate` adds 0020 and holds
    0021 back; a row of k0 is scheduled a few seconds ahead, with later rows of k0
    behind it; a relay of this release joins and takes over, and moves no row out while
    0021 waits (an old relay would not see it there, and let k0's later rows overtake
    it); a second `relay migrate` adds 0021, and the new relay moves the next row
    scheduled for later out, and lets it back in when due. Every row arrives, each key
    in order."""
    now = [(f"k{n % 4}", f"k{n % 4}:{n}".encode()) for n in range(200)]
    first = ("k0", b"k0:scheduled")
    second = ("k1", b"k1:scheduled")
    rows = [*now[:100], first, ("k0", b"k0:behind"), *now[100:150], second, *now[150:]]
    old = start(release(BEFORE_0020, tmp_path), db_at_0019, kafka, "old")
    new: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: holder(db_at_0019) == "old", timeout=20, message="old relay leads")
        insert_rows(db_at_0019, topic, now[:100])
        output = relay_migrate(db_at_0019)
        assert "0020" in output and "0021_park_scheduled_rows.sql waits" in output, output
        schedule(db_at_0019, topic, *first, seconds=4)
        insert_rows(db_at_0019, topic, [("k0", b"k0:behind")])
        new = start(REPO, db_at_0019, kafka, "new")
        stop_cleanly(old)
        wait_until(lambda: holder(db_at_0019) == "new", timeout=20, message="new takes over")
        insert_rows(db_at_0019, topic, now[100:150])
        wait_until(lambda: unsent_count(db_at_0019) == 0, timeout=30, message="k0 let in")
        assert parked(db_at_0019) == 0  # nothing moved out while 0021 waited
        output = relay_migrate(db_at_0019)
        assert output.split(": ", 1)[1].startswith("0021_park_scheduled_rows.sql"), output
        schedule(db_at_0019, topic, *second, seconds=4)
        insert_rows(db_at_0019, topic, now[150:])
        wait_until(lambda: parked(db_at_0019) == 1, timeout=20, message="moved out")
        wait_until(
            lambda: parked(db_at_0019) == 0 and unsent_count(db_at_0019) == 0,
            timeout=30,
            message="let back in, and sent",
        )
    finally:
        stop(old)
        if new is not None:
            stop_cleanly(new)
    every_row_arrived_in_order(kafka, topic, rows)


def test_the_walk_by_primary_key_waits_while_rows_marked_sent_in_place_remain(
    db_at_0021: str,
) -> None:
    """Migration 0022 lets the primary key carry the fetch's walk: it waits (and says
    why) while rows a release from before 0013 marked sent in place remain, which the
    walk would step over every time; once the purge has deleted them, it goes in."""
    with psycopg.connect(db_at_0021, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, sent_at)"
            " VALUES ('t', 'k', 'x', now() - interval '2 days')"
        )
    output = relay_migrate(db_at_0021)
    assert "0022_retire_due_index.sql waits: the outbox still holds rows" in output, output
    assert "outbox_due_idx" in outbox_indexes(db_at_0021)
    with psycopg.connect(db_at_0021, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox WHERE sent_at IS NOT NULL")  # as the purge does
    output = relay_migrate(db_at_0021)
    assert "0022_retire_due_index.sql" in output and "waits" not in output, output
    assert "outbox_due_idx" not in outbox_indexes(db_at_0021)
