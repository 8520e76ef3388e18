"""Through a transaction pooler: the relay draining a backlog through PgBouncer 1.18
(transaction pooling, its defaults) against the same relay connected directly, in
alternating rounds on one database, at the relay's defaults (docs/howto/poolers.md).

Through the pooler each statement outside a transaction runs in one of its own after
the session's settings, and nothing is prepared; the ratio is what that costs."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench import cpu
from tests.harness.pgbouncer import PgBouncer
from tests.harness.postgres import SUPERUSER, SUPERUSER_PASSWORD, PostgresServer


def run(pg: PostgresServer, dsn: str, bootstrap: str, quick: bool) -> dict[str, object]:
    rows = 200_000 if quick else 500_000
    rounds = 3
    base = Path(tempfile.mkdtemp(prefix="relay-bench-pgbouncer-"))
    with PgBouncer(base, pg, {SUPERUSER: SUPERUSER_PASSWORD}) as bouncer:
        pooled = bouncer.pooled(dsn)
        direct: list[float] = []
        through: list[float] = []
        for _ in range(rounds):
            direct.append(cpu.drain(dsn, bootstrap, rows)["rows_per_s"])
            through.append(cpu.drain(dsn, bootstrap, rows, RELAY_DATABASE_URL=pooled)["rows_per_s"])
    ratios = [t / d for t, d in zip(through, direct, strict=True)]
    report: dict[str, object] = {
        "rows": rows,
        "rounds": rounds,
        "direct_rows_per_s": direct,
        "pooled_rows_per_s": through,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    print(f"\nthrough PgBouncer 1.18 (transaction pooling), {rows} rows, defaults, {rounds} rounds")
    print(f"  {'round':>5} {'direct rows/s':>14} {'pooled rows/s':>14} {'ratio':>6}")
    for n, (d, t) in enumerate(zip(direct, through, strict=True), 1):
        print(f"  {n:>5} {d:>14,.0f} {t:>14,.0f} {t / d:>6.2f}")
    print(
        f"  ratio median {report['ratio_median']:.2f}"
        f" (spread {report['ratio_min']:.2f}-{report['ratio_max']:.2f})"
    )
    return report
