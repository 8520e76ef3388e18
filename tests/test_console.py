"""The operators' console (relay console) in a real browser: Playwright driving Debian's
chromium against the console as its own process under its least-privilege role
(migrations/console_grants.sql), a real relay draining to a real HTTP receiver, and
PostgreSQL. One console, one relay and one browser serve the whole module; every test
works on rows of its own. Screenshots of each page go to tests/artifacts/console/."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    Dialog,
    Page,
    Playwright,
    sync_playwright,
)

from relay.admin.migrate import migrations_dir
from relay.console import data as console_data
from relay.settings import Settings
from relay.sql import QUERIES
from tests.conftest import REPO, TEMPLATE_DB, relay_command, relay_env
from tests.harness import free_port
from tests.harness.postgres import PostgresServer
from tests.harness.webhook import Delivery, Reply, WebhookServer
from tests.support import http_get, plan_nodes, running_relay, scalar, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = REPO / "tests" / "artifacts" / "console"
TOKEN = "operator-token-0123456789"
VIEWER_TOKEN = "viewer-token-0123456789ab"
CONSOLE_ROLE, VIEWER_ROLE, ROLE_PASSWORD = "relay_console", "relay_console_viewer", "console-pw"
REPLICA = "relay-under-test"
PROXY_HEADER = "X-Forwarded-User"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium not installed")


def create_console_roles(pg: PostgresServer) -> None:
    """Both console roles, once per cluster (roles outlive databases)."""
    for role in (CONSOLE_ROLE, VIEWER_ROLE):
        pg.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN"
            f" CREATE ROLE {role} LOGIN PASSWORD '{ROLE_PASSWORD}'; END IF; END $$"
        )


def grant_console(pg: PostgresServer, dbname: str) -> None:
    create_console_roles(pg)
    pg.execute((migrations_dir() / "console_grants.sql").read_text(), dbname=dbname)


@dataclass
class World:
    """What the module's tests share."""

    dsn: str  # superuser: plays the app (inserts) and checks the database
    console_dsn: str
    url: str
    receiver: WebhookServer
    accept_poison: list[bool]


def responder(accept_poison: list[bool]) -> Any:
    """400 (dead letter) for payloads holding "poison" until told to accept them; 500
    (retried, in backoff) for keys starting "stuck"; 200 otherwise."""

    def respond(delivery: Delivery) -> Reply:
        if b"poison" in delivery.body and not accept_poison[0]:
            return Reply(400, body=b"schema violation: field order.total is missing")
        if (delivery.key or "").startswith("stuck"):
            return Reply(500, body=b"downstream database is read-only")
        return Reply(200)

    return respond


@pytest.fixture(scope="module")
def world(pg: PostgresServer) -> Iterator[World]:
    name = f"console_{uuid.uuid4().hex[:10]}"
    dsn = pg.create_database(name, template=TEMPLATE_DB)
    grant_console(pg, name)
    console_dsn = pg.dsn(name, user=CONSOLE_ROLE, password=ROLE_PASSWORD)
    accept_poison = [False]
    port = free_port()
    env = relay_env(
        console_dsn,
        RELAY_CONSOLE_TOKEN=TOKEN,
        RELAY_CONSOLE_VIEWER_TOKEN=VIEWER_TOKEN,
        RELAY_CONSOLE_PORT=str(port),
        RELAY_CONSOLE_TRUSTED_USER_HEADER=PROXY_HEADER,
        RELAY_CONSOLE_REFRESH_SECONDS="0",
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = (ARTIFACTS / "console.log").open("wb")
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
        retry_base_seconds=60.0,  # a failed key stays in backoff while the tests look
        retry_max_seconds=120.0,
        log_format="json",
    )
    try:
        with WebhookServer(responder(accept_poison)) as receiver:
            settings = settings.model_copy(update={"http_url": receiver.url + "/hooks/{topic}"})
            with running_relay(settings):
                url = f"http://127.0.0.1:{port}"
                wait_until(
                    lambda: http_get(url + "/healthz")[0] == 200 or console.poll() is not None,
                    timeout=30,
                    message="the console listening",
                )
                assert console.poll() is None, (ARTIFACTS / "console.log").read_text()[-3000:]
                yield World(dsn, console_dsn, url, receiver, accept_poison)
    finally:
        console.terminate()
        try:
            console.wait(timeout=10)
        except subprocess.TimeoutExpired:
            console.kill()
        log.close()
        pg.drop_database(name)


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(10_000)
    yield context
    context.close()


