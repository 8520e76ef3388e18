"""Replay (issue 50, `relay replay`): rows kept as sent put back into the
outbox as new rows, on real PostgreSQL and Kafka, through the command as the runtime
role (migrations/grants.sql) and through the console in a real browser as the console's
role (console_grants.sql)."""

from __future__ import annotations

import argparse
import getpass
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright
from psycopg.rows import dict_row

from relay.admin import replay
from relay.admin.cli import parse_time
from relay.console import data
from relay.settings import CommonSettings
from relay.store import db
from tests.conftest import REPO, SettingsFactory, relay_command, relay_env
from tests.harness import free_port
from tests.harness.kafka import Record, TansuBroker, consume
from tests.harness.postgres import PostgresServer
from tests.support import (
    http_get,
    insert_rows,
    keyed_rows,
    running_relay,
    scalar,
    unsent_count,
    wait_until,
)
from tests.test_console import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    CONSOLE_ROLE,
    ROLE_PASSWORD,
    TOKEN,
    VIEWER_ROLE,
    VIEWER_TOKEN,
    grant_console,
)

HOUR = 3600.0


def run_replay(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`relay replay ARGS` in a process of its own, however it ends."""
    return subprocess.run(
        relay_command("replay", *args),
        env=relay_env(dsn),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def keep(
    dsn: str,
    topic: str,
    rows: list[tuple[str | None, bytes]],
    sent_ago: str,
    headers: str | None = None,
) -> list[int]:
    """Rows as a settle in retention mode leaves them in outbox_sent, sent `sent_ago`
    (an interval), with `headers` (JSON text), under ids taken from the outbox's
    identity; their ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "INSERT INTO outbox_sent (generation, id, message_id, topic, key, payload, headers,"
            " created_at, available_at, attempts, last_error, sent_at)"
            " SELECT 0, nextval(pg_get_serial_sequence('outbox', 'id')), gen_random_uuid(), %s,"
            " r.key, r.payload, %s::jsonb, now() - interval '1 day', now() - interval '1 day', 2,"
            " 'HTTP 503', now() - %s::interval"
            " FROM unnest(%s::text[], %s::bytea[]) WITH ORDINALITY AS r (key, payload, n)"
            " ORDER BY r.n RETURNING id",
            (
                topic,
                headers,
                sent_ago,
                [k for k, _ in rows],
                [p for _, p in rows],
            ),
        ).fetchall()
    return [int(r[0]) for r in found]


def history_from(dsn: str, sent_ago: str = "3 hours") -> None:
    """A history kept since `sent_ago`: one row of another topic sent then. A range that
    starts before the oldest row kept is refused."""
    keep(dsn, "anchor", [(None, b"")], sent_ago)


def audit_rows(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT id, at, actor, action, target, row_count, first_id, last_id, row_ids"
            " FROM console_audit ORDER BY id"
        ).fetchall()


def outbox_rows(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT id, message_id, topic, key, payload, headers, created_at, available_at,"
            " attempts, last_error FROM outbox ORDER BY id"
        ).fetchall()


def replay_id_of(stdout: str) -> int:
    found = re.search(r": replay (\d+),", stdout)
    assert found, stdout
    return int(found[1])


def by_key(records: list[Record]) -> dict[str | None, list[Record]]:
    found: dict[str | None, list[Record]] = {}
    for record in records:
        found.setdefault(record.key, []).append(record)
    return found


# --- delivered again -------------------------------------------------------------------


