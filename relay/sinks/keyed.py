"""Publishing one message at a time per key, keys in parallel, on the sink's own loop.

For a sink whose client is asyncio (HTTP, NATS, RabbitMQ) and that learns each
message's fate from its own answer (a status, a publish ack, a confirm): the next
message of a key starts only after the previous one was acknowledged, so a refused
message is never overtaken by a later one of its key; once one fails, the rest of its
key is `SKIPPED` and goes out after the failed row is settled. The drain loop's call is
synchronous; the sends run on an event loop this class owns (one thread), so hundreds
of keys can be in flight without a thread each.

A sink may make a message wait its turn before it takes one of the in-flight slots
(`turn`: the HTTP sink's rate limits), told by `Batch` whether the batch has other work
still: a wait while it has costs the batch nothing. A message whose turn came at a
set time takes the next free slot before those in line: behind them it would start
late, bunched with the next one of its turn.

Long: keys, slots and turns are one scheduler on one event loop; split, each
invariant (a key's order, a slot's release, a turn's time) would span modules.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import enum
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TypeVar

from relay.message import OutboxMessage
from relay.observe.logging import get_logger
from relay.sinks.base import SKIPPED, OnePhase, Outcome, Result

log = get_logger("relay.sinks.keyed")
T = TypeVar("T")


class Turn(enum.Enum):
    IN_LINE = "in_line"  # take a slot when one is free, first come first served
    NOW = "now"  # its set time came (a rate limit's): the next free slot is its


class Slots:
    """The in-flight slots of one publish: first come, first served, except for sends
    whose turn came at a set time (`Turn.NOW`), which go first while such sends hold
    fewer than half the slots (a limit that allows more than the slots can carry must
    not crowd every other send out)."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._first_cap = max(1, count // 2)
        self._first_held = 0  # slots taken by going first, or waiting to
        self._first: deque[asyncio.Future[None]] = deque()
        self._in_line: deque[asyncio.Future[None]] = deque()

    @contextlib.asynccontextmanager
    async def take(self, turn: Turn) -> AsyncIterator[None]:
        first = turn is Turn.NOW and self._first_held < self._first_cap
        if first:
            self._first_held += 1
        try:
            await self._acquire(self._first if first else self._in_line)
            try:
                yield
            finally:
                self._release()
        finally:
            if first:
                self._first_held -= 1

    async def _acquire(self, line: deque[asyncio.Future[None]]) -> None:
        if self._free > 0 and not (self._first or self._in_line):
            self._free -= 1
            return
        granted = asyncio.get_running_loop().create_future()
        line.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # handed a slot just as it was cancelled: pass it on
            else:
                line.remove(granted)
            raise

    def _release(self) -> None:
        for line in (self._first, self._in_line):
            while line:
                waiter = line.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the slot goes straight to it
                    return
        self._free += 1


def chain_of(message: OutboxMessage) -> str:
    """The chain a message is sent in: its key's; a row without a key has no order to
    keep and is a chain of its own."""
    return message.key if message.key is not None else f"\0{message.id}"


class Batch:
    """One publish as a send waiting its turn sees it: its deadline, and whether it is
    busy: whether a key that never waited for a turn still has rows to send. The sends
    of a key that waited are what waiting brings: they do not keep the batch busy (a
    limited origin's own paced requests would otherwise keep its waits "free")."""

    def __init__(self, messages: Sequence[OutboxMessage], chains: int, deadline: float) -> None:
        self.messages = messages
        self.deadline = deadline  # no send starts after it
        self._busy = chains
        self._waited: set[str] = set()
        self._idle = asyncio.Event()
        self._update()

    @property
    def idle(self) -> bool:
        return self._busy == 0

    async def until_idle(self) -> None:
        await self._idle.wait()

    def waiting(self, message: OutboxMessage) -> None:
        """`message` waits for its turn: its key keeps the batch busy no more."""
        self._not_busy(chain_of(message))

    def chain_done(self, chain: str) -> None:
        self._not_busy(chain)

    def _not_busy(self, chain: str) -> None:
        if chain not in self._waited:
            self._waited.add(chain)
            self._busy -= 1
            self._update()

    def _update(self) -> None:
        if self._busy == 0:
            self._idle.set()
        else:
            self._idle.clear()


