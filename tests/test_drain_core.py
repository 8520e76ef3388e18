"""The drain loop without servers: the real `Drainer` (reader, settle pipeline, settler
thread, give-way, recorder) on the in-memory store (relay/store/memory.py), a scripted
sink and a fake clock that only the loop's own waits move. The same rules the
PostgreSQL tests check end to end, in milliseconds: order per key, backoff that blocks
only its key, dead letters, the fence, a failed statement, scheduled rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from relay.drain.batch import BatchLimits
from relay.drain.loop import DrainConfig, Drainer
from relay.lease.protocol import Lease
from relay.message import OutboxMessage
from relay.observe.metrics import Health
from relay.shutdown import Shutdown
from relay.sinks.base import ACKED, SKIPPED, OnePhase, Outcome, Result
from relay.store.memory import MemoryStore

pytestmark = pytest.mark.unit

LEASE = "core"
# How far the fake clock may run before a test gives up: the loop's waits move it, so a
# loop that never gets there ends anyway.
GIVE_UP_AFTER = 3600.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StopWhen(Shutdown):
    """A shutdown that is requested once `done()` holds (or the fake clock ran out),
    and whose waits move the fake clock instead of sleeping."""

    def __init__(self, clock: FakeClock, done: Callable[[], bool]) -> None:
        super().__init__(grace=5.0, clock=clock)
        self._fake = clock
        self._done = done
        self._give_up_at = clock.now + GIVE_UP_AFTER

    @property
    def requested(self) -> bool:
        return super().requested or self._done() or self._fake.now > self._give_up_at

    def wait(self, timeout: float) -> bool:
        self._fake.now += max(timeout, 0.001)
        return self.requested


class ScriptedSink(OnePhase):
    """Acknowledges every message, but for the outcomes scripted per key: each
    publication of a row of that key takes the next one. As every sink does, it skips
    the rest of a key's rows in a batch once one of them failed."""

    name = "scripted"
    serial_per_key = False
    max_publish_seconds = 5.0

    def __init__(self, script: dict[str, list[Result]] | None = None) -> None:
        self.script = script or {}
        self.published: list[tuple[str | None, bytes]] = []  # every publication, in order
        self.delivered: list[tuple[str | None, bytes]] = []  # the acknowledged ones
        self.on_batch: Callable[[int], None] = lambda _batches: None
        self._batches = 0

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        self._batches += 1
        self.on_batch(self._batches)
        results: list[Result] = []
        failed: set[str | None] = set()
        for message in messages:
            assert message.payload is not None
            if message.key in failed:
                results.append(SKIPPED)
                continue
            self.published.append((message.key, message.payload))
            planned = self.script.get(message.key or "")
            result = planned.pop(0) if planned else ACKED
            if result.outcome is Outcome.ACKED:
                self.delivered.append((message.key, message.payload))
            else:
                failed.add(message.key)
            results.append(result)
        return results

    def check(self, timeout: float) -> str:
        return "scripted"

    def close(self) -> None:
        return


def config(**overrides: object) -> DrainConfig:
    values: dict[str, object] = {
        "limits": BatchLimits(rows=4, bytes=1 << 20, per_key=2),
        "max_attempts": 3,
        "retry_base": 1.0,
        "retry_max": 1.0,
        "give_way_seconds": 0.0,
        "poll_min": 0.01,
        "poll_max": 1.0,
        "lease_ttl": 30.0,
        "sent_rows": "delete",
    }
    values.update(overrides)
    return DrainConfig(**values)  # type: ignore[arg-type]


def drain(
    store: MemoryStore,
    sink: ScriptedSink,
    clock: FakeClock,
    done: Callable[[], bool],
    drain_config: DrainConfig | None = None,
) -> Lease:
    """Run the loop as the lease's holder until `done()`; the lease, for its state."""
    lease = Lease(LEASE, "me", ttl=1e6, margin=1.0, clock=clock)
    lease.acquired(store.take(LEASE, "me"), clock.now)
    drainer = Drainer(
        drain_config or config(),
        store,
        sink,
        lease,
        StopWhen(clock, done),
        Health(clock),
        clock=clock,
    )
    try:
        drainer.drain()
    finally:
        drainer.close()
    return lease


