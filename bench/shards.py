"""Sharded leases: drain rate and CPU per message for RELAY_SHARDS x replicas.

For each shard count N in (1, 2, 4) and 1, 2 or 3 `relay run` processes: start the
replicas on an empty outbox, wait until every shard lease is held in a fair split that
stays put (so the figure is steady-state draining, not rebalancing), snapshot CPU, commit
a backlog in one transaction, and time commit -> no unsent row left. CPU (utime + stime
from /proc) is the delta over that window, summed over the replicas; PostgreSQL's (the
postmaster and its children) and the broker's are measured over the same window, so the
cost of a message can be split between relay, database and broker. Retention mode (rows
are moved to outbox_sent as they are settled), so "drained" means no row left to send.
Each count runs with only its own shard indexes present, as a deployment would.
50,000 rows over 200 keys, two whole rounds (--quick: 6,000 rows, one): 20,000 drain in
about half a second, where the idle poll's wake-up and the 20 ms completion poll weigh.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench.common import PAYLOAD, TOPIC
from bench.processes import cpu_seconds, start_relay, stop, wait_for
from relay.admin.schema_options import create_shard_indexes, shard_index_names
from relay.settings import CommonSettings

SHARD_COUNTS = (1, 2, 4)
REPLICA_COUNTS = (1, 2, 3)
KEYS = 200
BATCH = 500
# Short lease timings (as tests/test_shards.py) so the split settles in seconds.
TTL = 3.0
STANDBY_POLL = min(0.5, TTL / 15)  # what the relay derives from the ttl
HEARTBEAT = min(2.0, TTL / 5)  # what the relay derives from the ttl
STABLE_SECONDS = 3 * HEARTBEAT  # the split must hold still this long before loading
DRAIN_TIMEOUT = 180.0

Conn = psycopg.Connection[tuple[Any, ...]]
Row = dict[str, Any]


def _wait(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll every 20 ms: gently, the relays under measurement share the two cores."""
    return wait_for(condition, timeout, what, interval=0.02)


def _start(dsn: str, bootstrap: str, shards: int, replica_id: str) -> subprocess.Popen[bytes]:
    """One replica, in retention mode (sent rows are kept, in outbox_sent)."""
    return start_relay(
        dsn,
        bootstrap,
        RELAY_SHARDS=str(shards),
        RELAY_REPLICA_ID=replica_id,
        RELAY_LEASE_TTL_SECONDS=str(TTL),
        RELAY_BATCH_SIZE=str(BATCH),
        RELAY_RETENTION_SECONDS="86400",
    )


def _reset(conn: Conn) -> None:
    """An empty outbox and no lease, group or heartbeat rows left by the previous
    configuration (no relay runs now), so a new shard count starts at once."""
    conn.execute("TRUNCATE outbox")
    conn.execute("DELETE FROM replicas")
    conn.execute("DELETE FROM leases")
    conn.execute("DELETE FROM lease_groups")
    conn.execute("VACUUM ANALYZE outbox")


def _drop_shard_indexes(conn: Conn, shards: int) -> None:
    for name in shard_index_names(shards):
        conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(name)))


def _holders(conn: Conn, shards: int) -> dict[int, str | None]:
    """shard -> live holder. One shard is the plain lease `default` (no lease_group)."""
    rows = conn.execute(
        "SELECT shard, CASE WHEN expires_at > now() THEN holder END FROM leases"
        " WHERE coalesce(lease_group, name) = 'default' AND shards = %s",
        (shards,),
    ).fetchall()
    return {int(r[0]): r[1] for r in rows}


def _able(conn: Conn, ids: list[str]) -> bool:
    """Every replica has a fresh heartbeat saying it reaches the broker: each one's
    fair share is computed over all of them from now on."""
    row = conn.execute(
        "SELECT count(*) FROM replicas WHERE replica_id = ANY(%s) AND sink_ok"
        " AND seen_at > now() - interval '2 seconds'",
        (ids,),
    ).fetchone()
    return row is not None and int(row[0]) == len(ids)


def _fair_split(conn: Conn, shards: int, ids: list[str]) -> tuple[int, ...] | None:
    """Shards held per replica (in `ids` order) if every shard is held by one of them
    and none holds more than ceil(N / replicas); else None."""
    held = _holders(conn, shards)
    if len(held) != shards or not all(h in ids for h in held.values()):
        return None
    per = Counter(held.values())
    cap = math.ceil(shards / len(ids))
    if any(n > cap for n in per.values()):
        return None
    return tuple(per.get(i, 0) for i in ids)


