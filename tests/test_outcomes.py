"""The outcome policy (relay/drain/outcomes.py): pure, no database, no sink."""

from __future__ import annotations

import pytest

from relay.backoff import Backoff, retry_delay
from relay.drain.outcomes import decide
from relay.drain.stragglers import Stragglers
from relay.message import OutboxMessage
from relay.sinks.base import ACKED, IN_FLIGHT, SKIPPED, Outcome, Result

pytestmark = pytest.mark.unit


def row(row_id: int, key: str | None = "k", attempts: int = 0) -> OutboxMessage:
    return OutboxMessage(
        row_id, f"m{row_id}", "t", key, b"", None, None, "2026-11-23T00:00:00Z", 0.0, attempts
    )


def delay(attempts: int, retry_after: float | None) -> float:
    return retry_after if retry_after is not None else float(attempts)


def test_each_outcome_lands_where_the_policy_says() -> None:
    batch = [row(1), row(2), row(3, attempts=4), row(4), row(5)]
    results = [
        ACKED,
        Result(Outcome.RETRY, "HTTP 500", retry_after=7.0),
        Result(Outcome.RETRY, "HTTP 500"),  # its fifth attempt: out of attempts
        Result(Outcome.DEAD, "HTTP 400"),
        SKIPPED,
    ]
    decision = decide(batch, results, max_attempts=5, retry_delay=delay)
    settlement = decision.settlement
    assert settlement.sent == [1]
    assert (settlement.retry_ids, settlement.retry_delays) == ([2], [7.0])
    assert settlement.dead_ids == [3, 4]
    assert settlement.dead_reasons == ["gave up after 5 attempts: HTTP 500", "HTTP 400"]
    assert [m.id for m, _ in decision.dead] == [3, 4]
    assert decision.unavailable is None and decision.reached is True
    assert decision.counts[("t", "skipped")] == 1


def test_a_sink_that_is_down_leaves_rows_untouched_and_spends_no_attempt() -> None:
    down = Result(Outcome.UNAVAILABLE, "connection refused")
    decision = decide([row(1), row(2)], [down, down], max_attempts=1, retry_delay=delay)
    assert not decision.settlement
    assert decision.unavailable is down
    assert decision.reached is False  # asked, no answer: a stall for the give-way clock


def test_an_answer_proves_the_sink_reachable_and_relay_verdicts_prove_nothing() -> None:
    refused = Result(Outcome.RETRY, "HTTP 500", reached=True)
    no_answer = Result(Outcome.RETRY, "read timeout")
    malformed = Result(Outcome.DEAD, "invalid topic")

    def reached(results: list[Result]) -> bool | None:
        batch = [row(n) for n in range(len(results))]
        return decide(batch, results, max_attempts=1, retry_delay=delay).reached

    assert reached([no_answer, refused]) is True
    # Out of attempts without an answer: dead-lettered, yet no sign the sink is there.
    assert reached([no_answer]) is False
    assert reached([malformed, SKIPPED]) is None


def test_a_sick_partition_retries_its_own_rows_while_the_sink_acknowledges_others() -> None:
    sick = Result(Outcome.UNAVAILABLE, "timed out")
    collateral = Result(Outcome.UNAVAILABLE, "purged", collateral=True)
    decision = decide(
        [row(1, "a"), row(2, "b"), row(3, "c")],
        [ACKED, sick, collateral],
        max_attempts=10,
        retry_delay=delay,
    )
    settlement = decision.settlement
    assert settlement.sent == [1]
    assert settlement.retry_ids == [2]  # its own failure: one attempt, backoff
    assert 3 not in settlement.retry_ids + settlement.dead_ids  # collateral: untouched
    assert decision.unavailable is collateral


