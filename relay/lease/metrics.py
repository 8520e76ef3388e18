"""The lease series: held, epoch, time since renewal, acquisitions and losses.

Labelled `lease` as always; a shard's lease (RELAY_SHARDS > 1) adds `shard`. A custom
collector rather than labelled gauges and counters, because a family's label names are
fixed there: with one shard every series stays exactly what it was before shards
existed, and the text format lets one family's series differ in label names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Literal

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from relay.lease.protocol import Shard

LossReason = Literal["expired", "fenced", "released", "gave_way", "rebalanced", "error"]
LOSS_REASONS: tuple[LossReason, ...] = (
    "expired",
    "fenced",
    "released",
    "gave_way",
    "rebalanced",
    "error",
)


class _LeaseSeries:
    """One lease row's figures: read at scrape time (held, since renewal) or counted."""

    def __init__(self, held: Callable[[], bool], since_renewal: Callable[[], float]) -> None:
        self.held = held
        self.since_renewal = since_renewal
        self.epoch = 0.0
        self.acquisitions = 0.0
        self.losses: dict[str, float] = dict.fromkeys(LOSS_REASONS, 0.0)


class LeaseCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[Shard, _LeaseSeries] = {}

    def declare(
        self, shard: Shard, held: Callable[[], bool], since_renewal: Callable[[], float]
    ) -> None:
        with self._lock:
            old = self._series.get(shard)
            self._series[shard] = series = _LeaseSeries(held, since_renewal)
            if old is not None:  # a second app in one process (tests): counts go on
                series.epoch, series.acquisitions = old.epoch, old.acquisitions
                series.losses = old.losses

    def series(self, shard: Shard) -> _LeaseSeries:
        with self._lock:
            found = self._series.get(shard)
            if found is None:
                found = self._series[shard] = _LeaseSeries(lambda: False, lambda: 0.0)
            return found

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = list(self._series.items())
        held = Metric("relay_lease_held", "1 if this replica holds the lease, else 0.", "gauge")
        epoch = Metric("relay_lease_epoch", "Latest lease epoch this replica has seen.", "gauge")
        since = Metric(
            "relay_lease_seconds_since_renewal",
            "Seconds since this replica last acquired or renewed the lease (since start if never).",
            "gauge",
        )
        acquired = Metric(
            "relay_lease_acquisitions", "Times this replica acquired the lease.", "counter"
        )
        lost = Metric(
            "relay_lease_losses",
            "Times this replica stopped holding the lease, by reason (expired, fenced, "
            "released, gave_way: it could not deliver and a peer could, rebalanced: it "
            "handed a shard to a replica with fewer, error).",
            "counter",
        )
        for shard, s in items:
            labels = {"lease": shard.group}
            if shard.shards > 1:
                labels["shard"] = str(shard.shard)
            held.add_sample("relay_lease_held", labels, 1.0 if s.held() else 0.0)
            epoch.add_sample("relay_lease_epoch", labels, s.epoch)
            since.add_sample("relay_lease_seconds_since_renewal", labels, s.since_renewal())
            acquired.add_sample("relay_lease_acquisitions_total", labels, s.acquisitions)
            for reason, count in s.losses.items():
                lost.add_sample("relay_lease_losses_total", {**labels, "reason": reason}, count)
        yield from (held, epoch, since, acquired, lost)


LEASES = LeaseCollector()
REGISTRY.register(LEASES)


def declare_lease(
    shard: Shard, held: Callable[[], bool], since_renewal: Callable[[], float]
) -> None:
    """Create the lease's series, so rate() and absent() work from the first scrape.

    `relay_lease_held` is read from `held` at scrape time, not set on transitions: it
    drops to 0 at the local deadline even while the elector is stuck inside a renewal
    the database never answers.
    """
    LEASES.declare(shard, held, since_renewal)


def lease_transition(
    shard: Shard, *, held: bool, epoch: int, reason: LossReason | None = None
) -> None:
    series = LEASES.series(shard)
    series.epoch = epoch
    if held:
        series.acquisitions += 1
    else:
        series.losses[reason or "error"] += 1


def lease_observed(shard: Shard, epoch: int) -> None:
    LEASES.series(shard).epoch = epoch
