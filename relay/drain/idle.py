"""How an idle drain loop waits (docs/DESIGN.md, "Draining"): adaptive polling. Right
after traffic it looks again within milliseconds; a quiet outbox settles at one cheap
index probe per RELAY_POLL_INTERVAL_MAX_SECONDS, and wakes for the next scheduled row's
time, a NOTIFY (RELAY_NOTIFY_CHANNEL) or shutdown, whichever comes first."""

from __future__ import annotations

from typing import Protocol

from relay.drain.reader import Reader
from relay.shutdown import Shutdown


class Wakeup(Protocol):
    """A NOTIFY ends the idle wait early (relay/store/wakeup.py)."""

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout`; True if a NOTIFY came."""
        ...


class IdleWait:
    """Owned by the drain loop's thread alone."""

    def __init__(
        self,
        poll_min: float,
        poll_max: float,
        reader: Reader,
        shutdown: Shutdown,
        wakeup: Wakeup | None,
    ) -> None:
        self._poll_min = poll_min
        self._poll_max = poll_max
        self._reader = reader
        self._shutdown = shutdown
        self._wakeup = wakeup
        self._polls = 0  # empty polls since the last traffic

    def busy(self) -> None:
        """Rows came: the next wait starts short again."""
        self._polls = 0

    def wait(self) -> None:
        delay = min(
            self._poll_max,
            self._poll_min * (2 ** min(self._polls, 16)),
            self._reader.next_due_in(),
        )
        self._polls += 1
        if self._wakeup is None:
            self._shutdown.wait(delay)
        elif self._wakeup.wait(delay):
            # A NOTIFY may announce a row scheduled sooner than any we knew of.
            self._reader.look_for_due_rows()
