"""Rate limits and pauses per HTTP destination origin, against real receivers on
loopback and a real PostgreSQL: a limited origin never gets more than its limit (never
a 429) and never slows another origin; a 429 or 503 with Retry-After pauses its origin as a whole
without spending attempts; each key's rows arrive in order throughout."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from prometheus_client import REGISTRY

from relay.settings import Settings
from tests.conftest import SettingsFactory
from tests.harness.webhook import Delivery, LimitedTo, Reply, WebhookServer
from tests.support import insert_rows, running_relay, scalar, unsent_count, wait_until
from tests.test_http_sink import assert_in_order

LIMITED = "limited"
OTHER = "other"


@pytest.fixture
def other() -> Iterator[WebhookServer]:
    with WebhookServer(lambda d: Reply(200, delay=0.005)) as srv:
        yield srv


def rows_for(topic: str, keys: int, per_key: int) -> list[tuple[str, bytes]]:
    """Interleaved keys of their own per topic; the payload says key and step."""
    return [
        (f"{topic}{k}", f"{topic}{k}:{i}".encode()) for i in range(per_key) for k in range(keys)
    ]


def settings_for(
    make_settings: SettingsFactory, limited: WebhookServer, other: WebhookServer, **extra: Any
) -> Settings:
    values: dict[str, Any] = {
        "sink": "http",
        "http_url": other.url + "/hooks/{topic}",
        "http_topic_urls": {
            LIMITED: {"url": limited.url + "/limited", "max_requests_per_second": 40}
        },
        "sink_max_in_flight": 8,
        "sink_timeout_seconds": 5.0,
        "retry_max_seconds": 30.0,
        "retention_seconds": 3600.0,  # rows kept once sent: their attempts can be read
    }
    values.update(extra)
    return make_settings(**values)


def span(deliveries: Sequence[Delivery]) -> float:
    return max(d.ended for d in deliveries) - min(d.started for d in deliveries)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_limited_origin_never_sees_more_than_its_limit_and_never_slows_another(
    make_settings: SettingsFactory, database: str, other: WebhookServer
) -> None:
    """An origin limited to 40 requests a second by the relay, answering 429 above 50,
    behind whose 480-row backlog another origin's 400 rows are committed: the limited
    one never answers 429 nor sees more than 40 in a second, and the other's rows are
    all delivered while the limited one's are still held to its limit, before a
    quarter of its rows is left (which its limit puts 9 s after its first; the other's
    take 1-2 s alone here, 4 on a loaded machine). Before: they finished with the
    limited origin's, and the relay sent 5-10 times the limit."""
    limiter = LimitedTo(50)
    with WebhookServer(limiter) as limited:
        origin = f"http://127.0.0.1:{limited.port}"
        settings = settings_for(make_settings, limited, other)
        insert_rows(database, LIMITED, rows_for(LIMITED, keys=120, per_key=4))
        insert_rows(database, OTHER, rows_for(OTHER, keys=40, per_key=10))
        with running_relay(settings):
            wait_until(lambda: len(other.acked()) == 400, 60, message="the other origin")
            wait_until(lambda: len(limited.acked()) == 480, 60, message="the limited origin")
        limited_history = limited.history()
    assert limiter.refused == 0
    assert [d.status for d in limited_history] == [200] * 480
    # Never more than 40 in a second of the relay's starts is held exactly on a fake
    # clock (test_rate_limit.py, test_no_window_of_one_second_holds_more_than_the_rate):
    # here the receiver stamps each request when its thread gets to it, and on a loaded
    # machine a few wait long enough to bunch with the next second's (43 was seen). What
    # holds whatever the load: the origin refused none (it refuses past 50 in a second),
    # and over the whole drain no more than 40 a second went (the span below).
    assert span(limited_history) >= 479 / 40 - 0.1  # it was the limit that held them
    # How close to its limit the origin is served is a figure of the machine, not an
    # outcome: `./dev bench --only rate-limits` measures it (docs/benchmarks.md).
    other_done = max(d.ended for d in other.acked())
    left = sum(d.started > other_done for d in limited_history)
    assert left >= 120, f"{left} of the limited origin's 480 rows left when the other's were done"
    assert_in_order(limited_history, 120, 4)
    assert_in_order(other.history(), 40, 10)
    assert scalar(database, "SELECT max(attempts) FROM outbox_sent") == 0
    assert sample("relay_http_origin_max_requests_per_second", origin=origin) == 40
    assert sample("relay_http_origin_budget_wait_seconds_total", origin=origin) > 0
    # Rows that could not get budget while their batch was busy went back unsent.
    assert sample("relay_http_origin_deferred_rows_total", origin=origin, reason="budget") > 0


