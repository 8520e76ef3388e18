"""The consumer side over Kafka: every record the broker hands out, in order, across broker restarts.

It assigns every partition from the beginning (no group join: Tansu's is slow). The
in-memory broker comes back empty after a kill, so each incarnation is a `generation`:
the runner `suspend()`s the recorder before a kill and `resume()`s it on the new one.
"""

from __future__ import annotations

import threading
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

from tests.chaos.history import Delivered, parse_payload
from tests.harness.kafka import client_config


def _consumer(bootstrap: str) -> Consumer:
    return Consumer(
        client_config(
            bootstrap,
            **{
                "group.id": "chaos-recorder",
                "enable.auto.commit": False,
                "enable.partition.eof": False,
                "auto.offset.reset": "earliest",
                "log_level": 0,  # a paused or killed broker is the point, not news
            },
        )
    )


def high_watermarks(bootstrap: str, topic: str, partitions: int) -> dict[int, int] | None:
    consumer = _consumer(bootstrap)
    try:
        return {
            p: int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=3)[1])
            for p in range(partitions)
        }
    except KafkaException:
        return None
    finally:
        consumer.close()


MARKER_HEADER = "chaos-marker"


def put_markers(bootstrap: str, topic: str, partitions: int) -> set[str]:
    """One acknowledged marker record at the end of every partition.

    With the replicas frozen, a partition's marker comes after every record the relay
    could have seen acknowledged; reading it means the partition has been read whole.
    """
    producer = Producer(client_config(bootstrap, acks="all", log_level=0))
    markers = {uuid.uuid4().hex for _ in range(partitions)}
    failed: list[str] = []

    def report(err: object, _msg: object) -> None:
        if err is not None:
            failed.append(str(err))

    for partition, marker in enumerate(sorted(markers)):
        producer.produce(
            topic, b"", partition=partition, headers=[(MARKER_HEADER, marker)], on_delivery=report
        )
    left = producer.flush(15)
    if left or failed:
        raise AssertionError(f"markers not acknowledged: {left} left, errors {failed}")
    return markers


class KafkaRecorder:
    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self._partitions = partitions
        self._records: list[Delivered] = []
        self._next_offset: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._suspend = threading.Event()
        self._suspended = threading.Event()
        self.generation = 0
        self._markers: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="chaos-recorder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def suspend(self, timeout: float = 15.0) -> bool:
        """Close the consumer (before the broker is killed)."""
        self._suspended.clear()
        self._suspend.set()
        return self._suspended.wait(timeout)

    def resume(self) -> None:
        """Read the new broker incarnation from its beginning."""
        with self._lock:
            self.generation += 1
            self._next_offset = {}
        self._suspend.clear()

    @property
    def records(self) -> list[Delivered]:
        with self._lock:
            return list(self._records)

    def ids(self) -> set[str]:
        with self._lock:
            return {r.message_id for r in self._records}

    def read_markers(self, markers: set[str]) -> bool:
        """Has the recorder read these markers (and so everything before them)?"""
        with self._lock:
            return markers <= self._markers

    def caught_up(self) -> bool:
        """Has everything the broker holds now been read, by its high watermarks?

        Tansu's high watermark lags its log by a record batch, so this alone can miss
        the newest batch: before a broker kill, use `put_markers` + `read_markers`.
        """
        marks = high_watermarks(self._bootstrap, self._topic, self._partitions)
        if marks is None:
            return False
        with self._lock:
            return all(self._next_offset.get(p, 0) >= end for p, end in marks.items())

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._suspend.is_set():
                self._suspended.set()
                self._stop.wait(0.05)
                continue
            try:
                consumer = _consumer(self._bootstrap)
            except KafkaException:
                self._stop.wait(0.2)
                continue
            try:
                consumer.assign(
                    [
                        TopicPartition(self._topic, p, OFFSET_BEGINNING)
                        for p in range(self._partitions)
                    ]
                )
                self._consume(consumer)
            finally:
                consumer.close()

    def _consume(self, consumer: Consumer) -> None:
        generation = self.generation
        while not self._stop.is_set() and not self._suspend.is_set():
            msg = consumer.poll(0.1)
            if msg is None or msg.error():
                continue
            headers = dict(msg.headers() or [])
            marker = headers.get(MARKER_HEADER)
            if marker is not None:
                with self._lock:
                    self._markers.add(marker.decode() if isinstance(marker, bytes) else marker)
                    self._next_offset[msg.partition() or 0] = (msg.offset() or 0) + 1
                continue
            message_id = headers.get("message-id")
            raw_key = msg.key()
            key, seq = parse_payload(msg.value())
            record = Delivered(
                message_id=message_id.decode() if isinstance(message_id, bytes) else "",
                key=raw_key.decode() if isinstance(raw_key, bytes) else raw_key,
                seq=seq if key is not None else None,
                generation=generation,
                partition=msg.partition() or 0,
                offset=msg.offset() or 0,
            )
            with self._lock:
                self._records.append(record)
                self._next_offset[record.partition] = record.offset + 1
