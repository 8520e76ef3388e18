"""Prometheus metrics, and the small HTTP server for /metrics, /healthz and /readyz.

Metric objects live here so every module records through one vocabulary; the names
follow Prometheus conventions (`relay_` prefix, base units, `_total` counters).

The server that answers /metrics and the probes is relay/observe/server.py.

Long: one vocabulary: every series is declared here, so names, units and labels are
reviewed together, and the metrics reference is generated from one module.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


SHARDS_HELD = Gauge(
    "relay_shards_held",
    "Shards whose lease this replica holds, and the most it may hold (fair share: "
    "ceil(shards / replicas that reach the sink)).",
    ["lease", "kind"],
)
MESSAGES = Counter(
    "relay_messages_total",
    "Messages handed to the sink, by outcome (acked, retry, dead, unavailable).",
    ["sink", "topic", "outcome"],
)
DEAD_LETTERED = Counter(
    "relay_dead_lettered_total", "Rows moved to the dead-letter state.", ["sink", "topic"]
)
SINK_REACHABLE = Gauge(
    "relay_sink_reachable",
    "1 if this replica reaches the sink: a standby's last probe, a leader's recent "
    "delivery progress (what it last wrote to the replicas table).",
    ["lease"],
)
PEERS = Gauge(
    "relay_peers",
    "Other live replicas of the lease at the last heartbeat: all, and those that report "
    "they reach the sink (state=able).",
    ["lease", "state"],
)
NOTIFY_LISTENING = Gauge(
    "relay_notify_listening",
    "1 while this replica's session LISTENs on RELAY_NOTIFY_CHANNEL (absent without it): "
    "0 means wake-ups fall back to polling.",
)
NOTIFY_WAKEUPS = Counter(
    "relay_notify_wakeups_total",
    "Notifications received on RELAY_NOTIFY_CHANNEL, each waking the idle drain loops.",
)
STRAGGLERS = Gauge(
    "relay_stragglers",
    "Published rows without an outcome yet while the rest of their batch was answered "
    "(a sick partition): unsettled, their keys held back, other keys flowing.",
)
PUBLISHING_CUTS = Counter(
    "relay_publishing_cuts_total",
    "Times the lease's local deadline (or its loss) made the sink drop what it still held.",
)
PURGED = Counter(
    "relay_purged_rows_total", "Sent rows deleted by the retention purge (retention mode)."
)
SENT_GENERATIONS_EMPTIED = Counter(
    "relay_sent_generations_emptied_total",
    "Generations of outbox_sent emptied whole by the retention purge (one TRUNCATE each).",
)
PURGE_ERRORS = Counter(
    "relay_purge_errors_total",
    "Retention purge runs that failed (logged; tried again at the next interval).",
)
BATCH_SIZE = Histogram(
    "relay_batch_size",
    "Rows per fetched batch.",
    buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 2000, 5000),
)
PUBLISH_SECONDS = Histogram(
    "relay_publish_duration_seconds",
    "Time to publish a batch and collect every ack.",
    ["sink"],
    buckets=LATENCY_BUCKETS,
)
SETTLE_SECONDS = Histogram(
    "relay_mark_duration_seconds",
    "Time of the fenced transaction that settles a batch.",
    buckets=LATENCY_BUCKETS,
)
BATCH_LIMIT = Gauge(
    "relay_batch_limit_rows",
    "Rows the next fetch asks for at most: about what the sink publishes in 0.4 s, up "
    "to RELAY_BATCH_SIZE.",
    ["shard"],
)
FETCH_SECONDS = Histogram(
    "relay_fetch_duration_seconds",
    "Time to read a batch: the fetch statements, on the reader's thread.",
    buckets=LATENCY_BUCKETS,
)
PAUSED_ROWS_HELD = Counter(
    "relay_drain_paused_rows_held",
    "Rows of paused topics the drain moved out of the outbox into outbox_paused, to wait "
    "there until their topic is resumed.",
)
PAUSES_SEEN = Gauge(
    "relay_drain_paused_topics",
    "Paused topics this replica's drain of a shard honours, as its last pass read them.",
    ["shard"],
)
READ_WAIT = Counter(
    "relay_read_wait_seconds",
    "Seconds the drain loop of a lease (a shard's) waited for its reads (the read-ahead, a "
    "fresh fetch, letting scheduled rows in): its rate is the share of that loop's time "
    "the database holds it up.",
    ["lease"],
)


class BatchHistogram(Collector):
    """A histogram observed a batch at a time: one sort, one lock and a bisect per
    bucket, where prometheus_client's Histogram walks its buckets and takes a lock per
    value. The relay observes every message it delivers, so this is on the hot path."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        buckets: Sequence[float],
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self._name, self._documentation, self._label = name, documentation, label
        self._bounds = sorted(buckets)
        self._lock = threading.Lock()
        # label value -> (count per bucket, the last for +Inf; sum)
        self._series: dict[str, tuple[list[int], list[float]]] = {}
        self.registry = registry
        registry.register(self)

    def observe_many(self, value: str, amounts: Iterable[float]) -> None:
        # Sorted once (in C), then one bisect per bucket bound, not one per amount. Not
        # a finite number (a row created at 'infinity'): no latency to speak of, and
        # math.fsum would raise on +inf and -inf together.
        ordered = sorted(filter(math.isfinite, amounts))
        cumulative = [bisect.bisect_right(ordered, bound) for bound in self._bounds]
        total = math.fsum(ordered)
        with self._lock:
            kept, kept_sum = self._series.setdefault(value, ([0] * (len(self._bounds) + 1), [0.0]))
            below = 0
            for index, upto in enumerate(cumulative):
                kept[index] += upto - below  # amounts <= this bound, > the one before
                below = upto
            kept[-1] += len(ordered) - below
            kept_sum[0] += total

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=[self._label])
        with self._lock:
            series = [(v, list(c), s[0]) for v, (c, s) in self._series.items()]
        for value, counts, total in series:
            cumulative = list(itertools.accumulate(counts))
            buckets = [
                ("+Inf" if bound == math.inf else repr(float(bound)), float(n))
                for bound, n in zip([*self._bounds, math.inf], cumulative, strict=True)
            ]
            family.add_metric([value], buckets, total)
        yield family