def test_a_replay_is_delivered_again_in_order_with_its_message_ids_and_a_replay_header(
    make_settings: SettingsFactory,
    database: str,
    relay_dsn: str,
    kafka: TansuBroker,
    topic: str,
) -> None:
    """Rows sent with retention on, replayed while the relay runs: each key's rows
    arrive a second time, in their order, with the same message-id, their own headers,
    and `relay-replay` (the replay's id), which their first delivery did not carry."""
    rows = keyed_rows(keys=3, per_key=5)
    insert_rows(database, topic, rows, headers={"trace": "t-1"})
    with running_relay(make_settings(retention_seconds=HOUR)):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
        assert scalar(database, "SELECT count(*) FROM outbox_sent") == len(rows)
        # From the oldest row kept: the history began with this test's rows, and a range
        # that starts before it is refused (rows sent then may be gone).
        since = replay.stamp(scalar(database, "SELECT min(sent_at) FROM outbox_sent"))
        done = run_replay(relay_dsn, "--topic", topic, "--since", since)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"replayed {len(rows)} row(s) of topic '{topic}'")
        replay_id = replay_id_of(done.stdout)
        wait_until(lambda: unsent_count(database) == 0, 30, message="replay drained")
    records = consume(kafka.bootstrap_servers, topic, min_count=2 * len(rows))
    assert len(records) == 2 * len(rows)
    for key, seen in by_key(records).items():
        first, again = seen[:5], seen[5:]
        steps = [f"{key}:{i}".encode() for i in range(5)]
        assert [r.value for r in first] == steps, key
        assert [r.value for r in again] == steps, key
        assert [r.headers["message-id"] for r in again] == [r.headers["message-id"] for r in first]
        assert all("relay-replay" not in r.headers for r in first)
        assert {r.headers["relay-replay"] for r in again} == {str(replay_id).encode()}
        assert {r.headers["trace"] for r in seen} == {b"t-1"}
    # Kept again as sent, as new rows: the history now holds both deliveries.
    assert scalar(database, "SELECT count(DISTINCT message_id) FROM outbox_sent") == len(rows)
    assert scalar(database, "SELECT count(*) FROM outbox_sent") == 2 * len(rows)


def test_a_replay_of_a_key_goes_after_the_rows_of_that_key_already_waiting(
    make_settings: SettingsFactory,
    database: str,
    relay_dsn: str,
    kafka: TansuBroker,
    topic: str,
) -> None:
    """Rows of the key written after the first delivery, still waiting when the key is
    replayed: the replayed rows take new ids, so they go out after those, never before;
    the other key is not replayed. The audit entry names who, the filter, the count and
    every new id."""
    settings = make_settings(retention_seconds=HOUR)
    insert_rows(database, topic, [("k", b"k:0"), ("other", b"o:0"), ("k", b"k:1")])
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    waiting = insert_rows(database, topic, [("k", b"k:2"), ("k", b"k:3")])
    since = replay.stamp(scalar(database, "SELECT min(sent_at) FROM outbox_sent"))
    done = run_replay(relay_dsn, "--topic", topic, "--key", "k", "--since", since)
    assert done.returncode == 0, done.stderr
    replay_id = replay_id_of(done.stdout)
    rows = outbox_rows(database)
    assert [bytes(r["payload"]) for r in rows] == [b"k:2", b"k:3", b"k:0", b"k:1"]
    new_ids = [r["id"] for r in rows[2:]]
    assert min(new_ids) > max(waiting)
    (entry,) = audit_rows(database)
    assert entry["id"] == replay_id and entry["action"] == "replay"
    assert entry["actor"] == getpass.getuser()
    assert entry["target"]["via"] == "cli"
    assert entry["target"]["filter"]["topic"] == topic
    assert entry["target"]["filter"]["key"] == "k"
    assert set(entry["target"]["filter"]) == {"topic", "key", "since", "until"}
    assert (entry["row_count"], entry["first_id"], entry["last_id"]) == (2, *new_ids)
    assert entry["row_ids"] == new_ids
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    records = consume(kafka.bootstrap_servers, topic, min_count=7)
    keyed = by_key(records)
    assert [r.value for r in keyed["k"]] == [b"k:0", b"k:1", b"k:2", b"k:3", b"k:0", b"k:1"]
    assert ["relay-replay" in r.headers for r in keyed["k"]] == [False] * 4 + [True] * 2
    assert [r.value for r in keyed["other"]] == [b"o:0"]


