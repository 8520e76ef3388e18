"""Kafka sink on confluent-kafka (librdkafka): idempotent producer, acks=all.

Delivery reports, not `produce()` returning, are what let the drain loop mark a row.

Long: a sink is one module by design (adding a sink touches one module); here the
error classification, the producer's configuration, the relay-kept delivery deadline and
the per-batch bookkeeping (`Publishing`) belong together.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Producer

from relay.message import TOPIC, MalformedRow, OutboxMessage
from relay.observe.logging import get_logger, library_logger
from relay.settings import Settings
from relay.sinks.base import ACKED, IN_FLIGHT, SKIPPED, Outcome, Result
from relay.sinks.cloudevents import CloudEvents, is_attribute_header
from relay.sinks.kafka.settings import KafkaSettings

if TYPE_CHECKING:  # loaded only with RELAY_TRACING (the otel extra)
    from relay.observe.tracing import Tracing

log = get_logger("relay.sinks.kafka")

# Kafka's own rule for topic names (kafka.common.internals.Topic).
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

# Errors about this message that no retry can fix.
_PERMANENT = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_RECORD,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError._INVALID_ARG,
    }
)

# Errors that say the cluster (or our path to it) is down, not that this message is bad:
# the row is left untouched, attempts are not spent, the drain loop backs off as a whole.
# _MSG_TIMED_OUT may have been written ("possibly persisted"): a retry is a possible
# duplicate, never a loss.
_UNAVAILABLE = frozenset(
    {
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TIMED_OUT_QUEUE,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._QUEUE_FULL,
        KafkaError._PURGE_QUEUE,
        KafkaError._PURGE_INFLIGHT,
        KafkaError._FATAL,
        KafkaError._FENCED,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
    }
)


# The idempotent producer's own state (producer id, epoch, sequence) went bad, typically
# after requests timed out against a stalled broker. Nothing is wrong with the message:
# leave it untouched and start a fresh producer.
_PRODUCER_STATE = frozenset(
    {
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError.INVALID_PRODUCER_ID_MAPPING,
    }
)


def needs_new_producer(error: KafkaError) -> bool:
    # A delivery timeout too: an idempotent producer whose broker came back without its
    # producer state (a wiped or replaced broker) times out every later message, with no
    # fatal error, for as long as the process lives (found by tests/chaos). A fresh
    # producer costs a reconnect; timed-out messages are retried (possible duplicates).
    return (
        bool(error.fatal())
        or error.code() in _PRODUCER_STATE
        or error.code() == KafkaError._MSG_TIMED_OUT
    )


# The message was dropped with the producer it sat in (purged, or the producer turned
# fatal, e.g. by the gapless guarantee after another message's permanent error): its
# row is left untouched, without an attempt, whatever happened to the rest.
_COLLATERAL = frozenset(
    {
        KafkaError._PURGE_QUEUE,
        KafkaError._PURGE_INFLIGHT,
        KafkaError._FATAL,
        KafkaError._GAPLESS_GUARANTEE,
        KafkaError._FENCED,
    }
)


# Producer.produce's parameters in order: topic, value, key, partition, on_delivery,
# callback (an alias of on_delivery), timestamp, headers. Passed by position, the call
# costs about 0.8 µs where keywords cost 1.4 (CPython builds a dict and looks each name
# up); this is the relay's hottest call. tests/test_sink_contract.py consumes what such
# a call wrote (key, value, headers, a timestamp of now): a change of order fails there.
_ANY_PARTITION = -1  # the configured partitioner picks (RD_KAFKA_PARTITION_UA)
_NOW = 0  # no timestamp given: librdkafka stamps the message when produced

_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
_EXPIRED = "no delivery report within RELAY_SINK_TIMEOUT_SECONDS (purged, not lost)"


def classify(error: KafkaError) -> Result:
    text = f"{error.name()}: {error.str()}"
    if error.code() in _COLLATERAL or error.code() in _PRODUCER_STATE or error.fatal():
        return Result(Outcome.UNAVAILABLE, text, collateral=True)
    if needs_new_producer(error) or error.code() in _UNAVAILABLE:
        return Result(Outcome.UNAVAILABLE, text)
    # From here on the cluster answered about the message (a broker error, or metadata
    # saying its topic is unknown): the path to it works.
    if error.code() in _PERMANENT:
        return Result(Outcome.DEAD, text, reached=True)
    # Unknown topic, authorization and anything unexpected: retried per row with
    # backoff and dead-lettered after RELAY_MAX_ATTEMPTS, so an operator can fix and
    # requeue without the relay spinning.
    return Result(Outcome.RETRY, text, reached=True)


RecordHeaders = list[tuple[str, str | bytes | None]]


def record_headers(cloudevents: CloudEvents | None) -> Callable[[OutboxMessage], RecordHeaders]:
    """How a row's record headers are made: the row's plus the relay's
    (`OutboxMessage.header_pairs`), and in binary mode the CloudEvents attributes. One
    call per row either way, no test in the produce loop."""
    if cloudevents is None:
        return OutboxMessage.header_pairs
    attributes = cloudevents.attributes

    def with_cloudevents(message: OutboxMessage) -> RecordHeaders:
        """The Kafka binding: `ce_` headers, text as the others (confluent-kafka sends
        UTF-8); a row's own `ce_*` look-alikes give way to them."""
        if message.headers is None and message.unsendable is None:  # the usual row
            pairs = message.header_pairs()
        else:
            pairs = [(n, v) for n, v in message.header_pairs() if not is_attribute_header(n)]
        pairs.extend([("ce_" + name, value) for name, value in attributes(message)])
        return pairs

    return with_cloudevents


