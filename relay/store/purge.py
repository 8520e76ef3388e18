"""Retention: the purge of sent rows, on its own thread and session.

Only in retention mode (RELAY_RETENTION_SECONDS > 0) and only while this replica holds
the lease, so N replicas do not purge the same rows. It runs apart from the drain loop
on purpose: a purge that fails (a lock, a timeout, a missing privilege) is logged and
tried again at its next interval, and never delays a fetch. A run first empties the
oldest generation of outbox_sent whole when it is time (`rotate_sent`: one TRUNCATE,
however many rows); for an own table, which keeps its sent rows marked, it deletes
those in bounded batches instead, each one index-driven statement (`purge_sent`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from relay.drain.batch import SentRows
from relay.lease.protocol import Lease
from relay.observe import metrics
from relay.observe.logging import OutageLog, get_logger
from relay.store import db, repository

log = get_logger("relay.purge")

# A run deletes batch after batch until it finds fewer rows due than a batch, or for
# this long; a run cut short is followed by the next at once, not after the interval,
# so the purge keeps up with any drain rate while never holding a lock for long.
RUN_SECONDS = 2.0


# Rows one purge statement deletes, of the sent rows kept in the outbox itself (an own
# table's): small batches keep locks and WAL bursts short. outbox_sent is emptied a
# generation at a time instead.
BATCH_ROWS = 1_000


@dataclass(frozen=True, slots=True)
class PurgeConfig:
    """What the purge reads of the settings (`relay.daemon.configs.purge_config`)."""

    retention_seconds: float  # RELAY_RETENTION_SECONDS: sent rows older than this go
    interval_seconds: float  # RELAY_PURGE_INTERVAL_SECONDS
    sent_rows: SentRows  # "move": sent rows are kept in outbox_sent's generations


class Purger(threading.Thread):
    def __init__(
        self,
        config: PurgeConfig,
        connect: Callable[[str], db.Conn],
        lease: Lease,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="relay-purge", daemon=True)
        self._config = config
        self._lease = lease
        self._clock = clock
        self._stop_event = threading.Event()
        self._session = db.Session(lambda: connect("purge"))
        self._outage = OutageLog(log, "outbox.purge_failed", "outbox.purge_recovered")
        # Runs whose rotation found the generation due held by a reader: it waits for
        # the next run (read by the tests, which cannot see a log line go by).
        self.rotations_put_off = 0

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        wait = self._config.interval_seconds
        try:
            while not self._stop_event.wait(wait):
                wait = self._config.interval_seconds
                if self._lease.token() is not None and self.purge_once() is None:
                    wait = 0.05  # more rows are due: go on, after a breath
        finally:
            self._session.close()

    def purge_once(self) -> int | None:
        """One run; the rows deleted, or None if it stopped with more rows due."""
        deleted = 0
        ends = self._clock() + RUN_SECONDS
        rotation_failed = False
        if self._config.sent_rows == "move" and self._lease.token() is not None:
            rotation_failed = self._rotate()
        try:
            # Only an own table keeps its sent rows, marked, in the table itself.
            while self._config.sent_rows == "mark":
                if self._lease.token() is None or self._stop_event.is_set():
                    break
                if self._clock() > ends:
                    self._report(deleted)
                    return None
                count = repository.purge_sent(
                    self._session.get(),
                    self._config.retention_seconds,
                    BATCH_ROWS,
                )
                deleted += count
                if count < BATCH_ROWS:
                    break
        except Exception as exc:
            # Any failure: this thread only keeps the table small, and its death would
            # let the outbox grow without a word. One error a run, however many steps
            # met it (a database that is down fails the rotation and the purge both).
            if not rotation_failed:
                self._failed(exc)
            else:
                self._session.close()
            return deleted
        if not rotation_failed:
            self._outage.success()
        self._report(deleted)
        return deleted

    def _rotate(self) -> bool:
        """Empty the oldest generation of outbox_sent if it is time; whether it failed.
        A reader of that
        generation past the lock timeout is no failure: it waits for the next run."""
        try:
            generation = repository.rotate_sent(self._session.get(), self._config.retention_seconds)
        except psycopg.errors.LockNotAvailable:
            log.info("outbox.sent_generation_busy", retry_in_s=self._config.interval_seconds)
            self.rotations_put_off += 1
            return False
        except Exception as exc:
            self._failed(exc)
            return True
        if generation is not None:
            metrics.SENT_GENERATIONS_EMPTIED.inc()
            log.info("outbox.sent_generation_emptied", generation=generation)
        return False

    def _failed(self, exc: Exception) -> None:
        metrics.PURGE_ERRORS.inc()
        self._outage.failure(db.describe_error(exc))
        self._session.close()  # the next statement starts on a fresh session

    def _report(self, deleted: int) -> None:
        if deleted:
            metrics.PURGED.inc(deleted)
            log.info("outbox.purged", rows=deleted)
