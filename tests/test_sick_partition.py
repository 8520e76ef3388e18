"""One sick partition holds back only its own keys (Kafka).

A three-broker cluster (librdkafka's mock cluster, real sockets) with one broker's port
blackholed by iptables: the partitions it leads take messages and never answer, the
others answer at once. Before, every batch waited for its slowest report, up to
RELAY_KAFKA_DELIVERY_TIMEOUT_MS, so one sick partition throttled every key.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Iterator

import pytest

from tests.conftest import SettingsFactory
from tests.harness.kafka import consume
from tests.harness.mockkafka import MockCluster, blackhole, iptables_available
from tests.support import (
    assert_per_key_order,
    dedup_by_message_id,
    insert_rows,
    keyed_rows,
    running_relay,
    scalar,
    unsent_count,
    wait_until,
)

TOPIC = "orders"
KEYS = 40
PER_KEY = 5


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    if os.geteuid() != 0 or not iptables_available():
        pytest.skip("needs root and iptables (./dev test installs it)")
    with MockCluster(brokers=3) as mock:
        yield mock


def unsent_of(dsn: str, keys: set[str]) -> int:
    return int(
        scalar(
            dsn,
            "SELECT count(*) FROM outbox WHERE sent_at IS NULL AND dead_lettered_at IS NULL"
            " AND key = ANY(%s)",
            (sorted(keys),),
        )
    )


def test_a_sick_partition_holds_back_its_own_keys_only(
    make_settings: SettingsFactory, database: str, cluster: MockCluster
) -> None:
    leaders = cluster.partition_leaders(TOPIC)
    sick_port = leaders[0]
    sick = {p for p, port in leaders.items() if port == sick_port}
    assert len(sick) < len(leaders), leaders
    # librdkafka's default partitioner for keyed messages: CRC-32 of the key.
    keys = {f"k{n}" for n in range(KEYS)}
    sick_keys = {k for k in keys if zlib.crc32(k.encode()) % len(leaders) in sick}
    healthy_keys = keys - sick_keys
    assert sick_keys and healthy_keys

    settings = make_settings(
        kafka_bootstrap_servers=cluster.bootstrap_servers,
        kafka_delivery_timeout_ms=60_000,  # a sick partition would stall a batch this long
        kafka_straggler_ms=500,
        batch_size=50,
    )
    with running_relay(settings):
        insert_rows(database, TOPIC, [("k0", b"warm-up")])
        wait_until(lambda: unsent_count(database) == 0, timeout=30, message="warm producer")
        with blackhole(sick_port):
            ids = insert_rows(database, TOPIC, keyed_rows(KEYS, PER_KEY))
            wait_until(
                lambda: unsent_of(database, healthy_keys) == 0,
                timeout=20,
                message="the healthy partitions' rows delivered while one partition is sick",
            )
            assert unsent_of(database, sick_keys) > 0  # still held: their broker is silent
            # Waiting on a sick partition is nobody's failure: no attempt spent.
            assert scalar(database, "SELECT count(*) FROM outbox WHERE attempts > 0") == 0
        wait_until(
            lambda: unsent_count(database) == 0,
            timeout=60,
            message="the sick partition's rows delivered once it answers again",
        )
        assert (
            scalar(database, "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL") == 0
        )

    records = consume(cluster.bootstrap_servers, TOPIC, min_count=len(ids) + 1, timeout=60)
    delivered = dedup_by_message_id(records)
    assert len(delivered) == len(ids) + 1
    assert_per_key_order([r for r in delivered if r.value != b"warm-up"])


def test_a_key_never_overtakes_its_own_unanswered_message_when_its_broker_goes_silent(
    make_settings: SettingsFactory, database: str, cluster: MockCluster
) -> None:
    """The reliability issue's first case on a broker that accepts a bumped epoch:
    the partition's leader goes silent just past the delivery timeout while a key's
    rows fill a small producer queue (the rest of the batch still waiting to be
    produced). Had librdkafka timed the first ones out itself, it would have bumped
    the idempotent producer's epoch and sent the later ones once the broker answered
    again: K:20.. before the retried K:0. Per key, the consumed sequence never goes
    back."""
    leaders = cluster.partition_leaders(TOPIC)
    port = leaders[zlib.crc32(b"K") % len(leaders)]
    settings = make_settings(
        kafka_bootstrap_servers=cluster.bootstrap_servers,
        batch_size=200,
        kafka_delivery_timeout_ms=1_500,
        # A small queue, and requests of two messages: the queue fills while the
        # broker is silent, and the rest of the batch waits to be produced.
        kafka={"queue_buffering_max_messages": "20", "batch_num_messages": "2"},
    )
    with running_relay(settings):
        insert_rows(database, TOPIC, [("warm", b"warm:0")])
        wait_until(lambda: unsent_count(database) == 0, timeout=30, message="warm producer")
        with blackhole(port):
            insert_rows(database, TOPIC, [("K", f"K:{i}".encode()) for i in range(300)])
            # The fault: silent just past the delivery timeout.
            time.sleep(2.2)
        wait_until(lambda: unsent_count(database) == 0, timeout=90, message="all delivered")
    records = consume(cluster.bootstrap_servers, TOPIC, min_count=301, timeout=60)
    steps = [
        int(r.value.decode().split(":")[1])
        for r in dedup_by_message_id(records)
        if r.key == "K" and r.value is not None
    ]
    assert steps == list(range(300)), steps[:40]
