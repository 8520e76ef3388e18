"""Latency at a steady insert rate: app commit -> the sink's delivery report.

An app thread inserts rows at a steady rate (a transaction every 10 ms, as many rows as
the schedule asks) and notes when each commit returned. The relay runs in-process with
its real Kafka sink wrapped to note when `wait()` hands back each acknowledgement.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import psycopg

from bench.common import PAYLOAD, TOPIC, relay_settings
from relay.message import OutboxMessage
from relay.observe.tracing import Tracing
from relay.settings import Settings
from relay.sinks import Outcome, Result, Sink, create_sink
from relay.sinks.base import Pending
from tests.support import running_relay


class TimedSink:
    """The real sink, noting the time each message's acknowledgement came back."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.name = inner.name
        self.serial_per_key = inner.serial_per_key
        self.max_publish_seconds = inner.max_publish_seconds
        self.acked_at: dict[str, float] = {}

    def start_publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> Pending:
        return TimedPending(self, messages, self.inner.start_publish(messages, abandon))

    def note(self, messages: Sequence[OutboxMessage], results: list[Result]) -> list[Result]:
        now = time.monotonic()
        for message, result in zip(messages, results, strict=True):
            if result.outcome is Outcome.ACKED:
                self.acked_at.setdefault(message.message_id, now)
        return results

    def stop_sending(self) -> None:
        self.inner.stop_sending()

    def check(self, timeout: float) -> str:
        return self.inner.check(timeout)

    def flush(self, timeout: float) -> int:
        return self.inner.flush(timeout)

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()


class TimedPending:
    def __init__(self, sink: TimedSink, messages: Sequence[OutboxMessage], inner: Pending):
        self._sink, self._messages, self._inner = sink, messages, inner

    def wait(self, *, leave_stragglers: bool = False) -> list[Result]:
        return self._sink.note(self._messages, self._inner.wait(leave_stragglers=leave_stragglers))

    def again(self) -> list[Result]:
        return self._sink.note(self._messages, self._inner.again())


def insert_steadily(dsn: str, rate: float, seconds: float) -> dict[str, float]:
    committed: dict[str, float] = {}
    tick = 0.01
    with psycopg.connect(dsn, autocommit=False) as conn:
        started = time.monotonic()
        sent = 0
        while (now := time.monotonic()) - started < seconds:
            due = int((now - started) * rate) - sent
            if due > 0:
                rows = conn.execute(
                    "INSERT INTO outbox (topic, key, payload)"
                    " SELECT %s, 'k' || (g %% 100), %s FROM generate_series(1, %s) g"
                    " RETURNING message_id::text",
                    (TOPIC, PAYLOAD, due),
                ).fetchall()
                conn.commit()
                at = time.monotonic()
                committed.update((row[0], at) for row in rows)
                sent += due
            time.sleep(max(0.0, tick - (time.monotonic() - now)))
    return committed


def percentile(values: Sequence[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


@contextmanager
def timed_relay(settings: Settings) -> Iterator[list[TimedSink]]:
    """An in-process relay whose sinks note their acknowledgements (one per shard)."""
    sinks: list[TimedSink] = []

    def timed_sink(settings: Settings, tracing: Tracing) -> Sink:
        sink = TimedSink(create_sink(settings, tracing))
        sinks.append(sink)
        return sink

    with patch("relay.daemon.app.create_sink", timed_sink), running_relay(settings):
        yield sinks


def run(dsn: str, bootstrap: str, rate: float, seconds: float) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    committed: dict[str, float] = {}
    with timed_relay(relay_settings(dsn, bootstrap)) as sinks:
        time.sleep(1.0)  # lease acquired, producer connected: measure steady state
        inserter = threading.Thread(
            target=lambda: committed.update(insert_steadily(dsn, rate, seconds))
        )
        inserter.start()
        inserter.join()
        deadline = time.monotonic() + 30
        acked_so_far = sinks[0].acked_at
        while sum(1 for mid in list(committed) if mid in acked_so_far) < len(committed):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
    acked = sinks[0].acked_at
    latencies = [max(0.0, acked[mid] - at) * 1000 for mid, at in committed.items() if mid in acked]
    return {
        "rate": rate,
        "seconds": seconds,
        "messages": len(committed),
        "delivered": len(latencies),
        "p50_ms": percentile(latencies, 0.50),
        "p95_ms": percentile(latencies, 0.95),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": max(latencies),
    }