def test_a_deferred_row_spends_no_attempt_and_waits_what_the_sink_said() -> None:
    """A row its destination's rate limit or Retry-After pause sent back: out of
    attempts or not, it is never dead-lettered for it, and it waits as long as the
    sink said (the sink spread its rows)."""
    over_budget = Result(Outcome.RETRY, "over its limit", retry_after=0.35, collateral=True)
    paused = Result(Outcome.RETRY, "HTTP 503", retry_after=4.0, collateral=True, reached=True)
    decision = decide(
        [row(1, "a", attempts=9), row(2, "b"), row(3, "c")],
        [over_budget, paused, ACKED],
        max_attempts=10,
        retry_delay=lambda attempts, after: -1.0 if attempts else after or 0.0,
    )
    settlement = decision.settlement
    assert settlement.retry_ids == [1, 2] and settlement.retry_attempted == [0, 0]
    assert settlement.retry_delays == [0.35, 4.0]
    assert settlement.retry_errors == ["over its limit", "HTTP 503"]
    assert not settlement.dead_ids and decision.unavailable is None
    assert decision.counts[("t", "deferred")] == 2
    # A batch of rows sent back unsent asked the sink nothing: no stall for give-way.
    alone = decide([row(1)], [over_budget], max_attempts=1, retry_delay=delay)
    assert alone.reached is None and alone.settlement.retry_attempted == [0]


def test_a_deferral_comes_back_when_the_sink_said_capped_without_jitter() -> None:
    backoff = Backoff(base=1.0, cap=300.0)
    assert retry_delay(backoff, 0, 0.35) == 0.35
    assert retry_delay(backoff, 0, None) == 0.0
    assert retry_delay(backoff, 0, 9999.0) == 300.0
    assert 0.5 <= retry_delay(backoff, 1, None) <= 1.0  # a failure still backs off


class Answers:
    """A batch whose reports arrive when the test says so."""

    def __init__(self, size: int) -> None:
        self.results = [IN_FLIGHT] * size
        self.looks = 0

    def wait(self, *, leave_stragglers: bool = False) -> list[Result]:
        return self.results

    def again(self) -> list[Result]:
        self.looks += 1
        return self.results


def test_stragglers_leave_as_their_outcomes_come_and_hold_their_keys_meanwhile() -> None:
    batch = Answers(3)
    stragglers = Stragglers()
    for index, message in enumerate([row(1, "a"), row(2, "b"), row(3, None)]):
        stragglers.add(message, batch, index)
    assert (stragglers.ids(), stragglers.keys()) == ([1, 2, 3], frozenset({"a", "b"}))
    assert stragglers.answered() == ([], [])
    batch.results[1] = ACKED
    rows, results = stragglers.answered()
    assert [m.id for m in rows] == [2] and results == [ACKED]
    assert batch.looks == 2  # one look per batch per step, not one per row
    assert (stragglers.ids(), stragglers.keys()) == ([1, 3], frozenset({"a"}))
    stragglers.clear()
    assert len(stragglers) == 0


def test_a_wholly_acknowledged_batch_takes_the_short_way_to_the_same_decision() -> None:
    """The all-acked shortcut must decide exactly what the per-row walk decides."""
    batch = [row(1), row(2, key=None), row(3)]
    batch[2] = batch[2]._replace(topic="u")
    fast = decide(batch, [ACKED] * 3, max_attempts=5, retry_delay=delay)
    # An equal but not identical ACKED (another sink's instance) takes the same way.
    walked = decide(
        batch,
        [ACKED, Result(Outcome.ACKED, reached=True), ACKED],
        max_attempts=5,
        retry_delay=delay,
    )
    slow = decide([*batch, row(4)], [ACKED] * 3 + [SKIPPED], max_attempts=5, retry_delay=delay)
    for decision in (fast, walked):
        assert decision.settlement.sent == [1, 2, 3]
        assert decision.acked == batch
        assert decision.reached is True and decision.unavailable is None
        assert dict(decision.counts) == {("t", "acked"): 2, ("u", "acked"): 1}
    assert slow.settlement.sent == [1, 2, 3] and slow.counts[("t", "skipped")] == 1
    assert decide([], [], max_attempts=5, retry_delay=delay).reached is None
