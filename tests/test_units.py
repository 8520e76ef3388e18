"""Pure functions: SQL catalogue, backoff bounds, header encoding, topic rules."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from relay.backoff import Backoff
from relay.message import MalformedRow, OutboxMessage
from relay.metrics import Health
from relay.queries import QUERIES
from relay.sinks.base import Outcome
from relay.sinks.kafka import classify


def test_every_query_the_code_names_exists() -> None:
    used: set[str] = set()
    for path in Path("relay").rglob("*.py"):
        used |= set(re.findall(r"QUERIES\.([a-z_]+)", path.read_text()))
    used -= {"names", "get"}
    assert used <= set(QUERIES.names()), used - set(QUERIES.names())
    assert set(QUERIES.names()) <= used, f"unused queries: {set(QUERIES.names()) - used}"


def test_backoff_grows_is_jittered_and_capped() -> None:
    backoff = Backoff(base=0.5, cap=30.0)
    for failures in range(1, 200):
        ceiling = min(30.0, 0.5 * 2 ** (failures - 1))
        delays = {backoff.delay(failures) for _ in range(20)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(delays) > 1  # jittered
    assert backoff.delay(0) == 0.0


def message(headers: object) -> OutboxMessage:
    return OutboxMessage(
        id=1,
        message_id=str(uuid.UUID(int=7)),
        topic="t",
        key="k",
        payload=b"x",
        headers=headers,
        created_at="2026-01-02T03:04:05.000000Z",
        created_epoch=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp(),
        attempts=0,
    )


def test_headers_carry_row_headers_and_message_id() -> None:
    pairs = dict(message({"trace": "abc", "n": 3, "ok": True, "none": None}).header_pairs())
    assert pairs == {
        "trace": "abc",
        "n": "3",
        "ok": "true",
        "message-id": str(uuid.UUID(int=7)),
        "created-at": "2026-01-02T03:04:05.000000Z",
    }


def test_a_row_cannot_forge_the_message_id() -> None:
    pairs = message({"message-id": "forged"}).header_pairs()
    assert [v for k, v in pairs if k == "message-id"] == [str(uuid.UUID(int=7))]


@pytest.mark.parametrize("headers", [[1, 2], "text", {"nested": {"a": 1}}, {"list": [1]}])
def test_undecodable_headers_are_malformed(headers: object) -> None:
    with pytest.raises(MalformedRow):
        message(headers).header_pairs()


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, Outcome.DEAD),
        (KafkaError._MSG_TIMED_OUT, Outcome.UNAVAILABLE),
        (KafkaError._ALL_BROKERS_DOWN, Outcome.UNAVAILABLE),
        (KafkaError.PRODUCER_FENCED, Outcome.UNAVAILABLE),
        (KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, Outcome.UNAVAILABLE),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, Outcome.RETRY),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, Outcome.RETRY),
    ],
)
def test_kafka_error_classification(code: int, outcome: Outcome) -> None:
    assert classify(KafkaError(code)).outcome is outcome


def test_health_names_the_loop_that_stopped_beating() -> None:
    now = [100.0]
    health = Health(clock=lambda: now[0])
    health.register("main", stale_after=60.0)
    health.register("elector", stale_after=30.0)
    now[0] += 40.0
    health.beat("main")
    assert health.stalled() == ["elector"] and not health.alive()
    assert health.describe() == "elector=40.0s main=0.0s"
    health.beat("elector")
    assert health.alive()
