"""A paused topic beside a flowing one (`./dev bench --only pause`): does a pause slow
the others? The relay at its defaults drains N rows of one topic over 100 keys, alone
(the baseline), then with as many rows of a paused topic over 100 other keys
interleaved with them by id, and then with them behind the flowing rows' keys' heads
(the paused topic's rows first in id order). Alternating rounds; the ratio is flowing
rows/s with the pause over rows/s without, per round, and their spread."""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg

from bench.common import KEYS, PAYLOAD, TOPIC
from bench.processes import launch, stop, wait_for

HELD = "held"


def load(dsn: str, rows: int, held: int, *, held_first: bool) -> None:
    """`rows` rows of TOPIC over KEYS keys, and `held` rows of HELD over as many other
    keys: interleaved by id, or (held_first) all before the flowing ones; paused HELD."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox, outbox_paused_topics")
        flowing = (
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %s, 'k' || (g %% %s), %s FROM generate_series(1, %s) g"
        )
        paused = (
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %s, 'h' || (g %% %s), %s FROM generate_series(1, %s) g"
        )
        if held and held_first:
            conn.execute(paused, (HELD, KEYS, PAYLOAD, held))
            conn.execute(flowing, (TOPIC, KEYS, PAYLOAD, rows))
        elif held:
            conn.execute(
                "INSERT INTO outbox (topic, key, payload)"
                " SELECT CASE WHEN g %% 2 = 0 THEN %s ELSE %s END,"
                "        CASE WHEN g %% 2 = 0 THEN 'k' ELSE 'h' END || (g / 2 %% %s), %s"
                " FROM generate_series(1, %s) g",
                (TOPIC, HELD, KEYS, PAYLOAD, 2 * rows),
            )
        else:
            conn.execute(flowing, (TOPIC, KEYS, PAYLOAD, rows))
        if held:
            conn.execute("SELECT outbox_pause(%s, 'bench', NULL, 'cli')", (HELD,))
        conn.execute("VACUUM ANALYZE outbox")


def flowing_left(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM outbox WHERE topic = %s", (TOPIC,)).fetchone()
    assert row is not None
    return int(row[0])


def drain_flowing(dsn: str, bootstrap: str) -> float:
    """Rows/s of TOPIC from its first settled batch until none is left."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        total = flowing_left(conn)
        proc = launch(dsn, bootstrap, {})
        try:
            left = int(
                wait_for(
                    lambda: n if (n := flowing_left(conn)) < total else None, 120, "a first batch"
                )
            )
            started = time.perf_counter()
            while flowing_left(conn):
                time.sleep(0.02)
            return left / (time.perf_counter() - started)
        finally:
            stop([proc])


def run(dsn: str, bootstrap: str, quick: bool) -> dict[str, object]:
    rows = 50_000 if quick else 100_000
    rounds = 3
    scenes = {"interleaved": False, "held first": True}
    alone: list[float] = []
    beside: dict[str, list[float]] = {name: [] for name in scenes}
    for _ in range(rounds):
        load(dsn, rows, 0, held_first=False)
        alone.append(drain_flowing(dsn, bootstrap))
        for name, held_first in scenes.items():
            load(dsn, rows, rows, held_first=held_first)
            beside[name].append(drain_flowing(dsn, bootstrap))
    print(
        f"\na paused topic beside a flowing one: {rows:,} flowing rows over {KEYS} keys,"
        f" {rows:,} paused over {KEYS} others, defaults, {rounds} alternating rounds"
    )
    print(f"{'scene':<28} {'rows/s (median)':>16} {'ratio median':>13} {'ratio min-max':>14}")
    print(f"{'alone':<28} {statistics.median(alone):>16,.0f} {'1.00':>13} {'':>14}")
    report: dict[str, object] = {"rows": rows, "rounds": rounds, "alone_rows_per_s": alone}
    for name, runs in beside.items():
        ratios = [b / a for b, a in zip(runs, alone, strict=True)]
        print(
            f"{'beside a paused topic, ' + name:<28} {statistics.median(runs):>16,.0f}"
            f" {statistics.median(ratios):>13.2f} {min(ratios):>6.2f}-{max(ratios):.2f}"
        )
        report[name] = {"rows_per_s": runs, "ratios": ratios}
    return report
