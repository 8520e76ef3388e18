"""Opening relay sessions: credentials, TLS, the session timeouts docs/DESIGN.md describes,
and what needs a session of its own behind a pooler (relay/store/connection.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg import IsolationLevel
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from pydantic import SecretStr

from relay.errors import SettingsError
from relay.setting_checks import is_loopback
from relay.settings import CommonSettings, Settings
from relay.sql import QUERIES
from relay.store import connection
from relay.store.own_table_layout import OWN_TABLE_LAYOUT

# What every relay session is: autocommit, rows as dicts (see `connect`).
Conn = psycopg.Connection[dict[str, Any]]


def connect_kwargs(settings: CommonSettings) -> dict[str, Any]:
    """libpq keyword arguments layered over RELAY_DATABASE_URL."""
    kwargs: dict[str, Any] = {
        "connect_timeout": settings.database_connect_timeout_seconds,
        # Dead peers are noticed in seconds rather than after the kernel's two hours.
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        # Keepalives only cover an idle socket; this bounds a request whose packets go
        # unacknowledged (a partition mid-query), which otherwise blocks for ~15 minutes.
        "tcp_user_timeout": max(10_000, milliseconds(settings.database_statement_timeout_seconds)),
    }
    if settings.database_password is not None:
        kwargs["password"] = settings.database_password.get_secret_value()
    return kwargs


# What each sslmode short of verify-ca does to a password sent over it.
_UNVERIFIED = {
    "disable": "sends it in plaintext",
    "allow": "sends it in plaintext unless the server insists on TLS",
    "prefer": "falls back to plaintext if TLS fails, and checks no certificate",
    "require": "encrypts, but checks no certificate: whoever answers gets it",
}


def unverified_passwords(
    settings: CommonSettings, environ: Mapping[str, str]
) -> list[tuple[str, str]]:
    """(variable, why) for each database URL over which the password could be read in
    transit (CommonSettings.database_urls)."""
    found = []
    for variable, url in settings.database_urls().items():
        problem = _unverified(settings, variable, url, environ)
        if problem is not None:
            found.append((variable, problem))
    return found


def unverified_password(settings: CommonSettings, environ: Mapping[str, str]) -> str | None:
    """unverified_passwords' answer for RELAY_DATABASE_URL alone."""
    return _unverified(settings, "RELAY_DATABASE_URL", settings.database_url, environ)


def _unverified(
    settings: CommonSettings, variable: str, url: SecretStr, environ: Mapping[str, str]
) -> str | None:
    """Why the database password could be read in transit over `url` (`variable`'s), or
    None: a password is sent (the URL's, RELAY_DATABASE_PASSWORD or PGPASSWORD) to a host
    not on this machine, and the effective sslmode (the URL's, else PGSSLMODE, else
    libpq's prefer) does not verify the server. require with a root certificate verifies
    it as verify-ca does (libpq's rule)."""
    params = conninfo_to_dict(url.get_secret_value())
    if not (settings.database_password or params.get("password") or environ.get("PGPASSWORD")):
        return None
    hosts = str(params.get("hostaddr") or params.get("host") or environ.get("PGHOST") or "")
    if all(_on_this_machine(host) for host in hosts.split(",")):
        return None
    mode = str(params.get("sslmode") or environ.get("PGSSLMODE") or "prefer")
    rootcert = params.get("sslrootcert") or environ.get("PGSSLROOTCERT")
    exposure = _UNVERIFIED.get(mode)
    if exposure is None or (mode == "require" and rootcert):
        return None
    return (
        f"the database password goes to a remote server with sslmode={mode}, which"
        f" {exposure}; put sslmode=verify-full and sslrootcert=<the server's CA file> in"
        f" {variable} (?sslmode=verify-full&sslrootcert=/path/ca.crt)"
    )


def _on_this_machine(host: str) -> bool:
    """A Unix socket (a directory, or an abstract one: @name), or a loopback host. No
    host at all is libpq's default socket."""
    host = host.strip()
    return not host or host.startswith(("/", "@")) or is_loopback(host)


# Sessions whose purpose needs one server connection throughout: migrate's advisory lock
# (and its CONCURRENTLY builds), and LISTEN. Through a pooler they open
# RELAY_DATABASE_DIRECT_URL.
NEEDS_A_SESSION = {
    "migrate": "`relay migrate` (its advisory lock, its CONCURRENTLY index builds)",
    "listen": "the LISTEN of RELAY_NOTIFY_CHANNEL",
}


def connect(
    settings: CommonSettings,
    *,
    purpose: str,
    isolation_level: IsolationLevel | None = None,
) -> Conn:
    """A new autocommit session; transactions are explicit `conn.transaction()` blocks.

    Autocommit keeps the session out of "idle in transaction" between our own short
    transactions, so no relay session ever holds a snapshot or a lock while it waits
    on the sink.
    """
    direct = purpose in NEEDS_A_SESSION and settings.database_direct_url is not None
    url = settings.database_direct_url if direct else settings.database_url
    assert url is not None
    conn = connection.RelayConnection.connect(
        url.get_secret_value(),
        autocommit=True,
        row_factory=dict_row,
        cursor_factory=connection.RelayCursor,
        application_name=f"relay:{purpose}",
        **connect_kwargs(settings),
    )
    try:
        conn.pooled = connection.behind_pooler(conn)
        if conn.pooled:
            conn.prepare_threshold = None
            if purpose in NEEDS_A_SESSION:
                raise SettingsError(
                    "RELAY_DATABASE_DIRECT_URL", needs_direct(purpose, direct=direct)
                )
        statement_ms = milliseconds(settings.database_statement_timeout_seconds)
        kept = {
            "statement_timeout": f"{statement_ms}ms",
            "lock_timeout": f"{milliseconds(settings.database_lock_timeout_seconds)}ms",
            "idle_in_transaction_session_timeout": f"{idle_in_transaction_timeout_ms(settings)}ms",
            **connection.NO_JIT,
        }
        if settings.database_synchronous_commit is not None:
            kept["synchronous_commit"] = settings.database_synchronous_commit
        if settings.outbox_view_schema is not None and purpose != "migrate":
            kept["search_path"] = read_own_table(conn, settings)
        conn.keep(kept)
        if isolation_level is not None:
            conn.isolation_level = isolation_level
    except BaseException:
        conn.close()
        raise
    return conn