class KeyedSink(OnePhase, abc.ABC):
    """Subclasses implement `send` (one message, its outcome) and may override `start`
    and `stop` (open and close the client, on the loop)."""

    name: str
    serial_per_key = True

    def __init__(self, *, max_in_flight: int, batch_seconds: float) -> None:
        # No new send starts after `batch_seconds`: a key with many rows must not hold
        # the batch (and every other key's acks) for rows x latency; the rest go next.
        self._max_in_flight = max_in_flight
        self._batch_seconds = batch_seconds
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"relay-{self.name}", daemon=True
        )
        self._thread.start()

    @property
    def max_publish_seconds(self) -> float:
        # Past `batch_seconds` no send starts; one already started is bounded by the
        # sink's own timeout, which subclasses keep below another `batch_seconds`.
        return 2 * self._batch_seconds

    def on_loop(self, coro: Coroutine[object, object, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[object, object, T], timeout: float) -> T:
        """Run `coro` on the sink's loop and wait for it (from another thread)."""
        future = self.on_loop(coro)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.name}: no answer within {timeout:g}s") from None

    @abc.abstractmethod
    async def send(self, message: OutboxMessage) -> Result:
        """Deliver one message and return its outcome; never raise."""

    async def turn(self, message: OutboxMessage, batch: Batch) -> Result | Turn:
        """Wait until `message` may be sent (its `Turn`), or return its outcome unsent
        (a row sent back to wait its turn later). Runs before the message takes an
        in-flight slot, so a wait holds no other key up."""
        return Turn.IN_LINE

    async def stop(self) -> None:
        """Close the client (on the loop), after every send was cancelled."""
        return

    # --- publishing ---

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.publish() after close()")
        if abandon():  # the lease went while the batch was read: send none of it
            return [SKIPPED] * len(messages)
        results: list[Result | None] = [None] * len(messages)
        done = threading.Event()
        future = self.on_loop(self._deliver(messages, results, done))
        while True:
            try:
                future.result(timeout=0.05)
                break
            except concurrent.futures.TimeoutError:
                if abandon():
                    # Lease gone or shutdown overdue: stop now. Sends cut off may still
                    # have landed; their rows stay unsent (a duplicate, never a loss).
                    future.cancel()
                    if not done.wait(2.0):
                        log.warning("sink.cancel_slow", sink=self.name, pending=results.count(None))
                    break
            except concurrent.futures.CancelledError:
                break
        return [SKIPPED if result is None else result for result in list(results)]

    async def _deliver(
        self,
        messages: Sequence[OutboxMessage],
        results: list[Result | None],
        done: threading.Event,
    ) -> None:
        chains: dict[str, list[int]] = {}
        for index, message in enumerate(messages):
            chains.setdefault(chain_of(message), []).append(index)
        slots = Slots(self._max_in_flight)
        batch = Batch(messages, len(chains), time.monotonic() + self._batch_seconds)
        try:
            async with asyncio.TaskGroup() as group:
                for chain, indexes in chains.items():
                    group.create_task(
                        self._deliver_chain(chain, messages, indexes, results, slots, batch)
                    )
        finally:
            done.set()

    async def _deliver_chain(
        self,
        chain: str,
        messages: Sequence[OutboxMessage],
        indexes: list[int],
        results: list[Result | None],
        slots: Slots,
        batch: Batch,
    ) -> None:
        try:
            for index in indexes:
                result = await self._deliver_one(messages[index], slots, batch)
                if result is None:
                    return  # left SKIPPED: unsent, untouched, first in the next batch
                results[index] = result
                if result.outcome is not Outcome.ACKED:
                    return  # the rest of this key waits for this row to be settled
        finally:
            batch.chain_done(chain)

    async def _deliver_one(
        self, message: OutboxMessage, slots: Slots, batch: Batch
    ) -> Result | None:
        """The message's outcome; None if it was not sent because the batch is over."""
        if time.monotonic() > batch.deadline:
            return None
        try:
            turn = await self.turn(message, batch)
            if isinstance(turn, Result):
                return turn  # not sent: back to the outbox, or left for the next batch
            async with slots.take(turn):
                # Again once a slot is ours: against a server that never answers, the
                # wait for a slot is itself a timeout, and starting then would stretch
                # the batch by one timeout per round of slots.
                if time.monotonic() > batch.deadline:
                    return None
                return await self.send(message)
        except Exception as exc:
            # A bug in a send must not take the other keys down with it. An unknown
            # error's message may quote a header: only its type is kept.
            log.exception("sink.unexpected_error", sink=self.name, error_type=type(exc).__name__)
            return Result(Outcome.RETRY, f"unexpected error: {type(exc).__name__}")

    # --- shutting down ---

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.on_loop(self._wind_down()).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _wind_down(self) -> None:
        """Cancel what an abandoned publish left running, then close the client."""
        current = asyncio.current_task()
        leftovers = [task for task in asyncio.all_tasks() if task is not current]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        await self.stop()
