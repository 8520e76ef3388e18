"""Bring your own outbox table: drain an existing table (say, Debezium's outbox event
router layout) without changing the app's columns or its inserts.

`relay migrate --own-table` adds the relay's bookkeeping columns (relay_*) and partial
indexes to the table, and a view `relay_<schema>_<table>.outbox` that shows it in the
relay's layout (RELAY_OUTBOX_COLUMNS names which column is which field). The daemon's
sessions put that schema first on their search_path (`db.connect`), so every
statement in queries.sql runs unchanged: the view is simple, so PostgreSQL plans
through it to the table's indexes, and UPDATEs and DELETEs reach the table's rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from relay import db
from relay.errors import MigrationError, SettingsError
from relay.logging import get_logger
from relay.queries import QUERIES
from relay.settings import OWN_TABLE_FIELDS, CommonSettings

log = get_logger("relay.own_table")

_INTEGER = {"bigint", "integer", "smallint"}
# The relay's columns in the table (own_table_bookkeeping adds them).
BOOKKEEPING = (
    "relay_sent_at",
    "relay_attempts",
    "relay_next_attempt_at",
    "relay_last_error",
    "relay_dead_lettered_at",
    "relay_dead_letter_reason",
    "relay_promoted_at",
)
_TEXT = {"text", "character varying", "character", "name"}
_JSON = {"jsonb", "json"}


@dataclass(frozen=True, slots=True)
class Layout:
    """How the relay's fields are read from the table: SQL expressions over `t`."""

    table: sql.Composable
    adds: list[LiteralString]  # bookkeeping columns the table lacks: their statements
    fields: dict[str, sql.Composable]  # field -> expression in the view
    index_columns: dict[str, sql.Composable]  # id, key, available_at on the bare table
    id_indexed: bool  # an index leads with the id column already
    bookkept: bool  # the relay_* bookkeeping columns are there already


def _column(name: str, prefix: str | None = None) -> sql.Composable:
    return sql.Identifier(prefix, name) if prefix else sql.Identifier(name)


def plan_layout(
    settings: CommonSettings, columns: dict[str, str], indexed: dict[str, bool] | None = None
) -> Layout:
    """Map the relay's fields onto `columns` (name -> type; `indexed`: whether an index
    leads with it); a clear error for a mapping the table cannot serve."""
    indexed = indexed or {}
    assert settings.outbox_table is not None
    mapping = dict(settings.outbox_columns)
    for field in OWN_TABLE_FIELDS:
        if field not in mapping and field in columns:
            mapping[field] = field  # the column of the field's own name
    missing = sorted(c for c in mapping.values() if c not in columns)
    if missing:
        raise SettingsError(
            "RELAY_OUTBOX_COLUMNS", f"{settings.outbox_table} has no column {', '.join(missing)}"
        )

    def kind(field: str) -> str:
        return columns[mapping[field]]

    adds: list[LiteralString] = []
    fields: dict[str, sql.Composable] = {}
    bare: dict[str, sql.Composable] = {}

    def col(field: str, on: str | None = "t") -> sql.Composable:
        return _column(mapping[field], on)

    if "id" in mapping and kind("id") in _INTEGER:
        fields["id"], bare["id"] = col("id"), col("id", None)
    elif "id" in mapping and settings.outbox_columns.get("id"):
        raise SettingsError(
            "RELAY_OUTBOX_COLUMNS", f"id must be an integer column, not {kind('id')}"
        )
    else:
        adds.append(QUERIES.own_table_add_id)
        fields["id"], bare["id"] = sql.SQL("t.relay_id"), sql.SQL("relay_id")
    if "message_id" in mapping:
        fields["message_id"] = sql.SQL("{}::text").format(col("message_id"))
    else:
        adds.append(QUERIES.own_table_add_message_id)
        fields["message_id"] = sql.SQL("t.relay_message_id::text")
    if "topic" not in mapping:
        raise SettingsError(
            "RELAY_OUTBOX_COLUMNS",
            'no column for topic: name one, e.g. {"topic": "aggregatetype"}',
        )
    fields["topic"] = sql.SQL("{}::text").format(col("topic"))
    if "key" in mapping:
        fields["key"] = sql.SQL("{}::text").format(col("key"))
        bare["key"] = sql.SQL("({}::text)").format(col("key", None))
    else:
        fields["key"] = sql.SQL("NULL::text")
    fields["payload"] = _payload(mapping.get("payload"), columns)
    fields["headers"] = _headers(mapping, columns)
    for field in ("created_at", "available_at"):
        if field in mapping and kind(field) != "timestamp with time zone":
            # A cast from `timestamp` depends on the session's TimeZone: wrong by its
            # offset, and no index can be built on it.
            raise SettingsError(
                "RELAY_OUTBOX_COLUMNS", f"{field} must be a timestamptz column, not {kind(field)}"
            )
    if "created_at" in mapping:
        fields["created_at"] = col("created_at")
    else:
        adds.append(QUERIES.own_table_add_created_at)
        fields["created_at"] = sql.SQL("t.relay_created_at")
    if "available_at" in mapping:
        fields["available_at"] = col("available_at")
        bare["available_at"] = col("available_at", None)
    else:
        fields["available_at"] = sql.SQL("NULL::timestamptz")
    table = sql.Identifier(*settings.outbox_table.split("."))
    id_indexed = "id" in mapping and kind("id") in _INTEGER and indexed.get(mapping["id"], False)
    bookkept = all(column in columns for column in BOOKKEEPING)
    return Layout(table, adds, fields, bare, id_indexed, bookkept)


