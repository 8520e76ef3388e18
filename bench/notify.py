"""LISTEN/NOTIFY: what it costs the app's commits, and what it saves the first message.

1. Commit rate: `writers` app sessions, each committing one `relay.enqueue` per
   transaction as fast as it can, with and without `notify=` (NOTIFY takes a
   database-wide lock at commit), alternating; a session LISTENs throughout, as a relay
   would (without a listener PostgreSQL drops notifications at once).
2. First-message latency on a quiet outbox: an in-process relay at its default polling
   (up to 100 ms between polls once idle), one row committed after each quiet spell;
   commit -> the sink's acknowledgement, with and without RELAY_NOTIFY_CHANNEL.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import psycopg

import relay
from bench.common import PAYLOAD, TOPIC, relay_settings
from bench.latency import percentile, timed_relay

CHANNEL = "relay_bench"


def _listen(dsn: str, stop: threading.Event) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        while not stop.is_set():
            for _ in conn.notifies(timeout=0.2):
                pass


def commit_rate(dsn: str, writers: int, seconds: float, *, notify: bool) -> float:
    """Commits/s of `writers` sessions enqueueing one row per transaction."""
    counts = [0] * writers
    stop = threading.Event()

    def write(slot: int) -> None:
        with psycopg.connect(dsn) as conn:
            while not stop.is_set():
                with conn.transaction():
                    relay.enqueue(
                        conn, TOPIC, PAYLOAD, f"k{slot}", notify=CHANNEL if notify else None
                    )
                counts[slot] += 1

    listener = threading.Thread(target=_listen, args=(dsn, stop))
    listener.start()
    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    time.sleep(0.5)
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    listener.join()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    return sum(counts) / elapsed


def first_message(dsn: str, bootstrap: str, samples: int, *, notify: bool) -> dict[str, float]:
    """Commit -> acknowledgement of a lone row after a quiet spell, `samples` times."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    extra: dict[str, Any] = {"notify_channel": CHANNEL} if notify else {}
    latencies: list[float] = []
    with (
        timed_relay(relay_settings(dsn, bootstrap, **extra)) as sinks,
        psycopg.connect(dsn) as conn,
    ):
        time.sleep(1.5)  # lease, producer and listener up
        for n in range(samples):
            time.sleep(0.4)  # quiet: the idle polls are 100 ms apart by now
            with conn.transaction():
                added = relay.enqueue(
                    conn, TOPIC, PAYLOAD, f"k{n}", notify=CHANNEL if notify else None
                )
            committed = time.monotonic()
            message_id = str(added.message_id)
            deadline = committed + 10
            while message_id not in sinks[0].acked_at and time.monotonic() < deadline:
                time.sleep(0.0005)
            if message_id in sinks[0].acked_at:
                latencies.append((sinks[0].acked_at[message_id] - committed) * 1000)
    return {
        "samples": len(latencies),
        "p50_ms": statistics.median(latencies),
        "p95_ms": percentile(latencies, 0.95),
        "max_ms": max(latencies),
    }


def run(dsn: str, bootstrap: str, quick: bool) -> dict[str, Any]:
    writers, seconds, samples = (8, 3.0, 20) if quick else (8, 5.0, 50)
    rates: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(2):
        for mode in ("without", "with"):
            rates[mode].append(commit_rate(dsn, writers, seconds, notify=mode == "with"))
    without, with_ = statistics.mean(rates["without"]), statistics.mean(rates["with"])
    print(
        f"\n12. LISTEN/NOTIFY: {writers} app sessions, one enqueue per transaction,"
        f" {seconds:.0f} s x 2 each: {without:,.0f} commits/s without NOTIFY,"
        f" {with_:,.0f} with ({with_ / without:.2f})",
        flush=True,
    )
    first = {
        mode: first_message(dsn, bootstrap, samples, notify=mode == "with")
        for mode in ("without", "with")
    }
    for mode, figures in first.items():
        print(
            f"    first message after a quiet spell, {mode} NOTIFY ({figures['samples']:.0f}"
            f" samples): p50 {figures['p50_ms']:.1f} ms, p95 {figures['p95_ms']:.1f} ms,"
            f" max {figures['max_ms']:.1f} ms",
            flush=True,
        )
    return {"writers": writers, "commit_rate": rates, "first_message": first}
