"""What a row or a setting can make the HTTP sink send, and where: a topic stays one path
segment, credentials go to the destinations they were given for, and credentials over
plaintext need an opt-in. Against real receivers on loopback where a request is sent."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import psycopg
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from relay.message import MalformedRow
from relay.settings import (
    SECRET_FIELDS,
    Settings,
    SettingsError,
    is_setting_variable,
    load_settings,
)
from relay.sinks.http import sink as http
from relay.sinks.http.sink import RequestBuilder, UrlTemplate
from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness.webhook import Delivery, WebhookServer
from tests.support import insert_rows, running_relay, unsent_count, wait_until
from tests.test_http_sink import SECRET, http_settings, message

OTHER_SECRET = "whsec_" + base64.b64encode(b"another key, for another origin!").decode()
BASE = {"database_url": "postgresql://h/db", "sink": "http"}


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    with WebhookServer() as srv:
        yield srv


@pytest.fixture
def elsewhere() -> Iterator[WebhookServer]:
    """A second receiver: another port, so another origin."""
    with WebhookServer() as srv:
        yield srv


def dead_letters(dsn: str) -> dict[str, str]:
    """Dead-lettered rows' reasons by topic."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT topic, dead_letter_reason FROM outbox_dead_letters").fetchall()
    return {topic: reason for topic, reason in rows}


def signed_with(secret: str, delivery: Delivery) -> bool:
    try:
        Webhook(secret).verify(delivery.body, delivery.headers, json_parse=False)
    except WebhookVerificationError:
        return False
    return True


def by_path(receiver: WebhookServer) -> dict[str, Delivery]:
    return {d.path: d for d in receiver.acked()}


# --- a topic is one path segment ----------------------------------------------------


@pytest.mark.unit
def test_a_topic_fills_one_path_segment_and_no_other() -> None:
    hooks = UrlTemplate("https://h.example/tenant/hooks/{topic}")
    assert hooks.fill("orders") == "https://h.example/tenant/hooks/orders"
    assert hooks.fill("a/b?c#d") == "https://h.example/tenant/hooks/a%2Fb%3Fc%23d"
    assert hooks.fill("...") == "https://h.example/tenant/hooks/..."
    assert hooks.fill("a%2fb") == "https://h.example/tenant/hooks/a%252fb"
    for topic in ("..", ".", ""):
        with pytest.raises(MalformedRow) as err:
            hooks.fill(topic)
        assert str(err.value) == (
            f"topic {topic!r} cannot go in the URL path: it would make an empty, '.' or '..'"
            " segment, which changes the path"
        )
    # Part of a segment: the segment stays one whatever the topic.
    suffixed = UrlTemplate("https://h.example/hooks/{topic}.json")
    assert suffixed.fill("..") == "https://h.example/hooks/...json"
    assert suffixed.fill("") == "https://h.example/hooks/.json"
    # A segment that decodes to a dot segment is one too.
    with pytest.raises(MalformedRow):
        UrlTemplate("https://h.example/hooks/{topic}%2E").fill(".")
    # In the query a topic changes no path.
    query = UrlTemplate("https://h.example/in?topic={topic}")
    assert query.fill("..") == "https://h.example/in?topic=.."
    assert query.fill("") == "https://h.example/in?topic="
    assert query.fill("a&b=c") == "https://h.example/in?topic=a%26b%3Dc"
    long = "x" * 500 + "/..."
    assert UrlTemplate("https://h.example/{topic}").fill(long).endswith("x%2F...")
    with pytest.raises(MalformedRow, match="the URL for this topic is invalid"):
        UrlTemplate("https://h.example/{topic}").fill("x" * 70_000)  # the client refuses it


@pytest.mark.unit
@pytest.mark.parametrize(
    "topic", ["./..", "a/../..", "..\\x", "x/.", "%2e%2e", "a%2F..%2F..", "%2e%2e%2f"]
)
def test_a_topic_that_decodes_to_a_dot_segment_is_refused(topic: str) -> None:
    """Before: `./..` reached a receiver as /hooks/.%2F..; once a receiver or a proxy
    decodes %2F (many do, some twice), that is a dot segment that climbs out of the
    configured path."""
    with pytest.raises(MalformedRow) as err:
        UrlTemplate("https://h.example/tenant/hooks/{topic}").fill(topic)
    assert "holds a '.' or '..' segment" in str(err.value)