def log_in(context: BrowserContext, world: World, token: str = TOKEN) -> Page:
    page = context.new_page()
    page.goto(world.url + "/login")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(world.url + "/")
    return page


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def execute(dsn: str, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def dead_letter_directly(
    dsn: str,
    topic: str,
    key: str,
    payload: bytes,
    reason: str = "HTTP 400: bad",
    **extra: Any,
) -> int:
    """A row the app wrote and the relay gave up on, written here in one statement (no
    relay round trip): for tests about the console alone. In outbox_dead, under an id
    of the outbox's, as the relay moves it."""
    headers = extra.get("headers")
    (row,) = execute(
        dsn,
        "INSERT INTO outbox_dead (id, message_id, topic, key, payload, headers,"
        " created_at, attempts, dead_lettered_at, dead_letter_reason)"
        " VALUES (nextval(pg_get_serial_sequence('outbox', 'id')), gen_random_uuid(),"
        " %s, %s, %s, %s, now(), 1, now(), %s) RETURNING id",
        (topic, key, payload, None if headers is None else json.dumps(headers), reason),
    )
    return int(row[0])


def csrf_of(page: Page) -> str:
    value = page.get_attribute("input[name=csrf]", "value")
    assert value
    return value


# --- login ---------------------------------------------------------------------------


def test_every_page_needs_a_login_and_a_wrong_token_is_refused(
    world: World, context: BrowserContext
) -> None:
    page = context.new_page()
    for path in ("/", "/dead-letters", "/blocked", "/audit", "/rows/1"):
        page.goto(world.url + path)
        assert page.url.startswith(world.url + "/login"), path
    page.fill("#token", "not-the-token-at-all")
    page.click("button[type=submit]")
    assert page.locator(".error").inner_text() == "That is not the console's token."
    assert "/login" in page.url
    assert not context.cookies()
    shot(page, "login-refused")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(world.url + "/rows/1")  # back where it was sent from
    (cookie,) = context.cookies()
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert cookie["secure"] is True
    # Outside a browser, without the cookie: the same.
    assert http_get(world.url + "/dead-letters")[1].count("Console token") == 1


# --- overview ------------------------------------------------------------------------


def test_the_overview_shows_the_real_lease_holder(world: World, context: BrowserContext) -> None:
    wait_until(
        lambda: scalar(world.dsn, "SELECT holder FROM leases WHERE expires_at > now()") == REPLICA,
        timeout=20,
        message="the relay holding its lease",
    )
    wait_until(
        lambda: scalar(world.dsn, "SELECT count(*) FROM replicas") == 1, 10, message="heartbeat"
    )
    page = log_in(context, world)
    holder = page.locator("#leases td.holder").first
    assert holder.inner_text() == REPLICA
    assert "held" in page.locator("#leases").inner_text()
    replicas = page.locator("#replicas").inner_text()
    assert REPLICA in replicas and "reachable" in replicas
    for card in ("#unsent", "#oldest", "#blocked-keys", "#scheduled", "#dead-letters", "#rate"):
        assert page.locator(card).inner_text()
    shot(page, "overview")


# --- dead letters: find, inspect, requeue, deliver, audit ---------------------------


def test_a_dead_letter_is_found_inspected_requeued_and_delivered(
    world: World, context: BrowserContext
) -> None:
    key = f"order-{uuid.uuid4().hex[:8]}"
    body = {"order": 7, "poison": True, "lines": [{"sku": "A-1", "qty": 2}]}
    with psycopg.connect(world.dsn, autocommit=True) as conn:
        (row_id,) = conn.execute(
            "INSERT INTO outbox (topic, key, payload, headers) VALUES ('orders', %s, %s, %s)"
            " RETURNING id",
            (key, json.dumps(body).encode(), json.dumps({"trace-id": "abc123"})),
        ).fetchone() or (None,)
    wait_until(
        lambda: scalar(
            world.dsn, "SELECT count(*) FROM outbox_dead_letters WHERE id = %s", (row_id,)
        ),
        timeout=20,
        message="the relay dead-lettering the row",
    )
    page = log_in(context, world)
    page.click("text=Dead letters")
    page.fill("input[name=key]", key)
    page.fill("input[name=reason]", "SCHEMA VIOLATION")  # a case-insensitive substring
    page.click("#search button[type=submit]")
    # count() does not wait: the search's page first (the click only starts its load).
    page.wait_for_url(re.compile(rf".*/dead-letters\?.*key={key}.*"))
    rows = page.locator("#dead-letter-table tbody tr")
    assert rows.count() == 1
    assert "schema violation" in rows.first.inner_text()
    shot(page, "dead-letters")

    page.click(f"a[href='/rows/{row_id}']")
    payload = page.locator("#payload").inner_text()
    assert json.loads(payload) == body
    assert '\n  "order": 7,' in payload  # pretty-printed
    assert "abc123" in page.locator("#headers").inner_text()
    assert "schema violation" in page.locator("#reason").inner_text()
    shot(page, "dead-letter-row")

    world.accept_poison[0] = True
    page.click("button[value=requeue]")
    assert page.locator("h1").inner_text() == "Requeue 1 row?"
    shot(page, "confirm-requeue")
    page.click("#confirm")
    page.wait_for_url(re.compile(r".*/audit/\d+$"))
    assert page.locator("#done").inner_text() == "Requeued 1 row."
    shot(page, "audit-entry")

    wait_until(
        lambda: [d for d in world.receiver.acked() if d.key == key],
        timeout=20,
        message="the requeued row arriving at the receiver",
    )
    audit = execute(
        world.dsn,
        "SELECT actor, action, target, row_count, first_id, last_id, at > now() - interval"
        " '1 minute' FROM console_audit WHERE action = 'requeue' AND first_id = %s",
        (row_id,),
    )
    assert audit == [("token", "requeue", {"ids": [row_id]}, 1, row_id, row_id, True)]
    page.click("text=Audit")
    assert str(row_id) in page.locator("#audit-table").inner_text()
    shot(page, "audit")


# --- CSRF and origin -----------------------------------------------------------------


def test_a_replayed_change_without_its_csrf_token_is_refused(
    world: World, context: BrowserContext
) -> None:
    row_id = dead_letter_directly(world.dsn, "csrf", f"c-{uuid.uuid4().hex[:6]}", b"x")
    page = log_in(context, world)
    page.goto(f"{world.url}/rows/{row_id}")
    csrf = csrf_of(page)
    form: dict[str, str | float | bool] = {
        "action": "discard",
        "confirmed": "1",
        "digest": console_data.digest([row_id]),
        "id": row_id,
    }
    own = {"Origin": world.url}
    apply = world.url + "/dead-letters/apply"
    # The request the confirm button sends, replayed with the session cookie but no token:
    replayed = page.request.post(apply, form=form, headers=own, max_redirects=0)
    assert replayed.status == 403 and "CSRF" in replayed.text()
    wrong = page.request.post(apply, form={**form, "csrf": csrf[::-1]}, headers=own)
    assert wrong.status == 403
    # A foreign page's form, token and all, is refused for its Origin.
    foreign = page.request.post(
        apply, form={**form, "csrf": csrf}, headers={"Origin": "https://evil.example"}
    )
    assert foreign.status == 403 and "origin" in foreign.text()
    assert (
        scalar(world.dsn, "SELECT count(*) FROM outbox_dead_letters WHERE id = %s", (row_id,)) == 1
    )
    # Without the session cookie, with a token: no login.
    anonymous = context.browser.new_context() if context.browser else None
    assert anonymous is not None
    try:
        bare = anonymous.request.post(apply, form={**form, "csrf": csrf}, headers=own)
        assert bare.status == 401
    finally:
        anonymous.close()
    # The same request with its token goes through: the refusals were for what was missing.
    done = page.request.post(apply, form={**form, "csrf": csrf}, headers=own, max_redirects=0)
    assert done.status == 303
    assert (
        scalar(world.dsn, "SELECT count(*) FROM outbox_dead_letters WHERE id = %s", (row_id,)) == 0
    )


# --- DNS rebinding: the Host allow-list ----------------------------------------------


def request_as(
    world: World, method: str, path: str, headers: dict[str, str], body: str | None = None
) -> tuple[int, str]:
    """One request to the console's address with chosen headers, Host included (what a
    page whose name was re-pointed at 127.0.0.1 sends)."""
    port = int(world.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        extra = {"Content-Type": "application/x-www-form-urlencoded"} if body else {}
        conn.request(method, path, body=body, headers={**extra, **headers})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_a_rebound_page_is_refused_for_its_host_even_with_the_proxy_header(
    world: World,
) -> None:
    """A page at rebound.example, its name re-pointed at 127.0.0.1, sends the proxy's
    user header itself (loopback is trusted): its Host is not the console's, so it
    reads no page (no CSRF token) and changes nothing, Origin or not."""
    row_id = dead_letter_directly(world.dsn, "rebind", f"r-{uuid.uuid4().hex[:6]}", b"x")
    port = world.url.rsplit(":", 1)[1]
    rebound = {"Host": f"rebound.example:{port}", PROXY_HEADER: "mallory"}
    status, text = request_as(world, "GET", f"/rows/{row_id}", rebound)
    assert status == 400 and "RELAY_CONSOLE_ALLOWED_HOSTS" in text
    assert "csrf" not in text
    # The token a real page carries does not help the rebound one post.
    own = {"Host": f"127.0.0.1:{port}", PROXY_HEADER: "mallory"}
    status, text = request_as(world, "GET", f"/rows/{row_id}", own)
    assert status == 200
    csrf = re.findall(r'name="csrf" value="([0-9a-f]+)"', text)[0]
    form = (
        f"csrf={csrf}&action=discard&confirmed=1&id={row_id}&digest={console_data.digest([row_id])}"
    )
    origin = {"Origin": f"http://rebound.example:{port}"}
    status, _ = request_as(world, "POST", "/dead-letters/apply", {**rebound, **origin}, form)
    assert status == 400
    assert (
        scalar(world.dsn, "SELECT count(*) FROM outbox_dead_letters WHERE id = %s", (row_id,)) == 1
    )
    # The loopback names are the console's own by default, and the probes answer any Host.
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert request_as(world, "GET", "/login", {"Host": host})[0] == 200, host
    assert request_as(world, "GET", "/healthz", rebound) == (200, "ok")
    execute(world.dsn, "DELETE FROM outbox_dead WHERE id = %s", (row_id,))


def test_a_posts_origin_must_be_an_allowed_host_as_well_as_its_own() -> None:
    """The Origin check, apart from the Host check before it: an Origin equal to its
    Host is still foreign if that host is not allowed (`*` turns the list off)."""
    from starlette.requests import Request

    from relay.console.hosts import AllowedHosts, foreign_origin

    def post(host: str, origin: str) -> Request:
        headers = [(b"host", host.encode()), (b"origin", origin.encode())]
        return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})

    local = AllowedHosts.parse("127.0.0.1,localhost")
    rebound = post("rebound.example:9109", "http://rebound.example:9109")
    assert foreign_origin(rebound, local, set()) == "foreign origin 'http://rebound.example:9109'"
    assert foreign_origin(rebound, AllowedHosts.parse("*"), set()) is None
    assert foreign_origin(rebound, local, {"http://rebound.example:9109"}) is None
    assert foreign_origin(post("localhost:9109", "http://localhost:9109"), local, set()) is None
    assert foreign_origin(post("localhost:9109", "http://127.0.0.1:9109"), local, set())