def _payload(column: str | None, columns: dict[str, str]) -> sql.Composable:
    if column is None:
        return sql.SQL("NULL::bytea")
    kind = columns[column]
    ref = _column(column, "t")
    if kind == "bytea":
        return ref
    if kind in _TEXT:
        return sql.SQL("convert_to({}, 'UTF8')").format(ref)
    if kind in _JSON:  # sent as PostgreSQL prints it
        return sql.SQL("convert_to({}::text, 'UTF8')").format(ref)
    raise SettingsError(
        "RELAY_OUTBOX_COLUMNS", f"payload must be bytea, text or json(b), not {kind}"
    )


def _headers(mapping: dict[str, str], columns: dict[str, str]) -> sql.Composable:
    """The row's headers: its own jsonb object, if mapped, plus one per header:NAME."""
    pairs = [
        sql.SQL("{}, {}").format(sql.Literal(field.removeprefix("header:")), _column(column, "t"))
        for field, column in mapping.items()
        if field.startswith("header:")
    ]
    parts: list[sql.Composable] = []
    if "headers" in mapping:
        if columns[mapping["headers"]] not in _JSON:
            raise SettingsError("RELAY_OUTBOX_COLUMNS", "headers must be a json(b) column")
        parts.append(sql.SQL("{}::jsonb").format(_column(mapping["headers"], "t")))
    if pairs:
        parts.append(sql.SQL("jsonb_build_object({})").format(sql.SQL(", ").join(pairs)))
    if not parts:
        return sql.SQL("NULL::jsonb")
    if len(parts) == 1:
        return parts[0]
    return sql.SQL("coalesce({}, '{{}}'::jsonb) || {}").format(parts[0], parts[1])


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

    def index(query: LiteralString, what: str) -> sql.Composed:
        """The index, named for its definition: a changed mapping makes new ones (and
        the old ones go), where IF NOT EXISTS would keep a stale one by its name."""
        args = {"table": table, "due": due, **layout.index_columns}
        definition = sql.SQL(query).format(index=sql.Identifier("_"), **args).as_string(None)
        digest = hashlib.sha256(definition.encode()).hexdigest()[:8]
        name = f"{index_prefix(settings)}{what}_{digest}"
        made.append(name)
        return sql.SQL(query).format(index=sql.Identifier(name), **args)

    due: sql.Composable = sql.SQL("true")
    if "available_at" in layout.index_columns:
        due = sql.SQL("({} IS NULL OR relay_promoted_at IS NOT NULL)").format(
            layout.index_columns["available_at"]
        )
    out: list[sql.Composed] = []
    if not layout.bookkept:  # ALTER TABLE locks the table even when it changes nothing
        out.append(sql.SQL(QUERIES.own_table_bookkeeping).format(table=table))
    out += [sql.SQL(add).format(table=table) for add in layout.adds]
    out.append(sql.SQL(QUERIES.own_table_schema).format(schema=sql.Identifier(schema)))
    out.append(sql.SQL(QUERIES.own_table_view).format(view=view, table=table, **layout.fields))
    if not layout.id_indexed:
        out.append(index(QUERIES.own_table_index_id, "id"))
    out.append(index(QUERIES.own_table_index_unsent, "unsent"))
    out.append(index(QUERIES.own_table_index_failing, "failing"))
    out.append(index(QUERIES.own_table_index_dead_letter, "dead_letter"))
    out.append(index(QUERIES.own_table_index_sent, "sent"))
    keyed = "key" in layout.index_columns
    if keyed:
        out.append(index(QUERIES.own_table_index_key, "key"))
        out.append(index(QUERIES.own_table_index_backoff, "backoff"))
    if "available_at" in layout.index_columns:
        out.append(index(QUERIES.own_table_index_scheduled, "scheduled"))
        if keyed:
            out.append(index(QUERIES.own_table_index_scheduled_key, "scheduled_key"))
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
            existing = [
                r["name"]
                for r in conn.execute(
                    QUERIES.own_table_indexes,
                    {"table": settings.outbox_table, "prefix": _like(index_prefix(settings))},
                )
            ]
            planned = statements(settings, plan_layout(settings, columns, indexed), existing)
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
