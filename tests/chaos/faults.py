"""The faults, each injected, held and healed by one function that returns its record.

A fault is chosen from the run's seeded RNG; its own random choices (how long to hold,
crash or clean restart) come from the same RNG, so a seed replays the same schedule.
`in_flight_bound` is how many messages the fault can make the relay publish twice: three
batches for a crash or a pause (the drain publishes one batch while the previous one is
being settled, and up to a batch of Kafka stragglers may be waiting for their reports),
one batch per publish timeout that a paused broker can swallow and later persist.

`join_and_leave` scales the cluster out by one replica and back in (SIGTERM to one
drawn at random), as a rollout or an autoscaler does: retired replicas stay down.

"Broker" is the sink's server, whichever it is (tests/chaos/sinks.py says how each is
killed, paused and cut). `cut_leader_from_broker` needs every replica behind a proxy of
its own; where the sink cannot have that (Kafka without root) it is left out.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from tests.chaos.cluster import Cluster, Replica
from tests.chaos.history import Fault
from tests.support import wait_until

NETWORK_FAULTS = ("cut_leader_from_broker",)
LEADER_FAULTS = (
    "kill_leader",
    "kill_after_publish",
    "kill_in_settle",
    "pause_leader",
    *NETWORK_FAULTS,
)
ALL_FAULTS = (
    *LEADER_FAULTS,
    "join_and_leave",
    "restart_postgres",
    "crash_postgres",
    "kill_broker",
    "pause_broker",
)


@dataclass(slots=True)
class Timing:
    ttl: float
    batch: int
    publish_timeout: float  # the sink's: a paused broker may swallow a batch per this
    started: float  # monotonic start of the run
    give_way: float = 0.0  # RELAY_GIVE_WAY_SECONDS: a leader stalled this long hands over
    shards_per_replica: int = 1  # the most shards a replica can hold: each its own pipeline

    @property
    def in_flight(self) -> int:
        """Rows published but maybe not settled: the batch being published, the
        previous one, still being settled (the drain's pipeline), and up to a batch of
        Kafka stragglers (rows a partition held while the rest of their batch was
        answered: they stay in flight, unsettled, until their report comes); with
        shards, that for every shard the faulted replica can hold."""
        return 3 * self.batch * self.shards_per_replica


class Injector:
    def __init__(self, cluster: Cluster, timing: Timing, rng: random.Random) -> None:
        self.cluster = cluster
        self.timing = timing
        self.rng = rng
        self.watched = "default"  # the lease row the current fault watches

    def _now(self) -> float:
        return round(time.monotonic() - self.timing.started, 2)

    # --- helpers ---

    def leader(self, timeout: float = 30.0) -> tuple[Replica, int]:
        """A live holder and its epoch, of the lease the fault watches: with shards, a
        shard drawn from the run's RNG (its holder holds others too: all of them move)."""
        self.watched = self.rng.choice(self.cluster.lease_names())

        def find() -> tuple[Replica, int] | None:
            lease = self.cluster.lease(self.watched)
            if not lease or not lease["live"]:
                return None
            replica = self.cluster.by_holder(lease["holder"])
            if replica is None or not replica.alive():
                return None
            return replica, lease["epoch"]

        return wait_until(find, timeout=timeout, interval=0.05, message="a live leader")

    def wait_takeover(self, old_epoch: int, since: float, timeout: float = 75.0) -> float:
        # Not ttl-bound: a leader paused inside its settle transaction holds the lease
        # row's lock until idle_in_transaction_session_timeout (30 s) ends its session.
        def newer() -> bool:
            lease = self.cluster.lease(self.watched)
            return bool(lease and lease["live"] and lease["epoch"] > old_epoch)

        wait_until(newer, timeout=timeout, interval=0.02, message=f"an epoch after {old_epoch}")
        return round(time.monotonic() - since, 3)

    def heal(self) -> None:
        """Every replica running again and someone leading."""
        for replica in self.cluster.active():
            if not replica.alive():
                self.cluster.start_replica(replica)
        self.leader(timeout=60.0)

    # --- the faults ---

    def run(self, kind: str) -> Fault:
        fault: Callable[[], Fault] = getattr(self, kind)
        return fault()

    def kill_leader(self) -> Fault:
        replica, epoch = self.leader()
        at = self._now()
        killed = time.monotonic()
        self.cluster.kill(replica)
        takeover = self.wait_takeover(epoch, killed)
        return Fault("kill_leader", at, 0.0, self.timing.in_flight, takeover, replica.holder)

    def _kill_at(self, point: str, kind: str) -> Fault:
        replica, epoch = self.leader()
        at = self._now()
        armed = replica.failpoints / point
        replica.expected_exit = True
        armed.touch()
        note = f"{replica.holder} at {point}"
        try:
            wait_until(lambda: not replica.alive(), timeout=20, interval=0.01)
        except AssertionError:
            # No batch reached the point (an idle outbox): crash it anyway.
            armed.unlink(missing_ok=True)
            note += " (not reached: plain SIGKILL)"
            self.cluster.kill(replica)
        died = time.monotonic()
        takeover = self.wait_takeover(epoch, died)
        return Fault(kind, at, 0.0, self.timing.in_flight, takeover, note)

    def kill_after_publish(self) -> Fault:
        return self._kill_at("after_publish", "kill_after_publish")

    def kill_in_settle(self) -> Fault:
        return self._kill_at("in_settle", "kill_in_settle")

    def pause_leader(self) -> Fault:
        """SIGSTOP past the ttl: a standby takes over; the zombie wakes and must mark
        nothing (the checker's stale_mark)."""
        replica, epoch = self.leader()
        hold = self.timing.ttl + self.rng.uniform(1.0, 2.0)
        at = self._now()
        stopped = time.monotonic()
        replica.signal(signal.SIGSTOP)
        try:
            takeover = self.wait_takeover(epoch, stopped)
            remaining = hold - (time.monotonic() - stopped)
            if remaining > 0:
                time.sleep(remaining)  # part of the schedule: the zombie stays asleep
        finally:
            replica.signal(signal.SIGCONT)
        return Fault(
            "pause_leader", at, round(hold, 2), self.timing.in_flight, takeover, replica.holder
        )

    def cut_leader_from_broker(self) -> Fault:
        """The leader loses the broker, not the database: it keeps renewing its lease,
        so only giving way lets a standby that reaches the broker deliver. Held a moment
        past the takeover, then healed: the proxy drops what the cut leader wrote
        meanwhile; whatever its producer still holds and sends after the heal is the
        relay's to prevent and the checker's to catch (order, duplicates)."""
        replica, epoch = self.leader()
        proxy = replica.proxy
        assert proxy is not None, "cut_leader_from_broker needs a proxy per replica"
        hold = self.rng.uniform(0.5, 2.0)
        at = self._now()
        cut = time.monotonic()
        proxy.cut()
        try:
            takeover = self._wait_give_way(replica, epoch, cut)
            time.sleep(hold)  # part of the schedule: the old leader stays cut off
        finally:
            proxy.heal()
        note = replica.holder if takeover is not None else f"{replica.holder} (idle outbox)"
        return Fault(
            "cut_leader_from_broker",
            at,
            round(time.monotonic() - cut, 2),
            self.timing.in_flight,
            takeover,
            note,
        )

    def _wait_give_way(self, replica: Replica, old_epoch: int, since: float) -> float | None:
        """Seconds from the cut until another replica leads under a newer epoch.

        A leader gives way only while rows wait: the bound runs from the first moment
        the outbox had unsent rows. If none ever did (the producer reached its target),
        no takeover is due; None then.
        """
        due = self.timing.give_way + 2 * self.timing.ttl + 10.0
        waited_from: float | None = None
        while True:
            now = time.monotonic()
            lease = self.cluster.lease(self.watched)
            if (
                lease
                and lease["live"]
                and lease["epoch"] > old_epoch
                and lease["holder"] != replica.holder
            ):
                return round(now - since, 3)
            if waited_from is None and self.cluster.unsent():
                waited_from = now
            if waited_from is None and now - since > due:
                return None
            if waited_from is not None and now - waited_from > due:
                raise AssertionError(
                    f"{replica.holder} cut off from the broker for {now - since:.1f}s with rows"
                    f" waiting, and no replica took over (lease now {lease})"
                )
            time.sleep(0.05)

    def join_and_leave(self) -> Fault:
        """Scale out, then in: a replica of a new name joins (with shards, the others
        hand it their surplus), then one drawn at random (the newcomer or not) leaves
        with SIGTERM, releasing what it holds for the others to take at once. Each
        change must settle into a fair split, every shard held by a running replica,
        within a couple of ttl (the join also waits out the newcomer's start-up); the
        worse of the two is the fault's takeover."""
        at = self._now()
        began = time.monotonic()
        joined = self.cluster.add_replica()
        join_took = self._wait_fair(began, bound=2 * self.timing.ttl + 30.0, what="join")
        time.sleep(self.rng.uniform(0.5, 2.0))  # part of the schedule: four replicas drain
        leaver = self.rng.choice([r for r in self.cluster.active() if r.alive()])
        left = time.monotonic()
        self.cluster.retire(leaver)
        leave_took = self._wait_fair(left, bound=2 * self.timing.ttl + 2.0, what="leave")
        note = (
            f"{joined.holder} joined ({join_took:.2f}s), {leaver.holder} left ({leave_took:.2f}s)"
        )
        return Fault(
            "join_and_leave",
            at,
            round(time.monotonic() - began, 2),
            self.timing.in_flight,
            max(join_took, leave_took),
            note,
        )

    def _wait_fair(self, since: float, bound: float, what: str) -> float:
        """Seconds until every shard is held by a running replica and none holds more
        than ceil(shards / running replicas): the rebalance the issue bounds."""
        shards = self.cluster.shards

        def fair() -> bool:
            counts = self.cluster.shares()
            if counts is None:
                return False
            cap = -(-shards // len(counts))
            return shards == 1 or all(n <= cap for n in counts.values())

        try:
            wait_until(fair, timeout=bound, interval=0.05)
        except AssertionError:
            raise AssertionError(
                f"no fair split of {shards} shards {bound:.0f}s after a replica's {what}:"
                f" {self.cluster.shares()}"
            ) from None
        return round(time.monotonic() - since, 3)

    def _postgres_down(self, crash: bool) -> Fault:
        down = self.rng.uniform(0.5, 3.0)
        at = self._now()
        if crash:
            self.cluster.pg.kill()
        else:
            self.cluster.pg.stop("fast")
        time.sleep(down)
        self.cluster.pg.start()
        kind = "crash_postgres" if crash else "restart_postgres"
        return Fault(kind, at, round(down, 2), self.timing.in_flight, None, f"down {down:.1f}s")

    def restart_postgres(self) -> Fault:
        return self._postgres_down(crash=False)

    def crash_postgres(self) -> Fault:
        return self._postgres_down(crash=True)

    def kill_broker(self) -> Fault:
        """SIGKILL the sink's server and start it again on the same port."""
        at = self._now()
        began = time.monotonic()
        note = self.cluster.sink.kill_and_restart(self.cluster)
        took = time.monotonic() - began
        note = f"{note}, back after {took:.1f}s"
        return Fault("kill_broker", at, round(took, 2), self.timing.in_flight, None, note)

    def pause_broker(self) -> Fault:
        hold = self.rng.uniform(1.0, 2.5 * self.timing.publish_timeout)
        at = self._now()
        self.cluster.sink.pause()
        try:
            time.sleep(hold)
        finally:
            self.cluster.sink.resume()
        # Each publish timeout inside the pause can leave one batch in the broker's
        # socket buffer that it persists on waking, while the relay sends it again.
        copies = math.ceil(hold / self.timing.publish_timeout) + 1
        return Fault(
            "pause_broker", at, round(hold, 2), self.timing.batch * copies, None, f"{hold:.1f}s"
        )


def schedule(rng: random.Random, count: int, *, netcut: bool) -> list[str]:
    """Every kind at least once (when count allows), the rest drawn at random."""
    kinds_here = tuple(k for k in ALL_FAULTS if netcut or k not in NETWORK_FAULTS)
    kinds = list(kinds_here[:count])
    weights = {kind: 1.0 for kind in kinds_here} | {"kill_leader": 2.0, "pause_leader": 2.0}
    while len(kinds) < count:
        kinds += rng.choices(list(weights), weights=list(weights.values()))
    rng.shuffle(kinds)
    return kinds
