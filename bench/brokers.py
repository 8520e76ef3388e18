"""NATS JetStream and RabbitMQ sinks: the relay's delivery rate against a bare client of
the same library, in the same run.

    ./dev bench --sink nats     [--rows N] [--batch 500] [--in-flight 64]
    ./dev bench --sink rabbitmq [--rows N] [--batch 500] [--in-flight 64]

For each batch size:
  raw    the client library alone (nats-py / aio-pika): `in-flight` workers, each
         publishing and awaiting its ack (JetStream PubAck / publisher confirm) before
         the next, no database
  relay  the real relay draining the same number of pre-loaded rows (100 keys)
The ratio relay/raw is what the sink and the drain loop cost on top of the broker round
trip. Both wait for each message's acknowledgement: that is what at-least-once needs.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import nats
import psycopg

from bench.common import KEYS, PAYLOAD, TOPIC
from relay.daemon.app import RelayApp
from relay.settings import Settings
from tests.harness.nats import NatsServer
from tests.harness.rabbitmq import RabbitmqServer

Publish = Callable[[int], Awaitable[None]]


async def _workers(rows: int, in_flight: int, publish: Publish) -> float:
    remaining = iter(range(rows))

    async def worker() -> None:
        for n in remaining:
            await publish(n)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return rows / (time.perf_counter() - started)


def raw_nats(url: str, rows: int, in_flight: int) -> float:
    async def run() -> float:
        nc = await nats.connect(url)
        js = nc.jetstream()

        async def publish(n: int) -> None:
            await js.publish(TOPIC, PAYLOAD, headers={"Nats-Msg-Id": str(uuid.uuid4())})

        try:
            return await _workers(rows, in_flight, publish)
        finally:
            await nc.close()

    return asyncio.run(run())


def raw_rabbitmq(url: str, rows: int, in_flight: int) -> float:
    async def run() -> float:
        connection = await aio_pika.connect(url)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)

        async def publish(n: int) -> None:
            message = aio_pika.Message(
                PAYLOAD,
                message_id=str(uuid.uuid4()),
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await channel.default_exchange.publish(message, routing_key=TOPIC, mandatory=True)

        try:
            return await _workers(rows, in_flight, publish)
        finally:
            await connection.close()

    return asyncio.run(run())


def relay_rate(settings: Settings, rows: int) -> float:
    dsn = settings.database_url.get_secret_value()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %s, 'k' || (g %% %s), %s FROM generate_series(1, %s) g",
            (TOPIC, KEYS, PAYLOAD, rows),
        )
        conn.execute("VACUUM ANALYZE outbox")
    app = RelayApp(settings)
    thread = threading.Thread(target=app.run, daemon=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        thread.start()
        while True:
            left = conn.execute("SELECT count(*) FROM outbox").fetchone()
            if left is not None and left[0] == 0:
                break
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
    app.shutdown.request()
    thread.join(timeout=30)
    return rows / elapsed


def run(sink: str, dsn: str, rows: int, batches: list[int], in_flight: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    if sink == "nats":
        server: NatsServer | RabbitmqServer = NatsServer()
    else:
        server = RabbitmqServer()
    with server:
        if isinstance(server, NatsServer):
            server.create_stream("BENCH", [TOPIC])

            def raw() -> float:
                return raw_nats(server.url, rows, in_flight)

            options: dict[str, Any] = {"nats_url": server.url, "sink_max_in_flight": in_flight}
        else:
            server.declare_queue(TOPIC)

            def raw() -> float:
                return raw_rabbitmq(server.url, rows, in_flight)

            options = {"rabbitmq_url": server.url, "sink_max_in_flight": in_flight}
        print(f"{sink} sink, {in_flight} in flight, {rows} rows of {len(PAYLOAD)} B, {KEYS} keys")
        print(f"{'batch':>6} {'raw msg/s':>12} {'relay msg/s':>13} {'ratio':>6}")
        raw()  # warm up the server (and its disk)
        for batch in batches:
            bare = raw()
            settings = Settings(
                database_url=dsn,
                sink=sink,
                batch_size=batch,
                metrics_port=0,
                log_level="warning",
                **options,
            )
            relay = relay_rate(settings, rows)
            results.append(
                {"batch": batch, "rows": rows, "in_flight": in_flight, "raw": bare, "relay": relay}
            )
            print(f"{batch:>6} {bare:>12,.0f} {relay:>13,.0f} {relay / bare:>6.2f}", flush=True)
    return results