END_TO_END_SECONDS = BatchHistogram(
    "relay_end_to_end_latency_seconds",
    "Row created_at, or available_at if later (database clock), to sink acknowledgement"
    " (relay clock).",
    "sink",
    LATENCY_BUCKETS,
)
BUILD_INFO = Info("relay_build", "Version and sink of this relay process.")

# Lag gauges: set by the lag sampler (relay/observe/lag.py) on every replica, leader or standby.
OUTBOX_UNSENT = Gauge(
    "relay_outbox_unsent_rows", "Unsent, not dead-lettered rows (counted up to the cap)."
)
OUTBOX_OLDEST_AGE = Gauge(
    "relay_outbox_oldest_unsent_age_seconds",
    "Age of the oldest unsent row (lowest id), by the database clock; 0 when none.",
)
OUTBOX_BLOCKED = Gauge(
    "relay_outbox_blocked_rows",
    "Unsent rows that failed and wait to retry, plus the later rows of their key.",
)
OUTBOX_DEAD = Gauge(
    "relay_outbox_dead_letter_rows",
    "Dead letters, in outbox_dead (or an own table's, marked in place), up to the cap.",
)
OUTBOX_SCHEDULED = Gauge(
    "relay_outbox_scheduled_rows",
    "Rows scheduled for later (available_at) and not yet due: not lag (counted up to the cap).",
)
OUTBOX_PAUSED = Gauge(
    "relay_outbox_paused_rows",
    "Rows held for a paused topic (relay pause): moved out into outbox_paused, or parked in "
    "place (an own table's: the first waiting row of each key). Counted up to the cap.",
)
TOPIC_PAUSED = Gauge(
    "relay_topic_paused_seconds",
    "How long each paused topic (relay pause) has been paused; absent when none is.",
    ["topic"],
)
SCHEDULED_PROMOTED = Counter(
    "relay_scheduled_promoted_total",
    "Scheduled rows found due and let into the drain by this replica.",
)
OUTBOX_COUNT_CAP = Gauge(
    "relay_outbox_count_cap", "The row counts above stop at this value (100,000)."
)
# Unknown until the first sample: NaN, not 0, which would read as "no lag" (and make a
# dead-letter delta jump from 0 when a new pod's first sample lands).
for _gauge in (OUTBOX_UNSENT, OUTBOX_OLDEST_AGE, OUTBOX_BLOCKED, OUTBOX_DEAD, OUTBOX_SCHEDULED):
    _gauge.set(float("nan"))
