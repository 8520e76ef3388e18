"""The console's roles (migrations/console_grants.sql): the console works with only
those grants, and they let it do nothing else. Every console statement runs here, as
the role, on real rows; no browser needed."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import sql

from relay import db
from relay.console import data
from relay.queries import QUERIES
from relay.settings import CommonSettings
from tests.harness.postgres import PostgresServer
from tests.test_console import CONSOLE_ROLE, ROLE_PASSWORD, VIEWER_ROLE, grant_console

CONSOLE_STATEMENTS = {name for name in QUERIES.names() if QUERIES.get(name).source == "console.sql"}


def _as(pg: PostgresServer, database: str, role: str) -> CommonSettings:
    dbname = database.rsplit("/", 1)[1]
    grant_console(pg, dbname)
    return CommonSettings(database_url=pg.dsn(dbname, user=role, password=ROLE_PASSWORD))


def _dead_letters(dsn: str, topic: str, count: int) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "INSERT INTO outbox (topic, key, payload, attempts, dead_lettered_at,"
            " dead_letter_reason) SELECT %s, 'k', 'x', 2, now(), 'HTTP 400'"
            " FROM generate_series(1, %s) RETURNING id",
            (topic, count),
        ).fetchall()
    return [int(r[0]) for r in rows]


def _read_everything(conn: db.Conn) -> set[str]:
    """Every page's reads; the console statements they ran."""
    data.overview(conn, 1000)
    data.dead_letter_page(conn, data.Filter(), after=None, before=None, limit=10, cap=100)
    data.dead_letter_page(conn, data.Filter(reason="http"), after=None, before=5, limit=10, cap=100)
    data.row(conn, 1, 100)
    data.blocked_keys(conn, 10, 100)
    data.audit_page(conn, None, 10)
    data.audit_entry(conn, 1)
    data.matching_ids(conn, data.Target(ids=(1, 2)), 100)
    data.matching_ids(conn, data.Target(search=data.Filter(topic="t")), 100)
    conn.execute(QUERIES.console_settled_counters, {"window": 60.0, "cap": 10}).fetchone()
    return {
        "console_dead_letter_page_after",
        "console_dead_letter_page_before",
        "console_dead_letter_count",
        "console_dead_letter_ids",
        "console_dead_letters_of",
        "console_row",
        "console_blocked_keys",
        "console_blocked_key_count",
        "console_settled_counters",
        "console_audit_page",
        "console_audit_entry",
    }


def test_the_console_role_runs_every_console_statement(pg: PostgresServer, database: str) -> None:
    settings = _as(pg, database, CONSOLE_ROLE)
    topic = f"g-{uuid.uuid4().hex[:6]}"
    requeued, discarded = _dead_letters(database, topic, 2)
    with db.connect(settings, purpose="console") as conn:
        ran = _read_everything(conn)
        done = data.change(conn, "token", "requeue", data.Target(ids=(requeued,)), 1, 100)
        assert done.ids == [requeued]
        done = data.change(conn, "token", "discard", data.Target(ids=(discarded,)), 1, 100)
        assert done.ids == [discarded]
    assert ran | {"console_discard", "console_audit_record"} == CONSOLE_STATEMENTS
    with psycopg.connect(database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT action, actor, row_ids FROM console_audit ORDER BY id"
        ).fetchall()
        left = conn.execute("SELECT id, dead_lettered_at FROM outbox").fetchall()
    assert rows == [("requeue", "token", [requeued]), ("discard", "token", [discarded])]
    assert left == [(requeued, None)]


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE outbox SET topic = 'elsewhere'",
        "UPDATE outbox SET payload = 'changed'",
        "UPDATE outbox SET sent_at = now()",
        "INSERT INTO outbox (topic) VALUES ('forged')",
        "UPDATE leases SET holder = 'console'",
        "DELETE FROM replicas",
        "UPDATE console_audit SET actor = 'someone else'",
        "DELETE FROM console_audit",
    ],
)
def test_the_console_role_can_do_nothing_else(
    pg: PostgresServer, database: str, statement: str
) -> None:
    settings = _as(pg, database, CONSOLE_ROLE)
    with (
        db.connect(settings, purpose="console") as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute(sql.SQL(statement))


def test_the_viewer_role_reads_every_page_and_changes_nothing(
    pg: PostgresServer, database: str
) -> None:
    settings = _as(pg, database, VIEWER_ROLE)
    (row_id,) = _dead_letters(database, "viewer", 1)
    with db.connect(settings, purpose="console") as conn:
        _read_everything(conn)
        for action in ("requeue", "discard"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                data.change(conn, "viewer", action, data.Target(ids=(row_id,)), 1, 100)
    with psycopg.connect(database, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM console_audit").fetchone() == (0,)
        assert conn.execute("SELECT dead_lettered_at IS NOT NULL FROM outbox").fetchone() == (True,)
