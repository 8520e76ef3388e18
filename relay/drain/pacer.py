"""The drain's pace (RELAY_MAX_MESSAGES_PER_SECOND, RELAY_MAX_BYTES_PER_SECOND): a cap on
what one drain loop hands its sink, whatever the sink (Kafka, NATS, RabbitMQ; HTTP too,
where it caps the total beside each origin's own limit). Owned by the drain loop's
thread alone; one per lane, so with shards a process may send up to its lanes' caps.

Each cap is a GCRA without burst, weighted by cost: a batch goes once the batches
before it are paid for, and its cost (its rows, or its bytes, over the rate) pushes
the next one back. So in any window of W seconds the sink gets at most W times the
rate plus one batch, and a batch larger than any budget (one row of more bytes than a
second allows) still goes: only what follows it waits longer. The batches are made
small to keep that one batch small: at most `BURST_SECONDS` of budget each
(`PaceLimits.batch_rows`, `batch_bytes`, applied where the batch limits are made).

A row's bytes are counted as RELAY_BATCH_MAX_BYTES counts them: payload, topic, key and
its own headers; not the relay's headers (message-id, created-at) or the protocol's
framing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from relay.message import OutboxMessage
from relay.sinks.rate_limit import RecentRate

# A batch is at most this much of a cap's budget: what one batch may add to a second.
BURST_SECONDS = 0.1
# The slices a wait for budget is made of: a lost lease or a give-way ends it within one
# (a shutdown at once: its event ends the slice).
TICK_SECONDS = 0.05

MESSAGES_RATE = Gauge(
    "relay_drain_messages_per_second",
    "Messages the drain loop let out to the sink in about the last second (ten 100 ms "
    "buckets, a batch counted when the pacer lets it go); only with a cap set.",
    ["sink", "loop"],
)
BYTES_RATE = Gauge(
    "relay_drain_bytes_per_second",
    "Bytes (payload, topic, key, the row's headers) the drain loop let out to the sink in "
    "about the last second; only with a cap set.",
    ["sink", "loop"],
)
BUDGET_WAIT = Counter(
    "relay_drain_budget_wait_seconds_total",
    "Seconds the drain loop waited for its budget (RELAY_MAX_MESSAGES_PER_SECOND, "
    "RELAY_MAX_BYTES_PER_SECOND) before publishing a batch.",
    ["sink", "loop"],
)


@dataclass(frozen=True, slots=True)
class PaceLimits:
    """The caps, None for none (relay/daemon/configs.py `pace_limits`)."""

    messages: float | None = None  # RELAY_MAX_MESSAGES_PER_SECOND
    bytes: float | None = None  # RELAY_MAX_BYTES_PER_SECOND

    def batch_rows(self, rows: int) -> int:
        """RELAY_BATCH_SIZE, or fewer: at most `BURST_SECONDS` of the message cap."""
        if self.messages is None:
            return rows
        return max(1, min(rows, math.floor(self.messages * BURST_SECONDS)))

    def batch_bytes(self, size: int) -> int:
        """RELAY_BATCH_MAX_BYTES, or less: at most `BURST_SECONDS` of the byte cap (a
        batch still holds at least one row)."""
        if self.bytes is None:
            return size
        return max(1, min(size, math.floor(self.bytes * BURST_SECONDS)))


class Allowance:
    """One cap: `rate` units a second, spent a batch at a time. Pure: every method
    takes `now` (monotonic seconds), so it is tested on a fake clock.

    Not relay/sinks/rate_limit.py's `Budget`: that one books single requests that may be
    handed back (it keeps them until they start); here a booking has a cost, is never
    handed back, and nothing is kept but the next free start."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._next = -math.inf  # GCRA's theoretical arrival time: when the next may go

    def wait(self, now: float) -> float:
        """Seconds until the next batch may go (0: now)."""
        return max(0.0, self._next - now)

    def spend(self, now: float, cost: float) -> None:
        """A batch of `cost` goes now: the next one waits until it is paid for. No
        credit for a quiet spell (no burst after it)."""
        self._next = max(self._next, now) + cost / self.rate


def message_bytes(message: OutboxMessage) -> int:
    """A row's size as the batch byte bound counts it (relay/sql/drain.sql row_size)."""
    size = len(message.payload or b"") + len(message.topic.encode())
    if message.key is not None:
        size += len(message.key.encode())
    if message.headers:
        size += sum(len(name.encode()) + len(value.encode()) for name, value in message.headers)
    return size


class Pacer:
    """The caps of one drain loop, and their metrics (labelled by sink and loop: the
    liveness probe's loop names, one per lane)."""

    def __init__(
        self,
        limits: PaceLimits,
        sink: str,
        loop: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._messages = None if limits.messages is None else Allowance(limits.messages)
        self._bytes = None if limits.bytes is None else Allowance(limits.bytes)
        self.paced = self._messages is not None or self._bytes is not None
        if not self.paced:
            return
        self._message_rate, self._byte_rate = RecentRate(), RecentRate()
        MESSAGES_RATE.labels(sink, loop).set_function(self._rate_of(self._message_rate))
        BYTES_RATE.labels(sink, loop).set_function(self._rate_of(self._byte_rate))
        self._waited = BUDGET_WAIT.labels(sink, loop)

    def wait(self) -> float:
        """Seconds until the next batch may go (0: now, or no cap)."""
        if not self.paced:
            return 0.0
        now = self._clock()
        return max(
            self._messages.wait(now) if self._messages is not None else 0.0,
            self._bytes.wait(now) if self._bytes is not None else 0.0,
        )

    def admit(self, batch: Sequence[OutboxMessage], pause: Callable[[float], bool]) -> bool:
        """Wait with `pause` (False: cut short) until the caps let `batch` go, then spend
        its cost; False, spending nothing, if the wait was cut short."""
        if not self.paced:
            return True
        wait = self.wait()
        if wait > 0:
            started = self._clock()
            waited_out = pause(wait)
            self._waited.inc(max(0.0, self._clock() - started))
            if not waited_out:
                return False
        now, size = self._clock(), sum(map(message_bytes, batch))
        self._message_rate.record(now, len(batch))
        self._byte_rate.record(now, size)
        if self._messages is not None:
            self._messages.spend(now, len(batch))
        if self._bytes is not None:
            self._bytes.spend(now, size)
        return True

    def _rate_of(self, rate: RecentRate) -> Callable[[], float]:
        clock = self._clock
        return lambda: rate.per_second(clock())
