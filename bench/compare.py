"""`./dev bench --compare [REV]`: this checkout's relay against another commit's, in one run.

Both drain the same pre-loaded backlog as a `relay run` process (bench/cpu.py), runs
alternating old, new, old, new so drift on a shared machine hits both alike; medians
are printed with the ratio new / old (the median of each round's own ratio: drift on a
shared machine moves both sides of a round alike), and each side's throughput against
the bare select-and-mark loop at the same batch size and at batch 2000, measured in the
same run. "This checkout" is the working tree as it is, uncommitted changes included.

Each side runs on a database of its own, on the same server, made by its own
migrations: this checkout's `dsn` (migrated by this checkout), REV's `bench_old` (by
`relay migrate` run from REV's worktree), as a relay of REV would meet its schema. The
rows loaded and the bare loop are the same on both; the loop runs on each database, and
each side's x/raw is against its own database's.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import cpu, drain
from bench.common import preload
from bench.processes import REPO
from tests.harness.postgres import PostgresServer


def run(
    pg: PostgresServer,
    dsn: str,
    bootstrap: str,
    rev: str,
    rows: int,
    batches: list[int],
    rounds: int,
) -> dict[str, Any]:
    report: dict[str, Any] = {"old": cpu.revision(rev), "new": "working tree", "batches": []}
    print(f"\ncompare: {report['old']}  vs  {report['new']}")
    print(
        f"{rows:,} rows of 200 B over 100 keys, the relay at its defaults but the batch"
        f" (rows deleted once sent), {rounds} alternating rounds, each side on a database"
        " its own migrations made; raw = a bare select-and-mark loop on each database"
    )
    with cpu.worktree(rev) as old:
        old_dsn = pg.create_database("bench_old")
        cpu.migrate(old_dsn, old)
        sides = {"old": (old, old_dsn), "new": (REPO, dsn)}
        for source, side_dsn in sides.values():  # warm both up
            cpu.drain(side_dsn, bootstrap, min(rows, 20_000), source=source)
        raw_2000 = _raw(sides, rows, 2000)
        report["raw_2000"] = raw_2000
        print(
            f"raw loop at batch 2000: {raw_2000['old']:,.0f} rows/s on old's database,"
            f" {raw_2000['new']:,.0f} on new's"
        )
        print(
            f"{'batch':>6} {'old raw':>11} {'new raw':>11} {'old rows/s':>11}"
            f" {'new rows/s':>11} {'old µs/msg':>11} {'new µs/msg':>11} {'new/old':>8}"
            f" {'old db µs':>10} {'new db µs':>10} {'db n/o':>7} {'old/raw':>8}"
            f" {'new/raw':>8} {'new/raw2k':>9}"
        )
        # Last, each side at its own defaults (its own RELAY_BATCH_SIZE default), against
        # the raw loop at batch 2000: "the defaults" as a user meets them.
        defaults = f"{_default_batch(old)}/{_default_batch(REPO)}"
        for batch in [*batches, None]:
            raw = raw_2000 if batch is None else _raw(sides, rows, batch)
            runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
            for _ in range(rounds):
                for side, (source, side_dsn) in sides.items():
                    if batch is None:
                        result = cpu.drain(side_dsn, bootstrap, rows, source=source)
                    else:
                        result = cpu.drain(
                            side_dsn, bootstrap, rows, source=source, RELAY_BATCH_SIZE=str(batch)
                        )
                    runs[side].append(result)
            label = defaults if batch is None else str(batch)
            row = {"batch": label, "raw": raw, **_medians(runs)}
            report["batches"].append(row)
            print(
                f"{label:>6} {raw['old']:>11,.0f} {raw['new']:>11,.0f}"
                f" {row['old_rows_per_s']:>11,.0f} {row['new_rows_per_s']:>11,.0f}"
                f" {row['old_cpu_us_per_msg']:>11.2f} {row['new_cpu_us_per_msg']:>11.2f}"
                f" {row['cpu_new_over_old']:>8.2f}"
                f" {row['old_db_cpu_us_per_msg']:>10.2f} {row['new_db_cpu_us_per_msg']:>10.2f}"
                f" {row['db_cpu_new_over_old']:>7.2f}"
                f" {row['old_rows_per_s'] / raw['old']:>8.2f}"
                f" {row['new_rows_per_s'] / raw['new']:>8.2f}"
                f" {row['new_rows_per_s'] / raw_2000['new']:>9.2f}",
                flush=True,
            )
    print(
        "new/old: the relay's CPU per message, lower is better (median of the rounds'"
        " ratios); db µs: the database server's CPU per message in the same window,"
        " db n/o its ratio;"
        " x/raw: throughput against the bare loop on its own database at the same batch,"
        " raw2k: at batch 2000;"
        f" {defaults}: each side at its own default batch size (raw = the loop at 2000)"
    )
    return report


def _raw(sides: dict[str, tuple[Path, str]], rows: int, batch: int) -> dict[str, float]:
    """rows/s of the bare loop at `batch` on each side's database, `rows` loaded first."""
    rates: dict[str, float] = {}
    for side, (_source, side_dsn) in sides.items():
        preload(side_dsn, rows)
        rates[side] = drain.raw_drain(side_dsn, batch, delete=False)
    return rates


def _default_batch(source: Path) -> int:
    """RELAY_BATCH_SIZE's default in the checkout at `source`."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from relay.settings import Settings;"
            " print(Settings.model_fields['batch_size'].default)",
        ],
        cwd=source,
        env={**os.environ, "PYTHONPATH": str(source)},
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout.strip())


def _medians(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, results in runs.items():
        for figure in ("rows_per_s", "cpu_us_per_msg", "db_cpu_us_per_msg"):
            out[f"{side}_{figure}"] = statistics.median(r[figure] for r in results)
        out[f"{side}_runs"] = results
    for figure, ratio in (
        ("cpu_us_per_msg", "cpu_new_over_old"),
        ("db_cpu_us_per_msg", "db_cpu_new_over_old"),
    ):
        out[ratio] = statistics.median(
            new[figure] / old[figure] for old, new in zip(runs["old"], runs["new"], strict=True)
        )
    return out
