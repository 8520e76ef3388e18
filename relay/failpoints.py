"""Crash points for the fault-injection suite (tests/chaos). TEST-ONLY: never set
RELAY_FAILPOINTS in production.

With RELAY_FAILPOINTS unset (the default) `hit()` returns at once and does nothing.
With it set to a directory, `hit(name)` looks for a file called `name` there; if it
exists, it is removed and this process SIGKILLs itself on the spot, as a crash at that
line would. The test arms a point by creating the file, so it chooses when and which
replica dies. Points: `after_publish` (acked by the sink, not yet marked) and
`in_settle` (inside the fenced mark transaction, before its commit).

This module reads its environment variable directly, unlike the rest of the relay
(relay.settings): a test hook must not become a documented setting.
"""

from __future__ import annotations

import os
import signal

_DIRECTORY = os.environ.get("RELAY_FAILPOINTS") or None


def hit(name: str) -> None:
    if _DIRECTORY is None:
        return
    try:
        # Removing the file is the test-and-clear: a point fires once per arming.
        os.unlink(os.path.join(_DIRECTORY, name))
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