LAG_SAMPLE_SECONDS = Gauge(
    "relay_lag_sample_duration_seconds", "Duration of the last lag sample query."
)
LAG_SAMPLE_AGE = Gauge(
    "relay_lag_sample_age_seconds", "Seconds since the lag gauges were last refreshed."
)
LAG_SAMPLE_ERRORS = Counter(
    "relay_lag_sample_errors_total", "Lag samples that failed (the gauges keep the last value)."
)
LOOP_HEARTBEAT_AGE = Gauge(
    "relay_loop_heartbeat_age_seconds",
    "Seconds since a loop of this process last beat (main, elector, lag).",
    ["loop"],
)


OTHER_TOPIC = "_other"
# Longer topics count under OTHER_TOPIC: the cap bounds /metrics in bytes, not only in
# series. Kafka's own limit is 249, RabbitMQ's routing keys 255 bytes.
TOPIC_LABEL_MAX_CHARS = 255


class TopicLabels:
    """The `topic` label value of the per-topic series (RELAY_METRICS_TOPIC_LABELS).

    Topics come from app rows, so an app with a topic per tenant would grow /metrics,
    and Prometheus, without end: the first `limit` distinct topics keep their own value,
    every later one counts under OTHER_TOPIC. One per process, like the series it caps.
    """

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._kept: set[str] = set()
        self._limit = limit

    def reset(self, limit: int) -> None:
        """Start over with `limit` (at start-up: the process's series are new too)."""
        with self._lock:
            self._kept, self._limit = set(), limit

    def label(self, topic: str) -> str:
        # Once per topic per batch on the drain's hot path: a set lookup, no lock (a
        # membership test and an add are each atomic under the GIL).
        if topic in self._kept:
            return topic
        return self._admit(topic)

    def _admit(self, topic: str) -> str:
        if topic == OTHER_TOPIC or len(topic) > TOPIC_LABEL_MAX_CHARS:
            return OTHER_TOPIC
        if len(self._kept) < self._limit:
            with self._lock:
                if len(self._kept) < self._limit:
                    self._kept.add(topic)
        # Added, or the set is full and no longer changes: its answer is final.
        return topic if topic in self._kept else OTHER_TOPIC


# RELAY_METRICS_TOPIC_LABELS's default until the relay starts and sets it (relay/daemon/app.py).
TOPIC_LABELS = TopicLabels(100)


class Health:
    """Heartbeats the probes read: one per loop, and the last good database round trip.

    Every loop that must keep turning for the replica to be useful registers here: the
    main loop (drain or standby wait), the elector (without it a standby never takes
    over) and the lag sampler (without it the lag gauges lie).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._beats: dict[str, float] = {}
        self._stale_after: dict[str, float] = {}
        self.db_ok: Callable[[], bool] = lambda: False

    def register(self, loop: str, stale_after: float) -> None:
        with self._lock:
            self._beats[loop] = self._clock()
            self._stale_after[loop] = stale_after
        LOOP_HEARTBEAT_AGE.labels(loop).set_function(lambda: self.age(loop))

    def beat(self, loop: str = "main") -> None:
        # Lock-free on the hot path: one store into a key registered before any thread
        # started, which the GIL makes atomic.
        self._beats[loop] = self._clock()

    def age(self, loop: str) -> float:
        beat = self._beats.get(loop)
        return float("nan") if beat is None else self._clock() - beat

    def stalled(self) -> list[str]:
        """Loops whose last beat is older than their limit."""
        with self._lock:
            limits = dict(self._stale_after)
        return [loop for loop, limit in limits.items() if self.age(loop) >= limit]

    def describe(self) -> str:
        with self._lock:
            loops = sorted(self._stale_after)
        return " ".join(f"{loop}={self.age(loop):.1f}s" for loop in loops)
