"""Stragglers: published rows with no outcome yet while the rest of their batch was
answered (Kafka: a sick partition holds them). They stay in flight, unsettled and
spending no attempt; every fetch leaves their ids out and holds their keys back, so no
later row of such a key can overtake them; the drain loop asks for their outcomes at
every step and settles those that came.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.message import OutboxMessage
from relay.observe import metrics
from relay.sinks.base import Outcome, Pending, Result


@dataclass(slots=True)
class Straggler:
    message: OutboxMessage  # without its payload: enough to settle it
    pending: Pending  # the batch it was published in, which hears its report
    index: int  # its place in that batch


class Stragglers:
    def __init__(self) -> None:
        self._items: list[Straggler] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, message: OutboxMessage, pending: Pending, index: int) -> None:
        self._items.append(Straggler(message._replace(payload=None, headers=None), pending, index))
        metrics.STRAGGLERS.set(len(self._items))

    def answered(self) -> tuple[list[OutboxMessage], list[Result]]:
        """Those whose outcome came in (or whose deadline passed), taken off the list."""
        if not self._items:
            return [], []
        now: dict[int, list[Result]] = {}  # one look per batch
        rows: list[OutboxMessage] = []
        results: list[Result] = []
        still: list[Straggler] = []
        for straggler in self._items:
            outcomes = now.get(id(straggler.pending))
            if outcomes is None:
                outcomes = now[id(straggler.pending)] = straggler.pending.again()
            result = outcomes[straggler.index]
            if result.outcome is Outcome.IN_FLIGHT:
                still.append(straggler)
            else:
                rows.append(straggler.message)
                results.append(result)
        self._items = still
        metrics.STRAGGLERS.set(len(still))
        return rows, results

    def ids(self) -> list[int]:
        return [s.message.id for s in self._items]

    def keys(self) -> frozenset[str]:
        return frozenset(s.message.key for s in self._items if s.message.key is not None)

    def clear(self) -> None:
        """Forget them: their rows go again, under the next holder or our next term."""
        self._items = []
        metrics.STRAGGLERS.set(0)
