"""The console's database sessions: a few long-lived ones shared by the request
threads, never in the drain's path, each under the console's statement-timeout ceiling
(5 s): with RELAY_DATABASE_STATEMENT_TIMEOUT_SECONDS at 0 a slow query would otherwise
hold one of the few sessions for as long as it runs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from relay.settings import CommonSettings
from relay.store import db


def capped(settings: CommonSettings, ceiling: float) -> CommonSettings:
    """The database settings with the statement timeout at most `ceiling` seconds (0, no
    timeout, becomes the ceiling), which relay.store.db.connect then sets on each session."""
    configured = settings.database_statement_timeout_seconds
    timeout = ceiling if configured == 0 else min(configured, ceiling)
    return settings.model_copy(update={"database_statement_timeout_seconds": timeout})


class Pool:
    """A few long-lived sessions shared by the request threads; a session whose
    statement failed is closed rather than handed out again."""

    def __init__(self, settings: CommonSettings, size: int, statement_timeout: float) -> None:
        self._settings = capped(settings, statement_timeout)
        self._idle: queue.LifoQueue[db.Conn] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(size)

    @contextmanager
    def connection(self) -> Iterator[db.Conn]:
        if not self._slots.acquire(timeout=30):
            raise TimeoutError("every console database session is busy")
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = db.connect(self._settings, purpose="console")
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            if conn.closed:
                return
            self._idle.put(conn)
        finally:
            self._slots.release()

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return
