"""The lease protocol on a real PostgreSQL: mutual exclusion, expiry, races, fencing."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import IsolationLevel
from psycopg.rows import dict_row

from relay.drain.batch import SentRows, Settlement
from relay.lease.protocol import Acquired, HeldByOther, LeaseToken, LostRace
from relay.store import lease as protocol
from relay.store.repository import settle
from tests.support import insert_rows, scalar, wait_until
from tests.test_own_table import (
    DEBEZIUM_TABLE,
    TABLE,
    VIEW_SCHEMA,
    app_insert,
    grant_view,
    migrate_own_table,
)

Conn = psycopg.Connection[dict[str, Any]]


def rr_conn(dsn: str) -> Conn:
    conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row)
    conn.isolation_level = IsolationLevel.REPEATABLE_READ
    return conn


def test_eight_contenders_never_share_the_lease_or_an_epoch(relay_dsn: str) -> None:
    """The mutual-exclusion test: 8 threads race for a 1 s lease for ~6 s. Each winner
    records its local validity window; no two windows of different epochs overlap."""
    ttl, margin = 1.0, 0.2
    windows: list[tuple[int, str, float, float]] = []
    lock = threading.Lock()
    stop = time.monotonic() + 6.0
    errors: list[BaseException] = []

    def contender(n: int) -> None:
        holder = f"contender-{n}"
        try:
            with rr_conn(relay_dsn) as conn:
                protocol.ensure_row(conn, "mutex")
                while time.monotonic() < stop:
                    started = time.monotonic()
                    outcome = protocol.try_acquire(conn, "mutex", holder, ttl)
                    if isinstance(outcome, Acquired):
                        acquired = time.monotonic()
                        deadline = started + ttl - margin
                        time.sleep(0.3)  # "publish" for part of the window
                        valid_until = deadline
                        if n % 2 == 0:  # half release early, half let the lease lapse
                            valid_until = time.monotonic()
                            assert valid_until < deadline
                            protocol.release(conn, outcome.token)
                        with lock:
                            windows.append((outcome.token.epoch, holder, acquired, valid_until))
                    time.sleep(0.01 + (n % 3) * 0.005)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=contender, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    epochs = [w[0] for w in windows]
    assert len(windows) >= 5, "the race should produce several acquisitions"
    assert len(epochs) == len(set(epochs)), "an epoch was granted twice"
    final_epoch = scalar(relay_dsn, "SELECT epoch FROM leases WHERE name = 'mutex'")
    assert sorted(epochs) == list(range(1, final_epoch + 1)), "every epoch has one winner"
    for earlier, later in itertools.permutations(windows, 2):
        if earlier[0] < later[0] and earlier[1] != later[1]:
            # Mutual exclusion: nobody acquires while another holder may still trust
            # its lease (until it released, or until its local deadline passed).
            # (A holder re-taking its own live lease just supersedes itself.)
            assert later[2] >= earlier[3], f"{later} overlapped {earlier}"


def test_lost_cas_shows_as_serialization_failure_and_is_treated_as_lost(relay_dsn: str) -> None:
    """Two replicas read the same expired lease; the second UPDATE hits SQLSTATE 40001."""
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        protocol.ensure_row(a, "race")
        # Interleave by hand: B takes its snapshot, A wins and commits, B tries to win.
        with b.transaction():
            row = b.execute("SELECT epoch FROM leases WHERE name = 'race'").fetchone()
            assert row is not None
            assert isinstance(protocol.try_acquire(a, "race", "A", 5.0), Acquired)
            with pytest.raises(psycopg.errors.SerializationFailure):
                b.execute(
                    "UPDATE leases SET holder = 'B', epoch = epoch + 1 WHERE name = 'race'"
                    " AND epoch = %s",
                    (row["epoch"],),
                )
        outcome = protocol.try_acquire(b, "race", "B", 5.0)
        assert isinstance(outcome, HeldByOther)
        assert outcome.holder == "A"
        assert outcome.epoch == 1


def test_zero_row_cas_is_a_lost_race(relay_dsn: str) -> None:
    """Under READ COMMITTED-like timing the CAS can simply match nothing: also a loss."""
    with rr_conn(relay_dsn) as a, psycopg.connect(relay_dsn, autocommit=True) as other:
        protocol.ensure_row(a, "zero")
        a.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        row = a.execute("SELECT epoch FROM leases WHERE name = 'zero'").fetchone()
        assert row is not None
        a.execute("ROLLBACK")
        other.execute("UPDATE leases SET epoch = epoch + 1 WHERE name = 'zero'")
        cur = a.execute(
            "UPDATE leases SET holder = 'A', epoch = epoch + 1 WHERE name = 'zero' AND epoch = %s",
            (row["epoch"],),
        )
        assert cur.rowcount == 0
    assert isinstance(LostRace("x"), LostRace)


def test_expired_lease_is_taken_over_with_a_new_epoch(relay_dsn: str) -> None:
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        protocol.ensure_row(a, "expiry")
        first = protocol.try_acquire(a, "expiry", "A", 1.0)
        assert isinstance(first, Acquired)
        assert isinstance(protocol.try_acquire(b, "expiry", "B", 1.0), HeldByOther)

        # A stops renewing (paused, partitioned...). B gets it once the DB clock says so.
        def b_takes_over() -> Acquired | None:
            outcome = protocol.try_acquire(b, "expiry", "B", 1.0)
            return outcome if isinstance(outcome, Acquired) else None

        taken = wait_until(b_takes_over, timeout=5, message="B to take the expired lease")
        assert taken.token.epoch == first.token.epoch + 1
        assert not protocol.renew(a, first.token, 1.0), "the old holder cannot renew"


def test_released_lease_is_free_at_once(relay_dsn: str) -> None:
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        protocol.ensure_row(a, "handover")
        first = protocol.try_acquire(a, "handover", "A", 60.0)
        assert isinstance(first, Acquired)
        assert protocol.release(a, first.token)
        second = protocol.try_acquire(b, "handover", "B", 60.0)
        assert isinstance(second, Acquired)
        assert second.token.epoch == 2


@pytest.mark.parametrize(
    ("failures", "sent_rows"),
    [
        (False, "delete"),
        (False, "move"),
        (True, "delete"),
        (True, "move"),
    ],
)
def test_a_stale_holder_cannot_mark_rows(
    relay_dsn: str, database: str, failures: bool, sent_rows: SentRows
) -> None:
    """Fencing: A's lease is taken by B; A's settle writes nothing: the one statement of
    a wholly acknowledged batch (each mode) and the transaction of one with failures."""
    ids = insert_rows(database, "t", [("k", b"1"), ("k", b"2"), ("k", b"3")])
    name = f"fence-{failures}-{sent_rows}"
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        protocol.ensure_row(a, name)
        old = protocol.try_acquire(a, name, "A", 1.0)
        assert isinstance(old, Acquired)
        wait_until(
            lambda: isinstance(protocol.try_acquire(b, name, "B", 30.0), Acquired), timeout=5
        )
        stale = Settlement(sent=ids[:2])
        if failures:
            stale.dead(ids[2], "zombie says so")
        assert settle(a, old.token, 1.0, stale, sent_rows=sent_rows, set_aside="move") is None
        unsent = "SELECT count(*) FROM outbox"
        assert scalar(database, unsent) == 3
        assert scalar(database, "SELECT count(*) FROM outbox_sent") == 0
        # The rightful holder can.
        token = LeaseToken(name, "B", old.token.epoch + 1)
        settled = Settlement(sent=ids[:2])
        if failures:
            settled.dead(ids[2], "the holder says so")
        assert settle(b, token, 30.0, settled, sent_rows=sent_rows, set_aside="move") is not None
        # The third row: dead-lettered (moved into outbox_dead), or still to send.
        assert scalar(database, unsent) == (0 if failures else 1)
        assert scalar(database, "SELECT count(*) FROM outbox_dead") == (1 if failures else 0)
        assert scalar(database, "SELECT count(*) FROM outbox_sent") == (
            2 if sent_rows == "move" else 0
        )
        if sent_rows == "move":
            moved = scalar(
                database,
                "SELECT array_agg(id ORDER BY id) FROM outbox_sent"
                " WHERE sent_at IS NOT NULL AND generation = 0",
            )
            assert moved == ids[:2]


@pytest.mark.parametrize("failures", [False, True])
def test_a_stale_holder_cannot_mark_an_own_tables_rows(
    relay_dsn: str, database: str, failures: bool
) -> None:
    """The same fence for an own table (RELAY_OUTBOX_TABLE), whose sent rows and dead
    letters are marked in place, through its view, by settle_mark_sent and dead_letter."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(DEBEZIUM_TABLE)
    done = migrate_own_table(database)
    assert done.returncode == 0, done.stderr
    grant_view(database)
    app_insert(database, "t", [("k", 1), ("k", 2), ("k", 3)])
    marks = (
        "SELECT count(*) FILTER (WHERE relay_sent_at IS NOT NULL),"
        " count(*) FILTER (WHERE relay_dead_lettered_at IS NOT NULL)"
        f" FROM {TABLE}"
    )
    name = f"fence-own-{failures}"
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        for session in (a, b):
            session.execute(f"SET search_path = {VIEW_SCHEMA}, public")
        ids = [int(r["id"]) for r in a.execute("SELECT id FROM outbox ORDER BY id")]
        protocol.ensure_row(a, name)
        old = protocol.try_acquire(a, name, "A", 1.0)
        assert isinstance(old, Acquired)
        wait_until(
            lambda: isinstance(protocol.try_acquire(b, name, "B", 30.0), Acquired), timeout=5
        )
        stale = Settlement(sent=ids[:2])
        if failures:
            stale.dead(ids[2], "zombie says so")
        assert settle(a, old.token, 1.0, stale, sent_rows="mark", set_aside="mark") is None
        with psycopg.connect(database) as conn:
            assert conn.execute(marks).fetchone() == (0, 0)  # the zombie marked nothing
        token = LeaseToken(name, "B", old.token.epoch + 1)
        settled = Settlement(sent=ids[:2])
        if failures:
            settled.dead(ids[2], "the holder says so")
        assert settle(b, token, 30.0, settled, sent_rows="mark", set_aside="mark") is not None
    with psycopg.connect(database) as conn:
        assert conn.execute(marks).fetchone() == (2, 1 if failures else 0)


