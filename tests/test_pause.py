"""Pausing a topic (issue 50, `relay pause` and `relay resume`), on real PostgreSQL and
Kafka, through the commands as the runtime role (migrations/grants.sql): a paused
topic's rows wait unsent and unattempted across a restart while another topic flows,
per-key order holds across the pause, and the resume lets them go."""

from __future__ import annotations

import getpass
import json
import subprocess
import uuid
from typing import Any

import psycopg
import pytest
from playwright.sync_api import BrowserContext
from prometheus_client import REGISTRY
from psycopg.rows import dict_row

from relay.drain.batch import BatchLimits, id_set
from relay.store import fetch as store_fetch
from relay.store.port import FetchRequest
from relay.store.postgres import drain_session_setup
from relay.store.repository import release_paused
from tests import test_replay
from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness.kafka import Record, TansuBroker, consume
from tests.harness.postgres import PostgresServer
from tests.support import insert_rows, keyed_rows, running_relay, scalar, unsent_count, wait_until
from tests.test_console import (
    ARTIFACTS,
    CONSOLE_ROLE,
    ROLE_PASSWORD,
    VIEWER_ROLE,
    VIEWER_TOKEN,
    grant_console,
)
from tests.test_replay import Console, log_in

# The replay module's console process and browser, as fixtures of this module too.
browser, console, context = test_replay.browser, test_replay.console, test_replay.context

# The rows held for a pause: moved out into outbox_paused, or parked in place.
HELD = (
    "SELECT (SELECT count(*) FROM outbox_paused)"
    " + (SELECT count(*) FROM outbox WHERE next_attempt_at = 'infinity')"
)


def relay(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`relay ARGS` in a process of its own, however it ends."""
    return subprocess.run(
        relay_command(*args),
        env=relay_env(dsn),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def new_topic(kafka: TansuBroker, name: str) -> str:
    topic = f"{name}-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, partitions=3)
    return topic


def paused_seen() -> float:
    """The paused topics this process's drain honours (relay_drain_paused_topics)."""
    samples = [
        s.value
        for family in REGISTRY.collect()
        if family.name == "relay_drain_paused_topics"
        for s in family.samples
    ]
    return max(samples, default=0.0)


def values(records: list[Record], key: str | None = None) -> list[bytes]:
    """The records' values (of `key`), in the order read."""
    return [r.value or b"" for r in records if key is None or r.key == key]


def audit(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT actor, action, target, row_count FROM console_audit ORDER BY id"
        ).fetchall()


def test_a_pause_holds_across_a_restart_while_another_topic_flows_in_order_per_key(
    make_settings: SettingsFactory, database: str, relay_dsn: str, kafka: TansuBroker
) -> None:
    held, flowing = new_topic(kafka, "held"), new_topic(kafka, "flowing")
    done = relay(relay_dsn, "pause", held, "--reason", "consumer migration")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"paused topic '{held}'")
    again = relay(relay_dsn, "pause", held)
    assert again.returncode == 0 and "was paused already" in again.stdout

    insert_rows(database, held, keyed_rows(keys=3, per_key=5))
    # One key in both topics: its later row, of the flowing topic, waits behind the
    # paused one.
    insert_rows(database, held, [("shared", b"shared:0")])
    insert_rows(database, flowing, [("shared", b"shared:1")])
    insert_rows(
        database, flowing, [(f"j{k}", f"j{k}:{i}".encode()) for i in range(5) for k in range(3)]
    )

    with running_relay(make_settings()):
        wait_until(lambda: scalar(database, HELD) == 16, 30, message="the paused rows held")
        flowed = consume(kafka.bootstrap_servers, flowing, min_count=15)
        assert sorted(values(flowed)) == sorted(
            f"j{k}:{i}".encode() for i in range(5) for k in range(3)
        )
    # Held out of the outbox: unsent, no attempt spent, nothing dead-lettered; the shared
    # key's later row still waits in the outbox, behind its held row.
    assert scalar(database, "SELECT count(*) FROM outbox_paused WHERE topic = %s", (held,)) == 16
    assert unsent_count(database) == 1
    assert scalar(database, "SELECT max(attempts) FROM outbox_paused") == 0
    assert scalar(database, "SELECT max(attempts) FROM outbox") == 0
    assert scalar(database, "SELECT count(*) FROM outbox_dead") == 0

    with running_relay(make_settings()):  # a restart: the pause is kept in the database
        insert_rows(
            database,
            flowing,
            [(f"j{k}", f"j{k}:{i}".encode()) for i in range(5, 8) for k in range(3)],
        )
        wait_until(
            lambda: len(consume(kafka.bootstrap_servers, flowing, min_count=24, timeout=2)) >= 24,
            30,
            message="the flowing topic's new rows delivered",
        )
        assert unsent_count(database) == 1 and scalar(database, HELD) == 16
        status = relay(relay_dsn, "status", "--json")
        assert status.returncode == 0, status.stderr
        [paused] = json.loads(status.stdout)["paused_topics"]
        assert paused["topic"] == held and paused["reason"] == "consumer migration"
        assert paused["paused_by"] == getpass.getuser() and paused["held_rows"] == 16
        assert held in relay(relay_dsn, "status").stdout

        resumed = relay(relay_dsn, "resume", held)
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.startswith(f"resumed topic '{held}'")
        wait_until(lambda: unsent_count(database) == 0, 30, message="the paused rows sent")
        assert scalar(database, HELD) == 0
    sent = consume(kafka.bootstrap_servers, held, min_count=16)
    for k in range(3):
        assert values(sent, f"k{k}") == [f"k{k}:{i}".encode() for i in range(5)]
    assert values(sent, "shared") == [b"shared:0"]
    assert values(consume(kafka.bootstrap_servers, flowing, min_count=25), "shared") == [
        b"shared:1"
    ]
    assert relay(relay_dsn, "resume", held).stdout.startswith(f"topic '{held}' is not paused")
    actions = [(a["action"], a["target"]["topic"], a["target"]["via"]) for a in audit(database)]
    assert actions == [("pause", held, "cli"), ("resume", held, "cli")]


