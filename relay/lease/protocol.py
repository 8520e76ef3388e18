"""The lease: which replica may publish, until when, under which fencing epoch.

The protocol (docs/DESIGN.md, "The lease"):

1. `BEGIN ISOLATION LEVEL REPEATABLE READ`; read the lease row.
2. Held by someone else and not expired (by the DATABASE clock): stay standby.
3. Otherwise compare-and-swap: `UPDATE ... epoch = epoch + 1 ... WHERE epoch = seen`.
   A concurrent winner shows as SQLSTATE 40001 or as zero rows updated: we lost.
4. The holder trusts its lease only until a LOCAL monotonic deadline: the moment before
   the acquiring (or renewing) transaction began, plus ttl, minus a safety margin.
5. Every transaction that settles rows re-checks holder and epoch first (`lease_renew`
   in relay/sql/lease.sql, run by every settle); no match means roll back and stand by.
6. On shutdown the holder expires its lease at once so a standby takes over quickly.
7. A leader that cannot deliver (cut off from the sink, not from the database) gives
   the lease up the same way, once a live replica reports it can reach the sink
   (relay/store/presence.py); the drain loop decides, the elector's thread writes it.

Shards: with N > 1 shards each shard has a lease row of its own
(`shard_lease_name`), and every guarantee above holds per row. Every acquisition first
passes through its group's row (`lease_group_claim`): acquisitions of one group are
serialized, and the group's shard count changes only while no lease of the old count is
live, fencing them all, so two shard counts never drain one outbox at once.

`Lease` is this replica's belief (pure: no database driver here); `Elector`
(relay/lease/elector.py) is the thread that keeps it true, running the protocol's SQL steps
(relay/store/lease.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class LeaseToken:
    """Proof of holding: every fenced statement carries all three."""

    name: str
    holder: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Acquired:
    token: LeaseToken
    at: datetime | None = None  # database clock, read under the lease row's lock


@dataclass(frozen=True, slots=True)
class HeldByOther:
    holder: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class LostRace:
    detail: str


@dataclass(frozen=True, slots=True)
class OtherShardCount:
    """Replicas draining with another shard count hold a live lease (`lease`): this
    count waits until they are all gone (a rolling change of RELAY_SHARDS)."""

    lease: str | None


Attempt = Acquired | HeldByOther | LostRace | OtherShardCount


@dataclass(frozen=True, slots=True)
class Shard:
    """Which lease row: shard `shard` of `shards` of the lease `group`."""

    group: str
    shard: int = 0
    shards: int = 1

    @property
    def name(self) -> str:
        return shard_lease_name(self.group, self.shard, self.shards)

    def thread_name(self, role: str) -> str:
        """`relay-<role>`, and `-N` with shards: each lane's threads tell apart."""
        return f"relay-{role}" if self.shards == 1 else f"relay-{role}-{self.shard}"


def shard_lease_name(group: str, shard: int, shards: int) -> str:
    """The lease row of one shard: the lease's own name with one shard, as always."""
    return group if shards == 1 else f"{group}#{shard}/{shards}"


# --- this replica's belief -----------------------------------------------------------


class Lease:
    """Thread-safe local view: the token, and the monotonic deadline it is good until."""

    def __init__(
        self,
        name: str,
        holder: str,
        ttl: float,
        margin: float,
        clock: Clock,
        shard: Shard | None = None,
    ) -> None:
        self.shard = shard or Shard(name)
        assert self.shard.name == name, f"lease row {name!r} is not {self.shard}"
        self.name = name
        self.holder = holder
        self.ttl = ttl
        self.margin = margin
        self._clock = clock
        self._lock = threading.Lock()
        self._token: LeaseToken | None = None
        self._deadline = 0.0
        # "Since start" until the first acquisition: the gauge grows from a finite value.
        self._renewed_at = clock()
        self._changed = threading.Condition(self._lock)
        self._to_release: LeaseToken | None = None  # given up, not yet expired in the row
        self._fenced: LeaseToken | None = None  # lost to a newer holder, not yet reported
        self._wake = threading.Event()  # the elector's sleep ends early

    def token(self) -> LeaseToken | None:
        """The token if we may still publish under it; None once the deadline passed."""
        with self._lock:
            if self._token is not None and self._clock() < self._deadline:
                return self._token
            return None

    def held_token(self) -> LeaseToken | None:
        """The token we believe in, even if its local deadline has passed."""
        with self._lock:
            return self._token

    def seconds_left(self) -> float:
        with self._lock:
            return max(0.0, self._deadline - self._clock()) if self._token else 0.0

    def since_renewal(self) -> float:
        with self._lock:
            return self._clock() - self._renewed_at

    def acquired(self, token: LeaseToken, started_at: float) -> None:
        with self._lock:
            self._token = token
            self._deadline = started_at + self.ttl - self.margin
            self._renewed_at = started_at
            self._changed.notify_all()

    def renewed(self, token: LeaseToken, started_at: float) -> None:
        # `started_at` is taken before the renewing transaction began: the DB's now()
        # inside it is at least that late, so our deadline can never outlive the row's.
        with self._lock:
            if self._token == token:
                self._deadline = max(self._deadline, started_at + self.ttl - self.margin)
                self._renewed_at = max(self._renewed_at, started_at)

    def lose(self, token: LeaseToken | None = None) -> LeaseToken | None:
        """Forget the lease (only `token`'s, if given). Returns what was dropped."""
        with self._lock:
            dropped = self._token
            if dropped is None or (token is not None and token != dropped):
                return None
            self._token = None
            self._deadline = 0.0
            self._changed.notify_all()
            return dropped

    def give_up(self, token: LeaseToken) -> bool:
        """Stop publishing under `token` now and ask the elector to expire the row (a
        leader giving way). False if `token` was no longer ours."""
        with self._lock:
            if self._token is None or self._token != token:
                return False
            self._token = None
            self._deadline = 0.0
            self._to_release = token
            self._changed.notify_all()
        self._wake.set()
        return True

    def fenced(self, token: LeaseToken) -> None:
        """A fenced statement of ours matched no lease row: a newer holder exists. We
        stop at once; the elector's thread reports the loss."""
        with self._lock:
            if self._token is None or self._token != token:
                return
            self._token = None
            self._deadline = 0.0
            self._fenced = token
            self._changed.notify_all()
        self._wake.set()

    def take_fenced(self) -> LeaseToken | None:
        with self._lock:
            token, self._fenced = self._fenced, None
            return token

    def take_release(self) -> LeaseToken | None:
        """The token given up and not yet released in the database, once."""
        with self._lock:
            token, self._to_release = self._to_release, None
            return token

    def release_later(self, token: LeaseToken) -> None:
        """A release that failed: the elector tries again at its next turn."""
        with self._lock:
            if self._to_release is None and self._token is None:
                self._to_release = token

    def wake(self) -> None:
        self._wake.set()

    def doze(self, timeout: float) -> None:
        """The elector's sleep between turns; `wake()` or `give_up()` end it early."""
        self._wake.wait(timeout)
        self._wake.clear()

    def wait_held(self, timeout: float) -> LeaseToken | None:
        """Block until we hold the lease or `timeout` passes."""
        end = self._clock() + timeout
        with self._lock:
            # A token past its local deadline counts as not held: wait for the elector
            # to renew or drop it rather than spin on it.
            while self._token is None or self._clock() >= self._deadline:
                remaining = end - self._clock()
                if remaining <= 0:
                    return None
                self._changed.wait(min(remaining, 0.05))
            return self._token
