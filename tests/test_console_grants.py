"""The console's roles (migrations/console_grants.sql): the console works with only
those grants, and they let it do nothing else. Every console statement runs here, as
the role, on real rows; no browser needed."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import sql

from relay.console import data
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import db
from tests.harness.postgres import PostgresServer
from tests.test_console import CONSOLE_ROLE, ROLE_PASSWORD, VIEWER_ROLE, grant_console

CONSOLE_STATEMENTS = {name for name in QUERIES.names() if QUERIES.get(name).source == "console.sql"}


def _as(pg: PostgresServer, database: str, role: str) -> CommonSettings:
    dbname = database.rsplit("/", 1)[1]
    grant_console(pg, dbname)
    return CommonSettings(database_url=pg.dsn(dbname, user=role, password=ROLE_PASSWORD))


def _dead_letters(dsn: str, topic: str, count: int) -> list[int]:
    """Dead letters as the relay leaves them, moved into outbox_dead."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "INSERT INTO outbox (topic, key, payload, attempts)"
            " SELECT %s, 'k', 'x', 2 FROM generate_series(1, %s) RETURNING id",
            (topic, count),
        ).fetchall()
        ids = [int(r[0]) for r in rows]
        conn.execute(
            "SELECT outbox_dead_letter(%s, array_fill(0, ARRAY[%s]), array_fill("
            "'HTTP 400'::text, ARRAY[%s]))",
            (ids, len(ids), len(ids)),
        )
    return ids


def _read_everything(conn: db.Conn) -> set[str]:
    """Every page's reads; the console statements they ran."""
    data.overview(conn, 1000)
    data.dead_letter_page(conn, data.Filter(), after=None, before=None, limit=10, cap=100)
    data.dead_letter_page(conn, data.Filter(reason="http"), after=None, before=5, limit=10, cap=100)
    data.row(conn, 1, 100)
    data.blocked_keys(conn, 10, 100)
    # ... and as the page reads them once `relay migrate --without-key-index` ran.
    conn.execute(QUERIES.console_blocked_keys_uncounted, {"limit": 10, "cap": 100}).fetchall()
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
        "console_blocked_keys_counted",
        "console_blocked_keys_uncounted",
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
        done = data.change(
            conn, "token", "requeue", data.Target(ids=(requeued,)), 1, 100, set_aside="move"
        )
        assert done.ids == [requeued]
        done = data.change(
            conn, "token", "discard", data.Target(ids=(discarded,)), 1, 100, set_aside="move"
        )
        assert done.ids == [discarded]
    # The own table's statements read its view of all rows (outbox_marked), which the
    # relay's own schema has not.
    own_table = {"console_discard_in_place", "console_settled_counters_marked"}
    assert ran | {"console_discard", "console_audit_record"} | own_table == CONSOLE_STATEMENTS
    with psycopg.connect(database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT action, actor, row_ids FROM console_audit ORDER BY id"
        ).fetchall()
        left = conn.execute("SELECT id, attempts FROM outbox ORDER BY id")
        dead = conn.execute("SELECT count(*) FROM outbox_dead_letters").fetchone()
        assert left.fetchall() == [(requeued, 0)]
        assert dead == (0,)
    assert rows == [("requeue", "token", [requeued]), ("discard", "token", [discarded])]


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE outbox SET topic = 'elsewhere'",
        "UPDATE outbox SET payload = 'changed'",
        "UPDATE outbox SET attempts = 0",
        "INSERT INTO outbox (topic) VALUES ('forged')",
        "INSERT INTO outbox_dead (id, message_id, topic, created_at, attempts,"
        " dead_lettered_at) VALUES (1, gen_random_uuid(), 'forged', now(), 0, now())",
        "SELECT outbox_dead_letter(ARRAY[1], ARRAY[0], ARRAY['not the relay'])",
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
                data.change(
                    conn, "viewer", action, data.Target(ids=(row_id,)), 1, 100, set_aside="move"
                )
    with psycopg.connect(database, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM console_audit").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (1,)


def test_a_deep_page_reads_a_page_of_dead_letters(database: str) -> None:
    """40,000 dead letters beside 20,000 unsent rows: a page deep into them, and the
    look before it, read about a page (EXPLAIN ANALYZE's buffers), not every row."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, attempts)"
            " SELECT 'deep', 'k' || (g % 50), 'x', 1 FROM generate_series(1, 60000) AS g"
        )
        conn.execute(
            "SELECT outbox_dead_letter(array_agg(id), array_agg(0), array_agg('HTTP 400'::text))"
            " FROM (SELECT id FROM outbox WHERE id % 3 <> 0) AS two_thirds"
        )
        conn.execute("VACUUM ANALYZE outbox")
        conn.execute("VACUUM ANALYZE outbox_dead")
        middle = 30_000
        base = {"topic": None, "key": None, "reason": None, "since": None, "until": None}
        for query, params in (
            (QUERIES.console_dead_letter_page_after, {**base, "after": middle, "limit": 51}),
            (QUERIES.console_dead_letter_page_before, {**base, "before": middle, "limit": 51}),
            (
                QUERIES.console_dead_letter_page_after,
                {**base, "topic": "deep", "after": middle, "limit": 1},
            ),
        ):
            found = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params
            ).fetchone()
            assert found is not None
            plan = found[0][0]["Plan"]
            touched = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
            rows = conn.execute(query, params).fetchall()
            assert len(rows) == params["limit"]
            assert touched < 60, (touched, plan)
