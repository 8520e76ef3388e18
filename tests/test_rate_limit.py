"""Rate limits per HTTP destination origin, without a server: the budget
(relay/sinks/rate_limit.py) on a fake clock, the per-origin settings, and the keyed
sink's waits (relay/sinks/http/budgets.py) on its own loop with a sink that sends
nowhere."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence
from typing import Any

import pytest

from relay.message import OutboxMessage
from relay.settings import Settings, SettingsError, load_settings
from relay.sinks.base import ACKED, Outcome, Result
from relay.sinks.http.budgets import OriginBudgets
from relay.sinks.http.destinations import Origin, origin_limits
from relay.sinks.http.settings import HttpSettings
from relay.sinks.keyed import Batch, KeyedSink, Slots, Turn
from relay.sinks.rate_limit import Budget, RecentRate

pytestmark = pytest.mark.unit


# --- the budget on a fake clock ------------------------------------------------------


def test_requests_are_spaced_one_interval_apart_and_a_quiet_spell_saves_no_burst() -> None:
    budget = Budget(10.0)
    assert [budget.book(0.0).at for _ in range(3)] == pytest.approx([0.0, 0.1, 0.2])
    # Quiet for a while: one request may go at once, the next one interval later.
    assert [budget.book(5.0).at for _ in range(2)] == pytest.approx([5.0, 5.1])


def test_no_window_of_one_second_holds_more_than_the_rate() -> None:
    """The promise to a receiver that counts requests per second, whatever the arrivals."""
    rng = random.Random(7)
    budget = Budget(40.0)
    starts: list[float] = []
    now = 0.0
    for _ in range(2000):
        now += rng.expovariate(60.0)  # asked for faster than allowed, in bursts
        booking = budget.book(now)
        budget.started(booking)
        starts.append(booking.at)
    starts.sort()
    for index, start in enumerate(starts):
        in_window = sum(1 for s in starts[index : index + 60] if s < start + 1.0 - 1e-9)
        assert in_window <= 40, f"{in_window} requests in the second from {start:.3f}"


def test_requests_that_start_late_do_not_bunch_nor_drift() -> None:
    """A booked request may find its connection slot late and start bunched with the
    next one: real starts are spaced again (less the loop's jitter, which does not add
    up), so any second still holds at most one more than the rate."""
    budget = Budget(10.0)
    budget.starting(0.0)
    assert budget.spacing(0.05) == pytest.approx(0.025)  # 0.1 apart, less 0.025 jitter
    assert budget.spacing(0.08) == 0.0
    budget.starting(0.12)  # late by 0.02: the next may still go at its own 0.2
    assert budget.spacing(0.2) == 0.0
    rng = random.Random(3)
    limited = Budget(40.0)
    starts: list[float] = []
    now = 0.0
    for _ in range(2000):
        now += rng.expovariate(60.0)
        booking = limited.book(now)
        limited.started(booking)
        start = booking.at + rng.choice([0.0, 0.0, rng.uniform(0.0, 0.1)])  # no slot free
        start += limited.spacing(start)
        limited.starting(start)
        starts.append(start)
    starts.sort()
    for index, start in enumerate(starts):
        in_window = sum(1 for s in starts[index : index + 60] if s < start + 1.0 - 1e-9)
        assert in_window <= 41, f"{in_window} requests in the second from {start:.3f}"


def test_bookings_handed_back_at_the_end_of_the_line_free_their_slots() -> None:
    budget = Budget(10.0)
    first, second, third = (budget.book(0.0) for _ in range(3))
    budget.started(first)
    budget.hand_back(second)  # in the middle: the third still stands after it
    assert budget.next_start(0.0) == pytest.approx(0.3)
    budget.hand_back(third)  # now both roll back, in whatever order they came
    assert budget.next_start(0.0) == pytest.approx(0.1)
    budget.hand_back(third)  # twice is once
    assert budget.book(0.0).at == pytest.approx(0.1)


def test_a_booking_handed_back_behind_one_that_started_is_lost_never_double_spent() -> None:
    budget = Budget(10.0)
    early, late = budget.book(0.0), budget.book(0.0)
    budget.started(late)
    budget.hand_back(early)
    # The slot at 0.0 is gone (a request less, never a request too many).
    assert budget.book(0.0).at == pytest.approx(0.2)


def test_a_pause_holds_every_start_and_a_shorter_one_does_not_shorten_it() -> None:
    budget = Budget(None)  # no rate limit: pauses only
    assert budget.book(0.0).at == 0.0 and budget.book(0.0).at == 0.0
    budget.pause(1.0, 5.0)
    budget.pause(2.0, 1.0)
    assert budget.paused_for(2.0) == pytest.approx(4.0)
    assert budget.book(3.0).at == pytest.approx(6.0)
    assert budget.paused_for(6.0) == 0.0
    limited = Budget(2.0)
    limited.pause(0.0, 3.0)
    assert [limited.book(1.0).at for _ in range(2)] == pytest.approx([3.0, 3.5])


def test_rows_sent_away_queue_up_at_the_rate_behind_each_other() -> None:
    budget = Budget(10.0)
    budget.book(0.0)  # the budget's next free start is 0.1
    assert [budget.send_away(0.0) for _ in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    # Asked later, a row's delay is shorter by the time passed: the rows still come due
    # one interval apart (0.4, 0.5), whenever each was sent away.
    assert [budget.send_away(at) for at in (0.03, 0.07)] == pytest.approx([0.37, 0.43])
    # A row whose booking was handed back keeps its place if the queue is not past it.
    later = Budget(10.0)
    waiting = [later.book(0.0) for _ in range(6)]  # 0.0 .. 0.5
    for booking in waiting[2:]:
        later.hand_back(booking)
    assert [later.send_away(0.0, b) for b in waiting[2:]] == pytest.approx([0.2, 0.3, 0.4, 0.5])
    assert later.send_away(0.0) == pytest.approx(0.6)  # behind them
    # An origin without a limit: the rows sent away during a pause come back at its end.
    paused = Budget(None)
    paused.pause(0.0, 2.0)
    assert [paused.send_away(0.5) for _ in range(3)] == pytest.approx([1.5, 1.5, 1.5])


def test_the_recent_rate_counts_the_last_second() -> None:
    rate = RecentRate()
    for _ in range(5):
        rate.record(100.05)
    for _ in range(3):
        rate.record(100.55)
    assert rate.per_second(100.6) == 8
    assert rate.per_second(101.04) == 3  # the first 100 ms left the window
    assert rate.per_second(103.0) == 0


def test_a_timed_send_takes_the_next_slot_first_while_such_hold_under_half() -> None:
    async def scenario() -> list[str]:
        slots = Slots(2)  # half: one slot may be taken by going first
        order: list[str] = []
        release = asyncio.Event()

        async def send(name: str, turn: Turn, hold: bool = False) -> None:
            async with slots.take(turn):
                order.append(name)
                if hold:
                    await release.wait()

        busy = [asyncio.create_task(send(f"busy{n}", Turn.IN_LINE, hold=True)) for n in (1, 2)]
        await asyncio.sleep(0)
        waiting = [
            asyncio.create_task(send(name, turn))
            for name, turn in (
                ("a", Turn.IN_LINE),
                ("b", Turn.IN_LINE),
                ("timed1", Turn.NOW),
                ("timed2", Turn.NOW),  # one already waits to go first: in line
            )
        ]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*busy, *waiting)
        return order

    assert asyncio.run(scenario()) == ["busy1", "busy2", "timed1", "a", "b", "timed2"]


# --- settings ----------------------------------------------------------------------

BASE = {"database_url": "postgresql://h/db", "sink": "http", "http_url": "https://a.example/in"}


def limits(**values: Any) -> dict[Origin, float | None]:
    return origin_limits(load_settings(Settings, **BASE, **values).sink_options(HttpSettings))


def test_each_origin_gets_the_default_limit_or_its_entries_own() -> None:
    found = limits(
        http_max_requests_per_second=40,
        http_topic_urls={
            "billing": {"url": "https://b.example/1", "max_requests_per_second": 5},
            "refunds": {"url": "https://b.example:443/2", "max_requests_per_second": 5.0},
            "audit": "https://c.example/in",
        },
    )
    assert found == {
        ("https", "a.example", 443): 40.0,
        ("https", "b.example", 443): 5.0,
        ("https", "c.example", 443): 40.0,
    }
    assert set(limits().values()) == {None}  # unset: no limit anywhere


@pytest.mark.parametrize(
    ("values", "variable"),
    [
        ({"http_max_requests_per_second": 0}, "RELAY_HTTP_MAX_REQUESTS_PER_SECOND"),
        ({"http_max_requests_per_second": -3}, "RELAY_HTTP_MAX_REQUESTS_PER_SECOND"),
        ({"http_max_requests_per_second": "fast"}, "RELAY_HTTP_MAX_REQUESTS_PER_SECOND"),
        ({"http_max_requests_per_second": 1e9}, "RELAY_HTTP_MAX_REQUESTS_PER_SECOND"),
        (
            {"http_topic_urls": {"t": {"url": "https://b/x", "max_requests_per_second": 0}}},
            "RELAY_HTTP_TOPIC_URLS",
        ),
        (
            {
                "http_topic_urls": {
                    "one": {"url": "https://b/x", "max_requests_per_second": 5},
                    "two": {"url": "https://b/y", "max_requests_per_second": 6},
                }
            },
            "RELAY_HTTP_TOPIC_URLS",
        ),
    ],
)
def test_a_bad_limit_stops_start_up_naming_its_setting(
    values: dict[str, Any], variable: str
) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **BASE, **values)
    assert err.value.name == variable


def test_entries_on_one_origin_that_disagree_are_named_by_topic() -> None:
    with pytest.raises(SettingsError) as err:
        limits(
            http_topic_urls={
                "one": {"url": "https://b.example/x", "max_requests_per_second": 5},
                "two": {"url": "https://b.example/y", "max_requests_per_second": 6},
            }
        )
    assert "'one' and 'two'" in err.value.message


# --- waits in the keyed sink, on its own loop ----------------------------------------

LIMITED: Origin = ("http", "limited", 80)
OTHER: Origin = ("http", "other", 80)


class NowhereSink(KeyedSink):
    """Sends nothing: each row "takes" a fixed time and is acknowledged; topic = origin."""

    name = "nowhere"

    def __init__(self, rates: dict[Origin, float | None], seconds: float = 0.005) -> None:
        self.budgets = OriginBudgets(rates, _origin, single=len(rates) == 1, retry_cap=300.0)
        self.sent: list[tuple[str, float]] = []
        self._seconds = seconds
        super().__init__(max_in_flight=8, batch_seconds=5.0)

    async def turn(self, message: OutboxMessage, batch: Batch) -> Result | Turn:
        return await self.budgets.turn(message, batch)

    async def send(self, message: OutboxMessage) -> Result:
        held = await self.budgets.starting(_origin(message))
        if held is not None:
            return held
        self.sent.append((message.topic, time.monotonic()))
        await asyncio.sleep(self._seconds)
        return ACKED


def _origin(message: OutboxMessage) -> Origin:
    return LIMITED if message.topic == "limited" else OTHER


def batch_of(topics: Sequence[str]) -> list[OutboxMessage]:
    return [
        OutboxMessage(n, f"m{n}", topic, f"{topic}-{n}", b"", None, None, "", 0.0, 0)
        for n, topic in enumerate(topics)
    ]


def published(sink: KeyedSink, messages: list[OutboxMessage]) -> tuple[list[Result], float]:
    started = time.monotonic()
    try:
        return sink.publish(messages, lambda: False), time.monotonic() - started
    finally:
        sink.close()


def test_a_limited_origin_sends_the_rest_back_spaced_and_never_holds_the_batch() -> None:
    """40 rows of an origin limited to 20 a second beside 40 of another: the batch
    takes about what the other origin's rows take (not 2 s), the limited rows that did
    not get budget meanwhile come back unsent, no attempt spent, a twentieth of a
    second apart."""
    sink = NowhereSink({LIMITED: 20.0, OTHER: None}, seconds=0.02)
    results, _elapsed = published(sink, batch_of(["limited", "other"] * 40))
    limited = results[0::2]
    assert all(r is ACKED for r in results[1::2])
    # The batch did not wait for the limited origin's budget: what had none came back.
    back = [r for r in limited if r.outcome is Outcome.RETRY]
    assert back and all(r.collateral and not r.reached for r in back)
    sent = [at for topic, at in sink.sent if topic == "limited"]
    assert len(sent) + len(back) == 40
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    # An interval apart, less the event loop's jitter a start may be early by (a quarter).
    assert all(gap >= 0.05 * 0.75 - 0.001 for gap in gaps), gaps
    # Each comes due an interval after the one before (on a fake clock:
    # test_rows_sent_away_queue_up_at_the_rate_behind_each_other); each delay is counted
    # from when its row was sent away, a little later than the one before, so the
    # delays grow, by an interval at most.
    delays = [r.retry_after or 0.0 for r in back]
    assert delays == sorted(delays)
    assert all(b - a <= 0.05 + 1e-9 for a, b in itertools.pairwise(delays)), delays


def test_with_one_origin_rows_wait_for_their_budget_in_the_sink() -> None:
    sink = NowhereSink({LIMITED: 50.0})
    results, _elapsed = published(sink, batch_of(["limited"] * 10))
    assert results == [ACKED] * 10
    sent = [at for _, at in sink.sent]
    assert all(b - a >= 0.02 * 0.75 - 0.001 for a, b in itertools.pairwise(sent))


def test_a_paused_origin_sends_nothing_and_its_rows_wait_out_the_pause() -> None:
    sink = NowhereSink({LIMITED: None, OTHER: None})
    sink.budgets.answered(LIMITED, Result(Outcome.RETRY, "HTTP 429", 30.0, collateral=True))
    results, _ = published(sink, batch_of(["limited", "other"] * 3))
    assert [topic for topic, _ in sink.sent] == ["other"] * 3
    for held in results[0::2]:
        assert (held.outcome, held.collateral) == (Outcome.RETRY, True)
        assert held.retry_after == pytest.approx(30.0, abs=0.5)
