"""The drain's pace (RELAY_MAX_MESSAGES_PER_SECOND, RELAY_MAX_BYTES_PER_SECOND) without
servers: the weighted GCRA on a fake clock, the batch limits it makes, and the real
`Drainer` on the memory store (tests/test_drain_core.py's harness), where the cap
holds, and a shutdown or a lost lease ends a wait for budget at once."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import pytest
from prometheus_client import REGISTRY

from relay.daemon.configs import batch_limits, drain_config
from relay.drain.batch import BatchLimits
from relay.drain.loop import DrainConfig, Drainer
from relay.drain.pacer import TICK_SECONDS, Allowance, PaceLimits, message_bytes
from relay.lease.protocol import Lease
from relay.message import OutboxMessage
from relay.observe.metrics import Health
from relay.settings import Settings
from relay.shutdown import Shutdown
from relay.sinks.base import Result
from relay.store.memory import MemoryStore
from tests.test_drain_core import (
    LEASE,
    FakeClock,
    ScriptedSink,
    StopWhen,
    config,
    per_key,
    rows,
)

pytestmark = pytest.mark.unit


def busiest_window(sends: Sequence[tuple[float, int]], seconds: float = 1.0) -> int:
    """The most sent in any window [t, t + seconds), `sends` being (when, how many)."""
    ordered = sorted(sends)
    most, first, inside = 0, 0, 0
    for at, amount in ordered:
        inside += amount
        while ordered[first][0] <= at - seconds:
            inside -= ordered[first][1]
            first += 1
        most = max(most, inside)
    return most


# --- the allowance on a fake clock ----------------------------------------------------


def test_a_batch_goes_once_those_before_it_are_paid_for_and_a_quiet_spell_saves_nothing() -> None:
    allowance = Allowance(100.0)
    assert allowance.wait(0.0) == 0.0
    allowance.spend(0.0, 10)  # 10 messages at 100/s: the next waits 0.1 s
    assert allowance.wait(0.0) == pytest.approx(0.1)
    assert allowance.wait(0.05) == pytest.approx(0.05)
    allowance.spend(0.1, 50)
    assert allowance.wait(0.1) == pytest.approx(0.5)
    # Quiet for a while: the next batch goes at once, the one after it pays again.
    allowance.spend(10.0, 10)
    assert allowance.wait(10.0) == pytest.approx(0.1)


def test_no_window_holds_more_than_the_rate_plus_one_batch_whatever_the_batches() -> None:
    """The promise stated in the README, over random batch sizes and late wake-ups."""
    generator = random.Random(35)
    for _ in range(50):
        rate = generator.choice([5.0, 200.0, 10_000.0])
        largest = max(1, int(rate * 0.1))
        allowance, now, sends = Allowance(rate), 0.0, []
        for _ in range(300):
            now += allowance.wait(now) + generator.choice([0.0, 0.0, 0.003, 0.5])
            cost = generator.randint(1, largest)
            allowance.spend(now, cost)
            sends.append((now, cost))
        assert busiest_window(sends) <= rate + largest


def test_one_row_larger_than_any_budget_still_goes_and_only_delays_what_follows() -> None:
    allowance = Allowance(1000.0)  # bytes a second
    assert allowance.wait(0.0) == 0.0
    allowance.spend(0.0, 5000)
    assert allowance.wait(0.0) == pytest.approx(5.0)


def test_a_batch_is_at_most_a_tenth_of_a_second_of_each_cap() -> None:
    assert PaceLimits(200.0).batch_rows(1000) == 20
    assert PaceLimits(5.0).batch_rows(1000) == 1  # never an empty batch
    assert PaceLimits(1e6).batch_rows(1000) == 1000  # RELAY_BATCH_SIZE still bounds it
    assert PaceLimits(None, 50_000).batch_bytes(8 << 20) == 5_000
    assert PaceLimits(None, 5).batch_bytes(8 << 20) == 1  # (a batch holds a row anyway)
    assert PaceLimits().batch_rows(1000) == 1000
    assert PaceLimits().batch_bytes(4096) == 4096


def test_the_settings_make_the_batches_and_reach_the_drain() -> None:
    settings = Settings(
        database_url="postgresql://app@127.0.0.1:1/db",
        kafka_bootstrap_servers="k:9092",
        max_messages_per_second=200,
        max_bytes_per_second=100_000,
    )
    sink = ScriptedSink()  # fills batches like Kafka (not serial per key)
    limits = batch_limits(settings, sink)
    assert (limits.rows, limits.bytes, limits.per_key) == (20, 10_000, 4)
    assert drain_config(settings, sink).pace == PaceLimits(200.0, 100_000)


def test_a_row_counts_its_payload_topic_key_and_headers_in_bytes() -> None:
    message = OutboxMessage(
        1, "m", "tópic", "key", b"x" * 10, [["h", "vé"]], None, "2024", 0.0, 0
    )  # ó and é are two bytes each
    assert message_bytes(message) == 10 + 6 + 3 + 1 + 3


# --- the real drain loop on the memory store --------------------------------------------


class TimedSink(ScriptedSink):
    """Notes when each batch reached it (the fake clock) and its rows and bytes."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.sends: list[tuple[float, int, int]] = []

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        size = sum(map(message_bytes, messages))
        self.sends.append((self.clock.now, len(messages), size))
        return super().publish(messages, abandon)


