"""One sick partition holds back only its own keys (Kafka).

A three-broker cluster (librdkafka's mock cluster, real sockets) with one broker's port
blackholed by iptables: the partitions it leads take messages and never answer, the
others answer at once. Before, every batch waited for its slowest report, up to
RELAY_SINK_TIMEOUT_SECONDS, so one sick partition throttled every key.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.conftest import SettingsFactory
from tests.harness.kafka import consume, java_partition
from tests.harness.mockkafka import MockCluster, blackhole, iptables_available
from tests.support import (
    OVERTAKE_SETTINGS,
    assert_no_key_overtakes_itself,
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
            "SELECT count(*) FROM outbox WHERE key = ANY(%s)",
            (sorted(keys),),
        )
    )


def spread_topic(cluster: MockCluster) -> tuple[str, dict[int, int]]:
    """A topic whose partitions more than one broker leads, and its leaders. The mock
    cluster picks each partition's leader at random, all on one broker for about one
    topic in 27 (4 partitions, 3 brokers): a test of one sick broker among healthy
    ones takes the first of its names that the cluster spread."""
    for n in range(30):
        topic = f"{TOPIC}-{n}"
        leaders = cluster.partition_leaders(topic)
        if len(set(leaders.values())) > 1:
            return topic, leaders
    raise AssertionError("30 topics, each led by one broker alone")


def test_a_sick_partition_holds_back_its_own_keys_only(
    make_settings: SettingsFactory, database: str, cluster: MockCluster
) -> None:
    topic, leaders = spread_topic(cluster)
    sick_port = leaders[0]
    sick = {p for p, port in leaders.items() if port == sick_port}
    assert len(sick) < len(leaders), leaders
    # The relay's partitioner for keyed messages: murmur2, as Java's producer.
    keys = {f"k{n}" for n in range(KEYS)}
    sick_keys = {k for k in keys if java_partition(k, len(leaders)) in sick}
    healthy_keys = keys - sick_keys
    assert sick_keys and healthy_keys

    settings = make_settings(
        kafka_bootstrap_servers=cluster.bootstrap_servers,
        sink_timeout_seconds=60.0,  # a sick partition would stall a batch this long
        kafka_straggler_seconds=0.5,
        batch_size=50,
    )
    with running_relay(settings):
        insert_rows(database, topic, [("k0", b"warm-up")])
        wait_until(lambda: unsent_count(database) == 0, timeout=30, message="warm producer")
        with blackhole(sick_port):
            ids = insert_rows(database, topic, keyed_rows(KEYS, PER_KEY))
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
        assert scalar(database, "SELECT count(*) FROM outbox_dead_letters") == 0

    records = consume(cluster.bootstrap_servers, topic, min_count=len(ids) + 1, timeout=60)
    delivered = dedup_by_message_id(records)
    assert len(delivered) == len(ids) + 1
    assert_per_key_order([r for r in delivered if r.value != b"warm-up"])


def test_a_key_never_overtakes_its_own_unanswered_message_when_its_broker_goes_silent(
    make_settings: SettingsFactory, database: str, cluster: MockCluster
) -> None:
    """On a broker that accepts a bumped epoch: the partition's leader goes silent just
    past the delivery timeout (the code before the fix failed here: K:20.. first)."""
    leaders = cluster.partition_leaders(TOPIC)
    port = leaders[java_partition("K", len(leaders))]
    settings = make_settings(kafka_bootstrap_servers=cluster.bootstrap_servers, **OVERTAKE_SETTINGS)
    assert_no_key_overtakes_itself(settings, database, TOPIC, lambda: blackhole(port))
