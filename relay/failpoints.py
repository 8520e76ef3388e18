"""Crash points for the fault-injection suite (tests/chaos). TEST-ONLY: never set
RELAY_FAILPOINTS in production.

With RELAY_FAILPOINTS unset (the default) `hit()` returns at once and does nothing.
With it set to a directory, `hit(name)` looks for a file called `name` there; if it
exists, it is removed and this process SIGKILLs itself on the spot, as a crash at that
line would. The test arms a point by creating the file, so it chooses when and which
replica dies. Points: `after_publish` (acked by the sink, not yet marked) and
`in_settle` (in the fenced settle, before it commits: before its one statement
for a wholly acknowledged batch, inside its transaction otherwise). `stall()` holds a
thread instead, while a `stall_<name>` file exists.

This module reads its environment variable directly, unlike the rest of the relay
(relay.settings): a test hook must not become a documented setting.
"""

from __future__ import annotations

import os
import signal
import time

_DIRECTORY = os.environ.get("RELAY_FAILPOINTS") or None


def stall(name: str, longest: float = 60.0) -> None:
    """Hold this thread while a file called `stall_<name>` exists (up to `longest`
    seconds): a thread stuck where the point is, as on a database that does not answer.
    Point: `read_ahead` (the drain's read of its next batch)."""
    if _DIRECTORY is None:
        return
    path = os.path.join(_DIRECTORY, f"stall_{name}")
    deadline = time.monotonic() + longest
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def hit(name: str) -> None:
    if _DIRECTORY is None:
        return
    try:
        # Removing the file is the test-and-clear: a point fires once per arming.
        os.unlink(os.path.join(_DIRECTORY, name))
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
