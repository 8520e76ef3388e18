"""Nothing the app writes can stop the relay: every row, in the relay's table or an own
table whose columns may be NULL, is delivered or dead-lettered with its reason, and a row
too large to send is dead-lettered from its size without ever being loaded. On real
PostgreSQL, Kafka and a real HTTP receiver."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.rows import dict_row

from relay.daemon.app import RelayApp
from relay.drain.batch import BatchLimits
from relay.errors import SettingsError
from relay.observe import lag
from relay.store import db
from tests import test_own_table
from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness.kafka import TansuBroker, consume
from tests.harness.webhook import WebhookServer
from tests.sink_targets import Target
from tests.support import running_relay, scalar, wait_until
from tests.test_fetch import fetch

TABLE = "app.events"
VIEW_SCHEMA = "relay_app_events"
# An app's hand-made outbox with nothing declared NOT NULL but its id: every column the
# relay needs may be NULL, and the headers are json (which holds \u0000; jsonb cannot).
NULLABLE_TABLE = """
CREATE SCHEMA app;
CREATE TABLE app.events (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    msg_id     text,
    kind       text,
    entity     text,
    body       bytea,
    meta       json,
    made_at    timestamptz DEFAULT now(),
    note       text
);
"""
COLUMNS = {
    "message_id": "msg_id",
    "topic": "kind",
    "key": "entity",
    "payload": "body",
    "headers": "meta",
    "created_at": "made_at",
    "header:note": "note",
}
UNSETTLED_OWN = (
    "SELECT count(*) FROM app.events WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL"
)


def migrate_own_table(database: str) -> None:
    """`relay migrate --own-table` for app.events, and the relay role's grants on it."""
    done = test_own_table.migrate_own_table(database, columns=COLUMNS, table=TABLE)
    assert done.returncode == 0, done.stderr
    test_own_table.grant_view(database, VIEW_SCHEMA)


@pytest.fixture
def nullable_table(database: str) -> str:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(NULLABLE_TABLE)
    migrate_own_table(database)
    return database


def own_insert(dsn: str, rows: list[dict[str, Any]]) -> list[int]:
    """The app's inserts, any column NULL or odd; the ids in order."""
    ids = []
    with psycopg.connect(dsn) as conn, conn.transaction():
        for row in rows:
            found = conn.execute(
                "INSERT INTO app.events (msg_id, kind, entity, body, meta, made_at, note)"
                " VALUES (%(msg_id)s, %(kind)s, %(entity)s, %(body)s, %(meta)s::json,"
                "         %(made_at)s::timestamptz, %(note)s) RETURNING id",
                {"made_at": "now", "body": b"x", "meta": None, "note": None} | row,
            ).fetchone()
            assert found is not None
            ids.append(int(found[0]))
    return ids


def dead_reasons(dsn: str) -> dict[str | None, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT entity, relay_dead_letter_reason FROM app.events"
            " WHERE relay_dead_lettered_at IS NOT NULL"
        ).fetchall()
    return {entity: reason for entity, reason in rows}


