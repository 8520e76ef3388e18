"""How long the leader has had rows to deliver and no answer from the sink: what the
give-way decision (relay/drain/give_way.py) and the heartbeat (relay/store/presence.py) read.
Pure: a clock is all it needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """How long this leader has had rows to deliver and got no answer from the sink.

    The wait starts with the first batch published after the sink last answered and
    ends with the next answer about any row: an acknowledgement, or a refusal (an HTTP
    status, a broker error) that proves the path works; a row dead-lettered by the
    relay itself proves nothing. An empty fetch ends it only if nothing failed since:
    rows that got no answer may be waiting out a backoff, still to be delivered.

    Written by the drain thread only; read by the presence thread (plain attributes).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None
        self._failed = False

    def publishing(self) -> None:
        if self._since is None:
            self._since = self._clock()

    def published(self, *, reached: bool | None) -> None:
        """`reached`: the sink answered about some row (True), about none (False), or
        was not asked (None: nothing changes)."""
        if reached:
            self._since = None
            self._failed = False
        elif reached is not None:
            self._failed = True

    def idle(self) -> None:
        if not self._failed:
            self._since = None

    def reset(self) -> None:
        """A term as leader starts, or ends, with a clean slate."""
        self._since = None
        self._failed = False

    def stalled_for(self) -> float:
        since = self._since
        return 0.0 if since is None else self._clock() - since
