"""Throughput: the raw database limit, the bare producer, and the relay end to end."""

from __future__ import annotations

import time

from confluent_kafka import Producer

from bench import cpu
from bench.baselines import raw_loop
from bench.common import BARE_PRODUCER, PAYLOAD, TOPIC, preload, preload_history


def raw_drain(dsn: str, batch: int, *, delete: bool) -> float:
    """rows/s of a bare loop on the relay's outbox: select a batch in id order (its
    primary key), delete it or move it into outbox_sent, as the relay settles in each
    mode (bench/baselines.py runs the same loop on a minimal table)."""
    return raw_loop(dsn, "outbox", batch, settle_as="delete" if delete else "move")


def producer_rate(bootstrap: str, count: int) -> float:
    """msg/s of one Python loop producing to the broker with the relay's guarantees."""
    producer = Producer({"bootstrap.servers": bootstrap, **BARE_PRODUCER})
    producer.produce(TOPIC, PAYLOAD, key="warm-up")
    producer.flush(10)
    started = time.perf_counter()
    for n in range(count):
        while True:
            try:
                producer.produce(TOPIC, PAYLOAD, key=f"k{n % 100}")
                break
            except BufferError:
                producer.poll(0.01)
        if n % 1000 == 0:
            producer.poll(0)
    left = producer.flush(60)
    assert left == 0, f"{left} messages not delivered"
    return count / (time.perf_counter() - started)


def run(
    dsn: str, bootstrap: str, rows: int, batches: list[int]
) -> tuple[float, list[dict[str, float | int | str]]]:
    """Per retention mode and batch size: the bare loop, then a relay process draining
    the same backlog (rows/s, and its CPU time per message: bench/cpu.py)."""
    bare_producer = producer_rate(bootstrap, rows)
    results: list[dict[str, float | int | str]] = []
    for mode in ("delete", "keep"):
        retention = "0" if mode == "delete" else "86400"
        for batch in batches:
            preload(dsn, rows)
            raw = raw_drain(dsn, batch, delete=mode == "delete")
            relay = cpu.drain(
                dsn, bootstrap, rows, RELAY_BATCH_SIZE=str(batch), RELAY_RETENTION_SECONDS=retention
            )
            results.append(
                {
                    "mode": mode,
                    "batch": batch,
                    "rows": rows,
                    "raw": raw,
                    "relay": relay["rows_per_s"],
                    "cpu_us_per_msg": relay["cpu_us_per_msg"],
                }
            )
    return bare_producer, results


def history_effect(dsn: str, bootstrap: str, rows: int, history: int) -> dict[str, float | int]:
    """Retention mode: drain rate over an empty history vs `history` kept sent rows."""
    keep = "86400"
    empty = cpu.drain(dsn, bootstrap, rows, RELAY_BATCH_SIZE="500", RELAY_RETENTION_SECONDS=keep)
    preload_history(dsn, history)
    preload(dsn, rows, truncate=False)
    kept = cpu.drain(
        dsn, bootstrap, rows, preloaded=True, RELAY_BATCH_SIZE="500", RELAY_RETENTION_SECONDS=keep
    )
    return {
        "rows": rows,
        "history": history,
        "empty_history": empty["rows_per_s"],
        "with_history": kept["rows_per_s"],
    }
