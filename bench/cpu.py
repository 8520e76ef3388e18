"""A relay process draining a pre-loaded backlog: rows/s and CPU time per message.

CPU per message is user + system time of the `relay run` process, read from /proc
between the first settled batch and the empty outbox, divided by the rows drained in
that window: far steadier than wall time on a shared machine. The database's CPU per
message is the PostgreSQL server's in the same window (every backend, the bench's own
polling one included, and the background processes): the relay's SQL, where CPU per
message of the relay alone cannot see it. The same function runs
another commit's relay (`--compare`): a `git worktree` of it is started with its own
directory first on the import path, against a database its own `relay migrate` made
(`migrate`) and the same broker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from bench.common import first_unsent_id, preload
from bench.processes import REPO, cpu_seconds, launch, server_cpu_seconds, stop, wait_for


def drain(
    dsn: str,
    bootstrap: str,
    rows: int,
    *,
    source: Path = REPO,
    profile: Path | None = None,
    preloaded: bool = False,
    **env: str,
) -> dict[str, float]:
    """Drain `rows` pre-loaded rows with one relay process run from `source`.

    The outbox is loaded with `rows` fresh rows first, unless `preloaded` (the caller
    loaded it: say, over a history of sent rows).

    `profile`: also record the process with py-spy (on PATH): a flame graph for `.svg`,
    collapsed stacks (one line per stack, with its sample count) otherwise.
    """
    if not preloaded:
        preload(dsn, rows)
    with psycopg.connect(dsn, autocommit=True) as conn:
        first = first_unsent_id(conn)
        row = conn.execute("SELECT max(id) FROM outbox").fetchone()
        assert first is not None and row is not None
        last = int(row[0])
        proc = launch(dsn, bootstrap, {**env, "PYTHONPATH": str(source)}, cwd=source)
        spy: subprocess.Popen[bytes] | None = None
        try:
            if profile is not None:
                spy = subprocess.Popen(
                    [
                        *("py-spy", "record", "-p", str(proc.pid), "-o", str(profile)),
                        "--format",
                        "flamegraph" if profile.suffix == ".svg" else "raw",
                        *("--gil", "--rate", "500"),  # where the GIL is: Python's own CPU
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            current = wait_for(lambda: _moved(conn, first), 120, "the first settled batch")
            cpu_before, started = cpu_seconds(proc.pid), time.perf_counter()
            server_before = server_cpu_seconds(conn)
            left = 0 if current == -1 else last - current + 1
            while first_unsent_id(conn) is not None:
                time.sleep(0.02)
            elapsed = time.perf_counter() - started
            cpu = cpu_seconds(proc.pid) - cpu_before
            server = server_cpu_seconds(conn) - server_before
        finally:
            stop([proc])
            if spy is not None:
                spy.wait(60)
    return {
        "rows": left,
        "rows_per_s": left / elapsed,
        "cpu_us_per_msg": 1e6 * cpu / left,
        "cpu_cores": cpu / elapsed,
        "db_cpu_us_per_msg": 1e6 * server / left,
    }


def _moved(conn: psycopg.Connection[Any], first: int) -> int | None:
    """The new lowest unsent id once the first batch is settled (-1: all of it)."""
    current = first_unsent_id(conn)
    if current == first:
        return None
    return -1 if current is None else current


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A checkout of `rev` beside the repository, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="relay-bench-rev-"))
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
            check=False,
            capture_output=True,
        )


def migrate(dsn: str, source: Path) -> None:
    """`relay migrate` run from the checkout at `source` on the database at `dsn`: its
    own migrations, for its relay to run on the schema it was written for."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update({"RELAY_DATABASE_URL": dsn, "PYTHONPATH": str(source)})
    done = subprocess.run(
        [sys.executable, "-m", "relay", "migrate"],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench: relay migrate from {source} failed:\n{done.stderr}")


def revision(rev: str, source: Path = REPO) -> str:
    """`abc1234 subject` of a commit, for the table's header."""
    done = subprocess.run(
        ["git", "-C", str(source), "log", "-1", "--format=%h %s", rev],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()[:72]