def test_a_running_relay_honours_a_pause_at_its_next_pass_and_a_resume_too(
    make_settings: SettingsFactory, database: str, relay_dsn: str, kafka: TansuBroker
) -> None:
    """Paused while the relay runs: once its drain has read the pause (its gauge says
    so), a new row of the topic is held, not sent; resumed, it goes."""
    topic = new_topic(kafka, "live")
    insert_rows(database, topic, [("a", b"a:0")])
    with running_relay(make_settings()):
        wait_until(lambda: unsent_count(database) == 0, 30, message="the first row sent")
        assert relay(relay_dsn, "pause", topic).returncode == 0
        wait_until(lambda: paused_seen() == 1, 10, message="the drain saw the pause")
        insert_rows(database, topic, [("a", b"a:1"), ("b", b"b:0")])
        wait_until(lambda: scalar(database, HELD) == 2, 10, message="the new rows held")
        assert values(consume(kafka.bootstrap_servers, topic, min_count=1, timeout=3)) == [b"a:0"]
        assert relay(relay_dsn, "resume", topic).returncode == 0
        wait_until(lambda: unsent_count(database) == 0, 10, message="the rows sent once resumed")
        wait_until(lambda: paused_seen() == 0, 10, message="the drain saw the resume")
    assert values(consume(kafka.bootstrap_servers, topic, min_count=3), "a") == [b"a:0", b"a:1"]


def test_a_topic_that_is_empty_is_refused(relay_dsn: str) -> None:
    done = relay(relay_dsn, "pause", " ")
    assert done.returncode == 2 and "the topic is empty" in done.stderr


