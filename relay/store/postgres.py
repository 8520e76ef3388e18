"""The stores on PostgreSQL: the named statements of relay/sql/drain.sql (run by
relay/store/fetch.py and relay/store/repository.py) and relay/sql/lease.sql (relay/store/lease.py),
each session opened on first use and again after a failure."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime

import psycopg
from psycopg import IsolationLevel

from relay.drain.batch import SentRows, SetAside, Settlement
from relay.lease.protocol import Attempt, LeaseToken, Shard
from relay.settings import Settings
from relay.store import connection, db, fetch, repository
from relay.store import lease as lease_steps
from relay.store.port import Fetched, FetchRequest, Promoted, StoreError


def drain_session_setup(conn: connection.AnyConn) -> None:
    """How the drain session plans: with its actual parameters (custom plans), and
    never by bitmap scan, which would read every unsent row (of the shard) to return one
    batch (relay/store/db.py, ORDERED_WALKS)."""
    connection.keep_settings(conn, {**connection.CUSTOM_PLANS, **connection.ORDERED_WALKS})


@contextmanager
def _failing_as_store_error(session: db.Session) -> Iterator[None]:
    """A failed statement closes the session (the next starts afresh) and is raised as
    the store's error, worded as `db.describe_error` words it."""
    try:
        yield
    except psycopg.Error as exc:
        session.close()
        raise StoreError(db.describe_error(exc)) from exc


class PostgresReadStore:
    """Used on the reader's thread alone (relay/drain/reader.py), but for `interrupt`.
    `set_aside`: whether rows scheduled for later, and those of paused topics, move out
    of the outbox."""

    def __init__(self, connect: Callable[[], db.Conn], shard: Shard, set_aside: SetAside) -> None:
        self._connect = connect
        self._shard = shard
        self._set_aside = set_aside
        self._session = db.Session(self._open)

    def _open(self) -> db.Conn:
        conn = self._connect()
        try:
            drain_session_setup(conn)
        except BaseException:
            conn.close()  # never leak a session whose set-up failed
            raise
        return conn

    def fetch(self, request: FetchRequest) -> Fetched:
        with _failing_as_store_error(self._session):
            return fetch.fetch(
                self._session.get(),
                request,
                shards=self._shard.shards,
                shard=self._shard.shard,
                hold=self._set_aside == "move",
            )

    def promote_due(self, limit: int) -> Promoted:
        with _failing_as_store_error(self._session):
            return repository.promote_due(
                self._session.get(),
                limit,
                shards=self._shard.shards,
                shard=self._shard.shard,
                set_aside=self._set_aside,
            )

    def paused_topics(self) -> frozenset[str]:
        with _failing_as_store_error(self._session):
            return repository.paused_topics(self._session.get())

    def unpark_resumed(self) -> int:
        with _failing_as_store_error(self._session):
            return repository.unpark_resumed(self._session.get())

    def release_paused(self, limit: int) -> tuple[int, bool]:
        if self._set_aside != "move":
            return 0, False  # an own table holds nothing out of it
        with _failing_as_store_error(self._session):
            return repository.release_paused(self._session.get(), limit)

    def interrupt(self) -> None:
        self._session.cancel()

    def close(self) -> None:
        self._session.close()


class PostgresSettleStore:
    """Owned by the settler's thread alone. `set_aside`: where the rows given up on go."""

    def __init__(self, connect: Callable[[], db.Conn], set_aside: SetAside) -> None:
        self._session = db.Session(connect)
        self._set_aside = set_aside

    def settle(
        self, token: LeaseToken, settlement: Settlement, *, ttl: float, sent_rows: SentRows
    ) -> datetime | None:
        with _failing_as_store_error(self._session):
            return repository.settle(
                self._session.get(),
                token,
                ttl,
                settlement,
                sent_rows=sent_rows,
                set_aside=self._set_aside,
            )

    def reset(self) -> None:
        self._session.close()

    def close(self) -> None:
        self._session.close()


class PostgresLeaseStore:
    """The elector's session: REPEATABLE READ, which the CAS acquisition relies on
    (relay/lease/protocol.py); opening it makes sure the lease row exists."""

    def __init__(self, settings: Settings, shard: Shard) -> None:
        self._settings = settings
        self._shard = shard
        self._session = db.Session(self._open)

    def _open(self) -> db.Conn:
        conn = db.connect(
            self._settings, purpose="lease", isolation_level=IsolationLevel.REPEATABLE_READ
        )
        try:
            lease_steps.ensure_row(conn, self._shard.name, self._shard)
        except BaseException:
            conn.close()
            raise
        return conn

    def try_acquire(self, holder: str, ttl: float) -> Attempt:
        with _failing_as_store_error(self._session):
            return lease_steps.try_acquire(
                self._session.get(), self._shard.name, holder, ttl, self._shard
            )

    def renew(self, token: LeaseToken, ttl: float) -> bool:
        with _failing_as_store_error(self._session):
            return lease_steps.renew(self._session.get(), token, ttl)

    def release(self, token: LeaseToken) -> bool:
        with _failing_as_store_error(self._session):
            return lease_steps.release(self._session.get(), token)

    def reset(self) -> None:
        self._session.close()

    def close(self) -> None:
        self._session.close()


class PostgresStore:
    """One lane's drain sessions, each named for its purpose in pg_stat_activity."""

    def __init__(self, settings: Settings, shard: Shard) -> None:
        self._settings = settings
        self._shard = shard

    def reading(self) -> PostgresReadStore:
        return PostgresReadStore(
            lambda: db.connect(self._settings, purpose="drain"),
            self._shard,
            self._settings.set_aside,
        )

    def settling(self) -> PostgresSettleStore:
        return PostgresSettleStore(
            lambda: db.connect(self._settings, purpose="settle"), self._settings.set_aside
        )