def rows(store: MemoryStore, count: int, keys: int) -> list[tuple[str | None, bytes]]:
    written: list[tuple[str | None, bytes]] = []
    for n in range(count):
        key = f"k{n % keys}"
        payload = f"{key}:{n // keys}".encode()
        store.insert(key, payload)
        written.append((key, payload))
    return written


def per_key(delivered: Sequence[tuple[str | None, bytes]]) -> dict[str | None, list[bytes]]:
    seen: dict[str | None, list[bytes]] = {}
    for key, payload in delivered:
        seen.setdefault(key, []).append(payload)
    return seen


def test_every_row_is_delivered_once_in_order_per_key_and_settled() -> None:
    clock, store, sink = FakeClock(), MemoryStore(), ScriptedSink()
    store.clock = clock
    written = rows(store, 30, keys=3)
    drain(store, sink, clock, done=lambda: not store.unsent())
    assert sink.delivered == sink.published  # nothing published twice
    assert sorted(sink.delivered) == sorted(written)
    assert per_key(sink.delivered) == per_key(written)
    assert store.settles >= 30 // 4  # batches of at most 4 rows, each settled
    assert all(row.deleted for row in store.rows)


def test_a_failed_row_backs_off_and_holds_back_only_its_key() -> None:
    clock, store = FakeClock(), MemoryStore()
    store.clock = clock
    sink = ScriptedSink({"k0": [Result(Outcome.RETRY, "try later", reached=True)]})
    written = rows(store, 12, keys=3)
    started = clock.now
    drain(store, sink, clock, done=lambda: not store.unsent())
    assert per_key(sink.delivered) == per_key(written)  # k0's rows still in order
    first_k0 = sink.delivered.index(("k0", b"k0:0"))
    others = [key for key, _ in sink.delivered[:first_k0]]
    assert others.count("k1") == 4 and others.count("k2") == 4  # they did not wait
    assert clock.now - started >= 0.5  # k0:0 waited out its backoff (1 s, equal jitter)
    assert store.rows[0].attempts == 1 and store.rows[0].last_error == "try later"


def test_a_deferred_row_spends_no_attempt_waits_and_holds_back_only_its_key() -> None:
    """Sent back by its destination's rate limit five times, with max_attempts 3: it
    is never dead-lettered, comes back each time after the sink's time, in order."""
    clock, store = FakeClock(), MemoryStore()
    store.clock = clock
    deferred = Result(Outcome.RETRY, "over its limit", retry_after=2.0, collateral=True)
    sink = ScriptedSink({"k0": [deferred] * 5})
    written = rows(store, 12, keys=3)
    started = clock.now
    drain(store, sink, clock, done=lambda: not store.unsent(), drain_config=config(retry_max=10.0))
    assert per_key(sink.delivered) == per_key(written)
    first_k0 = sink.delivered.index(("k0", b"k0:0"))
    others = [key for key, _ in sink.delivered[:first_k0]]
    assert others.count("k1") == 4 and others.count("k2") == 4  # they did not wait
    assert clock.now - started >= 5 * 2.0
    assert not store.dead()
    assert store.rows[0].attempts == 0 and store.rows[0].last_error == "over its limit"


def test_a_row_that_keeps_failing_is_dead_lettered_and_its_key_goes_on() -> None:
    clock, store = FakeClock(), MemoryStore()
    store.clock = clock
    sink = ScriptedSink({"k0": [Result(Outcome.RETRY, "boom", reached=True)] * 3})
    rows(store, 6, keys=2)
    drain(store, sink, clock, done=lambda: not store.unsent())
    [dead] = store.dead()
    assert (dead.id, dead.attempts) == (1, 3)
    assert dead.dead_reason is not None and "boom" in dead.dead_reason
    assert [p for k, p in sink.delivered if k == "k0"] == [b"k0:1", b"k0:2"]


