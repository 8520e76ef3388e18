"""Writing to the outbox from a Python app: one INSERT, inside the app's own transaction.

The helper never commits: the outbox row must land in the same transaction as the
business write it announces, or not at all. It is the `enqueue` statement of
producer.sql, which apps on other stacks can run as plain SQL (README, "Write to the
outbox").
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from relay.message import REPLAY_HEADER, RESERVED_HEADERS
from relay.sql import QUERIES


@functools.cache
def _trace_context() -> Callable[[], dict[str, str]] | None:
    """What writes the current W3C trace context into a dict, loaded on the first
    enqueue (importing OpenTelemetry costs tens of milliseconds); None without
    opentelemetry-api."""
    try:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return None
    propagator = TraceContextTextMapPropagator()

    def current() -> dict[str, str]:
        carrier: dict[str, str] = {}
        if trace.get_current_span().get_span_context().is_valid:
            propagator.inject(carrier)
        return carrier

    return current


Payload = bytes | bytearray | memoryview | str | None


@dataclass(frozen=True, slots=True)
class Enqueued:
    """The new row's id (its place in the per-key order) and its stable message id,
    which consumers see as the `message-id` header."""

    id: int
    message_id: uuid.UUID


Delay = float | int | timedelta


def _statement(
    topic: str,
    payload: Payload,
    key: str | None,
    headers: Mapping[str, str] | None,
    notify: str | None,
    available_at: datetime | None = None,
    delay: Delay | None = None,
    trace_context: bool = True,
) -> tuple[str, dict[str, Any]]:
    """The statement to run and its parameters: `enqueue`, `enqueue_notify`, or
    `enqueue_scheduled`. An unscheduled row is written without naming `available_at`,
    so an app can take a newer relay package before the database can schedule rows."""
    params = _params(topic, payload, key, headers, trace_context)
    if notify is not None and (not isinstance(notify, str) or not notify):
        raise ValueError("notify must be the channel name (RELAY_NOTIFY_CHANNEL)")
    seconds = _schedule(available_at, delay)
    if available_at is not None or seconds:
        return QUERIES.enqueue_scheduled, {
            **params,
            "available_at": available_at,
            "delay": seconds,
            "channel": notify,
        }
    if notify is None:
        return QUERIES.enqueue, params
    return QUERIES.enqueue_notify, {**params, "channel": notify}


def _schedule(available_at: datetime | None, delay: Delay | None) -> float:
    """The delay in seconds (0: none), after checking the two ways to say when."""
    if available_at is not None:
        if delay is not None:
            raise ValueError("give available_at or delay, not both")
        if not isinstance(available_at, datetime):
            raise TypeError(f"available_at must be a datetime, not {type(available_at).__name__}")
        if available_at.tzinfo is None or available_at.utcoffset() is None:
            # A naive time would be read in the session's TimeZone: an hour off in
            # some deployments, silently.
            raise ValueError("available_at must be timezone-aware (say, tzinfo=UTC)")
        return 0.0
    if delay is None:
        return 0.0
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise TypeError(f"delay must be seconds or a timedelta, not {type(delay).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"delay must be a finite number of seconds >= 0, got {delay!r}")
    return seconds


def _params(
    topic: str,
    payload: Payload,
    key: str | None,
    headers: Mapping[str, str] | None,
    trace_context: bool = True,
) -> dict[str, Any]:
    if not isinstance(topic, str) or not topic:
        raise ValueError("topic must be a non-empty string")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a str or None, not {type(key).__name__}")
    if headers is not None:
        # The relay sends header values as given; strings keep them byte-exact.
        bad = [k for k, v in headers.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"header names and values must be str: {bad!r}")
        reserved = [k for k in headers if k.lower() in (*RESERVED_HEADERS, REPLAY_HEADER)]
        if reserved:
            raise ValueError(f"headers {reserved!r} are set by the relay itself")
    if trace_context:
        headers = _with_trace_context(headers)
    return {
        "topic": topic,
        "key": key,
        "payload": payload.encode("utf-8") if isinstance(payload, str) else payload,
        "headers": None if headers is None else Jsonb(dict(headers)),
    }


def _with_trace_context(headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """The app's current W3C trace context (`traceparent`, `tracestate`) added to the
    row's headers when a span is active, so the message joins the app's trace. If the
    app set either header itself, neither is added (a tracestate belongs with its own
    traceparent). Without opentelemetry-api installed: nothing to do."""
    current = _trace_context()
    if current is None:
        return headers
    if headers and any(name.lower() in ("traceparent", "tracestate") for name in headers):
        return headers
    carrier = current()
    if not carrier:
        return headers
    return {**headers, **carrier} if headers else carrier


def _require_transaction(autocommit: bool, status: TransactionStatus) -> None:
    """On an autocommit connection outside `conn.transaction()` the outbox row would
    commit on its own, whether or not the business write does: the one thing the
    outbox pattern exists to prevent."""
    if autocommit and status == TransactionStatus.IDLE:
        raise RuntimeError(
            "relay.enqueue needs a transaction: the connection is in autocommit mode and"
            " none is open; wrap the business write and the enqueue in conn.transaction()"
        )


def _enqueued(row: tuple[Any, ...] | None) -> Enqueued:
    assert row is not None  # INSERT ... RETURNING one row
    return Enqueued(id=int(row[0]), message_id=row[1])


def enqueue(
    conn: psycopg.Connection[Any],
    topic: str,
    payload: Payload,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    *,
    notify: str | None = None,
    available_at: datetime | None = None,
    delay: Delay | None = None,
    trace_context: bool = True,
) -> Enqueued:
    """Add a message to the outbox in `conn`'s current transaction (no commit).

    `payload` is bytes (Avro, Protobuf, ...) or str (sent as UTF-8); rows of the same
    `key` are delivered in the order they are enqueued. `notify`: the relays'
    RELAY_NOTIFY_CHANNEL, to wake them at commit instead of at their next poll.
    `available_at` (timezone-aware) or `delay` (seconds or a timedelta, from the
    transaction's start): not published before then, by the database clock; later
    rows of the same key wait for it (docs/howto/scheduled-delivery.md).
    `trace_context`: inside an active OpenTelemetry span, write its W3C trace context
    into the headers (docs/howto/tracing.md); False keeps it out (say, for a webhook to a
    third party).
    """
    _require_transaction(conn.autocommit, conn.info.transaction_status)
    statement, params = _statement(
        topic, payload, key, headers, notify, available_at, delay, trace_context
    )
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(statement, params)
        return _enqueued(cur.fetchone())


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    topic: str,
    payload: Payload,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    *,
    notify: str | None = None,
    available_at: datetime | None = None,
    delay: Delay | None = None,
    trace_context: bool = True,
) -> Enqueued:
    """`enqueue` for an asyncio app's `psycopg.AsyncConnection`."""
    _require_transaction(conn.autocommit, conn.info.transaction_status)
    statement, params = _statement(
        topic, payload, key, headers, notify, available_at, delay, trace_context
    )
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(statement, params)
        return _enqueued(await cur.fetchone())


def cancel(conn: psycopg.Connection[Any], row_id: int) -> bool:
    """Take back a row scheduled for later (`enqueue(available_at=...)` or `delay`), in
    `conn`'s current transaction, if the relay has not let it into the drain yet: True
    if it did, and then the row is never published once that transaction commits. A row
    already due and let in may be on its way to the sink: it is left, and this says
    False. A DELETE on `outbox` alone can miss a scheduled row: the relay moves those
    due later out into `outbox_scheduled` (docs/howto/scheduled-delivery.md)."""
    ids = {"ids": [_row_id(row_id)]}
    with conn.cursor(row_factory=tuple_row) as cur:
        for _ in range(2):  # again: a row moved between the tables while we waited
            if cur.execute(QUERIES.cancel, ids).fetchall():
                return True
    return False


async def cancel_async(conn: psycopg.AsyncConnection[Any], row_id: int) -> bool:
    """`cancel` for an asyncio app's `psycopg.AsyncConnection`."""
    ids = {"ids": [_row_id(row_id)]}
    async with conn.cursor(row_factory=tuple_row) as cur:
        for _ in range(2):
            await cur.execute(QUERIES.cancel, ids)
            if await cur.fetchall():
                return True
    return False


def _row_id(row_id: int) -> int:
    if isinstance(row_id, bool) or not isinstance(row_id, int):
        raise TypeError(f"row_id must be the row's id (Enqueued.id), not {type(row_id).__name__}")
    return row_id
