"""Paused topics (`relay pause`, docs/operations/pause.md), as the drain sees them: read
from the store on each pass for scheduled rows (at least once a second), so every
replica and shard honours a pause or a resume within about a second.

A paused topic's rows met at the head of the outbox are held out of it, in
outbox_paused (relay/store/hold.py), or parked where they are (an own table's, or one
too large to move: relay/drain/screen.py, then the settle), never published; a resume
only deletes the pause, and the first drain to see it gone lets its rows go. That is
also done at a drain's first pass and every UNPARK_EVERY_SECONDS: a replica that held
rows may stop before it sees the resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from relay.observe import metrics
from relay.store.port import ReadStore

UNPARK_EVERY_SECONDS = 30.0
# A resumed topic's held rows go back into the outbox in moves of at most RELEASE_ROWS
# rows (and 16 MiB), RELEASES_A_PASS of them a pass; what is left, at the next pass.
RELEASE_ROWS = 5000
RELEASES_A_PASS = 10


class Pauses:
    """Owned by the reader; `refresh` runs on its session's thread, `topics` is read by
    the drain loop (a frozenset, swapped whole)."""

    def __init__(self, shard: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.topics: frozenset[str] = frozenset()
        self._seen = metrics.PAUSES_SEEN.labels(shard)
        self._clock = clock
        self._unpark_at = 0.0  # at the first pass: rows may be left from before
        self._releasing = False  # the last release stopped at its bounds

    def refresh(self, store: ReadStore) -> int:
        """Read the pauses, and let go the rows of any pause that is over if one was
        seen to end, the last pass left some, or it is time to look anyway; how many
        rows were let go."""
        paused = store.paused_topics()
        released = 0
        if not self.topics <= paused or self._clock() >= self._unpark_at or self._releasing:
            released = store.unpark_resumed()
            for _ in range(RELEASES_A_PASS):
                moved, self._releasing = store.release_paused(RELEASE_ROWS)
                released += moved
                if not self._releasing:
                    break
            self._unpark_at = self._clock() + UNPARK_EVERY_SECONDS
        self.topics = paused
        self._seen.set(len(paused))
        return released