def test_the_allowed_hosts_default_and_matching() -> None:
    from relay.console.hosts import AllowedHosts, default_hosts
    from relay.console.settings import ConsoleSettings

    def hosts(**values: Any) -> str:
        return str(ConsoleSettings(token=TOKEN, **values).hosts)

    assert hosts() == "127.0.0.1,[::1],localhost"
    assert hosts(host="0.0.0.0") == "127.0.0.1,[::1],localhost"  # noqa: S104
    assert hosts(host="console.internal") == "console.internal"
    assert hosts(host="0.0.0.0", allowed_hosts="Console.Example.com.") == "console.example.com"  # noqa: S104
    assert default_hosts("::1") == "::1,localhost,127.0.0.1,[::1]"
    allowed = AllowedHosts.parse("console.example.com, ops.example.com:8443, ::1")
    for host in ("console.example.com", "CONSOLE.example.com:9109", "[::1]:9109"):
        assert allowed.allows(host), host
    for host in ("ops.example.com:9109", "evil.example", "console.example.com.evil", "", "a b"):
        assert not allowed.allows(host), host
    assert AllowedHosts.parse("ops.example.com:443").allows("ops.example.com")
    assert AllowedHosts.parse("*").allows("anything.example")


# --- escaping ------------------------------------------------------------------------