def test_a_replayed_row_keeps_the_event_and_starts_afresh_as_a_row(
    database: str, relay_dsn: str
) -> None:
    """What is copied: the message id, topic, key, payload and headers (a header of the
    replay's name the row had, in any case, replaced by the replay's); the rest is a new
    row's: created_at is the replay's time (the created-at header, the lag and the
    latency count from it), no schedule, no attempts, no error."""
    history_from(database)
    forged = json.dumps({"x": "1", "Relay-Replay": "forged"})
    kept_ids = keep(database, "t", [("a", b"1")], "5 minutes", forged)
    kept_ids += keep(database, "t", [("a", b"2")], "5 minutes", "null")
    kept_ids += keep(database, "t", [("a", b"3"), (None, b"4")], "5 minutes")
    settings = CommonSettings(database_url=relay_dsn)
    with db.connect(settings, purpose="test") as conn:
        found = replay.replay(
            conn, replay.Request("t", timedelta(minutes=10)), max_rows=10, actor="me", via="cli"
        )
    assert (found.matching, found.replayed) == (4, 4)
    rows = outbox_rows(database)
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as conn:
        sent = conn.execute(
            "SELECT message_id, topic, key, payload FROM outbox_sent WHERE topic = 't' ORDER BY id"
        ).fetchall()
    assert [{k: r[k] for k in ("message_id", "topic", "key", "payload")} for r in rows] == sent
    mark = {"relay-replay": str(found.replay_id)}
    assert [r["headers"] for r in rows] == [{"x": "1", **mark}, mark, mark, mark]
    (entry,) = audit_rows(database)
    assert {r["created_at"] for r in rows} == {entry["at"]}  # the replay's transaction
    assert {(r["available_at"], r["attempts"], r["last_error"]) for r in rows} == {(None, 0, None)}
    assert [r["id"] for r in rows] == list(range(found.first_id or 0, (found.last_id or 0) + 1))
    assert min(r["id"] for r in rows) > max(kept_ids)


# --- refused, or nothing done ----------------------------------------------------------


