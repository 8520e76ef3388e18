"""The reader's own thread (relay/drain/reader.py) without servers: the read-ahead runs beside
the loop, every use of the session runs after it, one at a time, and neither closing
nor forgetting a read loses what went wrong in it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY

from relay.drain.batch import BatchLimits, IdSet, id_set
from relay.drain.reader import CLOSE_SECONDS, Reader
from relay.lease.protocol import Shard
from relay.message import OutboxMessage
from relay.shutdown import Shutdown
from relay.store.port import Fetched, FetchRequest, Promoted, StoreError

pytestmark = pytest.mark.unit

LIMITS = BatchLimits(rows=10, bytes=1 << 20, per_key=10)
# Long enough for any thread hand-over on a busy machine, far below a stuck read.
PROMPTLY = 2.0


def message(row_id: int, key: str = "k") -> OutboxMessage:
    return OutboxMessage(
        row_id, str(row_id), "t", key, b"p", None, None, "2026-01-01T00:00:00Z", 0.0, 0, True
    )


class SlowStore:
    """A read store whose fetches wait while `blocked` is set (until `interrupt`), fail
    as scripted, and count how many run at once."""

    def __init__(self) -> None:
        self.blocked = threading.Event()
        self.released = threading.Event()
        self.failures: list[BaseException] = []
        self.running = 0
        self.most_at_once = 0
        self.interrupted = 0
        self.closed_on: str | None = None
        self.fetches = 0
        self.on_daemon_threads = True
        self._lock = threading.Lock()
        self._next_id = 1

    def fetch(self, request: FetchRequest) -> Fetched:
        with self._lock:
            self.running += 1
            self.fetches += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.on_daemon_threads &= threading.current_thread().daemon
        try:
            if self.blocked.is_set() and not self.released.wait(30):
                raise AssertionError("never released")
            time.sleep(0.01)  # long enough for a second statement to overlap it
            if self.failures:
                raise self.failures.pop(0)
            row_id, self._next_id = self._next_id, self._next_id + 1
            return Fetched([message(row_id)])
        finally:
            with self._lock:
                self.running -= 1

    def promote_due(self, limit: int) -> Promoted:
        return Promoted(0, None)

    def paused_topics(self) -> frozenset[str]:
        return frozenset()

    def unpark_resumed(self) -> int:
        return 0

    def release_paused(self, limit: int) -> tuple[int, bool]:
        return 0, False

    def interrupt(self) -> None:
        self.interrupted += 1
        self.failures.insert(0, StoreError("canceling statement due to user request"))
        self.released.set()

    def close(self) -> None:
        self.closed_on = threading.current_thread().name


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PROMPTLY
    while not condition():
        assert time.monotonic() < deadline, f"not within {PROMPTLY} s: {what}"
        time.sleep(0.005)


def reader(store: SlowStore, shutdown: Shutdown | None = None) -> Reader:
    return Reader(store, LIMITS, 0.1, shard=Shard("test"), shutdown=shutdown)


def test_closing_cancels_a_stuck_read_ahead_and_closes_the_session_on_its_thread() -> None:
    """A read-ahead stuck on the database must not hold up the lane's stop (and so the
    lease's release) until the statement times out."""
    store = SlowStore()
    read = reader(store)
    assert read.next_batch([], frozenset())  # the session in use
    store.blocked.set()
    read.prefetch([], frozenset(), id_set([1]))
    until(lambda: store.fetches == 2, "the read-ahead stuck on the database")
    started = time.monotonic()
    read.close()
    took = time.monotonic() - started
    assert store.interrupted == 1
    assert took < PROMPTLY < CLOSE_SECONDS, f"close took {took:.2f} s"
    assert store.closed_on == "relay-read"


def test_closing_an_idle_reader_cancels_nothing() -> None:
    store = SlowStore()
    read = reader(store)
    assert read.next_batch([], frozenset())
    read.prefetch([], frozenset(), id_set([1]))
    assert read.next_batch([], frozenset())  # the read-ahead, used
    read.close()
    assert store.interrupted == 0
    assert store.closed_on is not None


