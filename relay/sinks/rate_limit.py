"""A request budget per destination: a rate limit, pauses, and where rows sent away queue.

Pure: every method takes `now` (monotonic seconds), so it is tested on a fake clock.

The limit is GCRA, the virtual-scheduling form of a token bucket, with a burst of one:
requests are booked 1/rate apart, so a receiver that counts requests in any window of
one second sees the rate, and at most one more where a request started a little early
after one that started late (`spacing`: real starts are kept apart too, less a quarter
interval of event-loop jitter that must not add up). A larger burst would let the
first second after a quiet spell carry rate + burst requests, which is what a receiver
limited to "N a second" answers with 429s.

A request is *booked*: it gets the earliest time it may start, and the budget moves on
by one interval. A booking can be handed back (the row was sent away rather than wait):
bookings handed back at the end of the line roll the budget back, so a row sent away
costs the others nothing; one handed back from the middle of the line is lost (a slot
unused, never a request too many).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field


class _State(enum.Enum):
    PENDING = 1
    STARTED = 2
    HANDED_BACK = 3


@dataclass(eq=False, slots=True)
class Booking:
    """One request's place in its origin's budget."""

    at: float  # when it may start
    before: float = field(repr=False)  # the budget's next start before this booking
    state: _State = field(default=_State.PENDING, repr=False)
    in_line: bool = field(default=True, repr=False)  # may still be rolled back


class Budget:
    """One origin's budget: `rate` requests a second (None: no limit, pauses only)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._interval = 0.0 if rate is None else 1.0 / rate
        self._next = -math.inf  # GCRA's theoretical arrival time: the next free start
        self._paused_until = -math.inf
        self._queue_end = -math.inf  # where the next row sent away joins the queue
        self._next_actual = -math.inf  # the same GCRA over when requests really started
        # What a real start may be early by: the event loop's timing jitter, absorbed so
        # that it does not add up from one request to the next.
        self._jitter = max(self._interval / 4, 0.002) if rate is not None else 0.0
        self._bookings: deque[Booking] = deque()  # oldest first; only what may roll back

    @property
    def interval(self) -> float:
        """Seconds between two requests (0: no limit)."""
        return self._interval

    def paused_for(self, now: float) -> float:
        """Seconds left of a pause (Retry-After), 0 if none."""
        return max(0.0, self._paused_until - now)

    def pause(self, now: float, seconds: float) -> None:
        """No request starts for `seconds` (a longer pause already set stands)."""
        self._paused_until = max(self._paused_until, now + seconds)

    def next_start(self, now: float) -> float:
        """When one more request could start."""
        return max(now, self._next, self._paused_until)

    def book(self, now: float) -> Booking:
        at = self.next_start(now)
        booking = Booking(at, self._next)
        self._next = at + self._interval
        self._bookings.append(booking)
        return booking

    def started(self, booking: Booking) -> None:
        """The request went (or is about to): its slot is spent for good, and no
        booking before it can be rolled back any more."""
        booking.state = _State.STARTED
        while booking.in_line:
            self._bookings.popleft().in_line = False

    def hand_back(self, booking: Booking) -> None:
        """The request will not go: free its slot once no later booking stands on it."""
        if booking.state is not _State.PENDING:
            return
        booking.state = _State.HANDED_BACK
        while self._bookings and self._bookings[-1].state is _State.HANDED_BACK:
            last = self._bookings.pop()
            last.in_line = False
            self._next = last.before

    def spacing(self, now: float) -> float:
        """Seconds a request about to start must still wait so that real starts stay
        about one interval apart: bookings are, but a request may find its connection
        slot late (all busy) and start bunched with the next one."""
        return max(0.0, self._next_actual - self._jitter - now)

    def starting(self, now: float) -> None:
        """A request really starts now."""
        self._next_actual = max(self._next_actual, now) + self._interval

    def send_away(self, now: float, booking: Booking | None = None) -> float:
        """Seconds until a row that will not wait should come back. Rows sent away
        queue one interval apart, after the budget's next free start or at the place
        their handed-back booking had, so they come back about as fast as the budget
        takes them, not all at once to be sent away again."""
        if booking is None:
            start = self.next_start(now)
        else:  # not next_start: later bookings still waiting may stand after it
            start = max(booking.at, now, self._paused_until)
        at = max(self._queue_end, start)
        self._queue_end = at + self._interval
        return at - now


class RecentRate:
    """Requests started in about the last second (ten buckets of 100 ms), read from
    another thread (a scrape): a torn read is off by a request, never an error. The
    drain's pacer (relay/drain/pacer.py) counts messages and bytes with it, `count` at once."""

    _BUCKETS = 10
    _WIDTH = 0.1

    def __init__(self) -> None:
        self._counts = [0] * self._BUCKETS
        self._slots = [-self._BUCKETS] * self._BUCKETS  # which 100 ms each bucket counts

    def record(self, now: float, count: int = 1) -> None:
        slot = int(now / self._WIDTH)
        index = slot % self._BUCKETS
        if self._slots[index] != slot:
            self._slots[index] = slot
            self._counts[index] = 0
        self._counts[index] += count

    def per_second(self, now: float) -> float:
        slot = int(now / self._WIDTH)
        return float(
            sum(
                count
                for count, counted in zip(self._counts, self._slots, strict=True)
                if slot - counted < self._BUCKETS
            )
        )