def test_markup_in_rows_renders_as_text_and_never_runs(
    world: World, context: BrowserContext
) -> None:
    key = "<script>window.__pwned = 'key'</script>"
    reason = "<img src=x onerror=\"window.__pwned = 'reason'\">"
    headers = {"<b>h</b>": "<script>window.__pwned = 'header'</script>"}
    payload = b"<script>window.__pwned = 'payload'</script><iframe src=/></iframe>"
    row_id = dead_letter_directly(world.dsn, "<i>t</i>", key, payload, reason, headers=headers)
    page = log_in(context, world)
    dialogs: list[str] = []

    def dialog(opened: Dialog) -> None:
        dialogs.append(opened.message)
        opened.dismiss()

    page.on("dialog", dialog)
    page.goto(f"{world.url}/dead-letters?topic=%3Ci%3Et%3C%2Fi%3E")
    table = page.locator("#dead-letter-table")
    assert key in table.inner_text() and reason in table.inner_text()
    assert table.locator("script, img, i").count() == 0
    page.goto(f"{world.url}/rows/{row_id}")
    assert page.locator("#payload").inner_text() == payload.decode()
    assert "<script>window.__pwned = 'header'</script>" in page.locator("#headers").inner_text()
    assert page.locator("main script, main img, main iframe, main b").count() == 0
    shot(page, "escaped-row")
    assert page.evaluate("window.__pwned") is None
    assert dialogs == []


# --- keyset pages --------------------------------------------------------------------


