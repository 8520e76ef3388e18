"""Pure functions: SQL catalogue, backoff bounds, header encoding, topic rules."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from aiormq.exceptions import ChannelNotFoundEntity
from confluent_kafka import KafkaError

from relay.backoff import Backoff
from relay.drain.progress import Progress
from relay.observe.metrics import Health
from relay.sinks.base import Outcome
from relay.sinks.kafka.sink import classify
from relay.sinks.rabbitmq.outcomes import queue_is_absent
from relay.sql import QUERIES, load, parse

pytestmark = pytest.mark.unit


def test_every_query_the_code_names_exists() -> None:
    used: set[str] = set()
    for path in Path("relay").rglob("*.py"):
        used |= set(re.findall(r"QUERIES\.([a-z_]+)", path.read_text()))
    used -= {"names", "get"}
    assert used <= set(QUERIES.names()), used - set(QUERIES.names())
    assert set(QUERIES.names()) <= used, f"unused queries: {set(QUERIES.names()) - used}"


def test_every_sql_file_is_loaded_with_its_fragments_filled_in() -> None:
    queries = [QUERIES.get(name) for name in QUERIES.names()]
    assert {q.source for q in queries} == {p.name for p in Path("relay/sql").glob("*.sql")}
    assert not [q.name for q in queries if "{{" in q.sql]


def test_a_fragment_fills_its_markers_lined_up_under_them() -> None:
    text = """
-- fragment: due
-- The rule.
o.sent_at IS NULL
AND o.ok

-- name: one
-- Uses it twice.
SELECT 1 FROM outbox AS o WHERE {{due}}
  AND NOT ({{due}});
"""
    query = parse(text, "x.sql")["one"]
    assert query.description == "Uses it twice."
    assert query.sql == (
        "SELECT 1 FROM outbox AS o WHERE o.sent_at IS NULL\n"
        "                                AND o.ok\n"
        "  AND NOT (o.sent_at IS NULL\n"
        "           AND o.ok);"
    )


def test_a_fragment_may_use_fragments_each_lined_up_under_its_marker() -> None:
    """A long statement as an outline of parts: a part uses the file's shared rules."""
    text = """
-- fragment: due
o.sent_at IS NULL
AND o.ok

-- fragment: head
-- A part of the statement.
SELECT o.id
FROM outbox AS o
WHERE {{due}}
  AND NOT ({{due}})

-- name: one
WITH head AS (
    {{head}}
)
SELECT * FROM head;
"""
    assert parse(text, "x.sql")["one"].sql == (
        "WITH head AS (\n"
        "    SELECT o.id\n"
        "    FROM outbox AS o\n"
        "    WHERE o.sent_at IS NULL\n"
        "          AND o.ok\n"
        "      AND NOT (o.sent_at IS NULL\n"
        "               AND o.ok)\n"
        ")\n"
        "SELECT * FROM head;"
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-- name: q\nSELECT {{nope}};", r"x\.sql: query 'q' uses \{\{nope\}\}: no such fragment"),
        ("-- fragment: f\n1\n-- name: q\nSELECT 2;", r"x\.sql: fragments no query uses: f"),
        ("-- fragment: f\n1  -- one\n-- name: q\nSELECT {{f}};", "ends in a comment"),
        (
            "-- fragment: f\n{{g}}\n-- fragment: g\n{{f}}\n-- name: q\nSELECT {{g}};",
            r"'g' uses itself \(g -> f -> g\)",
        ),
        ("-- fragment: f\n{{f}}\n-- name: q\nSELECT {{f}};", r"'f' uses itself \(f -> f\)"),
        (
            "-- fragment: f\n{{g}}\n-- name: q\nSELECT {{f}};",
            r"fragment 'f' uses \{\{g\}\}: no such",
        ),
        ("-- name: q\nSELECT 1;\n-- name: q\nSELECT 2;", "'q' is defined twice"),
        ("-- name: q\n-- Only words.\n", "'q' has no SQL"),
    ],
)
def test_the_loader_refuses_what_it_cannot_fill_in(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse(text, "x.sql")


def test_a_name_two_files_define_is_an_error_naming_both(tmp_path: Path) -> None:
    (tmp_path / "a.sql").write_text("-- name: q\nSELECT 1;\n")
    (tmp_path / "b.sql").write_text("-- name: q\nSELECT 2;\n")
    with pytest.raises(ValueError, match=r"'q' is defined in both a\.sql and b\.sql"):
        load(tmp_path.glob("*.sql"))


def test_the_settles_fence_is_lease_renew_word_for_word() -> None:
    """The one-statement settles fence as the elector renews: one rule, two files."""
    renew = " ".join(QUERIES.lease_renew.removesuffix(";").split())
    for settle in (QUERIES.settle_delete_sent, QUERIES.settle_mark_sent):
        assert f"WITH fence AS ( {renew} )," in " ".join(settle.split())


def test_backoff_grows_is_jittered_and_capped() -> None:
    backoff = Backoff(base=0.5, cap=30.0)
    for failures in range(1, 200):
        ceiling = min(30.0, 0.5 * 2 ** (failures - 1))
        delays = {backoff.delay(failures) for _ in range(20)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(delays) > 1  # jittered
    assert backoff.delay(0) == 0.0


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, Outcome.DEAD),
        (KafkaError._MSG_TIMED_OUT, Outcome.UNAVAILABLE),
        (KafkaError._ALL_BROKERS_DOWN, Outcome.UNAVAILABLE),
        (KafkaError.PRODUCER_FENCED, Outcome.UNAVAILABLE),
        (KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, Outcome.UNAVAILABLE),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, Outcome.RETRY),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, Outcome.RETRY),
    ],
)
def test_kafka_error_classification(code: int, outcome: Outcome) -> None:
    assert classify(KafkaError(code)).outcome is outcome


