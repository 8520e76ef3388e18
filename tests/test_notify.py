"""Instant wake-up (RELAY_NOTIFY_CHANNEL): an idle relay looks at once when an app
NOTIFYs, long before its next poll; the listen session comes back when it is killed.

Every test polls rarely (every 10 s, the most the setting allows), so a row that
arrives within 3 s was woken for (three in a row: a poll cannot explain them all).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from prometheus_client import REGISTRY

import relay
from relay.settings import Settings
from tests.conftest import SettingsFactory, relay_migrate
from tests.support import running_relay, scalar, unsent_count, wait_until

QUIET = {"poll_interval_min_seconds": 10.0, "poll_interval_max_seconds": 10.0}
WOKEN_WITHIN = 3.0  # seconds: far below the 10 s poll


def listening() -> bool:
    return REGISTRY.get_sample_value("relay_notify_listening") == 1.0


@contextmanager
def idle_leader(settings: Settings, database: str) -> Iterator[None]:
    """A relay that holds the lease, listens, and has begun a 10 s idle wait."""
    with running_relay(settings):
        wait_until(listening, timeout=20, message="the relay to LISTEN")
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM leases WHERE holder IS NOT NULL") == 1,
            timeout=20,
            message="the relay to hold the lease",
        )
        yield


def test_a_notify_wakes_an_idle_relay_long_before_its_next_poll(
    make_settings: SettingsFactory, database: str, topic: str
) -> None:
    channel = f"outbox_{uuid.uuid4().hex[:8]}"
    with idle_leader(make_settings(notify_channel=channel, **QUIET), database):
        for n in range(3):  # a poll could land in one window by luck, not in three
            with psycopg.connect(database) as conn, conn.transaction():
                relay.enqueue(conn, topic, f"m{n}".encode(), key="k", notify=channel)
            wait_until(
                lambda: unsent_count(database) == 0,
                timeout=WOKEN_WITHIN,
                message=f"row {n} delivered after its NOTIFY",
            )


def test_the_migration_trigger_wakes_the_relay_on_plain_inserts(
    make_settings: SettingsFactory, database: str, topic: str
) -> None:
    channel = f"outbox_{uuid.uuid4().hex[:8]}"
    relay_migrate(database, "--notify-trigger", channel)
    with idle_leader(make_settings(notify_channel=channel, **QUIET), database):
        with psycopg.connect(database) as conn:  # an app that knows nothing of the relay
            conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', 'x')", (topic,))
        wait_until(lambda: unsent_count(database) == 0, timeout=WOKEN_WITHIN)
    relay_migrate(database, "--drop-notify-trigger")
    assert scalar(database, "SELECT count(*) FROM pg_trigger WHERE tgname = 'outbox_notify'") == 0


def test_the_listener_comes_back_after_its_session_is_killed(
    make_settings: SettingsFactory, database: str, topic: str
) -> None:
    """Before: nothing; a killed listen session must not leave the relay deaf."""
    channel = f"outbox_{uuid.uuid4().hex[:8]}"
    with idle_leader(make_settings(notify_channel=channel, **QUIET), database):
        killed = scalar(
            database,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = 'relay:listen' AND datname = current_database()",
        )
        assert killed == 1
        wait_until(lambda: not listening(), timeout=10, message="the loss to be noticed")
        wait_until(listening, timeout=20, message="the relay to LISTEN again")
        with psycopg.connect(database) as conn, conn.transaction():
            relay.enqueue(conn, topic, b"after", key="k", notify=channel)
        wait_until(lambda: unsent_count(database) == 0, timeout=WOKEN_WITHIN)


def test_enqueue_refuses_a_notify_that_is_not_a_channel_name(database: str) -> None:
    with psycopg.connect(database) as conn, pytest.raises(ValueError, match="channel"):
        relay.enqueue(conn, "t", b"x", notify="")
