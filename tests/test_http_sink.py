"""The HTTP sink against a real HTTP/1.1 server on loopback: order, concurrency, retries,
dead-letters, signing, outages and a relay killed mid-delivery."""

from __future__ import annotations

import base64
import itertools
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from standardwebhooks.webhooks import Webhook

from relay.message import MalformedRow, OutboxMessage
from relay.settings import Settings
from relay.sinks.base import Outcome
from relay.sinks.http.sink import RequestBuilder, classify_response, parse_retry_after, sign
from tests.conftest import SettingsFactory, relay_command, relay_env, start_relay
from tests.harness import free_port
from tests.harness.webhook import Delivery, Reply, WebhookServer
from tests.support import insert_rows, keyed_rows, running_relay, scalar, unsent_count, wait_until

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
TOPIC = "orders"


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    with WebhookServer() as srv:
        yield srv


def http_settings(make_settings: SettingsFactory, url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "sink": "http",
        "http_url": url + "/hooks/{topic}",
        "sink_max_in_flight": 8,
        "sink_timeout_seconds": 5.0,
    }
    values.update(overrides)
    return make_settings(**values)


def rows_of(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def first_acks_in_order(deliveries: Sequence[Delivery]) -> dict[str, list[int]]:
    """Per key, the steps (payload `k:i`) of each message's first 2xx, in answer order."""
    seen: set[str] = set()
    by_key: dict[str, list[int]] = defaultdict(list)
    for d in deliveries:
        if d.ok and d.message_id not in seen:
            seen.add(d.message_id)
            key, step = d.body.decode().split(":")
            assert d.key == key
            by_key[key].append(int(step))
    return by_key


def assert_in_order(deliveries: Sequence[Delivery], keys: int, per_key: int) -> None:
    by_key = first_acks_in_order(deliveries)
    assert len(by_key) == keys
    for key, steps in by_key.items():
        assert steps == list(range(per_key)), f"key {key}: {steps}"


def overlapping(a: Delivery, b: Delivery) -> bool:
    return a.started < b.ended and b.started < a.ended


# --- pure parts -----------------------------------------------------------------


def message(**fields: Any) -> OutboxMessage:
    values: dict[str, Any] = {
        "id": 1,
        "message_id": str(uuid.uuid4()),
        "topic": TOPIC,
        "key": "k1",
        "payload": b'{"a": 1}',
        "headers": None,
        "unsendable": None,
        "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "due_epoch": time.time(),
        "attempts": 0,
    }
    values.update(fields)
    if isinstance(values["headers"], dict):  # as the fetch query hands them over: text pairs
        values["headers"] = [[name, value] for name, value in values["headers"].items()]
    return OutboxMessage(**values)


@pytest.mark.unit
def test_classification() -> None:
    assert classify_response(204, None, b"", 300).outcome is Outcome.ACKED
    for status in (408, 425, 429, 500, 501):
        assert classify_response(status, None, b"", 300).outcome is Outcome.RETRY
    for status in (502, 503, 504):
        assert classify_response(status, None, b"", 300).outcome is Outcome.UNAVAILABLE
    dead = classify_response(400, None, b"bad field\n" + b"x" * 5000, 300)
    assert dead.outcome is Outcome.DEAD
    assert dead.error is not None
    assert dead.error.startswith("HTTP 400: bad field")
    assert len(dead.error) < 300
    assert classify_response(301, None, b"", 300).outcome is Outcome.DEAD
    assert classify_response(429, "7", b"", 300).retry_after == 7
    # With a Retry-After, a 429 or 503 pauses the endpoint's origin: no attempt spent.
    assert classify_response(429, "7", b"", 300).collateral
    assert classify_response(503, "7", b"", 300).collateral
    assert not classify_response(429, None, b"", 300).collateral
    assert not classify_response(429, "0", b"", 300).collateral  # asks for no pause
    assert not classify_response(500, "7", b"", 300).collateral
    # RELAY_HTTP_RETRY_STATUSES: a 401 during a token rotation is worth retrying.
    assert classify_response(401, None, b"", 300, frozenset({401})).outcome is Outcome.RETRY
    assert classify_response(403, None, b"", 300, frozenset({401})).outcome is Outcome.DEAD


@pytest.mark.unit
def test_retry_after_forms() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("120", 300, now) == 120
    assert parse_retry_after(" 0 ", 300, now) == 0
    http_date = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(http_date, 300, now) == 30
    assert parse_retry_after("99999", 300, now) == 300  # capped by RELAY_RETRY_MAX_SECONDS
    assert parse_retry_after(format_datetime(now - timedelta(hours=1), usegmt=True), 300, now) == 0
    assert parse_retry_after("soon", 300, now) is None
    assert parse_retry_after("\u00b2", 300, now) is None  # isdigit() but not a number
    assert parse_retry_after("-5", 300, now) is None
    # Only retryable answers read it: a 400 stays permanent whatever it says.
    assert classify_response(400, "\u00b2", b"", 300).outcome is Outcome.DEAD
    assert parse_retry_after(None, 300, now) is None


def test_request_headers_and_signature(make_settings: SettingsFactory) -> None:
    settings = http_settings(
        make_settings,
        "https://hooks.example",
        http_signing_secret=SECRET,
        http_forward_headers="traceparent, content-type",
        http_topic_urls={
            "special": {"url": "https://special.example/in", "share_credentials": True}
        },
    )
    builder = RequestBuilder(settings)
    msg = message(
        headers={"traceparent": "00-abc-def-01", "x-secret-internal": "no", "content-type": "a/b"},
        key="k/1 ü",
    )
    request = builder.build(msg, timestamp=1_700_000_000)
    headers = dict(request.headers)
    assert request.url == "https://hooks.example/hooks/orders"
    assert headers["message-id"] == str(msg.message_id).encode()
    assert headers["content-type"] == b"a/b"
    assert headers["traceparent"] == b"00-abc-def-01"
    assert "x-secret-internal" not in headers
    assert headers["message-key"] == b"k%2F1%20%C3%BC"
    assert headers["webhook-id"] == str(msg.message_id).encode()
    assert headers["webhook-signature"].decode() == sign(
        base64.b64decode(SECRET.removeprefix("whsec_")),
        str(msg.message_id),
        1_700_000_000,
        request.body,
    )
    # An independent implementation of the Standard Webhooks spec accepts a fresh one.
    fresh = builder.build(msg)
    headers_text = {name: value.decode() for name, value in fresh.headers}
    Webhook(SECRET).verify(fresh.body, headers_text, json_parse=False)
    special = builder.build(message(topic="special"))
    assert special.url == "https://special.example/in"
    assert "webhook-signature" in dict(special.headers)  # another origin, opted in
    # A row can neither replace the relay's credentials nor smuggle a bad header.
    everything = RequestBuilder(
        http_settings(make_settings, "https://h", http_auth_header="Authorization: Bearer real")
    )
    forged = everything.build(
        message(headers={"Authorization": "Bearer forged", "User-Agent": "x"})
    ).headers
    # The relay's own header, once: the builder adds each destination's credentials.
    assert [v for n, v in forged if n.lower() == "authorization"] == [b"Bearer real"]
    assert "User-Agent" not in dict(forged)
    for bad in ({"café": "x"}, {"x-a": "ab "}, {"x-a": "a\r\nInjected: 1"}, {"x a": "1"}):
        with pytest.raises(MalformedRow):
            everything.build(message(headers=bad))
    plain = dict(builder.build(message(headers=None)).headers)
    assert plain["content-type"] == b"application/octet-stream"


def test_settings_reject_bad_http_values(make_settings: SettingsFactory) -> None:
    from relay.settings import SettingsError, load_settings

    base = {"database_url": "postgresql://h/db", "sink": "http"}
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **base)
    assert err.value.name == "RELAY_HTTP_URL"
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **base, http_url="ftp://x")
    assert err.value.name == "RELAY_HTTP_URL"
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **base, http_url="http://x", http_signing_secret="whsec_!!notb64")
    assert err.value.name == "RELAY_HTTP_SIGNING_SECRET"
    assert "notb64" not in str(err.value)
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **base, http_topic_urls={"a": "nope"})
    assert err.value.name == "RELAY_HTTP_TOPIC_URLS"
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **base, http_url="http://h", http_retry_statuses="401,500")
    assert err.value.name == "RELAY_HTTP_RETRY_STATUSES"
    assert load_settings(
        Settings, **base, http_url="http://h", http_retry_statuses=" 401, 404 "
    ).http_retry_status_codes == {401, 404}
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **base, http_url="http://h:99999/x")
    assert err.value.name == "RELAY_HTTP_URL"
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **base, http_url="http://{topic}.h/x")
    assert err.value.name == "RELAY_HTTP_URL"
    # `echo token > file` leaves a newline: stripped. An inner one is refused, unquoted.
    # (https: an auth header over http:// to a remote host needs an opt-in.)
    ok = load_settings(Settings, **base, http_url="https://h", http_auth_header="X-Key: t\n")
    assert ok.http_auth_header is not None
    assert ok.http_auth_header.get_secret_value() == "X-Key: t"
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **base, http_url="https://h", http_auth_header="X-Key: hun\nter2")
    assert err.value.name == "RELAY_HTTP_AUTH_HEADER"
    assert "hun" not in str(err.value)


