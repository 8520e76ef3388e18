"""The sink interface: publish a batch, report one outcome per message.

A sink owns its client, its concurrency, its settings and its metrics; the drain loop
owns the database. A sink is a package, `relay/sinks/<name>/`: a module implementing
`Sink`, and `settings.py` declaring its settings and a `SINK = SinkSpec(...)`, listed
in the registry (`relay.sinks.SINK_SETTINGS`).

The one ordering rule a sink must keep: within a batch, it must not deliver a message
of a key after an earlier message of the same key failed. It reports such later
messages as `SKIPPED`; they stay unsent and go out after the failed one is settled.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

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
    # Never a sink's answer: the relay held the message back, its topic paused
    # (relay/drain/screen.py). The row is parked, unsent, no attempt spent.
    PAUSED = "paused"


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    error: str | None = None
    retry_after: float | None = None  # seconds the sink asked us to wait (HTTP 429)
    # The message failed for another's sake (its producer died or was purged), or was
    # sent back unsent (its destination's rate limit or Retry-After pause): never its
    # own fault, so it spends no attempt even while the sink acks other messages. A
    # RETRY so marked is deferred: the row waits `retry_after`, its key held meanwhile.
    collateral: bool = False
    # The sink answered about this message (acknowledged it, or refused it: an HTTP
    # status, a broker error), as opposed to no answer at all (refused connection,
    # timeout). Any answer proves the path to the sink works: a leader gives way only
    # while it gets none.
    reached: bool = False


ACKED = Result(Outcome.ACKED, reached=True)
SKIPPED = Result(Outcome.SKIPPED)
PAUSED = Result(Outcome.PAUSED)
IN_FLIGHT = Result(Outcome.IN_FLIGHT)


class Sink(Protocol):
    """What the drain loop needs of a sink. Publishing is two-phase for every sink:
    `start_publish` hands a batch over and `Pending.wait` collects its outcomes, so a
    sink that can send in the background (Kafka) overlaps with the next fetch; one that
    cannot (`OnePhase`) publishes inside `start_publish`."""

    name: str
    # True if the sink sends a key's rows one at a time (HTTP): more rows of one key in a
    # batch then only make the other keys wait, so the per-key cap always holds.
    serial_per_key: bool

    @property
    def max_publish_seconds(self) -> float:
        """The longest one batch's publish and wait may take: the drain loop's liveness
        limit is sized from it."""
        ...

    def start_publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> Pending:
        """Hand `messages` over; `abandon()` turning true (shutdown past its grace, lease
        lost) means stop: messages without an outcome yet are reported `SKIPPED`."""
        ...

    def stop_sending(self) -> None:
        """The lease's local deadline passed: drop what the client still holds to send
        (queued, or waiting for a retry), not what is already on the wire. Called from
        another thread than the drain loop's, which may be stuck in the database."""
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


@dataclass(frozen=True, slots=True)
class Published:
    results: list[Result]

    def wait(self, *, leave_stragglers: bool = False) -> list[Result]:
        return self.results

    def again(self) -> list[Result]:
        return self.results


class OnePhase:
    """For a sink that delivers a whole batch inside one call (HTTP, NATS, RabbitMQ):
    it implements `publish`; nothing outlives the call, so nothing is held between
    phases, nothing is left to flush, and a reset has nothing to drop."""

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        raise NotImplementedError

    def start_publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> Pending:
        return Published(self.publish(messages, abandon))

    def stop_sending(self) -> None:
        return  # `abandon()` ends a publish in progress; nothing waits between calls

    def flush(self, timeout: float) -> int:
        return 0

    def reset(self) -> None:
        return


@dataclass(frozen=True)
class SinkSpec:
    """A sink as the registry knows it (`SINK` in its `relay/sinks/<name>/settings.py`):
    enough to load and validate its settings without importing its client library."""

    name: str  # the value of RELAY_SINK
    settings: type[BaseModel]  # its RELAY_<NAME>_* fields, mixed into `Settings`
    # "module:Class", imported only when this sink is chosen; made as
    # Class(settings, tracing=...) (the process's Tracing, or None)
    implementation: str
    secrets: tuple[str, ...] = ()  # fields that may come from RELAY_<FIELD>_FILE
    # Raises `SettingsError` if a setting this sink cannot run without is missing;
    # called only when this sink is the chosen one.
    require: Callable[[Any], None] = lambda _settings: None
    extra: str | None = None  # the pip extra that brings its client library
    # The largest message it accepts by default (RELAY_MESSAGE_MAX_BYTES overrides): a
    # larger row is dead-lettered from its size, before its bytes leave PostgreSQL.
    message_max_bytes: Callable[[Any], int] = lambda _settings: 16 << 20