def test_a_dry_run_counts_and_changes_nothing(database: str, relay_dsn: str) -> None:
    history_from(database)
    keep(database, "t", [("a", b"1"), ("b", b"2")], "5 minutes")
    keep(database, "elsewhere", [("a", b"1")], "5 minutes")
    done = run_replay(relay_dsn, "--topic", "t", "--since", "1h", "--until", "1m", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("would replay 2 row(s) of topic 't' sent from ")
    assert outbox_rows(database) == [] and audit_rows(database) == []
    keyed = run_replay(relay_dsn, "--topic", "t", "--key", "b", "--since", "1h", "--dry-run")
    assert keyed.stdout.startswith("would replay 1 row(s) of topic 't' (key 'b')"), keyed.stdout
    # Outside the range: nothing to do, said so, not refused.
    none = run_replay(relay_dsn, "--topic", "t", "--since", "2m")
    assert none.returncode == 0, none.stderr
    assert none.stdout.startswith("nothing to replay: no row of topic 't' sent from ")
    assert "the rows kept were sent from " in none.stdout
    assert outbox_rows(database) == [] and audit_rows(database) == []


def test_a_replay_over_the_cap_is_refused_with_the_count(database: str, relay_dsn: str) -> None:
    """Refused whole (exit 2), never cut short: half a range would look like all of it."""
    history_from(database)
    keep(database, "t", [("k", str(i).encode()) for i in range(5)], "5 minutes")
    done = run_replay(relay_dsn, "--topic", "t", "--since", "1h", "--max-rows", "4")
    assert done.returncode == 2, done.stdout
    assert "5 rows match, more than the 4 one replay may put back" in done.stderr
    assert "nothing replayed" in done.stderr
    assert outbox_rows(database) == [] and audit_rows(database) == []
    assert run_replay(relay_dsn, "--topic", "t", "--since", "1h", "--max-rows", "5").returncode == 0
    assert len(outbox_rows(database)) == 5


def test_without_kept_rows_a_replay_is_refused(database: str, relay_dsn: str) -> None:
    """Retention off (RELAY_RETENTION_SECONDS=0) leaves outbox_sent empty: nothing can
    be replayed, and it says why (exit 2)."""
    insert_rows(database, "t", [("k", b"unsent")])  # waiting rows are no history
    for args in (("--since", "1h"), ("--since", "1h", "--dry-run")):
        done = run_replay(relay_dsn, "--topic", "t", *args)
        assert done.returncode == 2, done.stdout
        assert "no sent rows are kept" in done.stderr
        assert "RELAY_RETENTION_SECONDS=0" in done.stderr
    assert len(outbox_rows(database)) == 1 and audit_rows(database) == []


def test_a_range_that_starts_before_the_history_kept_is_refused(
    database: str, relay_dsn: str
) -> None:
    """Rows sent before the oldest row kept may have been purged: a replay from then
    would miss them. So is an empty range. Neither changes anything (exit 2)."""
    keep(database, "t", [("k", b"old")], "30 minutes")
    keep(database, "t", [("k", b"new")], "5 minutes")
    done = run_replay(relay_dsn, "--topic", "t", "--since", "1h")
    assert done.returncode == 2, done.stdout
    assert "before the oldest row kept (sent at " in done.stderr
    oldest = scalar(database, "SELECT min(sent_at) FROM outbox_sent")
    assert replay.stamp(oldest) in done.stderr  # what to pass as --since instead
    empty = run_replay(relay_dsn, "--topic", "t", "--since", "10m", "--until", "20m")
    assert empty.returncode == 2 and "the range is empty" in empty.stderr
    assert outbox_rows(database) == [] and audit_rows(database) == []
    since = run_replay(relay_dsn, "--topic", "t", "--since", replay.stamp(oldest))
    assert since.returncode == 0, since.stderr
    assert [bytes(r["payload"]) for r in outbox_rows(database)] == [b"old", b"new"]


def test_an_own_table_has_nothing_to_replay(database: str) -> None:
    env = relay_env(database, RELAY_OUTBOX_TABLE="inventory.outboxevent")
    done = subprocess.run(
        relay_command("replay", "--topic", "t", "--since", "1h"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout
    assert "an own table (RELAY_OUTBOX_TABLE) keeps its sent rows in place" in done.stderr


# --- the roles -------------------------------------------------------------------------


def test_the_console_role_replays_and_the_viewer_role_may_not(
    pg: PostgresServer, database: str
) -> None:
    """Through outbox_replay alone: neither role may insert an outbox row itself."""
    dbname = database.rsplit("/", 1)[1]
    grant_console(pg, dbname)
    history_from(database)
    keep(database, "t", [("k", b"1")], "5 minutes")
    asked = replay.Request("t", timedelta(hours=1))
    console = CommonSettings(database_url=pg.dsn(dbname, user=CONSOLE_ROLE, password=ROLE_PASSWORD))
    with db.connect(console, purpose="console") as conn:
        found = data.replay_count(conn, asked, 100)
        assert found.matching == 1
        with pytest.raises(data.Changed):
            data.replay_apply(conn, "token", asked, 2, 100)
        with pytest.raises(data.Refused, match="1 rows match, more than the 0"):
            data.replay_apply(conn, "token", asked, 1, 0)
        done = data.replay_apply(conn, "token", asked, 1, 100)
        assert done.replayed == 1
    viewer = CommonSettings(database_url=pg.dsn(dbname, user=VIEWER_ROLE, password=ROLE_PASSWORD))
    with (
        db.connect(viewer, purpose="console") as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        data.replay_count(conn, asked, 100)
    assert [(a["actor"], a["action"], a["row_count"]) for a in audit_rows(database)] == [
        ("token", "replay", 1)
    ]


# --- the console -----------------------------------------------------------------------


@dataclass
class Console:
    dsn: str  # superuser: plays the relay (rows kept) and checks the database
    url: str


@pytest.fixture(scope="module")
def console(pg: PostgresServer) -> Iterator[Console]:
    """`relay console` as its own process under its role, on a database of its own."""
    name = f"replay_{uuid.uuid4().hex[:10]}"
    dsn = pg.create_database(name, template="relay_template")
    grant_console(pg, name)
    history_from(dsn)
    port = free_port()
    env = relay_env(
        pg.dsn(name, user=CONSOLE_ROLE, password=ROLE_PASSWORD),
        RELAY_CONSOLE_TOKEN=TOKEN,
        RELAY_CONSOLE_VIEWER_TOKEN=VIEWER_TOKEN,
        RELAY_CONSOLE_PORT=str(port),
        RELAY_CONSOLE_REFRESH_SECONDS="0",
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log_path = ARTIFACTS / "replay-console.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            relay_command("console"), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(
                lambda: http_get(url + "/healthz")[0] == 200 or process.poll() is not None,
                timeout=30,
                message="the console listening",
            )
            assert process.poll() is None, log_path.read_text()[-3000:]
            yield Console(dsn, url)
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
            pg.drop_database(name)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(10_000)
    yield context
    context.close()


def log_in(context: BrowserContext, console: Console, token: str = TOKEN) -> Page:
    page = context.new_page()
    page.goto(console.url + "/login")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(console.url + "/")
    return page


def local_input(moment: datetime) -> str:
    """A datetime-local field's value for `moment`, in UTC (the console's times)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")


def test_the_console_counts_confirms_and_replays_and_the_audit_shows_it(
    console: Console, context: BrowserContext
) -> None:
    topic = f"c-{uuid.uuid4().hex[:6]}"
    keep(console.dsn, topic, [("k", b"1"), ("j", b"2"), ("k", b"3")], "5 minutes")
    page = log_in(context, console)
    page.click("nav >> text=Replay")
    page.wait_for_url(console.url + "/replay")
    page.fill("#replay input[name=topic]", topic)
    page.fill("#replay input[name=key]", "k")
    page.fill("#replay input[name=since]", local_input(datetime.now(UTC) - timedelta(hours=1)))
    page.click("#replay button[type=submit]")
    page.wait_for_url(console.url + "/replay/confirm")
    assert page.locator("h1").inner_text() == "Replay 2 rows?"
    assert f"Topic “{topic}”, key “k”" in page.locator("#range").inner_text()
    page.screenshot(path=str(ARTIFACTS / "replay-confirm.png"), full_page=True)
    assert outbox_rows(console.dsn) == []  # counting changes nothing
    page.click("#confirm")
    page.wait_for_url(re.compile(r".*/audit/\d+$"))
    entry_id = int(page.url.rsplit("/", 1)[1])
    assert page.locator("#done").inner_text() == "Replayed 2 rows."
    assert f"relay-replay: {entry_id}" in page.locator("#replay-header").inner_text()
    page.screenshot(path=str(ARTIFACTS / "replay-audit-entry.png"), full_page=True)
    rows = [r for r in outbox_rows(console.dsn) if r["topic"] == topic]
    assert [bytes(r["payload"]) for r in rows] == [b"1", b"3"]
    assert {r["headers"]["relay-replay"] for r in rows} == {str(entry_id)}
    assert f"{rows[0]['id']}, {rows[1]['id']}" in page.locator("#row-ids").inner_text()
    entry = next(a for a in audit_rows(console.dsn) if a["id"] == entry_id)
    assert (entry["actor"], entry["action"], entry["row_count"]) == ("token", "replay", 2)
    assert entry["target"]["via"] == "console" and entry["target"]["filter"]["key"] == "k"
    page.click("text=Audit")
    assert "replay" in page.locator("#audit-table").inner_text()


def test_the_console_refuses_a_replay_whose_rows_changed_or_that_is_over_the_history(
    console: Console, context: BrowserContext
) -> None:
    """A row sent into the range between the count and the confirmation: nothing is
    replayed (409), as a requeue whose rows changed. A range before the history kept is
    refused at the count, saying where the history starts."""
    topic = f"c-{uuid.uuid4().hex[:6]}"
    keep(console.dsn, topic, [("k", b"1")], "10 minutes")
    page = log_in(context, console)
    page.goto(console.url + "/replay")
    page.fill("#replay input[name=topic]", topic)
    page.fill("#replay input[name=since]", local_input(datetime.now(UTC) - timedelta(minutes=20)))
    page.click("#replay button[type=submit]")
    page.wait_for_url(console.url + "/replay/confirm")
    assert page.locator("h1").inner_text() == "Replay 1 row?"
    keep(console.dsn, topic, [("k", b"2")], "2 minutes")
    page.click("#confirm")
    page.wait_for_url(console.url + "/replay/apply")
    assert "1 row(s) were confirmed, 2 match now" in page.locator(".error").inner_text()
    assert [r for r in outbox_rows(console.dsn) if r["topic"] == topic] == []
    page.goto(console.url + "/replay")
    page.fill("#replay input[name=topic]", topic)
    page.fill("#replay input[name=since]", "2000-01-01T00:00:00")
    page.click("#replay button[type=submit]")
    page.wait_for_url(console.url + "/replay/confirm")
    assert "before the oldest row kept" in page.locator(".error").inner_text()


def test_a_viewer_sees_the_replay_page_but_cannot_replay(
    console: Console, context: BrowserContext
) -> None:
    page = log_in(context, console, VIEWER_TOKEN)
    page.goto(console.url + "/replay")
    assert page.locator("#replay").count() == 0
    assert "may look, not change" in page.locator("main").inner_text()
    csrf = page.get_attribute("input[name=csrf]", "value")
    posted = page.request.post(
        console.url + "/replay/confirm",
        form={"csrf": csrf or "", "topic": "t", "since": "2000-01-01T00:00:00"},
        headers={"Origin": console.url},
    )
    assert posted.status == 403


# --- pure parts ------------------------------------------------------------------------


@pytest.mark.unit
def test_times_are_iso_8601_or_how_long_ago() -> None:
    assert parse_time("2h") == timedelta(hours=2)
    assert parse_time("90") == timedelta(seconds=90)
    assert parse_time("2026-05-01T10:00:00Z") == datetime(2026, 5, 1, 10, tzinfo=UTC)
    assert parse_time("2026-05-01T12:00:00+02:00") == datetime(2026, 5, 1, 10, tzinfo=UTC)
    assert parse_time("2026-05-01 10:00") == datetime(2026, 5, 1, 10, tzinfo=UTC)  # UTC
    for bad in ("yesterday", "2h ago", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="not a time"):
            parse_time(bad)


@pytest.mark.unit
def test_a_refusal_names_what_stands_in_the_way() -> None:
    now = datetime(2026, 5, 1, 10, tzinfo=UTC)

    def found(**values: Any) -> replay.Replay:
        base: dict[str, Any] = {
            "sent_from": now - timedelta(hours=1),
            "sent_until": now,
            "kept_since": now - timedelta(hours=2),
            "kept_until": now,
            "matching": 3,
            "replay_id": None,
            "replayed": None,
            "first_id": None,
            "last_id": None,
        }
        return replay.Replay(**{**base, **values})

    assert replay.refusal(found(), 3) is None
    assert replay.refusal(found(matching=0), 3) is None  # nothing to do is no refusal
    assert "4 rows match, more than the 3" in str(replay.refusal(found(matching=4), 3))
    assert "no sent rows are kept" in str(replay.refusal(found(kept_since=None), 3))
    early = replay.refusal(found(kept_since=now - timedelta(minutes=30)), 3)
    assert "start at 2026-05-01T09:30:00+00:00 or later" in str(early)
    assert "the range is empty" in str(
        replay.refusal(found(sent_until=now - timedelta(hours=2)), 3)
    )
    assert replay.Request("t", timedelta(minutes=2), now).params() == {
        "topic": "t",
        "key": None,
        "since": None,
        "since_ago": 120.0,
        "until": now,
        "until_ago": None,
    }


@pytest.mark.unit
def test_an_app_may_not_write_the_replay_header_itself() -> None:
    """relay.enqueue refuses it, as it refuses the relay's own headers: a first delivery
    that carried it would pass for a replay."""
    from relay.producer import _params

    with pytest.raises(ValueError, match="set by the relay itself"):
        _params("t", b"x", None, {"Relay-Replay": "7"}, trace_context=False)
    assert _params("t", b"x", None, {"relay-replayed": "no"}, trace_context=False)["headers"]
