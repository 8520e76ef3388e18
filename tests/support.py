"""Helpers the tests share: waiting on conditions, writing outbox rows, reading history."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar, cast

import psycopg
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from relay.daemon.app import RelayApp
from relay.settings import Settings
from relay.sinks.kafka.sink import KafkaSink
from tests.harness.kafka import Record, consume

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None], timeout: float, interval: float = 0.02, message: str = ""
) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message or condition}")
        time.sleep(interval)


def insert_rows(
    dsn: str,
    topic: str,
    rows: Iterable[tuple[str | None, bytes | None]],
    headers: dict[str, Any] | None = None,
) -> list[int]:
    """Insert (key, payload) rows in one transaction; return their ids in order."""
    with psycopg.connect(dsn, autocommit=False) as conn:
        ids = []
        for key, payload in rows:
            row = conn.execute(
                "INSERT INTO outbox (topic, key, payload, headers) VALUES (%s, %s, %s, %s)"
                " RETURNING id",
                (topic, key, payload, None if headers is None else json.dumps(headers)),
            ).fetchone()
            assert row is not None
            ids.append(int(row[0]))
        conn.commit()
    return ids


def keyed_rows(keys: int, per_key: int, start: int = 0) -> list[tuple[str, bytes]]:
    """Interleaved keys; the payload says which key and which step: `k3:17`."""
    steps = range(start, start + per_key)
    return [(f"k{k}", f"k{k}:{i}".encode()) for i in steps for k in range(keys)]


def scalar(dsn: str, sql: str, params: Sequence[Any] = ()) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
        return None if row is None else row[0]


def lease(dsn: str, name: str = "default") -> tuple[str | None, int]:
    """The lease row as (live holder or None, epoch)."""
    row = scalar(
        dsn,
        "SELECT json_build_array(CASE WHEN expires_at > now() THEN holder END, epoch)"
        " FROM leases WHERE name = %s",
        (name,),
    )
    holder, epoch = row if row else (None, 0)
    return holder, int(epoch)


def live_holder(dsn: str) -> str | None:
    """The default lease's holder while the lease is live."""
    holder: str | None = scalar(
        dsn, "SELECT holder FROM leases WHERE name = 'default' AND expires_at > now()"
    )
    return holder


def new_holder(dsn: str, old: str | None) -> str | None:
    holder = live_holder(dsn)
    return holder if holder is not None and holder != old else None


def pid_of(holder: str | None) -> int:
    assert holder
    return int(holder.split(":")[1])


def outbox_indexes(dsn: str) -> dict[str, str]:
    """The outbox's indexes: name -> definition."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'outbox'"
        ).fetchall()
    return {name: definition for name, definition in rows}


def unsent_count(dsn: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM outbox"))


def sample(name: str, **labels: str) -> float:
    """One series of this process's metrics (an in-process relay's), 0 while absent."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def failed_deliveries(sink: str, topic: str) -> float:
    """Messages of `topic` an in-process relay handed to `sink` that came back without
    an acknowledgement: the sink unreachable or past its deadline (`unavailable`), or a
    failure of the message's own while others were acknowledged (`retry`)."""
    return sum(
        sample("relay_messages_total", sink=sink, topic=topic, outcome=outcome)
        for outcome in ("unavailable", "retry")
    )


def dedup_by_message_id(records: Sequence[Record]) -> list[Record]:
    """Keep each message's first delivery, in consumption order."""
    seen: set[bytes] = set()
    unique = []
    for record in records:
        mid = record.headers["message-id"]
        if mid not in seen:
            seen.add(mid)
            unique.append(record)
    return unique


def assert_per_key_order(records: Sequence[Record]) -> None:
    """After dedup, each key's steps (payload `k:i`) arrive as 0, 1, 2, ... without gaps."""
    by_key: dict[str, list[int]] = {}
    for record in dedup_by_message_id(records):
        assert record.value is not None
        key, step = record.value.decode().split(":")
        assert record.key == key
        by_key.setdefault(key, []).append(int(step))
    for key, steps in by_key.items():
        assert steps == sorted(steps), f"key {key} out of order: {steps}"