def test_a_503_with_retry_after_pauses_its_origin_as_a_whole_and_spends_no_attempt(
    make_settings: SettingsFactory, database: str
) -> None:
    """The first request to an origin is answered 503 with Retry-After: 2. Before: only
    that row waited (spending an attempt) and the origin's other rows kept coming."""
    answered: list[Delivery] = []

    def deploying(d: Delivery) -> Reply:
        if not answered:
            answered.append(d)
            return Reply(503, headers={"Retry-After": "2"}, body=b"deploying")
        return Reply(200, delay=0.005)

    with (
        WebhookServer(deploying) as paused,
        WebhookServer(lambda d: Reply(200, delay=0.02)) as other,
    ):
        insert_rows(database, LIMITED, rows_for(LIMITED, keys=20, per_key=2))
        insert_rows(database, OTHER, rows_for(OTHER, keys=40, per_key=10))
        settings = settings_for(
            make_settings, paused, other, http_topic_urls={LIMITED: paused.url + "/in"}
        )
        with running_relay(settings):
            wait_until(lambda: unsent_count(database) == 0, 60, message="outbox drained")
        history = paused.history()
    refused = next(d for d in history if d.status == 503)
    pause_ends = refused.ended + 2.0
    # Requests already on their way when it answered may land; after that, none.
    during = [d for d in history if refused.ended + 0.1 < d.started < pause_ends - 0.1]
    assert during == [], [d.body for d in during]
    again = [d for d in history if d.message_id == refused.message_id]
    assert [d.status for d in again] == [503, 200]
    assert again[1].started >= pause_ends - 0.1
    # The other origin went on meanwhile: it was served while this one paused (not how
    # much of it, which a loaded machine decides).
    assert any(refused.ended + 0.1 < d.started < pause_ends - 0.1 for d in other.acked())
    assert scalar(database, "SELECT max(attempts) FROM outbox_sent") == 0
    assert_in_order([d for d in history if d.ok], 20, 2)
    assert_in_order(other.history(), 40, 10)


def test_one_origin_with_a_limit_waits_for_its_budget_without_writing_a_row(
    make_settings: SettingsFactory, database: str
) -> None:
    """RELAY_HTTP_MAX_REQUESTS_PER_SECOND with a single endpoint: no other origin to
    slow, so rows wait in the sink, spaced; none goes back to the outbox."""
    limiter = LimitedTo(25)
    with WebhookServer(limiter) as server:
        origin = f"http://127.0.0.1:{server.port}"
        insert_rows(database, LIMITED, rows_for(LIMITED, keys=10, per_key=6))
        settings = make_settings(
            sink="http",
            http_url=server.url + "/hooks/{topic}",
            http_max_requests_per_second=20,
            sink_max_in_flight=8,
            retry_max_seconds=30.0,
            retention_seconds=3600.0,
        )
        with running_relay(settings):
            wait_until(lambda: unsent_count(database) == 0, 60, message="outbox drained")
        history = server.history()
    # The bound on arrivals is the receiver's own: it refuses one beyond 25 in a second.
    # The relay releases at most 21 in any second, but a loaded machine bunches their
    # arrivals by a few (23 in one run), which no assert on the relay's rate can allow for.
    assert limiter.refused == 0 and len(history) == 60
    assert span(history) >= 59 / 20 - 0.1
    assert_in_order(history, 10, 6)
    assert scalar(database, "SELECT max(attempts) FROM outbox_sent") == 0
    assert scalar(database, "SELECT count(*) FROM outbox_sent WHERE last_error IS NOT NULL") == 0
    assert sample("relay_http_origin_deferred_rows_total", origin=origin, reason="budget") == 0
    assert sample("relay_http_origin_budget_wait_seconds_total", origin=origin) > 1.0


def test_the_rate_gauge_counts_the_last_second(
    make_settings: SettingsFactory, database: str
) -> None:
    with WebhookServer() as server:
        origin = f"http://127.0.0.1:{server.port}"
        insert_rows(database, LIMITED, rows_for(LIMITED, keys=20, per_key=10))
        settings = make_settings(
            sink="http", http_url=server.url + "/x", http_max_requests_per_second=50
        )
        seen: list[float] = []

        def drained() -> bool:
            seen.append(sample("relay_http_origin_requests_per_second", origin=origin))
            return unsent_count(database) == 0

        with running_relay(settings):
            wait_until(drained, 30, message="outbox drained")
            # Back at 0 once nothing is sent: its window, the last second, is the fake
            # clock's to check (test_rate_limit.py, test_the_recent_rate_counts_the_last_second).
            wait_until(
                lambda: sample("relay_http_origin_requests_per_second", origin=origin) == 0,
                5,
                message="the gauge back at 0 once nothing is sent",
            )
    # Never over the limit (the sink's budget guarantees it; one more may be counted at a
    # bucket's edge), and it did count: how close it comes to 50 is the machine's.
    assert 0 < max(seen) <= 51, max(seen)
