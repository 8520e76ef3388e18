"""The one thread a reader's session runs its statements on, one after the other."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class SessionThread:
    """One thread running the reader's statements, one after the other. A daemon, unlike
    a ThreadPoolExecutor's worker: a read left running at close (its server unreachable)
    must not hold the process's exit until a TCP timeout."""

    def __init__(self, name: str) -> None:
        self._steps: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, step: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        self._steps.put((partial(step, *args, **kwargs), future))
        return future

    def stop(self) -> None:
        """The thread ends after the steps handed to it."""
        self._steps.put(None)

    def _run(self) -> None:
        while (item := self._steps.get()) is not None:
            step, future = item
            try:
                future.set_result(step())
            except BaseException as exc:  # the caller's to raise, on its own thread
                future.set_exception(exc)