def test_dead_letter_pages_walk_their_index(world: World, context: BrowserContext) -> None:
    """Each page is a walk of outbox_dead's key from its cursor (EXPLAIN, as the
    console's role), first and deep; and Next/Previous in the browser continue the ids.
    The page time at 100,000 dead letters is in
    the benchmark (bench/console.py)."""
    topic = f"many-{uuid.uuid4().hex[:6]}"
    other = dead_letter_directly(world.dsn, f"other-{topic}", "k", b"x")  # before, unmatched
    execute(
        world.dsn,
        "INSERT INTO outbox (topic, key, payload, attempts)"
        " SELECT %s, 'k' || (g %% 50), 'x', 3 FROM generate_series(1, 3000) AS g",
        (topic,),
    )
    execute(
        world.dsn,
        "WITH gone AS (DELETE FROM outbox WHERE topic = %s RETURNING *)"
        " INSERT INTO outbox_dead (id, message_id, topic, key, payload, created_at, attempts,"
        " dead_lettered_at, dead_letter_reason) SELECT id, message_id, topic, key, payload,"
        " created_at, attempts, now(), 'HTTP 400: nope' FROM gone",
        (topic,),
    )
    execute(world.dsn, "ANALYZE outbox")
    execute(world.dsn, "ANALYZE outbox_dead")
    first_id = scalar(
        world.dsn, "SELECT min(id) FROM outbox_dead_letters WHERE topic = %s", (topic,)
    )
    base = {"topic": None, "key": None, "reason": None, "since": None, "until": None}
    after, before = QUERIES.console_dead_letter_page_after, QUERIES.console_dead_letter_page_before
    with psycopg.connect(world.console_dsn, autocommit=True) as conn:
        # A page, and the one-row look past its end (Next) or before its start (Previous).
        for query, params in (
            (after, {**base, "after": 0, "limit": 51}),
            (after, {**base, "after": first_id + 2500, "limit": 51}),
            (after, {**base, "topic": topic, "after": first_id + 1000, "limit": 51}),
            (after, {**base, "topic": topic, "after": first_id + 1000, "limit": 1}),
            (before, {**base, "before": first_id + 2500, "limit": 51}),
            (before, {**base, "topic": topic, "before": first_id + 1000, "limit": 51}),
            (before, {**base, "topic": topic, "before": first_id + 1000, "limit": 1}),
        ):
            found = conn.execute("EXPLAIN (FORMAT JSON) " + query, params).fetchone()
            assert found is not None
            plan = found[0][0]["Plan"]
            # outbox_dead by its key from the cursor, never read whole and sorted.
            walks = {n.get("Index Name") for n in plan_nodes(plan) if n.get("Relation Name")}
            assert walks == {"outbox_dead_pkey"}, plan
            for sort in (n for n in plan_nodes(plan) if n["Node Type"] == "Sort"):
                assert all(n.get("Relation Name") != "outbox_dead" for n in plan_nodes(sort)), plan

    page = log_in(context, world)
    page.goto(f"{world.url}/dead-letters?topic={topic}")
    assert page.locator("#matching").inner_text().startswith("3,000 dead letter(s)")

    def ids() -> list[int]:
        return [
            int(t)
            for t in page.locator("#dead-letter-table tbody tr td:nth-child(2)").all_inner_texts()
        ]

    def follow(link: str) -> list[int]:
        """The ids of the page a link leads to, once it has loaded: ids() does not wait,
        and the click only starts the load."""
        href = page.get_attribute(link, "href")
        assert href is not None
        page.click(link)
        page.wait_for_url(re.compile(".*" + re.escape(href.split("?", 1)[1]) + "$"))
        return ids()

    first = ids()
    assert first == list(range(first_id, first_id + 50))
    second = follow("#next")
    assert second == list(range(first_id + 50, first_id + 100))
    assert follow("#prev") == first
    assert page.locator("#prev").count() == 0  # the first page: nothing before it

    def visit(query: str) -> tuple[list[int], bool, bool]:
        page.goto(f"{world.url}/dead-letters?topic={topic}&{query}")
        return ids(), page.locator("#prev").count() > 0, page.locator("#next").count() > 0

    last_id = first_id + 2999
    # A cursor with no match before it (only another topic's row): no Previous.
    assert visit(f"after={other}") == (first, False, True)
    # A previous page that would run past the first row: the first page, full.
    assert visit(f"before={first_id + 10}") == (first, False, True)
    # A previous page from beyond the last row: the last page, and no Next.
    last = list(range(last_id - 49, last_id + 1))
    assert visit(f"before={last_id + 1}") == (last, True, False)
    middle = list(range(last_id - 99, last_id - 49))
    assert visit(f"before={last_id - 49}") == (middle, True, True)
    assert visit(f"after={last_id - 50}") == (last, True, False)
    execute(world.dsn, "DELETE FROM outbox WHERE topic = %s", (topic,))
    execute(world.dsn, "DELETE FROM outbox_dead WHERE topic = %s OR id = %s", (topic, other))


# --- changes by filter, discards, read-only, proxy -----------------------------------


def test_a_discard_by_filter_states_its_count_and_is_audited(
    world: World, context: BrowserContext
) -> None:
    topic = f"discard-{uuid.uuid4().hex[:6]}"
    ids = [dead_letter_directly(world.dsn, topic, f"k{n}", b"old") for n in range(3)]
    page = log_in(context, world)
    page.goto(f"{world.url}/dead-letters?topic={topic}")
    page.click("#by-filter button[value=discard]")
    assert page.locator("h1").inner_text() == "Discard 3 rows?"
    assert "deletes" in page.locator("#statement").inner_text()
    # One more matches by now: confirming the 3 changes nothing, and says so.
    late = dead_letter_directly(world.dsn, topic, "k9", b"late")
    page.click("#confirm")
    assert "3 row(s) were confirmed, 4 match now" in page.locator(".error").inner_text()
    assert (
        scalar(world.dsn, "SELECT count(*) FROM outbox_dead_letters WHERE topic = %s", (topic,))
        == 4
    )
    page.goto(f"{world.url}/dead-letters?topic={topic}")
    page.click("#by-filter button[value=discard]")
    assert page.locator("h1").inner_text() == "Discard 4 rows?"
    page.click("#confirm")
    assert page.locator("#done").inner_text() == "Discarded 4 rows."
    deleted = [*ids, late]
    assert page.locator("#row-ids").inner_text() == "Row ids (4): " + ", ".join(map(str, deleted))
    assert (
        scalar(world.dsn, "SELECT count(*) FROM outbox_dead_letters WHERE topic = %s", (topic,))
        == 0
    )
    # Which rows went is in the audit, not only the search (which matches nothing now).
    audit = execute(
        world.dsn,
        "SELECT actor, target, row_count, first_id, last_id, row_ids FROM console_audit"
        " WHERE action = 'discard' AND first_id = %s",
        (ids[0],),
    )
    assert audit == [("token", {"filter": {"topic": topic}}, 4, ids[0], late, deleted)]


