"""The drain loop (docs/DESIGN.md, "Draining"), run while this replica holds the lease.

    fetch the next unsent rows in id order (never a last-seen-id cursor)
    publish them; while their acknowledgements come back, fetch the batch after them
    wait for every acknowledgement
    settle: atomically, fenced on our lease epoch (one transaction; one statement when
            every row was acknowledged), mark the acknowledged rows
            sent (or delete them), back off the failed ones, dead-letter the hopeless;
            this runs on the settler's own session while the loop publishes the next
            batch, so at most two batches are ever published and not yet settled,
            plus up to a batch of stragglers: rows a sick partition holds while the rest
            of their batch was answered (Kafka), their keys held until they settle
    repeat; when there is nothing to do, poll adaptively
    give the lease way when nothing was delivered for RELAY_GIVE_WAY_SECONDS while rows
            wait and a live peer reports it reaches the sink (relay/presence.py)

Every fetch leaves out the rows published and not yet settled. A failed row blocks later
rows of its key only: the fetch query skips them once the failure is written, and until
then the loop holds the key back itself. The lease check inside the settle is what makes
a paused or partitioned ex-leader harmless.

Long: the loop reads like the protocol above only if its steps (fetch rounds, publish,
settle, stragglers' bookkeeping, backing off, giving way) sit together; the policy
(relay/outcomes.py), the settle (relay/settler.py) and the stragglers' list
(relay/stragglers.py) are out already.
"""

from __future__ import annotations

import operator
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import psycopg

from relay import db, failpoints, lease_metrics, metrics, repository, screen, tracing
from relay.backoff import Backoff, Retrying
from relay.lease import Lease, LeaseToken
from relay.logging import get_logger
from relay.message import DUE_EPOCH, ID, OutboxMessage
from relay.metrics import Health
from relay.outcomes import decide
from relay.presence import Presence, Progress
from relay.queries import QUERIES
from relay.repository import BatchLimits, Settlement
from relay.settings import Settings
from relay.settler import InFlight, Settler
from relay.shutdown import Shutdown
from relay.sinks import Outcome, Result, Sink, message_max_bytes
from relay.sinks.base import ACKED
from relay.stragglers import Stragglers
from relay.wakeup import Wakeup

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = get_logger("relay.drain")


def _without(rows: list[OutboxMessage], held: frozenset[str]) -> list[OutboxMessage]:
    """`rows` minus those of the keys held back."""
    if not held:
        return rows
    return [m for m in rows if m.key is None or m.key not in held]


# While a busy key fills whole batches alone (Kafka), how often the fetch looks past the
# head for other keys: the fair statement costs a few times the plain one.
LOOK_FOR_OTHERS_SECONDS = 0.1


