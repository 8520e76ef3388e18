"""The overview's settled rate: the outbox's settle counters sampled on an interval by a
thread of the console."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from relay.observe.logging import get_logger
from relay.settings import CommonSettings
from relay.sql import QUERIES
from relay.store import db

log = get_logger("relay.console")


@dataclass(frozen=True, slots=True)
class Rate:
    per_second: float | None  # None: not measured yet, or not measurable here
    over_seconds: float
    source: str  # how it was measured, for the page


@dataclass
class RateSampler:
    """Samples the outbox's settle counters on an interval (a thread of the console):
    deletions from PostgreSQL's statistics, or an own table's rows kept with sent_at in the
    window."""

    settings: CommonSettings
    window: float
    interval: float = 10.0
    cap: int = 1_000_000
    _samples: deque[tuple[float, int | None, int]] = field(default_factory=deque)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        threading.Thread(target=self._run, name="console-rate", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        conn: db.Conn | None = None
        while not self._stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = db.connect(self.settings, purpose="console-rate")
                self.sample(conn)
            except Exception as exc:
                log.warning("console.rate_sample_failed", error=db.describe_error(exc))
                if conn is not None:
                    conn.close()
                conn = None
            self._stop.wait(self.interval)
        if conn is not None:
            conn.close()

    def sample(self, conn: db.Conn) -> None:
        counters = (
            QUERIES.console_settled_counters_marked
            if self.settings.set_aside == "mark"
            else QUERIES.console_settled_counters
        )
        found = conn.execute(counters, {"window": self.window, "cap": self.cap}).fetchone()
        if found is None:
            return
        deleted = None if found["deleted"] is None else int(found["deleted"])
        with self._lock:
            self._samples.append((float(found["at"]), deleted, int(found["sent_in_window"])))
            while (
                len(self._samples) > 2 and self._samples[-1][0] - self._samples[1][0] > self.window
            ):
                self._samples.popleft()

    def rate(self) -> Rate:
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return Rate(None, 0.0, "not sampled yet")
        at, deleted, sent = samples[-1]
        if sent > 0:
            return Rate(sent / self.window, self.window, "rows marked sent (retention keeps them)")
        if deleted is None:
            return Rate(None, 0.0, "no table statistics for this outbox")
        first_at, first_deleted, _ = samples[0]
        if first_deleted is None or at - first_at < 1.0:
            return Rate(None, 0.0, "measuring")
        return Rate(
            max(0, deleted - first_deleted) / (at - first_at),
            at - first_at,
            "rows deleted once sent (PostgreSQL statistics; purges and discards count too)",
        )
