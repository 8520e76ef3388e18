"""A leader that cannot reach the sink, while a standby can, hands the lease over.

Two `relay run` replicas with the HTTP sink, each posting to its own real endpoint: the
leader's endpoint going away cuts the leader off from "the sink" and nothing else (the
database, the other replica). The Kafka version, with a per-process network cut, is in
tests/test_broker_cut.py.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import relay_env, start_relay
from tests.harness.webhook import Reply, WebhookServer
from tests.support import insert_rows, keyed_rows, lease, scalar, unsent_count, wait_until

pytestmark = pytest.mark.slow

GIVE_WAY_SECONDS = 2.0


def events(log_path: Path, name: str) -> list[dict[str, object]]:
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == name:
                found.append(event)
    return found


def stays_with(dsn: str, expected: tuple[str, int], seconds: float) -> None:
    """The lease keeps its holder and epoch for `seconds`: watched, not assumed."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert lease(dsn) == expected
        time.sleep(0.1)


class Replica:
    def __init__(self, name: str, dsn: str, endpoint: WebhookServer, workdir: Path) -> None:
        self.name = name
        self.endpoint = endpoint
        self.log_path = workdir / f"relay-{name}.log"
        self.env = relay_env(
            dsn,
            RELAY_SINK="http",
            RELAY_HTTP_URL=endpoint.url + "/hooks/{topic}",
            RELAY_SINK_TIMEOUT_SECONDS="2",
            RELAY_REPLICA_ID=name,
            RELAY_LEASE_TTL_SECONDS="3",
            RELAY_GIVE_WAY_SECONDS=str(GIVE_WAY_SECONDS),
            RELAY_BATCH_SIZE="50",
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = start_relay(self.env, self.log_path)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def pair(relay_dsn: str, database: str, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    endpoints = [WebhookServer(), WebhookServer()]
    for endpoint in endpoints:
        endpoint.start()
    a = Replica("a", relay_dsn, endpoints[0], tmp_path)
    b = Replica("b", relay_dsn, endpoints[1], tmp_path)
    # `a` leads: it starts alone and takes the lease before `b` exists.
    a.start()
    wait_until(lambda: lease(database)[0] == "a", timeout=20, message="a leading")
    b.start()
    wait_until(
        lambda: scalar(database, "SELECT count(*) FROM replicas WHERE sink_ok") == 2,
        timeout=20,
        message="both replicas beating, both reaching their endpoint",
    )
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()
        for endpoint in endpoints:
            endpoint.stop()


def test_a_leader_cut_off_from_the_sink_gives_way_to_a_standby_that_reaches_it(
    database: str, pair: tuple[Replica, Replica]
) -> None:
    a, b = pair
    _, epoch = lease(database)
    a.endpoint.stop()  # the leader's only path to the sink: connections refused
    ids = insert_rows(database, "orders", keyed_rows(keys=5, per_key=20))
    cut = time.monotonic()

    wait_until(
        lambda: unsent_count(database) == 0,
        timeout=GIVE_WAY_SECONDS + 25,
        message="every row delivered by the replica that reaches the sink",
    )
    took = time.monotonic() - cut
    holder, new_epoch = lease(database)
    assert holder == "b" and new_epoch > epoch
    assert len(b.endpoint.acked_ids()) >= len(ids)
    gave_way = events(a.log_path, "lease.gave_way")
    assert len(gave_way) == 1, gave_way
    assert float(str(gave_way[0]["stalled_seconds"])) >= GIVE_WAY_SECONDS
    # The window, a heartbeat and a poll, not a ttl after ttl of renewals.
    assert took < GIVE_WAY_SECONDS + 15, took
    # `a` still cannot reach its endpoint: it defers and does not take the lease back.
    assert events(a.log_path, "lease.deferring")


def test_when_no_replica_reaches_the_sink_the_lease_stays_and_nothing_is_lost(
    database: str, pair: tuple[Replica, Replica]
) -> None:
    a, b = pair
    _, epoch = lease(database)
    a.endpoint.stop()
    b.endpoint.stop()
    # The standby's probe says it cannot reach its endpoint, then the rows come: a
    # leader whose deliveries fail gives way to a peer whose last heartbeat still said
    # it could, as it should. The leader's traffic is its own probe.
    wait_until(
        lambda: (
            scalar(database, "SELECT count(*) FROM replicas WHERE NOT sink_ok AND replica_id = 'b'")
            == 1
        ),
        timeout=20,
        message="the standby reporting its sink unreachable",
    )
    ids = insert_rows(database, "orders", keyed_rows(keys=3, per_key=10))
    wait_until(
        lambda: scalar(database, "SELECT count(*) FROM replicas WHERE NOT sink_ok") == 2,
        timeout=20,
        message="both replicas reporting the sink unreachable",
    )
    # Three give-way windows with nobody able: the leader keeps the lease, rows wait.
    stays_with(database, ("a", epoch), seconds=3 * GIVE_WAY_SECONDS)
    assert unsent_count(database) == len(ids)
    assert not events(a.log_path, "lease.gave_way")

    # Only `b` gets its endpoint back: now `a` gives way to it, and every row goes.
    revived = WebhookServer(port=b.endpoint.port)
    revived.start()
    try:
        wait_until(
            lambda: unsent_count(database) == 0,
            timeout=GIVE_WAY_SECONDS + 25,
            message="every row delivered once b reaches its endpoint again",
        )
        assert lease(database)[0] == "b"
        assert len(revived.acked_ids()) == len(ids)
        assert scalar(database, "SELECT count(*) FROM outbox WHERE attempts > 0") == 0
    finally:
        revived.stop()


def test_a_leader_whose_sink_answers_with_errors_keeps_the_lease(
    database: str, pair: tuple[Replica, Replica]
) -> None:
    """An answer, even a refusal, proves the path to the sink works: the standby would
    meet the same 500s. Rows back off and retry; the lease does not move."""
    a, _ = pair
    _, epoch = lease(database)
    a.endpoint.respond = lambda _delivery: Reply(status=500)
    insert_rows(database, "orders", keyed_rows(keys=2, per_key=3))
    wait_until(
        lambda: scalar(database, "SELECT count(*) FROM outbox WHERE attempts > 0") > 0,
        timeout=20,
        message="the endpoint refusing rows",
    )
    stays_with(database, ("a", epoch), seconds=3 * GIVE_WAY_SECONDS)
    assert not events(a.log_path, "lease.gave_way")
