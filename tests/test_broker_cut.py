"""One process cut off from the Kafka broker while the others still reach it.

The self-check proves the harness (tests/harness/netcut.py) with plain producers; the
relay test cuts the leader of two `relay run` replicas and expects it to give way
(RELAY_GIVE_WAY_SECONDS) to the standby, which still reaches the broker.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path

import pytest

from tests.conftest import relay_command, relay_env, start_relay
from tests.harness.kafka import TansuBroker, consume
from tests.harness.netcut import TcpProxy, loopback, namespaced, namespaces_available
from tests.support import (
    assert_per_key_order,
    dedup_by_message_id,
    insert_rows,
    keyed_rows,
    lease,
    scalar,
    unsent_count,
    wait_until,
)

GIVE_WAY_SECONDS = 2.0
DEADLINE = 30.0  # from the cut to every row consumed: the window plus a few seconds

# One message every 0.1 s; each delivery report is a line: "ok <offset>" or "err <code>".
# Short timeouts, so a cut shows as errors within seconds and a heal as "ok" again.
PRODUCER = """
import sys
from confluent_kafka import Producer

bootstrap, topic = sys.argv[1], sys.argv[2]
producer = Producer({
    "bootstrap.servers": bootstrap,
    "message.timeout.ms": 1500,
    "reconnect.backoff.max.ms": 500,
    "log_level": 0,
})

def report(err, msg):
    print(f"err {err.name()}" if err else f"ok {msg.offset()}", flush=True)

while True:
    producer.produce(topic, b"ping", on_delivery=report)
    producer.poll(0.1)
"""


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuBroker]:
    """A broker advertising `localhost`, so namespaced processes dial their own proxy."""
    if not namespaces_available():
        pytest.skip("needs root and unshare: a mount namespace per cut process")
    with TansuBroker(advertised_host="localhost") as server:
        yield server


def new_topic(broker: TansuBroker, partitions: int) -> str:
    name = f"cut-{uuid.uuid4().hex[:8]}"
    broker.create_topic(name, partitions)
    return name


def proxy_for(broker: TansuBroker, n: int) -> TcpProxy:
    proxy = TcpProxy(loopback(n), broker.port, ("127.0.0.1", broker.port))
    proxy.start()
    return proxy


class Deliveries:
    """Counts one producer's delivery reports, read from its stdout on a thread."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self._lock = threading.Lock()
        self._ok = 0
        self._errors = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace")
            with self._lock:
                if line.startswith("ok "):
                    self._ok += 1
                elif line.startswith("err "):
                    self._errors += 1

    @property
    def ok(self) -> int:
        with self._lock:
            return self._ok

    @property
    def errors(self) -> int:
        with self._lock:
            return self._errors


def test_self_check_cut_silences_one_process_and_heal_resumes_it(
    broker: TansuBroker, tmp_path: Path
) -> None:
    topic = new_topic(broker, partitions=1)
    with ExitStack() as stack:
        proxies = [proxy_for(broker, n) for n in range(2)]
        for proxy in proxies:
            stack.callback(proxy.close)
        procs = []
        for n, proxy in enumerate(proxies):
            argv = [sys.executable, "-c", PRODUCER, broker.advertised_bootstrap, topic]
            proc = subprocess.Popen(
                namespaced(argv, proxy.host, tmp_path),
                stdout=subprocess.PIPE,
                stderr=stack.enter_context((tmp_path / f"producer-{n}.err").open("wb")),
            )
            stack.callback(proc.wait, 10)
            stack.callback(proc.kill)
            procs.append(proc)
        cut, other = (Deliveries(proc) for proc in procs)

        wait_until(lambda: cut.ok >= 5 and other.ok >= 5, timeout=30, message="both delivering")
        assert all(proxy.accepted for proxy in proxies), "each process dials its own proxy"

        proxies[0].cut()
        # A partition, not a refusal: a new connection is accepted and then ignored.
        probe = socket.create_connection((proxies[0].host, broker.port), timeout=2)
        stack.callback(probe.close)
        probe.sendall(b"\x00\x00\x00\x00")
        probe.settimeout(0.5)
        with pytest.raises(TimeoutError):
            probe.recv(1)

        # Reports already on their way at the cut may still land in the first window;
        # none in the second, while the other process goes on delivering.
        mark = other.ok
        wait_until(lambda: other.ok >= mark + 10, timeout=10, message="the other delivering")
        silenced = cut.ok
        wait_until(lambda: cut.errors > 0, timeout=10, message="the cut process timing out")
        mark = other.ok
        wait_until(lambda: other.ok >= mark + 10, timeout=10, message="the other delivering")
        assert cut.ok == silenced, "a delivery through a cut link"

        proxies[0].heal()
        # Held connections are closed on heal: the client sees its end, not stale bytes.
        probe.settimeout(5)
        with suppress(ConnectionResetError):
            assert probe.recv(1) == b""
        wait_until(lambda: cut.ok >= silenced + 5, timeout=20, message="deliveries resuming")
        assert other.ok > mark + 10
        assert all(proc.poll() is None for proc in procs)