def paced(pace: PaceLimits, rows: int = 1000, size: int = 1 << 20) -> DrainConfig:
    """The drain config `drain_config` would make: batches cut to the caps."""
    limits = BatchLimits(rows=pace.batch_rows(rows), bytes=pace.batch_bytes(size), per_key=1000)
    return config(limits=limits, pace=pace)


def run(store: MemoryStore, sink: ScriptedSink, clock: FakeClock, drain: DrainConfig) -> None:
    lease = Lease(LEASE, "me", ttl=1e6, margin=1.0, clock=clock)
    lease.acquired(store.take(LEASE, "me"), clock.now)
    shutdown = StopWhen(clock, lambda: not store.unsent())
    drainer = Drainer(drain, store, sink, lease, shutdown, Health(clock), clock=clock)
    try:
        drainer.drain()
    finally:
        drainer.close()


@pytest.mark.parametrize("cap", [None, 20.0])
def test_the_message_cap_holds_in_every_second_and_order_per_key_too(cap: float | None) -> None:
    """100 rows at 20 a second: batches of 2 rows, never more than 20 + 2 in any second,
    about 5 s in all. Without the cap (the check that the test can fail) they go at once."""
    clock, store = FakeClock(), MemoryStore()
    store.clock = clock
    sink = TimedSink(clock)
    written = rows(store, 100, keys=5)
    started = clock.now
    run(store, sink, clock, paced(PaceLimits(cap), rows=50))
    assert per_key(sink.delivered) == per_key(written)
    busiest = busiest_window([(at, count) for at, count, _ in sink.sends])
    took = sink.sends[-1][0] - started
    if cap is None:
        assert busiest == 100 and took < 1.0
        return
    assert max(count for _, count, _ in sink.sends) == 2
    assert busiest <= 20 + 2
    assert (100 - 2) / 20 <= took < (100 - 2) / 20 + 0.5


def test_the_byte_cap_holds_in_every_second() -> None:
    """Rows of about 100 bytes at 1,000 bytes a second: a batch is one row (the tenth
    of a second is 100 bytes), never more than 1,000 + one batch in any second."""
    clock, store = FakeClock(), MemoryStore()
    store.clock = clock
    sink = TimedSink(clock)
    for n in range(30):
        store.insert(f"k{n % 3}", b"x" * 95)
    run(store, sink, clock, paced(PaceLimits(None, 1000)))
    assert len(sink.delivered) == 30
    sizes = {size for _, _, size in sink.sends}
    assert sizes == {95 + len("events") + 2}
    row = sizes.pop()
    assert busiest_window([(at, size) for at, _, size in sink.sends]) <= 1000 + row
    took = sink.sends[-1][0] - sink.sends[0][0]
    assert took == pytest.approx(29 * row / 1000, abs=TICK_SECONDS)


