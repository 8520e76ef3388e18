"""Bring your own outbox table: drain an existing table (say, Debezium's outbox event
router layout) without changing the app's columns or its inserts.

`relay migrate --own-table` adds the relay's bookkeeping columns (relay_*) and partial
indexes to the table, and a view `relay_<schema>_<table>.outbox` that shows it in the
relay's layout (RELAY_OUTBOX_COLUMNS names which column is which field). The daemon's
sessions put that schema first on their search_path (`db.connect`), so every
statement in relay/sql/ runs unchanged: the view is simple, so PostgreSQL plans
through it to the table's indexes, and UPDATEs and DELETEs reach the table's rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from relay.errors import MigrationError, SettingsError
from relay.observe.logging import get_logger
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import db
from relay.store.own_table_layout import JSONB_OR_REASON, OWN_TABLE_LAYOUT, Layout, plan_layout

log = get_logger("relay.own_table")


def index_prefix(settings: CommonSettings) -> str:
    """What the names of the indexes `--own-table` makes start with."""
    assert settings.outbox_table is not None
    return settings.outbox_table.split(".")[-1][:28] + "_relay_"


def statements(
    settings: CommonSettings, layout: Layout, existing: Sequence[str] = ()
) -> list[sql.Composed]:
    """Every statement `relay migrate --own-table` runs, in order (what --dry-run prints).
    `existing`: the indexes an earlier run made; those not made now are dropped."""
    assert settings.outbox_table is not None and settings.outbox_view_schema is not None
    table, schema = layout.table, settings.outbox_view_schema
    view = sql.Identifier(schema, "outbox")
    table_schema = settings.outbox_table.split(".")[0] if "." in settings.outbox_table else None
    made: list[str] = []

    due: sql.Composable = sql.SQL("true")
    if "available_at" in layout.index_columns:
        due = sql.SQL("({} IS NULL OR relay_promoted_at IS NOT NULL)").format(
            layout.index_columns["available_at"]
        )
    waiting: sql.Composable = sql.SQL("relay_next_attempt_at IS NOT NULL")
    if "available_at" in layout.index_columns:
        waiting = sql.SQL(
            "(relay_next_attempt_at IS NOT NULL OR ({} IS NOT NULL AND relay_promoted_at IS NULL))"
        ).format(layout.index_columns["available_at"])
    args = {"table": table, "due": due, "waiting": waiting, **layout.index_columns}

    def name_of(query: LiteralString, what: str) -> str:
        """An index is named for its definition: a changed mapping makes new ones (and
        the old ones go), where IF NOT EXISTS would keep a stale one by its name."""
        definition = sql.SQL(query).format(index=sql.Identifier("_"), **args).as_string(None)
        digest = hashlib.sha256(definition.encode()).hexdigest()[:8]
        return f"{index_prefix(settings)}{what}_{digest}"

    def index(query: LiteralString, what: str) -> sql.Composed:
        name = name_of(query, what)
        made.append(name)
        return sql.SQL(query).format(index=sql.Identifier(name), **args)

    out: list[sql.Composed] = []
    if not layout.bookkept:  # ALTER TABLE locks the table even when it changes nothing
        out.append(sql.SQL(QUERIES.own_table_bookkeeping).format(table=table))
    out += [sql.SQL(add).format(table=table) for add in layout.adds]
    out.append(sql.SQL(QUERIES.own_table_schema).format(schema=sql.Identifier(schema)))
    function = sql.Identifier(schema, JSONB_OR_REASON)
    out.append(sql.SQL(QUERIES.own_table_jsonb).format(function=function))
    marked = sql.Identifier(schema, "outbox_marked")
    out.append(
        sql.SQL(QUERIES.own_table_marked_view).format(view=marked, table=table, **layout.fields)
    )
    out.append(sql.SQL(QUERIES.own_table_view).format(view=view, table=table, **layout.fields))
    layout_name = sql.Literal(OWN_TABLE_LAYOUT)
    out.append(sql.SQL(QUERIES.own_table_view_comment).format(view=view, layout=layout_name))
    dead_view = sql.Identifier(schema, "outbox_dead_letters")
    stand_in = sql.Identifier(schema, "outbox_dead")
    out.append(
        sql.SQL(QUERIES.own_table_dead_letters_view).format(dead_view=dead_view, marked=marked)
    )
    out.append(sql.SQL(QUERIES.own_table_dead_stand_in).format(stand_in=stand_in, view=marked))
    scheduled = sql.Identifier(schema, "outbox_scheduled")
    paused = sql.Identifier(schema, "outbox_paused")
    for moved_out in (scheduled, paused):
        out.append(
            sql.SQL(QUERIES.own_table_moved_out_stand_in).format(stand_in=moved_out, view=marked)
        )
    out.append(
        sql.SQL(QUERIES.own_table_dead_letters_readers).format(
            view_name=sql.Literal(view.as_string(None)),
            dead_view_name=sql.Literal(dead_view.as_string(None)),
            marked_name=sql.Literal(marked.as_string(None)),
            stand_in_name=sql.Literal(stand_in.as_string(None)),
            scheduled_name=sql.Literal(scheduled.as_string(None)),
            paused_name=sql.Literal(paused.as_string(None)),
        )
    )
    if not layout.id_indexed:
        out.append(index(QUERIES.own_table_index_id, "id"))
    out.append(index(QUERIES.own_table_index_unsent, "unsent"))
    out.append(index(QUERIES.own_table_index_failing, "failing"))
    out.append(index(QUERIES.own_table_index_dead_letter, "dead_letter"))
    out.append(index(QUERIES.own_table_index_sent, "sent"))
    keyed = "key" in layout.index_columns
    if keyed:
        out.append(index(QUERIES.own_table_index_key, "key"))
        out.append(index(QUERIES.own_table_index_waiting, "waiting"))
    if "available_at" in layout.index_columns:
        out.append(index(QUERIES.own_table_index_scheduled, "scheduled"))
    for stale in sorted(set(existing) - set(made)):
        name = sql.Identifier(table_schema, stale) if table_schema else sql.Identifier(stale)
        out.append(sql.SQL(QUERIES.own_table_index_drop).format(index=name))
    return out


def migrate_own_table(settings: CommonSettings, *, dry_run: bool = False) -> list[str]:
    """`relay migrate --own-table`: the statements, as text; applied in one transaction
    unless `dry_run`. Run again after changing RELAY_OUTBOX_COLUMNS: it is idempotent."""
    if settings.outbox_table is None:
        raise SettingsError("RELAY_OUTBOX_TABLE", "is needed by `relay migrate --own-table`")
    with db.connect(settings, purpose="migrate") as conn:
        conn.execute(QUERIES.migrations_no_timeout)
        conn.execute(QUERIES.migrations_lock)  # one run at a time, as for the migrations
        try:
            params = {"schema": settings.outbox_view_schema, "table": settings.outbox_table}
            check = conn.execute(QUERIES.own_table_view_check, params).fetchone()
            if check is not None and check["view_exists"] and not check["view_reads_table"]:
                raise SettingsError(
                    "RELAY_OUTBOX_TABLE",
                    f"{settings.outbox_view_schema}.outbox is another table's view (its name"
                    " maps to the same view schema): rename one of the tables",
                )
            rows = conn.execute(QUERIES.own_table_columns, {"table": settings.outbox_table})
            found: list[dict[str, Any]] = rows.fetchall()
            if not found:
                raise SettingsError(
                    "RELAY_OUTBOX_TABLE", f"no table {settings.outbox_table} in this database"
                )
            columns = {r["name"]: r["type"] for r in found}
            indexed = {r["name"]: bool(r["indexed"]) for r in found}
            not_null = {r["name"]: bool(r["not_null"]) for r in found}
            existing = [
                r["name"]
                for r in conn.execute(
                    QUERIES.own_table_indexes,
                    {"table": settings.outbox_table, "prefix": _like(index_prefix(settings))},
                )
            ]
            planned = statements(
                settings, plan_layout(settings, columns, indexed, not_null), existing
            )
            texts = [s.as_string(conn) for s in planned]
            if dry_run:
                return texts
            with conn.transaction():
                for statement in planned:
                    conn.execute(statement)
        except psycopg.Error as exc:
            raise MigrationError(db.describe_error(exc)) from exc
        finally:
            if not conn.closed and not conn.broken:
                conn.execute(QUERIES.migrations_unlock)
    log.info("migration.own_table", table=settings.outbox_table, view=settings.outbox_view_schema)
    return texts


def _like(prefix: str) -> str:
    """`prefix%` as a LIKE pattern, its own _ and % taken literally."""
    return prefix.replace("\\", "\\\\").replace("_", "\\_").replace("%", "\\%") + "%"
