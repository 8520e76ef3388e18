"""The runtime role's grants (migrations/grants.sql): the relay writes its bookkeeping
and nothing the app wrote, in its own outbox and, with the column grants the README
gives, in an own table read through its view. Every statement that writes outbox rows
runs here as that role, on real rows."""

from __future__ import annotations

import re

import psycopg
import pytest
from psycopg import sql

from relay.admin import dead_letters, pauses
from relay.drain.batch import BatchLimits, SetAside, Settlement
from relay.settings import CommonSettings, SettingsError
from relay.sql import QUERIES
from relay.store import db, repository
from relay.store import fetch as store_fetch
from relay.store.port import FetchRequest
from tests.conftest import RELAY_ROLE
from tests.test_own_table import DEBEZIUM_TABLE, TABLE, VIEW_SCHEMA, migrate_own_table

# The relay's own outbox: the bookkeeping of rows still to send.
BOOKKEEPING = ("attempts", "next_attempt_at", "last_error", "promoted_at")
# An own table's view, which marks sent rows and dead letters in place.
OWN_TABLE_BOOKKEEPING = (
    "sent_at",
    "attempts",
    "next_attempt_at",
    "last_error",
    "dead_lettered_at",
    "dead_letter_reason",
    "promoted_at",
)
# What the app wrote, each with a value of its type.
APP_COLUMNS = {
    "topic": "'elsewhere'",
    "key": "'someone-else'",
    "payload": "'\\x00'::bytea",
    "headers": "'{}'::jsonb",
    "message_id": "gen_random_uuid()",
    "created_at": "now()",
    "available_at": "now()",
}
# The statements of relay/sql/ that write outbox rows (UPDATE, or lock them FOR UPDATE).
WRITES = {
    "promote_due",
    "record_failures",
    "dead_letter",
    "dead_letter_requeue_in_place",
    "settle_mark_sent",
    "mark_sent",
    "purge_sent",
    "park_paused",
    "unpark_resumed",
}
LEASE = "grants"

# The README's grants for an own table, the view's bookkeeping columns only.
OWN_TABLE_GRANTS = f"""
GRANT USAGE ON SCHEMA {VIEW_SCHEMA} TO {RELAY_ROLE};
GRANT SELECT, DELETE ON {VIEW_SCHEMA}.outbox, {VIEW_SCHEMA}.outbox_marked TO {RELAY_ROLE};
GRANT SELECT ON {VIEW_SCHEMA}.outbox_dead_letters, {VIEW_SCHEMA}.outbox_dead,
    {VIEW_SCHEMA}.outbox_scheduled, {VIEW_SCHEMA}.outbox_paused TO {RELAY_ROLE};
GRANT UPDATE ({", ".join(OWN_TABLE_BOOKKEEPING)})
    ON {VIEW_SCHEMA}.outbox, {VIEW_SCHEMA}.outbox_marked TO {RELAY_ROLE};
"""


def _writes_outbox(text: str) -> bool:
    return bool(
        re.search(r"\bUPDATE\s+outbox(?:_marked)?\b", text)
        or ("FOR UPDATE" in text and re.search(r"\bFROM\s+outbox(?:_marked)?\b", text))
    )


def test_every_statement_that_writes_outbox_rows_is_run_here() -> None:
    """A new one would need its columns granted: this list makes it run below."""
    found = {name for name in QUERIES.names() if _writes_outbox(QUERIES.get(name).sql)}
    assert found == WRITES


