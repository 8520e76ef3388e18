"""Rows no sink may see: the fetch says why a row cannot be sent as it is (too large to
load, a column an own table left NULL, headers that are no object of scalars), and such
a row is dead-lettered with that reason without reaching the sink; and the rows of a
paused topic (`relay pause`), which are parked unsent until it is resumed.

Screening here, once, rather than in each sink keeps a sink from ever meeting a row it
could crash on (a NULL topic, a payload the fetch left in the database), and a fifth
sink from having to know about any of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from relay.message import OutboxMessage
from relay.sinks.base import PAUSED, SKIPPED, Outcome, Pending, Published, Result, Sink

__all__ = ["sendable", "start_publish"]

_UNSENDABLE = attrgetter("unsendable")
_TOPIC = attrgetter("topic")


def start_publish(
    sink: Sink,
    batch: Sequence[OutboxMessage],
    abandon: Callable[[], bool],
    paused: frozenset[str] = frozenset(),
) -> Pending:
    """`sink.start_publish(batch)`, minus the rows that cannot be sent: those are
    DEAD with their reason, those of a `paused` topic PAUSED, and the later rows of
    their keys in this batch SKIPPED (a sink's ordering rule: nothing of a key after an
    earlier row of it failed)."""
    if not any(map(_UNSENDABLE, batch)) and not (paused and _any_paused(batch, paused)):
        return sink.start_publish(batch, abandon)  # the usual batch: in C, no copy
    fixed: list[Result | None] = []
    sendable: list[OutboxMessage] = []
    blocked: set[str] = set()
    for message in batch:
        if message.unsendable is not None:
            fixed.append(Result(Outcome.DEAD, message.unsendable))
            if message.key is not None:
                blocked.add(message.key)
        elif message.key is not None and message.key in blocked:
            fixed.append(SKIPPED)
        elif message.topic in paused:
            # Only a key's first row is parked: its later ones stay as they are, held
            # behind it by the fetch, so a paused backlog is not copied into the
            # waiting index (a row of no key holds nothing back: each is parked).
            fixed.append(PAUSED)
            if message.key is not None:
                blocked.add(message.key)
        else:
            fixed.append(None)
            sendable.append(message)
    pending = sink.start_publish(sendable, abandon) if sendable else Published([])
    return _Screened(pending, fixed)


def _any_paused(batch: Sequence[OutboxMessage], paused: frozenset[str]) -> bool:
    return not paused.isdisjoint(map(_TOPIC, batch))


def sendable(batch: list[OutboxMessage], paused: frozenset[str]) -> list[OutboxMessage]:
    """`batch` without the rows of paused topics: what the pacer charges for."""
    if not paused:
        return batch
    return [message for message in batch if message.topic not in paused]


class _Screened:
    """The sink's results for the rows it was given, in their places in the batch."""

    def __init__(self, pending: Pending, fixed: list[Result | None]) -> None:
        self._pending = pending
        self._fixed = fixed

    def wait(self, *, leave_stragglers: bool = False) -> list[Result]:
        return self._merge(self._pending.wait(leave_stragglers=leave_stragglers))

    def again(self) -> list[Result]:
        return self._merge(self._pending.again())

    def _merge(self, sent: list[Result]) -> list[Result]:
        results = iter(sent)
        return [next(results) if fixed is None else fixed for fixed in self._fixed]
