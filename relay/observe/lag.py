"""How far behind the outbox is: one bounded query, sampled on an interval.

Every replica samples, leader or standby, on its own connection, so a scrape of any
replica tells the truth about the outbox. The query (`lag_sample` in operations.sql) walks
only the partial indexes and stops counting at a cap: its cost follows the cap, not the
table (docs/howto/tuning.md, "Lag sampling"). A scrape reads the last sample and never touches
the database. With shards (RELAY_SHARDS > 1) each shard's backlog and oldest age are
sampled too, through the shard index, and exported with a `shard` label beside the
unlabelled totals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from psycopg.pq import TransactionStatus

from relay.observe import metrics
from relay.observe.logging import OutageLog, get_logger
from relay.observe.metrics import Health
from relay.sql import QUERIES
from relay.store import connection, db
from relay.store.db import Conn

log = get_logger("relay.lag")


# The oldest age is the longest wait among this many rows at the head (lag_sample).
AGE_WINDOW = 1_000


# Row counts in the lag gauges stop here, so a sample's cost is bounded (a count equal to
# it means "at least").
COUNT_CAP = 100_000


@dataclass(frozen=True, slots=True)
class LagSample:
    unsent: int
    oldest_unsent_age_seconds: float
    blocked: int
    dead_lettered: int
    count_cap: int
    # Scheduled rows not yet due (not lag), and in how many seconds the next one is
    # due (None: none is scheduled).
    scheduled: int = 0
    next_due_in_seconds: float | None = None
    # Rows held for a paused topic (moved out, or parked in place), and each paused
    # topic with how many seconds it has been paused.
    paused: int = 0
    paused_topics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The counts, for `relay status --json`'s `outbox`: the paused topics are its
        own `paused_topics`, with who paused them and since when."""
        counts = asdict(self)
        del counts["paused_topics"]
        return counts


@contextmanager
def _walking_in_order(conn: Conn) -> Iterator[None]:
    """The lag statements' walks stop at their caps whatever the statistics: planned
    with bitmap scans and sorts off (relay/store/db.py, ORDERED_WALKS), for one
    transaction, on whichever session asks (the lag sampler's, `relay status`, the
    console's). A caller inside its own transaction keeps its settings."""
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        with conn.transaction():
            connection.apply_settings(conn, connection.ORDERED_WALKS, local=True)
            yield
    else:
        yield


def measure(conn: Conn, cap: int) -> LagSample:
    with _walking_in_order(conn):
        row = conn.execute(QUERIES.lag_sample, {"cap": cap, "age_window": AGE_WINDOW}).fetchone()
    assert row is not None  # an aggregate-only SELECT always returns one row
    return LagSample(
        unsent=int(row["unsent"]),
        oldest_unsent_age_seconds=float(row["oldest_unsent_age_seconds"] or 0.0),
        blocked=int(row["blocked"]),
        dead_lettered=int(row["dead_lettered"]),
        count_cap=cap,
        scheduled=int(row["scheduled"]),
        next_due_in_seconds=(
            None if row["next_due_in_seconds"] is None else float(row["next_due_in_seconds"])
        ),
        paused=int(row["paused"]),
        paused_topics={str(t): float(s) for t, s in row["paused_topics"].items()},
    )


