"""Instant wake-up (opt-in, RELAY_NOTIFY_CHANNEL): a session LISTENing for the apps'
NOTIFY, so the first row after a quiet spell goes out at once instead of at the next
poll (docs/howto/wake-up.md, "Instant wake-up").

Polling stays the safety net: a lost notification (the listen session down, an app that
does not NOTIFY) costs at most one poll interval, never a row. A notification is only a
hint to look now; what to send is still decided by the fetch alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

from relay.backoff import Backoff, Retrying
from relay.observe import metrics
from relay.observe.logging import get_logger
from relay.shutdown import Shutdown
from relay.store import db

log = get_logger("relay.wakeup")


class Wakeup:
    """What an idle drain loop waits on: its next poll, a notification, or shutdown."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout`, less if woken; True if woken. Cleared on return, before
        the caller fetches: a NOTIFY comes after its commit, so one that lands from here
        on is either seen by that fetch or wakes the next wait at once."""
        woken = self._event.wait(timeout)
        self._event.clear()
        return woken

    def set(self) -> None:
        self._event.set()


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """What the listener reads of the settings (`relay.daemon.configs.listener_config`)."""

    channel: str  # RELAY_NOTIFY_CHANNEL


class Listener:
    """LISTENs on its own session and wakes every lane's drain loop on a notification.

    One per replica, standbys included (a standby that takes the lease over is already
    listening): one idle session each. It reconnects with backoff whenever the session
    fails, and wakes the lanes each time it (re)starts listening, for rows committed
    while it was not.
    """

    def __init__(
        self,
        config: ListenerConfig,
        connect: Callable[[str], db.Conn],
        wakeups: list[Wakeup],
        shutdown: Shutdown,
    ) -> None:
        self._connect = connect
        self._listen = sql.SQL("LISTEN {}").format(sql.Identifier(config.channel))
        self._channel = config.channel
        self._wakeups = wakeups
        self._shutdown = shutdown
        self._stopping = threading.Event()
        self._retry = Retrying(Backoff(0.2, 5.0))
        self._thread = threading.Thread(target=self._run, name="relay-listen", daemon=True)
        shutdown.on_request(self.wake_all)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5.0)

    def wake_all(self) -> None:
        for wakeup in self._wakeups:
            wakeup.set()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._listen_until_stopped()
            except psycopg.Error as exc:
                metrics.NOTIFY_LISTENING.set(0)
                delay = self._retry.next_delay()
                log.warning(
                    "notify.listen_failed",
                    channel=self._channel,
                    error=db.describe_error(exc),
                    retry_in=round(delay, 3),
                )
                self._stopping.wait(delay)
        metrics.NOTIFY_LISTENING.set(0)

    def _listen_until_stopped(self) -> None:
        with self._connect("listen") as conn:
            conn.execute(self._listen)
            self._retry.reset()
            metrics.NOTIFY_LISTENING.set(1)
            log.info("notify.listening", channel=self._channel)
            self.wake_all()  # rows committed while we were not listening
            while not self._stopping.is_set():
                # Returns after a second without notifications: a chance to stop.
                for _ in conn.notifies(timeout=1.0):
                    metrics.NOTIFY_WAKEUPS.inc()
                    self.wake_all()
