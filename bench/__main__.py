"""Benchmark: the relay against the limits it runs on, measured in the same run.

    ./dev bench            the full table (a few minutes)
    ./dev bench --quick    smaller sizes and shorter windows (about a minute and a half)
    ./dev bench --full     also the 10M-kept-rows history case (slow)
    ./dev bench --sink http [--rows N] [--in-flight 16]     (see bench/http.py)
    ./dev bench --sink nats|rabbitmq [--rows N] [--in-flight 64]  (see bench/brokers.py)
    ./dev bench --only shards|fairness|notify|interop|baselines|rate-limits|tenants|console|pooler
    ./dev bench --only pause [--quick]   (a paused topic beside a flowing one: bench/pause.py)
        [--quick]
    ./dev bench --only soak [--quick | --minutes M]
    ./dev bench --only without-key-index [--quick]
        one section alone
    ./dev bench --compare [REV] [--rows N] [--batch B ...] [--rounds R]
        this checkout's relay against REV's (default HEAD~1): CPU per message and
        rows/s in alternating runs, and the bare select-and-mark loop (bench/compare.py)

Starts its own PostgreSQL (fsync ON, realistic settings) and Tansu broker and prints:
  1. the raw limit: a bare select + move to outbox_sent (or delete) loop, by the primary key
  2. the bare producer rate to the broker (idempotent, acks=all, lz4)
  3. the relay end to end, rows pre-loaded then drained by a relay process, per batch
     size and retention mode, with its ratio to 1. and its CPU time per message
  4. latency at a steady insert rate: commit -> delivery report, p50/p95/p99
  5. idle CPU of a leader and a standby on an empty outbox
  6. SIGTERM handover and SIGKILL takeover: signal -> the other replica publishing
  7. RSS with a backlog (start, peak, after draining); drain rate over a kept history
  8-10. fairness: a key in backoff with a deep backlog, a hot key in front, big rows'
     peak RSS with and without RELAY_BATCH_MAX_BYTES (see bench/fairness.py)
  11. sharded leases: drain rate and CPU per message for 1/2/4 shards x 1/2/3 replicas
     (see bench/shards.py; `--only shards` runs it alone)
  12. LISTEN/NOTIFY: the app's commit rate with and without NOTIFY, and the first
     message's latency on a quiet outbox with and without it (bench/notify.py;
     `--only notify`)
  13. CloudEvents binary mode, and tracing (OTLP), each against neither: CPU per
     message and drain rate (bench/interop.py; `--only interop`)
  14. baselines without the relay's index set or machinery (bench/baselines.py;
     `--only baselines`): the loops of 1. on a minimal table (primary key and one
     partial index) beside `outbox`; the bare relay (select 2000, produce, wait for
     every ack, delete: the job's floor) against the relay at its defaults; the app's
     write path (pgbench one-row and ten-row INSERT transactions, COPY) into `outbox`
     and into a table with only a primary key, alternating
  15. rate limits per HTTP destination (bench/rate_limits.py; `--only rate-limits`
     only): two origins, one limited to 40 requests/s and answering 429 above 50
  16. fairness per tenant (bench/tenants.py; `--only tenants` only): a tenant of 20
     rows behind another's 12,000 on 1,500 keys, over HTTP and Kafka, grouped or not;
     the grouped fetch's cost at 1, 100,000 and 1,000,000 waiting rows of one tenant
  17. the operators' console (bench/console.py; `--only console` only): a page of dead
     letters with 100,000 in the table, first and deep, as whole HTTP requests
  18. soak (bench/soak.py; `--only soak` only): 500 rows/s for 30 minutes in each mode,
     the outbox's and the history's size and dead tuples and the fetch's time, sampled
  19. without the key index (bench/without_key_index.py; `--only without-key-index`
     only): a sketch of the fair fetch on an outbox whose primary key is its only
     index, moving crowded keys' rows out, against first in, first out and the relay
Results also go to bench/results/<timestamp>.json. Absolute numbers drift on a shared
machine; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from relay.admin.migrate import migrate
from relay.settings import CommonSettings
from tests.harness.kafka import TansuBroker
from tests.harness.postgres import PostgresServer


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("--sink", choices=["kafka", "http", "nats", "rabbitmq"], default="kafka")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, shorter windows")
    parser.add_argument("--full", action="store_true", help="add the 10M-row history case")
    parser.add_argument("--rows", type=int, default=None, help="rows per drain run")
    parser.add_argument(
        "--minutes", type=float, default=None, help="--only soak: minutes per mode (30)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument(
        "--in-flight", type=int, default=None, help="RELAY_<SINK>_MAX_IN_FLIGHT (16 / 64)"
    )
    parser.add_argument(
        "--only",
        choices=[
            "fairness",
            "shards",
            "notify",
            "interop",
            "baselines",
            "rate-limits",
            "tenants",
            "console",
            "pooler",
            "soak",
            "without-key-index",
            "pause",
        ],
        default=None,
        help="run one section alone",
    )
    parser.add_argument(
        "--compare",
        nargs="?",
        const="HEAD~1",
        default=None,
        metavar="REV",
        help="this checkout's relay against REV's (default: the previous commit)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (--compare)")
    args = parser.parse_args()

    from relay.observe.logging import configure

    configure("console", "warning")
    if args.sink == "http":
        return bench_http(args.rows or 10_000, args.batch or [500], args.in_flight or 16)
    if args.sink in ("nats", "rabbitmq"):
        rows, batches = args.rows or 20_000, args.batch or [500]
        return bench_broker(args.sink, rows, batches, args.in_flight or 64)
    if args.compare is not None:
        return bench_compare(
            args.compare, args.rows or 100_000, args.batch or [500, 2000], args.rounds
        )
    if args.only == "fairness":
        return bench_fairness(args.quick)
    if args.only == "shards":
        return bench_shards(args.quick, args.rows)
    if args.only == "notify":
        return bench_notify(args.quick)
    if args.only == "interop":
        return bench_interop(args.quick)
    if args.only == "baselines":
        return bench_baselines(args.quick)
    if args.only == "rate-limits":
        return bench_rate_limits(args.quick)
    if args.only == "pause":
        return bench_pause(args.quick)
    if args.only == "pooler":
        return bench_pooler(args.quick)
    if args.only == "console":
        return bench_console(args.quick)
    if args.only == "tenants":
        return bench_tenants(args.quick)
    if args.only == "soak":
        return bench_soak(args.minutes or (3.0 if args.quick else 30.0))
    if args.only == "without-key-index":
        return bench_without_key_index(args.quick)
    return bench_kafka(args)


@contextmanager
def server_set() -> Iterator[tuple[PostgresServer, str, str]]:
    """A fresh PostgreSQL (fsync on) with the schema, and a broker with the topic:
    (the server, dsn, bootstrap servers)."""
    with (
        PostgresServer(Path(tempfile.mkdtemp(prefix="relay-bench-pg-")), durable=True) as pg,
        TansuBroker() as broker,
    ):
        dsn = pg.create_database("bench")
        migrate(CommonSettings(database_url=dsn))
        broker.create_topic("bench", partitions=3)
        yield pg, dsn, broker.bootstrap_servers


@contextmanager
def servers() -> Iterator[tuple[str, str]]:
    """`server_set`, for the sections that need only (dsn, bootstrap servers)."""
    with server_set() as (_pg, dsn, bootstrap):
        yield dsn, bootstrap


def bench_compare(rev: str, rows: int, batches: list[int], rounds: int) -> int:
    from bench import compare

    with server_set() as (pg, dsn, bootstrap):
        report = compare.run(pg, dsn, bootstrap, rev, rows, batches, rounds)
    save({"sink": "kafka", "compare": report})
    return 0


def bench_fairness(quick: bool) -> int:
    from bench import fairness

    with servers() as (dsn, bootstrap):
        report = fairness.run(dsn, bootstrap, quick)
    save({"sink": "kafka", "quick": quick, "fairness": report})
    return 0


def bench_notify(quick: bool) -> int:
    from bench import notify

    with servers() as (dsn, bootstrap):
        report = notify.run(dsn, bootstrap, quick)
    save({"sink": "kafka", "quick": quick, "notify": report})
    return 0


def bench_interop(quick: bool) -> int:
    from bench import interop

    with servers() as (dsn, bootstrap):
        report = interop.run(dsn, bootstrap, quick)
    save({"sink": "kafka", "quick": quick, "interop": report})
    return 0


def bench_baselines(quick: bool) -> int:
    from bench import baselines

    with servers() as (dsn, bootstrap):
        report = baselines.run(dsn, bootstrap, quick)
    save({"sink": "kafka", "quick": quick, "baselines": report})
    return 0


def bench_rate_limits(quick: bool) -> int:
    from bench import rate_limits

    with servers() as (dsn, _bootstrap):
        report = rate_limits.run(dsn, quick)
    save({"sink": "http", "quick": quick, "rate_limits": report})
    return 0


def bench_soak(minutes: float) -> int:
    from bench import soak

    with servers() as (dsn, bootstrap):
        report = soak.run(dsn, bootstrap, minutes)
    save({"sink": "kafka", "soak": report})
    return 0


def bench_tenants(quick: bool) -> int:
    from bench import tenants

    with servers() as (dsn, bootstrap):
        report = tenants.run(dsn, bootstrap, quick)
    save({"sink": "http+kafka", "quick": quick, "tenants": report})
    return 0


def bench_without_key_index(quick: bool) -> int:
    from bench import without_key_index

    with servers() as (dsn, bootstrap):
        report = without_key_index.run(dsn, bootstrap, quick)
    save({"sink": "kafka", "quick": quick, "without_key_index": report})
    return 0


def bench_pooler(quick: bool) -> int:
    from bench import pooler

    with server_set() as (pg, dsn, bootstrap):
        report = pooler.run(pg, dsn, bootstrap, quick)
    save({"sink": "kafka", "quick": quick, "pooler": report})
    return 0


def bench_pause(quick: bool) -> int:
    from bench import pause

    with server_set() as (_pg, dsn, bootstrap):
        report = pause.run(dsn, bootstrap, quick)
    save({"sink": "kafka", "quick": quick, "pause": report})
    return 0


def bench_console(quick: bool) -> int:
    from bench import console

    with PostgresServer(Path(tempfile.mkdtemp(prefix="relay-bench-pg-")), durable=True) as pg:
        dsn = pg.create_database("bench")
        migrate(CommonSettings(database_url=dsn))
        report = console.run(dsn, quick)
    save({"quick": quick, "console": report})
    return 0


def bench_shards(quick: bool, rows: int | None) -> int:
    from bench import shards

    with servers() as (dsn, bootstrap):
        report = shards.run(dsn, bootstrap, quick, rows)
    save({"sink": "kafka", "quick": quick, "shards": report})
    return 0


def bench_kafka(args: argparse.Namespace) -> int:
    from bench import baselines, drain, fairness, interop, latency, notify, processes, shards

    quick = args.quick
    rows = args.rows or (20_000 if quick else 50_000)
    batches = args.batch or [100, 500, 2000]
    report: dict[str, Any] = {"sink": "kafka", "quick": quick}
    with servers() as (dsn, bootstrap):
        bare, drains = drain.run(dsn, bootstrap, rows, batches)
        report["producer_msgs_per_s"] = bare
        report["drain"] = drains
        print(f"\n2. bare producer to the broker: {bare:,.0f} msg/s")
        print(f"\n1+3. drain, {rows:,} rows of 200 B, 100 keys, one replica")
        print(
            f"{'mode':>7} {'batch':>6} {'raw rows/s':>11} {'relay rows/s':>13} {'ratio':>6}"
            f" {'relay µs/msg':>13}"
        )
        for r in drains:
            ratio = float(r["relay"]) / float(r["raw"])
            print(
                f"{r['mode']:>7} {r['batch']:>6} {r['raw']:>11,.0f} {r['relay']:>13,.0f}"
                f" {ratio:>6.2f} {r['cpu_us_per_msg']:>13.2f}",
                flush=True,
            )
        print("   relay µs/msg: user + system CPU of the relay process per message")

        lat = latency.run(dsn, bootstrap, rate=1000, seconds=10 if quick else 30)
        report["latency"] = lat
        print(
            f"\n4. latency at {lat['rate']:.0f} msg/s for {lat['seconds']:.0f} s"
            f" ({lat['delivered']}/{lat['messages']} delivered): p50 {lat['p50_ms']:.1f} ms,"
            f" p95 {lat['p95_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, max {lat['max_ms']:.1f} ms",
            flush=True,
        )

        idle = processes.idle_cpu(dsn, bootstrap, seconds=10 if quick else 30)
        report["idle"] = idle
        print(
            f"\n5. idle CPU over {idle['seconds']:.0f} s: leader"
            f" {idle['leader_cpu_percent']:.2f} % of a core, standby"
            f" {idle['standby_cpu_percent']:.2f} %",
            flush=True,
        )

        fo = processes.failover(dsn, bootstrap, ttl=5.0)
        report["failover"] = fo
        print(
            f"\n6. failover (ttl {fo['ttl_seconds']:.0f} s): SIGTERM handover"
            f" {fo['sigterm_seconds']:.2f} s, SIGKILL takeover {fo['sigkill_seconds']:.2f} s",
            flush=True,
        )

        mem = processes.memory(dsn, bootstrap, backlog=200_000 if quick else 1_000_000)
        report["memory"] = mem
        print(
            f"\n7. memory with a {mem['backlog_rows']:,.0f}-row backlog: RSS"
            f" {mem['rss_start_mib']:.0f} MiB at start, {mem['rss_peak_mib']:.0f} MiB peak,"
            f" {mem['rss_after_mib']:.0f} MiB after draining"
            f" ({mem['drain_rows_per_s']:,.0f} rows/s, a relay process)",
            flush=True,
        )
        report["fairness"] = fairness.run(dsn, bootstrap, quick)
        report["shards"] = shards.run(dsn, bootstrap, quick)
        report["notify"] = notify.run(dsn, bootstrap, quick)
        report["interop"] = interop.run(dsn, bootstrap, quick)
        report["baselines"] = baselines.run(dsn, bootstrap, quick)
        if args.full:
            hist = drain.history_effect(dsn, bootstrap, rows, history=10_000_000)
            report["history"] = hist
            print(
                f"   retention mode over 10M kept rows: {hist['with_history']:,.0f} rows/s vs"
                f" {hist['empty_history']:,.0f} rows/s over an empty history",
                flush=True,
            )
    save(report)
    return 0


def bench_http(rows: int, batches: list[int], in_flight: int) -> int:
    from bench import http

    with PostgresServer(Path(tempfile.mkdtemp(prefix="relay-bench-pg-")), durable=True) as pg:
        dsn = pg.create_database("bench")
        migrate(CommonSettings(database_url=dsn))
        results = http.run(dsn, rows, batches, in_flight)
    save({"mode": "delete", "sink": "http", "results": results})
    return 0


def bench_broker(sink: str, rows: int, batches: list[int], in_flight: int) -> int:
    from bench import brokers

    with PostgresServer(Path(tempfile.mkdtemp(prefix="relay-bench-pg-")), durable=True) as pg:
        dsn = pg.create_database("bench")
        migrate(CommonSettings(database_url=dsn))
        results = brokers.run(sink, dsn, rows, batches, in_flight)
    save({"mode": "delete", "sink": sink, "results": results})
    return 0


def save(report: dict[str, object]) -> None:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    raise SystemExit(main())
