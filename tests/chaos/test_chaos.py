"""The short chaos profile, part of the normal suite: 3 replicas, ~10 faults, ~3k messages,
once per sink whose server can be killed and restarted under the relay (the HTTP sink's
receiver is the test's own: its outages are covered by tests/test_http_sink.py).

A failure prints the seed; `python -m tests.chaos --sink S --seed N --keep` replays it
and keeps the replicas' logs.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.chaos.runner import PROFILES, cleanup, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sink", ["kafka", "nats", "rabbitmq"])
def test_short_chaos_run_keeps_every_guarantee(sink: str) -> None:
    seed = int(os.environ.get("RELAY_CHAOS_SEED") or random.randrange(1, 1_000_000))
    outcome = run(PROFILES["short"], seed, sink)
    print(outcome.summary())
    assert outcome.report.ok, outcome.summary()
    if sink == "nats":  # JetStream's duplicate window drops every redelivery
        assert outcome.report.duplicates == 0, outcome.summary()
    assert len(outcome.history.faults) == PROFILES["short"].faults
    assert outcome.report.committed > 1_000
    cleanup(outcome)


def test_sharded_chaos_run_keeps_every_guarantee_per_shard() -> None:
    """RELAY_SHARDS=8 over three replicas: every replica drains its share at once, and
    the same faults hit a replica holding several shards; order per key, no loss, one
    holder per shard epoch."""
    seed = int(os.environ.get("RELAY_CHAOS_SEED") or random.randrange(1, 1_000_000))
    outcome = run(PROFILES["sharded"], seed)
    print(outcome.summary())
    assert outcome.report.ok, outcome.summary()
    assert len(outcome.history.faults) == PROFILES["sharded"].faults
    assert outcome.report.committed > 1_000
    holders = {a.holder.split(".")[0] for a in outcome.history.acquisitions}
    # The three it started with; a replica that joins mid-run (join_and_leave) is
    # held to its fair share by the fault itself.
    assert {"r0", "r1", "r2"} <= holders, f"every replica should have drained some shard: {holders}"
    cleanup(outcome)