# --- against a real server ---------------------------------------------------------


def test_per_key_order_with_concurrency_across_keys(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    server.respond = lambda d: Reply(204, delay=0.01)
    keys, per_key = 8, 12
    insert_rows(database, TOPIC, keyed_rows(keys, per_key), headers={"traceparent": "t-1"})
    settings = http_settings(
        make_settings, server.url, batch_size=50, http_auth_header="Authorization: Bearer t0ken"
    )
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    history = server.history()
    assert all(d.headers["authorization"] == "Bearer t0ken" for d in history)
    assert all(d.headers["accept-encoding"] == "identity" for d in history)
    assert len(server.acked_ids()) == keys * per_key
    assert_in_order(history, keys, per_key)
    assert all(d.path == "/hooks/orders" for d in history)
    assert all(d.headers["traceparent"] == "t-1" for d in history)
    # Different keys were in flight together; one key never was.
    by_key: dict[str | None, list[Delivery]] = defaultdict(list)
    for d in history:
        by_key[d.key].append(d)
    for key, ds in by_key.items():
        for a, b in itertools.pairwise(ds):
            assert not overlapping(a, b), f"key {key} had two requests in flight"
    assert server.max_in_flight > 1
    assert server.max_in_flight <= 8


def test_transient_failures_retried_with_one_webhook_id_and_valid_signatures(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    def respond(d: Delivery) -> Reply:
        key, step = d.body.decode().split(":")
        if key == "k0" and step == "1" and d.attempt <= 2:
            return Reply(500, body=b"database hiccup")
        if key == "k1" and step == "0" and d.attempt == 1:
            return Reply(200, delay=3.0)  # past the sink timeout: the relay gives up
        return Reply(200)

    server.respond = respond
    insert_rows(database, TOPIC, keyed_rows(3, 4))
    settings = http_settings(
        make_settings, server.url, http_signing_secret=SECRET, sink_timeout_seconds=1.5
    )
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    history = server.history()
    assert_in_order(history, 3, 4)
    verifier = Webhook(SECRET)
    attempts: dict[str, set[str]] = defaultdict(set)
    for d in history:
        verifier.verify(d.body, d.headers, json_parse=False)  # raises on a bad signature
        attempts[d.message_id].add(d.headers["webhook-id"])
        assert d.headers["webhook-id"] == d.message_id
    retried = [d for d in history if d.attempt > 1]
    assert {d.body for d in retried} == {b"k0:1", b"k1:0"}
    assert all(len(ids) == 1 for ids in attempts.values())
    assert max(d.attempt for d in history if d.body == b"k0:1") == 3


def test_retry_after_pauses_the_endpoint_as_a_whole_and_spends_no_attempt(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    """A 429 with Retry-After speaks for the endpoint, not the row: no request goes
    there until it is over (before: only that row waited, spending an attempt, and
    the other keys' rows kept coming)."""

    def respond(d: Delivery) -> Reply:
        if d.body == b"k0:0" and d.attempt == 1:
            return Reply(429, headers={"Retry-After": "2"})
        return Reply(200, delay=0.05)

    server.respond = respond
    insert_rows(database, TOPIC, keyed_rows(4, 3))
    settings = http_settings(
        make_settings, server.url, retry_max_seconds=10.0, retention_seconds=3600.0
    )
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    tries = [d for d in server.history() if d.body == b"k0:0"]
    assert [d.status for d in tries] == [429, 200]
    gap = tries[1].started - tries[0].ended
    assert gap >= 1.9, f"retried {gap:.2f}s after a Retry-After of 2s"
    # Requests already on their way may land; after them, none until the pause is over.
    during = [
        d.body for d in server.history() if tries[0].ended + 0.1 < d.started < tries[0].ended + 1.9
    ]
    assert during == []
    assert_in_order(server.history(), 4, 3)
    assert scalar(database, "SELECT max(attempts) FROM outbox_sent") == 0


def test_permanent_4xx_dead_lettered_while_other_keys_flow(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    def respond(d: Delivery) -> Reply:
        if d.body == b"k0:1":
            return Reply(422, body=b'{"error": "amount must be positive"}')
        return Reply(200)

    server.respond = respond
    ids = insert_rows(database, TOPIC, keyed_rows(3, 3))
    with running_relay(http_settings(make_settings, server.url)):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    reason = scalar(
        database,
        "SELECT dead_letter_reason FROM outbox_dead_letters WHERE id = %s",
        (ids[3],),  # k0:1
    )
    assert reason.startswith("HTTP 422")
    assert "amount must be positive" in reason
    assert len([d for d in server.history() if d.body == b"k0:1"]) == 1  # never retried
    # The key goes on after its dead-lettered row, in order; the others never stopped.
    acked = first_acks_in_order(server.history())
    assert acked == {"k0": [0, 2], "k1": [0, 1, 2], "k2": [0, 1, 2]}


def test_endpoint_down_then_up_loses_nothing_and_spends_no_attempts(
    make_settings: SettingsFactory, database: str
) -> None:
    server = WebhookServer()  # not started: connections are refused
    insert_rows(database, TOPIC, keyed_rows(4, 5))
    settings = http_settings(make_settings, server.url)
    with running_relay(settings):
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM leases WHERE holder IS NOT NULL"),
            10,
            message="a lease holder",
        )
        refused = _http_requests("connect_error")
        wait_until(
            lambda: _http_requests("connect_error") >= refused + 3,
            10,
            message="the relay tried the dead endpoint a few times",
        )
        assert unsent_count(database) == 20
        assert scalar(database, "SELECT max(attempts) FROM outbox") == 0
        with server:
            wait_until(lambda: unsent_count(database) == 0, 30, message="drained once up")
            assert_in_order(server.history(), 4, 5)


def test_a_dead_endpoint_blocks_only_its_own_topic(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    dead_url = f"http://127.0.0.1:{free_port()}/never"
    # Keys are per outbox, not per topic: the payments rows get keys of their own.
    # Its backlog fills whole batches (batch 4, 12 rows), ahead of the healthy topic's.
    insert_rows(
        database, "payments", [(f"p{n % 6}", f"p{n % 6}:{n // 6}".encode()) for n in range(12)]
    )
    insert_rows(database, TOPIC, keyed_rows(3, 4))
    settings = http_settings(
        make_settings,
        server.url,
        http_topic_urls={"payments": dead_url},
        max_attempts=100,
        batch_size=4,
    )
    with running_relay(settings):
        wait_until(lambda: len(server.acked_ids()) == 12, 30, message="the healthy topic delivered")
        wait_until(
            lambda: scalar(database, "SELECT attempts FROM outbox WHERE payload = 'p0:0'") >= 2,
            30,
            message="the dead endpoint's rows back off per row",
        )
    assert_in_order(server.history(), 3, 4)
    assert scalar(database, "SELECT count(*) FROM outbox WHERE topic = 'payments'") == 12


def test_null_keys_are_all_delivered_in_parallel(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    server.respond = lambda d: Reply(200, delay=0.05)
    insert_rows(database, TOPIC, [(None, f"none:{n}".encode()) for n in range(16)])
    with running_relay(http_settings(make_settings, server.url)):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    assert sorted(d.body for d in server.acked()) == sorted(f"none:{n}".encode() for n in range(16))
    assert all("message-key" not in d.headers for d in server.acked())
    assert server.max_in_flight > 1


def test_single_endpoint_503_pauses_the_sink_for_its_retry_after_without_attempts(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    def respond(d: Delivery) -> Reply:
        if d.attempt == 1 and d.body == b"k0:0":
            return Reply(503, headers={"Retry-After": "2"}, body=b"deploying")
        return Reply(200)

    server.respond = respond
    (row_id,) = insert_rows(database, TOPIC, [("k0", b"k0:0")])
    settings = http_settings(
        make_settings, server.url, retry_max_seconds=10.0, retention_seconds=3600.0
    )
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    tries = [d for d in server.history() if d.body == b"k0:0"]
    assert [d.status for d in tries] == [503, 200]
    assert tries[1].started - tries[0].ended >= 1.9
    # Kept (retention mode) so we can see: the outage spent no attempt.
    assert scalar(database, "SELECT attempts FROM outbox_sent WHERE id = %s", (row_id,)) == 0


def _http_requests(status: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("relay_http_requests_total", {"status": status})
    return value or 0.0


@pytest.mark.slow
def test_killed_mid_delivery_duplicates_only_in_flight(
    database: str, relay_dsn: str, server: WebhookServer, tmp_path: Path
) -> None:
    server.respond = lambda d: Reply(200, delay=0.05)
    keys, per_key, batch = 10, 30, 40
    insert_rows(database, TOPIC, keyed_rows(keys, per_key))
    env = relay_env(
        relay_dsn,
        RELAY_SINK="http",
        RELAY_HTTP_URL=server.url + "/hooks/{topic}",
        RELAY_SINK_MAX_IN_FLIGHT="8",
        RELAY_BATCH_SIZE=str(batch),
        RELAY_LEASE_TTL_SECONDS="2",
    )
    first = start_relay(env, tmp_path / "relay-1.log")
    try:
        wait_until(lambda: len(server.acked()) >= 60, 30, message="delivery under way")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        unsettled = {bytes(row[0]) for row in rows_of(database, "SELECT payload FROM outbox")}
        # The kill landed mid-drain: some rows settled before it, some still unsent.
        assert 0 < len(unsettled) < keys * per_key, f"{len(unsettled)} unsent at the kill"
        second = start_relay(env, tmp_path / "relay-2.log")
        try:
            wait_until(lambda: unsent_count(database) == 0, 60, message="drained after restart")
        finally:
            second.terminate()
            second.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    history = server.acked()
    assert len({d.message_id for d in history}) == keys * per_key
    assert_in_order(history, keys, per_key)
    first_seen: dict[str, Delivery] = {}
    duplicates: list[Delivery] = []
    for d in history:
        if d.message_id in first_seen:
            duplicates.append(d)
        else:
            first_seen[d.message_id] = d
    # Only rows in flight at the kill come twice: delivered, but not yet settled in the
    # database. The drain pipelines: at most the batch being published plus the one
    # still being settled. A settled row is never sent again.
    assert len(duplicates) <= 2 * batch
    assert {d.body for d in duplicates} <= unsettled


def test_check_reaches_the_endpoint_and_keeps_secrets(
    relay_dsn: str, server: WebhookServer
) -> None:
    env = relay_env(
        relay_dsn,
        RELAY_SINK="http",
        RELAY_HTTP_URL=server.url + "/hooks/{topic}",
        RELAY_HTTP_SIGNING_SECRET=SECRET,
        RELAY_HTTP_AUTH_HEADER="Authorization: Bearer top-secret-token",
    )
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"http: reachable http://127.0.0.1:{server.port}".encode() in output
    server.stop()
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1
    assert b"sink: FAILED" in output
    for secret in (b"top-secret-token", SECRET.encode(), b"relay-secret-pw"):
        assert secret not in output


def test_abandon_mid_batch_returns_at_once_and_acks_nothing_unanswered(
    make_settings: SettingsFactory, server: WebhookServer
) -> None:
    from relay.sinks.http.sink import HttpSink

    server.respond = lambda d: Reply(200, delay=0.05 if d.key == "fast" else 3.0)
    sink = HttpSink(http_settings(make_settings, server.url))
    try:
        batch = [message(id=1, key="fast"), message(id=2, key="slow"), message(id=3, key="slow")]
        started = time.monotonic()
        results = sink.publish(batch, lambda: time.monotonic() - started > 0.5)
        returned = time.monotonic()
    finally:
        sink.close()
    # It returned without waiting for the slow answer: the endpoint wrote it later.
    slow = wait_until(
        lambda: [d for d in server.history() if d.key == "slow"],
        timeout=10,
        message="the slow request answered",
    )
    assert [d.ended > returned for d in slow] == [True]
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.SKIPPED, Outcome.SKIPPED]
    with pytest.raises(RuntimeError):
        sink.publish(batch, lambda: False)


def test_an_endpoint_that_never_answers_holds_a_batch_for_about_two_timeouts(
    make_settings: SettingsFactory, server: WebhookServer
) -> None:
    """30 keys, 2 requests in flight, an endpoint that takes connections and never
    answers. Before: chains waiting for a slot started when it freed, one timeout per
    round of slots (15 s); now the batch ends within about two timeouts, the rows that
    never started stay untouched (SKIPPED, no attempt)."""
    from relay.sinks.http.sink import HttpSink

    server.respond = lambda d: Reply(200, delay=30.0)
    timeout = 1.0
    settings = http_settings(
        make_settings,
        server.url,
        sink_max_in_flight=2,
        sink_timeout_seconds=timeout,
    )
    sink = HttpSink(settings)
    try:
        batch = [message(id=n, key=f"k{n}") for n in range(30)]
        results = sink.publish(batch, lambda: False)
    finally:
        sink.close()
    # Two rounds of its two slots at most, not a round per slot's worth of keys: the
    # endpoint saw no more requests than that, and the rest never started.
    assert len(server.history()) <= 4
    outcomes = [r.outcome for r in results]
    assert outcomes.count(Outcome.RETRY) <= 4  # the requests that started: timed out
    assert outcomes.count(Outcome.SKIPPED) >= 26  # never started: no attempt spent


def test_a_hot_key_backlog_does_not_hold_back_keys_committed_after_it(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    """A key's rows go one request at a time; 5,000 of one key in front of a 20 ms
    endpoint are minutes of work. Rows of 50 other keys committed meanwhile arrive
    while the hot key sends fewer than one batch (before: only after whole 500-row
    batches of the hot key)."""
    server.respond = lambda d: Reply(204, delay=0.02)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %s, 'H', convert_to('H:' || g, 'UTF8') FROM generate_series(0, 4999) g",
            (TOPIC,),
        )
    settings = http_settings(make_settings, server.url, batch_size=500)
    with running_relay(settings):
        wait_until(server.acked, 30, message="the hot key flowing")
        hot_before = sum(1 for d in server.acked() if d.key == "H")
        insert_rows(database, TOPIC, keyed_rows(50, 5))
        wait_until(
            lambda: sum(1 for d in server.acked() if d.key != "H") >= 250,
            30.0,
            message="the other keys' 250 rows delivered",
        )
        hot_then = sum(1 for d in server.acked() if d.key == "H")
    assert_in_order([d for d in server.history() if d.key != "H"], 50, 5)
    hot = [d.body for d in server.acked() if d.key == "H"]
    assert hot == [f"H:{i}".encode() for i in range(len(hot))]
    # They did not wait behind the hot key's batches: fewer than one of its 500-row
    # batches went meanwhile (before, they came after whole such batches).
    went = hot_then - hot_before
    assert went < 500, f"{went} of the hot key's rows went before the other keys' 250"