@dataclass(frozen=True, slots=True)
class ShardLag:
    shard: int
    shards: int
    unsent: int
    oldest_unsent_age_seconds: float
    count_cap: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def shard_count_cap(cap: int, shards: int) -> int:
    """Each shard's count (and its window for the oldest age) stops at its part of the
    cap: a sample of all the shards walks no more index entries than the unsharded one."""
    return max(1, cap // shards)


def measure_shards(conn: Conn, shards: int, cap: int) -> list[ShardLag]:
    """Per-shard lag; `conn` must plan with custom plans (relay/store/db.py, CUSTOM_PLANS),
    or the shard count is no constant and no shard index matches."""
    part = shard_count_cap(cap, shards)
    with _walking_in_order(conn):
        rows = conn.execute(
            QUERIES.lag_sample_shards,
            {"shards": shards, "cap": part, "age_window": shard_count_cap(AGE_WINDOW, shards)},
        ).fetchall()
    return [
        ShardLag(
            shard=int(row["shard"]),
            shards=shards,
            unsent=int(row["unsent"]),
            oldest_unsent_age_seconds=float(row["oldest_unsent_age_seconds"]),
            count_cap=part,
        )
        for row in rows
    ]


class ShardLagCollector(Collector):
    """`relay_outbox_shard_*{lease,shard}`: absent without shards, so an unsharded
    relay's metrics are exactly what they were before shards existed."""

    def __init__(self) -> None:
        self._lease = ""
        self._shards: list[ShardLag] = []

    def set(self, lease: str, shards: list[ShardLag]) -> None:
        self._lease, self._shards = lease, shards  # one reference swap: scrapes see a whole sample

    def collect(self) -> Iterator[Metric]:
        lease, shards = self._lease, self._shards
        if not shards:
            return
        unsent = Metric(
            "relay_outbox_shard_unsent_rows",
            "Unsent, not dead-lettered rows of one shard (counted up to the cap / shards).",
            "gauge",
        )
        oldest = Metric(
            "relay_outbox_shard_oldest_unsent_age_seconds",
            "Age of one shard's oldest unsent row, by the database clock; 0 when none.",
            "gauge",
        )
        for s in shards:
            labels = {"lease": lease, "shard": str(s.shard)}
            unsent.add_sample("relay_outbox_shard_unsent_rows", labels, s.unsent)
            oldest.add_sample(
                "relay_outbox_shard_oldest_unsent_age_seconds", labels, s.oldest_unsent_age_seconds
            )
        yield from (unsent, oldest)


SHARD_LAG = ShardLagCollector()
REGISTRY.register(SHARD_LAG)


# The topics relay_topic_paused_seconds has a series for: a resumed topic's is removed
# after the new values are set, never cleared first (a scrape between would miss them).
_PAUSED_SERIES: set[str] = set()


def publish(sample: LagSample) -> None:
    metrics.OUTBOX_UNSENT.set(sample.unsent)
    metrics.OUTBOX_OLDEST_AGE.set(sample.oldest_unsent_age_seconds)
    metrics.OUTBOX_BLOCKED.set(sample.blocked)
    metrics.OUTBOX_DEAD.set(sample.dead_lettered)
    metrics.OUTBOX_SCHEDULED.set(sample.scheduled)
    metrics.OUTBOX_COUNT_CAP.set(sample.count_cap)
    metrics.OUTBOX_PAUSED.set(sample.paused)
    for topic, seconds in sample.paused_topics.items():
        metrics.TOPIC_PAUSED.labels(topic).set(seconds)
    for resumed in _PAUSED_SERIES - sample.paused_topics.keys():
        metrics.TOPIC_PAUSED.remove(resumed)
    _PAUSED_SERIES.clear()
    _PAUSED_SERIES.update(sample.paused_topics)


@dataclass(frozen=True, slots=True)
class LagConfig:
    """What the sampler reads of the settings (`relay.daemon.configs.lag_config`)."""

    lease_name: str  # RELAY_LEASE_NAME, the `lease` label of the per-shard series
    interval_seconds: float  # RELAY_LAG_SAMPLE_SECONDS
    count_cap: int  # COUNT_CAP
    shards: int  # RELAY_SHARDS; above 1, each shard is sampled too


class LagSampler(threading.Thread):
    """Refreshes the lag gauges every `interval_seconds`.

    On a failed sample the gauges keep their last values (the errors counter and
    `relay_lag_sample_age_seconds` say they are stale) rather than drop to zero, which
    would read as "no lag" exactly when the database is in trouble.
    """

    def __init__(
        self,
        config: LagConfig,
        connect: Callable[[str], db.Conn],
        health: Health,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="relay-lag", daemon=True)
        self._config = config
        self._connect = connect
        self._health = health
        self._clock = clock
        self._stop_event = threading.Event()
        self._session = db.Session(self._open)
        self._sampled_at = clock()
        self._outage = OutageLog(log, "lag.sample_failed", "lag.sample_recovered")
        metrics.LAG_SAMPLE_AGE.set_function(lambda: self._clock() - self._sampled_at)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self._health.beat("lag")
                self.sample_once()
                self._stop_event.wait(self._config.interval_seconds)
        finally:
            self._session.close()

    def sample_once(self) -> LagSample | None:
        started = self._clock()
        config = self._config
        try:
            conn = self._session.get()
            sample = measure(conn, config.count_cap)
            shards = (
                measure_shards(conn, config.shards, config.count_cap) if config.shards > 1 else []
            )
        except Exception as exc:
            # Any failure, not only the database's: this thread only feeds metrics, and
            # its death would fail /healthz and restart a healthy leader.
            metrics.LAG_SAMPLE_ERRORS.inc()
            self._outage.failure(db.describe_error(exc))
            self._session.close()
            return None
        self._outage.success()
        publish(sample)
        SHARD_LAG.set(config.lease_name, shards)
        self._sampled_at = self._clock()
        metrics.LAG_SAMPLE_SECONDS.set(self._sampled_at - started)
        return sample

    def _open(self) -> Conn:
        conn = self._connect("lag")
        try:
            # No JIT for millisecond queries; custom plans match the shard indexes.
            connection.keep_settings(conn, connection.CUSTOM_PLANS)
        except BaseException:
            conn.close()
            raise
        return conn