def test_an_audit_entry_lists_its_row_ids_compactly(world: World, context: BrowserContext) -> None:
    """A few hundred ids, then "… and N more"; an entry recorded without its ids says
    so."""
    ids = list(range(10_000, 11_200))
    entries = execute(
        world.dsn,
        "INSERT INTO console_audit (actor, action, target, row_count, first_id, last_id,"
        " row_ids) VALUES ('token', 'discard', '{\"filter\": {}}', 1200, 10000, 11199, %s),"
        " ('token', 'discard', '{\"ids\": [7, 9]}', 2, 7, 9, NULL) RETURNING id",
        (ids,),
    )
    (many,), (old,) = entries
    page = log_in(context, world)
    page.goto(f"{world.url}/audit/{many}")
    shown = page.locator("#row-ids").inner_text()
    listed = ", ".join(map(str, ids[: console_data.AUDIT_IDS_SHOWN]))
    assert shown == f"Row ids (1,200): {listed} … and 700 more"
    shot(page, "audit-entry-ids")
    page.goto(f"{world.url}/audit/{old}")
    assert "not recorded" in page.locator("#row-ids").inner_text()


def test_requeueing_a_selection_warns_when_an_earlier_dead_letter_of_its_key_stays(
    world: World, context: BrowserContext
) -> None:
    key = f"pair-{uuid.uuid4().hex[:6]}"
    topic = f"sel-{uuid.uuid4().hex[:6]}"
    world.accept_poison[0] = True
    older = dead_letter_directly(world.dsn, topic, key, b"older")
    newer = dead_letter_directly(world.dsn, topic, key, b"newer")
    page = log_in(context, world)
    page.goto(f"{world.url}/dead-letters?topic={topic}")
    page.check(f"input.pick[value='{newer}']")
    page.click("#selection button[value=requeue]")
    assert page.locator("h1").inner_text() == "Requeue 1 row?"
    page.click("#confirm")
    assert key in page.locator("#note").inner_text()
    assert (
        scalar(world.dsn, "SELECT count(*) FROM outbox_dead_letters WHERE id = %s", (older,)) == 1
    )
    page.goto(f"{world.url}/dead-letters?topic={topic}")
    page.check("#select-all")
    page.click("#selection button[value=requeue]")
    page.click("#confirm")
    assert page.locator("#done").inner_text() == "Requeued 1 row."
    wait_until(
        lambda: {d.body for d in world.receiver.acked() if d.key == key} >= {b"older", b"newer"},
        timeout=20,
        message="both rows of the key delivered",
    )


def test_a_viewer_may_look_but_not_change(world: World, context: BrowserContext) -> None:
    topic = f"view-{uuid.uuid4().hex[:6]}"
    row_id = dead_letter_directly(world.dsn, topic, "v", b"look")
    page = log_in(context, world, VIEWER_TOKEN)
    assert "read-only" in page.locator("header .who").inner_text()
    page.goto(f"{world.url}/dead-letters?topic={topic}")
    assert page.locator("#dead-letter-table tbody tr").count() == 1
    assert page.locator("input.pick, button[value=requeue], button[value=discard]").count() == 0
    page.goto(f"{world.url}/rows/{row_id}")
    assert page.locator("button[value=requeue]").count() == 0
    csrf = page.get_attribute("header input[name=csrf]", "value")
    refused = page.request.post(
        world.url + "/dead-letters/apply",
        form={"csrf": csrf or "", "action": "requeue", "confirmed": "1", "id": str(row_id)},
        headers={"Origin": world.url},
    )
    assert refused.status == 403 and "look, not change" in refused.text()
    assert scalar(world.dsn, "SELECT count(*) FROM outbox_dead_letters WHERE id = %s", (row_id,))


def test_a_proxys_user_header_logs_in_and_is_audited(world: World, browser: Browser) -> None:
    topic = f"proxy-{uuid.uuid4().hex[:6]}"
    row_id = dead_letter_directly(world.dsn, topic, "p", b"via proxy")
    context = browser.new_context(extra_http_headers={PROXY_HEADER: "alice@example.com"})
    try:
        page = context.new_page()
        page.goto(f"{world.url}/rows/{row_id}")
        assert "alice@example.com" in page.locator("header .who").inner_text()
        page.click("button[value=discard]")
        page.click("#confirm")
        assert page.locator("#done").inner_text() == "Discarded 1 row."
    finally:
        context.close()
    actor = scalar(world.dsn, "SELECT actor FROM console_audit WHERE first_id = %s", (row_id,))
    assert actor == "alice@example.com"


# --- blocked keys --------------------------------------------------------------------


def test_the_blocked_keys_page_shows_a_key_in_backoff(
    world: World, context: BrowserContext
) -> None:
    key = f"stuck-{uuid.uuid4().hex[:6]}"
    execute(
        world.dsn,
        "INSERT INTO outbox (topic, key, payload) VALUES ('orders', %s, 'a'), ('orders', %s, 'b')",
        (key, key),
    )
    wait_until(
        lambda: scalar(
            world.dsn, "SELECT attempts FROM outbox WHERE key = %s ORDER BY id LIMIT 1", (key,)
        ),
        timeout=20,
        message="the first row of the key failing",
    )
    page = log_in(context, world)
    page.click("text=Blocked keys")
    row = page.locator("#blocked-table tbody tr", has_text=key)
    text = row.inner_text()
    assert "downstream database is read-only" in text and "\t1\t" in text
    assert row.locator("td").nth(5).inner_text() == "1"  # its second row waits behind it
    shot(page, "blocked-keys")
    execute(world.dsn, "DELETE FROM outbox WHERE key = %s", (key,))


# --- review: limits, bad input, races, logout, throttling ---------------------------


def raw_post(
    world: World, path: str, body: bytes | Iterator[bytes], source: str = "127.0.0.1"
) -> tuple[int, str]:
    """One POST outside the browser, from a chosen loopback address (the throttle
    counts per address, so a test's wrong tokens do not lock the others out)."""
    port = int(world.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request(
            "POST",
            path,
            body=body,
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Origin": world.url,
            },
        )
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_a_body_over_the_limit_is_refused_before_any_route_reads_it(world: World) -> None:
    """Starlette reads a urlencoded form whole, unbounded: anyone who can reach /login
    could otherwise make the console hold any amount in memory."""
    big = b"token=" + b"a" * (300 * 1024)
    status, text = raw_post(world, "/login", big)
    assert status == 413, text
    # No declared length (chunked): counted as it arrives.
    status, text = raw_post(world, "/login", iter([big[:200_000], big[200_000:]]))
    assert status == 413, text
    assert http_get(world.url + "/healthz") == (200, "ok")


def test_bad_input_is_refused_as_such_never_a_server_error(
    world: World, context: BrowserContext
) -> None:
    page = log_in(context, world)
    page.goto(world.url + "/dead-letters")
    csrf = page.get_attribute("header input[name=csrf]", "value") or ""
    huge = "9" * 25
    for path, status in (
        ("/audit?before=abc", 400),
        (f"/audit?before={huge}", 400),
        (f"/rows/{huge}", 404),
        (f"/audit/{huge}", 404),
        ("/dead-letters?topic=%00", 400),
        (f"/dead-letters?after={huge}", 400),
        ("/dead-letters?since=yesterday", 400),
    ):
        assert page.request.get(world.url + path).status == status, path
    own = {"Origin": world.url}
    for path, form in (
        ("/dead-letters/confirm", {"action": "requeue", "id": huge}),
        ("/dead-letters/confirm", {"action": "requeue", "scope": "filter", "key": "a\0b"}),
        ("/dead-letters/apply", {"action": "requeue", "id": "1", "confirmed": "x"}),
        ("/dead-letters/apply", {"action": "requeue", "id": huge, "confirmed": "1"}),
        ("/dead-letters/apply", {"action": "requeue", "id": "1", "confirmed": "1"}),  # no digest
    ):
        done = page.request.post(world.url + path, form={**form, "csrf": csrf}, headers=own)
        assert done.status == 400, (path, form, done.text())


def test_a_change_by_filter_touches_the_rows_confirmed_not_just_as_many(
    world: World, context: BrowserContext
) -> None:
    """Between confirmation and change, one matching row is requeued elsewhere and
    another dead-lettered: the count holds, the rows do not; nothing is changed."""
    topic = f"swap-{uuid.uuid4().hex[:6]}"
    first, second = (dead_letter_directly(world.dsn, topic, f"k{n}", b"seen") for n in range(2))
    page = log_in(context, world)
    page.goto(f"{world.url}/dead-letters?topic={topic}")
    page.click("#by-filter button[value=discard]")
    assert page.locator("h1").inner_text() == "Discard 2 rows?"
    execute(world.dsn, "SELECT outbox_requeue(ARRAY[%s]::bigint[], NULL, false)", (second,))
    unseen = dead_letter_directly(world.dsn, topic, "k9", b"never shown")
    page.click("#confirm")
    assert "not the 2 confirmed" in page.locator(".error").inner_text()
    left = execute(
        world.dsn,
        "SELECT id FROM outbox_dead_letters WHERE topic = %s ORDER BY id",
        (topic,),
    )
    assert left == [(first,), (unseen,)]  # (the requeued one the relay delivers)
    execute(world.dsn, "DELETE FROM outbox_dead WHERE topic = %s", (topic,))


def test_a_session_cookie_is_refused_once_logged_out(
    world: World, context: BrowserContext, browser: Browser
) -> None:
    page = log_in(context, world)
    kept = context.cookies()
    page.click("header button[type=submit]")  # Log out
    page.wait_for_url(world.url + "/login")
    replay = browser.new_context()
    try:
        replay.add_cookies(kept)  # type: ignore[arg-type]
        again = replay.new_page()
        again.goto(world.url + "/")
        assert again.url.startswith(world.url + "/login")
    finally:
        replay.close()


