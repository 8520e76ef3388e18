"""The lease protocol without servers: real `Elector`s and `Lease`s of three replicas on
the in-memory store (relay/store/memory.py), one fake clock for all, each replica
stepped (`Elector.turn`) or paused at will. The store's clock stands for the database's
`now()`; a replica's local deadline is the one it computes itself."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.lease.elector import Elector, ElectorTimings
from relay.lease.protocol import Lease
from relay.store.memory import MemoryStore

pytestmark = pytest.mark.unit

NAME = "core"
TTL, MARGIN, RENEW = 10.0, 2.0, 3.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Replica:
    lease: Lease
    elector: Elector


def replicas(count: int) -> tuple[FakeClock, MemoryStore, list[Replica]]:
    clock = FakeClock()
    store = MemoryStore(clock)
    made = []
    for n in range(count):
        lease = Lease(NAME, f"r{n}", TTL, MARGIN, clock)
        elector = Elector(
            ElectorTimings(TTL, RENEW, 0.5), store.lease_session(NAME), lease, clock=clock
        )
        made.append(Replica(lease, elector))
    return clock, store, made


def trusting(replicas: list[Replica]) -> list[Replica]:
    return [r for r in replicas if r.lease.token() is not None]


def test_a_paused_leader_stops_trusting_its_lease_before_a_standby_can_take_it() -> None:
    clock, _store, (a, b) = replicas(2)
    a.elector.turn()
    b.elector.turn()
    token = a.lease.token()
    assert token is not None and token.epoch == 1 and b.lease.token() is None
    clock.now += TTL - MARGIN - 0.01  # a is paused from here on
    assert a.lease.token() == token
    clock.now += 0.01
    assert a.lease.token() is None  # its local deadline: before the row expires
    clock.now += MARGIN - 0.01
    b.elector.turn()
    assert b.lease.token() is None  # the row is still a's by the store's clock
    clock.now += 0.01
    b.elector.turn()
    taken = b.lease.token()
    assert taken is not None and taken.epoch == 2
    a.elector.turn()  # a wakes up: it drops the lease and stays a standby
    a.elector.turn()
    assert a.lease.held_token() is None and trusting([a, b]) == [b]


def test_a_released_lease_is_taken_at_the_next_poll_not_after_a_ttl() -> None:
    clock, _store, (a, b) = replicas(2)
    a.elector.turn()
    a.elector.release()
    clock.now += 0.5
    b.elector.turn()
    token = b.lease.token()
    assert token is not None and token.epoch == 2


def test_a_leader_whose_clock_ran_slow_is_fenced_by_its_next_renewal() -> None:
    """The margin covers a clock drift of a few percent, not this one: a's local clock
    runs at half speed, so it still trusts its lease after the row expired and b took
    it. Its next renewal is refused, and it stops at once."""
    clock, _store, (b,) = replicas(1)
    slow = lambda: 1000.0 + (clock.now - 1000.0) / 2  # noqa: E731
    lease = Lease(NAME, "a", TTL, MARGIN, slow)
    a = Elector(ElectorTimings(TTL, RENEW, 0.5), _store.lease_session(NAME), lease, clock=slow)
    a.turn()
    clock.now += TTL + 0.1  # by the store's clock a's row expired; a's clock says 5 s
    b.elector.turn()
    assert lease.token() is not None and b.lease.token() is not None  # both believe
    a.turn()  # a renews (5 s since its last): refused, the epoch moved on
    assert lease.token() is None and lease.held_token() is None
    assert trusting([b]) == [b]


def test_a_renewal_that_fails_on_the_database_keeps_the_lease_until_the_local_deadline() -> None:
    clock, store, (a,) = replicas(1)
    a.elector.turn()
    token = a.lease.token()
    clock.now += RENEW
    store.fail_next(1)
    a.elector.turn()
    assert a.lease.token() == token  # one failed renewal: still within the deadline
    clock.now += TTL - MARGIN - RENEW
    store.fail_next(1)
    a.elector.turn()
    assert a.lease.token() is None and a.lease.held_token() is None  # dropped, not kept


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # which replica
            st.sampled_from(["turn", "turn", "turn", "release", "fail"]),
            st.floats(0.0, 6.0),  # then the clock moves this far (others paused)
        ),
        max_size=60,
    )
)
def test_at_most_one_replica_trusts_the_lease_and_it_is_the_rows_holder(
    steps: list[tuple[int, str, float]],
) -> None:
    """Any interleaving of turns, pauses (a replica not stepped), releases and failed
    statements: at every instant at most one replica trusts a token, and that token is
    the row's current holder and epoch, unexpired by the store's clock."""
    clock, store, group = replicas(3)
    for index, action, pause in steps:
        replica = group[index]
        if action == "turn":
            replica.elector.turn()
        elif action == "release":
            replica.elector.release()
        else:
            store.fail_next(1)
            replica.elector.turn()
        for moment in (0.0, pause):
            clock.now += moment
            holders = trusting(group)
            assert len(holders) <= 1
            if holders:
                token = holders[0].lease.token()
                row = store.leases[NAME]
                assert token is not None
                assert (row.holder, row.epoch) == (token.holder, token.epoch)
                assert row.expires > clock.now and not row.released