@pytest.mark.unit
def test_a_path_the_client_would_send_otherwise_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last check: what the client would send, compared with the configured path
    around the topic (a client that resolved more than dot segments, say)."""
    hooks = UrlTemplate("https://h.example/hooks/{topic}")
    monkeypatch.setattr(http, "_sent_path", lambda url: "/elsewhere")
    with pytest.raises(MalformedRow) as err:
        hooks.fill("orders")
    assert str(err.value) == "topic 'orders' would change the URL path sent"


def test_dot_topics_are_dead_lettered_and_reach_no_other_path(
    make_settings: SettingsFactory, database: str, server: WebhookServer
) -> None:
    """Before: `..` went to /tenant/ and `.` to /tenant/hooks (the client resolves dot
    segments), both acknowledged there."""
    climbing = ("./..", "a/../..")  # dot segments once a receiver decodes %2F
    for topic in ("..", ".", "", *climbing):
        insert_rows(database, topic, [(None, b"bad")])
    insert_rows(database, "orders", [(None, b"good")])
    settings = http_settings(
        make_settings, server.url, http_url=server.url + "/tenant/hooks/{topic}"
    )
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox settled")
    reasons = dead_letters(database)
    assert set(reasons) == {"..", ".", "", *climbing}
    for topic, reason in reasons.items():
        assert reason.startswith(f"topic {topic!r} cannot go in the URL path"), reason
    # The receiver decodes %2F before it routes: still nothing outside /tenant/hooks/.
    routed = [(unquote(d.path), d.body) for d in server.history()]
    assert routed == [("/tenant/hooks/orders", b"good")]


# --- credentials per destination ----------------------------------------------------


def test_credentials_stay_with_the_origin_they_were_given_for(
    make_settings: SettingsFactory, database: str, server: WebhookServer, elsewhere: WebhookServer
) -> None:
    """Before: the auth header and the signing key went to every topic URL's origin."""
    for topic in ("orders", "same", "plain"):
        insert_rows(database, topic, [(None, topic.encode())])
    settings = http_settings(
        make_settings,
        server.url,
        http_auth_header="Authorization: Bearer home-token",
        http_signing_secret=SECRET,
        http_topic_urls={"same": server.url + "/same", "plain": elsewhere.url + "/plain"},
    )
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    home = by_path(server)
    assert set(home) == {"/hooks/orders", "/same"}
    for delivery in home.values():
        assert delivery.headers["authorization"] == "Bearer home-token"
        assert signed_with(SECRET, delivery)
    plain = by_path(elsewhere)["/plain"]
    assert "authorization" not in plain.headers
    assert not {"webhook-id", "webhook-timestamp", "webhook-signature"} & set(plain.headers)


def test_another_origin_shares_credentials_only_when_told_or_has_its_own(
    make_settings: SettingsFactory, database: str, server: WebhookServer, elsewhere: WebhookServer
) -> None:
    for topic in ("shared", "own"):
        insert_rows(database, topic, [(None, topic.encode())])
    settings = http_settings(
        make_settings,
        server.url,
        http_auth_header="Authorization: Bearer home-token",
        http_signing_secret=SECRET,
        http_topic_urls={
            "shared": {"url": elsewhere.url + "/shared", "share_credentials": True},
            "own": {
                "url": elsewhere.url + "/own",
                "auth_header_name": "X-Api-Key",
                "auth_header_value": "own-key",
                "signing_secret": OTHER_SECRET,
            },
        },
    )
    with running_relay(settings):
        wait_until(lambda: unsent_count(database) == 0, 30, message="outbox drained")
    received = by_path(elsewhere)
    shared, own = received["/shared"], received["/own"]
    assert shared.headers["authorization"] == "Bearer home-token"
    assert signed_with(SECRET, shared)
    assert own.headers["x-api-key"] == "own-key"
    assert "authorization" not in own.headers
    assert signed_with(OTHER_SECRET, own)
    assert not signed_with(SECRET, own)
    assert server.history() == []


