"""Real servers for the suite: one PostgreSQL and one Tansu broker per session, a fresh
database per test (cloned from a migrated template), a fresh topic per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay.admin.migrate import migrate, migrations_dir
from relay.settings import CommonSettings, Settings
from tests import model_runs
from tests.harness.kafka import TansuBroker
from tests.harness.postgres import PostgresServer

# The sinks' servers and the contract suite's `target` fixture.
pytest_plugins = ["tests.sink_targets"]

TEMPLATE_DB = "relay_template"
RELAY_ROLE = "relay"
RELAY_ROLE_PASSWORD = "relay-secret-pw"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def pg() -> Iterator[PostgresServer]:
    base = Path(tempfile.mkdtemp(prefix="relay-pg-"))
    server = PostgresServer(base)
    server.start()
    try:
        _prepare_template(server)
        yield server
    finally:
        server.stop("immediate")


def _prepare_template(server: PostgresServer) -> None:
    dsn = server.create_database(TEMPLATE_DB)
    migrate(CommonSettings(database_url=dsn))
    server.execute(f"CREATE ROLE {RELAY_ROLE} LOGIN PASSWORD '{RELAY_ROLE_PASSWORD}'")
    grants = (migrations_dir() / "grants.sql").read_text()
    server.execute(grants, dbname=TEMPLATE_DB)


@pytest.fixture(scope="session")
def kafka() -> Iterator[TansuBroker]:
    broker = TansuBroker()
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def database(pg: PostgresServer) -> Iterator[str]:
    """DSN (superuser) of a fresh, migrated database for this test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    dsn = pg.create_database(name, template=TEMPLATE_DB)
    yield dsn
    pg.drop_database(name)


@pytest.fixture
def empty_db(pg: PostgresServer) -> Iterator[str]:
    """DSN (superuser) of a new database with nothing in it: not migrated."""
    name = f"m_{uuid.uuid4().hex[:10]}"
    dsn = pg.create_database(name)
    yield dsn
    pg.drop_database(name)


@pytest.fixture
def relay_dsn(pg: PostgresServer, database: str) -> str:
    """The same database, as the least-privilege relay role."""
    dbname = database.rsplit("/", 1)[1]
    return pg.dsn(dbname, user=RELAY_ROLE, password=RELAY_ROLE_PASSWORD)


@pytest.fixture
def topic(kafka: TansuBroker) -> str:
    name = f"orders-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(name, partitions=3)
    return name


SettingsFactory = Callable[..., Settings]


@pytest.fixture
def make_settings(relay_dsn: str, request: pytest.FixtureRequest) -> SettingsFactory:
    """Settings for an in-process relay; fast timings so tests stay short. The Kafka
    broker is started only for the Kafka sink (the default) without a bootstrap given."""

    def factory(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": relay_dsn,
            "metrics_port": 0,
            "lease_ttl_seconds": 3.0,
            "batch_size": 100,
            "sink_timeout_seconds": 5.0,
            "retry_base_seconds": 0.1,
            "retry_max_seconds": 1.0,
            "log_format": "json",
        }
        values.update(overrides)
        if values.get("sink", "kafka") == "kafka" and "kafka_bootstrap_servers" not in values:
            values["kafka_bootstrap_servers"] = request.getfixturevalue("kafka").bootstrap_servers
        return Settings(**values)

    return factory


def relay_env(dsn: str, bootstrap: str | None = None, **extra: str) -> dict[str, str]:
    """Environment for a `relay` subprocess: only RELAY_* from here, nothing inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(
        {
            "RELAY_DATABASE_URL": dsn,
            "RELAY_LOG_FORMAT": "json",
            "RELAY_METRICS_PORT": "0",
            "PYTHONPATH": str(REPO),
        }
    )
    if bootstrap is not None:
        env["RELAY_KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    env.update(extra)
    return env


def relay_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "relay", *args]


def relay_migrate(database: str, *args: str) -> None:
    """`relay migrate ARGS` in a process of its own, which must succeed."""
    done = relay_migrate_run(database, *args)
    assert done.returncode == 0, done.stderr


def relay_migrate_run(database: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`relay migrate ARGS` in a process of its own, however it ends."""
    return subprocess.run(
        relay_command("migrate", *args),
        env=relay_env(database),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def start_relay(
    env: dict[str, str], log_path: Path, command: Sequence[str] | None = None
) -> subprocess.Popen[bytes]:
    """`relay run`, or `command` (the same wrapped, e.g. in its own namespace)."""
    log_file = log_path.open("ab")
    return subprocess.Popen(
        list(command or relay_command("run")),
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )


def connect(dsn: str) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(dsn, autocommit=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The Spin checks start now, beside the suite (tests/model_runs.py), when spin and
    gcc are there (else their tests fail, saying so). Not in a pytest-xdist worker: each
    collects every test, and only one runs them (then, when it reaches them)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if shutil.which("spin") and shutil.which("gcc"):
        model_runs.start(item.name for item in session.items)
