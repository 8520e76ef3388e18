"""The shutdown request, shared by the signal handler, the drain loop and the sink."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Shutdown:
    """Set once by SIGTERM/SIGINT. After `grace` seconds, work in flight is abandoned."""

    def __init__(self, grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._event = threading.Event()
        self._grace = grace
        self._clock = clock
        self._requested_at: float | None = None
        self._callbacks: list[Callable[[], None]] = []
        self.reason = ""

    def on_request(self, callback: Callable[[], None]) -> None:
        """Call `callback` when shutdown is requested: for waits not on our event."""
        self._callbacks.append(callback)

    def request(self, reason: str = "requested") -> None:
        if self._requested_at is None:
            self._requested_at = self._clock()
            self.reason = reason
        self._event.set()
        for callback in self._callbacks:
            callback()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def grace_over(self) -> bool:
        return self._requested_at is not None and self._clock() - self._requested_at > self._grace

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout`; True (early) if shutdown was requested."""
        return self._event.wait(timeout)