def test_destinations_and_their_credentials(make_settings: SettingsFactory) -> None:
    settings = http_settings(
        make_settings,
        "https://hooks.example",
        http_auth_header="Authorization: Bearer home",
        http_signing_secret=SECRET,
        http_topic_urls={
            "explicit-port": "https://HOOKS.example:443/x",  # the same origin
            "other-port": "https://hooks.example:8443/x",
            "other-scheme": "http://hooks.example/x",
            "own": {
                "url": "https://o.example/x",
                "auth_header_name": "X-Key",
                "auth_header_value": "k",
            },
        },
    )
    builder = RequestBuilder(settings)

    def sent(topic: str) -> dict[str, bytes]:
        return dict(builder.build(message(topic=topic)).headers)

    assert sent("orders")["Authorization"] == b"Bearer home"
    assert sent("explicit-port")["Authorization"] == b"Bearer home"
    assert "webhook-signature" in sent("explicit-port")
    for topic in ("other-port", "other-scheme"):
        assert "Authorization" not in sent(topic)
        assert "webhook-signature" not in sent(topic)
    assert sent("own")["X-Key"] == b"k"
    assert "Authorization" not in sent("own")
    # A row cannot set any destination's auth header, wherever it goes.
    forged = dict(builder.build(message(headers={"x-key": "forged"})).headers)
    assert "x-key" not in forged
    assert "Bearer home" not in repr(builder.build(message()))


@pytest.mark.unit
def test_the_auth_header_is_a_name_a_colon_and_a_value() -> None:
    """RELAY_HTTP_AUTH_HEADER is one secret, `Name: value` (RELAY_HTTP_AUTH_HEADER_NAME and
    _VALUE before); whitespace around the value and a file's newline are dropped."""
    for given, name, value in [
        ("Authorization: Bearer hunter2", "Authorization", "Bearer hunter2"),
        ("X-Api-Key:hunter2", "X-Api-Key", "hunter2"),
        ("X-Api-Key: \t hunter2 \n", "X-Api-Key", "hunter2"),
        ("Authorization: Basic dXNlcjpwYXNz:x", "Authorization", "Basic dXNlcjpwYXNz:x"),
    ]:
        settings = load_settings(
            Settings, **BASE, http_url="https://hooks.example/in", http_auth_header=given
        )
        sent = dict(RequestBuilder(settings).build(message()).headers)
        assert sent[name] == value.encode()
        assert settings.http_auth_header_name == name
        for text in (repr(settings), str(settings), settings.model_dump_json()):
            assert "hunter2" not in text
    for bad, says in [
        ("Bearer hunter2", "it has no colon"),
        ("X Key: hunter2", "before the colon an HTTP header name"),
        ("Authorization : hunter2", "before the colon an HTTP header name"),
        (": hunter2", "before the colon an HTTP header name"),
        ("X-Api-Key:", "after the colon a non-empty header value"),
        ("X-Api-Key:   ", "after the colon a non-empty header value"),
        ("X-Api-Key: hun\r\nter2", "after the colon a non-empty header value"),
        ("X-Api-Key: hünter2", "after the colon a non-empty header value"),
    ]:
        with pytest.raises(SettingsError) as err:
            load_settings(
                Settings, **BASE, http_url="https://hooks.example/in", http_auth_header=bad
            )
        assert err.value.name == "RELAY_HTTP_AUTH_HEADER"
        assert says in err.value.message and "`Name: value`" in err.value.message
        assert "hun" not in str(err.value)
    assert "http_auth_header" in SECRET_FIELDS
    assert is_setting_variable("RELAY_HTTP_AUTH_HEADER_FILE")


@pytest.mark.unit
def test_the_auth_header_comes_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "auth-header"
    path.write_text("X-Api-Key: hunter2\n")  # as `echo ... > file` leaves it
    monkeypatch.setenv("RELAY_HTTP_AUTH_HEADER_FILE", str(path))
    settings = load_settings(Settings, **BASE, http_url="https://hooks.example/in")
    assert dict(RequestBuilder(settings).build(message()).headers)["X-Api-Key"] == b"hunter2"
    monkeypatch.setenv("RELAY_HTTP_AUTH_HEADER", "X-Api-Key: hunter2")
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **BASE, http_url="https://hooks.example/in")
    assert err.value.name == "RELAY_HTTP_AUTH_HEADER_FILE"