def test_a_settle_waiting_on_an_open_takeover_writes_nothing_once_it_commits(
    relay_dsn: str, database: str
) -> None:
    """The one-statement settle against a takeover still in flight: A's fence waits on
    the lease row B has updated; when B commits, A's statement re-checks the row, finds
    a newer epoch, and deletes nothing."""
    ids = insert_rows(database, "t", [("k", b"1"), ("k", b"2")])
    with rr_conn(relay_dsn) as a, rr_conn(relay_dsn) as b:
        protocol.ensure_row(a, "open-takeover")
        held = protocol.try_acquire(a, "open-takeover", "A", 30.0)
        assert isinstance(held, Acquired)
        outcome: list[object] = []
        with b.transaction():
            b.execute(
                "UPDATE leases SET holder = 'B', epoch = epoch + 1 WHERE name = 'open-takeover'"
            )
            settling = threading.Thread(
                target=lambda: outcome.append(
                    settle(
                        a,
                        held.token,
                        30.0,
                        Settlement(sent=list(ids)),
                        sent_rows="delete",
                        set_aside="move",
                    )
                )
            )
            settling.start()
            wait_until(
                lambda: (
                    scalar(
                        database,
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND datname = current_database()",
                    )
                    == 1
                ),
                timeout=10,
                message="A's settle to wait on the lease row",
            )
        settling.join(timeout=10)
        assert outcome == [None]  # fenced out
        assert scalar(database, "SELECT count(*) FROM outbox") == 2


