"""A key lands on the partition a Java producer picks for it (murmur2), on a real broker.

Teams move from Debezium (Kafka Connect, Java) or mix the relay with JVM producers and
Kafka Streams joins: a key on two partitions across the switch loses its order there.
The relay sets librdkafka's `murmur2_random`; the partitions are checked against an
implementation of Kafka's own murmur2 (tests/harness/kafka.py), itself checked against
Kafka's test vectors here.
"""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import SettingsFactory
from tests.harness.kafka import TansuBroker, consume, java_partition, murmur2
from tests.support import insert_rows, running_relay, unsent_count, wait_until

PARTITIONS = 12


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "expected"),
    [  # Kafka's UtilsTest.testMurmur2
        ("21", -973932308),
        ("foobar", -790332482),
        ("a-little-bit-long-string", -985981536),
        ("a-little-bit-longer-string", -1486304829),
        ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        ("abc", 479470107),
    ],
)
def test_the_reference_murmur2_is_kafkas(text: str, expected: int) -> None:
    assert murmur2(text.encode()) == expected


def test_each_key_lands_where_a_java_producer_puts_it(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker
) -> None:
    topic = f"java-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, partitions=PARTITIONS)
    keys = [f"customer-{n}" for n in range(300)]
    insert_rows(database, topic, [(key, key.encode()) for key in keys])
    with running_relay(make_settings(batch_size=100)):
        wait_until(lambda: unsent_count(database) == 0, timeout=60, interval=0.1)
    records = consume(kafka.bootstrap_servers, topic, min_count=len(keys))
    wrong = [r.key for r in records if r.key and r.partition != java_partition(r.key, PARTITIONS)]
    assert len(records) == len(keys)
    assert not wrong, f"{len(wrong)} of {len(keys)} keys off Java's partition: {wrong[:5]}"


def test_rows_without_a_key_are_spread_over_the_partitions(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker
) -> None:
    """Java spreads NULL keys (sticky batches, then on); they must not pile on one."""
    topic = f"nokey-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, partitions=PARTITIONS)
    for _ in range(10):  # batches of their own: a sticky partitioner moves between them
        insert_rows(database, topic, [(None, b"x")] * 20)
    with running_relay(make_settings(batch_size=20)):
        wait_until(lambda: unsent_count(database) == 0, timeout=60, interval=0.1)
    records = consume(kafka.bootstrap_servers, topic, min_count=200)
    assert len({r.partition for r in records}) > 1


def test_the_old_partitioner_stays_one_setting_away(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker
) -> None:
    """A topic written with the earlier default keeps its keys where they are."""
    topic = f"crc-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, partitions=PARTITIONS)
    keys = [f"customer-{n}" for n in range(300)]
    insert_rows(database, topic, [(key, key.encode()) for key in keys])
    settings = make_settings(kafka={"partitioner": "consistent_random"})
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, timeout=60, interval=0.1)
    records = consume(kafka.bootstrap_servers, topic, min_count=len(keys))
    wrong = [r.key for r in records if r.key and r.partition != java_partition(r.key, PARTITIONS)]
    assert len(wrong) > len(keys) // 2  # CRC32 agrees with murmur2 by chance only