# --- the relay: a leader cut off from the broker gives way ---


def logged(log_path: Path, event: str) -> bool:
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                if json.loads(line).get("event") == event:
                    return True
            except json.JSONDecodeError:
                continue
    return False


@pytest.mark.slow
def test_a_leader_cut_off_from_the_broker_gives_way_and_every_row_arrives(
    broker: TansuBroker, relay_dsn: str, database: str, tmp_path: Path
) -> None:
    topic = new_topic(broker, partitions=3)
    names = [f"cut-{n}" for n in range(2)]
    with ExitStack() as stack:
        proxies = {name: proxy_for(broker, n) for n, name in enumerate(names)}
        for proxy in proxies.values():
            stack.callback(proxy.close)
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in names:
            env = relay_env(
                relay_dsn,
                broker.advertised_bootstrap,
                RELAY_REPLICA_ID=name,
                RELAY_LEASE_TTL_SECONDS="3",
                RELAY_GIVE_WAY_SECONDS=str(GIVE_WAY_SECONDS),
                RELAY_BATCH_SIZE="50",
            )
            command = namespaced(relay_command("run"), proxies[name].host, tmp_path)
            proc = start_relay(env, tmp_path / f"relay-{name}.log", command)
            stack.callback(proc.wait, 10)
            stack.callback(proc.kill)
            procs[name] = proc

        leader = wait_until(lambda: lease(database)[0], timeout=20, message="a leader")
        wait_until(
            lambda: (
                scalar(
                    database,
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'relay:lease'",
                )
                == 2
            ),
            timeout=20,
            message="both replicas on the lease",
        )
        # Warm-up through the leader's proxy: the path works before it is cut.
        warm = insert_rows(database, topic, keyed_rows(keys=5, per_key=2, start=0))
        wait_until(lambda: unsent_count(database) == 0, timeout=20, message="warm-up delivered")
        _, epoch = lease(database)
        assert lease(database)[0] == leader, "the lease moved before the cut"

        proxies[leader].cut()
        cut_at = time.monotonic()
        rows = insert_rows(database, topic, keyed_rows(keys=5, per_key=40, start=2))

        def taken_over() -> tuple[str, int] | None:
            holder, now = lease(database)
            return (holder, now) if holder is not None and holder != leader else None

        holder, new_epoch = wait_until(
            taken_over, timeout=DEADLINE, interval=0.05, message="another replica leading"
        )
        took = time.monotonic() - cut_at
        assert new_epoch > epoch
        wait_until(
            lambda: unsent_count(database) == 0,
            timeout=max(1.0, DEADLINE - (time.monotonic() - cut_at)),
            message="every row delivered by the replica that reaches the broker",
        )
        total = len(warm) + len(rows)
        records = consume(
            broker.bootstrap_servers,
            topic,
            min_count=total,
            timeout=max(5.0, DEADLINE - (time.monotonic() - cut_at)),
        )
        assert len(dedup_by_message_id(records)) == total, "every row consumed"
        assert_per_key_order(records)
        assert logged(tmp_path / f"relay-{leader}.log", "lease.gave_way")
        assert procs[leader].poll() is None, "the old leader stands by, it does not exit"
        print(f"takeover {took:.2f}s after the cut; {holder} leads at epoch {new_epoch}")