def test_wrong_tokens_are_throttled_per_address(world: World, context: BrowserContext) -> None:
    source = "127.0.0.2"
    for _ in range(10):
        assert raw_post(world, "/login", b"token=guess-guess-guess-guess", source)[0] == 401
    status, text = raw_post(world, "/login", f"token={TOKEN}".encode(), source)
    assert status == 429 and "too many" in text  # the right token too, while refused
    log_in(context, world)  # another address is not refused


def test_a_slow_or_lost_database_answers_503_and_shows_nothing_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A statement timeout or a pool busy for 30 s is the database's state, not a bug
    of the console's (500): 503, and nothing of the SQL or the server in the page."""
    from starlette.testclient import TestClient

    from relay.console.app import Console
    from relay.console.settings import ConsoleSettings
    from relay.settings import CommonSettings

    console = Console(
        CommonSettings(database_url="postgresql://nobody@127.0.0.1:1/none"),
        ConsoleSettings(token=TOKEN, cookie_secure=False, allowed_hosts="testserver"),
    )
    client = TestClient(console.application(), base_url="http://testserver")
    own = {"Origin": "http://testserver"}
    login = client.post("/login", data={"token": TOKEN}, headers=own, follow_redirects=False)
    assert login.status_code == 303
    for failure in (
        TimeoutError("every console database session is busy"),
        psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
    ):

        async def failing(_work: Any, failure: Exception = failure) -> Any:
            raise failure

        monkeypatch.setattr(console, "db", failing)
        page = client.get("/dead-letters")
        assert page.status_code == 503, page.text
        assert "statement" not in page.text and "session" not in page.text


def test_the_console_caps_its_sessions_statement_timeout(world: World) -> None:
    """RELAY_DATABASE_STATEMENT_TIMEOUT_SECONDS=0 (no timeout) would let a slow query hold
    one of the console's few sessions for ever: the console's own ceiling holds."""
    from relay.console.app import Console
    from relay.console.pool import Pool
    from relay.console.settings import ConsoleSettings
    from relay.settings import CommonSettings

    unbounded = CommonSettings(database_url=world.console_dsn, database_statement_timeout_seconds=0)
    pool = Pool(unbounded, 1, statement_timeout=0.2)
    try:
        with pool.connection() as conn:
            assert conn.execute("SHOW statement_timeout").fetchone() == {
                "statement_timeout": "200ms"
            }
        with pytest.raises(psycopg.errors.QueryCanceled), pool.connection() as conn:
            conn.execute("SELECT pg_sleep(5)")
    finally:
        pool.close()
    lower = unbounded.model_copy(update={"database_statement_timeout_seconds": 0.1})
    pool = Pool(lower, 1, statement_timeout=0.2)
    try:
        with pool.connection() as conn:  # a lower database setting stays
            assert conn.execute("SHOW statement_timeout").fetchone() == {
                "statement_timeout": "100ms"
            }
    finally:
        pool.close()
    console = Console(unbounded, ConsoleSettings(token=TOKEN))  # the rate sampler's too
    assert console.rate.settings.database_statement_timeout_seconds == 5.0


# --- settings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"RELAY_CONSOLE_TOKEN": TOKEN, "RELAY_CONSOLE_PORT": "http"}, "RELAY_CONSOLE_PORT"),
        ({}, "RELAY_CONSOLE_TOKEN"),
        ({"RELAY_CONSOLE_TOKEN": "short"}, "RELAY_CONSOLE_TOKEN"),
        ({"RELAY_CONSOLE_TOKN": TOKEN}, "did you mean RELAY_CONSOLE_TOKEN"),
        (
            {"RELAY_CONSOLE_TOKEN": TOKEN, "RELAY_CONSOLE_TRUSTED_PROXIES": "nope"},
            "RELAY_CONSOLE_TRUSTED_PROXIES",
        ),
        (
            {"RELAY_CONSOLE_TOKEN": TOKEN, "RELAY_CONSOLE_ALLOWED_HOSTS": "https://x.example/"},
            "RELAY_CONSOLE_ALLOWED_HOSTS: 'https://x.example/' is not a host name",
        ),
        (
            {"RELAY_CONSOLE_TOKEN": TOKEN, "RELAY_CONSOLE_ALLOWED_HOSTS": "*,localhost"},
            "RELAY_CONSOLE_ALLOWED_HOSTS: '*' (any host) stands alone",
        ),
        (
            {"RELAY_CONSOLE_TOKEN": TOKEN, "RELAY_CONSOLE_PAGE_SIZE": "10"},
            "RELAY_CONSOLE_PAGE_SIZE: was renamed or removed in 1.0",
        ),
    ],
)
def test_a_bad_setting_stops_the_console_naming_it(
    world: World, variables: dict[str, str], named: str
) -> None:
    done = subprocess.run(
        relay_command("console"),
        env=relay_env(world.console_dsn, **variables),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert named in done.stderr
    assert TOKEN not in done.stderr