def _settled_split(conn: Conn, shards: int, ids: list[str]) -> tuple[int, ...]:
    """Wait for the replicas to see each other, then for a fair split that holds still
    for STABLE_SECONDS (a hand-over in progress would otherwise be timed)."""
    _wait(lambda: _able(conn, ids), 60, "every replica's heartbeat")
    deadline = time.monotonic() + 60
    while True:
        split = _wait(lambda: _fair_split(conn, shards, ids), 60, f"a fair split of {shards}")
        time.sleep(STABLE_SECONDS)
        if _fair_split(conn, shards, ids) == split:
            return tuple(split)
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: the split of {shards} shards kept changing")


def _children_of(ppid: int) -> list[int]:
    """Live processes whose parent is `ppid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
            found.append(int(entry.name))
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cpu(pids: list[int]) -> float:
    """utime + stime summed over `pids` (every thread), skipping any that went away."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except OSError:
            continue
    return total


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat: whatever runs, not only ours."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class Servers:
    """The PostgreSQL and broker processes behind the DSN and the bootstrap address."""

    def __init__(self, conn: Conn) -> None:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        self.own_backend = int(row[0])  # the bench's loader and poller: not the relay's cost
        stat = Path(f"/proc/{self.own_backend}/stat").read_text()
        self.postmaster = int(stat.rsplit(")", 1)[1].split()[1])
        # Tansu is a child of this process (tests/harness/kafka.py).
        brokers = [p for p in _children_of(os.getpid()) if _comm(p).startswith("tansu")]
        self.broker = brokers[0] if len(brokers) == 1 else None

    def database_cpu(self) -> float:
        """The postmaster and every child: backends, WAL writer, checkpointer, autovacuum."""
        children = [p for p in _children_of(self.postmaster) if p != self.own_backend]
        return _cpu([self.postmaster, *children])

    def broker_cpu(self) -> float | None:
        return None if self.broker is None else _cpu([self.broker])


@dataclass(frozen=True, slots=True)
class Cpu:
    """CPU seconds so far: the replicas, PostgreSQL, the broker; and the machine's
    busy and total jiffies."""

    relay: float
    database: float
    broker: float | None
    busy: float
    total: float

    @classmethod
    def sample(cls, servers: Servers, relays: list[int]) -> Cpu:
        return cls(_cpu(relays), servers.database_cpu(), servers.broker_cpu(), *_machine_busy())


