"""The settle pipeline (docs/DESIGN.md, "Draining"): rows published and not yet settled.

At most one batch is being settled, on the settler's own session, while the loop
publishes the next; besides it, the stragglers (relay/drain/stragglers.py). Every fetch leaves
their ids out and holds their keys back (`unsettled`), so no later row of such a key can
overtake them. A settle that a newer lease holder fenced out is reported to the lease.
"""

from __future__ import annotations

from relay.drain.batch import IdSet, Settlement, id_set
from relay.drain.settler import InFlight, Settler
from relay.drain.stragglers import Stragglers
from relay.lease.protocol import Lease, LeaseToken
from relay.message import OutboxMessage
from relay.observe.logging import get_logger
from relay.sinks import Outcome, Result
from relay.store.port import StoreError

log = get_logger("relay.drain")


class SettlePipeline:
    """Owned by the drain loop's thread alone (the settler's thread only answers its
    futures)."""

    def __init__(self, settler: Settler, lease: Lease) -> None:
        self._settler = settler
        self._lease = lease
        self._in_flight: InFlight | None = None  # published, being settled
        self.stragglers = Stragglers()  # published, no outcome yet
        self.landed_count = 0  # batches settled (fenced ones not counted)

    def unsettled(self) -> tuple[list[IdSet], frozenset[str]]:
        """Ids every fetch leaves out and keys held back from it: the batch being
        settled, and the stragglers."""
        ids = [id_set(self.stragglers.ids())]
        held = self.stragglers.keys()
        if self._in_flight is not None:
            ids.append(self._in_flight.ids)
            held |= self._in_flight.held_keys
        return ids, held

    @property
    def settling(self) -> bool:
        return self._in_flight is not None

    @property
    def landed(self) -> bool:
        """The batch being settled has its answer already (say, after a pause)."""
        return self._in_flight is not None and self._in_flight.future.done()

    def unacked(
        self, rows: list[OutboxMessage], results: list[Result], settlement: Settlement
    ) -> frozenset[str]:
        """Keys whose later rows must wait: the stragglers', and those of rows not
        acknowledged here (until their settle lands and the fetch sees the retry)."""
        keys = self.stragglers.keys()
        if len(settlement.sent) != len(rows):  # not every row acknowledged
            keys |= frozenset(
                message.key
                for message, result in zip(rows, results, strict=True)
                if message.key is not None and result.outcome is not Outcome.ACKED
            )
        return keys

    def submit(
        self,
        token: LeaseToken,
        rows: list[OutboxMessage],
        settlement: Settlement,
        unacked: frozenset[str],
        ids: IdSet | None,
    ) -> bool:
        """Hand the settlement to the settler once the previous one landed; False if a
        newer holder fenced that out (these rows stay unsent: published, duplicates)."""
        if not self.land():
            return False
        if settlement:
            self._in_flight = self._settler.submit(token, rows, settlement, unacked, ids)
        return True

    def land(self) -> bool:
        """Wait for the batch being settled, if any; False if a newer lease holder
        fenced it out (raises the store's error)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return True
        settled_at = in_flight.future.result()
        token, settlement = in_flight.token, in_flight.settlement
        if settled_at is None:
            self._lease.fenced(token)
            return False
        self.landed_count += 1
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

    def land_quietly(self) -> None:
        """Before the loop stops or starts over: the last settle lands or fails, and
        nothing is fetched while it might still run."""
        try:
            self.land()
        except StoreError as exc:
            log.warning("drain.settle_failed", error=str(exc))

    def drop_stragglers(self) -> bool:
        """Forget the stragglers (their rows go again, under the next holder or our next
        term); whether there were any, for the sink to drop what it still holds."""
        had = len(self.stragglers) > 0
        self.stragglers.clear()
        return had

    def close(self) -> None:
        self._settler.close()
