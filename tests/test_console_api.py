"""The console's JSON API (/api/v1/, relay/console/api.py) against the console as its
own process under its least-privilege role, a real relay draining to a real HTTP
receiver, and PostgreSQL: bearer tokens (none, wrong, the viewer's), the status
document, dead-letter pages, requeue and discard by ids and by filter with their
audit rows, the cap, and the session cookie and the bearer token kept apart. One
console and one relay serve the module; every test works on rows of its own topic.
No browser: the API is for scripts."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import REGISTRY

from relay.console import data as console_data
from relay.console.limits import LOGIN_FAILURES
from relay.settings import Settings
from tests.conftest import REPO, TEMPLATE_DB, relay_command, relay_env
from tests.harness import free_port
from tests.harness.postgres import PostgresServer
from tests.harness.webhook import Delivery, Reply, WebhookServer
from tests.support import http_get, running_relay, scalar, wait_until
from tests.test_console import CONSOLE_ROLE, ROLE_PASSWORD, grant_console
from tests.test_replay import keep

TOKEN = "api-operator-token-0123456789"
VIEWER_TOKEN = "api-viewer-token-0123456789"
REPLICA = "relay-under-api"
CAP = 100_000  # ConsoleSettings.bulk_cap: one change touches at most this many rows
LOG = REPO / "tests" / "artifacts" / "console-api.log"


@dataclass
class World:
    dsn: str  # superuser: writes dead letters, checks the database
    url: str
    receiver: WebhookServer

    def client(self, token: str | None = TOKEN, source: str | None = None) -> httpx.Client:
        """A script's client: its bearer token, nothing else (no cookie jar in use)."""
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        transport = httpx.HTTPTransport(local_address=source) if source else None
        return httpx.Client(base_url=self.url, headers=headers, transport=transport, timeout=30)


def accept_all(_delivery: Delivery) -> Reply:
    return Reply(200)


@pytest.fixture(scope="module")
def world(pg: PostgresServer) -> Iterator[World]:
    name = f"api_{uuid.uuid4().hex[:10]}"
    dsn = pg.create_database(name, template=TEMPLATE_DB)
    grant_console(pg, name)
    port = free_port()
    env = relay_env(
        pg.dsn(name, user=CONSOLE_ROLE, password=ROLE_PASSWORD),
        RELAY_CONSOLE_TOKEN=TOKEN,
        RELAY_CONSOLE_VIEWER_TOKEN=VIEWER_TOKEN,
        RELAY_CONSOLE_PORT=str(port),
    )
    LOG.parent.mkdir(parents=True, exist_ok=True)
    log = LOG.open("wb")
    console = subprocess.Popen(
        relay_command("console"), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
    )
    settings = Settings(
        database_url=pg.dsn(name, user="relay", password="relay-secret-pw"),
        sink="http",
        http_url="http://127.0.0.1:0/unused",  # replaced below, once the receiver listens
        replica_id=REPLICA,
        metrics_port=0,
        lease_ttl_seconds=3.0,
        log_format="json",
    )
    try:
        with WebhookServer(accept_all) as receiver:
            settings = settings.model_copy(update={"http_url": receiver.url + "/hooks/{topic}"})
            with running_relay(settings):
                url = f"http://127.0.0.1:{port}"
                wait_until(
                    lambda: http_get(url + "/healthz")[0] == 200 or console.poll() is not None,
                    timeout=30,
                    message="the console listening",
                )
                assert console.poll() is None, LOG.read_text()[-3000:]
                yield World(dsn, url, receiver)
    finally:
        console.terminate()
        try:
            console.wait(timeout=10)
        except subprocess.TimeoutExpired:
            console.kill()
        log.close()
        pg.drop_database(name)


