"""Publishing one message at a time per key, keys in parallel, on the sink's own loop.

For a sink whose client is asyncio (HTTP, NATS, RabbitMQ) and that learns each
message's fate from its own answer (a status, a publish ack, a confirm): the next
message of a key starts only after the previous one was acknowledged, so a refused
message is never overtaken by a later one of its key; once one fails, the rest of its
key is `SKIPPED` and goes out after the failed row is settled. The drain loop's call is
synchronous; the sends run on an event loop this class owns (one thread), so hundreds
of keys can be in flight without a thread each.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TypeVar

from relay.logging import get_logger
from relay.message import OutboxMessage
from relay.sinks.base import SKIPPED, OnePhase, Outcome, Result

log = get_logger("relay.sinks.keyed")
T = TypeVar("T")


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
            # A row without a key has no order to keep: it is a chain of its own.
            chain = message.key if message.key is not None else f"\0{index}"
            chains.setdefault(chain, []).append(index)
        slots = asyncio.Semaphore(self._max_in_flight)
        stop_starting = time.monotonic() + self._batch_seconds
        try:
            async with asyncio.TaskGroup() as group:
                for indexes in chains.values():
                    group.create_task(
                        self._deliver_chain(messages, indexes, results, slots, stop_starting)
                    )
        finally:
            done.set()

    async def _deliver_chain(
        self,
        messages: Sequence[OutboxMessage],
        indexes: list[int],
        results: list[Result | None],
        slots: asyncio.Semaphore,
        stop_starting: float,
    ) -> None:
        for index in indexes:
            if time.monotonic() > stop_starting:
                return  # left SKIPPED: unsent, untouched, first in the next batch
            async with slots:
                # Again once a slot is ours: against a server that never answers, the
                # wait for a slot is itself a timeout, and starting then would stretch
                # the batch by one timeout per round of slots.
                if time.monotonic() > stop_starting:
                    return
                try:
                    result = await self.send(messages[index])
                except Exception as exc:
                    # A bug in a send must not take the other keys down with it. An
                    # unknown error's message may quote a header: only its type is kept.
                    log.exception(
                        "sink.unexpected_error", sink=self.name, error_type=type(exc).__name__
                    )
                    result = Result(Outcome.RETRY, f"unexpected error: {type(exc).__name__}")
            results[index] = result
            if result.outcome is not Outcome.ACKED:
                return  # the rest of this key waits for this row to be settled

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
