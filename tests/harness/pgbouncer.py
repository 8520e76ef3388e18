"""A real PgBouncer (Debian's package, 1.18) in transaction pooling in front of a test
PostgreSQL: what most production databases sit behind. Its defaults otherwise; 1.18
has no protocol-level prepared statements, so a client that prepares fails here."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg

from tests.harness import Service, alive, free_port
from tests.harness.postgres import PostgresServer

PGBOUNCER = Path("/usr/sbin/pgbouncer")


def pgbouncer_available() -> bool:
    return PGBOUNCER.exists() or shutil.which("pgbouncer") is not None


class PgBouncer(Service):
    """Forwards every database of `server`; knows the users and passwords of `users`, with
    which it logs in to PostgreSQL (clients are trusted: loopback only)."""

    def __init__(self, base_dir: Path, server: PostgresServer, users: dict[str, str]) -> None:
        self.base_dir = Path(base_dir)
        self.server = server
        self.users = users
        self.port = free_port()
        self.host = "127.0.0.1"
        self._as_postgres = os.geteuid() == 0
        self._process: subprocess.Popen[bytes] | None = None
        atexit.register(self.stop)

    @property
    def log_path(self) -> Path:
        return self.base_dir / "pgbouncer.log"

    def _write_config(self) -> Path:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        auth = self.base_dir / "users.txt"
        auth.write_text(
            "".join(f'"{user}" "{password}"\n' for user, password in self.users.items())
        )
        config = self.base_dir / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host={self.server.host} port={self.server.port}\n"
            "[pgbouncer]\n"
            f"listen_addr = {self.host}\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {auth}\n"
            "pool_mode = transaction\n"
            f"logfile = {self.log_path}\n"
            f"pidfile = {self.base_dir / 'pgbouncer.pid'}\n"
        )
        if self._as_postgres:
            shutil.chown(self.base_dir, "postgres", "postgres")
            for path in (auth, config):
                shutil.chown(path, "postgres", "postgres")
        return config

    def start(self) -> None:
        config = self._write_config()
        command = [str(PGBOUNCER if PGBOUNCER.exists() else "pgbouncer"), str(config)]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        self._process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/"
        )
        deadline = time.monotonic() + 20
        user, password = next(iter(self.users.items()))
        while True:
            try:
                with psycopg.connect(self.dsn(user, password), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                    return
            except psycopg.OperationalError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PgBouncer did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGINT (PgBouncer's immediate shutdown) to PgBouncer itself, by its pidfile:
        run through runuser, the child we started is runuser, which does not pass it on."""
        process, self._process = self._process, None
        if process is None:
            return
        pid = self._pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _pid(self) -> int | None:
        try:
            return int((self.base_dir / "pgbouncer.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def dsn(self, user: str, password: str, dbname: str = "postgres") -> str:
        return f"postgresql://{user}:{password}@{self.host}:{self.port}/{dbname}"

    def pooled(self, direct_dsn: str) -> str:
        """`direct_dsn` (a URL to `server`) as it reads through this pooler."""
        info = psycopg.conninfo.conninfo_to_dict(direct_dsn)
        info.update(host=self.host, port=str(self.port))
        return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
