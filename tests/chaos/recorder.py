"""The consumer side: every record the broker hands out, in order, across broker restarts.

It assigns every partition from the beginning (no group join: Tansu's is slow). The
in-memory broker comes back empty after a kill, so each incarnation is a `generation`:
the runner `suspend()`s the recorder before a kill and `resume()`s it on the new one.
"""

from __future__ import annotations

import threading

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from tests.chaos.history import Delivered, parse_payload


def _consumer(bootstrap: str) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "chaos-recorder",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            "auto.offset.reset": "earliest",
            "log_level": 0,  # a paused or killed broker is the point, not news
        }
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


class Recorder:
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

    def caught_up(self) -> bool:
        """Has everything the broker holds now been read?"""
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
            message_id = dict(msg.headers() or []).get("message-id")
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