def batch_limits(settings: Settings, sink: Sink) -> BatchLimits:
    """The batch bounds and the per-key cap, with the sink's default for the cap."""
    per_key = settings.batch_max_per_key
    if per_key is None:
        per_key = 4 if sink.serial_per_key else max(1, settings.batch_size // 5)
    return BatchLimits(
        rows=settings.batch_size,
        bytes=settings.batch_max_bytes,
        per_key=per_key,
        fill=not sink.serial_per_key,
        message_bytes=message_max_bytes(settings),
    )


@dataclass(slots=True)
class Prefetched:
    """The next batch, read while the previous one was being acknowledged."""

    rows: list[OutboxMessage]
    # Keys whose failures may not be written yet: the batches in flight at the read.
    held: frozenset[str]


def drain_session_setup(shards: int) -> list[str]:
    """How the drain session plans: with its actual parameters (custom plans); with
    shards, also never by bitmap scan, which would read every unsent row of the shard
    to return one batch (the shard index leads with the hash, so the planner prices
    its ordered walk as random reads)."""
    setup = [QUERIES.force_custom_plans]
    if shards > 1:
        setup.append(QUERIES.walk_shard_indexes_in_order)
    return setup


class Drainer:
    def __init__(
        self,
        settings: Settings,
        sink: Sink,
        lease: Lease,
        shutdown: Shutdown,
        health: Health,
        presence: Presence | None = None,
        progress: Progress | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        loop: str = "main",
        surplus: Callable[[], bool] | None = None,
        wakeup: Wakeup | None = None,
    ) -> None:
        self._settings = settings
        self._loop = loop  # its name in the liveness probe (one per shard with shards)
        self._wakeup = wakeup  # set by a NOTIFY (RELAY_NOTIFY_CHANNEL, relay/wakeup.py)
        # With shards: True while this replica holds more than its fair share and this
        # shard is one to hand over (relay/lanes.py).
        self._surplus = surplus
        self._presence = presence
        self._progress = progress or Progress(clock)
        self._sink = sink
        self._lease = lease
        self._shutdown = shutdown
        self._health = health
        self._clock = clock
        self._session = db.Session(self._open_drain_session)
        self._settler = Settler(
            lambda: db.connect(settings, purpose="settle"),
            lease,
            settings.lease_ttl_seconds,
            delete_sent=not settings.keep_sent_rows,
            clock=clock,
        )
        self._in_flight: InFlight | None = None  # published, being settled
        self._prefetched: Prefetched | None = None  # fetched, not published yet
        self._stragglers = Stragglers()  # published, no outcome yet
        # Times we gave way since the sink last answered us: each doubles the window,
        # so a sink that peers' probes reach but nobody can deliver to moves the lease
        # ever more rarely (a probe is weaker than a delivery).
        self._give_way_streak = 0
        self._row_backoff = Backoff(settings.retry_base_seconds, settings.retry_max_seconds)
        self._sink_retry = Retrying(Backoff(0.2, 10.0))
        self._db_retry = Retrying(Backoff(0.2, 5.0))
        self._idle_polls = 0
        self._limits = batch_limits(settings, sink)
        self._after_key: str | None = None  # where the next round over keys starts
        self._look_for_others_at = 0.0
        self._promote_at = 0.0  # when to look for scheduled rows that are due
        self._tracing = tracing.current()  # RELAY_TRACING (relay/tracing.py), else None
        self._span: Span | None = None  # the batch being published, when tracing

    def _open_drain_session(self) -> db.Conn:
        conn = db.connect(self._settings, purpose="drain")
        try:
            for statement in drain_session_setup(self._lease.shard.shards):
                conn.execute(statement)
        except BaseException:
            conn.close()  # never leak a session whose set-up failed
            raise
        return conn

    def _fetch(
        self, conn: db.Conn, in_flight: str, held: frozenset[str] = frozenset()
    ) -> list[OutboxMessage]:
        # A round over keys that met only held-back keys comes back empty: go on from
        # where it stopped at once (a few rounds) rather than idle-wait between them.
        for _ in range(4):
            fetched = repository.fetch_batch(
                conn,
                self._limits,
                in_flight,
                self._after_key,
                held=sorted(held),
                share_busy_keys=self._clock() >= self._look_for_others_at,
                shards=self._lease.shard.shards,
                shard=self._lease.shard.shard,
            )
            if fetched.fair:  # a head that needed no sharing says nothing of the round
                self._after_key = fetched.walked_to
            if fetched.alone:
                # A key drains alone: look for others only every so often, so a lone
                # hot key keeps the cheap fetch (they wait this much longer at most).
                self._look_for_others_at = self._clock() + LOOK_FOR_OTHERS_SECONDS
            if fetched.messages or not fetched.fair or fetched.walked_to is None:
                break
        return fetched.messages

    # --- the loop ---

    def drain(self) -> None:
        """Drain until the lease is lost or shutdown is requested."""
        token = self._lease.token()
        self._progress.reset()
        try:
            while token is not None and not self._shutdown.requested:
                self._health.beat(self._loop)
                try:
                    self._step(token)
                    self._db_retry.reset()
                    if self._cannot_deliver():
                        self._give_way(token)
                    elif self._surplus is not None and self._surplus():
                        self._hand_over(token)
                except psycopg.Error as exc:
                    self._end_span(failed=True)
                    # Rows of a batch published but not settled stay unsent: they will
                    # be published again (a duplicate, never a loss).
                    self._settle_in_flight_quietly()
                    self._prefetched = None
                    delay = self._db_retry.next_delay()
                    log.warning(
                        "drain.db_error", error=db.describe_error(exc), retry_in=round(delay, 3)
                    )
                    self._session.close()
                    self._shutdown.wait(delay)
                token = self._lease.token()
        finally:
            self._end_span()
            self._settle_in_flight_quietly()
            self._prefetched = None
            if len(self._stragglers):
                # Forgotten, so not left to be retried forever and land after the next
                # holder's later rows of their keys.
                self._sink.reset()
            self._stragglers.clear()
            self._progress.reset()

    def _step(self, token: LeaseToken) -> None:
        conn = self._session.get()
        in_flight = self._in_flight
        # Landed already (say, during a pause): no need to leave its rows out.
        if (
            in_flight is not None
            and in_flight.future.done()
            and not self._settle_in_flight(in_flight)
        ):
            return
        self._promote_due(conn)
        taken_ns = time.time_ns() if self._tracing is not None else 0
        batch = self._next_batch(conn)
        if not batch:
            answered, answers = self._stragglers.answered()
            if answered:
                unavailable = self._settle(token, answered, answers)
                if unavailable is not None:  # stragglers expired with the sink down
                    self._pause(self._sink_retry.next_delay(), token)
            elif self._in_flight is not None:
                self._settle_in_flight(self._in_flight)  # then look again at once
            else:
                self._progress.idle()
                self._idle_wait()
            return
        self._idle_polls = 0
        if self._lease.token() != token:
            return  # our deadline passed while we read: publish nothing
        metrics.BATCH_SIZE.observe(len(batch))

        started = self._clock()
        self._progress.publishing()
        span = None if self._tracing is None else self._tracing.start_batch(batch, taken_ns)
        self._span = span
        publishing = screen.start_publish(self._sink, batch, lambda: self._abandon(token))
        prefetch_started = self._clock()
        batch_text = repository.id_text(map(ID, batch))
        if not self._abandon(token):
            self._prefetch(conn, batch_text)
        prefetching = self._clock() - prefetch_started
        # At most a batch of stragglers: this batch may straggle whole only if it fits.
        room = len(self._stragglers) + len(batch) <= self._limits.rows
        results = publishing.wait(leave_stragglers=room)
        metrics.PUBLISH_SECONDS.labels(self._sink.name).observe(
            self._clock() - started - prefetching
        )
        failpoints.hit("after_publish")
        if span is not None:
            span.add_event("acknowledged", {"messaging.acknowledged": results.count(ACKED)})

        rows: list[OutboxMessage] = batch
        outcomes: list[Result] = results
        if results.count(ACKED) != len(results):  # (by identity first: C speed)
            rows, outcomes = [], []
            for index, (message, result) in enumerate(zip(batch, results, strict=True)):
                if result.outcome is Outcome.IN_FLIGHT:
                    self._stragglers.add(message, publishing, index)
                else:
                    rows.append(message)
                    outcomes.append(result)
        answered, answers = self._stragglers.answered()
        whole = len(rows) == len(batch) and not answered  # the batch's ids, as fetched
        unavailable = self._settle(
            token, rows + answered, outcomes + answers, batch_text if whole else None
        )
        if span is not None:  # the settle runs on, on the settler's session
            span.add_event("settle")
            self._end_span()
        if unavailable is not None:
            # The sink's own hint (HTTP 503 Retry-After) wins over our backoff when longer.
            delay = max(
                self._sink_retry.next_delay(),
                min(unavailable.retry_after or 0.0, self._settings.retry_max_seconds),
            )
            log.warning(
                "sink.unavailable",
                sink=self._sink.name,
                error=unavailable.error or "sink unavailable",
                retry_in=round(delay, 3),
            )
            self._prefetched = None  # read again when the sink is back
            self._pause(delay, token)
        else:
            self._sink_retry.reset()

    def _settle(
        self,
        token: LeaseToken,
        rows: list[OutboxMessage],
        results: list[Result],
        ids_text: str | None = None,
    ) -> Result | None:
        """Hand the outcomes of `rows` to the settler (after the previous settle landed);
        the sink's "unavailable" verdict, if any, for the loop to back off on.
        `ids_text`: the rows' ids as `repository.id_text`, if made already."""
        settlement, unavailable, reached = self._plan(rows, results)
        if ids_text is not None and len(settlement.sent) == len(rows):
            settlement.sent_text = ids_text
        if reached is None and len(self._stragglers):
            reached = False  # asked, and still no answer
        self._progress.published(reached=reached)
        if reached:
            self._give_way_streak = 0
        unacked = self._stragglers.keys()
        if len(settlement.sent) != len(rows):  # not every row acknowledged
            unacked |= frozenset(
                message.key
                for message, result in zip(rows, results, strict=True)
                if message.key is not None and result.outcome is not Outcome.ACKED
            )
        if self._prefetched is not None:
            # The prefetched rows were read before these failures are written (and
            # before these stragglers straggled): hold those keys back from them too.
            self._prefetched.held |= unacked
        if self._in_flight is not None and not self._settle_in_flight(self._in_flight):
            return None  # fenced out: these rows stay unsent (published: duplicates later)
        if settlement:
            self._in_flight = self._settler.submit(token, rows, settlement, unacked, ids_text)
        return unavailable

    def _unsettled(self) -> tuple[list[str], frozenset[str]]:
        """Ids every fetch leaves out (as `repository.id_text` parts) and keys held back
        from it: the batch being settled, and the stragglers."""
        ids = [repository.id_text(self._stragglers.ids())]
        held = self._stragglers.keys()
        if self._in_flight is not None:
            ids.append(self._in_flight.ids_text)
            held |= self._in_flight.held_keys
        return ids, held

    def _next_batch(self, conn: db.Conn) -> list[OutboxMessage]:
        """The prefetched batch, or a fresh fetch; minus the keys held back."""
        prefetched, self._prefetched = self._prefetched, None
        ids, held = self._unsettled()
        if prefetched is not None:
            batch = _without(prefetched.rows, held | prefetched.held)
            if batch:
                return batch
        return _without(self._fetch(conn, repository.join_literal(ids), held), held)

    def _prefetch(self, conn: db.Conn, publishing: str) -> None:
        """Read the batch after `publishing` (its ids, as `repository.id_text`) while
        its acknowledgements come back.

        It leaves out every row not yet settled (this batch, the one the settler has,
        the stragglers), and remembers the keys held back: when the prefetched rows are
        published, the failures of those batches may still be unwritten.
        """
        failpoints.stall("read_ahead")
        ids, held = self._unsettled()
        try:
            rows = self._fetch(conn, repository.join_literal([*ids, publishing]), held)
        except psycopg.Error:
            # The next step's own fetch will meet (and report) the same trouble.
            self._session.close()
            return
        self._prefetched = Prefetched(rows, held)

    def _settle_in_flight(self, in_flight: InFlight) -> bool:
        """Wait for the previous batch's settle; False if a newer lease holder fenced
        it out (raises what the database raised)."""
        self._in_flight = None
        settled_at = in_flight.future.result()
        token, settlement = in_flight.token, in_flight.settlement
        if settled_at is None:
            self._prefetched = None
            self._lease.fenced(token)
            return False
        # Debug level: one line a batch is history for tests/chaos, noise in production.
        log.debug(
            "batch.settled",
            lease=token.name,
            holder=token.holder,
            epoch=token.epoch,
            db_time=settled_at.isoformat(),
            sent=len(settlement.sent),
            retried=len(settlement.retry_ids),
            dead=len(settlement.dead_ids),
            first_id=in_flight.first_id,
            last_id=in_flight.last_id,
        )
        return True

    def _settle_in_flight_quietly(self) -> None:
        """Before the loop stops or starts over: the last settle lands or fails, and
        nothing is fetched while it might still run."""
        if self._in_flight is not None:
            try:
                self._settle_in_flight(self._in_flight)
            except psycopg.Error as exc:
                log.warning("drain.settle_failed", error=db.describe_error(exc))

    def _pause(self, delay: float, token: LeaseToken) -> None:
        """Wait out a sink outage in short slices: the liveness probe keeps seeing a
        beating loop (a Retry-After may ask for minutes), and a lost lease or a
        shutdown ends the wait at once."""
        deadline = self._clock() + delay
        while (left := deadline - self._clock()) > 0:
            self._health.beat(self._loop)
            if self._shutdown.wait(min(left, 1.0)) or self._lease.token() != token:
                return
            if self._cannot_deliver():
                return  # the loop gives the lease way

    def _abandon(self, token: LeaseToken) -> bool:
        """Stop waiting on the sink: lease gone, shutdown grace used up, or time to
        give way to a peer that can deliver."""
        self._health.beat(self._loop)
        return self._lease.token() != token or self._shutdown.grace_over() or self._cannot_deliver()

    # --- giving way ---

    def _cannot_deliver(self) -> bool:
        """Nothing delivered for the give-way window while rows wait, and a live peer
        says it reaches the sink. Nobody able: keep the lease, nothing is lost."""
        window = self._settings.give_way_seconds * 2 ** min(self._give_way_streak, 4)
        return (
            window > 0
            and self._presence is not None
            and self._progress.stalled_for() >= window
            and self._presence.able_peers() > 0
        )

    def _give_way(self, token: LeaseToken) -> None:
        """Hand the lease over for want of the sink: the peer that reaches it takes it at
        its next poll. Nothing the sink still holds, queued or in flight, may be sent
        after the peer starts: librdkafka would retry a request stuck on a silent
        connection later (bytes already written to the socket can still land: a
        possible duplicate)."""
        assert self._presence is not None
        stalled = self._progress.stalled_for()
        peers = self._presence.able_peers()
        self._give_way_streak += 1
        self._presence.gave_way()  # and so we do not campaign while a peer can deliver
        if self._let_go(token, "gave_way", reset_sink=True):
            log.warning(
                "lease.gave_way",
                lease=token.name,
                holder=token.holder,
                epoch=token.epoch,
                stalled_seconds=round(stalled, 1),
                able_peers=peers,
                sink=self._sink.name,
            )

    def _hand_over(self, token: LeaseToken) -> None:
        """Rebalancing: this replica holds more shards than its fair share, and this one
        goes to a replica with fewer; nothing says the sink is out of reach, so only
        stragglers (which could land after the taker's rows of their keys) are dropped."""
        if self._let_go(token, "rebalanced", reset_sink=False):
            log.info(
                "lease.handed_over",
                lease=token.name,
                holder=token.holder,
                epoch=token.epoch,
                reason="this replica holds more shards than its fair share",
            )

    def _let_go(
        self, token: LeaseToken, reason: lease_metrics.LossReason, *, reset_sink: bool
    ) -> bool:
        """Stop publishing under `token` and have the elector expire its row: the last
        settle lands first (it is fenced on our epoch), then what the sink holds is
        dropped (`reset_sink`, or stragglers left). False if the token was gone."""
        self._settle_in_flight_quietly()
        self._prefetched = None
        if reset_sink or len(self._stragglers):
            self._sink.reset()
        self._stragglers.clear()
        given = self._lease.give_up(token)
        if given:
            lease_metrics.lease_transition(
                self._lease.shard, held=False, epoch=token.epoch, reason=reason
            )
        self._progress.reset()
        return given

    # --- what each outcome means for its row (relay/outcomes.py decides) ---

    def _plan(
        self, batch: Sequence[OutboxMessage], results: Sequence[Result]
    ) -> tuple[Settlement, Result | None, bool | None]:
        decision = decide(
            batch,
            results,
            max_attempts=self._settings.max_attempts,
            retry_delay=self._retry_delay,
        )
        ages = map(partial(operator.sub, time.time()), map(DUE_EPOCH, decision.acked))
        metrics.END_TO_END_SECONDS.observe_many(self._sink.name, ages)
        for message, reason in decision.dead:
            self._dead_lettered(message, reason)
        for (topic, outcome_name), count in decision.counts.items():
            topic_label = metrics.TOPIC_LABELS.label(topic)
            metrics.MESSAGES.labels(self._sink.name, topic_label, outcome_name).inc(count)
        return decision.settlement, decision.unavailable, decision.reached

    def _retry_delay(self, attempts: int, retry_after: float | None) -> float:
        """Our backoff, or the sink's Retry-After when longer, spread by up to 20 % so
        the rows it throttled do not all come back in the same instant."""
        backoff = self._row_backoff.delay(attempts)
        if retry_after is None or retry_after <= backoff:
            return backoff
        return min(retry_after * random.uniform(1.0, 1.2), self._settings.retry_max_seconds)

    def _dead_lettered(self, message: OutboxMessage, reason: str) -> None:
        topic_label = metrics.TOPIC_LABELS.label(message.topic)
        metrics.DEAD_LETTERED.labels(self._sink.name, topic_label).inc()
        log.warning(
            "outbox.dead_lettered",
            id=message.id,
            message_id=message.message_id,
            topic=message.topic,
            key=message.key,
            attempts=message.attempts + 1,
            reason=reason,
        )

    # --- idle and housekeeping ---

    def _end_span(self, *, failed: bool = False) -> None:
        span, self._span = self._span, None
        if span is not None:
            if failed and self._tracing is not None:
                self._tracing.failed(span, "a database error cut the batch short", "database")
            span.end()

    def _promote_due(self, conn: db.Conn) -> None:
        """Scheduled delivery: let the rows that are due into the drain, at most a batch
        a pass, then note when to look again: at once if a batch was due, at the next
        row's time, and at most a longest idle poll away (the app may schedule an
        earlier row meanwhile). Before the fetch, so a row due now is in the next one read."""
        if self._clock() < self._promote_at:
            return
        promoted = repository.promote_due(
            conn, self._limits.rows, shards=self._lease.shard.shards, shard=self._lease.shard.shard
        )
        wait = self._settings.poll_interval_max_seconds
        if promoted.rows >= self._limits.rows:
            wait = 0.0
        elif promoted.next_due_in is not None:
            wait = min(wait, max(0.0, promoted.next_due_in))
        self._promote_at = self._clock() + wait
        if promoted.rows:
            metrics.SCHEDULED_PROMOTED.inc(promoted.rows)
            self._idle_polls = 0

    def _idle_wait(self) -> None:
        # Adaptive polling: right after traffic we look again within milliseconds; a
        # quiet outbox settles at one cheap index probe per poll_interval_max, and
        # wakes for the next scheduled row's time.
        delay = min(
            self._settings.poll_interval_max_seconds,
            self._settings.poll_interval_min_seconds * (2 ** min(self._idle_polls, 16)),
            max(0.0, self._promote_at - self._clock()),
        )
        self._idle_polls += 1
        if self._wakeup is not None:
            # A NOTIFY, the poll, or shutdown: whichever first. A NOTIFY may announce a
            # row scheduled sooner than any we knew of: look for due rows too.
            if self._wakeup.wait(delay):
                self._promote_at = 0.0
        else:
            self._shutdown.wait(delay)

    def close(self) -> None:
        self._settler.close()
        self._session.close()
