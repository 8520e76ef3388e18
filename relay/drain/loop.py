"""The drain loop (docs/DESIGN.md, "Draining"), run while this replica holds the lease.

    fetch the next unsent rows in id order (never a last-seen-id cursor)
    publish them; meanwhile, on the reader's thread, fetch the batch after them
    wait for every acknowledgement
    settle: atomically, fenced on our lease epoch (one transaction; one statement when
            every row was acknowledged), delete (or keep) the acknowledged rows, back
            off the failed ones, dead-letter the hopeless;
            this runs on the settler's own session while the loop publishes the next
            batch, so at most two batches are ever published and not yet settled,
            plus up to a batch of stragglers: rows a sick partition holds while the rest
            of their batch was answered (Kafka), their keys held until they settle
    repeat; when there is nothing to do, poll adaptively
    give the lease way when nothing was delivered for RELAY_GIVE_WAY_SECONDS while rows
            wait and a live peer reports it reaches the sink (relay/store/presence.py)

Every fetch leaves out the rows published and not yet settled. A failed row blocks later
rows of its key only: the fetch query skips them once the failure is written, and until
then the loop holds the key back itself. The lease check inside the settle is what makes
a paused or partitioned ex-leader harmless.

Its parts, each the one owner of its state: the reading (relay/drain/reader.py: fetch rounds,
read-ahead, scheduled rows let in), what outcomes mean (relay/drain/outcomes.py), the settle
pipeline (relay/drain/pipeline.py: the batch being settled, relay/drain/settler.py, and the
stragglers), the give-way decision (relay/drain/give_way.py) and the letting go (hand_over.py),
the idle wait (idle.py), the pace (pacer.py), what is recorded (recorder.py), the
store (relay/store/port.py). Here: the loop that ties them, and backing off outages.

Long: the one place the loop's steps are ordered and its outages backed off; every
rule it applies lives in the modules named above.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from relay import failpoints
from relay.backoff import Backoff, Retrying, retry_delay
from relay.drain import screen
from relay.drain.batch import BatchLimits, IdSet, SentRows, Settlement, id_set
from relay.drain.give_way import GiveWay, Peers
from relay.drain.hand_over import HandOver
from relay.drain.idle import IdleWait, Wakeup
from relay.drain.outcomes import decide
from relay.drain.pacer import TICK_SECONDS, PaceLimits, Pacer
from relay.drain.pipeline import SettlePipeline
from relay.drain.progress import Progress
from relay.drain.reader import Reader
from relay.drain.recorder import Recorder
from relay.drain.settler import Settler
from relay.lease.protocol import Lease, LeaseToken
from relay.message import ID, OutboxMessage
from relay.observe.logging import get_logger
from relay.observe.metrics import Health
from relay.shutdown import Shutdown
from relay.sinks import Outcome, Result, Sink
from relay.sinks.base import ACKED
from relay.store.port import DrainStore, StoreError

if TYPE_CHECKING:  # loaded only with RELAY_TRACING (the otel extra)
    from relay.observe.tracing import Tracing

log = get_logger("relay.drain")


@dataclass(frozen=True, slots=True)
class DrainConfig:
    """What the drain reads of the settings (`relay.daemon.configs.drain_config`)."""

    limits: BatchLimits
    max_attempts: int  # RELAY_MAX_ATTEMPTS
    retry_base: float  # RELAY_RETRY_BASE_SECONDS
    retry_max: float  # RELAY_RETRY_MAX_SECONDS
    give_way_seconds: float  # RELAY_GIVE_WAY_SECONDS
    poll_min: float  # RELAY_POLL_INTERVAL_MIN_SECONDS
    poll_max: float  # RELAY_POLL_INTERVAL_MAX_SECONDS
    lease_ttl: float  # RELAY_LEASE_TTL_SECONDS, which each settle extends the lease by
    sent_rows: SentRows  # RELAY_RETENTION_SECONDS (and RELAY_OUTBOX_TABLE)
    pace: PaceLimits = field(default_factory=PaceLimits)  # RELAY_MAX_*_PER_SECOND


class Drainer:
    def __init__(
        self,
        config: DrainConfig,
        store: DrainStore,
        sink: Sink,
        lease: Lease,
        shutdown: Shutdown,
        health: Health,
        peers: Peers | None = None,
        progress: Progress | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        loop: str = "main",
        surplus: Callable[[], bool] | None = None,
        wakeup: Wakeup | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._config = config
        self._loop = loop  # its name in the liveness probe (one per shard with shards)
        # With shards: True while this replica holds more than its fair share and this
        # shard is one to hand over (relay/daemon/lanes.py).
        self._surplus = surplus
        self._progress = progress or Progress(clock)
        self._give_way_policy = GiveWay(config.give_way_seconds, peers, self._progress)
        self._sink = sink
        self._lease = lease
        self._shutdown = shutdown
        self._health = health
        self._clock = clock
        reading, limits, lane = store.reading(), config.limits, lease.shard
        self._reader = Reader(reading, limits, config.poll_max, clock, lane, shutdown)
        settler = Settler(
            store.settling(),
            lease,
            config.lease_ttl,
            sent_rows=config.sent_rows,
            clock=clock,
        )
        self._pipeline = SettlePipeline(settler, lease)
        self._row_backoff = Backoff(config.retry_base, config.retry_max)
        self._sink_retry = Retrying(Backoff(0.2, 10.0))
        self._db_retry = Retrying(Backoff(0.2, 5.0))
        self._idle = IdleWait(config.poll_min, config.poll_max, self._reader, shutdown, wakeup)
        self._hand_over = HandOver(
            lease, sink, self._reader, self._pipeline, self._give_way_policy, self._progress
        )
        self._recorder = Recorder(sink.name, tracing)
        self._pacer = Pacer(config.pace, sink.name, loop, clock)

    # --- the loop ---

    def drain(self) -> None:
        """Drain until the lease is lost or shutdown is requested."""
        token = self._lease.token()
        self._progress.reset()
        landed = -1  # lands counted at the last store error
        try:
            while token is not None and not self._shutdown.requested:
                self._health.beat(self._loop)
                try:
                    self._step(token)
                    if not self._pipeline.settling or self._pipeline.landed_count > landed:
                        self._db_retry.reset()  # not while a failed settle is retried
                    if self._cannot_deliver():
                        self._hand_over.give_way(token)
                    elif self._surplus is not None and self._surplus():
                        self._hand_over.rebalance(token)
                except StoreError as exc:
                    landed = self._pipeline.landed_count
                    self._recorder.end(failed=True)
                    # Rows of a batch published but not settled stay unsent: they will
                    # be published again (a duplicate, never a loss).
                    self._pipeline.land_quietly()
                    self._reader.forget()
                    delay = self._db_retry.next_delay()
                    log.warning("drain.db_error", error=str(exc), retry_in=round(delay, 3))
                    self._shutdown.wait(delay)
                token = self._lease.token()
        finally:
            self._recorder.end()
            self._pipeline.land_quietly()
            self._reader.forget()
            if self._pipeline.drop_stragglers():
                # Forgotten, so not left to be retried forever and land after the next
                # holder's later rows of their keys.
                self._sink.reset()
            self._progress.reset()

    def _step(self, token: LeaseToken) -> None:
        # Landed already (say, during a pause): no need to leave its rows out.
        if self._pipeline.landed and not self._land():
            return
        if self._reader.promote_due():
            self._idle.busy()
        fetched_ns = self._recorder.fetch_started()
        batch = self._reader.next_batch(*self._pipeline.unsettled())
        if not batch:
            self._nothing_to_publish(token)
            return
        self._idle.busy()
        paced = self._pacer.admit(
            screen.sendable(batch, self._reader.pauses.topics),
            lambda wait: self._pause(wait, token, TICK_SECONDS),
        )
        if not paced or self._lease.token() != token:
            return  # a wait for budget cut short, or the deadline passed: publish nothing
        unavailable = self._publish(token, batch, fetched_ns)
        if unavailable is not None:
            self._back_off(token, unavailable)
        else:
            self._sink_retry.reset()

    def _nothing_to_publish(self, token: LeaseToken) -> None:
        """No new rows: settle the stragglers that were answered, else let the batch
        being settled land, else wait for rows."""
        answered, answers = self._pipeline.stragglers.answered()
        if answered:
            unavailable = self._settle(token, answered, answers)
            if unavailable is not None:  # stragglers expired with the sink down
                self._pause(self._sink_retry.next_delay(), token)
        elif self._pipeline.settling:
            self._land()  # then look again at once
        else:
            self._progress.idle()
            self._idle.wait()

    def _publish(
        self, token: LeaseToken, batch: list[OutboxMessage], fetched_ns: int
    ) -> Result | None:
        """Publish `batch`, read the next one meanwhile, and hand the outcomes to the
        settle; the sink's "unavailable" verdict, if any."""
        started = self._clock()
        self._progress.publishing()
        self._recorder.publishing(batch, fetched_ns)
        batch_ids = id_set(list(map(ID, batch)))
        if not self._abandon(token):
            self._reader.prefetch(*self._pipeline.unsettled(), batch_ids)
        publishing = screen.start_publish(
            self._sink, batch, lambda: self._abandon(token), self._reader.pauses.topics
        )
        # At most a batch of stragglers: this batch may straggle whole only if it fits.
        room = len(self._pipeline.stragglers) + len(batch) <= self._reader.limits.rows
        results = publishing.wait(leave_stragglers=room)
        seconds = self._clock() - started
        self._recorder.published(seconds, results.count(ACKED))
        self._reader.published(len(batch), seconds)
        failpoints.hit("after_publish")

        rows: list[OutboxMessage] = batch
        outcomes: list[Result] = results
        if results.count(ACKED) != len(results):  # (by identity first: C speed)
            rows, outcomes = [], []
            for index, (message, result) in enumerate(zip(batch, results, strict=True)):
                if result.outcome is Outcome.IN_FLIGHT:
                    self._pipeline.stragglers.add(message, publishing, index)
                else:
                    rows.append(message)
                    outcomes.append(result)
        answered, answers = self._pipeline.stragglers.answered()
        whole = len(rows) == len(batch) and not answered  # the batch's ids, as fetched
        unavailable = self._settle(
            token, rows + answered, outcomes + answers, batch_ids if whole else None
        )
        self._recorder.settling()
        return unavailable

    def _back_off(self, token: LeaseToken, unavailable: Result) -> None:
        """The sink is down as a whole: wait, then read again. Its own hint (HTTP 503
        Retry-After) wins over our backoff when longer."""
        delay = max(
            self._sink_retry.next_delay(),
            min(unavailable.retry_after or 0.0, self._config.retry_max),
        )
        log.warning(
            "sink.unavailable",
            sink=self._sink.name,
            error=unavailable.error or "sink unavailable",
            retry_in=round(delay, 3),
        )
        self._reader.forget()  # read again when the sink is back
        self._pause(delay, token)

    def _settle(
        self,
        token: LeaseToken,
        rows: list[OutboxMessage],
        results: list[Result],
        ids: IdSet | None = None,
    ) -> Result | None:
        """Hand the outcomes of `rows` to the settler (after the previous settle landed);
        the sink's "unavailable" verdict, if any, for the loop to back off on.
        `ids`: the rows' ids, if made already."""
        settlement, unavailable, reached = self._plan(rows, results)
        if ids is not None and len(settlement.sent) == len(rows):
            settlement.sent_text = ids.text
        if reached is None and len(self._pipeline.stragglers):
            reached = False  # asked, and still no answer
        self._progress.published(reached=reached)
        if reached:
            self._give_way_policy.sink_answered()
        unacked = self._pipeline.unacked(rows, results, settlement)
        self._reader.hold(unacked)
        if not self._pipeline.submit(token, rows, settlement, unacked, ids):
            self._reader.forget()
            return None  # fenced out: these rows stay unsent (published: duplicates later)
        return unavailable

    def _land(self) -> bool:
        """The batch being settled lands; False if it was fenced out (the read-ahead,
        made for a term that is over, is dropped)."""
        if self._pipeline.land():
            return True
        self._reader.forget()
        return False

    def _pause(self, delay: float, token: LeaseToken, tick: float = 1.0) -> bool:
        """Wait out a sink outage (or the pacer's budget) in slices of `tick`: the
        liveness probe keeps seeing a beating loop (a Retry-After may ask for minutes),
        a shutdown ends the wait at once, a lost lease within a slice. False if cut short."""
        deadline = self._clock() + delay
        while (left := deadline - self._clock()) > 0:
            self._health.beat(self._loop)
            if self._shutdown.wait(min(left, tick)) or self._lease.token() != token:
                return False
            if self._cannot_deliver():
                return False  # the loop gives the lease way
        return True

    def _abandon(self, token: LeaseToken) -> bool:
        """Stop waiting on the sink: lease gone, shutdown grace used up, or time to
        give way to a peer that can deliver."""
        self._health.beat(self._loop)
        return self._lease.token() != token or self._shutdown.grace_over() or self._cannot_deliver()

    def _cannot_deliver(self) -> bool:
        return self._give_way_policy.due()

    # --- what each outcome means for its row (relay/drain/outcomes.py decides) ---

    def _plan(
        self, batch: Sequence[OutboxMessage], results: Sequence[Result]
    ) -> tuple[Settlement, Result | None, bool | None]:
        decision = decide(
            batch,
            results,
            max_attempts=self._config.max_attempts,
            retry_delay=partial(retry_delay, self._row_backoff),
        )
        self._recorder.decided(decision)
        return decision.settlement, decision.unavailable, decision.reached

    def close(self) -> None:
        self._pipeline.close()
        self._reader.close()
