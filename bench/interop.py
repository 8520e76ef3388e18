"""What interoperability costs: the relay's CPU per message and drain rate with
CloudEvents binary mode, and with tracing (spans exported over OTLP/HTTP to a real
receiver), each against neither, on the same rows, alternating rounds.

Every row carries a `traceparent` header, as an app that traces writes them, so the
batch spans have a link per message. Each round drains `rows` fresh rows once each way
with a `relay run` process (bench/cpu.py), the order rotated; a figure is the median of
each round's own ratio, so the machine's drift between rounds cancels out.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from bench.common import preload
from bench.cpu import drain
from tests.harness.otlp import OtlpReceiver

WAYS = ("off", "cloudevents", "tracing")
TRACEPARENT = json.dumps({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})


def _drain(dsn: str, bootstrap: str, rows: int, way: str, otlp: str) -> dict[str, float]:
    preload(dsn, rows, headers=TRACEPARENT)
    if way == "cloudevents":
        return drain(
            dsn,
            bootstrap,
            rows,
            preloaded=True,
            RELAY_CLOUDEVENTS_SOURCE="/bench",
        )
    if way == "tracing":
        return drain(
            dsn,
            bootstrap,
            rows,
            preloaded=True,
            RELAY_TRACING="true",
            OTEL_EXPORTER_OTLP_ENDPOINT=otlp,
        )
    return drain(dsn, bootstrap, rows, preloaded=True)


def run(dsn: str, bootstrap: str, quick: bool) -> dict[str, Any]:
    rows, rounds = (30_000, 3) if quick else (100_000, 5)
    seen: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    with OtlpReceiver() as receiver:
        for n in range(rounds):
            order = WAYS[n % len(WAYS) :] + WAYS[: n % len(WAYS)]
            for way in order:
                seen[way].append(_drain(dsn, bootstrap, rows, way, receiver.endpoint))
        spans = len(receiver.spans())

    def ratio(way: str, field: str) -> float:
        return statistics.median(
            on[field] / off[field] for on, off in zip(seen[way], seen["off"], strict=True)
        )

    report: dict[str, Any] = {"rows": rows, "rounds": rounds, "spans_received": spans}
    for way, runs in seen.items():
        report[way] = {
            "cpu_us_per_msg": statistics.median(r["cpu_us_per_msg"] for r in runs),
            "rows_per_s": statistics.median(r["rows_per_s"] for r in runs),
        }
        if way != "off":
            report[way]["cpu_ratio"] = ratio(way, "cpu_us_per_msg")
            report[way]["rate_ratio"] = ratio(way, "rows_per_s")
    off = report["off"]
    print(
        f"\n13. interoperability, Kafka, {rows:,} rows with a traceparent each x {rounds}"
        f" rounds: neither {off['cpu_us_per_msg']:.2f} us/msg, {off['rows_per_s']:,.0f} rows/s",
        flush=True,
    )
    for way in WAYS[1:]:
        on = report[way]
        print(
            f"    {way:12s} {on['cpu_us_per_msg']:.2f} us/msg (x{on['cpu_ratio']:.2f}),"
            f" {on['rows_per_s']:,.0f} rows/s (x{on['rate_ratio']:.2f})",
            flush=True,
        )
    return report