DEFAULT_TIMEOUT_SECONDS = 30.0  # RELAY_SINK_TIMEOUT_SECONDS unset


def producer_config(common: Settings) -> dict[str, Any]:
    settings = common.sink_options(KafkaSettings)
    config: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap_servers,
        "client.id": f"relay-{common.lease_name}",
        # Off by default in librdkafka: without it a retried batch can be duplicated or
        # reordered inside the partition.
        "enable.idempotence": True,
        "acks": "all",
        # Smaller requests and less broker storage for some CPU, and requests filled
        # for 5 ms: the relay's defaults, which RELAY_KAFKA__* may change.
        "compression.type": "lz4",
        "linger.ms": 5,
        # A key's partition as Java's producer (Kafka Connect, Debezium, Streams) picks
        # it: murmur2, and NULL keys spread at random. librdkafka's own default
        # (consistent_random, CRC32) puts most keys elsewhere; RELAY_KAFKA__PARTITIONER
        # keeps it for a topic the relay already wrote with it.
        "partitioner": "murmur2_random",
        # Per-key order across failures. librdkafka never times a message out itself
        # (0 = no limit): a message it timed out while later ones of its partition were
        # still queued would make it bump the idempotent producer's epoch and send those
        # later ones, so a consumer would see K:j before the retried K:i. The relay keeps
        # the deadline instead (RELAY_SINK_TIMEOUT_SECONDS): when it passes, every
        # message of the batch still queued or in flight is purged and the producer is
        # replaced, so nothing produced after an unacknowledged message is ever sent.
        "message.timeout.ms": 0,
        # Any other failure that could leave a gap in a partition (a batch the broker
        # refused mid-sequence) is fatal instead of papered over with an epoch bump.
        "enable.gapless.guarantee": True,
    }
    config.update(settings.librdkafka_config())
    return config