def test_the_console_role_pauses_through_the_functions_and_the_viewer_may_not(
    pg: PostgresServer, database: str
) -> None:
    """No role writes the pause table but through outbox_pause and outbox_resume, which
    audit; the viewer role reads the pauses and may change none."""
    dbname = database.rsplit("/", 1)[1]
    grant_console(pg, dbname)
    operator = pg.dsn(dbname, user=CONSOLE_ROLE, password=ROLE_PASSWORD)
    viewer = pg.dsn(dbname, user=VIEWER_ROLE, password=ROLE_PASSWORD)
    with psycopg.connect(operator, autocommit=True) as conn:
        assert conn.execute(
            "SELECT paused_now FROM outbox_pause('t', 'ana', NULL, 'console')"
        ).fetchone() == (True,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM outbox_paused_topics")
    with psycopg.connect(viewer, autocommit=True) as conn:
        assert conn.execute("SELECT topic, paused_by FROM outbox_paused_topics").fetchall() == [
            ("t", "ana")
        ]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT outbox_resume('t', 'eve', 'console')")
    with psycopg.connect(operator, autocommit=True) as conn:
        assert conn.execute(
            "SELECT resumed FROM outbox_resume('t', 'ana', 'console')"
        ).fetchone() == (True,)
    assert [(a["actor"], a["action"]) for a in audit(database)] == [
        ("ana", "pause"),
        ("ana", "resume"),
    ]


def test_the_console_pauses_and_resumes_a_topic_and_the_viewer_may_not(
    console: Console,
    context: BrowserContext,
) -> None:
    """In a real browser: the Pauses page pauses a topic with its reason, the overview
    says so, the viewer sees it and cannot resume, the operator resumes; both audited."""
    topic = f"p-{uuid.uuid4().hex[:6]}"
    page = log_in(context, console)
    page.click("nav >> text=Pauses")
    page.wait_for_url(console.url + "/pauses")
    assert page.locator("#none-paused").is_visible()
    page.fill("#pause input[name=topic]", topic)
    page.fill("#pause input[name=reason]", "consumer migration")
    page.click("#pause button[type=submit]")
    page.wait_for_url(console.url + "/pauses")
    row = page.locator("#paused tr", has_text=topic)
    assert "consumer migration" in row.inner_text() and "token" in row.inner_text()
    page.screenshot(path=str(ARTIFACTS / "pauses.png"), full_page=True)
    page.click("nav >> text=Overview")
    assert topic in page.locator("#paused-topics").inner_text()

    viewer = log_in(context.browser.new_context(), console, VIEWER_TOKEN)  # type: ignore[union-attr]
    viewer.goto(console.url + "/pauses")
    assert topic in viewer.locator("#paused").inner_text()
    assert viewer.locator("#paused button").count() == 0
    assert viewer.locator("#pause").count() == 0

    page.goto(console.url + "/pauses")
    page.locator("#paused tr", has_text=topic).locator("button").click()
    page.wait_for_url(console.url + "/pauses")
    assert page.locator("#paused tr", has_text=topic).count() == 0
    assert scalar(console.dsn, "SELECT count(*) FROM outbox_paused_topics") == 0
    actions = [
        (a["actor"], a["action"], a["target"]["via"])
        for a in audit(console.dsn)
        if a["target"].get("topic") == topic
    ]
    assert actions == [("token", "pause", "console"), ("token", "resume", "console")]


ROW = "id, message_id, topic, key, payload, headers, created_at, attempts, last_error, tenant"


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "in-order"])
def test_a_fetch_holds_a_paused_topics_rows_out_and_a_release_brings_them_back_unchanged(
    database: str, fair: bool
) -> None:
    """The fetch moves every row of a paused topic it meets at the head, and those past
    it over its walk, into outbox_paused, and hands over only the rows that may go: not a
    later row of a key held there, whatever its topic, nor a row in flight moved. Once
    the topic is resumed, a release puts them back under their ids, as they were, with
    the column the app added."""
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN tenant text")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload, headers, tenant, attempts, last_error)"
            " SELECT CASE WHEN g % 2 = 0 THEN 'held' ELSE 'flowing' END,"
            "        CASE WHEN g % 2 = 0 THEN 'h' ELSE 'f' END || (g / 2 % 5),"
            "        convert_to('row ' || g, 'UTF8'), jsonb_build_object('n', g::text),"
            "        't' || g, g % 3, CASE WHEN g % 3 > 0 THEN 'was failing' END"
            " FROM generate_series(0, 99) AS g"
        )
        insert_rows(database, "held", [("shared", b"shared:0")])
        insert_rows(database, "flowing", [("shared", b"shared:1")])
        conn.execute("SELECT outbox_pause('held', 'test', NULL, 'cli')")
        before = conn.execute(
            f"SELECT {ROW} FROM outbox WHERE topic = 'held' ORDER BY id"
        ).fetchall()
        in_flight = before[3]["id"]
        drain_session_setup(conn)
        limits = BatchLimits(rows=20, bytes=8 << 20, per_key=20, fair=fair)
        ask = FetchRequest(limits, (id_set([in_flight]),), paused=frozenset({"held"}))
        fetched = store_fetch.fetch(conn, ask, hold=True)

        assert fetched.messages and {m.topic for m in fetched.messages} == {"flowing"}
        assert "shared" not in {m.key for m in fetched.messages}
        kept = ROW.replace("tenant", "extra->>'tenant' AS tenant")
        held = conn.execute(f"SELECT {kept} FROM outbox_paused ORDER BY id").fetchall()
        assert held == [r for r in before if r["id"] != in_flight]
        left = conn.execute("SELECT id FROM outbox WHERE topic = 'held'").fetchall()
        assert [r["id"] for r in left] == [in_flight]

        assert release_paused(conn, 5000) == (0, False)  # still paused: nothing goes
        conn.execute("SELECT outbox_resume('held', 'test', 'cli')")
        assert release_paused(conn, 30) == (30, True)
        assert release_paused(conn, 5000) == (len(before) - 1 - 30, False)
        after = conn.execute(
            f"SELECT {ROW} FROM outbox WHERE topic = 'held' ORDER BY id"
        ).fetchall()
        assert after == before
        assert scalar(database, "SELECT count(*) FROM outbox_paused") == 0
