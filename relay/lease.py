"""The lease: which replica may publish, until when, under which fencing epoch.

The protocol (docs/DESIGN.md, "The lease"):

1. `BEGIN ISOLATION LEVEL REPEATABLE READ`; read the lease row.
2. Held by someone else and not expired (by the DATABASE clock): stay standby.
3. Otherwise compare-and-swap: `UPDATE ... epoch = epoch + 1 ... WHERE epoch = seen`.
   A concurrent winner shows as SQLSTATE 40001 or as zero rows updated: we lost.
4. The holder trusts its lease only until a LOCAL monotonic deadline: the moment before
   the acquiring (or renewing) transaction began, plus ttl, minus a safety margin.
5. Every transaction that settles rows re-checks holder and epoch first (`lease_renew`
   in queries.sql, used by the repository); no match means roll back and stand by.
6. On shutdown the holder expires its lease at once so a standby takes over quickly.
7. A leader that cannot deliver (cut off from the sink, not from the database) gives
   the lease up the same way, once a live replica reports it can reach the sink
   (relay/presence.py); the drain loop decides, the elector's thread writes it.

`Lease` is this replica's belief; `Elector` is the thread that keeps it true.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg import IsolationLevel, errors

from relay import db, metrics
from relay.backoff import jittered
from relay.db import Conn
from relay.logging import get_logger
from relay.metrics import Health
from relay.queries import QUERIES
from relay.settings import Settings

log = get_logger("relay.lease")

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class LeaseToken:
    """Proof of holding: every fenced statement carries all three."""

    name: str
    holder: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Acquired:
    token: LeaseToken
    at: datetime | None = None  # database clock, read under the lease row's lock


@dataclass(frozen=True, slots=True)
class HeldByOther:
    holder: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class LostRace:
    detail: str


Attempt = Acquired | HeldByOther | LostRace


# --- the SQL steps of the protocol -------------------------------------------------


def ensure_row(conn: Conn, name: str) -> None:
    conn.execute(QUERIES.lease_ensure, {"name": name})


def try_acquire(conn: Conn, name: str, holder: str, ttl: float) -> Attempt:
    """One compare-and-swap attempt. `conn` must be autocommit with REPEATABLE READ."""
    try:
        with conn.transaction():
            row = conn.execute(QUERIES.lease_read, {"name": name}).fetchone()
            if row is None:
                return LostRace("lease row missing")
            if row["live"] and row["holder"] != holder:
                return HeldByOther(row["holder"], row["epoch"])
            taken = conn.execute(
                QUERIES.lease_take,
                {"name": name, "holder": holder, "ttl": ttl, "seen_epoch": row["epoch"]},
            ).fetchone()
            if taken is None:
                # Zero rows: someone moved the epoch between our read and our write.
                return LostRace("epoch changed under us")
            return Acquired(LeaseToken(name, holder, int(taken["epoch"])), taken["at"])
    except (errors.SerializationFailure, errors.LockNotAvailable) as exc:
        return LostRace(f"SQLSTATE {exc.sqlstate}")


def renew(conn: Conn, token: LeaseToken, ttl: float) -> bool:
    row = conn.execute(
        QUERIES.lease_renew,
        {"name": token.name, "holder": token.holder, "epoch": token.epoch, "ttl": ttl},
    ).fetchone()
    return row is not None


def release(conn: Conn, token: LeaseToken) -> bool:
    cur = conn.execute(
        QUERIES.lease_release,
        {"name": token.name, "holder": token.holder, "epoch": token.epoch},
    )
    return cur.rowcount == 1


# --- this replica's belief -----------------------------------------------------------


class Lease:
    """Thread-safe local view: the token, and the monotonic deadline it is good until."""

    def __init__(self, name: str, holder: str, ttl: float, margin: float, clock: Clock) -> None:
        self.name = name
        self.holder = holder
        self.ttl = ttl
        self.margin = margin
        self._clock = clock
        self._lock = threading.Lock()
        self._token: LeaseToken | None = None
        self._deadline = 0.0
        # "Since start" until the first acquisition: the gauge grows from a finite value.
        self._renewed_at = clock()
        self._changed = threading.Condition(self._lock)
        self._to_release: LeaseToken | None = None  # given up, not yet expired in the row
        self._fenced: LeaseToken | None = None  # lost to a newer holder, not yet reported
        self._wake = threading.Event()  # the elector's sleep ends early

    def token(self) -> LeaseToken | None:
        """The token if we may still publish under it; None once the deadline passed."""
        with self._lock:
            if self._token is not None and self._clock() < self._deadline:
                return self._token
            return None

    def held_token(self) -> LeaseToken | None:
        """The token we believe in, even if its local deadline has passed."""
        with self._lock:
            return self._token

    def seconds_left(self) -> float:
        with self._lock:
            return max(0.0, self._deadline - self._clock()) if self._token else 0.0

    def since_renewal(self) -> float:
        with self._lock:
            return self._clock() - self._renewed_at

    def acquired(self, token: LeaseToken, started_at: float) -> None:
        with self._lock:
            self._token = token
            self._deadline = started_at + self.ttl - self.margin
            self._renewed_at = started_at
            self._changed.notify_all()

    def renewed(self, token: LeaseToken, started_at: float) -> None:
        # `started_at` is taken before the renewing transaction began: the DB's now()
        # inside it is at least that late, so our deadline can never outlive the row's.
        with self._lock:
            if self._token == token:
                self._deadline = max(self._deadline, started_at + self.ttl - self.margin)
                self._renewed_at = max(self._renewed_at, started_at)

    def lose(self, token: LeaseToken | None = None) -> LeaseToken | None:
        """Forget the lease (only `token`'s, if given). Returns what was dropped."""
        with self._lock:
            dropped = self._token
            if dropped is None or (token is not None and token != dropped):
                return None
            self._token = None
            self._deadline = 0.0
            self._changed.notify_all()
            return dropped

    def give_up(self, token: LeaseToken) -> bool:
        """Stop publishing under `token` now and ask the elector to expire the row (a
        leader giving way). False if `token` was no longer ours."""
        with self._lock:
            if self._token is None or self._token != token:
                return False
            self._token = None
            self._deadline = 0.0
            self._to_release = token
            self._changed.notify_all()
        self._wake.set()
        return True

    def fenced(self, token: LeaseToken) -> None:
        """A fenced statement of ours matched no lease row: a newer holder exists. We
        stop at once; the elector's thread reports the loss."""
        with self._lock:
            if self._token is None or self._token != token:
                return
            self._token = None
            self._deadline = 0.0
            self._fenced = token
            self._changed.notify_all()
        self._wake.set()

    def take_fenced(self) -> LeaseToken | None:
        with self._lock:
            token, self._fenced = self._fenced, None
            return token

    def take_release(self) -> LeaseToken | None:
        """The token given up and not yet released in the database, once."""
        with self._lock:
            token, self._to_release = self._to_release, None
            return token

    def wake(self) -> None:
        self._wake.set()

    def doze(self, timeout: float) -> None:
        """The elector's sleep between turns; `wake()` or `give_up()` end it early."""
        self._wake.wait(timeout)
        self._wake.clear()

    def wait_held(self, timeout: float) -> LeaseToken | None:
        """Block until we hold the lease or `timeout` passes."""
        end = self._clock() + timeout
        with self._lock:
            # A token past its local deadline counts as not held: wait for the elector
            # to renew or drop it rather than spin on it.
            while self._token is None or self._clock() >= self._deadline:
                remaining = end - self._clock()
                if remaining <= 0:
                    return None
                self._changed.wait(min(remaining, 0.05))
            return self._token


# --- the loop that keeps it true -------------------------------------------------------


class Elector(threading.Thread):
    """Standby: try to acquire every `standby_poll_seconds` (jittered).
    Leader: renew when no settle transaction has renewed for `renew_interval`.
    """

    def __init__(
        self,
        settings: Settings,
        lease: Lease,
        clock: Clock = time.monotonic,
        health: Health | None = None,
        defer: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(name="relay-elector", daemon=True)
        self._settings = settings
        self._lease = lease
        self._clock = clock
        self._health = health
        # True while this replica should leave the lease to a peer that can deliver
        # (it cannot reach the sink, a live peer can): it does not campaign then.
        self._defer = defer
        self._deferring = False
        # The last renewal attempt failed on the database: if the lease then runs out,
        # the loss is an "error", not a plain "expired" (a paused or slow process).
        self._renew_error = False
        self._stop_event = threading.Event()
        self._session = db.Session(self._open)
        self._last_other: tuple[str | None, int] | None = None
        self._standby_since = clock()
        # When a lease statement last came back from the database (readiness). Only real
        # round trips count: a leader's turns that had nothing to renew prove nothing.
        self.last_db_ok = 0.0

    # -- public --

    def stop(self) -> None:
        self._stop_event.set()
        self._lease.wake()

    def release(self) -> None:
        """Give the lease up (after the drain stopped and the sink was flushed)."""
        token = self._lease.lose()
        if token is not None:
            metrics.lease_transition(token.name, held=False, epoch=token.epoch, reason="released")
        else:
            token = self._lease.take_release()  # given up; its row not expired yet
        if token is None:
            return
        try:
            self._write_release(token)
        finally:
            self._session.close()

    def _write_release(self, token: LeaseToken) -> None:
        try:
            released = release(self._session.get(), token)
        except psycopg.Error as exc:
            log.warning(
                "lease.release_failed",
                lease=token.name,
                holder=token.holder,
                epoch=token.epoch,
                error=db.describe_error(exc),
            )
            self._session.close()
            return
        self.last_db_ok = self._clock()
        log.info(
            "lease.released",
            lease=token.name,
            holder=token.holder,
            epoch=token.epoch,
            released=released,
        )

    # -- loop --

    def run(self) -> None:
        while not self._stop_event.is_set():
            if self._health is not None:
                self._health.beat("elector")
            try:
                fenced = self._lease.take_fenced()
                if fenced is not None:
                    self._on_lost(fenced, "fenced")
                given_up = self._lease.take_release()
                if given_up is not None:
                    # Expire the row now, on this thread: a renewal of ours can then
                    # never land after it and keep the lease from the peer for a ttl.
                    self._write_release(given_up)
                if self._lease.held_token() is None:
                    self._attempt()
                else:
                    self._keep()
                self._renew_error = False
            except psycopg.Error as exc:
                self._renew_error = self._lease.held_token() is not None
                log.warning(
                    "lease.renew_failed" if self._lease.held_token() else "lease.db_error",
                    lease=self._lease.name,
                    holder=self._lease.holder,
                    error=db.describe_error(exc),
                )
                self._session.close()
                self._expire_if_past_deadline()
            except Exception:
                # A bug must not silently end the elector: this replica would never
                # campaign again. Log it, start over with a fresh connection.
                log.exception("lease.elector_error", lease=self._lease.name)
                self._renew_error = self._lease.held_token() is not None
                self._session.close()
                self._expire_if_past_deadline()
            self._lease.doze(self._next_wait())

    def _next_wait(self) -> float:
        if self._lease.held_token() is None:
            return jittered(self._settings.standby_poll_seconds)
        # Wake often enough to renew on time and to notice our own deadline passing.
        return max(0.05, min(self._settings.renew_interval / 2, self._lease.seconds_left()))

    def _attempt(self) -> None:
        deferring = self._defer is not None and self._defer()
        if deferring != self._deferring:
            self._deferring = deferring
            log.info(
                "lease.deferring" if deferring else "lease.campaigning",
                lease=self._lease.name,
                holder=self._lease.holder,
                reason="this replica cannot reach the sink and a live peer can"
                if deferring
                else "this replica reaches the sink again, or no peer does",
            )
        if deferring:
            return
        conn = self._session.get()
        started = self._clock()
        outcome = try_acquire(
            conn, self._lease.name, self._lease.holder, self._settings.lease_ttl_seconds
        )
        self.last_db_ok = self._clock()
        if isinstance(outcome, Acquired):
            self._lease.acquired(outcome.token, started)
            self._last_other = None
            metrics.lease_transition(outcome.token.name, held=True, epoch=outcome.token.epoch)
            log.info(
                "lease.acquired",
                lease=outcome.token.name,
                holder=outcome.token.holder,
                epoch=outcome.token.epoch,
                waited_seconds=round(started - self._standby_since, 3),
                db_time=outcome.at.isoformat() if outcome.at else None,
            )
        elif isinstance(outcome, HeldByOther):
            seen = (outcome.holder, outcome.epoch)
            if seen != self._last_other:
                self._last_other = seen
                metrics.lease_observed(self._lease.name, outcome.epoch)
                log.info(
                    "lease.standby",
                    lease=self._lease.name,
                    holder=self._lease.holder,
                    leader=outcome.holder,
                    epoch=outcome.epoch,
                )
        else:
            log.debug(
                "lease.lost_race",
                lease=self._lease.name,
                holder=self._lease.holder,
                detail=outcome.detail,
            )

    def _keep(self) -> None:
        if self._expire_if_past_deadline():
            return
        if self._lease.since_renewal() < self._settings.renew_interval:
            return
        token = self._lease.held_token()
        if token is None:
            return
        conn = self._session.get()
        started = self._clock()
        renewed = renew(conn, token, self._settings.lease_ttl_seconds)
        self.last_db_ok = self._clock()
        if renewed:
            self._lease.renewed(token, started)
        elif self._lease.lose(token) is not None:
            self._on_lost(token, "fenced")

    def _expire_if_past_deadline(self) -> bool:
        token = self._lease.held_token()
        if token is None or self._lease.token() is not None:
            return False
        if self._lease.lose(token) is not None:
            self._on_lost(token, "error" if self._renew_error else "expired")
        return True

    def _on_lost(self, token: LeaseToken, reason: metrics.LossReason) -> None:
        self._standby_since = self._clock()
        metrics.lease_transition(token.name, held=False, epoch=token.epoch, reason=reason)
        log.warning(
            "lease.lost", lease=token.name, holder=token.holder, epoch=token.epoch, reason=reason
        )

    # -- connection --

    def _open(self) -> Conn:
        conn = db.connect(
            self._settings, purpose="lease", isolation_level=IsolationLevel.REPEATABLE_READ
        )
        try:
            ensure_row(conn, self._lease.name)
        except BaseException:
            conn.close()
            raise
        return conn
