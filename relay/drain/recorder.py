"""What the drain records of each batch: its metrics, a log line per dead letter and,
with tracing on, the batch's span. One owner of the span in flight, so the loop only
says what happened; with tracing off each span call is one `is None` test.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from relay.drain.outcomes import Decision
from relay.message import DUE_EPOCH, OutboxMessage
from relay.observe import metrics
from relay.observe.logging import get_logger

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from relay.observe.tracing import Tracing

log = get_logger("relay.drain")


class Recorder:
    def __init__(self, sink: str, tracing: Tracing | None) -> None:
        self._sink = sink
        self._tracing = tracing  # RELAY_TRACING (relay/observe/tracing.py), else None
        self._span: Span | None = None  # the batch being published, when tracing

    def fetch_started(self) -> int:
        """When the fetch began, for the batch span's event (0 when not tracing)."""
        return time.time_ns() if self._tracing is not None else 0

    def publishing(self, batch: Sequence[OutboxMessage], fetched_ns: int) -> None:
        metrics.BATCH_SIZE.observe(len(batch))
        if self._tracing is not None:
            self._span = self._tracing.start_batch(batch, fetched_ns)

    def published(self, seconds: float, acked: int) -> None:
        """Every row of the batch answered (or left to straggle) after `seconds`."""
        metrics.PUBLISH_SECONDS.labels(self._sink).observe(seconds)
        if self._span is not None:
            self._span.add_event("acknowledged", {"messaging.acknowledged": acked})

    def decided(self, decision: Decision) -> None:
        """The outcomes of rows about to be settled: latency, counts, dead letters."""
        ages = map(partial(operator.sub, time.time()), map(DUE_EPOCH, decision.acked))
        metrics.END_TO_END_SECONDS.observe_many(self._sink, ages)
        for message, reason in decision.dead:
            self._dead_lettered(message, reason)
        for (topic, outcome_name), count in decision.counts.items():
            topic_label = metrics.TOPIC_LABELS.label(topic)
            metrics.MESSAGES.labels(self._sink, topic_label, outcome_name).inc(count)

    def settling(self) -> None:
        """The batch went to the settle, which runs on on the settler's session."""
        if self._span is not None:
            self._span.add_event("settle")
            self.end()

    def end(self, *, failed: bool = False) -> None:
        span, self._span = self._span, None
        if span is not None:
            if failed and self._tracing is not None:
                self._tracing.failed(span, "a database error cut the batch short", "database")
            span.end()

    def _dead_lettered(self, message: OutboxMessage, reason: str) -> None:
        topic_label = metrics.TOPIC_LABELS.label(message.topic)
        metrics.DEAD_LETTERED.labels(self._sink, topic_label).inc()
        log.warning(
            "outbox.dead_lettered",
            id=message.id,
            message_id=message.message_id,
            topic=message.topic,
            key=message.key,
            attempts=message.attempts + 1,
            reason=reason,
        )
