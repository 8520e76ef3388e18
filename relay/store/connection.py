"""What a relay session is: a psycopg connection that keeps its settings, for the
session on a direct connection, or per transaction behind a transaction pooler
(PgBouncer, RDS Proxy, Supavisor, PgCat), which it finds by itself."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, Self

import psycopg
from psycopg import Transaction
from psycopg.abc import Params, QueryNoTemplate
from psycopg.pq import TransactionStatus
from psycopg.rows import Row

from relay.sql import QUERIES

# Any session the relay's settings can be applied to (a test's or the benchmark's too).
AnyConn = psycopg.Connection[Any]


# For every relay session (relay/store/db.py, connect): no JIT. Each statement is a
# bounded index walk of milliseconds, which compiling would cost more than it saves; and
# with sorts off (ORDERED_WALKS) PostgreSQL before 18 prices a plan that must sort far
# past jit_above_cost, so a statement like lag_sample was compiled on every run (about
# 100 functions, half a second of the database's CPU, several seconds on a busy server).
NO_JIT = {"jit": "off"}

# For the drain and lag sessions: plan with the actual parameters, so the in-flight
# exclusion is a hashed lookup, the key cursor and the shard count constants (the shard
# indexes match); without JIT, which a session of a test or a benchmark that plans as
# the drain does (these settings alone) would otherwise compile on every call.
CUSTOM_PLANS = {"plan_cache_mode": "force_custom_plan", **NO_JIT}

# For the drain and lag sessions: no bitmap scans. Every statement of these sessions is
# meant as an ordered, LIMITed index walk that stops at the batch: the primary key's in
# id order, a shard index's (outbox_shards_N_due_idx leads with the shard hash, which
# has no correlation with the table's order, so the planner prices its ordered walk as
# random reads). With statistics that see fewer rows to send than there are (taken
# while a schedule sat in the outbox, say), the planner would rather read ALL of the
# unsent rows through the key-hash index (by a bitmap, or else by a plain index scan)
# and sort them: a fetch whose cost grows with the backlog. Sorts off too, then: a plan
# that needs one is taken only when no other exists (fetch_batch's rounds over keys,
# say), and the walk in id order never needs one. The plan tests of tests/test_fetch.py,
# test_fairness.py and test_scheduled.py hold both.
ORDERED_WALKS = {"enable_bitmapscan": "off", "enable_sort": "off"}


class RelayConnection(psycopg.Connection[dict[str, Any]]):
    """A relay session, which may reach PostgreSQL through a transaction pooler
    (PgBouncer, RDS Proxy, Supavisor, PgCat). There (`pooled`) a server connection is
    this session's only for one transaction: what the session runs with (`keep`) is set
    at the start of each transaction instead, a statement outside one runs after them in
    an implicit transaction of its own, and nothing is prepared, since the next
    transaction may meet another server."""

    pooled: bool = False
    _kept: dict[str, str] | None = None
    _depth = 0  # RelayConnection.transaction blocks open

    def keep(self, settings: Mapping[str, str]) -> None:
        """Run the rest of this session with `settings` (PostgreSQL's, by name)."""
        if not settings:
            return
        if not self.pooled:
            apply_settings(self, settings, local=False)
            return
        self._kept = {**(self._kept or {}), **settings}

    @contextmanager
    def transaction(
        self, savepoint_name: str | None = None, force_rollback: bool = False
    ) -> Iterator[Transaction]:
        outermost = self._depth == 0 and self.info.transaction_status == TransactionStatus.IDLE
        self._depth += 1
        try:
            if not (outermost and self._kept):
                with super().transaction(savepoint_name, force_rollback) as tx:
                    yield tx
                return
            with ExitStack() as stack:
                # BEGIN and the settings in one round trip: a pipeline sends both, and
                # ends before the block runs.
                with self.pipeline():
                    tx = stack.enter_context(super().transaction(savepoint_name, force_rollback))
                    apply_settings(self, self._kept, local=True)
                yield tx
        finally:
            self._depth -= 1

    @contextmanager
    def settings_first(self) -> Iterator[None]:
        """The statements of the block run after the kept settings, in one round trip
        and one transaction: up to its Sync, the extended protocol runs what a pipeline
        sends in one implicit transaction, whose end (commit, or rollback on an error)
        also ends the settings. A pooler keeps one server connection for it."""
        self._depth += 1
        try:
            with self.pipeline():
                assert self._kept
                apply_settings(self, self._kept, local=True)
                yield
        finally:
            self._depth -= 1

    def needs_own_transaction(self) -> bool:
        """A statement about to run outside a transaction must run in one of its own,
        after the kept settings, when they cannot be the session's."""
        return (
            bool(self._kept)
            and self._depth == 0
            and self.info.transaction_status == TransactionStatus.IDLE
        )


class RelayCursor(psycopg.Cursor[Row]):
    """RelayConnection's cursor: through a pooler, a statement outside a transaction runs
    in one of its own, so it runs with the session's kept settings."""

    def execute(  # type: ignore[override]  # the relay passes no template strings
        self,
        query: QueryNoTemplate,
        params: Params | None = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        conn = self.connection
        if isinstance(conn, RelayConnection) and conn.needs_own_transaction():
            with conn.settings_first():
                return super().execute(query, params, prepare=prepare, binary=binary)
        return super().execute(query, params, prepare=prepare, binary=binary)


def apply_settings(conn: AnyConn, settings: Mapping[str, str], *, local: bool) -> None:
    conn.execute(
        QUERIES.apply_settings,
        {"names": list(settings), "values": list(settings.values()), "local": local},
    )


def keep_settings(conn: AnyConn, settings: Mapping[str, str]) -> None:
    """`RelayConnection.keep` on the relay's sessions; any other session (a test's, say)
    takes them for the session."""
    if isinstance(conn, RelayConnection):
        conn.keep(settings)
    else:
        apply_settings(conn, settings, local=False)


def behind_pooler(conn: AnyConn) -> bool:
    """Whether `conn` reaches PostgreSQL through a pooler: the backend a pooler announces
    (its own cancel key, since it must route a cancel itself) is not the one that runs
    the statement. A direct session's are the same process."""
    row = conn.execute(QUERIES.session_backend).fetchone()
    return row is not None and row["pid"] != conn.info.backend_pid
