"""Ending a term early, the two ways a leader lets a lease go while it could keep it
(docs/DESIGN.md, "The lease" and "Shards"): giving way for want of the sink, and
handing a surplus shard over. Either way the last settle lands first (it is fenced on
our epoch), then what the sink may still send later is dropped, then the elector expires
the row so the taker starts at its next poll."""

from __future__ import annotations

from relay.drain.give_way import GiveWay
from relay.drain.pipeline import SettlePipeline
from relay.drain.progress import Progress
from relay.drain.reader import Reader
from relay.lease import metrics as lease_metrics
from relay.lease.protocol import Lease, LeaseToken
from relay.observe.logging import get_logger
from relay.sinks import Sink

log = get_logger("relay.drain")


class HandOver:
    """Owned by the drain loop's thread alone."""

    def __init__(
        self,
        lease: Lease,
        sink: Sink,
        reader: Reader,
        pipeline: SettlePipeline,
        policy: GiveWay,
        progress: Progress,
    ) -> None:
        self._lease = lease
        self._sink = sink
        self._reader = reader
        self._pipeline = pipeline
        self._policy = policy
        self._progress = progress

    def give_way(self, token: LeaseToken) -> None:
        """Hand the lease over for want of the sink: the peer that reaches it takes it at
        its next poll. Nothing the sink still holds, queued or in flight, may be sent
        after the peer starts: librdkafka would retry a request stuck on a silent
        connection later (bytes already written to the socket can still land: a
        possible duplicate)."""
        stalled, peers = self._policy.giving_way()
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

    def rebalance(self, token: LeaseToken) -> None:
        """This replica holds more shards than its fair share, and this one goes to a
        replica with fewer; nothing says the sink is out of reach, so only stragglers
        (which could land after the taker's rows of their keys) are dropped."""
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
        """Stop publishing under `token` and have the elector expire its row; False if
        the token was gone already."""
        self._pipeline.land_quietly()
        self._reader.forget()
        if self._pipeline.drop_stragglers() or reset_sink:
            self._sink.reset()
        given = self._lease.give_up(token)
        if given:
            lease_metrics.lease_transition(
                self._lease.shard, held=False, epoch=token.epoch, reason=reason
            )
        self._progress.reset()
        return given