@pytest.mark.unit
def test_a_topic_urls_own_value_goes_in_its_name_else_in_the_global_headers() -> None:
    """As with RELAY_HTTP_AUTH_HEADER_NAME before: a topic entry's auth_header_value
    without auth_header_name goes in the global header's name; a shared global value goes
    in the entry's auth_header_name if it has one."""
    topics = {
        "own-value": {"url": "https://o.example/in", "auth_header_value": "own"},
        "own-name": {
            "url": "https://o.example/in",
            "auth_header_name": "X-Own",
            "auth_header_value": "own",
        },
        "shared-in-own-name": {
            "url": "https://s.example/in",
            "auth_header_name": "X-Shared",
            "share_credentials": True,
        },
        "shared": {"url": "https://s.example/in", "share_credentials": True},
    }

    def sent(settings: Settings, topic: str) -> dict[str, bytes]:
        return dict(RequestBuilder(settings).build(message(topic=topic)).headers)

    named = load_settings(
        Settings,
        **BASE,
        http_url="https://hooks.example/in",
        http_auth_header="X-Api-Key: home",
        http_topic_urls=topics,
    )
    assert sent(named, "orders")["X-Api-Key"] == b"home"
    assert sent(named, "own-value")["X-Api-Key"] == b"own"
    assert sent(named, "own-name")["X-Own"] == b"own"
    assert "X-Api-Key" not in sent(named, "own-name")
    assert sent(named, "shared-in-own-name")["X-Shared"] == b"home"
    assert sent(named, "shared")["X-Api-Key"] == b"home"
    # A row cannot set the global header's name, wherever it goes.
    forged = RequestBuilder(named).build(message(topic="own-name", headers={"x-api-key": "f"}))
    assert "x-api-key" not in dict(forged.headers)
    unnamed = load_settings(
        Settings, **BASE, http_url="https://hooks.example/in", http_topic_urls=topics
    )
    assert "Authorization" not in sent(unnamed, "orders")
    assert sent(unnamed, "own-value")["Authorization"] == b"own"
    assert sent(unnamed, "own-name")["X-Own"] == b"own"
    assert "X-Shared" not in sent(unnamed, "shared-in-own-name")
    forged = RequestBuilder(unnamed).build(message(headers={"authorization": "f"}))
    assert "authorization" not in dict(forged.headers)


def test_a_bad_auth_header_stops_start_up_with_exit_2() -> None:
    env = relay_env(
        "postgresql://relay@nowhere.invalid/db",
        RELAY_SINK="http",
        RELAY_HTTP_URL="https://hooks.example/in",
        RELAY_HTTP_AUTH_HEADER="Bearer hunter2",  # the old _VALUE's form: no name
    )
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "RELAY_HTTP_AUTH_HEADER: must be `Name: value`" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout


@pytest.mark.unit
def test_topic_url_objects_are_validated_strictly_and_keep_their_secrets() -> None:
    def refused(entry: Any) -> SettingsError:
        with pytest.raises(SettingsError) as err:
            load_settings(Settings, **BASE, http_topic_urls={"payments": entry})
        assert err.value.name == "RELAY_HTTP_TOPIC_URLS"
        assert "topic 'payments'" in err.value.message
        return err.value

    unknown = refused({"url": "https://p.example", "share": True})
    assert "unknown key 'share'" in unknown.message
    assert "url is required" in refused({"share_credentials": True}).message
    assert "share_credentials" in refused({"url": "https://p", "share_credentials": "yes"}).message
    bad_key = refused({"url": "https://p", "signing_secret": "whsec_!!hunter2"})
    assert "hunter2" not in str(bad_key)
    bad_value = refused({"url": "https://p", "auth_header_value": "Bearer\nhunter2"})
    assert "hunter2" not in str(bad_value)
    assert "auth_header_name" in refused({"url": "https://p", "auth_header_name": "a b"}).message
    refused({"url": "ftp://p"})
    refused(42)
    settings = load_settings(
        Settings,
        **BASE,
        http_topic_urls={
            "payments": {
                "url": "https://user:pw-in-url@p.example/in",
                "auth_header_value": "Bearer hunter2\n",
                "signing_secret": OTHER_SECRET,
            }
        },
    )
    entry = settings.http_topic_urls["payments"]
    assert entry.auth_header_value is not None
    assert entry.auth_header_value.get_secret_value() == "Bearer hunter2"
    for text in (repr(settings), str(settings), repr(entry)):
        for secret in ("hunter2", OTHER_SECRET, "pw-in-url"):
            assert secret not in text
    # A secret setting: readable from RELAY_HTTP_TOPIC_URLS_FILE.
    assert "http_topic_urls" in SECRET_FIELDS
    assert is_setting_variable("RELAY_HTTP_TOPIC_URLS_FILE")


