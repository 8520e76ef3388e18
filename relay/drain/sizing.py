"""How many rows the next fetch asks for: about what the sink publishes in
TARGET_SECONDS, between a floor and RELAY_BATCH_SIZE.

A row committed while a batch is published waits for that batch, for the one read
ahead beside it, and for its own: about three batch times. A fixed batch size makes
that time the sink's: 1,000 rows to a receiver that takes 20 ms a request is three
seconds a batch, and a small tenant's row waits ten. Sized by time, a batch to a fast
sink (Kafka) grows to its cap, where the per-batch costs (a fetch, a settle, a flush)
spread thinnest, and a batch to a slow one shrinks to what it sends in
TARGET_SECONDS. Pure: the drain loop reports each publish, on a clock it measured.
"""

from __future__ import annotations

# A batch should take about this long to publish: a row committed meanwhile is sent
# within a few of these. Shorter costs throughput beside a rate-limited HTTP origin,
# whose rows take a larger part of each small batch than it can send (0.25 s: the other
# origin at 1.45x its time alone; 0.4 s: 1.15x; a small tenant's rows at 20 ms a request
# 0.6-0.8 s and 1.1-1.2 s after their commit; `./dev bench --only rate-limits|tenants`).
TARGET_SECONDS = 0.4
# Never fewer rows than this (or RELAY_BATCH_SIZE, if smaller): enough keys to keep a
# sink's in-flight slots busy, and a batch's fixed costs small beside its rows.
FLOOR_ROWS = 64
# A batch at most doubles from one to the next: one fast publish (acks that came all
# at once) must not swing the next batch to the cap.
GROWTH = 2.0
# How much of a new measurement enters the rate estimate.
SMOOTHING = 0.3


class BatchSizer:
    """The rate the sink publishes at, as the batches showed it, and what the next
    fetch asks for (`rows`). It starts at the floor: the first batches show the rate."""

    def __init__(
        self, most: int, *, floor: int = FLOOR_ROWS, target_seconds: float = TARGET_SECONDS
    ) -> None:
        self._most = most
        self._floor = min(floor, most)
        self._target = target_seconds
        self._rate: float | None = None  # rows a second
        self.rows = self._floor

    @property
    def rate(self) -> float | None:
        return self._rate

    def published(self, rows: int, asked: int, seconds: float) -> None:
        """A batch of `rows` (its fetch asked for `asked`) took `seconds` to publish.
        A short batch (the backlog, a key's cap or the bytes bound ended it) shows the
        sink's latency more than its rate: it may only raise the estimate."""
        if rows <= 0 or seconds <= 0:
            return
        rate = rows / seconds
        if self._rate is None:
            self._rate = rate
        elif rows >= asked:
            self._rate += SMOOTHING * (rate - self._rate)
        elif rate > self._rate:
            self._rate = rate
        wanted = self._rate * self._target
        self.rows = int(max(self._floor, min(wanted, self._most, self.rows * GROWTH)))