def test_rows_with_null_or_unsendable_columns_are_dead_lettered_and_the_drain_goes_on(
    make_settings: SettingsFactory, nullable_table: str, kafka: TansuBroker, topic: str
) -> None:
    """Before: a NULL topic crashed the drain thread over Kafka (every replica in turn);
    a NULL created_at raised after the broker's ack, so the row was published again on
    every restart; json headers holding \\u0000 failed every fetch; a message id with a
    line break went into the sinks' headers."""
    database = nullable_table
    good: list[dict[str, Any]] = [
        {"msg_id": uuid.uuid4().hex, "kind": topic, "entity": f"ok{i}"} for i in range(3)
    ]
    poison: list[dict[str, Any]] = [
        {"msg_id": "a", "kind": None, "entity": "null-topic"},
        {"msg_id": "b", "kind": topic, "entity": "null-created-at", "made_at": None},
        {"msg_id": "c\r\nx-evil: 1", "kind": topic, "entity": "line-break-id"},
        {"msg_id": None, "kind": topic, "entity": "null-id"},
        {"msg_id": "d", "kind": topic, "entity": "nul-header", "meta": '{"a": "x\\u0000y"}'},
        {"msg_id": "e", "kind": topic, "entity": "huge-number", "meta": '{"a": 1e1000000}'},
        {"msg_id": "f", "kind": topic, "entity": "lone-surrogate", "meta": '{"a": "\\ud800"}'},
        {"msg_id": "g", "kind": topic, "entity": "long-header", "note": "n" * 70_000},
        {"msg_id": "h", "kind": "t" * 2000, "entity": "long-topic"},
    ]
    own_insert(database, [good[0], *poison, good[1]])
    settings = make_settings(outbox_table=TABLE, lease_name="app", retention_seconds=3600)
    with running_relay(settings) as app:
        wait_until(lambda: scalar(database, UNSETTLED_OWN) == 0, 30, message="all settled")
        own_insert(database, [good[2]])  # the drain still runs
        wait_until(lambda: scalar(database, UNSETTLED_OWN) == 0, 30, message="the last one")
        assert not app.shutdown.requested
    reasons = dead_reasons(database)
    assert set(reasons) == {row["entity"] for row in poison}
    assert reasons["null-topic"] == "topic is NULL"
    assert reasons["null-created-at"] == "created_at is NULL"
    assert "no id a header can carry" in reasons["line-break-id"]
    assert "message_id is NULL" in reasons["null-id"]
    assert "jsonb cannot hold: unsupported Unicode escape" in reasons["nul-header"]
    assert "jsonb cannot hold" in reasons["huge-number"]
    assert "jsonb cannot hold" in reasons["lone-surrogate"]
    assert reasons["long-header"] == (
        "headers must be a JSON object, got string: header note holds over 65536 bytes"
    )
    assert reasons["long-topic"] == "topic is 2000 bytes, over 1024 (no sink takes it)"
    records = consume(kafka.bootstrap_servers, topic, min_count=3)
    assert sorted(r.headers["message-id"].decode() for r in records) == sorted(
        row["msg_id"] for row in good
    )