class SteadyWriter(threading.Thread):
    """Commits one row per key every 20 ms: at least `steps` steps, and on until
    `until()` holds, so a fault armed mid-drain always has rows to fire on."""

    def __init__(
        self,
        dsn: str,
        topic: str,
        steps: int,
        keys: int = 10,
        until: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__()
        self.dsn, self.topic, self.steps, self.keys = dsn, topic, steps, keys
        self.until = until or (lambda: True)
        self.written = 0
        self.start()

    def run(self) -> None:
        step = 0
        deadline = time.monotonic() + 60
        while step < self.steps or (not self.until() and time.monotonic() < deadline):
            rows = [(f"k{k}", f"k{k}:{step}".encode()) for k in range(self.keys)]
            insert_rows(self.dsn, self.topic, rows)
            self.written += len(rows)
            step += 1
            time.sleep(0.02)


@contextmanager
def running_relay(settings: Settings) -> Iterator[RelayApp]:
    """An in-process relay on a thread; stopped the way SIGTERM stops it."""
    app = RelayApp(settings)
    thread = threading.Thread(target=app.run, name=f"relay-{settings.replica_id}", daemon=True)
    thread.start()
    try:
        yield app
    finally:
        app.shutdown.request()
        thread.join(timeout=30)
        assert not thread.is_alive(), "relay did not stop within 30 s"


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body); status 0 while nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """One /metrics scrape as {(sample name, labels): value}; empty if not up."""
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    if status != 200:
        return {}
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def metric(port: int, name: str, **labels: str) -> float | None:
    """The value of one series on one replica, None if absent or the replica is down."""
    return scrape(port).get((name, frozenset(labels.items())))


# The reliability issue's first case: a key's rows fill a small producer queue while the
# broker (or the partition's leader) is silent just past the delivery timeout.
OVERTAKE_SETTINGS: dict[str, Any] = {
    "batch_size": 200,
    "sink_timeout_seconds": 1.5,
    # A small queue, and requests of two messages: the queue fills while the broker is
    # silent, and the rest of the batch waits to be produced.
    "kafka": {"queue_buffering_max_messages": "20", "batch_num_messages": "2"},
}


def assert_no_key_overtakes_itself(
    settings: Settings,
    dsn: str,
    topic: str,
    silence: Callable[[], AbstractContextManager[object]],
) -> None:
    """Had librdkafka timed the first messages out itself, it would have bumped the
    idempotent producer's epoch and sent the later ones once the broker answered again:
    K:20.. before the retried K:0. Per key, the consumed sequence never goes back."""
    with running_relay(settings) as app:
        sink = cast(KafkaSink, app.sink)
        insert_rows(dsn, topic, [("warm", b"warm:0")])
        wait_until(lambda: unsent_count(dsn) == 0, timeout=30, message="producer warm")
        failed = failed_deliveries("kafka", topic)

        def given_up() -> bool:
            """A message of K given up on past its delivery timeout, by whoever keeps
            it: the relay (its batch came back unanswered) or, were the timeout left to
            librdkafka, the producer (a timed-out message condemns it)."""
            return failed_deliveries("kafka", topic) > failed or sink._needs_new_producer

        assert not given_up(), "the producer was condemned before the fault"
        with silence():
            insert_rows(dsn, topic, [("K", f"K:{i}".encode()) for i in range(300)])
            # The fault: silent just past the delivery timeout (not a guessed sleep:
            # until the timeout has fired), then answering again at once, every row
            # of K still unsent behind the unanswered K:0.
            wait_until(given_up, timeout=30, message="K given up on at its delivery timeout")
            assert unsent_count(dsn) == 300, "a row of K was marked sent during the silence"
        wait_until(lambda: unsent_count(dsn) == 0, timeout=90, message="all delivered")
    assert settings.kafka_bootstrap_servers
    records = consume(settings.kafka_bootstrap_servers, topic, min_count=301, timeout=60)
    steps = [
        int(r.value.decode().split(":")[1])
        for r in dedup_by_message_id(records)
        if r.key == "K" and r.value is not None
    ]
    assert steps == list(range(300)), steps[:40]


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A JSON plan's node and every node under it."""
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)
