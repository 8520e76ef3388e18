"""How an own table's columns are read in the relay's layout (RELAY_OUTBOX_COLUMNS): the
SQL expressions of the view `relay migrate --own-table` builds, and a clear error for a
mapping the table cannot serve. Pure: the table's columns come in, SQL comes out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import LiteralString

from psycopg import sql

from relay.errors import SettingsError
from relay.settings import OWN_TABLE_FIELDS, CommonSettings
from relay.sql import QUERIES

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
# The function `--own-table` makes in the view's schema (own_table_jsonb).
JSONB_OR_REASON = "jsonb_or_reason"
# What the view's comment says it is: a view of another layout (an earlier release's)
# is refused at start-up until `relay migrate --own-table` runs again.
OWN_TABLE_LAYOUT = "relay own-table view, layout 3"
# A header:NAME column's value at most (a header; and jsonb holds no string past 256 MB).
HEADER_VALUE_MAX_BYTES = 65536
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
    settings: CommonSettings,
    columns: dict[str, str],
    indexed: dict[str, bool] | None = None,
    not_null: dict[str, bool] | None = None,
) -> Layout:
    """Map the relay's fields onto `columns` (name -> type; `indexed`: whether an index
    leads with it; `not_null`: whether it is declared NOT NULL); a clear error for a
    mapping the table cannot serve.

    Whatever a row holds, the view shows it so that the fetch can say why it cannot be
    sent (a NULL topic or created_at, a message id no header can carry, json headers
    jsonb cannot hold): such a row is dead-lettered with that reason, the drain goes on.
    Only the id cannot be handled so: a row without one could never be settled."""
    assert settings.outbox_table is not None and settings.outbox_view_schema is not None
    plan = _Planner(settings.outbox_table, _full_mapping(settings, columns), columns)
    plan.id(explicit="id" in settings.outbox_columns, not_null=not_null or {})
    plan.message_id()
    plan.topic_and_key()
    plan.fields["payload"] = _payload(plan.mapping.get("payload"), columns)
    plan.fields["headers"] = _headers(plan.mapping, columns, settings.outbox_view_schema)
    plan.times()
    table = sql.Identifier(*settings.outbox_table.split("."))
    mapping = plan.mapping
    id_indexed = (
        "id" in mapping
        and plan.kind("id") in _INTEGER
        and (indexed or {}).get(mapping["id"], False)
    )
    bookkept = all(column in columns for column in BOOKKEEPING)
    return Layout(table, plan.adds, plan.fields, plan.bare, id_indexed, bookkept)


def _full_mapping(settings: CommonSettings, columns: dict[str, str]) -> dict[str, str]:
    """RELAY_OUTBOX_COLUMNS, plus each field not named that has a column of its name."""
    mapping = dict(settings.outbox_columns)
    for field in OWN_TABLE_FIELDS:
        if field not in mapping and field in columns:
            mapping[field] = field
    missing = sorted(c for c in mapping.values() if c not in columns)
    if missing:
        raise SettingsError(
            "RELAY_OUTBOX_COLUMNS", f"{settings.outbox_table} has no column {', '.join(missing)}"
        )
    return mapping


class _Planner:
    """The view's expression for each field (`fields`, over the table as `t`), the
    bare columns the indexes are built on (`bare`), and the columns to add (`adds`)."""

    def __init__(self, table: str, mapping: dict[str, str], columns: dict[str, str]) -> None:
        self.table, self.mapping, self.columns = table, mapping, columns
        self.adds: list[LiteralString] = []
        self.fields: dict[str, sql.Composable] = {}
        self.bare: dict[str, sql.Composable] = {}

    def kind(self, field: str) -> str:
        return self.columns[self.mapping[field]]

    def col(self, field: str, on: str | None = "t") -> sql.Composable:
        return _column(self.mapping[field], on)

    def id(self, *, explicit: bool, not_null: dict[str, bool]) -> None:
        mapping = self.mapping
        if "id" in mapping and self.kind("id") in _INTEGER:
            if not not_null.get(mapping["id"], True):
                raise SettingsError(
                    "RELAY_OUTBOX_COLUMNS",
                    f"id column {mapping['id']} may be NULL, and a row without an id can"
                    f" never be marked sent: declare it NOT NULL (ALTER TABLE {self.table}"
                    f" ALTER COLUMN {mapping['id']} SET NOT NULL) or map no id column (the"
                    " relay then adds relay_id)",
                )
            self.fields["id"], self.bare["id"] = self.col("id"), self.col("id", None)
        elif "id" in mapping and explicit:
            raise SettingsError(
                "RELAY_OUTBOX_COLUMNS", f"id must be an integer column, not {self.kind('id')}"
            )
        else:
            self.adds.append(QUERIES.own_table_add_id)
            self.fields["id"], self.bare["id"] = sql.SQL("t.relay_id"), sql.SQL("relay_id")

    def message_id(self) -> None:
        if "message_id" in self.mapping and self.kind("message_id") == "uuid":
            self.fields["message_id"] = sql.SQL("{}::text").format(self.col("message_id"))
        elif "message_id" in self.mapping:
            # Sent as a header by every sink: a line break would add headers of its own,
            # and outside visible ASCII each sink's header rules differ.
            self.fields["message_id"] = sql.SQL(
                "CASE WHEN {id}::text ~ '^[!-~]{{1,255}}$' THEN {id}::text END"
            ).format(id=self.col("message_id"))
        else:
            self.adds.append(QUERIES.own_table_add_message_id)
            self.fields["message_id"] = sql.SQL("t.relay_message_id::text")

    def topic_and_key(self) -> None:
        if "topic" not in self.mapping:
            raise SettingsError(
                "RELAY_OUTBOX_COLUMNS",
                'no column for topic: name one, e.g. {"topic": "aggregatetype"}',
            )
        self.fields["topic"] = sql.SQL("{}::text").format(self.col("topic"))
        if "key" in self.mapping:
            self.fields["key"] = sql.SQL("{}::text").format(self.col("key"))
            self.bare["key"] = sql.SQL("({}::text)").format(self.col("key", None))
        else:
            self.fields["key"] = sql.SQL("NULL::text")

    def times(self) -> None:
        for field in ("created_at", "available_at"):
            if field in self.mapping and self.kind(field) != "timestamp with time zone":
                # A cast from `timestamp` depends on the session's TimeZone: wrong by its
                # offset, and no index can be built on it.
                raise SettingsError(
                    "RELAY_OUTBOX_COLUMNS",
                    f"{field} must be a timestamptz column, not {self.kind(field)}",
                )
        if "created_at" in self.mapping:
            self.fields["created_at"] = self.col("created_at")
        else:
            self.adds.append(QUERIES.own_table_add_created_at)
            self.fields["created_at"] = sql.SQL("t.relay_created_at")
        if "available_at" in self.mapping:
            self.fields["available_at"] = self.col("available_at")
            self.bare["available_at"] = self.col("available_at", None)
        else:
            self.fields["available_at"] = sql.SQL("NULL::timestamptz")


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


def _headers(mapping: dict[str, str], columns: dict[str, str], schema: str) -> sql.Composable:
    """The row's headers: its own jsonb object, if mapped, plus one per header:NAME.
    Whatever a row holds, this never fails (which would fail every fetch): headers
    jsonb cannot hold, or a header column too long for one, become a JSON string that
    says so, which the fetch turns into the row's dead-letter reason."""
    pairs = [
        sql.SQL("{}, {}").format(
            sql.Literal(field.removeprefix("header:")), _header_value(column, columns)
        )
        for field, column in mapping.items()
        if field.startswith("header:")
    ]
    parts: list[sql.Composable] = []
    if "headers" in mapping:
        if columns[mapping["headers"]] not in _JSON:
            raise SettingsError("RELAY_OUTBOX_COLUMNS", "headers must be a json(b) column")
        parts.append(
            _as_jsonb(_column(mapping["headers"], "t"), columns[mapping["headers"]], schema)
        )
    if pairs:
        parts.append(sql.SQL("jsonb_build_object({})").format(sql.SQL(", ").join(pairs)))
    if not parts:
        return sql.SQL("NULL::jsonb")
    combined = parts[0]
    if len(parts) == 2:  # a string is a reason the row cannot be sent: it stays alone
        combined = sql.SQL(
            "CASE WHEN jsonb_typeof({own}) = 'string' THEN {own}"
            " ELSE coalesce({own}, '{{}}'::jsonb) || {columns} END"
        ).format(own=parts[0], columns=parts[1])
    return _header_columns_fit(mapping, combined)