def needs_direct(purpose: str, *, direct: bool) -> str:
    """Why a session for `purpose` was refused: it met a pooler."""
    what = NEEDS_A_SESSION[purpose]
    if direct:
        return (
            f"it goes through a pooler too (its backend is not the one it announces), and"
            f" {what} needs a session of its own: give a URL straight to PostgreSQL"
        )
    return (
        f"RELAY_DATABASE_URL goes through a transaction pooler (its backend is not the one"
        f" it announces), and {what} needs a session of its own: set"
        f" RELAY_DATABASE_DIRECT_URL to a URL straight to PostgreSQL (docs/howto/poolers.md)"
    )


def read_own_table(conn: Conn, settings: CommonSettings) -> str:
    """RELAY_OUTBOX_TABLE: the search_path with which the session reads the table's view
    (relay/store/own_table.py) as `outbox`. A table never migrated stops the relay, which
    would otherwise find the relay's own outbox further down the search_path and drain
    the wrong table."""
    params = {"schema": settings.outbox_view_schema, "table": settings.outbox_table}
    check = conn.execute(QUERIES.own_table_view_check, params).fetchone()
    if check is None or not check["view_exists"]:
        raise SettingsError(
            "RELAY_OUTBOX_TABLE",
            f"{settings.outbox_table} has no relay view {settings.outbox_view_schema}.outbox"
            " yet: run `relay migrate --own-table` with the same RELAY_OUTBOX_TABLE and"
            " RELAY_OUTBOX_COLUMNS",
        )
    if not check["view_reads_table"]:
        raise SettingsError(
            "RELAY_OUTBOX_TABLE",
            f"the view {settings.outbox_view_schema}.outbox reads another table than"
            f" {settings.outbox_table} (two tables whose names map to one view schema)",
        )
    if check["layout"] != OWN_TABLE_LAYOUT:
        raise SettingsError(
            "RELAY_OUTBOX_TABLE",
            f"the view {settings.outbox_view_schema}.outbox was made by another release of"
            f" relay ({check['layout'] or 'no layout named'}; this one reads"
            f" {OWN_TABLE_LAYOUT}): run `relay migrate --own-table` again with this release",
        )
    schema = settings.outbox_view_schema
    if not check["dead_letter_views"]:
        raise SettingsError(
            "RELAY_OUTBOX_TABLE",
            f"{schema} lacks the views outbox_dead_letters, outbox_dead, outbox_scheduled"
            " and outbox_paused, through which this release reads the table's dead letters,"
            " scheduled rows and paused topics' rows: run `relay migrate --own-table` again",
        )
    if not check["dead_letter_views_readable"]:
        raise SettingsError(
            "RELAY_OUTBOX_TABLE",
            f"the role may not read {schema}.outbox_dead_letters, {schema}.outbox_dead,"
            f" {schema}.outbox_scheduled and {schema}.outbox_paused: grant SELECT on them,"
            " as on the view outbox"
            " (docs/howto/own-tables.md)",
        )
    row = conn.execute(QUERIES.own_table_search_path, {"schema": schema}).fetchone()
    assert row is not None
    return str(row["search_path"])


class Session:
    """One long-lived session per loop: opened on first use, and again after `close()`.

    Loops call `close()` when a statement fails, so the next turn starts on a fresh
    connection instead of a broken one.
    """

    def __init__(self, open_session: Callable[[], Conn]) -> None:
        self._open = open_session
        self._conn: Conn | None = None

    def get(self) -> Conn:
        if self._conn is None or self._conn.closed:
            self._conn = self._open()
        return self._conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def cancel(self, timeout: float = 2.0) -> None:
        """From another thread: ask the server to cancel the statement running on the
        session, if any (the one running it then fails as the statement would)."""
        conn = self._conn
        if conn is None or conn.closed:
            return
        # Unreachable server: the session's statement timeout ends the statement.
        with contextlib.suppress(psycopg.Error, OSError):
            conn.cancel_safe(timeout=timeout)


def milliseconds(seconds: float) -> int:
    """A setting in seconds as PostgreSQL's timeouts take it; 0 stays 0 (no limit)."""
    return round(seconds * 1000)


def idle_in_transaction_timeout_ms(settings: CommonSettings) -> int:
    """The configured timeout, capped at the lease ttl for the daemon's sessions.

    Their transactions (a renewal, a settle) take milliseconds and hold the lease row's
    lock. A replica frozen inside one (SIGSTOP, a VM pause) would otherwise block every
    standby's takeover until the server's timeout, 30 s by default, instead of a ttl.
    """
    configured = milliseconds(settings.database_idle_in_transaction_timeout_seconds)
    if not isinstance(settings, Settings):
        return configured
    return min(configured, int(settings.lease_ttl_seconds * 1000))


def describe_error(exc: BaseException) -> str:
    """One line about a database failure without echoing the connection string."""
    if isinstance(exc, psycopg.Error):
        sqlstate = getattr(exc, "sqlstate", None)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{type(exc).__name__}[{sqlstate}]: {text}" if sqlstate else text
    return f"{type(exc).__name__}: {exc}"
