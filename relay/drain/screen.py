"""Rows no sink may see: the fetch says why a row cannot be sent as it is (too large to
load, a column an own table left NULL, headers that are no object of scalars), and such
a row is dead-lettered with that reason without reaching the sink.

Screening here, once, rather than in each sink keeps a sink from ever meeting a row it
could crash on (a NULL topic, a payload the fetch left in the database), and a fifth
sink from having to know about any of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from relay.message import OutboxMessage
from relay.sinks.base import SKIPPED, Outcome, Pending, Published, Result, Sink

__all__ = ["start_publish"]

_UNSENDABLE = attrgetter("unsendable")


def start_publish(
    sink: Sink, batch: Sequence[OutboxMessage], abandon: Callable[[], bool]
) -> Pending:
    """`sink.start_publish(batch)`, minus the rows that cannot be sent: those are
    DEAD with their reason, and the later rows of their keys in this batch SKIPPED (a
    sink's ordering rule: nothing of a key after an earlier row of it failed)."""
    if not any(map(_UNSENDABLE, batch)):  # the usual batch: in C, no copy
        return sink.start_publish(batch, abandon)
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
        else:
            fixed.append(None)
            sendable.append(message)
    pending = sink.start_publish(sendable, abandon) if sendable else Published([])
    return _Screened(pending, fixed)


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