def test_a_lost_lease_ends_a_wait_for_budget_within_a_tick_and_nothing_more_goes() -> None:
    """A row of 5,000 bytes at 1,000 a second: the next batch must wait 5 s. The lease
    is lost 1 s into the wait: the loop stops within one tick, the row unpublished."""
    clock, store = FakeClock(), MemoryStore()
    store.clock = clock
    sink = TimedSink(clock)
    store.insert("k", b"x" * 5000)
    store.insert("k", b"y")
    lease = Lease(LEASE, "me", ttl=1e6, margin=1.0, clock=clock)
    lease.acquired(store.take(LEASE, "me"), clock.now)
    lost_at: list[float] = []  # when the lease was lost: 1 s after the first batch

    class LoseTheLease(StopWhen):
        def wait(self, timeout: float) -> bool:
            requested = super().wait(timeout)  # the fake clock moves by `timeout`
            if sink.sends and not lost_at and clock.now >= sink.sends[0][0] + 1.0:
                lease.lose()  # as the elector would, from its thread
                lost_at.append(sink.sends[0][0] + 1.0)
            return requested

    drainer = Drainer(
        paced(PaceLimits(None, 1000)),
        store,
        sink,
        lease,
        LoseTheLease(clock, lambda: False),
        Health(clock),
        clock=clock,
    )
    try:
        drainer.drain()
    finally:
        drainer.close()
    assert [count for _, count, _ in sink.sends] == [1]
    assert lost_at and clock.now - lost_at[0] <= TICK_SECONDS + 1e-9
    assert [row.payload for row in store.rows if row.unsent] == [b"y"]


def test_shutdown_ends_a_wait_for_budget_at_once_on_the_real_clock() -> None:
    """One message a second: the second row waits a second for budget. A shutdown
    0.2 s into it ends the loop at once (the event, not the next slice), unpublished."""
    store = MemoryStore()
    store.insert("k", b"first")
    store.insert("k", b"second")
    sink = ScriptedSink()
    shutdown = Shutdown(grace=5.0)
    lease = Lease(LEASE, "me", ttl=60.0, margin=1.0, clock=time.monotonic)
    lease.acquired(store.take(LEASE, "me"), time.monotonic())
    pace = PaceLimits(1.0)
    drainer = Drainer(paced(pace), store, sink, lease, shutdown, Health())
    requested_at: list[float] = []

    def request() -> None:
        requested_at.append(time.monotonic())
        shutdown.request()

    timer = threading.Timer(0.2, request)
    timer.start()
    try:
        drainer.drain()
        ended = time.monotonic()
    finally:
        timer.cancel()
        drainer.close()
    assert sink.published == [("k", b"first")]
    assert requested_at and ended - requested_at[0] < TICK_SECONDS


def test_the_rates_and_the_wait_are_exported_per_sink_and_loop() -> None:
    clock, store = FakeClock(), MemoryStore()
    store.clock = clock
    sink = TimedSink(clock)
    rows(store, 30, keys=3)
    labels = {"sink": "scripted", "loop": "main"}
    waited = REGISTRY.get_sample_value("relay_drain_budget_wait_seconds_total", labels) or 0.0
    run(store, sink, clock, paced(PaceLimits(10.0)))
    # 30 rows at 10 a second, a batch of one: 29 waits of 0.1 s.
    now_waited = REGISTRY.get_sample_value("relay_drain_budget_wait_seconds_total", labels)
    assert now_waited is not None
    assert now_waited - waited == pytest.approx(2.9, abs=0.05)
    # Read at scrape, over about the last second: 10 a second, and their bytes.
    assert REGISTRY.get_sample_value("relay_drain_messages_per_second", labels) == 10
    row = sink.sends[-1][2]
    assert REGISTRY.get_sample_value("relay_drain_bytes_per_second", labels) == 10 * row
