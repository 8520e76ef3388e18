"""The system under test: PostgreSQL, the sink's server, and N `relay run` replicas.

Replicas run as the least-privilege role (migrations/grants.sql), log JSON at debug level
(for `batch.settled`), serve /metrics, and may be armed at a failpoint (relay/failpoints.py)
through their own directory. One replica may run with a skewed wall clock (libfaketime).

Where the sink allows it (tests/chaos/sinks.py), each replica reaches the sink's server
only through a proxy of its own: a fault can cut one replica off from the sink and
nothing else. The recorder and the other harness clients reach the server directly.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from relay.admin.migrate import migrate, migrations_dir
from relay.admin.schema_options import create_shard_indexes
from relay.lease.protocol import shard_lease_name
from relay.settings import CommonSettings
from tests.chaos.producer import LEDGER_DDL
from tests.chaos.sinks import TOPIC, ChaosSink
from tests.conftest import relay_env, start_relay
from tests.harness import free_port
from tests.harness.netcut import TcpProxy
from tests.harness.postgres import PostgresServer

DATABASE = "chaos"
ROLE = "relay"
LIBFAKETIMES = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))


def libfaketime() -> Path | None:
    return LIBFAKETIMES[0] if LIBFAKETIMES else None


@dataclass(slots=True)
class Replica:
    name: str
    log_path: Path
    failpoints: Path
    metrics_port: int
    skew: str | None = None
    proxy: TcpProxy | None = None  # its only way to the sink's server, where one is cut
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    expected_exit: bool = False
    stopped: bool = False
    retired: bool = False  # left the cluster for good (scaled in): heal leaves it down
    unexpected_exits: list[str] = field(default_factory=list)

    @property
    def holder(self) -> str:
        return f"{self.name}.{self.incarnation}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


class Cluster:
    def __init__(
        self,
        workdir: Path,
        sink: ChaosSink,
        *,
        replicas: int,
        settings: dict[str, str],
        shards: int = 1,
    ) -> None:
        self.workdir = workdir
        self.shards = shards
        self.pg = PostgresServer(workdir / "pg")
        self.sink = sink
        self.topic = TOPIC
        self.password = f"chaos-{secrets.token_hex(12)}"
        self.settings = settings
        self.replicas: list[Replica] = []
        for _ in range(replicas):
            self._new_replica()

    def _new_replica(self) -> Replica:
        n = len(self.replicas)
        replica = Replica(
            f"r{n}",
            self.workdir / f"relay-r{n}.log",
            self.workdir / f"failpoints-r{n}",
            free_port(),
        )
        self.sink.attach(replica, n)
        self.replicas.append(replica)
        return replica

    @property
    def netcut(self) -> bool:
        """Can a fault cut one replica off from the sink?"""
        return all(replica.proxy is not None for replica in self.replicas)

    # --- servers ---

    def start_servers(self) -> None:
        self.pg.start()
        admin_dsn = self.pg.create_database(DATABASE)
        migrate(CommonSettings(database_url=admin_dsn))
        create_shard_indexes(CommonSettings(database_url=admin_dsn), self.shards)
        self.pg.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{self.password}'")
        self.pg.execute((migrations_dir() / "grants.sql").read_text(), dbname=DATABASE)
        self.pg.execute(LEDGER_DDL, dbname=DATABASE)
        self.sink.start()
        for replica in self.replicas:
            if replica.proxy is not None:
                replica.proxy.start()

    @property
    def admin_dsn(self) -> str:
        return self.pg.dsn(DATABASE)

    @property
    def relay_dsn(self) -> str:
        # A session to a restarted or paused server gives up in 2 s, not libpq's 5.
        return self.pg.dsn(DATABASE, user=ROLE, password=self.password) + "?connect_timeout=2"

    # --- replicas ---

    def start_replica(self, replica: Replica) -> None:
        replica.incarnation += 1
        replica.failpoints.mkdir(parents=True, exist_ok=True)
        for armed in replica.failpoints.iterdir():
            armed.unlink()
        extra = {
            **self.settings,
            "RELAY_REPLICA_ID": replica.holder,
            "RELAY_LOG_LEVEL": "debug",
            "RELAY_FAILPOINTS": str(replica.failpoints),
            "RELAY_METRICS_PORT": str(replica.metrics_port),
            "RELAY_SHARDS": str(self.shards),
        }
        command = self.sink.replica_command(replica, self.workdir)
        env = relay_env(self.relay_dsn, **extra, **self.sink.replica_env(replica))
        lib = libfaketime()
        if replica.skew and lib is not None:
            # Only the wall clock: an NTP-less node. The lease runs on the database's
            # clock and the relay's own deadlines on the monotonic one.
            env |= {
                "LD_PRELOAD": str(lib),
                "FAKETIME": replica.skew,
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            }
        replica.expected_exit = False
        replica.stopped = False
        replica.proc = start_relay(env, replica.log_path, command)

    def start_replicas(self) -> None:
        for replica in self.replicas:
            self.start_replica(replica)

    def active(self) -> list[Replica]:
        """The replicas that are part of the cluster (running, or down for a fault)."""
        return [r for r in self.replicas if not r.retired]

    def add_replica(self) -> Replica:
        """Scale out: a replica of a new name joins the running cluster."""
        replica = self._new_replica()
        if replica.proxy is not None:
            replica.proxy.start()
        self.start_replica(replica)
        return replica

    def retire(self, replica: Replica) -> None:
        """Scale in: SIGTERM, as Kubernetes does; it releases what it holds and leaves."""
        replica.retired = True
        replica.expected_exit = True
        replica.signal(signal.SIGTERM)
        if replica.proc is not None:
            replica.proc.wait(timeout=60)

    def shares(self) -> dict[str, int] | None:
        """Live lease rows held per holder, if every shard is live and held by an active
        replica; None while one is not (or the database is down)."""
        try:
            with psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=2) as conn:
                rows = conn.execute(
                    "SELECT name, holder FROM leases WHERE name = ANY(%s)"
                    " AND holder IS NOT NULL AND released_at IS NULL AND expires_at > now()",
                    (self.lease_names(),),
                ).fetchall()
        except psycopg.Error:
            return None
        holders = {r.holder for r in self.active() if r.alive()}
        if len(rows) != self.shards or any(row[1] not in holders for row in rows):
            return None
        counts: dict[str, int] = dict.fromkeys(holders, 0)
        for _, holder in rows:
            counts[holder] += 1
        return counts

    def by_holder(self, holder: str | None) -> Replica | None:
        return next((r for r in self.replicas if r.holder == holder), None)

    def kill(self, replica: Replica) -> None:
        replica.expected_exit = True
        replica.signal(signal.SIGKILL)
        if replica.proc is not None:
            replica.proc.wait(timeout=10)

    def note_unexpected_exits(self) -> None:
        for replica in self.replicas:
            if replica.proc is not None and not replica.alive() and not replica.expected_exit:
                replica.unexpected_exits.append(
                    f"{replica.holder} exited with {replica.proc.returncode}"
                )
                replica.expected_exit = True

    def freeze_all(self) -> None:
        for replica in self.replicas:
            replica.signal(signal.SIGSTOP)
            replica.stopped = True

    def thaw_all(self) -> None:
        for replica in self.replicas:
            replica.signal(signal.SIGCONT)
            replica.stopped = False

    def scrape(self, replica: Replica, timeout: float = 60.0) -> str:
        """One /metrics scrape; waits for a replica that is still starting (a fault may
        have restarted it just before, and on a loaded machine its imports take a while)."""
        url = f"http://127.0.0.1:{replica.metrics_port}/metrics"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    body: bytes = response.read()
                return body.decode(errors="replace")
            except urllib.error.URLError:
                if not replica.alive() or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop_replicas(self) -> None:
        for replica in self.replicas:
            replica.signal(signal.SIGCONT)
            replica.expected_exit = True
            replica.signal(signal.SIGTERM)
        for replica in self.replicas:
            if replica.proc is None:
                continue
            try:
                replica.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait(timeout=10)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_replicas()
        for replica in self.replicas:
            if replica.proxy is not None:
                replica.proxy.close()
        self.sink.stop()
        self.pg.stop("immediate")

    # --- reading state ---

    def lease_names(self) -> list[str]:
        return [shard_lease_name("default", n, self.shards) for n in range(self.shards)]

    def lease(self, name: str = "default") -> dict[str, Any] | None:
        """A lease row as the database sees it; None while the database is down."""
        try:
            with psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute(
                    "SELECT holder, epoch, expires_at > now() AS live FROM leases WHERE name = %s",
                    (name,),
                ).fetchone()
        except psycopg.Error:
            return None
        if row is None:
            return None
        return {"holder": row[0], "epoch": int(row[1]), "live": bool(row[2])}

    def unsent(self) -> int | None:
        try:
            with psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute("SELECT count(*) FROM outbox").fetchone()
        except psycopg.Error:
            return None
        return None if row is None else int(row[0])


def make_workdir() -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="relay-chaos-"))
    workdir.chmod(0o755)  # PostgreSQL runs as the postgres user, in a subdirectory
    return workdir