def test_the_relay_role_cannot_change_what_the_app_wrote(database: str, relay_dsn: str) -> None:
    """Before: UPDATE on the whole table, payload and topic included."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload) VALUES ('t', 'k', 'p')")
    with psycopg.connect(relay_dsn, autocommit=True) as conn:
        for column, value in APP_COLUMNS.items():
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(sql.SQL(f"UPDATE outbox SET {column} = {value}"))
        for column in BOOKKEEPING:
            conn.execute(sql.SQL(f"UPDATE outbox SET {column} = {column}"))
    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute("SELECT topic, key, payload FROM outbox").fetchone()
    assert row == ("t", "k", b"p")


def test_the_relay_role_runs_every_outbox_write(database: str, relay_dsn: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, available_at)"
            " VALUES ('t', 'due', 'x', now() - interval '1 second')"
        )
    ids = _insert(
        database, "INSERT INTO outbox (topic, key, payload) VALUES ('t', %s, 'x') RETURNING id"
    )
    settings = CommonSettings(database_url=relay_dsn)
    with db.connect(settings, purpose="grants") as conn:
        assert repository.promote_due(conn, 10, set_aside="move").rows == 1
        _run_every_write(conn, ids, "move")
    _assert_written(database, "outbox", None, ids)


def test_the_relay_role_inserts_no_row_of_its_own(database: str, relay_dsn: str) -> None:
    """Dead letters go out and come back through functions that move rows only: the
    role may not write either table itself (it could requeue a forged row)."""
    with psycopg.connect(relay_dsn, autocommit=True) as conn:
        for statement in (
            "INSERT INTO outbox (topic) VALUES ('forged')",
            "INSERT INTO outbox_dead (id, message_id, topic, created_at, attempts,"
            " dead_lettered_at) VALUES (1, gen_random_uuid(), 'forged', now(), 0, now())",
            "UPDATE outbox_dead SET payload = 'changed'",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(sql.SQL(statement))


@pytest.fixture
def own_table(database: str) -> str:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(DEBEZIUM_TABLE)
    done = migrate_own_table(database)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(OWN_TABLE_GRANTS)
    return database


def test_an_own_tables_column_grants_let_the_relay_write_its_columns_only(
    own_table: str, relay_dsn: str
) -> None:
    """The README's grant text for RELAY_OUTBOX_TABLE, column by column, is enough."""
    ids = _insert(
        own_table,
        "INSERT INTO inventory.outboxevent (id, aggregatetype, aggregateid, type, payload)"
        " VALUES (gen_random_uuid(), 't', %s, 'Created', '{}') RETURNING relay_id",
    )
    settings = CommonSettings(database_url=relay_dsn, outbox_table=TABLE, lease_name=LEASE)
    with db.connect(settings, purpose="grants") as conn:
        _run_every_write(conn, ids, "mark")
        # The view's other app columns are expressions (casts), never updatable; this
        # one is the table's relay_created_at as it is.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("UPDATE outbox SET created_at = now()")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("UPDATE inventory.outboxevent SET aggregatetype = 'elsewhere'")
    _assert_written(own_table, TABLE, "relay_sent_at", ids)


def test_an_own_tables_dead_letter_views_unreadable_stop_the_session_naming_them(
    database: str, relay_dsn: str
) -> None:
    """Granted on the view only (the grants of the previous release, made after
    `--own-table` ran): every lag sample and dead-letter listing would fail; the
    session refuses at once, naming the views and the grant."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(DEBEZIUM_TABLE)
    done = migrate_own_table(database)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(OWN_TABLE_GRANTS.split("GRANT SELECT ON", maxsplit=1)[0])
    settings = CommonSettings(database_url=relay_dsn, outbox_table=TABLE, lease_name=LEASE)
    with pytest.raises(SettingsError) as refused:
        db.connect(settings, purpose="grants").close()
    assert refused.value.name == "RELAY_OUTBOX_TABLE"
    assert f"{VIEW_SCHEMA}.outbox_dead_letters" in str(refused.value), refused.value
    assert "grant SELECT" in str(refused.value)


def _insert(dsn: str, statement: str) -> list[int]:
    """Four rows, keys a-d, written by the owner (the app), and the lease row the settle
    fences on, held by "test" at epoch 1; the rows' ids."""
    ids = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO leases (name, holder, epoch, expires_at)"
            " VALUES (%s, 'test', 1, now() + interval '1 minute')",
            (LEASE,),
        )
        for key in "abcd":
            row = conn.execute(statement, (key,)).fetchone()
            assert row is not None
            ids.append(int(row[0]))
    return ids


