"""Settling a published batch on its own session and thread, so the drain loop can
fetch and publish the next batch meanwhile (docs/DESIGN.md, "Draining": pipelining).

At most one batch is being settled while the next is published: two batches in flight,
never more. The settle itself is unchanged: atomic, fenced on the lease epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime

from relay.drain.batch import IdSet, SentRows, Settlement, id_set
from relay.lease.protocol import Lease, LeaseToken
from relay.message import ID, OutboxMessage
from relay.observe import metrics
from relay.store.port import SettleStore


@dataclass(slots=True)
class InFlight:
    """A batch that was published and whose outcomes are being written."""

    token: LeaseToken
    # Ids only, for the fetches that leave them out (`IdSet`): the rows' payloads are
    # let go once published, so a batch of large rows is held in two stages at most
    # (read ahead, publishing), not three.
    ids: IdSet
    first_id: int  # for the `batch.settled` event
    last_id: int
    settlement: Settlement
    # Keys with a row not acknowledged in this batch: until the settle lands (and the
    # fetch query sees the retry), later rows of these keys must not be published.
    held_keys: frozenset[str]
    future: Future[datetime | None]


class Settler:
    def __init__(
        self,
        store: SettleStore,
        lease: Lease,
        ttl: float,
        *,
        sent_rows: SentRows,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._lease = lease
        self._ttl = ttl
        self._sent_rows = sent_rows
        self._clock = clock
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=lease.shard.thread_name("settle")
        )

    def submit(
        self,
        token: LeaseToken,
        batch: list[OutboxMessage],
        settlement: Settlement,
        held_keys: frozenset[str],
        ids: IdSet | None = None,
    ) -> InFlight:
        """`ids`: the batch's ids, if the caller made them already."""
        future = self._pool.submit(self._settle, token, settlement)
        if ids is None:
            ids = id_set(list(map(ID, batch)))
        return InFlight(token, ids, batch[0].id, batch[-1].id, settlement, held_keys, future)

    def _settle(self, token: LeaseToken, settlement: Settlement) -> datetime | None:
        started = self._clock()
        try:
            settled_at = self._store.settle(
                token, settlement, ttl=self._ttl, sent_rows=self._sent_rows
            )
        except BaseException:
            self._store.reset()  # the next settle starts on a fresh session
            raise
        if settled_at is not None:
            self._lease.renewed(token, started)
            metrics.SETTLE_SECONDS.observe(self._clock() - started)
        return settled_at

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._store.close()
