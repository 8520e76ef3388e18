"""What interoperability costs: the relay's CPU per message and drain rate with
CloudEvents binary mode on against off, on the same rows, alternating rounds.

Each round drains `rows` fresh rows twice with a `relay run` process (bench/cpu.py), once
each way, in turn order rotated; the figure is the median of each round's own ratio,
so the machine's drift between rounds cancels out.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.cpu import drain


def _drain(dsn: str, bootstrap: str, rows: int, way: str) -> dict[str, float]:
    if way == "cloudevents":
        return drain(
            dsn, bootstrap, rows, RELAY_CLOUDEVENTS="binary", RELAY_CLOUDEVENTS_SOURCE="/bench"
        )
    return drain(dsn, bootstrap, rows)


def run(dsn: str, bootstrap: str, quick: bool) -> dict[str, Any]:
    rows, rounds = (30_000, 3) if quick else (100_000, 5)
    ways = ["off", "cloudevents"]
    seen: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    for n in range(rounds):
        for name in ways if n % 2 == 0 else reversed(ways):
            seen[name].append(_drain(dsn, bootstrap, rows, name))

    def ratio(field: str) -> float:
        return statistics.median(
            on[field] / off[field] for on, off in zip(seen["cloudevents"], seen["off"], strict=True)
        )

    report: dict[str, Any] = {
        "rows": rows,
        "rounds": rounds,
        **{
            name: {
                "cpu_us_per_msg": statistics.median(r["cpu_us_per_msg"] for r in runs),
                "rows_per_s": statistics.median(r["rows_per_s"] for r in runs),
            }
            for name, runs in seen.items()
        },
        "cpu_ratio": ratio("cpu_us_per_msg"),
        "rate_ratio": ratio("rows_per_s"),
    }
    off, on = report["off"], report["cloudevents"]
    print(
        f"\n13. CloudEvents binary mode, Kafka, {rows:,} rows x {rounds} rounds: CPU"
        f" {off['cpu_us_per_msg']:.2f} -> {on['cpu_us_per_msg']:.2f} us/msg"
        f" (x{report['cpu_ratio']:.2f}), {off['rows_per_s']:,.0f} -> {on['rows_per_s']:,.0f}"
        f" rows/s (x{report['rate_ratio']:.2f})",
        flush=True,
    )
    return report