def _as_jsonb(ref: sql.Composable, kind: str, schema: str) -> sql.Composable:
    r"""A json column as jsonb, which cannot hold all that json can (\u0000, a number
    past its range, a lone surrogate): the migration's function says why instead."""
    if kind == "jsonb":
        return ref
    return sql.SQL("{}({})").format(sql.Identifier(schema, JSONB_OR_REASON), ref)


def _header_columns_fit(mapping: dict[str, str], headers: sql.Composable) -> sql.Composable:
    """`headers`, unless a header:NAME column holds more than a header may: then why."""
    checks = [
        sql.SQL("WHEN octet_length({col}::text) > {most} THEN to_jsonb({why}::text)").format(
            col=_column(column, "t"),
            most=sql.Literal(HEADER_VALUE_MAX_BYTES),
            why=sql.Literal(
                f"header {field.removeprefix('header:')} holds over {HEADER_VALUE_MAX_BYTES} bytes"
            ),
        )
        for field, column in mapping.items()
        if field.startswith("header:")
    ]
    if not checks:
        return headers
    return sql.SQL("CASE {} ELSE {} END").format(sql.SQL(" ").join(checks), headers)


def _header_value(column: str, columns: dict[str, str]) -> sql.Composable:
    r"""A header:NAME column's value: JSON as its text (a header is a string, and a json
    value could hold \u0000), anything else as it is."""
    ref = _column(column, "t")
    return sql.SQL("{}::text").format(ref) if columns[column] in _JSON else ref