def test_a_row_too_large_to_load_is_dead_lettered_with_its_size_unsent() -> None:
    clock, store, sink = FakeClock(), MemoryStore(), ScriptedSink()
    store.clock = clock
    store.insert("k", b"k:0")
    store.insert("k", b"x" * 100)
    store.insert("k", b"k:2")
    limits = BatchLimits(rows=4, bytes=1 << 20, per_key=4, message_bytes=50)
    drain(store, sink, clock, lambda: not store.unsent(), config(limits=limits))
    assert sink.published == [("k", b"k:0"), ("k", b"k:2")]
    [dead] = store.dead()
    assert dead.id == 2 and dead.dead_reason is not None and "100 bytes" in dead.dead_reason


def test_a_newer_holder_fences_the_settle_and_the_loop_stops_publishing() -> None:
    clock, store, sink = FakeClock(), MemoryStore(), ScriptedSink()
    store.clock = clock
    rows(store, 40, keys=4)
    at_takeover: list[int] = []

    def take_over(batches: int) -> None:
        if batches == 3:
            store.take(LEASE, "newer")
            at_takeover.extend(row.id for row in store.rows if not row.unsent)

    sink.on_batch = take_over
    lease = drain(store, sink, clock, done=lambda: False)
    assert lease.token() is None  # fenced: the loop ended on its own
    assert lease.take_fenced() is not None  # and the elector is told
    assert len(at_takeover) >= 4  # the first batch had landed (pipelining: maybe two)
    # Nothing the old holder published after the takeover was settled by it.
    assert [row.id for row in store.rows if not row.unsent] == at_takeover
    assert len(sink.published) <= 4 * 4  # at most the batch after the fenced one
    assert clock.now < 1000.0 + GIVE_UP_AFTER


def test_a_failed_statement_is_retried_on_a_fresh_session_and_nothing_is_lost() -> None:
    clock, store, sink = FakeClock(), MemoryStore(), ScriptedSink()
    store.clock = clock
    written = rows(store, 20, keys=2)

    def cut_the_session(batches: int) -> None:
        if batches in (2, 4):
            store.fail_next(1)

    sink.on_batch = cut_the_session
    drain(store, sink, clock, done=lambda: not store.unsent())
    assert sorted(set(sink.delivered)) == sorted(written)  # duplicates allowed, no loss
    first_seen: list[tuple[str | None, bytes]] = []
    for delivery in sink.delivered:
        if delivery not in first_seen:
            first_seen.append(delivery)
    assert per_key(first_seen) == per_key(written)  # first publications in order


def test_a_failing_settle_backs_off_instead_of_republishing_at_a_fixed_pace() -> None:
    """Every settle fails for 30 s (a missing grant, a table locked away): each step
    publishes the batch again, then its settle fails. Before, the backoff was reset by
    every publish that succeeded, so the batch went out every 0.1-0.2 s; now it
    grows as for any outage (0.2 s doubling to 5 s), and the rows go once it recovers."""
    clock, store, sink = FakeClock(), MemoryStore(), ScriptedSink()
    store.clock = clock
    written = rows(store, 2, keys=2)
    store.settles_fail_until = clock.now + 30.0
    drain(store, sink, clock, done=lambda: not store.unsent())
    assert clock.now >= 30.0
    # About 13 rounds in 30 s (equal jitter: 2.5 to 5 s apart once grown); before, 200.
    assert len(sink.published) <= 2 * 20, len(sink.published)
    assert sorted(set(sink.delivered)) == sorted(written)


