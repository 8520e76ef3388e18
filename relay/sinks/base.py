"""The sink interface: publish a batch, report one outcome per message.

A sink owns its client and its concurrency; the drain loop owns the database. Adding a
sink (NATS, RabbitMQ, ...) means one module implementing `Sink` and one line in
`relay.sinks.create_sink`.

The one ordering rule a sink must keep: within a batch, it must not deliver a message
of a key after an earlier message of the same key failed. It reports such later
messages as `SKIPPED`; they stay unsent and go out after the failed one is settled.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from relay.message import OutboxMessage


class Outcome(enum.Enum):
    ACKED = "acked"  # the sink confirmed it: mark the row sent
    RETRY = "retry"  # this message failed, may work later: count an attempt, back off
    DEAD = "dead"  # this message can never succeed as it is: dead-letter it
    UNAVAILABLE = "unavailable"  # the sink as a whole is down: the row is untouched
    SKIPPED = "skipped"  # not attempted (key blocked earlier in the batch, or abandoned)
    # No outcome yet: the message may still be delivered (a sick partition holds it while
    # the rest of the batch was acknowledged). Its row stays unsettled and its key held;
    # the drain loop asks again (`Pending.again`) until it has an outcome.
    IN_FLIGHT = "in_flight"


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    error: str | None = None
    retry_after: float | None = None  # seconds the sink asked us to wait (HTTP 429)
    # The message failed for another's sake (its producer died or was purged): never
    # its own fault, so it spends no attempt even while the sink acks other messages.
    collateral: bool = False
    # The sink answered about this message (acknowledged it, or refused it: an HTTP
    # status, a broker error), as opposed to no answer at all (refused connection,
    # timeout). Any answer proves the path to the sink works: a leader gives way only
    # while it gets none.
    reached: bool = False


ACKED = Result(Outcome.ACKED, reached=True)
SKIPPED = Result(Outcome.SKIPPED)
IN_FLIGHT = Result(Outcome.IN_FLIGHT)


class Sink(Protocol):
    name: str
    # True if the sink sends a key's rows one at a time (HTTP): more rows of one key in a
    # batch then only make the other keys wait, so the per-key cap always holds.
    serial_per_key: bool

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        """Deliver `messages`, wait for each acknowledgement, return results in order.

        `abandon()` turning true (shutdown past its grace, lease lost) means stop
        waiting: messages without an outcome yet are reported `SKIPPED`.
        """
        ...

    def check(self, timeout: float) -> str:
        """Connect and return a one-line description; raise on failure."""
        ...

    def flush(self, timeout: float) -> int:
        """Wait for anything still queued; return how many are left."""
        ...

    def reset(self) -> None:
        """Drop whatever is still queued or in flight, unreported, and start clean
        (this replica gave the lease up). Called on the drain loop's thread."""
        ...

    def close(self) -> None: ...


class Pending(Protocol):
    def wait(self, *, leave_stragglers: bool = False) -> list[Result]:
        """The batch's results, as `Sink.publish` returns them. With `leave_stragglers`
        it may return once the rest of the batch is answered and a few messages are
        overdue: those are `IN_FLIGHT`."""
        ...

    def again(self) -> list[Result]:
        """The results now, without waiting: `IN_FLIGHT` for messages still without an
        outcome (past the sink's deadline they get one: unavailable)."""
        ...


@runtime_checkable
class StartsPublishing(Protocol):
    """A sink that can hand a batch over and report later (Kafka: produce now, delivery
    reports after), so the drain loop reads its next batch meanwhile."""

    def start_publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> Pending: ...

    def stop_sending(self) -> None:
        """The lease's local deadline passed: drop what the client still holds to send
        (queued, or waiting for a retry), not what is already on the wire. Called from
        another thread than the drain loop's, which may be stuck in the database."""
        ...


@dataclass(frozen=True, slots=True)
class Published:
    results: list[Result]

    def wait(self, *, leave_stragglers: bool = False) -> list[Result]:
        return self.results

    def again(self) -> list[Result]:
        return self.results


def start_publishing(
    sink: Sink, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
) -> Pending:
    """Two-phase where the sink can do it; otherwise publish now (HTTP)."""
    if isinstance(sink, StartsPublishing):
        return sink.start_publish(messages, abandon)
    return Published(sink.publish(messages, abandon))
