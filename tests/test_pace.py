"""The drain's pace over a real broker (issue 35): RELAY_MAX_MESSAGES_PER_SECOND and
RELAY_MAX_BYTES_PER_SECOND against PostgreSQL and Kafka (Tansu), read from the
consumer's side: the records' CreateTime (stamped by the producer as the relay hands
them over) never shows more than the cap, plus one batch (a tenth of a second of it),
in any one-second window; the drain takes about what the cap says; order per key holds.
Without the cap, 600 rows go in a fraction of a second: both tests fail."""

from __future__ import annotations

from collections.abc import Sequence

from tests.conftest import SettingsFactory
from tests.harness.kafka import Record, TansuBroker, consume
from tests.support import (
    assert_per_key_order,
    dedup_by_message_id,
    insert_rows,
    keyed_rows,
    running_relay,
    unsent_count,
    wait_until,
)


def busiest_second(records: Sequence[Record], amount: dict[int, int]) -> int:
    """The most of `amount` (per record, by `id`) in any window [t, t + 1 s) of CreateTime."""
    sends = sorted((r.timestamp_ms, amount[id(r)]) for r in records)
    most = inside = first = 0
    for at, size in sends:
        inside += size
        while sends[first][0] <= at - 1000:
            inside -= sends[first][1]
            first += 1
        most = max(most, inside)
    return most


def span_seconds(records: Sequence[Record]) -> float:
    stamps = [r.timestamp_ms for r in records]
    return (max(stamps) - min(stamps)) / 1000


def test_the_message_cap_holds_in_every_second_over_kafka(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """600 rows at 200 a second: batches of 20 (a tenth of a second), so at most
    200 + 20 in any second, and about (600 - 20) / 200 = 2.9 s from first to last."""
    cap, rows, batch = 200, 600, 20
    insert_rows(database, topic, keyed_rows(keys=10, per_key=rows // 10))
    with running_relay(make_settings(batch_size=1000, max_messages_per_second=cap)):
        wait_until(lambda: unsent_count(database) == 0, timeout=30, message="outbox drained")
    records = dedup_by_message_id(consume(kafka.bootstrap_servers, topic, min_count=rows))
    assert len(records) == rows
    assert_per_key_order(records)
    busiest = busiest_second(records, {id(r): 1 for r in records})
    assert busiest <= cap + batch, f"{busiest} records in one second"
    took = span_seconds(records)
    assert (rows - batch) / cap - 0.01 <= took < (rows - batch) / cap + 2.0, took


def test_the_byte_cap_holds_in_every_second_over_kafka(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """150 rows of about 1,017 bytes (payload, topic, key: what the cap counts) at
    50,000 bytes a second: batches of at most 5,000 bytes (4 rows), so at most
    55,000 bytes in any second, and about 3 s from first to last."""
    cap, rows = 50_000, 150
    padded = [(key, payload.ljust(1000)) for key, payload in keyed_rows(keys=5, per_key=30)]
    insert_rows(database, topic, padded)
    with running_relay(make_settings(batch_size=1000, max_bytes_per_second=cap)):
        wait_until(lambda: unsent_count(database) == 0, timeout=30, message="outbox drained")
    records = dedup_by_message_id(consume(kafka.bootstrap_servers, topic, min_count=rows))
    assert len(records) == rows
    assert_per_key_order(records)  # the payload is "k3:17" padded with spaces
    size = {
        id(r): len(r.value or b"") + len(r.topic.encode()) + len((r.key or "").encode())
        for r in records
    }
    busiest = busiest_second(records, size)
    assert busiest <= cap + cap // 10, f"{busiest} bytes in one second"
    total = sum(size.values())
    took = span_seconds(records)
    assert (total - cap // 10) / cap - 0.01 <= took < total / cap + 2.0, took
