"""What each message's outcome means for its row: the settlement of one batch.

A pure function, so the policy (which failures spend an attempt, when a row is dead-
lettered, when the sink as a whole backs off) is readable in one place and tested without
a database or a sink. The drain loop applies the decision: counts, logs, the settle.

    acked                 -> mark sent (or delete)
    retry                 -> one more attempt, back off the row; past RELAY_MAX_ATTEMPTS,
                             dead-letter it
    retry, collateral     -> deferred: the sink sent the row back unsent, or its
                             destination refused it as a whole (a rate limit, a
                             Retry-After pause): no attempt spent, the row waits as long
                             as the sink said, and its key is held back meanwhile
    dead                  -> dead-letter with the sink's reason
    unavailable           -> leave the row untouched, back the whole sink off; but if
                             the sink acknowledged others in the same batch and the
                             failure was the row's own, it is a sick partition or
                             endpoint: retry the row like any failure
    collateral failures   -> never the row's fault: untouched, no attempt spent
    skipped               -> untouched (its key was blocked earlier in the batch)
    paused                -> parked: its topic is paused (relay pause); no attempt
                             spent, its key held behind it until the topic is resumed
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from relay.drain.batch import Settlement
from relay.message import ID, TOPIC, OutboxMessage
from relay.sinks.base import ACKED, Outcome, Result

# (attempts so far including this one, the sink's Retry-After) -> seconds to wait; with
# attempts 0 (a deferral: nothing failed) the Retry-After as it is, capped.
RetryDelay = Callable[[int, float | None], float]
DEFERRED = "deferred"  # the outcome label of a retry that spends no attempt


@dataclass(slots=True)
class Decision:
    settlement: Settlement = field(default_factory=Settlement)
    # The sink as a whole is down: the loop backs off (this result's error and hint).
    unavailable: Result | None = None
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (topic, outcome)
    acked: list[OutboxMessage] = field(default_factory=list)
    dead: list[tuple[OutboxMessage, str]] = field(default_factory=list)

    # The sink answered about some row (True), about none while it was asked (False),
    # or was not asked at all (None: every row skipped or refused by the relay itself).
    reached: bool | None = None


def decide(
    batch: Sequence[OutboxMessage],
    results: Sequence[Result],
    *,
    max_attempts: int,
    retry_delay: RetryDelay,
) -> Decision:
    decision = Decision()
    settlement = decision.settlement
    if batch and results.count(ACKED) == len(results):
        # The common case, a whole batch acknowledged, without a per-row walk (list
        # count compares by identity first: C speed for the shared ACKED).
        decision.reached = True
        decision.acked = list(batch)
        settlement.sent = list(map(ID, batch))
        for topic, count in Counter(map(TOPIC, batch)).items():
            decision.counts[(topic, Outcome.ACKED.value)] = count
        return decision
    # A sink that acknowledged part of the batch is up: its "unavailable" rows are a
    # sick topic or partition, and must back off per row (and eventually be dead-
    # lettered) rather than head every batch and throttle all other keys.
    sink_up = any(result.outcome is Outcome.ACKED for result in results)
    if any(result.reached for result in results):
        decision.reached = True
    elif any(_asked(result) for result in results):
        decision.reached = False
    for message, result in zip(batch, results, strict=True):
        outcome = result.outcome
        if outcome is Outcome.UNAVAILABLE and sink_up and not result.collateral:
            outcome = Outcome.RETRY
        if outcome is Outcome.RETRY and result.collateral:
            decision.counts[(message.topic, DEFERRED)] += 1
            delay = retry_delay(0, result.retry_after)
            settlement.retry(message.id, delay, result.error or "deferred", attempted=False)
            continue
        decision.counts[(message.topic, outcome.value)] += 1
        if outcome is Outcome.ACKED:
            settlement.sent.append(message.id)
            decision.acked.append(message)
        elif outcome is Outcome.RETRY:
            attempts = message.attempts + 1
            error = result.error or "unknown error"
            if attempts >= max_attempts:
                reason = f"gave up after {attempts} attempts: {error}"
                settlement.dead(message.id, reason)
                decision.dead.append((message, reason))
            else:
                settlement.retry(message.id, retry_delay(attempts, result.retry_after), error)
        elif outcome is Outcome.DEAD:
            reason = result.error or "permanent failure"
            settlement.dead(message.id, reason)
            decision.dead.append((message, reason))
        elif outcome is Outcome.PAUSED:
            settlement.park(message.id, message.topic)
        elif outcome is Outcome.UNAVAILABLE:
            decision.unavailable = result
    return decision


def _asked(result: Result) -> bool:
    """The sink tried this message and has no answer to show (a deferred row was never
    tried: a batch of them says nothing of whether the sink can be reached)."""
    if result.outcome is Outcome.RETRY:
        return not result.collateral
    return result.outcome in (Outcome.UNAVAILABLE, Outcome.IN_FLIGHT)
