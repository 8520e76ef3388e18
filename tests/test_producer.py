"""`relay.enqueue` / `relay.enqueue_async`: one outbox row in the app's own transaction."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

import relay
from tests.conftest import SettingsFactory
from tests.harness.kafka import TansuBroker, consume
from tests.support import running_relay, scalar, wait_until


def test_enqueue_commits_and_rolls_back_with_the_business_write(database: str) -> None:
    with psycopg.connect(database) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, status text)")
        conn.commit()
        conn.execute("INSERT INTO orders VALUES (42, 'paid')")
        lost = relay.enqueue(conn, "orders", b"never sent", key="order-42")
        conn.rollback()
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (43, 'paid')")
            kept = relay.enqueue(
                conn, "orders", '{"id":43,"status":"paid"}', "order-43", {"kind": "paid"}
            )
    assert kept.id > lost.id and isinstance(kept.message_id, uuid.UUID)
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT id, message_id, topic, key, payload, headers FROM outbox")
        assert rows.fetchall() == [
            (kept.id, kept.message_id, "orders", "order-43", b'{"id":43,"status":"paid"}',
             {"kind": "paid"}),
        ]  # fmt: skip


def test_enqueue_refuses_to_commit_on_its_own(database: str) -> None:
    """Autocommit with no transaction open would commit the outbox row alone."""
    with psycopg.connect(database, autocommit=True) as conn:
        with pytest.raises(RuntimeError, match=r"conn\.transaction\(\)"):
            relay.enqueue(conn, "orders", b"x")
        with pytest.raises(ValueError, match="set by the relay"), conn.transaction():
            relay.enqueue(conn, "orders", b"x", headers={"Message-Id": "forged"})
        with conn.transaction():  # the supported way on an autocommit connection
            relay.enqueue(conn, "orders", b"x")
    assert scalar(database, "SELECT count(*) FROM outbox") == 1


def test_enqueue_async_writes_in_the_async_transaction(database: str) -> None:
    async def app() -> list[relay.Enqueued]:
        async with await psycopg.AsyncConnection.connect(database) as conn:
            async with conn.transaction():
                first = await relay.enqueue_async(conn, "orders", "é", key="k")
                second = await relay.enqueue_async(conn, "orders", None, "k")
            return [first, second]

    first, second = asyncio.run(app())
    assert second.id > first.id
    assert scalar(database, "SELECT payload FROM outbox WHERE id = %s", (first.id,)) == "é".encode()
    assert scalar(database, "SELECT payload FROM outbox WHERE id = %s", (second.id,)) is None


def test_enqueue_refuses_values_it_cannot_send_faithfully(database: str) -> None:
    with psycopg.connect(database) as conn:
        with pytest.raises(TypeError, match="header names and values must be str"):
            relay.enqueue(conn, "orders", b"x", headers={"retries": 3})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="topic"):
            relay.enqueue(conn, "", b"x")


def test_an_enqueued_message_arrives_with_its_message_id(
    make_settings: SettingsFactory, database: str, kafka: TansuBroker, topic: str
) -> None:
    with psycopg.connect(database) as conn, conn.transaction():
        sent = relay.enqueue(conn, topic, b"hello", key="k1", headers={"trace": "abc"})
    with running_relay(make_settings()):
        wait_until(lambda: scalar(database, "SELECT count(*) FROM outbox") == 0, timeout=20)
    [record] = consume(kafka.bootstrap_servers, topic, min_count=1, timeout=20)
    assert record.key == "k1" and record.value == b"hello"
    assert record.headers["message-id"] == str(sent.message_id).encode()
    assert record.headers["trace"] == b"abc"