@pytest.mark.parametrize(
    ("text", "absent"),
    [
        ("NOT_FOUND - no queue 'orders' in vhost '/'", True),
        ("NOT_FOUND - queue 'orders' in vhost '/' process is stopped by supervisor", False),
        ("NOT_FOUND - queue 'orders' in vhost '/' has crashed and failed to restart", False),
        (
            "NOT_FOUND - home node 'rabbit@a' of durable queue 'orders' in vhost '/' is down "
            "or inaccessible",
            False,
        ),
        (
            "NOT_FOUND - failed to perform operation on queue 'orders' in vhost '/' due to timeout",
            False,
        ),
    ],
)
def test_only_a_queue_that_does_not_exist_makes_a_returned_message_dead(
    text: str, absent: bool
) -> None:
    """The texts RabbitMQ answers a passive declare with (rabbit_amqqueue, rabbit_misc):
    a queue that exists but is not running, as while a crashed node recovers it, is no
    reason to dead-letter a message."""
    assert queue_is_absent(ChannelNotFoundEntity(text)) is absent


def test_health_names_the_loop_that_stopped_beating() -> None:
    now = [100.0]
    health = Health(clock=lambda: now[0])
    health.register("main", stale_after=60.0)
    health.register("elector", stale_after=30.0)
    now[0] += 40.0
    health.beat("main")
    assert health.stalled() == ["elector"]
    assert health.describe() == "elector=40.0s main=0.0s"
    health.beat("elector")
    assert health.stalled() == []


@pytest.mark.parametrize(
    ("code", "collateral"),
    [
        (KafkaError._PURGE_QUEUE, True),
        (KafkaError._PURGE_INFLIGHT, True),
        (KafkaError._FATAL, True),
        (KafkaError._GAPLESS_GUARANTEE, True),
        (KafkaError.PRODUCER_FENCED, True),
        (KafkaError._MSG_TIMED_OUT, False),  # a sick partition: its rows back off
        (KafkaError._ALL_BROKERS_DOWN, False),
    ],
)
def test_messages_dropped_with_their_producer_spend_no_attempt(code: int, collateral: bool) -> None:
    """A producer turned fatal by another message's permanent error (the gapless
    guarantee) purges the rest: those rows must not back off or be dead-lettered."""
    result = classify(KafkaError(code))
    assert result.outcome is Outcome.UNAVAILABLE
    assert result.collateral is collateral


