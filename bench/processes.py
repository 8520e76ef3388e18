"""Idle CPU, failover times and memory, measured on real `relay run` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.common import PAYLOAD, TOPIC, preload

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def start_relay(dsn: str, bootstrap: str, **extra: str) -> subprocess.Popen[bytes]:
    return launch(dsn, bootstrap, extra)


def launch(
    dsn: str, bootstrap: str, extra: dict[str, str], cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """`relay run` as a process; `cwd`: a checkout to run it from (`-m` imports from
    the working directory first)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(
        {
            "RELAY_DATABASE_URL": dsn,
            "RELAY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "RELAY_METRICS_PORT": "0",
            "RELAY_LOG_FORMAT": "json",
            "RELAY_LOG_LEVEL": "warning",
            "PYTHONPATH": str(REPO),
        }
    )
    env.update(extra)
    log = tempfile.NamedTemporaryFile(prefix="relay-bench-", suffix=".log", delete=False)  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "relay", "run"],
        env=env,
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _stat(path: Path) -> list[str]:
    """A /proc/<pid>/stat line's fields after the command (which may hold spaces):
    [0] state, [1] ppid, [11:13] utime and stime, [13:15] cutime and cstime."""
    return path.read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def server_cpu_seconds(conn: psycopg.Connection[Any]) -> float:
    """CPU time of the PostgreSQL server behind `conn`: its postmaster's and every
    live child's, each with the children it has reaped (utime + stime + cutime +
    cstime). A backend that exits in the window is reaped by the postmaster, so its
    time moves into the postmaster's cutime and is still counted."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    postmaster = _stat(Path(f"/proc/{row[0]}/stat"))[1]
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = _stat(stat)
        except OSError:  # exited while we looked: its time is in the postmaster's now
            continue
        if postmaster in (stat.parent.name, fields[1]):
            total += sum(int(f) for f in fields[11:15])
    return total / TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def holder(conn: psycopg.Connection[Any]) -> str | None:
    row = conn.execute(
        "SELECT holder FROM leases WHERE name = 'default' AND expires_at > now()"
    ).fetchone()
    return None if row is None else row[0]


def wait_for(condition: Any, timeout: float, what: str, interval: float = 0.005) -> Any:
    """Poll `condition` until it is truthy; a longer `interval` polls gently where the
    processes under measurement share the cores with the poller."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: timed out waiting for {what}")
        time.sleep(interval)
    return value


def idle_cpu(dsn: str, bootstrap: str, seconds: float) -> dict[str, float]:
    """Share of one core a leader and a standby use on an empty outbox."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        procs = [start_relay(dsn, bootstrap) for _ in range(2)]
        try:
            leader_id = wait_for(lambda: holder(conn), 30, "a lease holder")
            time.sleep(2.0)  # start-up work done
            leader_pid = int(leader_id.split(":")[1])
            standby = next(p for p in procs if p.pid != leader_pid)
            before = {p.pid: cpu_seconds(p.pid) for p in procs}
            time.sleep(seconds)
            used = {p.pid: cpu_seconds(p.pid) - before[p.pid] for p in procs}
        finally:
            stop(procs)
    return {
        "seconds": seconds,
        "leader_cpu_percent": 100 * used[leader_pid] / seconds,
        "standby_cpu_percent": 100 * used[standby.pid] / seconds,
    }


class Trickle(threading.Thread):
    """Inserts one row every 10 ms, remembering when each id was committed."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop_event = threading.Event()
        self.committed: list[tuple[int, float]] = []

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop_event.wait(0.01):
                row = conn.execute(
                    "INSERT INTO outbox (topic, key, payload) VALUES (%s, 'k', %s) RETURNING id",
                    (TOPIC, PAYLOAD),
                ).fetchone()
                assert row is not None
                self.committed.append((int(row[0]), time.monotonic()))


def failover(dsn: str, bootstrap: str, ttl: float) -> dict[str, float]:
    """SIGTERM and SIGKILL of the leader -> a row committed after the signal is published
    (and deleted) by the other replica."""
    env = {"RELAY_LEASE_TTL_SECONDS": str(ttl)}
    results: dict[str, float] = {"ttl_seconds": ttl}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        trickle = Trickle(dsn)
        trickle.start()
        procs = [start_relay(dsn, bootstrap, **env) for _ in range(2)]
        try:
            for name, sig in (("sigterm", signal.SIGTERM), ("sigkill", signal.SIGKILL)):
                leader_id = wait_for(lambda: holder(conn), 30, "a lease holder")
                time.sleep(ttl)  # the standby settled into its polling rhythm
                pid = int(leader_id.split(":")[1])
                leader = next(p for p in procs if p.pid == pid)
                signalled = time.monotonic()
                os.kill(pid, sig)
                leader.wait(60)
                first_after = wait_for(
                    lambda t=signalled: next((i for i, at in trickle.committed if at > t), None),
                    10,
                    "a row committed after the signal",
                )

                def published(row_id: int = first_after) -> bool:
                    row = conn.execute("SELECT 1 FROM outbox WHERE id = %s", (row_id,)).fetchone()
                    return row is None

                wait_for(published, 60, "the other replica to publish")
                results[f"{name}_seconds"] = time.monotonic() - signalled
                procs.remove(leader)
                procs.append(start_relay(dsn, bootstrap, **env))
        finally:
            trickle.stop_event.set()
            stop(procs)
    return results


def memory(dsn: str, bootstrap: str, backlog: int) -> dict[str, float]:
    """RSS of the leader with `backlog` rows waiting: at start, at peak, after draining."""
    preload(dsn, backlog)
    with psycopg.connect(dsn, autocommit=True) as conn:
        proc = start_relay(dsn, bootstrap)
        try:
            wait_for(lambda: holder(conn), 30, "a lease holder")
            start = rss_mib(proc.pid)
            peak = start
            started = time.monotonic()
            while True:
                peak = max(peak, rss_mib(proc.pid))
                # Drained: the outbox holds only rows still to send.
                row = conn.execute("SELECT EXISTS (SELECT 1 FROM outbox)").fetchone()
                if row is not None and not row[0]:
                    break
                time.sleep(0.2)
            drained = time.monotonic() - started
            time.sleep(1.0)
            end = rss_mib(proc.pid)
        finally:
            stop([proc])
    return {
        "backlog_rows": backlog,
        "rss_start_mib": start,
        "rss_peak_mib": peak,
        "rss_after_mib": end,
        "drain_rows_per_s": backlog / drained,
    }