def test_a_holder_frozen_inside_a_lease_transaction_blocks_takeover_for_a_ttl_at_most(
    relay_dsn: str,
) -> None:
    """A daemon session frozen mid-transaction (SIGSTOP during a settle) holds the lease
    row's lock; the server must end it within a ttl, not after its 30 s default."""
    from relay.settings import CommonSettings, Settings
    from relay.store import db

    daemon = Settings(database_url=relay_dsn, kafka_bootstrap_servers="x:1", lease_ttl_seconds=3)
    with db.connect(daemon, purpose="drain") as conn:
        assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == {
            "idle_in_transaction_session_timeout": "3s"
        }
    # Operator commands keep the configured value: they hold no lease lock.
    with db.connect(CommonSettings(database_url=relay_dsn), purpose="status") as conn:
        assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == {
            "idle_in_transaction_session_timeout": "30s"
        }

    frozen = db.connect(daemon, purpose="drain")
    try:
        frozen.execute("BEGIN")
        # Holds a lock on a lease row, then goes quiet: the client is frozen.
        frozen.execute("INSERT INTO leases (name, holder, epoch) VALUES ('x', 'frozen', 1)")
        started = time.monotonic()
        # The other session waits on the row lock until the server ends the frozen one.
        with psycopg.connect(relay_dsn, autocommit=True) as other:
            wait_until(
                lambda: (
                    other.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'relay:drain'"
                    ).fetchone()
                    == (0,)
                ),
                timeout=10,
                message="the frozen session to be ended",
            )
        assert time.monotonic() - started < 6
    finally:
        frozen.close()
