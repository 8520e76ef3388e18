"""The short chaos profile, part of the normal suite: 3 replicas, ~10 faults, ~3k messages.

A failure prints the seed; `python -m tests.chaos --seed N --keep` replays it and keeps
the replicas' logs.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.chaos.runner import PROFILES, cleanup, run

pytestmark = pytest.mark.slow


def test_short_chaos_run_keeps_every_guarantee() -> None:
    seed = int(os.environ.get("RELAY_CHAOS_SEED") or random.randrange(1, 1_000_000))
    outcome = run(PROFILES["short"], seed)
    print(outcome.summary())
    assert outcome.report.ok, outcome.summary()
    assert len(outcome.history.faults) == PROFILES["short"].faults
    assert outcome.report.committed > 1_000
    cleanup(outcome)
