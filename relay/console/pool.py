"""The console's database sessions: a few long-lived ones shared by the request
threads, never in the drain's path."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from relay import db
from relay.settings import CommonSettings


class Pool:
    """A few long-lived sessions shared by the request threads; a session whose
    statement failed is closed rather than handed out again."""

    def __init__(self, settings: CommonSettings, size: int) -> None:
        self._settings = settings
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