@pytest.mark.unit
def test_topic_urls_with_their_credentials_come_from_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "topic-urls.json"
    entry = {"url": "https://p.example/in", "auth_header_value": "Bearer hunter2"}
    path.write_text(json.dumps({"payments": entry}))
    monkeypatch.setenv("RELAY_HTTP_TOPIC_URLS_FILE", str(path))
    settings = load_settings(Settings, **BASE, http_url="https://hooks.example/in")
    value = settings.http_topic_urls["payments"].auth_header_value
    assert value is not None
    assert value.get_secret_value() == "Bearer hunter2"


@pytest.mark.unit
def test_a_global_credential_that_goes_nowhere_is_refused() -> None:
    only_topics = {"http_topic_urls": {"orders": "https://o.example/in"}}
    with pytest.raises(SettingsError) as err:
        load_settings(
            Settings, **BASE, **only_topics, http_auth_header="Authorization: Bearer hunter2"
        )
    assert err.value.name == "RELAY_HTTP_AUTH_HEADER"
    assert "hunter2" not in str(err.value)
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, **BASE, **only_topics, http_signing_secret=SECRET)
    assert err.value.name == "RELAY_HTTP_SIGNING_SECRET"
    shared = {"orders": {"url": "https://o.example/in", "share_credentials": True}}
    load_settings(Settings, **BASE, http_topic_urls=shared, http_signing_secret=SECRET)


# --- plaintext with credentials -----------------------------------------------------


@pytest.mark.unit
def test_plaintext_credentials_need_an_opt_in() -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {
                "http_url": "http://hooks.example/in",
                "http_auth_header": "Authorization: Bearer hunter2",
            },
            "RELAY_HTTP_URL",
            "the Authorization header",
        ),
        (
            {"http_url": "http://user:hunter2@hooks.example/in"},
            "RELAY_HTTP_URL",
            "the user:password in the URL",
        ),
        (
            {
                "http_url": "https://hooks.example/in",
                "http_topic_urls": {
                    "t": {"url": "http://t.example", "auth_header_value": "hunter2"}
                },
            },
            "RELAY_HTTP_TOPIC_URLS",
            "topic 't': an http:// URL",
        ),
        (
            {
                "http_url": "https://hooks.example/in",
                "http_auth_header": "Authorization: Bearer hunter2",
                "http_topic_urls": {"t": {"url": "http://t.example", "share_credentials": True}},
            },
            "RELAY_HTTP_TOPIC_URLS",
            "topic 't': an http:// URL",
        ),
    ]
    for values, variable, says in cases:
        with pytest.raises(SettingsError) as err:
            load_settings(Settings, **BASE, **values)
        assert err.value.name == variable
        assert says in err.value.message
        assert "RELAY_HTTP_ALLOW_PLAINTEXT_CREDENTIALS=true" in err.value.message
        assert "hunter2" not in str(err.value)
        load_settings(Settings, **BASE, **values, http_allow_plaintext_credentials=True)


@pytest.mark.unit
def test_what_needs_no_plaintext_opt_in() -> None:
    token = {"http_auth_header": "Authorization: Bearer t"}
    for url in (
        "http://localhost:8080/in",
        "http://127.0.0.1:9/in",
        "http://127.1.2.3/in",
        "http://[::1]:8080/in",
        "http://user:pw@localhost/in",
    ):
        load_settings(Settings, **BASE, http_url=url, **token)
    # No credential goes there: a signature proves the body, it reveals no key.
    load_settings(Settings, **BASE, http_url="http://hooks.example/in", http_signing_secret=SECRET)
    # A topic URL elsewhere that gets none of RELAY_HTTP_URL's credentials.
    load_settings(
        Settings,
        **BASE,
        **token,
        http_url="https://hooks.example/in",
        http_topic_urls={"t": "http://t.example/in"},
    )
    # Only the chosen sink's destinations are checked.
    load_settings(
        Settings,
        **BASE | {"sink": "kafka"},
        kafka_bootstrap_servers="k:9092",
        http_url="http://hooks.example/in",
        **token,
    )


def test_plaintext_credentials_stop_start_up_with_exit_2() -> None:
    env = relay_env(
        "postgresql://relay@nowhere.invalid/db",
        RELAY_SINK="http",
        RELAY_HTTP_URL="http://hooks.example/in",
        RELAY_HTTP_AUTH_HEADER="Authorization: Bearer hunter2",
    )
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "RELAY_HTTP_URL" in done.stderr
    assert "RELAY_HTTP_ALLOW_PLAINTEXT_CREDENTIALS" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout
