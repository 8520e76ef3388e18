"""The checker fails on histories that broken relays would produce, with the right finding.

Each test starts from a correct history (two leaders, a handover, a duplicate batch
after the crash) and breaks it the way a known bug would.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from tests.chaos.checker import check
from tests.chaos.history import (
    Acquired,
    Delivered,
    Fault,
    History,
    Produced,
    Settled,
    lease_history,
    parse_payload,
)

pytestmark = pytest.mark.unit


T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def produced(key: str, seq: int, kind: str = "normal") -> Produced:
    return Produced(f"{key}-{seq}", key, seq, kind)  # type: ignore[arg-type]


def delivered(p: Produced, offset: int, generation: int = 0) -> Delivered:
    return Delivered(p.message_id, p.key, p.seq, generation, 0, offset)


def good_history() -> History:
    a = [produced("a", i) for i in range(4)]
    b = [produced("b", i) for i in range(3)]
    poison = produced("b", 3, "poison")
    # r1 delivers a0 a1 b0, crashes after publishing a2 b1 (unsettled); r2 takes over,
    # publishes a2 b1 again, then the rest.
    stream = [a[0], a[1], b[0], a[2], b[1], a[2], b[1], a[3], b[2]]
    return History(
        committed=[*a, *b, poison],
        attempted_ids={p.message_id for p in [*a, *b, poison]} | {"rolled-back-1"},
        delivered=[delivered(p, i) for i, p in enumerate(stream)],
        acquisitions=[Acquired("r1", 1, at(0)), Acquired("r2", 2, at(10))],
        settles=[
            Settled("r1", 1, at(1), 3, 1, 3),
            Settled("r2", 2, at(11), 4, 4, 7),
            Settled("r2", 2, at(12), 0, 8, 8),
        ],
        dead_letters={poison.message_id: "invalid Kafka topic name 'bad topic'"},
        faults=[Fault("kill_leader", at=5.0, in_flight_bound=2)],
        recovery_seconds=3.0,
        recovery_bound=60.0,
    )


def test_a_correct_history_passes_and_counts_its_duplicates() -> None:
    report = check(good_history())
    assert report.ok, report.summary()
    assert (report.committed, report.unique, report.duplicates) == (7, 7, 2)


def test_marking_without_the_fence_is_a_stale_mark() -> None:
    # A zombie r1 (paused past its ttl) wakes up and marks a batch after r2 took epoch 2:
    # what a settle transaction without the lease check would let through.
    history = good_history()
    history.settles.append(Settled("r1", 1, at(10.5), 2, 4, 5))
    report = check(history)
    assert report.checks_failed() == {"stale_mark"}, report.summary()
    assert "r1 epoch 1" in report.summary()


def test_two_replicas_believing_in_one_epoch_is_found() -> None:
    # A lost compare-and-swap taken for a win (zero rows updated not checked).
    history = good_history()
    history.acquisitions.append(Acquired("r3", 2, at(10.2)))
    history.settles.append(Settled("r3", 2, at(10.4), 1, 9, 9))
    report = check(history)
    assert "epoch_shared" in report.checks_failed(), report.summary()


def cursor_poller(commit_order: list[Produced], ids: dict[str, int]) -> list[Produced]:
    """The classic broken relay: publish rows as they become visible, but only those with
    an id above the last id seen. A row with a low id that commits late is skipped."""
    out, last = [], 0
    for p in commit_order:
        if ids[p.message_id] > last:
            out.append(p)
            last = ids[p.message_id]
    return out


def test_epochs_are_per_shard_lease_and_a_zombie_of_one_shard_is_found() -> None:
    # Shards: each lease row counts its own epochs, so r1 and r2 both holding epoch 1 of
    # two different shards is right; a settle of shard 1 under an epoch that shard has
    # superseded is still a stale mark.
    history = good_history()
    history.acquisitions += [
        Acquired("r2", 1, at(0), "default#1/2"),
        Acquired("r1", 2, at(20), "default#1/2"),
    ]
    history.settles.append(Settled("r2", 1, at(2), 1, 9, 9, "default#1/2"))
    assert check(history).ok, check(history).summary()
    history.settles.append(Settled("r2", 1, at(21), 1, 10, 10, "default#1/2"))
    report = check(history)
    assert report.checks_failed() == {"stale_mark"}, report.summary()
    assert "r2 default#1/2 epoch 1" in report.summary()


def test_a_last_id_cursor_that_skips_a_late_commit_loses_a_message() -> None:
    history = good_history()
    late = produced("c", 0)  # inserted first (id 1), committed last
    early = [produced("d", i) for i in range(3)]  # ids 2..4, committed at once
    ids = {late.message_id: 1} | {p.message_id: i + 2 for i, p in enumerate(early)}
    published = cursor_poller([*early, late], ids)
    base = len(history.delivered)
    history.committed += [late, *early]
    history.delivered += [delivered(p, base + i) for i, p in enumerate(published)]
    report = check(history)
    assert report.checks_failed() == {"lost"}, report.summary()
    assert "c:0" in report.summary()


def test_out_of_order_per_key_is_found_after_dedup() -> None:
    history = good_history()
    # b2 overtakes b1: a failed b1 did not block the later row of its key.
    stream = history.delivered
    i1 = next(i for i, d in enumerate(stream) if d.seq == 1 and d.key == "b")
    i2 = next(i for i, d in enumerate(stream) if d.seq == 2 and d.key == "b")
    stream[i1], stream[i2] = (
        replace(stream[i2], offset=stream[i1].offset),
        replace(stream[i1], offset=stream[i2].offset),
    )
    report = check(history)
    assert report.checks_failed() == {"order"}, report.summary()


def test_a_rolled_back_or_poison_message_delivered_is_a_phantom() -> None:
    history = good_history()
    history.delivered.append(Delivered("rolled-back-1", "a", 9, 0, 0, 100))
    report = check(history)
    assert report.checks_failed() == {"phantom"}, report.summary()
    assert "rolled back" in report.summary()


def test_duplicates_beyond_the_batches_in_flight_are_found() -> None:
    history = good_history()
    history.delivered += [replace(d, offset=200 + i) for i, d in enumerate(history.delivered)]
    report = check(history)
    assert report.checks_failed() == {"duplicates"}, report.summary()


def test_poison_kept_in_the_drain_or_good_rows_dead_lettered_are_found() -> None:
    history = good_history()
    poison_id = next(p.message_id for p in history.committed if p.kind == "poison")
    history.dead_letters = {poison_id: None, "a-3": "HTTP 500"}
    report = check(history)
    assert report.checks_failed() == {"poison_not_dead_lettered", "good_row_dead_lettered"}


def test_lag_that_never_returns_to_zero_is_found() -> None:
    history = good_history()
    history.recovery_seconds = None
    assert check(history).checks_failed() == {"lag"}


def test_lease_history_reads_the_replicas_json_events() -> None:
    lines = [
        json.dumps(
            {"event": "lease.acquired", "holder": "r1", "epoch": 3, "db_time": at(1).isoformat()}
        ),
        "Traceback (most recent call last):",
        '{"event": "batch.settled", "holder": "r1", "epoch": 3, "db_time": "'
        + at(2).isoformat()
        + '", "sent": 5, "first_id": 10, "last_id": 14}',
        '{"event": "batch.settled", "holder": "r1", "ep',  # cut short by SIGKILL
    ]
    acquisitions, settles = lease_history(lines)
    assert acquisitions == [Acquired("r1", 3, at(1))]
    assert settles == [Settled("r1", 3, at(2), 5, 10, 14)]
    assert parse_payload(b"k12:7 xxxx") == ("k12", 7)