def _run_every_write(conn: db.Conn, ids: list[int], set_aside: SetAside) -> None:
    """Row a fails once, b is dead-lettered and requeued, c settles under a held lease,
    d is acknowledged; an own table keeps c and d marked sent, then they are purged."""
    a, b, c, d = ids
    topic = conn.execute("SELECT topic FROM outbox WHERE id = %s", (a,)).fetchone()
    assert topic is not None
    pauses.pause(conn, topic["topic"], actor="test", via="cli")
    with conn.transaction():  # a parked for its topic's pause, as a settle parks it
        repository.park_paused(conn, Settlement(paused_ids=[a], paused_topics={topic["topic"]}))
    pauses.resume(conn, topic["topic"], actor="test", via="cli")
    assert repository.unpark_resumed(conn) == 1
    if set_aside == "move":  # the relay's own outbox holds a paused topic's rows out of it
        pauses.pause(conn, topic["topic"], actor="test", via="cli")
        count = "SELECT count(*) AS n FROM outbox WHERE topic = %s"
        rows = conn.execute(count, (topic["topic"],)).fetchone()
        assert rows is not None and rows["n"] >= len(ids)
        ask = FetchRequest(
            BatchLimits(rows=10, bytes=1 << 20, per_key=10), paused=frozenset({topic["topic"]})
        )
        assert store_fetch.fetch(conn, ask, hold=True).messages == []
        held = conn.execute("SELECT count(*) AS n FROM outbox_paused").fetchone()
        assert held is not None and held["n"] == rows["n"]
        pauses.resume(conn, topic["topic"], actor="test", via="cli")
        assert repository.release_paused(conn, 100) == (rows["n"], False)
    with conn.transaction():
        conn.execute(
            QUERIES.record_failures,
            {"ids": [a], "attempted": [1], "delays": [60.0], "errors": ["no broker"]},
        )
        conn.execute(
            repository.DEAD_LETTER[set_aside], {"ids": [b], "attempted": [1], "reasons": ["bad"]}
        )
    assert dead_letters.requeue_dead_letters(conn, ids=[b], set_aside=set_aside) == [b]
    fence = {"name": LEASE, "holder": "test", "epoch": 1, "ttl": 60.0, "ids": [c]}
    if set_aside == "move":
        conn.execute(QUERIES.delete_sent, {"ids": [d]})
        assert conn.execute(QUERIES.settle_delete_sent, fence).fetchone() is not None
        return
    conn.execute(QUERIES.mark_sent, {"ids": [d]})
    settled = conn.execute(QUERIES.settle_mark_sent, fence).fetchone()
    assert settled is not None, "the settle's fence did not hold"
    assert repository.purge_sent(conn, 0.0, 10) == 2


def _assert_written(dsn: str, table: str, sent_at: str | None, ids: list[int]) -> None:
    """The failed row's attempt and error, the requeued row back with fresh attempts; c
    and d gone (deleted, or kept and purged)."""
    prefix = "relay_" if sent_at is not None else ""
    marks: sql.Composable = sql.SQL("")
    if sent_at is not None:
        marks = sql.SQL(", {dead}, {sent}").format(
            dead=sql.Identifier(prefix + "dead_lettered_at"), sent=sql.Identifier(sent_at)
        )
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT {attempts}, {error}{marks} FROM {table} WHERE {id} = ANY(%s) ORDER BY {id}"
            ).format(
                attempts=sql.Identifier(prefix + "attempts"),
                error=sql.Identifier(prefix + "last_error"),
                marks=marks,
                table=sql.Identifier(*table.split(".")),
                id=sql.Identifier(prefix + "id"),
            ),
            (ids,),
        ).fetchall()
    unmarked = () if sent_at is None else (None, None)
    assert rows == [(1, "no broker", *unmarked), (0, "bad", *unmarked)]
