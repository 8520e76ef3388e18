"""Presence: every replica says in the database that it is alive and reaches the sink.

A leader cut off from the broker (or the endpoint) but not from PostgreSQL keeps renewing
its lease; by the lease alone it would hold it forever while a standby that could
deliver waits. So each replica beats every fifth of the ttl (at most 2 s) into the `replicas`
table (`replica_beat` in lease.sql):

- a standby probes the sink (`Sink.check`: broker metadata, a TCP/TLS connect to the
  endpoint) and writes whether it answered;
- the leader writes whether it delivered anything lately (`Progress`, kept by the drain
  loop): its probe is the real traffic.

The same round trip returns how many other live replicas reach the sink. The drain loop
gives the lease way when it has delivered nothing for RELAY_GIVE_WAY_SECONDS while rows
wait and a peer reaches the sink; a standby that cannot reach the sink does not campaign
while a peer can (`defer`). When nobody reaches the sink nobody gives way: rows wait,
nothing is lost, and the lease changes hands at most once per window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from relay.observe import metrics
from relay.observe.logging import OutageLog, get_logger
from relay.sinks import Sink
from relay.sql import QUERIES
from relay.store import db

log = get_logger("relay.presence")

# A replica's rows silent this long are deleted by the others: it is gone for good.
FORGET_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class PresenceConfig:
    """What the presence loop reads of the settings (`relay.daemon.configs.presence_config`)."""

    lease_name: str  # RELAY_LEASE_NAME: the group whose replicas count each other
    replica_id: str  # RELAY_REPLICA_ID
    heartbeat_seconds: float  # Settings.heartbeat_seconds: a fifth of the ttl, at most 2 s
    live_seconds: float  # Settings.replica_live_seconds
    give_way_seconds: float  # RELAY_GIVE_WAY_SECONDS; 0: never give way nor defer


@dataclass(frozen=True, slots=True)
class Peers:
    live: int
    able: int  # of them, those whose last heartbeat said they reach the sink
    at: float  # monotonic time of the heartbeat that counted them


class Presence(threading.Thread):
    def __init__(
        self,
        config: PresenceConfig,
        connect: Callable[[str], db.Conn],
        leading: Callable[[], bool],
        sink: Sink,
        stalled_for: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="relay-presence", daemon=True)
        self._config = config
        # Does this replica hold a lease (any shard's), and for how long has it had
        # rows to deliver and no answer (the worst of its shards).
        self._leading = leading
        self._sink = sink
        self._stalled_for = stalled_for
        self._clock = clock
        self._stop_event = threading.Event()
        self._session = db.Session(lambda: connect("presence"))
        self._outage = OutageLog(log, "presence.beat_failed", "presence.beat_recovered")
        # Single writer (this thread), replaced whole: readers see one heartbeat's count.
        self._peers = Peers(0, 0, float("-inf"))
        # Written by this thread (each probe) and by a drain thread (giving way), read by
        # the electors: under this lock.
        self._able_lock = threading.Lock()
        # Until a probe says otherwise this replica counts itself able: it campaigns.
        self._sink_ok = True
        # After giving way, this replica leaves the lease to a peer for a whole window,
        # whatever its probe says: a probe (metadata, a TCP connect) is weaker than a
        # delivery, and would otherwise let it take the lease straight back.
        self._defer_until = float("-inf")
        self._first_beat = True
        self._missing_schema = False
        self._probe_failing = False
        # When a heartbeat last came back from the database (readiness).
        self.last_db_ok = 0.0
        metrics.SINK_REACHABLE.labels(config.lease_name).set(1)

    def stop(self) -> None:
        self._stop_event.set()

    # --- what the other threads ask ---

    def able_peers(self) -> int:
        """Other live replicas that reach the sink, by a heartbeat recent enough to trust."""
        peers = self._peers
        if self._clock() - peers.at > self._config.live_seconds:
            return 0
        return peers.able

    def defer(self) -> bool:
        """Leave the lease to a peer: we cannot reach the sink (or just gave way for
        want of it), and a live peer can."""
        if self._config.give_way_seconds <= 0:
            return False
        with self._able_lock:
            unable = not self._sink_ok or self._clock() < self._defer_until
        return unable and self.able_peers() > 0

    def gave_way(self) -> None:
        """The drain loop gave the lease up for want of the sink."""
        with self._able_lock:
            self._sink_ok = False
            self._defer_until = self._clock() + self._config.give_way_seconds

    # --- the loop ---

    def run(self) -> None:
        try:
            while True:
                self.beat_once()
                # Without its table or grants it cannot help: look again now and then.
                wait = 60.0 if self._missing_schema else self._config.heartbeat_seconds
                if self._stop_event.wait(wait):
                    break
        finally:
            self._leave()
            self._session.close()

    def beat_once(self) -> None:
        sink_ok, error = self._sink_state()
        with self._able_lock:
            self._sink_ok = sink_ok
        metrics.SINK_REACHABLE.labels(self._config.lease_name).set(1 if sink_ok else 0)
        try:
            row = (
                self._session.get()
                .execute(
                    QUERIES.replica_beat,
                    {
                        "lease": self._config.lease_name,
                        "replica": self._config.replica_id,
                        "sink_ok": sink_ok,
                        "sink_error": error,
                        "first": self._first_beat,
                        "live": self._config.live_seconds,
                        "forget": FORGET_SECONDS,
                    },
                )
                .fetchone()
            )
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege) as exc:
            if not self._missing_schema:
                log.error(
                    "presence.unavailable",
                    error=db.describe_error(exc),
                    hint="run relay migrate and apply migrations/grants.sql;"
                    " until then this replica never gives way nor defers",
                )
            self._missing_schema = True
            self._session.close()
            return
        except psycopg.Error as exc:
            self._outage.failure(db.describe_error(exc))
            self._session.close()
            return
        self._missing_schema = False
        self._first_beat = False
        self._outage.success()
        assert row is not None  # an aggregate-only SELECT always returns one row
        self.last_db_ok = self._clock()
        self._peers = Peers(int(row["live_peers"]), int(row["able_peers"]), self.last_db_ok)
        metrics.PEERS.labels(self._config.lease_name, "live").set(self._peers.live)
        metrics.PEERS.labels(self._config.lease_name, "able").set(self._peers.able)

    def _sink_state(self) -> tuple[bool, str | None]:
        if self._leading():
            # The leader's traffic is its probe. Past half the give-way window without
            # progress it reports itself unable, so a peer deciding whether to defer
            # sees the truth before the leader gives way.
            limit = max(self._config.give_way_seconds / 2, 2 * self._config.heartbeat_seconds)
            stalled = self._stalled_for()
            if stalled < limit:
                return True, None
            return False, f"leader delivered nothing for {stalled:.0f} s"
        try:
            self._sink.check(timeout=min(5.0, self._config.heartbeat_seconds))
        except Exception as exc:  # any failure to reach it is an answer, not a bug
            error = f"{type(exc).__name__}: {exc}"[:300]
            if not self._probe_failing:
                log.warning("presence.sink_unreachable", sink=self._sink.name, error=error)
            self._probe_failing = True
            return False, error
        if self._probe_failing:
            log.info("presence.sink_reachable", sink=self._sink.name)
        self._probe_failing = False
        return True, None

    def _leave(self) -> None:
        """A clean stop: we are no longer a live peer anybody should count on."""
        try:
            self._session.get().execute(
                QUERIES.replica_leave,
                {"lease": self._config.lease_name, "replica": self._config.replica_id},
            )
        except psycopg.Error as exc:
            log.debug("presence.leave_failed", error=db.describe_error(exc))
