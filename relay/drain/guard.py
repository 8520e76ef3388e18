"""The deadline guard: nothing is sent after the lease's local deadline.

The drain loop stops publishing when it notices the lease is gone, but it notices only
between steps. A sink that sends in the background (Kafka) keeps sending what it holds
on its own threads while the drain thread is stuck elsewhere, say waiting for a read
or a settle against a database that does not answer while stragglers sit queued; past
the deadline a newer holder may already be publishing. This thread watches the lease
alone and, the moment our token stops being good, tells the sink to drop what it still
holds. It touches nothing else.
"""

from __future__ import annotations

import threading

from relay.lease.protocol import Lease, LeaseToken
from relay.observe import metrics
from relay.observe.logging import get_logger
from relay.sinks.base import Sink

log = get_logger("relay.guard")

TICK_SECONDS = 0.05


class DeadlineGuard(threading.Thread):
    def __init__(self, lease: Lease, sink: Sink) -> None:
        super().__init__(name=lease.shard.thread_name("deadline-guard"), daemon=True)
        self._lease = lease
        self._sink = sink
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        good: LeaseToken | None = None
        while not self._stop_event.wait(TICK_SECONDS):
            token = self._lease.token()
            if token is not None:
                good = token
                continue
            if good is not None:
                # Whoever noticed first (deadline, fencing, release), this is the
                # moment our publishing must end.
                metrics.PUBLISHING_CUTS.inc()
                log.info(
                    "lease.publishing_cut", lease=good.name, holder=good.holder, epoch=good.epoch
                )
                good = None
            # Every tick while the lease is not ours: what the drain loop produced after
            # the cut (it notices between messages) goes too. Cheap when nothing is held.
            self._sink.stop_sending()