def test_a_fresh_read_after_a_forgotten_one_waits_for_it() -> None:
    """One session, one statement at a time: the loop may drop a read-ahead still
    running and read afresh at once."""
    store = SlowStore()
    read = reader(store)
    for _ in range(20):
        read.prefetch([], frozenset(), IdSet())
        read.forget()
        assert read.next_batch([], frozenset())
    read.close()
    assert store.most_at_once == 1


def test_a_forgotten_read_ahead_that_failed_other_than_the_store_fails_is_raised() -> None:
    """A bug in a read-ahead (not the database failing) crashes the lane, as it did when
    the read ran on the loop's thread, even when the loop dropped the read meanwhile."""
    store = SlowStore()
    read = reader(store)
    store.failures.append(ValueError("a row the relay cannot decode"))
    read.prefetch([], frozenset(), IdSet())
    read.forget()
    with pytest.raises(ValueError, match="cannot decode"):
        read.next_batch([], frozenset())
    assert read.next_batch([], frozenset())  # raised once; the loop may go on
    read.close()


def test_a_read_ahead_the_store_failed_is_read_again_and_the_failure_reported_there() -> None:
    store = SlowStore()
    read = reader(store)
    store.failures += [StoreError("connection lost"), StoreError("connection refused")]
    read.prefetch([], frozenset(), IdSet())
    with pytest.raises(StoreError, match="refused"):
        read.next_batch([], frozenset())
    assert read.next_batch([], frozenset())
    read.close()


def test_a_stop_requested_while_the_loop_waits_for_a_stuck_read_ends_the_wait() -> None:
    """The loop then stops at once (a store error ends its turn, and the request its
    loop) instead of waiting out the read; closing cancels the read."""
    store = SlowStore()
    shutdown = Shutdown(grace=5.0)
    read = reader(store, shutdown)
    assert read.next_batch([], frozenset())
    store.blocked.set()
    read.prefetch([], frozenset(), id_set([1]))
    until(lambda: store.fetches == 2, "the read-ahead stuck on the database")
    threading.Timer(0.2, shutdown.request).start()
    started = time.monotonic()
    with pytest.raises(StoreError, match="stopping"):
        read.next_batch([], frozenset())
    assert time.monotonic() - started < PROMPTLY
    read.close()
    assert store.interrupted == 1


def test_the_time_the_loop_waits_for_its_reads_is_counted() -> None:
    """relay_read_wait_seconds_total: its rate is the share of the loop's time the
    database's reads hold it up, read ahead or not."""
    store = SlowStore()
    read = reader(store)

    def waited() -> float:
        return REGISTRY.get_sample_value("relay_read_wait_seconds_total", {"lease": "test"}) or 0.0

    assert read.next_batch([], frozenset())
    store.blocked.set()
    read.prefetch([], frozenset(), id_set([1]))
    before = waited()
    threading.Timer(0.3, store.released.set).start()
    assert read.next_batch([], frozenset())
    assert waited() - before >= 0.25
    read.close()


def test_closing_starts_no_statement_queued_behind_a_stuck_read() -> None:
    """The loop dropped a stuck read-ahead and asked for a fresh read, queued behind it;
    then the relay stops. Closing cancels the stuck read and the queued one never starts
    (it would have met the same lock, and held the lease's release). The reader's thread
    is a daemon: a read abandoned at close does not hold the process's exit."""
    store = SlowStore()
    read = reader(store)
    assert read.next_batch([], frozenset())
    store.blocked.set()
    read.prefetch([], frozenset(), id_set([1]))
    ahead = read._last
    until(lambda: store.fetches == 2, "the read-ahead stuck on the database")
    read.forget()
    queued: list[BaseException] = []

    def fresh_read() -> None:
        try:
            read.next_batch([], frozenset())
        except StoreError as exc:
            queued.append(exc)

    waiter = threading.Thread(target=fresh_read)
    waiter.start()
    until(lambda: read._last is not ahead, "a fresh read queued behind it")
    started = time.monotonic()
    read.close()
    assert time.monotonic() - started < PROMPTLY
    waiter.join(PROMPTLY)
    assert store.fetches == 2  # the first read and the read-ahead; not the queued one
    assert [str(exc) for exc in queued] == ["the reader is closing"]
    assert store.on_daemon_threads
