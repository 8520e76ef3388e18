"""Batches sized by time (relay/drain/sizing.py), without servers: the estimate on made-up
publishes, the limits it makes, and the real `Drainer` on the memory store with a sink
that takes a set time a row on the fake clock: a slow sink gets batches of about
TARGET_SECONDS of its rate, a fast one batches at the cap."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from relay.drain.batch import BatchLimits
from relay.drain.sizing import FLOOR_ROWS, TARGET_SECONDS, BatchSizer
from relay.message import OutboxMessage
from relay.sinks.base import Result
from relay.store.memory import MemoryStore
from tests.test_drain_core import FakeClock, ScriptedSink, config, drain, rows

pytestmark = pytest.mark.unit


def test_it_starts_at_the_floor_and_at_most_doubles_a_batch_up_to_the_cap() -> None:
    sizer = BatchSizer(1000)
    seen = [sizer.rows]
    for _ in range(6):  # a fast sink: any batch in 10 ms
        sizer.published(sizer.rows, sizer.rows, 0.01)
        seen.append(sizer.rows)
    assert seen == [FLOOR_ROWS, 128, 256, 512, 1000, 1000, 1000]


def test_a_slow_sink_gets_about_its_target_time_of_its_rate() -> None:
    sizer = BatchSizer(1000)
    for _ in range(30):  # 800 rows a second, whatever the batch
        sizer.published(sizer.rows, sizer.rows, sizer.rows / 800)
    assert sizer.rows == pytest.approx(800 * TARGET_SECONDS, abs=2)
    for _ in range(30):  # slower still: it shrinks, never under the floor
        sizer.published(sizer.rows, sizer.rows, sizer.rows / 50)
    assert sizer.rows == FLOOR_ROWS


def test_a_short_batch_may_raise_the_estimate_but_never_lower_it() -> None:
    sizer = BatchSizer(1000)
    for _ in range(10):
        sizer.published(sizer.rows, sizer.rows, sizer.rows / 2000)
    settled = round(2000 * TARGET_SECONDS)
    assert sizer.rows == settled
    sizer.published(3, settled, 0.05)  # three rows in 50 ms: the sink's latency, not its rate
    assert sizer.rows == settled
    sizer.published(0, settled, 0.0)
    assert sizer.rows == settled


def test_the_cap_and_the_floor_are_the_settings_when_smaller() -> None:
    sizer = BatchSizer(10)
    assert sizer.rows == 10
    sizer.published(10, 10, 10.0)  # one a second
    assert sizer.rows == 10


def test_limits_for_a_smaller_batch_keep_a_key_to_its_fifth_when_that_is_the_default() -> None:
    kafka = BatchLimits(rows=1000, bytes=1 << 20, per_key=200, per_key_fifth=True)
    assert kafka.sized(100).rows == 100 and kafka.sized(100).per_key == 20
    assert kafka.sized(3).per_key == 1
    assert kafka.sized(5000) is kafka  # never past the setting
    http = BatchLimits(rows=1000, bytes=1 << 20, per_key=4)  # a set cap, or HTTP's 4
    assert http.sized(100).per_key == 4


class TimedSink(ScriptedSink):
    """Acknowledges everything, taking `per_row` seconds of the fake clock a row (and
    `per_batch` a batch); remembers each batch's size."""

    def __init__(self, clock: FakeClock, per_row: float, per_batch: float = 0.0) -> None:
        super().__init__()
        self._clock = clock
        self._per_row = per_row
        self._per_batch = per_batch
        self.sizes: list[int] = []

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        self.sizes.append(len(messages))
        self._clock.now += self._per_batch + self._per_row * len(messages)
        return super().publish(messages, abandon)


def batch_sizes(per_row: float, per_batch: float = 0.0) -> list[int]:
    store, clock = MemoryStore(), FakeClock()
    clock.now = 1000.0
    written = rows(store, 20_000, keys=500)
    sink = TimedSink(clock, per_row, per_batch)
    limits = BatchLimits(rows=1000, bytes=1 << 30, per_key=200, per_key_fifth=True)
    drain(store, sink, clock, lambda: len(sink.delivered) == len(written), config(limits=limits))
    assert sorted(sink.delivered) == sorted(written)
    return sink.sizes


def test_the_drain_asks_a_slow_sink_for_its_target_time_and_a_fast_one_for_the_cap() -> None:
    slow = batch_sizes(per_row=1 / 400)  # 400 rows a second: 160 a batch
    assert slow[0] == FLOOR_ROWS
    assert all(size == pytest.approx(400 * TARGET_SECONDS, abs=3) for size in slow[10:-1]), slow
    fast = batch_sizes(per_row=1e-5, per_batch=0.005)  # Kafka-like: the acks' latency
    # Each batch was read ahead while the one before it was published: one behind.
    assert fast[:6] == [FLOOR_ROWS, FLOOR_ROWS, 128, 256, 512, 1000]
    assert set(fast[6:-1]) == {1000}
