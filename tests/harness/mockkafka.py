"""A three-broker Kafka cluster (librdkafka's mock cluster) whose brokers listen on real
loopback ports, plus a firewall rule that makes one of them a black hole.

Tansu is one broker holding every partition: it can stall as a whole, never one
partition alone. librdkafka's mock cluster spreads partitions over several brokers, each
on its own TCP port, and speaks the protocol over real sockets to any client (the relay
included), so dropping one broker's packets leaves the partitions it leads sick while the
others stay healthy. The cluster lives inside a producer object of the test process.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Iterator

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from tests.harness import Service

_BOOTSTRAP = re.compile(r"[Mm]ock cluster \S+ bootstrap\.servers=(\S+)")


class MockCluster(Service):
    def __init__(self, brokers: int = 3) -> None:
        self.brokers = brokers
        self.bootstrap_servers = ""
        self._holder: Producer | None = None
        self._lines: list[str] = []

    def start(self) -> None:
        lines = self._lines

        class Capture(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        logger = logging.getLogger(f"mockkafka.{id(self)}")
        logger.propagate = False
        logger.addHandler(Capture())
        logger.setLevel(logging.DEBUG)
        self._holder = Producer(
            {"test.mock.num.brokers": self.brokers, "logger": logger, "debug": "mock"}
        )
        deadline = time.monotonic() + 10
        while not self.bootstrap_servers:
            self._holder.poll(0.05)
            for line in lines:
                if match := _BOOTSTRAP.search(line):
                    self.bootstrap_servers = match.group(1)
            if time.monotonic() > deadline:
                raise RuntimeError("the mock cluster did not say where it listens")

    def stop(self) -> None:
        self._holder = None  # the cluster goes with the producer that holds it

    def partition_leaders(self, topic: str) -> dict[int, int]:
        """partition -> port of its leader; the topic is auto-created on first ask."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        deadline = time.monotonic() + 10
        while True:
            metadata = admin.list_topics(topic, timeout=5)
            found = metadata.topics.get(topic)
            if found is not None and found.error is None and found.partitions:
                ports = {b.id: b.port for b in metadata.brokers.values()}
                leaders = {p.id: p.leader for p in found.partitions.values()}
                if all(leader in ports for leader in leaders.values()):
                    return {p: ports[leader] for p, leader in leaders.items()}
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic} not ready on the mock cluster")
            time.sleep(0.1)


def iptables_available() -> bool:
    return shutil.which("iptables") is not None


@contextlib.contextmanager
def blackhole(port: int) -> Iterator[None]:
    """Drop every packet to and from 127.0.0.1:`port` (no RST, no FIN): the broker there
    goes silent for everyone, mid-connection too. The rules go when the block ends."""
    rules = [
        ["OUTPUT", "-p", "tcp", "-d", "127.0.0.1", "--dport", str(port), "-j", "DROP"],
        ["INPUT", "-p", "tcp", "-s", "127.0.0.1", "--sport", str(port), "-j", "DROP"],
    ]
    added: list[list[str]] = []
    try:
        for rule in rules:
            subprocess.run(["iptables", "-w", "-I", *rule], check=True, timeout=30)
            added.append(rule)
        yield
    finally:
        for rule in added:
            subprocess.run(["iptables", "-w", "-D", *rule], check=False, timeout=30)
