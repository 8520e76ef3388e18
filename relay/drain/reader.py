"""The drain's reading side (docs/DESIGN.md, "Draining"): the next batch in id order,
fair across keys, read ahead on its own thread while the loop publishes the batch
before it, and the scheduled rows let in when due. It owns the drain's session (a
`ReadStore`) and where the rounds over keys stand; the loop tells it which rows are
unsettled and which keys are held back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import partial
from typing import Any, ParamSpec, TypeVar

from relay import failpoints
from relay.drain.batch import BatchLimits, IdSet
from relay.drain.pauses import Pauses
from relay.drain.session_thread import SessionThread
from relay.drain.sizing import BatchSizer
from relay.lease.protocol import Shard
from relay.message import OutboxMessage
from relay.observe import metrics
from relay.observe.logging import get_logger
from relay.shutdown import Shutdown
from relay.store.port import FetchRequest, Promoted, ReadStore, StoreError

LeftOut = tuple[IdSet, ...]  # the rows every fetch leaves out: published, not settled

log = get_logger("relay.drain")

P = ParamSpec("P")
T = TypeVar("T")

ONE_LANE = Shard("default")  # a reader's lane when none is given (tests)

# How long closing waits for a read still running (cancelling it again every
# CANCEL_AGAIN_SECONDS), and how often a wait for a read looks whether the relay is
# stopping.
CLOSE_SECONDS = 5.0
CANCEL_AGAIN_SECONDS = 0.5
STOP_CHECK_SECONDS = 0.1

# While a busy key fills whole batches alone (Kafka), how often the fetch looks past the
# head for other keys: the fair statement costs a few times the plain one.
LOOK_FOR_OTHERS_SECONDS = 0.1


def without(rows: list[OutboxMessage], held: frozenset[str]) -> list[OutboxMessage]:
    """`rows` minus those of the keys held back."""
    if not held:
        return rows
    return [m for m in rows if m.key is None or m.key not in held]


# The pass for scheduled rows runs at least this often, whatever the idle poll: it also
# moves rows the app scheduled for later out of the outbox, and until it does the
# fetch's walk in id order steps over them.
SCHEDULE_PASS_SECONDS = 1.0


@dataclass(slots=True)
class Prefetched:
    """The next batch, being read (or read) while the one before it is published."""

    rows: Future[list[OutboxMessage] | None]  # None: the read failed
    asked: int  # the rows its fetch asked for at most
    # Keys whose failures may not be written yet: the batches in flight at the read,
    # and those whose rows failed since.
    held: frozenset[str]


class Reader:
    """Owned by the drain loop's thread; its session is used on the reader's own
    thread alone, one statement after the other (the read-ahead, then whatever the
    loop asks), and so is where the rounds stand."""

    def __init__(
        self,
        store: ReadStore,
        limits: BatchLimits,
        poll_max_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        shard: Shard = ONE_LANE,
        shutdown: Shutdown | None = None,
    ) -> None:
        self._store = store
        self.limits = limits  # the most a batch may be; each fetch asks for `_sizer.rows`
        self._sizer = BatchSizer(limits.rows)
        self._asked = limits.rows  # what the fetch of the batch last handed out asked for
        self._limit_gauge = metrics.BATCH_LIMIT.labels(shard.name)
        self._limit_gauge.set(self._sizer.rows)
        self._poll_max = poll_max_seconds
        self._clock = clock
        self._shutdown = shutdown  # once requested, waiting for a read is over
        self._waited = metrics.READ_WAIT.labels(shard.name)
        self._session_thread = SessionThread(shard.thread_name("read"))
        self._closing = False  # set by close(): a step not started yet does not start
        self._prefetched: Prefetched | None = None  # being read or read, not published yet
        self._dropped: Future[list[OutboxMessage] | None] | None = None  # a read forgotten
        self._last: Future[Any] | None = None  # the last statement handed to the thread
        self._after_key: int | None = None  # where the next round over keys starts
        self._after_group: str | None = None  # ... over fairness groups
        self._look_for_others_at = 0.0
        self._promote_at = 0.0  # when to look for scheduled rows that are due
        # The topics paused (`relay pause`), as the last pass read them: their rows
        # are parked, not published.
        self.pauses = Pauses(shard.name, clock)
        self._released = 0  # rows the last pass let go

    # --- the batches ---

    def next_batch(self, unsettled: list[IdSet], held: frozenset[str]) -> list[OutboxMessage]:
        """The prefetched batch, or a fresh fetch; minus the keys held back.
        `unsettled`: the ids every fetch leaves out."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            rows = self._result(prefetched.rows)
            batch = without(rows, held | prefetched.held) if rows is not None else []
            if batch:
                self._asked = prefetched.asked
                return batch
        self._asked = asked = self._sizer.rows
        return without(self._on_session(self._fetch, tuple(unsettled), held, asked), held)

    def published(self, rows: int, seconds: float) -> None:
        """The batch last handed out, `rows` of it published, took `seconds`: the next
        fetches ask for about what the sink publishes in 0.4 s."""
        self._sizer.published(rows, self._asked, seconds)
        self._limit_gauge.set(self._sizer.rows)

    def prefetch(self, unsettled: list[IdSet], held: frozenset[str], publishing: IdSet) -> None:
        """Start reading the batch after the one being published (`publishing`, its
        ids), on the reader's thread: the read overlaps the publish and its
        acknowledgements.

        It leaves out every row not yet settled, and remembers the keys held back: when
        the prefetched rows are published, the failures of those batches may still be
        unwritten.
        """
        asked = self._sizer.rows
        read = self._submit(self._read_ahead, (*unsettled, publishing), held, asked)
        self._prefetched = Prefetched(read, asked, held)

    def _read_ahead(
        self, left_out: LeftOut, held: frozenset[str], rows: int
    ) -> list[OutboxMessage] | None:
        failpoints.stall("read_ahead")
        try:
            return self._fetch(left_out, held, rows)
        except StoreError:
            return None  # the next step's own fetch will meet (and report) the same trouble

    def hold(self, keys: frozenset[str]) -> None:
        """The prefetched rows were read before these keys' failures are written (or
        before their rows straggled): hold those keys back from them too."""
        if self._prefetched is not None:
            self._prefetched.held |= keys

    def forget(self) -> None:
        """Drop the read-ahead (a read still running ends unused on the reader's
        thread): it is read again once the loop goes on."""
        if self._prefetched is not None:
            self._dropped = self._prefetched.rows
        self._prefetched = None

    def _on_session(self, step: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `step` on the reader's thread, after any read-ahead still running. A
        read-ahead dropped unused that failed other than as the store fails (a bug, a
        setting found wrong on reconnect) raises here: forgetting it must not hide it."""
        result = self._result(self._submit(step, *args, **kwargs))
        dropped, self._dropped = self._dropped, None
        if dropped is not None:
            dropped.result()  # done: it ran before `step`
        return result

    def _result(self, read: Future[T]) -> T:
        """What `read` returns, once it has; a StoreError if the relay is stopping
        first: a read stuck on the database does not hold the loop (and so the lease's
        release) for its statement timeout; closing cancels it."""
        started = time.perf_counter()
        try:
            while True:
                try:
                    return read.result(timeout=STOP_CHECK_SECONDS)
                except TimeoutError:
                    if self._shutdown is not None and self._shutdown.requested:
                        raise StoreError(
                            "the relay is stopping: a read still running is left"
                        ) from None
        finally:
            self._waited.inc(time.perf_counter() - started)

    def _submit(self, step: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        if self._closing:  # the thread takes no more steps
            closed: Future[T] = Future()
            closed.set_exception(StoreError("the reader is closing"))
            return closed
        future = self._session_thread.submit(self._unless_closing, partial(step, *args, **kwargs))
        self._last = future
        return future

    def _unless_closing(self, step: Callable[[], T]) -> T:
        if self._closing:
            raise StoreError("the reader is closing")
        return step()

    def _fetch(self, left_out: LeftOut, held: frozenset[str], rows: int) -> list[OutboxMessage]:
        started = time.perf_counter()
        try:
            return self._rounds(left_out, held, self.limits.sized(rows))
        finally:
            metrics.FETCH_SECONDS.observe(time.perf_counter() - started)

    def _rounds(
        self, left_out: LeftOut, held: frozenset[str], limits: BatchLimits
    ) -> list[OutboxMessage]:
        # A round over keys that met only held-back keys comes back empty: go on from
        # where it stopped at once (a few rounds) rather than idle-wait between them.
        for _ in range(4):
            share = self._clock() >= self._look_for_others_at
            rounds = (self._after_key, self._after_group, share)
            fetched = self._store.fetch(
                FetchRequest(limits, left_out, held, *rounds, self.pauses.topics)
            )
            if fetched.fair:  # a head that needed no sharing says nothing of the round
                self._after_key = fetched.walked_to
                self._after_group = fetched.walked_group
            if fetched.alone:
                # A key drains alone: look for others only every so often, so a lone
                # hot key keeps the cheap fetch (they wait this much longer at most).
                self._look_for_others_at = self._clock() + LOOK_FOR_OTHERS_SECONDS
            if (
                fetched.messages
                or not fetched.fair
                or (fetched.walked_to, fetched.walked_group) == (None, None)
            ):
                break
        return fetched.messages

    # --- scheduled rows ---

    def promote_due(self) -> int:
        """Scheduled delivery: let the rows that are due into the drain, at most a batch
        a pass, then note when to look again: at once if a batch was due, at the next
        row's time, and at most a longest idle poll away (the app may schedule an
        earlier row meanwhile). Before the fetch, so a row due now is in the next one
        read. How many were let in."""
        if self._clock() < self._promote_at:
            return 0
        promoted = self._on_session(self._pass)
        wait = min(self._poll_max, SCHEDULE_PASS_SECONDS)
        if promoted.rows >= self.limits.rows:
            wait = 0.0
        elif promoted.next_due_in is not None:
            wait = min(wait, max(0.0, promoted.next_due_in))
        self._promote_at = self._clock() + wait
        if promoted.rows:
            metrics.SCHEDULED_PROMOTED.inc(promoted.rows)
        return promoted.rows + self._released

    def _pass(self) -> Promoted:
        """On the reader's thread: the pauses read, the rows of a pause that is over
        let go, the scheduled rows let in."""
        self._released = self.pauses.refresh(self._store)
        return self._store.promote_due(self.limits.rows)

    def next_due_in(self) -> float:
        """Seconds until the next look for due rows (0: now)."""
        return max(0.0, self._promote_at - self._clock())

    def look_for_due_rows(self) -> None:
        """A NOTIFY may announce a row scheduled sooner than any we knew of."""
        self._promote_at = 0.0

    # --- the session ---

    def close(self) -> None:
        """Close the session on the reader's thread. A read still running (ahead, or
        one the loop left waiting for when it was stopped) is cancelled first, and the
        wait is bounded: a stuck read must not hold up the lease's release (it ends, at
        the latest, at the session's statement timeout)."""
        self._prefetched = None
        self._closing = True
        closed = self._session_thread.submit(self._store.close)
        self._session_thread.stop()
        deadline = time.monotonic() + CLOSE_SECONDS
        while not closed.done():  # the close runs after every step handed over before it
            if self._last is not None and not self._last.done():
                self._store.interrupt()  # again: a step may have started as one ended
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("drain.read_abandoned", waited_s=CLOSE_SECONDS)
                return
            wait([closed], min(left, CANCEL_AGAIN_SECONDS))