def test_an_id_column_that_may_be_null_is_refused_by_the_migration(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app; CREATE TABLE app.events (seq bigint, kind text)")
    done = subprocess.run(
        relay_command("migrate", "--own-table"),
        env=relay_env(
            database,
            RELAY_OUTBOX_TABLE=TABLE,
            RELAY_OUTBOX_COLUMNS=json.dumps({"id": "seq", "topic": "kind"}),
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "RELAY_OUTBOX_COLUMNS" in done.stderr
    assert "SET NOT NULL" in done.stderr
    assert scalar(database, "SELECT to_regclass('relay_app_events.outbox')") is None


# --- one huge row --------------------------------------------------------------------

HUGE = 192 << 20  # past the 512Mi a replica gets, with the copies a fetch makes


def test_a_row_over_the_message_limit_comes_without_its_bytes_and_with_its_size(
    database: str,
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, headers) VALUES"
            " ('t', 'big', repeat('x', 5000)::bytea, '{\"h\": \"v\"}'),"
            " ('t', 'small', 'y', '{\"h\": \"v\"}')"
        )
    limits = BatchLimits(rows=10, bytes=1 << 20, per_key=10, message_bytes=4096)
    rows = {r.key: r for r in fetch(database, limits)}
    assert rows["big"].payload is None and rows["big"].headers is None
    # 5000 of payload, 1 of topic, 3 of key, 2 of header name and value
    assert rows["big"].unsendable == (
        "the row holds 5006 bytes of payload, topic, key and headers, over"
        " RELAY_MESSAGE_MAX_BYTES (4096)"
    )
    assert rows["small"].payload == b"y" and rows["small"].unsendable is None


def test_sizes_are_read_not_printed_and_count_the_topic(database: str) -> None:
    """Before: a jsonb value of control characters, stored in a few MB, printed past
    what one text can hold when the fetch measured the headers as JSON text, and every
    fetch failed; a 50 MB topic was not counted at all and came whole."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, headers) VALUES"
            " ('t', 'escapes', 'x', jsonb_build_object('a', repeat(chr(1), 180000000))),"
            " (repeat('t', 50000000), 'topic', 'x', NULL),"
            " ('t', 'fine', 'y', NULL)"
        )
    rows = {r.key: r for r in fetch(database, BatchLimits(10, 1 << 20, 10, message_bytes=1 << 20))}
    assert rows["escapes"].unsendable is not None
    assert "the row holds 180000010 bytes" in rows["escapes"].unsendable
    assert rows["topic"].unsendable is not None
    assert "the row holds 50000006 bytes" in rows["topic"].unsendable
    assert rows["topic"].topic == "t" * 200  # cut: enough for its dead-letter line
    assert rows["fine"].payload == b"y" and rows["fine"].unsendable is None


def test_a_view_an_earlier_release_made_is_refused(
    make_settings: SettingsFactory, nullable_table: str
) -> None:
    """The view carries checks the drain relies on (a message id no header can carry,
    headers jsonb cannot hold): one made before them must be made again."""
    with psycopg.connect(nullable_table, autocommit=True) as conn:
        conn.execute(f"COMMENT ON VIEW {VIEW_SCHEMA}.outbox IS NULL")
    settings = make_settings(outbox_table=TABLE, lease_name="app")
    with pytest.raises(SettingsError, match="run `relay migrate --own-table` again"):
        db.connect(settings, purpose="drain")
    migrate_own_table(nullable_table)
    db.connect(settings, purpose="drain").close()


def _peak_rss(pid: int) -> int:
    """The process's high-water mark of resident memory, in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def relay_process(database: str, kafka: TansuBroker, topic: str) -> Iterator[subprocess.Popen[str]]:
    env = relay_env(database, kafka.bootstrap_servers, RELAY_LEASE_TTL_SECONDS="3")
    process = subprocess.Popen(
        relay_command("run"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_huge_row_is_dead_lettered_without_the_replica_ever_holding_it(
    database: str, kafka: TansuBroker, topic: str, relay_process: subprocess.Popen[str]
) -> None:
    """Before: the first ready row was fetched whole whatever its size; a row of a few
    hundred MB took a replica past its memory limit, and every replica in turn."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', 'before')", (topic,)
        )
        conn.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', repeat('x', %s)::bytea)",
            (topic, HUGE),
        )
        conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', 'after')", (topic,))
    unsettled = "SELECT count(*) FROM outbox"
    wait_until(lambda: scalar(database, unsettled) == 0, 60, message="the outbox settled")
    assert relay_process.poll() is None, relay_process.stderr
    reason = scalar(database, "SELECT dead_letter_reason FROM outbox_dead_letters")
    # Moved into outbox_dead whole, after the settle, in a transaction of its own without
    # the statement timeout a copy of that size could outlast.
    assert scalar(database, "SELECT octet_length(payload) FROM outbox_dead") == HUGE
    assert (
        f"holds {HUGE + len(topic) + 1} bytes" in reason
        and "RELAY_MESSAGE_MAX_BYTES (1000000)" in reason
    )
    records = consume(kafka.bootstrap_servers, topic, min_count=2)
    assert [r.value for r in records] == [b"before", b"after"]
    assert _peak_rss(relay_process.pid) < HUGE // 2


# --- any row the app could write -----------------------------------------------------

_ODD_TEXT = st.sampled_from(
    ["", ".", "..", "../x", "a/b", "%2e%2e", "a b", "é", "\x01", "x\r\ny: z", "\t", "?q=1", "#f"]
)
# What a text column can hold: anything but NUL.
_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")
_TEXT = st.one_of(
    st.none(),
    _ODD_TEXT,
    st.text(_CHARS, max_size=40),
    st.text(_CHARS, min_size=250, max_size=300),
)
_JSON_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_JSON = st.recursive(
    _JSON_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=10), inner, max_size=3)
    ),
    max_leaves=8,
)
# json a json column holds and jsonb cannot: the relay's own table never sees them.
_NOT_JSONB = ('{"a": 1e1000000}', '{"a": "\\ud800"}')
_HEADERS = st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=12), _JSON_SCALAR, max_size=4).map(json.dumps),
    _JSON.map(json.dumps),
    st.just('{"a": "x\\u0000"}'),
    st.sampled_from(_NOT_JSONB),
    st.just('{"a": 1, "a": 2}'),
    st.just('"\\u0000"'),
)
_ROW = st.fixed_dictionaries(
    {
        # A prefix to a unique suffix: None, the empty id, and one of 300 characters
        # stay as they are (the app's ids are unique; a delivery names its row).
        "msg_id": st.one_of(
            st.none(),
            st.sampled_from(["", "x" * 300, "valid:", "a b:", "x\r\ny: z:", "\x01:", "é:"]),
        ),
        "kind": _TEXT,
        "entity": _TEXT,
        "body": st.one_of(st.none(), st.binary(max_size=300)),
        "meta": _HEADERS,
        "made_at": st.sampled_from([None, "now", "infinity", "-infinity", "4000-01-01 00:00Z"]),
    }
)


def _unique(row: dict[str, Any]) -> dict[str, Any]:
    if row["msg_id"] and row["msg_id"].endswith(":"):
        return row | {"msg_id": row["msg_id"] + uuid.uuid4().hex}
    return row


@pytest.fixture
def receiver() -> Iterator[WebhookServer]:
    with WebhookServer() as server:
        yield server


class Layout:
    """Where the app writes: the relay's own `outbox`, or a table of its own whose
    columns may all be NULL (and whose headers are json)."""

    def __init__(self, name: str, database: str) -> None:
        self.name, self.database = name, database
        own = name == "own"
        # Retention mode: the relay's sent rows are in outbox_sent, its dead letters in
        # outbox_dead, the others in outbox.
        self.table = (
            "app.events"
            if own
            else "(SELECT id, message_id, topic, NULL::timestamptz AS sent_at,"
            " NULL::timestamptz AS dead_lettered_at, NULL AS dead_letter_reason"
            " FROM outbox UNION ALL SELECT id, message_id, topic, sent_at, NULL, NULL"
            " FROM outbox_sent UNION ALL SELECT id, message_id, topic, NULL,"
            " dead_lettered_at, dead_letter_reason FROM outbox_dead) AS every_row"
        )
        self.ident = "msg_id" if own else "message_id::text"
        self.topic = "kind" if own else "topic"
        self.sent, self.dead, self.reason = (
            ("relay_sent_at", "relay_dead_lettered_at", "relay_dead_letter_reason")
            if own
            else ("sent_at", "dead_lettered_at", "dead_letter_reason")
        )

    def insert(self, rows: list[dict[str, Any]]) -> list[int]:
        if self.name == "own":
            return own_insert(self.database, rows)
        ids = []
        with psycopg.connect(self.database) as conn, conn.transaction():
            for row in rows:
                meta = row["meta"]
                if meta is not None and ("\\u0000" in meta or meta in _NOT_JSONB):
                    meta = None  # jsonb cannot hold it: the app could not write it here
                found = conn.execute(
                    "INSERT INTO outbox (topic, key, payload, headers)"
                    " VALUES (%s, %s, %s, %s::jsonb) RETURNING id",
                    (row["kind"] or "", row["entity"], row["body"], meta),
                ).fetchone()
                assert found is not None
                ids.append(int(found[0]))
        return ids

    def settled(self, ids: list[int]) -> list[tuple[Any, ...]] | None:
        """(message id, topic, sent, dead-letter reason) of each row; None while any
        is neither sent nor dead-lettered."""
        with psycopg.connect(self.database, autocommit=True) as conn:
            rows = conn.execute(
                f"SELECT {self.ident}, {self.topic}, {self.sent} IS NOT NULL,"
                f"       {self.dead} IS NOT NULL, {self.reason}"
                f" FROM {self.table} WHERE id = ANY(%s) ORDER BY id",
                (ids,),
            ).fetchall()
        if any(not sent and not dead for _, _, sent, dead, _ in rows):
            return None
        return [(ident, topic, sent, reason) for ident, topic, sent, _, reason in rows]


@pytest.fixture(params=["own", "relay"])
def layout(request: pytest.FixtureRequest, database: str) -> Layout:
    if request.param == "own":
        request.getfixturevalue("nullable_table")
    return Layout(request.param, database)


@pytest.fixture
def http_relay(
    make_settings: SettingsFactory, layout: Layout, receiver: WebhookServer
) -> Iterator[RelayApp]:
    own: dict[str, Any] = {"outbox_table": TABLE, "lease_name": "app"}
    settings = make_settings(
        **(own if layout.name == "own" else {}),
        retention_seconds=3600,
        sink="http",
        http_url=receiver.url + "/hooks/{topic}",
        max_attempts=2,
        poll_interval_max_seconds=0.05,
    )
    with running_relay(settings) as app:
        yield app


@settings(
    max_examples=int(os.environ.get("RELAY_TEST_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(_ROW.map(_unique), min_size=1, max_size=6))
def test_any_row_the_app_writes_ends_delivered_or_dead_lettered_and_the_relay_runs_on(
    layout: Layout, receiver: WebhookServer, http_relay: RelayApp, batch: list[dict[str, Any]]
) -> None:
    ids = layout.insert(batch)
    settled = wait_until(
        lambda: layout.settled(ids) or http_relay.shutdown.requested,
        30,
        message="the batch settled",
    )
    assert not http_relay.shutdown.requested, "the relay stopped"
    assert isinstance(settled, list)
    acked = {d.message_id: d for d in receiver.acked()}
    for ident, topic, sent, reason in settled:
        if sent:
            delivery = acked[ident]
            assert delivery.path == "/hooks/" + quote(topic, safe=""), "left its path segment"
        else:
            assert reason, "dead-lettered without a reason"
            assert ident not in acked


@pytest.fixture
def own_relay(
    make_settings: SettingsFactory, nullable_table: str, target: Target
) -> Iterator[RelayApp]:
    settings = make_settings(
        **target.settings(),
        outbox_table=TABLE,
        lease_name="app",
        retention_seconds=3600,
        max_attempts=2,
        poll_interval_max_seconds=0.05,
    )
    with running_relay(settings) as app:
        yield app


@settings(
    max_examples=int(os.environ.get("RELAY_TEST_EXAMPLES", "10")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_row_in_an_own_table_ends_delivered_or_dead_lettered_over_every_sink(
    nullable_table: str, target: Target, own_relay: RelayApp, data: st.DataObject
) -> None:
    """The same over Kafka, HTTP, NATS and RabbitMQ, with most rows on the topic each
    routes to a destination of its own (the rest NULL or odd)."""
    topics = st.one_of(st.just(target.topic), st.just(target.topic), _TEXT)
    batch = data.draw(st.lists(_ROW.map(_unique), min_size=1, max_size=5))
    batch = [row | {"kind": data.draw(topics)} for row in batch]
    layout = Layout("own", nullable_table)
    ids = layout.insert(batch)
    settled = wait_until(
        lambda: layout.settled(ids) or own_relay.shutdown.requested,
        30,
        message="the batch settled",
    )
    assert not own_relay.shutdown.requested, "the relay stopped"
    assert isinstance(settled, list)
    assert all(sent or reason for _, _, sent, reason in settled), "dead without a reason"
    ours = scalar(
        nullable_table,
        "SELECT count(*) FROM app.events WHERE relay_sent_at IS NOT NULL AND kind = %s",
        (target.topic,),
    )
    delivered = {i for i, topic, sent, _ in settled if sent and topic == target.topic}
    if delivered:
        assert delivered <= {r.message_id for r in target.received(at_least=ours)}


# --- timestamps at the ends of time ----------------------------------------------------


def test_rows_stamped_infinity_neither_stop_the_drain_nor_the_lag_gauges(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    """Before: `now() - 'infinity'` raised, so a row created at -infinity failed every
    lag sample, and one scheduled at infinity failed every promotion of scheduled rows
    (the due ones never went out)."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, created_at, available_at) VALUES"
            " (%(t)s, 'never', 'n', now(), 'infinity'),"
            " (%(t)s, 'old', 'o', '-infinity', NULL),"
            " (%(t)s, 'soon', 's', now(), now() + interval '200 milliseconds')",
            {"t": topic},
        )
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        sample = lag.measure(conn, cap=100)
    assert sample.oldest_unsent_age_seconds == float("inf")
    assert sample.next_due_in_seconds is not None and sample.next_due_in_seconds < 1
    with running_relay(make_settings()):
        records = consume(kafka.bootstrap_servers, topic, min_count=2)
    assert sorted(r.value or b"" for r in records) == [b"o", b"s"]
    # Never due: waiting in the outbox, or moved out of it until due.
    assert (
        scalar(database, "SELECT key FROM outbox UNION ALL SELECT key FROM outbox_scheduled")
        == "never"
    )