def test_a_scheduled_row_waits_for_its_time_and_holds_back_its_key() -> None:
    clock, store, sink = FakeClock(), MemoryStore(), ScriptedSink()
    store.clock = clock
    store.insert("k", b"k:0", available_in=30.0)
    store.insert("k", b"k:1")
    store.insert("other", b"other:0")
    started = clock.now
    due_at: list[float] = []
    sink.on_batch = lambda _batches: due_at.append(clock.now)
    drain(store, sink, clock, done=lambda: not store.unsent())
    assert sink.delivered == [("other", b"other:0"), ("k", b"k:0"), ("k", b"k:1")]
    assert due_at[0] - started < 1.0  # the other key did not wait
    assert due_at[1] - started >= 30.0


def test_a_surplus_shard_is_handed_over_once_its_last_settle_landed() -> None:
    """Rebalancing: the loop lets the lease go, but only after every batch it published
    was settled under its epoch (the taker must not publish a key's later rows first)."""
    clock, store, sink = FakeClock(), MemoryStore(), ScriptedSink()
    store.clock = clock
    rows(store, 40, keys=4)
    lease = Lease(LEASE, "me", ttl=1e6, margin=1.0, clock=clock)
    token = store.take(LEASE, "me")
    lease.acquired(token, clock.now)
    drainer = Drainer(
        config(),
        store,
        sink,
        lease,
        StopWhen(clock, lambda: False),
        Health(clock),
        clock=clock,
        surplus=lambda: len(sink.published) >= 8,
    )
    try:
        drainer.drain()
    finally:
        drainer.close()
    assert lease.token() is None and lease.take_release() == token  # the elector expires it
    settled = {row.payload for row in store.rows if not row.unsent}
    assert settled == {payload for _, payload in sink.published}  # nothing left in flight
    assert 8 <= len(settled) < 40


def test_the_fair_share_hands_over_each_replicas_highest_shards() -> None:
    from relay.daemon.lanes import FairShare

    peers = [1]
    held = [0, 1, 2, 3, 4, 5]
    share = FairShare(8, lambda: peers[0], lambda: held)
    assert share.cap() == 4 and share.at_cap()
    assert [s for s in held if share.surplus(s)] == [4, 5]
    peers[0] = 2  # a third replica joined: at most ceil(8 / 3)
    assert [s for s in held if share.surplus(s)] == [3, 4, 5]
    peers[0] = 0  # alone: everything is its share
    assert not any(share.surplus(s) for s in held) and not share.at_cap()


def test_a_paused_topic_waits_unattempted_holds_its_keys_and_goes_on_once_resumed() -> None:
    """A paused topic's row is parked, spending no attempt; the later row of its key in
    another topic waits behind it; other keys flow. Within a pass of the resume (about a
    second of the drain's clock) the row goes, before its key's later row."""
    clock, store, sink = FakeClock(), MemoryStore(), ScriptedSink()
    store.clock = clock
    store.insert("k", b"k:0", topic="audit")
    store.insert("k", b"k:1")
    store.insert("j", b"j:0")
    store.insert("j", b"j:1", topic="audit")
    store.insert("j", b"j:2")
    store.paused = {"audit"}
    resumed_at: list[float] = []

    def parked_then_resume() -> bool:
        parked = [row.id for row in store.rows if row.next_attempt_at == float("inf")]
        if not resumed_at and parked == [1, 4] and ("j", b"j:0") in sink.delivered:
            assert sink.published == [("j", b"j:0")]  # nothing of k, nor j after j:1
            assert all(row.attempts == 0 and row.last_error is None for row in store.rows)
            store.paused.clear()
            resumed_at.append(clock.now)
        return not store.unsent()

    drain(store, sink, clock, done=parked_then_resume)
    assert resumed_at, "the paused rows were never parked"
    assert sink.delivered == sink.published
    assert per_key(sink.delivered) == {"k": [b"k:0", b"k:1"], "j": [b"j:0", b"j:1", b"j:2"]}
    assert not store.dead()
    assert clock.now - resumed_at[0] <= 1.5  # the next pass let them go
