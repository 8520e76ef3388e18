"""When a leader should hand its lease to a peer for want of the sink (docs/DESIGN.md,
"The lease"): nothing delivered for RELAY_GIVE_WAY_SECONDS while rows wait, and a live
peer says it reaches the sink. Nobody able: keep the lease, nothing is lost.

The decision only; the drain loop carries it out (the last settle first, then the sink's
reset and the lease's release). Pure but for the presence it reads.
"""

from __future__ import annotations

from typing import Protocol

from relay.drain.progress import Progress

# Each give-way doubles the window, up to this many times.
MAX_DOUBLINGS = 4


class Peers(Protocol):
    """What the policy reads of the other replicas (relay/store/presence.py)."""

    def able_peers(self) -> int: ...

    def gave_way(self) -> None: ...


class GiveWay:
    """Owned by the drain loop's thread alone."""

    def __init__(self, window_seconds: float, peers: Peers | None, progress: Progress) -> None:
        self._window = window_seconds  # 0: never
        self._peers = peers
        self._progress = progress
        # Times we gave way since the sink last answered us: each doubles the window, so
        # a sink that peers' probes reach but nobody can deliver to moves the lease ever
        # more rarely (a probe is weaker than a delivery).
        self._streak = 0

    def due(self) -> bool:
        window = self._window * 2 ** min(self._streak, MAX_DOUBLINGS)
        return (
            window > 0
            and self._peers is not None
            and self._progress.stalled_for() >= window
            and self._peers.able_peers() > 0
        )

    def sink_answered(self) -> None:
        self._streak = 0

    def giving_way(self) -> tuple[float, int]:
        """Note the give-way (the peers hear of it, so this replica does not campaign
        while one can deliver); how long nothing was delivered, and how many peers can."""
        assert self._peers is not None
        stalled, able = self._progress.stalled_for(), self._peers.able_peers()
        self._streak += 1
        self._peers.gave_way()
        return stalled, able