def execute(dsn: str, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def dead_letters(dsn: str, topic: str, count: int, reason: str = "HTTP 400: bad") -> list[int]:
    """`count` dead letters of `topic`, as the relay moves them into outbox_dead (under
    ids of the outbox's), in one statement: keys k0..k4 in turn."""
    rows = execute(
        dsn,
        "INSERT INTO outbox_dead (id, message_id, topic, key, payload, created_at, attempts,"
        " dead_lettered_at, dead_letter_reason)"
        " SELECT nextval(pg_get_serial_sequence('outbox', 'id')), gen_random_uuid(), %s,"
        " 'k' || (g %% 5), convert_to('row ' || g, 'UTF8'), now(), 1, now(), %s"
        " FROM generate_series(1, %s) AS g RETURNING id",
        (topic, reason, count),
    )
    return sorted(int(r[0]) for r in rows)


def dead_ids(dsn: str, topic: str) -> list[int]:
    rows = execute(dsn, "SELECT id FROM outbox_dead_letters WHERE topic = %s ORDER BY id", (topic,))
    return [int(r[0]) for r in rows]


def audit_of(dsn: str, first_id: int) -> list[tuple[Any, ...]]:
    return execute(
        dsn,
        "SELECT actor, action, target, row_count, first_id, last_id, row_ids FROM console_audit"
        " WHERE first_id = %s",
        (first_id,),
    )


def a_topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --- who may call ----------------------------------------------------------------------


def test_no_token_or_a_wrong_one_is_refused_401_in_json(world: World) -> None:
    topic = a_topic("auth")
    ids = dead_letters(world.dsn, topic, 1)
    with world.client(token=None) as bare:
        for answer in (
            bare.get("/api/v1/status"),
            bare.get("/api/v1/dead-letters"),
            bare.post("/api/v1/dead-letters/discard", json={"ids": ids}),
            bare.get("/api/v1/status", headers={"Authorization": f"Basic {TOKEN}"}),
        ):
            assert answer.status_code == 401, answer.text
            assert "Bearer" in answer.json()["error"]
            assert answer.headers["www-authenticate"].startswith("Bearer")
    with world.client(token="not-the-token-at-all-0123") as wrong:
        for answer in (
            wrong.get("/api/v1/status"),
            wrong.post("/api/v1/dead-letters/discard", json={"ids": ids}),
        ):
            assert answer.status_code == 401, answer.text
            assert answer.json() == {"error": "that is not the console's token"}
            assert 'error="invalid_token"' in answer.headers["www-authenticate"]
            assert answer.headers["content-type"] == "application/json"
    assert dead_ids(world.dsn, topic) == ids
    assert TOKEN not in LOG.read_text()


def test_wrong_tokens_are_throttled_per_address_as_wrong_logins_are(world: World) -> None:
    with world.client(token="guess-guess-guess-guess", source="127.0.0.3") as guessing:
        for _ in range(LOGIN_FAILURES):
            assert guessing.get("/api/v1/status").status_code == 401
    with world.client(source="127.0.0.3") as right:
        answer = right.get("/api/v1/status")
        assert answer.status_code == 429 and "too many" in answer.json()["error"]
        assert answer.headers["retry-after"] == "60"
    with world.client() as other:  # another address is not refused
        assert other.get("/api/v1/status").status_code == 200


def test_the_viewer_token_reads_and_may_not_change(world: World) -> None:
    topic = a_topic("viewer")
    ids = dead_letters(world.dsn, topic, 2)
    with world.client(VIEWER_TOKEN) as viewer:
        assert viewer.get("/api/v1/status").status_code == 200
        listed = viewer.get("/api/v1/dead-letters", params={"topic": topic})
        assert [r["id"] for r in listed.json()["dead_letters"]] == ids
        for action, body in (
            ("requeue", {"ids": ids}),
            ("discard", {"ids": ids}),
            ("requeue", {"filter": {"topic": topic}, "expected": 2}),
            ("discard", {"filter": {"topic": topic}, "dry_run": True}),
        ):
            answer = viewer.post(f"/api/v1/dead-letters/{action}", json=body)
            assert answer.status_code == 403, answer.text
            assert "may read, not change" in answer.json()["error"]
    assert dead_ids(world.dsn, topic) == ids
    assert scalar(world.dsn, "SELECT count(*) FROM console_audit WHERE first_id = %s", ids[:1]) == 0


# --- status ----------------------------------------------------------------------------


def test_status_is_relay_status_json(world: World) -> None:
    """The same document as `relay status --json` (at the console's count cap): its
    keys, the lease the relay holds, its heartbeat, the outbox's counts."""
    wait_until(
        lambda: scalar(world.dsn, "SELECT count(*) FROM replicas WHERE sink_ok") == 1,
        timeout=20,
        message="the relay's heartbeat",
    )
    with world.client() as api:
        answer = api.get("/api/v1/status")
    assert answer.status_code == 200, answer.text
    served = answer.json()
    printed = json.loads(
        subprocess.run(
            relay_command("status", "--json", "--count-cap", str(CAP)),
            env=relay_env(world.dsn),
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
    )

    def shape(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: shape(v) for k, v in value.items()}
        if isinstance(value, list):
            return [shape(v) for v in value]
        return type(value).__name__ if value is not None else None

    assert shape(served) == shape(printed)
    assert served["schema_version"] == printed["schema_version"]
    (lease,) = served["leases"]
    assert (lease["holder"], lease["live"]) == (REPLICA, True)
    assert lease["epoch"] == printed["leases"][0]["epoch"]
    (replica,) = served["replicas"]
    assert (replica["replica_id"], replica["sink_ok"]) == (REPLICA, True)
    assert served["outbox"]["count_cap"] == CAP
    for count in ("unsent", "blocked", "dead_lettered", "scheduled"):
        assert served["outbox"][count] == printed["outbox"][count], count
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+\+00:00", lease["expires_at"])


# --- dead letters: pages ---------------------------------------------------------------


def test_dead_letter_pages_follow_their_next_cursor(world: World) -> None:
    topic = a_topic("pages")
    ids = dead_letters(world.dsn, topic, 120)
    others = dead_letters(world.dsn, topic, 3, reason="HTTP 413: too large")
    seen: list[int] = []
    pages = []
    with world.client() as api:
        cursor: int | None = None
        while True:
            params: dict[str, Any] = {"topic": topic, "reason": "400", "limit": 50}
            if cursor is not None:
                params["after"] = cursor
            answer = api.get("/api/v1/dead-letters", params=params)
            assert answer.status_code == 200, answer.text
            page = answer.json()
            assert page["matching"] == 120 and page["count_cap"] == CAP
            pages.append(len(page["dead_letters"]))
            seen += [r["id"] for r in page["dead_letters"]]
            cursor = page["next"]
            if cursor is None:
                break
        assert pages == [50, 50, 20]
        assert seen == ids
        first = api.get("/api/v1/dead-letters", params={"topic": topic}).json()
        row = first["dead_letters"][0]
        assert set(row) == {
            "id",
            "message_id",
            "topic",
            "key",
            "attempts",
            "dead_lettered_at",
            "dead_letter_reason",
            "payload_bytes",
        }
        assert (row["id"], row["topic"], row["key"]) == (ids[0], topic, "k1")
        assert first["matching"] == 123  # 50 a page by default, the next after the 50th
        assert (len(first["dead_letters"]), first["next"]) == (50, ids[49])
        reason = api.get("/api/v1/dead-letters", params={"topic": topic, "reason": "TOO LARGE"})
        assert [r["id"] for r in reason.json()["dead_letters"]] == others


def test_bad_query_parameters_are_refused_400(world: World) -> None:
    with world.client() as api:
        for query in (
            "topik=orders",  # a misspelt filter would list everything
            "topic=a&topic=b",
            "limit=0",
            "limit=501",
            "after=abc",
            f"after={'9' * 25}",
            "since=yesterday",
            "topic=%00",
        ):
            answer = api.get(f"/api/v1/dead-letters?{query}")
            assert answer.status_code == 400, (query, answer.text)
            assert answer.json()["error"].startswith("bad query"), query


# --- changes ---------------------------------------------------------------------------


def test_a_requeue_by_ids_puts_the_rows_back_and_is_audited_as_the_api(world: World) -> None:
    topic = a_topic("requeue")
    ids = dead_letters(world.dsn, topic, 3)
    with world.client() as api:
        dry = api.post("/api/v1/dead-letters/requeue", json={"ids": ids[:2], "dry_run": True})
        assert dry.status_code == 200, dry.text
        assert dry.json() == {
            "action": "requeue",
            "dry_run": True,
            "matching": 2,
            "digest": console_data.digest(ids[:2]),
            "ids": ids[:2],
            "not_dead_letters": [],
        }
        assert dead_ids(world.dsn, topic) == ids  # a dry run changes nothing
        answer = api.post("/api/v1/dead-letters/requeue", json={"ids": ids[:2]})
    assert answer.status_code == 200, answer.text
    done = answer.json()
    assert (done["action"], done["changed"], done["ids"]) == ("requeue", 2, ids[:2])
    assert dead_ids(world.dsn, topic) == ids[2:]
    wait_until(
        lambda: (
            {d.body for d in world.receiver.acked() if "/hooks/" + topic in d.path}
            >= {b"row 1", b"row 2"}
        ),
        timeout=20,
        message="the requeued rows delivered",
    )
    audit = audit_of(world.dsn, ids[0])
    assert audit == [("api:token", "requeue", {"ids": ids[:2]}, 2, ids[0], ids[1], ids[:2])]
    assert done["audit_id"] == scalar(
        world.dsn, "SELECT id FROM console_audit WHERE first_id = %s", (ids[0],)
    )


def test_a_change_by_ids_changes_nothing_unless_every_id_is_a_dead_letter(world: World) -> None:
    topic = a_topic("partly")
    ids = dead_letters(world.dsn, topic, 2)
    missing = ids[-1] + 1_000_000
    with world.client() as api:
        answer = api.post("/api/v1/dead-letters/discard", json={"ids": [*ids, missing]})
    assert answer.status_code == 409, answer.text
    refused = answer.json()
    assert refused["error"].startswith("nothing changed: 3 row(s) were confirmed, 2 match now")
    assert refused["not_dead_letters"] == [missing]
    assert dead_ids(world.dsn, topic) == ids
    assert audit_of(world.dsn, ids[0]) == []


def test_a_change_by_filter_must_state_its_count_and_then_touches_those_rows(
    world: World,
) -> None:
    topic = a_topic("filter")
    ids = dead_letters(world.dsn, topic, 4)
    url = "/api/v1/dead-letters/requeue"
    by_filter: dict[str, Any] = {"filter": {"topic": topic}}
    with world.client() as api:
        # Without its count: the confirmation's figure, and nothing changed.
        asked = api.post(url, json=by_filter)
        assert asked.status_code == 409, asked.text
        assert asked.json()["matching"] == 4
        assert asked.json()["digest"] == console_data.digest(ids)
        assert '"expected": 4' in asked.json()["error"]
        # Another dead letter arrives: the count confirmed is no longer what matches.
        late = dead_letters(world.dsn, topic, 1)
        stale = api.post(url, json={**by_filter, "expected": 4})
        assert stale.status_code == 409, stale.text
        assert "4 row(s) were confirmed, 5 match now" in stale.json()["error"]
        assert stale.json()["matching"] == 5
        # As many rows, but not those seen (one discarded, one more arrived): the digest.
        digest = console_data.digest([*ids, *late])
        execute(world.dsn, "DELETE FROM outbox_dead WHERE id = %s", (late[0],))
        newer = dead_letters(world.dsn, topic, 1)
        swapped = api.post(url, json={**by_filter, "expected": 5, "digest": digest})
        assert swapped.status_code == 409, swapped.text
        assert "not the 5 confirmed" in swapped.json()["error"]
        assert dead_ids(world.dsn, topic) == [*ids, *newer]
        # The count and the digest of the rows that match now: done.
        rows = [*ids, *newer]
        done = api.post(url, json={**by_filter, "expected": 5, "digest": console_data.digest(rows)})
    assert done.status_code == 200, done.text
    assert (done.json()["changed"], done.json()["ids"]) == (5, rows)
    assert dead_ids(world.dsn, topic) == []
    audit = audit_of(world.dsn, ids[0])
    assert audit == [
        ("api:token", "requeue", {"filter": {"topic": topic}}, 5, ids[0], rows[-1], rows)
    ]


def test_a_discard_by_filter_deletes_the_rows_it_counted(world: World) -> None:
    topic = a_topic("discard")
    ids = dead_letters(world.dsn, topic, 3, reason="HTTP 422: unprocessable")
    kept = dead_letters(world.dsn, topic, 1, reason="HTTP 404: gone")
    with world.client() as api:
        answer = api.post(
            "/api/v1/dead-letters/discard",
            json={"filter": {"topic": topic, "reason": "unprocessable"}, "expected": 3},
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["ids"] == ids
    assert dead_ids(world.dsn, topic) == kept
    assert scalar(world.dsn, "SELECT count(*) FROM outbox WHERE id = ANY(%s)", (ids,)) == 0
    target = {"filter": {"topic": topic, "reason": "unprocessable"}}
    assert audit_of(world.dsn, ids[0]) == [
        ("api:token", "discard", target, 3, ids[0], ids[-1], ids)
    ]


def test_a_filter_matching_more_than_the_cap_is_refused_with_the_count(world: World) -> None:
    topic = a_topic("cap")
    ids = dead_letters(world.dsn, topic, CAP + 1)
    try:
        with world.client() as api:
            for body in (
                {"filter": {"topic": topic}},
                {"filter": {"topic": topic}, "dry_run": True},
                {"filter": {"topic": topic}, "expected": CAP + 1},
            ):
                answer = api.post("/api/v1/dead-letters/requeue", json=body)
                assert answer.status_code == 409, answer.text
                refused = answer.json()
                assert refused["cap"] == CAP and refused["matching_at_least"] == CAP + 1
                assert f"more than {CAP} dead letters match" in refused["error"]
        assert scalar(world.dsn, "SELECT count(*) FROM outbox_dead WHERE topic = %s", (topic,)) == (
            CAP + 1
        )
        assert audit_of(world.dsn, ids[0]) == []
    finally:
        execute(world.dsn, "DELETE FROM outbox_dead WHERE topic = %s", (topic,))


# --- the cookie and the bearer token kept apart ------------------------------------------


def test_the_session_cookie_is_no_api_caller_and_a_bearer_token_no_login(world: World) -> None:
    topic = a_topic("apart")
    ids = dead_letters(world.dsn, topic, 1)
    own = {"Origin": world.url}
    with world.client(token=None) as browser:
        login = browser.post("/login", data={"token": TOKEN}, headers=own)
        assert login.status_code == 303
        session = login.headers["set-cookie"].split(";", 1)[0]
        cookie = {"Cookie": session, **own}
        page = browser.get(f"/rows/{ids[0]}", headers=cookie)
        assert page.status_code == 200
        csrf = re.findall(r'name="csrf" value="([0-9a-f]+)"', page.text)[0]
        # The browser's session calls no API endpoint, reading or changing.
        for answer in (
            browser.get("/api/v1/status", headers=cookie),
            browser.post("/api/v1/dead-letters/discard", json={"ids": ids}, headers=cookie),
            browser.post(
                "/api/v1/dead-letters/discard",
                json={"ids": ids},
                headers={**cookie, "X-CSRF-Token": csrf},
            ),
        ):
            assert answer.status_code == 401, answer.text
        # A form route takes no bearer token for a login, nor for the CSRF token.
        form = {
            "action": "discard",
            "confirmed": "1",
            "digest": console_data.digest(ids),
            "id": str(ids[0]),
        }
        bearer = {"Authorization": f"Bearer {TOKEN}", **own}
        alone = browser.post("/dead-letters/apply", data=form, headers=bearer)
        assert alone.status_code == 401 and alone.text == "login required"
        with_cookie = browser.post("/dead-letters/apply", data=form, headers={**bearer, **cookie})
        assert with_cookie.status_code == 403 and "CSRF" in with_cookie.text
        assert dead_ids(world.dsn, topic) == ids
        # With its CSRF token the same form goes through: the refusals were for what lacked.
        done = browser.post("/dead-letters/apply", data={**form, "csrf": csrf}, headers=cookie)
        assert done.status_code == 303
    assert dead_ids(world.dsn, topic) == []
    assert audit_of(world.dsn, ids[0])[0][0] == "token"  # the page's actor, not the API's


# --- errors are JSON -------------------------------------------------------------------


def test_every_error_is_json_with_its_status(world: World) -> None:
    url = "/api/v1/dead-letters/requeue"
    with world.client() as api:
        for body, status in (
            (b"not json", 400),
            (b"[1, 2]", 400),
            (b"[" * 100_000, 400),
            (b'{"ids": [1], "filter": {}}', 400),
            (b"{}", 400),
            (b'{"ids": []}', 400),
            (b'{"ids": ["1"]}', 400),
            (b'{"ids": [true]}', 400),
            (b'{"ids": [-1]}', 400),
            (b'{"ids": [1e400]}', 400),
            (b'{"ids": [1], "expected": 1}', 400),
            (b'{"filter": {"topik": "a"}, "expected": 0}', 400),  # never "every row"
            (b'{"filter": {"topic": 7}}', 400),
            (b'{"filter": {"since": "yesterday"}}', 400),
            (b'{"filter": {}, "expected": -1}', 400),
            (b'{"filter": {}, "dry_run": "yes"}', 400),
            (b'{"ids": [1], "confirm": true}', 400),
        ):
            answer = api.post(url, content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == status, (body[:60], answer.text)
            assert answer.json()["error"].startswith("bad request"), body[:60]
        for answer, status in (
            (api.get("/api/v1/nothing-here"), 404),
            (api.get(url), 405),
            (api.post("/api/v1/status"), 405),
            (api.post(url, content=b'{"ids": [' + b"1," * 200_000 + b"1]}"), 413),
            (api.get("/api/v1/status", headers={"Host": "rebound.example"}), 400),
        ):
            assert answer.status_code == status, answer.text
            assert set(answer.json()) == {"error"}, answer.text


@pytest.mark.unit
def test_a_read_only_console_refuses_the_token_a_change_and_a_lost_database_is_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from starlette.testclient import TestClient

    from relay.console.app import Console
    from relay.console.settings import ConsoleSettings
    from relay.settings import CommonSettings

    console = Console(
        CommonSettings(database_url="postgresql://nobody@127.0.0.1:1/none"),
        ConsoleSettings(token=TOKEN, read_only=True, allowed_hosts="testserver"),
    )
    client = TestClient(console.application(), base_url="http://testserver")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    refused = client.post("/api/v1/dead-letters/requeue", json={"ids": [1]}, headers=bearer)
    assert refused.status_code == 403
    assert refused.json() == {
        "error": "refused: the console is read-only (RELAY_CONSOLE_READ_ONLY)"
    }

    async def failing(_work: Any) -> Any:
        raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")

    monkeypatch.setattr(console.api, "run", failing)
    lost = client.get("/api/v1/status", headers=bearer)
    assert lost.status_code == 503
    assert lost.json() == {"error": "the database is unavailable or slow; try again"}


# --- pause, resume, replay -------------------------------------------------------------


def delivered(world: World, topic: str) -> list[Delivery]:
    return [d for d in world.receiver.acked() if d.path.endswith("/hooks/" + topic)]


def test_a_pause_and_a_resume_through_the_api_hold_a_topic_and_are_audited(
    world: World,
) -> None:
    topic = a_topic("paused")
    with world.client(VIEWER_TOKEN) as viewer:
        assert viewer.post("/api/v1/pause", json={"topic": topic}).status_code == 403
    with world.client() as api:
        paused = api.post("/api/v1/pause", json={"topic": topic, "reason": "consumer down"})
        assert paused.status_code == 200, paused.text
        assert (paused.json()["topic"], paused.json()["paused"]) == (topic, True)
        again = api.post("/api/v1/pause", json={"topic": topic})
        assert (again.status_code, again.json()["paused"]) == (200, False)

        def listed_pause() -> dict[str, Any] | None:
            # A status under load may answer 503 (the console's statement timeout):
            # asked again until it answers, within the deadline.
            answer = api.get("/api/v1/status")
            if answer.status_code != 200:
                return None
            found = [p for p in answer.json()["paused_topics"] if p["topic"] == topic]
            return found[0] if found else None

        listed = wait_until(listed_pause, timeout=30, message="the pause in the status")
        assert (listed["paused_by"], listed["reason"]) == ("api:token", "consumer down")
        wait_until(
            lambda: any(
                s.value >= 1
                for family in REGISTRY.collect()
                if family.name == "relay_drain_paused_topics"
                for s in family.samples
            ),
            timeout=10,
            message="the relay's drain saw the pause",
        )
        execute(
            world.dsn, "INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', 'held')", (topic,)
        )
        wait_until(
            lambda: (
                scalar(
                    world.dsn,
                    "SELECT count(*) FROM outbox_paused WHERE topic = %s",
                    (topic,),
                )
                == 1
            ),
            timeout=10,
            message="the row held",
        )
        assert delivered(world, topic) == []
        resumed = api.post("/api/v1/resume", json={"topic": topic})
        assert resumed.status_code == 200, resumed.text
        wait_until(lambda: delivered(world, topic), timeout=10, message="the row sent once resumed")
        not_paused = api.post("/api/v1/resume", json={"topic": topic})
        assert not_paused.status_code == 409 and "is not paused" in not_paused.json()["error"]
        for bad in ({}, {"topic": ""}, {"topic": 7}, {"topic": topic, "why": "x"}):
            refused = api.post("/api/v1/pause", json=bad)
            assert refused.status_code == 400, (bad, refused.text)
    audit = execute(
        world.dsn,
        "SELECT actor, action, target FROM console_audit WHERE target->>'topic' = %s ORDER BY id",
        (topic,),
    )
    assert audit == [
        ("api:token", "pause", {"topic": topic, "via": "api"}),
        ("api:token", "resume", {"topic": topic, "via": "api"}),
    ]


def test_a_replay_through_the_api_states_its_count_then_replays_exactly_those_rows(
    world: World,
) -> None:
    topic = a_topic("replayed")
    keep(world.dsn, "anchor", [(None, b"")], "3 hours")  # the history kept since then
    keep(world.dsn, topic, [("k", b"again 0"), ("k", b"again 1")], "1 hour")
    with world.client() as api:
        counted = api.post("/api/v1/replay", json={"topic": topic, "since": "2h"})
        assert counted.status_code == 200, counted.text
        assert (counted.json()["matching"], counted.json()["replayed"]) == (2, 0)
        assert 'send "expected": 2' in counted.json()["message"]
        wrong = api.post("/api/v1/replay", json={"topic": topic, "since": "2h", "expected": 3})
        assert wrong.status_code == 409, wrong.text
        too_early = api.post("/api/v1/replay", json={"topic": topic, "since": "5h", "expected": 2})
        assert too_early.status_code == 409 and "before the oldest row kept" in too_early.text
        done = api.post("/api/v1/replay", json={"topic": topic, "since": "2h", "expected": 2})
    assert done.status_code == 200, done.text
    replay_id = done.json()["replay_id"]
    assert done.json()["replayed"] == 2
    wait_until(lambda: len(delivered(world, topic)) == 2, timeout=20, message="the replay sent")
    sent = delivered(world, topic)
    assert [d.body for d in sent] == [b"again 0", b"again 1"]
    assert {d.headers["relay-replay"] for d in sent} == {str(replay_id)}
    [(actor, via)] = execute(
        world.dsn, "SELECT actor, target->>'via' FROM console_audit WHERE id = %s", (replay_id,)
    )
    assert (actor, via) == ("api:token", "api")
