"""Lanes: one drain per shard (RELAY_SHARDS), and the fair share of shards between
replicas (docs/DESIGN.md, "Shards").

A lane is everything the single-lease relay had, for one shard: its lease and elector,
its own sink (producer, client: giving way, a deadline cut or a rebalance resets only
this shard's), its deadline guard, and a drain loop on a thread of its own. With one
shard there is one lane, on the lease row of today.

The fair share: a replica holds at most ceil(shards / replicas) shards, counting itself
and the live peers whose heartbeat says they reach the sink (relay/store/presence.py): a peer
that cannot reach it defers and takes nothing, and counting it would leave a shard that
was given way without a taker (found by the sharded chaos run). At its share, its electors
stop campaigning; above it (a replica joined), the lanes holding its highest-numbered
shards hand them over, released at once so a replica with fewer takes them at its next
poll.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from relay.daemon.configs import drain_config, elector_timings
from relay.drain.guard import DeadlineGuard
from relay.drain.loop import Drainer
from relay.drain.progress import Progress
from relay.lease import metrics as lease_metrics
from relay.lease.elector import Elector
from relay.lease.protocol import Lease, Shard
from relay.observe.logging import get_logger
from relay.observe.metrics import Health
from relay.settings import Settings
from relay.shutdown import Shutdown
from relay.sinks import Sink
from relay.store.postgres import PostgresLeaseStore, PostgresStore
from relay.store.presence import Presence
from relay.store.wakeup import Wakeup

if TYPE_CHECKING:  # loaded only with RELAY_TRACING (the otel extra)
    from relay.observe.tracing import Tracing

log = get_logger("relay.lanes")


class FairShare:
    """How many shards this replica may hold, and which of its shards are surplus."""

    def __init__(
        self, shards: int, able_peers: Callable[[], int], held: Callable[[], Sequence[int]]
    ) -> None:
        self.shards = shards
        self._able_peers = able_peers
        self._held = held  # the shards this replica holds now

    def cap(self) -> int:
        return math.ceil(self.shards / (1 + max(0, self._able_peers())))

    def at_cap(self) -> bool:
        return len(self._held()) >= self.cap()

    def surplus(self, shard: int) -> bool:
        """Hand `shard` over? Its own lanes' highest shards go first, so every replica
        that is above its share agrees on which without talking."""
        held = sorted(self._held())
        return shard in held[self.cap() :]


class Lane:
    def __init__(
        self,
        settings: Settings,
        shard: Shard,
        sink: Sink,
        shutdown: Shutdown,
        health: Health,
        fair: FairShare | None,
        presence: Presence,
        on_crash: Callable[[BaseException], None],
        wakeup: Wakeup | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.shard = shard
        self.sink = sink
        self._shutdown = shutdown
        self._on_crash = on_crash
        one = shard.shards == 1
        # Loop names in the liveness probe: as before with one shard.
        self.main_loop = "main" if one else f"drain-{shard.shard}"
        elector_loop = "elector" if one else f"elector-{shard.shard}"
        self.lease = Lease(
            shard.name,
            settings.replica_id,
            settings.lease_ttl_seconds,
            settings.safety_margin,
            time.monotonic,
            shard,
        )
        self.progress = Progress()
        self.elector = Elector(
            elector_timings(settings),
            PostgresLeaseStore(settings, shard),
            self.lease,
            health=health,
            defer=presence.defer,
            at_fair_share=fair.at_cap if fair is not None else None,
            loop=elector_loop,
        )
        self.guard = DeadlineGuard(self.lease, sink)
        self.drainer = Drainer(
            drain_config(settings, sink),
            PostgresStore(settings, shard),
            sink,
            self.lease,
            shutdown,
            health,
            peers=presence,
            progress=self.progress,
            loop=self.main_loop,
            surplus=(lambda: fair.surplus(shard.shard)) if fair is not None else None,
            wakeup=wakeup,
            tracing=tracing,
        )
        self._health = health
        self._thread: threading.Thread | None = None

    def held(self) -> bool:
        return self.lease.token() is not None

    def start(self) -> None:
        lease_metrics.declare_lease(self.shard, self.held, self.lease.since_renewal)
        self.elector.start()
        self.guard.start()
        self._thread = threading.Thread(
            target=self._run, name=f"relay-{self.main_loop}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._shutdown.requested:
                self._health.beat(self.main_loop)
                if self.lease.wait_held(timeout=0.25) is None:
                    # Standby keeps its producer warm for a fast takeover; serving its
                    # events keeps client logs and errors from piling up unread.
                    self.sink.flush(0)
                    continue
                self.drainer.drain()
        except BaseException as exc:
            self._on_crash(exc)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, flush_seconds: float) -> None:
        """After the drain loop returned: flush the sink, close the drain, then give the
        lease up so a standby takes over at its next poll instead of after a ttl."""
        try:
            left = self.sink.flush(flush_seconds)
            if left:
                log.warning("sink.flush_incomplete", messages=left, lease=self.shard.name)
        except Exception as exc:  # a dead producer must not keep the lease held
            log.warning("sink.flush_failed", error=str(exc), lease=self.shard.name)
        # The drain loop has returned and waited for its last settle; closing it first
        # makes sure no settle (which renews the lease) runs after the release.
        self.drainer.close()
        self.elector.stop()
        self.elector.join(timeout=5.0)
        if self.elector.is_alive():
            # Still inside a database call: releasing on its connection would race it.
            # The lease then ends by its ttl instead.
            log.warning("lease.release_skipped", reason="elector busy", lease=self.shard.name)
        else:
            self.elector.release()
        self.guard.stop()
        self.guard.join(timeout=5.0)
        self.sink.close()