def test_progress_counts_the_wait_from_the_first_undelivered_batch() -> None:
    now = [100.0]
    progress = Progress(clock=lambda: now[0])
    progress.publishing()
    now[0] += 5
    progress.publishing()  # the next batch does not restart the wait
    assert progress.stalled_for() == 5
    progress.published(reached=False)
    progress.idle()  # the failed rows may be waiting out a backoff: still stalled
    now[0] += 1
    assert progress.stalled_for() == 6
    progress.published(reached=True)
    assert progress.stalled_for() == 0
    progress.publishing()
    progress.published(reached=True)
    progress.idle()  # delivered, then nothing to do: not stalled
    now[0] += 60
    assert progress.stalled_for() == 0


def test_a_module_over_300_lines_says_why_at_its_top() -> None:
    for path in Path("relay").rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 300:
            docstring = text.split('"""', 2)[1]
            assert "Long:" in docstring, f"{path}: over 300 lines without a reason at its top"


def test_the_batch_histogram_exports_what_a_prometheus_histogram_does() -> None:
    """The end-to-end latency histogram is observed a batch at a time; its exposition
    must be the standard one, bucket for bucket (bounds are inclusive: le)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from relay.observe.metrics import LATENCY_BUCKETS, BatchHistogram

    values = [0.0, 0.0005, 0.001, 0.0011, 0.3, 2.0, 10.0, 50.0, 0.01]
    registry = CollectorRegistry()
    standard = Histogram("h", "d", ["sink"], buckets=LATENCY_BUCKETS, registry=registry)
    for value in values:
        standard.labels("kafka").observe(value)
    ours = BatchHistogram("h", "d", "sink", LATENCY_BUCKETS, registry=CollectorRegistry())
    ours.observe_many("kafka", values[:4])
    ours.observe_many("kafka", values[4:])

    def samples(text: str) -> list[str]:
        return [
            line for line in text.splitlines() if line.startswith("h_") and "created" not in line
        ]

    def sums(lines: list[str]) -> list[float]:
        return [float(line.split()[-1]) for line in lines if line.startswith("h_sum")]

    ours_lines = samples(generate_latest(ours.registry).decode())
    standard_lines = samples(generate_latest(registry).decode())
    without_sum = [line for line in ours_lines if not line.startswith("h_sum")]
    assert without_sum == [line for line in standard_lines if not line.startswith("h_sum")]
    # The sum is the same up to rounding: ours adds a batch with math.fsum (exact), the
    # standard one adds value by value.
    assert len(sums(ours_lines)) == len(sums(standard_lines)) == 1
    assert sums(ours_lines)[0] == pytest.approx(sums(standard_lines)[0], rel=1e-12)


def test_the_collector_is_tuned_once_start_up_is_done() -> None:
    """`relay run` freezes what start-up made and collects the young generation less
    often (relay/daemon/runtime.py); the test process gets its collector back as it was."""
    import gc

    from relay.daemon import runtime

    before = gc.get_threshold()
    try:
        runtime.tune_garbage_collector()
        assert gc.get_threshold() == (runtime.YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_batch_histogram_skips_ages_that_are_not_finite() -> None:
    """A row created at '-infinity' next to one at 'infinity' made math.fsum raise after
    the batch was published and before it was settled: the same batch again, forever."""
    from prometheus_client import CollectorRegistry

    from relay.observe.metrics import LATENCY_BUCKETS, BatchHistogram

    histogram = BatchHistogram("h", "d", "sink", LATENCY_BUCKETS, registry=CollectorRegistry())
    histogram.observe_many("kafka", [float("inf"), float("-inf"), float("nan"), 0.1])
    assert histogram.registry.get_sample_value("h_count", {"sink": "kafka"}) == 1.0
    assert histogram.registry.get_sample_value("h_sum", {"sink": "kafka"}) == 0.1


# --- the give-way decision, on a fake clock ----------------------------------------


class _FakePeers:
    def __init__(self, able: int) -> None:
        self.able, self.gave = able, 0

    def able_peers(self) -> int:
        return self.able

    def gave_way(self) -> None:
        self.gave += 1


def test_give_way_is_due_after_the_window_only_when_a_peer_can_deliver() -> None:
    from relay.drain.give_way import GiveWay
    from relay.drain.progress import Progress

    now = [100.0]
    progress = Progress(lambda: now[0])
    peers = _FakePeers(able=0)
    policy = GiveWay(30.0, peers, progress)
    progress.publishing()  # rows went out; the sink has not answered since
    now[0] += 29.9
    assert not policy.due()
    now[0] += 0.2
    assert not policy.due()  # nobody able: keep the lease, nothing is lost
    peers.able = 1
    assert policy.due()
    progress.published(reached=True)  # an answer about any row ends the wait
    assert not policy.due()
    assert not GiveWay(0.0, peers, progress).due()  # 0: never
    assert not GiveWay(30.0, None, progress).due()  # no presence: never


def test_each_give_way_doubles_the_window_until_the_sink_answers() -> None:
    from relay.drain.give_way import MAX_DOUBLINGS, GiveWay
    from relay.drain.progress import Progress

    now = [0.0]
    progress = Progress(lambda: now[0])
    peers = _FakePeers(able=2)
    policy = GiveWay(10.0, peers, progress)
    for streak in range(MAX_DOUBLINGS + 2):
        progress.reset()  # a new term as leader (the loop resets it on giving way)
        progress.publishing()
        window = 10.0 * 2 ** min(streak, MAX_DOUBLINGS)
        now[0] += window - 0.1
        assert not policy.due(), streak
        now[0] += 0.1
        assert policy.due(), streak
        stalled, able = policy.giving_way()
        assert stalled == pytest.approx(window) and able == 2
    assert peers.gave == MAX_DOUBLINGS + 2
    policy.sink_answered()
    progress.reset()
    progress.publishing()
    now[0] += 10.0
    assert policy.due()  # the window is back to its first length


# --- the lease's belief, on a fake clock -------------------------------------------


def _lease(now: list[float]) -> Any:
    from relay.lease.protocol import Lease

    return Lease("default", "me", ttl=10.0, margin=2.0, clock=lambda: now[0])


def test_a_lease_is_trusted_until_the_acquiring_transaction_began_plus_ttl_minus_margin() -> None:
    from relay.lease.protocol import LeaseToken

    now = [100.0]
    lease = _lease(now)
    token = LeaseToken("default", "me", 7)
    lease.acquired(token, started_at=99.0)  # the moment before the transaction began
    now[0] = 106.999
    assert lease.token() == token
    now[0] = 107.0  # 99 + 10 - 2: the row may outlive it, never the other way round
    assert lease.token() is None
    assert lease.held_token() == token  # believed in, but no longer published under


def test_a_renewal_extends_only_its_own_token_and_never_shortens() -> None:
    from relay.lease.protocol import LeaseToken

    now = [0.0]
    lease = _lease(now)
    ours, stale = LeaseToken("default", "me", 2), LeaseToken("default", "me", 1)
    lease.acquired(ours, started_at=0.0)
    lease.renewed(stale, started_at=5.0)  # a renewal of an older term
    now[0] = 8.0
    assert lease.token() is None
    lease.acquired(ours, started_at=5.0)
    lease.renewed(ours, started_at=4.0)  # a slower renewal that began earlier
    now[0] = 12.5
    assert lease.token() == ours  # still 5 + 8, not 4 + 8
    lease.renewed(ours, started_at=12.0)
    now[0] = 19.9
    assert lease.token() == ours


def test_giving_up_and_being_fenced_stop_publishing_at_once_and_are_reported_once() -> None:
    from relay.lease.protocol import LeaseToken

    now = [0.0]
    lease = _lease(now)
    first, second = LeaseToken("default", "me", 1), LeaseToken("default", "me", 2)
    lease.acquired(first, started_at=0.0)
    assert not lease.give_up(second)  # not ours: nothing happens
    assert lease.give_up(first)
    assert lease.token() is None
    assert lease.take_release() == first and lease.take_release() is None
    lease.acquired(second, started_at=0.0)
    lease.fenced(first)  # an old term's settle: not this one's business
    assert lease.token() == second
    lease.fenced(second)
    assert lease.token() is None
    assert lease.take_fenced() == second and lease.take_fenced() is None
    assert lease.lose() is None  # already dropped


# --- the settle pipeline, with a settler that answers when told ------------------


class _FakeSettler:
    """Answers each settle when the test says (the real one: a fenced transaction)."""

    def __init__(self) -> None:
        self.futures: list[Any] = []

    def submit(
        self, token: Any, batch: list[Any], settlement: Any, held: frozenset[str], ids: Any
    ) -> Any:
        from concurrent.futures import Future

        from relay.drain.batch import id_set
        from relay.drain.settler import InFlight

        future: Future[Any] = Future()
        self.futures.append(future)
        given = id_set([m.id for m in batch]) if ids is None else ids
        return InFlight(token, given, batch[0].id, batch[-1].id, settlement, held, future)

    def close(self) -> None:
        return None


def _row(row_id: int, key: str) -> Any:
    from relay.message import OutboxMessage

    return OutboxMessage(row_id, f"m{row_id}", "t", key, b"", None, None, "", 0.0, 0)


def test_the_pipeline_leaves_out_what_is_unsettled_and_lands_one_batch_before_the_next() -> None:
    import datetime as dt

    from relay.drain.batch import IdSet, Settlement, id_set
    from relay.drain.pipeline import SettlePipeline
    from relay.lease.protocol import LeaseToken

    now = [0.0]
    lease = _lease(now)
    token = LeaseToken("default", "me", 1)
    lease.acquired(token, started_at=0.0)
    settler = _FakeSettler()
    pipeline = SettlePipeline(settler, lease)  # type: ignore[arg-type]
    rows = [_row(1, "a"), _row(2, "b")]
    assert pipeline.submit(token, rows, Settlement(sent=[1, 2]), frozenset({"b"}), None)
    assert pipeline.unsettled() == ([IdSet(), id_set([1, 2])], frozenset({"b"}))
    assert not pipeline.landed
    settler.futures[0].set_result(dt.datetime.now(dt.UTC))
    assert pipeline.landed
    # The next submit lands the previous settle first.
    assert pipeline.submit(token, [_row(3, "a")], Settlement(sent=[3]), frozenset(), id_set([3]))
    assert pipeline.unsettled() == ([IdSet(), id_set([3])], frozenset())
    settler.futures[1].set_result(None)  # a newer holder fenced this settle out
    assert not pipeline.submit(
        token, [_row(4, "c")], Settlement(sent=[4]), frozenset(), id_set([4])
    )
    assert len(settler.futures) == 2  # nothing submitted under a fenced term
    assert lease.token() is None and lease.take_fenced() == token


# --- the elector's transitions, without a server ---------------------------------


def _elector(now: list[float]) -> tuple[Any, Any]:
    from relay.lease.elector import Elector, ElectorTimings

    class NoDatabase:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"this transition needs no database ({name})")

    lease = _lease(now)  # ttl 10, margin 2
    elector = Elector(ElectorTimings(10.0, 3.0, 0.5), NoDatabase(), lease, clock=lambda: now[0])
    return elector, lease


def test_the_elector_polls_as_a_standby_and_wakes_to_renew_and_to_see_its_deadline() -> None:
    from relay.lease.protocol import LeaseToken

    now = [0.0]
    elector, lease = _elector(now)
    waits = {round(elector._next_wait(), 3) for _ in range(50)}
    assert all(0.4 <= w <= 0.6 for w in waits) and len(waits) > 1  # jittered poll
    lease.acquired(LeaseToken("default", "me", 1), started_at=0.0)
    assert elector._next_wait() == 1.5  # half the renew interval
    now[0] = 7.0
    assert elector._next_wait() == pytest.approx(1.0)  # the deadline (8) comes first
    now[0] = 7.99
    assert elector._next_wait() == 0.05


def test_the_elector_renews_only_when_due_and_drops_a_lease_past_its_deadline() -> None:
    from relay.lease.protocol import LeaseToken

    now = [0.0]
    elector, lease = _elector(now)
    token = LeaseToken("default", "me", 1)
    lease.acquired(token, started_at=0.0)
    now[0] = 2.9
    elector._keep()  # a settle or acquisition renewed lately: no statement at all
    assert lease.token() == token
    now[0] = 8.0  # past the local deadline, with no renewal: gone, without asking
    elector._keep()
    assert lease.held_token() is None


def test_a_migration_that_retires_indexes_waits_for_the_rollout_of_the_one_it_follows() -> None:
    from relay.admin.migrate import Migration, _waits_for_rollout

    retire = Migration("0010", "0010_x.sql", "-- after-rollout-of: 0009\nDROP INDEX i;")
    assert retire.after_rollout_of == "0009"
    assert Migration("0009", "0009_x.sql", "CREATE INDEX i ...;").after_rollout_of is None
    assert _waits_for_rollout(retire, {}) is None  # a fresh database: nothing ran before
    assert _waits_for_rollout(retire, {"0009": "c"}) is None  # an earlier run applied it
    waits = _waits_for_rollout(retire, {"0007": "c"})  # this run is applying 0009
    assert waits is not None and "0010_x.sql waits" in waits and "relay migrate" in waits


def only_retires(sql: str) -> bool:
    """Whether a migration adds nothing a later one could build on: it drops, moves rows
    out of what it drops, and replaces what read it; it creates no table, index, type or
    column and grants nothing."""
    statements = re.sub(r"--[^\n]*", "", sql)
    adds = re.search(
        r"\bCREATE\s+(?:UNIQUE\s+)?(?:TABLE|INDEX|TYPE|SCHEMA|SEQUENCE)\b|\bADD\s+COLUMN\b|\bGRANT\b",
        statements,
        re.IGNORECASE,
    )
    return adds is None and re.search(r"\bDROP\b", statements) is not None


def test_a_migration_that_waits_for_a_rollout_only_retires() -> None:
    """The migrations after a waiting one go in without it (relay/admin/migrate.py): safe only
    while nothing later can need what a waiting one does, that is while each only retires."""
    from relay.admin.migrate import load

    assert only_retires("SET LOCAL lock_timeout = '5s';\nDROP INDEX IF EXISTS i; -- CREATE")
    assert only_retires("CREATE OR REPLACE VIEW v AS SELECT 1; ALTER TABLE t DROP COLUMN a;")
    assert not only_retires("DROP INDEX i; CREATE INDEX j ON t (a);")
    assert not only_retires("ALTER TABLE t ADD COLUMN a int; DROP INDEX i;")
    assert not only_retires("UPDATE t SET a = 1;")
    for migration in load():
        if migration.after_rollout_of is not None:
            assert only_retires(migration.sql), migration.name


def test_a_batch_without_gaps_is_left_out_as_one_span_and_one_with_gaps_by_its_ids() -> None:
    from relay.drain.batch import IdSet, id_set
    from relay.store.fetch import left_out_literals

    assert id_set([5, 6, 7, 8]) == IdSet((5, 6, 7, 8), "5,6,7,8", (5, 8))
    assert id_set([8, 5, 7, 6]) == IdSet((8, 5, 7, 6), "8,5,7,6", (5, 8))  # unsorted: all
    assert id_set([5, 7, 8]).span is None
    assert id_set([5, 6, 6, 8]).span is None  # 7 is not in flight
    assert id_set([2**63 - 2, 2**63 - 1]).span is None  # [a, b] is stored as [a, b + 1)
    assert id_set([]) == IdSet()
    parts = [IdSet(), id_set([1, 2, 3]), id_set([10, 12]), id_set([20])]
    assert left_out_literals(parts) == ("{10,12}", "{[1,3],[20,20]}")
    assert left_out_literals([IdSet()]) == ("{}", "{}")


def test_a_server_older_than_postgresql_14_stops_start_up_naming_the_setting() -> None:
    from types import SimpleNamespace

    from relay.settings import SettingsError
    from relay.store import startup_checks

    conn = SimpleNamespace(info=SimpleNamespace(server_version=130011))
    with pytest.raises(SettingsError) as caught:
        startup_checks.schema(conn, None)  # type: ignore[arg-type]
    assert caught.value.name == "RELAY_DATABASE_URL"
    assert "PostgreSQL 13" in str(caught.value) and "14 or later" in str(caught.value)


def test_settings_are_made_of_exactly_the_registered_sinks() -> None:
    """The registry and `Settings`' bases are both written out: a sink added to one
    and not the other would lose its variables or its `RELAY_SINK` name."""
    from relay.settings import CommonSettings, Settings
    from relay.sinks import sink_specs
    from relay.sinks.settings import SinkSettings

    bases = [base for base in Settings.__bases__ if base not in (CommonSettings, SinkSettings)]
    assert bases == [spec.settings for spec in sink_specs().values()]


def test_at_most_twelve_modules_sit_directly_in_the_package() -> None:
    """Each part is a package (docs/DESIGN.md, "Layout"); the top holds what all share."""
    top = sorted(path.name for path in Path("relay").glob("*.py"))
    assert len(top) <= 12, top