def _load(conn: Conn, rows: int, sample: Callable[[], Cpu]) -> tuple[float, Cpu]:
    """Commit `rows` rows over KEYS keys in one transaction, analyzed in it (the relays
    plan their fetches with the backlog's statistics): the commit instant, and CPU
    sampled just before it (the relays cannot see a row before then)."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO outbox (topic, key, payload)"
            " SELECT %s, 'k' || (g %% %s), %s FROM generate_series(1, %s) g",
            (TOPIC, KEYS, PAYLOAD, rows),
        )
        conn.execute("ANALYZE outbox")
        before = sample()
    return time.perf_counter(), before


def _unsent(conn: Conn) -> bool:
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM outbox)").fetchone()
    return bool(row and row[0])


def _busiest_share(conn: Conn, shards: int) -> float:
    """The largest shard's share of the rows (1/N when keys hash evenly): a replica
    count cannot drain faster than the shard that has the most to do."""
    row = conn.execute(
        "SELECT max(n)::float / sum(n) FROM (SELECT count(*) AS n FROM outbox"
        " GROUP BY outbox_shard(key, id, %s)) s",
        (shards,),
    ).fetchone()
    return 1.0 if row is None or row[0] is None else float(row[0])


def measure(
    conn: Conn, servers: Servers, dsn: str, bootstrap: str, shards: int, replicas: int, rows: int
) -> Row:
    """One cell: `replicas` processes with RELAY_SHARDS=`shards` drain `rows` rows."""
    _reset(conn)
    ids = [f"bench-{shards}x{replicas}-r{i}" for i in range(replicas)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for replica_id in ids:
            procs.append(_start(dsn, bootstrap, shards, replica_id))
        split = _settled_split(conn, shards, ids)
        pids = [p.pid for p in procs]
        committed, before = _load(conn, rows, lambda: Cpu.sample(servers, pids))
        _wait(lambda: not _unsent(conn), DRAIN_TIMEOUT, "the backlog drained")
        elapsed = time.perf_counter() - committed
        end = Cpu.sample(servers, pids)
        split_end = _fair_split(conn, shards, ids)
        exited = [p.pid for p in procs if p.poll() is not None]
        if exited:
            raise RuntimeError(f"bench: relay processes {exited} exited during the run")
    finally:
        stop(procs)
    relay = end.relay - before.relay
    broker = None if before.broker is None or end.broker is None else end.broker - before.broker
    return {
        "shards": shards,
        "replicas": replicas,
        "rows": rows,
        "split": sorted(split, reverse=True),
        "split_after": None if split_end is None else sorted(split_end, reverse=True),
        "seconds": elapsed,
        "rows_per_s": rows / elapsed,
        "relay_cpu_us_per_msg": relay / rows * 1e6,
        "relay_cores": relay / elapsed,
        "db_cpu_us_per_msg": (end.database - before.database) / rows * 1e6,
        "broker_cpu_us_per_msg": None if broker is None else broker / rows * 1e6,
        # Both cores, whoever used them (the test suite may run beside the bench).
        "machine_busy_percent": 100 * (end.busy - before.busy) / (end.total - before.total),
        "busiest_shard_share": _busiest_share(conn, shards),
    }


MEANS = (
    "rows_per_s",
    "seconds",
    "relay_cpu_us_per_msg",
    "relay_cores",
    "db_cpu_us_per_msg",
    "broker_cpu_us_per_msg",
    "machine_busy_percent",
    "busiest_shard_share",
)


def _summary(runs: list[Row]) -> list[Row]:
    """One row per (shards, replicas): the mean of its rounds, each round's rate, and the
    ratio to 1 shard x 1 replica of the same run."""
    cells: dict[tuple[int, int], list[Row]] = {}
    for r in runs:
        cells.setdefault((r["shards"], r["replicas"]), []).append(r)
    table: list[Row] = []
    for (shards, replicas), rounds in cells.items():
        row: Row = {"shards": shards, "replicas": replicas, "rows": rounds[0]["rows"]}
        for field in MEANS:
            values = [r[field] for r in rounds if r[field] is not None]
            row[field] = statistics.mean(values) if values else None
        row["rounds_rows_per_s"] = [r["rows_per_s"] for r in rounds]
        row["splits"] = sorted({"/".join(map(str, r["split"])) for r in rounds})
        table.append(row)
    base = table[0]["rows_per_s"]
    for row in table:
        row["ratio"] = row["rows_per_s"] / base
    return table


def _print(rows: int, rounds: int, table: list[Row]) -> None:
    print(
        f"\n11. sharded leases: {rows:,} rows of 200 B over {KEYS} keys committed at once,"
        f" batch {BATCH}, retention mode; commit -> all sent; mean of {rounds} round(s)"
    )
    print(
        f"{'shards':>6} {'replicas':>8} {'held':>7} {'rows/s':>8} {'ratio':>6}"
        f" {'relay µs/msg':>12} {'relay cores':>11} {'pg µs/msg':>9} {'broker µs/msg':>13}"
        f" {'busy':>5} {'top shard':>9}  rounds (rows/s)"
    )
    for r in table:
        broker = r["broker_cpu_us_per_msg"]
        print(
            f"{r['shards']:>6} {r['replicas']:>8} {','.join(r['splits']):>7}"
            f" {r['rows_per_s']:>8,.0f} {r['ratio']:>6.2f} {r['relay_cpu_us_per_msg']:>12.0f}"
            f" {r['relay_cores']:>11.2f} {r['db_cpu_us_per_msg']:>9.0f}"
            f" {'-' if broker is None else f'{broker:.0f}':>13}"
            f" {r['machine_busy_percent']:>4.0f}% {100 * r['busiest_shard_share']:>8.0f}%  "
            + " ".join(f"{v:,.0f}" for v in r["rounds_rows_per_s"]),
            flush=True,
        )
    print(
        "    held: shards per replica; relay cores: CPU of all replicas / wall time;"
        " busy: both cores, whoever used them; top shard: the busiest shard's share of rows",
        flush=True,
    )


def run(dsn: str, bootstrap: str, quick: bool, rows: int | None = None) -> dict[str, Any]:
    rows = rows or (6_000 if quick else 50_000)
    rounds = 1 if quick else 2
    settings = CommonSettings(database_url=dsn)
    runs: list[Row] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        servers = Servers(conn)
        # Whole rounds one after the other: drift of the shared machine hits every cell.
        for round_ in range(rounds):
            for shards in SHARD_COUNTS:
                create_shard_indexes(settings, shards)  # `relay migrate --shards N`; none for 1
                for replicas in REPLICA_COUNTS:
                    result = measure(conn, servers, dsn, bootstrap, shards, replicas, rows)
                    runs.append({**result, "round": round_})
                _drop_shard_indexes(conn, shards)
        _reset(conn)
    table = _summary(runs)
    _print(rows, rounds, table)
    return {
        "rows": rows,
        "keys": KEYS,
        "batch": BATCH,
        "mode": "keep",
        "rounds": rounds,
        "lease_ttl_seconds": TTL,
        "standby_poll_seconds": STANDBY_POLL,
        "heartbeat_seconds": HEARTBEAT,
        "table": table,
        "runs": runs,
    }
