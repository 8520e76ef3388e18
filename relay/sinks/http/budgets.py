"""Each HTTP destination origin's budget, on the sink's loop: its rate limit
(RELAY_HTTP_MAX_REQUESTS_PER_SECOND, or its RELAY_HTTP_TOPIC_URLS entries'
`max_requests_per_second`), its pauses (a 429 or 503 with Retry-After pauses the origin
as a whole), what they cost, and their metrics.

A limited or paused origin must never slow another. A batch is settled once every row
has an outcome, so a row waiting for its origin's budget would hold back every other
origin's rows: those of its batch (settled late) and those of the next. So a row waits
only while the rest of its batch is still being sent, which costs nothing, and then at
most 5 ms more (less than a row sent back and read again costs), or one interval of its
origin (at most 50 ms) when the batch holds no other origin's rows; otherwise it goes
back to the outbox unsent, spending no attempt, to come back about when its origin has
budget again (`Budget.send_away`), its key held meanwhile. With one origin configured
there is no other to slow: rows wait for its budget and out its pauses in the sink, up
to the batch's deadline (past it they stay untouched for the next batch); only a row
that got the 429 or 503 goes back, spending no attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from relay.message import OutboxMessage
from relay.observe.logging import get_logger
from relay.sinks.base import SKIPPED, Outcome, Result
from relay.sinks.http.destinations import Origin, origin_name
from relay.sinks.keyed import Batch, Turn
from relay.sinks.rate_limit import Booking, Budget, RecentRate

log = get_logger("relay.sinks.http")

ORIGIN_RATE = Gauge(
    "relay_http_origin_requests_per_second",
    "HTTP sink requests started to each destination origin in the last second.",
    ["origin"],
)
ORIGIN_LIMIT = Gauge(
    "relay_http_origin_max_requests_per_second",
    "Each destination origin's rate limit in requests a second; 0 for none.",
    ["origin"],
)
ORIGIN_PAUSED = Gauge(
    "relay_http_origin_paused_seconds",
    "Seconds left of each destination origin's pause (a 429 or 503 Retry-After), else 0.",
    ["origin"],
)
BUDGET_WAIT = Counter(
    "relay_http_origin_budget_wait_seconds_total",
    "Seconds rows waited in the HTTP sink for their origin's budget or pause to end.",
    ["origin"],
)
DEFERRED = Counter(
    "relay_http_origin_deferred_rows_total",
    "Rows held back unsent, no attempt spent, by reason: budget (rate limit) or paused.",
    ["origin", "reason"],
)

BUDGET = "budget"
PAUSED = "paused"
# What a wait may add to a batch once nothing else is left in it.
_GRACE_SECONDS = 0.005
# A batch of one origin's rows alone may wait one interval of it for the next, up to
# this: its rows go paced rather than back to the outbox, and what could notice is
# another origin's row committed meanwhile, by that much.
_MAX_PACING_SECONDS = 0.05


@dataclass(eq=False, slots=True)
class _Origin:
    name: str
    budget: Budget
    rate: RecentRate


class OriginBudgets:
    """Every configured origin's budget; `single`: only one origin is configured."""

    def __init__(
        self,
        limits: Mapping[Origin, float | None],
        origin_of: Callable[[OutboxMessage], Origin | None],
        *,
        single: bool,
        retry_cap: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._origin_of = origin_of  # None: the row has no destination
        self._batch_origins: weakref.WeakKeyDictionary[Batch, frozenset[Origin | None]] = (
            weakref.WeakKeyDictionary()
        )
        self._single = single
        self._retry_cap = retry_cap  # RELAY_RETRY_MAX_SECONDS: no row is sent back longer
        self._clock = clock
        self._origins: dict[Origin, _Origin] = {}
        for origin, rate in limits.items():
            state = _Origin(origin_name(origin), Budget(rate), RecentRate())
            self._origins[origin] = state
            ORIGIN_LIMIT.labels(state.name).set(rate or 0.0)
            ORIGIN_RATE.labels(state.name).set_function(_rate_of(state.rate, clock))
            ORIGIN_PAUSED.labels(state.name).set_function(_pause_of(state.budget, clock))
            BUDGET_WAIT.labels(state.name)
            for reason in (BUDGET, PAUSED):
                DEFERRED.labels(state.name, reason)

    async def turn(self, message: OutboxMessage, batch: Batch) -> Result | Turn:
        """Wait for the origin's budget, or hold the row back."""
        origin = self._origin_of(message)
        state = self._origins.get(origin) if origin is not None else None
        if state is None:
            return Turn.IN_LINE  # no destination: the send dead-letters it
        now = self._clock()
        if self._single:
            return await self._wait_alone(state, batch)
        if state.budget.paused_for(now) > 0:
            return self._held_back(state, now, PAUSED)
        booking = state.budget.book(now)
        if booking.at > now:
            if booking.at > batch.deadline:
                state.budget.hand_back(booking)
                return self._held_back(state, now, BUDGET)
            try:
                pacing = self._pacing(state, origin, batch)
                in_time = await self._wait(message, booking, batch, pacing)
            except BaseException:  # cancelled: the publish was abandoned
                state.budget.hand_back(booking)
                raise
            finally:
                BUDGET_WAIT.labels(state.name).inc(max(0.0, self._clock() - now))
            now = self._clock()
            if not in_time or state.budget.paused_for(now) > 0:
                state.budget.hand_back(booking)
                return self._held_back(state, now, BUDGET if not in_time else PAUSED, booking)
        state.budget.started(booking)
        return Turn.IN_LINE if state.budget.rate is None else Turn.NOW

    async def _wait_alone(self, state: _Origin, batch: Batch) -> Result | Turn:
        """The only origin: wait for its budget, and out its pauses, in the sink."""
        began = self._clock()
        try:
            while True:
                now = self._clock()
                booking = state.budget.book(now)
                if booking.at > batch.deadline:
                    state.budget.hand_back(booking)
                    return SKIPPED  # untouched, first in the next batch
                if booking.at > now:
                    try:
                        await asyncio.sleep(booking.at - now)
                    except BaseException:  # cancelled: the publish was abandoned
                        state.budget.hand_back(booking)
                        raise
                if state.budget.paused_for(self._clock()) == 0:
                    state.budget.started(booking)
                    return Turn.IN_LINE if state.budget.rate is None else Turn.NOW
                state.budget.hand_back(booking)  # paused meanwhile: book again after it
        finally:
            BUDGET_WAIT.labels(state.name).inc(max(0.0, self._clock() - began))

    async def starting(self, origin: Origin | None) -> Result | None:
        """A request to `origin` has its slot: wait out any bunching (`Budget.spacing`)
        and let it start (None), or hold it back if the origin was paused meanwhile."""
        state = self._origins.get(origin) if origin is not None else None
        if state is None:
            return None
        began = now = self._clock()
        while (wait := state.budget.spacing(now)) > 0:
            await asyncio.sleep(wait)
            now = self._clock()
        if now > began:
            BUDGET_WAIT.labels(state.name).inc(now - began)
        if state.budget.paused_for(now) > 0:
            return self._held_back(state, now, PAUSED)
        state.budget.starting(now)
        state.rate.record(now)
        return None

    def answered(self, origin: Origin | None, result: Result) -> Result:
        """The answer as the row's outcome. A 429 or 503 with Retry-After (collateral:
        `classify_response`) pauses its origin as a whole, spending no attempt."""
        state = self._origins.get(origin) if origin is not None else None
        if state is None or not (result.collateral and result.retry_after):
            return result
        now = self._clock()
        if state.budget.paused_for(now) == 0:  # once a pause, not once per answer in it
            log.warning(
                "http.origin_paused",
                origin=state.name,
                seconds=round(result.retry_after, 3),
                error=result.error,
            )
        state.budget.pause(now, result.retry_after)
        return Result(
            Outcome.RETRY,
            result.error,
            min(state.budget.send_away(now), self._retry_cap),
            collateral=True,
            reached=True,
        )

    def _pacing(self, state: _Origin, origin: Origin | None, batch: Batch) -> float:
        """How long a row may wait once its batch is idle, beyond the grace."""
        origins = self._batch_origins.get(batch)
        if origins is None:
            origins = frozenset(map(self._origin_of, batch.messages))
            self._batch_origins[batch] = origins
        if origins != {origin}:
            return 0.0
        return min(state.budget.interval, _MAX_PACING_SECONDS)

    async def _wait(
        self, message: OutboxMessage, booking: Booking, batch: Batch, pacing: float
    ) -> bool:
        """Wait until the booking's time; False if the row should go back instead."""
        batch.waiting(message)
        if not batch.idle:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(booking.at - self._clock()):
                    await batch.until_idle()
        left = booking.at - self._clock()
        if left > 0:
            if left > max(pacing, _GRACE_SECONDS):
                return False
            await asyncio.sleep(left)
        return True

    def _held_back(
        self, state: _Origin, now: float, reason: str, booking: Booking | None = None
    ) -> Result:
        DEFERRED.labels(state.name, reason).inc()
        if reason == PAUSED:
            error = f"{state.name} paused by its Retry-After"
        else:
            error = f"{state.name} over its limit of {state.budget.rate:g} requests a second"
        seconds = min(state.budget.send_away(now, booking), self._retry_cap)
        return Result(Outcome.RETRY, error, seconds, collateral=True)


def _rate_of(rate: RecentRate, clock: Callable[[], float]) -> Callable[[], float]:
    return lambda: rate.per_second(clock())


def _pause_of(budget: Budget, clock: Callable[[], float]) -> Callable[[], float]:
    return lambda: budget.paused_for(clock())
