"""The elector: the thread that keeps this replica's belief about the lease true.

Standby: try to acquire every fifteenth of the ttl, at most 0.5 s (jittered), unless this
replica cannot reach the sink while a live peer can (`defer`). Leader: renew when no
settle has renewed for the renew interval; drop the lease at the local deadline; expire
the row when the drain loop gave the lease up, and report a loss by fencing. It is the
only thread that writes the lease row outside a settle (relay/lease/protocol.py has the protocol,
relay/store/lease.py its SQL steps).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from relay.backoff import jittered
from relay.lease import metrics as lease_metrics
from relay.lease.protocol import Acquired, Clock, HeldByOther, Lease, LeaseToken, OtherShardCount
from relay.observe.logging import get_logger
from relay.observe.metrics import Health
from relay.store.port import LeaseStore, StoreError

log = get_logger("relay.lease")


@dataclass(frozen=True, slots=True)
class ElectorTimings:
    """All the elector reads of the settings (`relay.daemon.configs.elector_timings`)."""

    ttl: float  # RELAY_LEASE_TTL_SECONDS, written into the row by each acquisition
    renew_interval: float  # renew when no settle has for this long
    standby_poll: float  # a standby tries to acquire this often (jittered)


class Elector(threading.Thread):
    """Standby: try to acquire every `standby_poll_seconds` (jittered).
    Leader: renew when no settle transaction has renewed for `renew_interval`.
    """

    def __init__(
        self,
        timings: ElectorTimings,
        store: LeaseStore,
        lease: Lease,
        clock: Clock = time.monotonic,
        health: Health | None = None,
        defer: Callable[[], bool] | None = None,
        at_fair_share: Callable[[], bool] | None = None,
        loop: str = "elector",
    ) -> None:
        super().__init__(name=f"relay-{loop}", daemon=True)
        self._timings = timings
        self._store = store
        self._lease = lease
        self._clock = clock
        self._health = health
        # True while this replica should leave the lease to a peer that can deliver
        # (it cannot reach the sink, a live peer can): it does not campaign then.
        self._defer = defer
        self._deferring = False
        # With shards: True while this replica holds its fair share already; it leaves
        # the rest to replicas that hold fewer (relay/daemon/lanes.py).
        self._at_fair_share = at_fair_share
        self.loop = loop  # its name in the liveness probe
        # The last renewal attempt failed on the database: if the lease then runs out,
        # the loss is an "error", not a plain "expired" (a paused or slow process).
        self._renew_error = False
        self._stop_event = threading.Event()
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
            lease_metrics.lease_transition(
                self._lease.shard, held=False, epoch=token.epoch, reason="released"
            )
        else:
            token = self._lease.take_release()  # given up; its row not expired yet
        if token is None:
            return
        try:
            self._write_release(token)
        finally:
            self._store.close()

    def _write_release(self, token: LeaseToken) -> bool:
        try:
            released = self._store.release(token)
        except StoreError as exc:
            log.warning(
                "lease.release_failed",
                lease=token.name,
                holder=token.holder,
                epoch=token.epoch,
                error=str(exc),
            )
            return False
        self.last_db_ok = self._clock()
        log.info(
            "lease.released",
            lease=token.name,
            holder=token.holder,
            epoch=token.epoch,
            released=released,
        )
        return True

    # -- loop --

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.turn()
            self._lease.doze(self._next_wait())

    def turn(self) -> None:
        """One pass: report a fencing, expire a lease the drain gave up, else campaign
        as a standby or keep the lease as its holder."""
        if self._health is not None:
            self._health.beat(self.loop)
        try:
            fenced = self._lease.take_fenced()
            if fenced is not None:
                self._on_lost(fenced, "fenced")
            given_up = self._lease.take_release()
            if given_up is not None:
                # Expire the row now, on this thread: a renewal of ours can then never
                # land after it and keep the lease from the peer for a ttl. Failed (a
                # blip, a lock): again next turn, and no campaign in this one (our own
                # live row would let us take it straight back).
                if not self._write_release(given_up):
                    self._lease.release_later(given_up)
            elif self._lease.held_token() is None:
                self._attempt()
            else:
                self._keep()
            self._renew_error = False
        except StoreError as exc:
            self._renew_error = self._lease.held_token() is not None
            log.warning(
                "lease.renew_failed" if self._lease.held_token() else "lease.db_error",
                lease=self._lease.name,
                holder=self._lease.holder,
                error=str(exc),
            )
            self._expire_if_past_deadline()
        except Exception:
            # A bug must not silently end the elector: this replica would never
            # campaign again. Log it, start over with a fresh session.
            log.exception("lease.elector_error", lease=self._lease.name)
            self._renew_error = self._lease.held_token() is not None
            self._store.reset()
            self._expire_if_past_deadline()

    def _next_wait(self) -> float:
        if self._lease.held_token() is None:
            return jittered(self._timings.standby_poll)
        # Wake often enough to renew on time and to notice our own deadline passing.
        return max(0.05, min(self._timings.renew_interval / 2, self._lease.seconds_left()))

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
        if self._at_fair_share is not None and self._at_fair_share():
            return
        started = self._clock()
        outcome = self._store.try_acquire(self._lease.holder, self._timings.ttl)
        self.last_db_ok = self._clock()
        if isinstance(outcome, Acquired):
            self._on_acquired(outcome, started)
        elif isinstance(outcome, HeldByOther):
            self._on_held_by_other(outcome)
        elif isinstance(outcome, OtherShardCount):
            self._on_other_shard_count(outcome)
        else:
            log.debug(
                "lease.lost_race",
                lease=self._lease.name,
                holder=self._lease.holder,
                detail=outcome.detail,
            )

    def _on_acquired(self, outcome: Acquired, started: float) -> None:
        self._lease.acquired(outcome.token, started)
        self._last_other = None
        lease_metrics.lease_transition(self._lease.shard, held=True, epoch=outcome.token.epoch)
        log.info(
            "lease.acquired",
            lease=outcome.token.name,
            holder=outcome.token.holder,
            epoch=outcome.token.epoch,
            waited_seconds=round(started - self._standby_since, 3),
            db_time=outcome.at.isoformat() if outcome.at else None,
        )

    def _on_held_by_other(self, outcome: HeldByOther) -> None:
        """Said once per leader and epoch, not at every poll."""
        seen = (outcome.holder, outcome.epoch)
        if seen == self._last_other:
            return
        self._last_other = seen
        lease_metrics.lease_observed(self._lease.shard, outcome.epoch)
        log.info(
            "lease.standby",
            lease=self._lease.name,
            holder=self._lease.holder,
            leader=outcome.holder,
            epoch=outcome.epoch,
        )

    def _on_other_shard_count(self, outcome: OtherShardCount) -> None:
        seen = (outcome.lease, -1)
        if seen == self._last_other:
            return
        self._last_other = seen
        log.warning(
            "lease.other_shard_count",
            lease=self._lease.name,
            holder=self._lease.holder,
            live=outcome.lease,
            hint="replicas with another RELAY_SHARDS still hold a lease; this one"
            " waits until they stop",
        )

    def _keep(self) -> None:
        if self._expire_if_past_deadline():
            return
        if self._lease.since_renewal() < self._timings.renew_interval:
            return
        token = self._lease.held_token()
        if token is None:
            return
        started = self._clock()
        renewed = self._store.renew(token, self._timings.ttl)
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

    def _on_lost(self, token: LeaseToken, reason: lease_metrics.LossReason) -> None:
        self._standby_since = self._clock()
        lease_metrics.lease_transition(
            self._lease.shard, held=False, epoch=token.epoch, reason=reason
        )
        log.warning(
            "lease.lost", lease=token.name, holder=token.holder, epoch=token.epoch, reason=reason
        )