class KafkaSink:
    name = "kafka"
    serial_per_key = False

    def __init__(self, common: Settings, tracing: Tracing | None = None) -> None:
        settings = common.sink_options(KafkaSettings)
        self._config = producer_config(common)
        self._config["error_cb"] = self._on_client_error
        client_log = library_logger("librdkafka", "kafka.client_log")
        if not any(isinstance(f, _KnownConfigWarnings) for f in client_log.filters):
            client_log.addFilter(_KnownConfigWarnings())
        self._config["logger"] = client_log
        self._topic_map = common.topic_map
        self._headers_of = record_headers(CloudEvents.from_settings(common))
        self._topics: dict[str, str] = {}  # outbox topic -> validated Kafka topic
        # How long a batch may wait for room in librdkafka's queue and for its reports.
        self._max_wait = common.sink_timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        self.max_publish_seconds = self._max_wait
        # How long without any report before a batch whose other messages were answered
        # leaves its stragglers (a sick partition's) in flight and lets the loop go on.
        self._straggler_wait = settings.kafka_straggler_seconds
        self.last_ack = float("-inf")  # monotonic time of the latest acknowledgement
        self._acks = [0]  # acknowledgements so far, counted by every batch's reports
        self._acks_timed = 0  # the count when `last_ack` was last taken
        self._producer = Producer(self._config)
        self._needs_new_producer = False

    def _on_client_error(self, error: KafkaError) -> None:
        if needs_new_producer(error):
            self._needs_new_producer = True
        # A refused or dropped connection is also in librdkafka's own log line
        # (kafka.client_log, FAIL): at warning level once is enough during an outage.
        emit = log.debug if error.code() == KafkaError._TRANSPORT else log.warning
        emit("kafka.client_error", code=error.name(), error=error.str(), fatal=error.fatal())

    def topic_for(self, message: OutboxMessage) -> str:
        topic = self._topics.get(message.topic)
        if topic is None:
            topic = self._topic_map.get(message.topic, message.topic)
            if not _TOPIC_NAME.match(topic) or topic in {".", ".."}:
                raise MalformedRow(f"invalid Kafka topic name {topic!r}")
            if len(self._topics) < 10_000:  # bounded: topics come from app rows
                self._topics[message.topic] = topic
        return topic

    def publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> list[Result]:
        return self.start_publish(messages, abandon).wait()

    def start_publish(
        self, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> Publishing:
        """Hand the batch to librdkafka and return at once; `wait()` collects the
        reports (the drain's next read runs meanwhile, on the reader's thread)."""
        if self._needs_new_producer:
            self._replace_producer()
        publishing = Publishing(self, self._producer, len(messages), abandon)
        # Not `pending += self._produce_batch(...)`: that would read `pending` before the
        # reports served while producing subtract from it.
        produced = self._produce_batch(publishing, messages, abandon)
        publishing.pending += produced
        # flush(0): ask librdkafka to send the batch's tail now rather than after
        # linger.ms: nothing more joins this batch.
        failure = self._serve(self._producer, 0, flush=True)
        if publishing.failure is None:  # expired while producing: keep that verdict
            publishing.failure = failure
        return publishing

    def _produce_batch(
        self, publishing: Publishing, messages: Sequence[OutboxMessage], abandon: Callable[[], bool]
    ) -> int:
        """The loop runs once per row the relay ever moves: the usual row (a known topic,
        no headers of its own) takes the shortest way. Returns the count produced."""
        results = publishing.results
        produce, report, topics = self._producer.produce, publishing.report, self._topics
        headers_of = self._headers_of
        blocked: set[str] = set()
        key_topic = _key_topics(messages)
        produced = 0
        for index, message in enumerate(messages):
            key = message.key
            if key is not None and key in blocked:
                results[index] = SKIPPED
                continue
            try:
                topic = topics.get(message.topic) or self.topic_for(message)
                headers = headers_of(message)  # header_pairs: a short way for the usual row
            except MalformedRow as exc:
                results[index] = Result(Outcome.DEAD, str(exc))
                if key is not None:
                    blocked.add(key)
                continue
            if (
                key_topic is not None
                and key is not None
                and key_topic.setdefault(key, topic) != topic
            ):
                results[index] = SKIPPED
                blocked.add(key)
                continue
            if index % 64 == 0 and abandon():
                publishing.never_sent(index)  # lease gone or shutdown grace over
                break
            produced += 1
            try:
                # Positional (see _ANY_PARTITION): a third less CPU than keywords.
                produce(
                    topic,
                    message.payload,
                    key,
                    _ANY_PARTITION,
                    partial(report, index),
                    None,
                    _NOW,
                    headers,
                )
                continue
            except BufferError:
                # Local queue full: serve delivery reports to make room, then again.
                if not self._produce_when_room(publishing, topic, message, headers, index):
                    produced -= 1
                    publishing.never_sent(index)  # gave up waiting for queue room
                    break
            except KafkaException as exc:
                report(index, exc.args[0])
            if results[index] is not None and key is not None:
                blocked.add(key)  # produce() refused it (too large, bad argument)
        return produced

    def _serve(
        self, producer: Producer, timeout: float, *, flush: bool = False
    ) -> KafkaError | None:
        """Serve delivery reports; a fatal producer error surfaces here as an exception.

        `flush`: wait as flush() does, which also tells librdkafka to send what it holds
        at once instead of lingering. The whole batch is already produced and we wait
        for all of it, so `linger.ms` would only add its full length to every batch
        (measured, batch 500, linger 5 ms: 42k rows/s waiting with poll(), 86k with flush()).
        """
        try:
            if flush:
                producer.flush(timeout)
            else:
                producer.poll(timeout)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            self._needs_new_producer = True
            log.warning("kafka.producer_failed", code=error.name(), error=error.str())
            return error
        finally:
            # Timed here, once, not in every report; counts served elsewhere (a purge's
            # poll, a flush at stop) are timed at the next serve.
            if self._acks[0] != self._acks_timed:
                self._acks_timed = self._acks[0]
                self.last_ack = time.monotonic()
        return None

    def _produce_when_room(
        self,
        publishing: Publishing,
        topic: str,
        message: OutboxMessage,
        headers: list[tuple[str, str | bytes | None]],
        index: int,
    ) -> bool:
        """librdkafka's queue is full: serve reports until `produce()` takes the
        message; False if we gave up waiting for room."""
        producer = publishing.producer
        while True:
            if self._serve(producer, 0.05) is not None or publishing.abandon():
                return False
            if time.monotonic() > publishing.deadline:
                publishing.expire()  # the broker has taken nothing for too long
                return False
            try:
                producer.produce(
                    topic,
                    message.payload,
                    message.key,
                    _ANY_PARTITION,
                    partial(publishing.report, index),
                    None,
                    _NOW,
                    headers,
                )
                return True
            except BufferError:
                continue
            except KafkaException as exc:
                publishing.report(index, exc.args[0])
                return True

    def _replace_producer(self) -> None:
        log.warning(
            "kafka.producer_recreated",
            reason="producer state lost (fatal or fenced), or a batch timed out",
        )
        # Nothing the old producer still holds may go out now: it would land after
        # messages its replacement sends (and after an earlier message of its key that
        # failed). What it already sent may still land: a possible duplicate.
        _purge_everything(self._producer)
        self._producer = Producer(self._config)
        self._needs_new_producer = False

    def stop_sending(self) -> None:
        # The queue only: purging requests in flight trips the gapless guarantee (a
        # fatal producer, and callbacks that then fail on whichever thread serves them).
        # A request in flight that fails is queued again, and the next tick drops it.
        # No poll here: delivery callbacks run on the drain thread.
        producer = self._producer
        if len(producer):
            with contextlib.suppress(KafkaException, RuntimeError):
                producer.purge(in_queue=True, in_flight=False, blocking=False)

    def reset(self) -> None:
        if len(self._producer):
            self._replace_producer()

    def check(self, timeout: float) -> str:
        metadata = self._producer.list_topics(timeout=timeout)
        return f"kafka: ok ({len(metadata.brokers)} broker(s), {len(metadata.topics)} topic(s))"

    def flush(self, timeout: float) -> int:
        try:
            return int(self._producer.flush(timeout))
        except KafkaException as exc:
            self._needs_new_producer = True
            log.warning("kafka.producer_failed", error=str(exc.args[0]))
            return len(self._producer)

    def close(self) -> None:
        self._producer.flush(0)


def _key_topics(messages: Sequence[OutboxMessage]) -> dict[str, str] | None:
    """Kafka orders a key only within one partition of one topic. A later row of a key
    bound for another topic waits for the next batch, after the earlier one is settled,
    so a failure of the first cannot be overtaken by the second. None: a batch of one
    topic, the usual one, needs no check."""
    return {} if len(set(map(TOPIC, messages))) > 1 else None


class _KnownConfigWarnings(logging.Filter):
    """librdkafka calls enable.gapless.guarantee "experimental" at every producer start;
    the relay sets it on purpose (see producer_config), so that line is only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("CONFWARN" in message and "enable.gapless.guarantee" in message)


def _purge_everything(producer: Producer) -> None:
    """Drop what the producer holds and collect the purge reports now: an unreported
    message keeps its callback, and through it the producer, alive."""
    with contextlib.suppress(KafkaException, RuntimeError):
        producer.purge(in_queue=True, in_flight=True, blocking=True)
        for _ in range(20):
            producer.poll(0.01)
            if len(producer) == 0:
                break


class Publishing:
    """One batch handed to librdkafka, its delivery reports still coming back."""

    def __init__(
        self, sink: KafkaSink, producer: Producer, size: int, abandon: Callable[[], bool]
    ) -> None:
        self.sink = sink
        self.producer = producer
        self.abandon = abandon
        self.results: list[Result | None] = [None] * size
        self.pending = 0
        self._acks = sink._acks
        self._pending_seen = 0  # `pending` when we last looked (see `_heard`)
        self.failure: KafkaError | None = None
        self.deadline = time.monotonic() + sink._max_wait
        self.expired = False
        self.created = self.last_report = time.monotonic()

    def never_sent(self, start: int) -> None:
        """Rows from `start` on were not handed to librdkafka: untouched (SKIPPED), never
        mistaken for messages still in flight."""
        for index in range(start, len(self.results)):
            if self.results[index] is None:
                self.results[index] = SKIPPED

    def _current(self) -> bool:
        """Our producer is still the sink's: only then may we condemn it."""
        return self.producer is self.sink._producer

    def expire(self) -> None:
        """The batch's deadline passed: purge what is queued or in flight (reported as
        timed out) and start a fresh producer next batch."""
        self.expired = True
        _purge_everything(self.producer)
        if self._current():
            self.sink._needs_new_producer = True
        self.failure = KafkaError(KafkaError._MSG_TIMED_OUT, _EXPIRED)

    def report(self, index: int, error: KafkaError | None, _message: object = None) -> None:
        """librdkafka's delivery report for the message at `index` (its callback, or
        `produce()` refusing it). An acknowledgement only counts: its time is taken
        where reports are served (`KafkaSink._serve`, `_heard`), once per batch."""
        if error is None:
            self.results[index] = ACKED
            self._acks[0] += 1
        elif self.expired and error.code() in _PURGED:
            # Purged by our own deadline: no report in time, like a timeout. Not
            # collateral: a sick partition's rows must back off (and eventually be
            # dead-lettered) while the rest of the sink acknowledges.
            self.results[index] = Result(Outcome.UNAVAILABLE, _EXPIRED)
        else:
            self.results[index] = classify(error)
            if needs_new_producer(error) and self._current():
                self.sink._needs_new_producer = True
        self.pending -= 1

    def _heard(self) -> None:
        """After serving reports: if any of this batch's came (whoever served them),
        this is the latest time we heard of it."""
        if self.pending != self._pending_seen:
            self._pending_seen = self.pending
            self.last_report = time.monotonic()

    def _straggling(self) -> bool:
        """No report for a while, yet the broker acknowledged messages lately (this
        batch's or others'): what still waits is held by a sick partition, not by a
        broker that is down (then the batch waits for its deadline, as a whole)."""
        now = time.monotonic()
        # "Lately": since this batch was handed over, or just before it; a broker that
        # went down as a whole acknowledges nothing from then on.
        acked_lately = self.sink.last_ack >= self.created - 4 * self.sink._straggler_wait
        return now - self.last_report >= self.sink._straggler_wait and acked_lately

    def wait(self, *, leave_stragglers: bool = False) -> list[Result]:
        """Every message's outcome, once each has its report (or we stop waiting)."""
        sink, producer = self.sink, self.producer
        abandoned = False
        failure = self.failure
        # The quiet time counts from now: reports may be waiting unserved since the
        # batch was produced, and must not make the whole batch look stuck.
        self.last_report = max(self.last_report, time.monotonic())
        self._pending_seen = self.pending
        while failure is None and self.pending > 0:
            if self.abandon():
                abandoned = True
                break
            if leave_stragglers and self._straggling():
                # Not purged: they stay queued in their partition, in order, and may
                # still be delivered; the loop asks again (`again`) and holds their keys.
                return [IN_FLIGHT if result is None else result for result in self.results]
            if time.monotonic() > self.deadline:
                # Reports that arrived and are not served yet count: purging
                # acknowledged messages would only make duplicates.
                failure = sink._serve(producer, 0, flush=True)
                if failure is not None or self.pending == 0:
                    break
                self.expire()
                failure = self.failure
                break
            failure = sink._serve(producer, 0.05, flush=True)
            self._heard()
        if abandoned and self.pending > 0:
            # Stop publishing at once (lease lost or shutdown overdue): drop what has
            # not left the client yet. What is already in flight may still land.
            with contextlib.suppress(KafkaException):
                producer.purge(in_queue=True, in_flight=False, blocking=False)
                producer.poll(0)
        if failure is not None:
            # The producer died, or reports are overdue: nothing unreported can be
            # trusted as sent, and nothing about these rows is wrong. The drain loop
            # backs off and they go again (possibly as duplicates).
            lost = classify(failure)
            return [lost if result is None else result for result in self.results]
        return [SKIPPED if result is None else result for result in self.results]

    def again(self) -> list[Result]:
        """The stragglers' outcomes so far. Past the batch's deadline the rest is purged
        (and the producer replaced), like a batch that timed out as a whole."""
        if self.pending > 0:
            failure = self.sink._serve(self.producer, 0)
            if failure is None and self.pending > 0 and time.monotonic() > self.deadline:
                self.expire()
                failure = self.failure
            if failure is not None and self.pending > 0:
                lost = classify(failure)
                return [lost if result is None else result for result in self.results]
        if self.pending == 0:  # every message handed over has its report
            return [SKIPPED if result is None else result for result in self.results]
        return [IN_FLIGHT if result is None else result for result in self.results]
