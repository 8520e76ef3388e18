"""The relay through a real PgBouncer 1.18 in transaction pooling, at its defaults: what
most production databases sit behind. A session there is one server connection only
for one transaction, and 1.18 keeps no prepared statement across them."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from relay.errors import SettingsError
from relay.settings import CommonSettings
from relay.store import connection, db
from tests.conftest import (
    RELAY_ROLE,
    RELAY_ROLE_PASSWORD,
    TEMPLATE_DB,
    relay_command,
    relay_env,
    start_relay,
)
from tests.harness import free_port
from tests.harness.kafka import TansuBroker, consume
from tests.harness.pgbouncer import PgBouncer, pgbouncer_available
from tests.harness.postgres import SUPERUSER, SUPERUSER_PASSWORD, PostgresServer
from tests.support import (
    assert_per_key_order,
    dedup_by_message_id,
    insert_rows,
    keyed_rows,
    lease,
    live_holder,
    new_holder,
    pid_of,
    scalar,
    wait_until,
)
from tests.test_console import PROXY_HEADER, grant_console

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not pgbouncer_available(), reason="pgbouncer not installed"),
]

# What a relay's log says when a statement met another server connection than the one
# it was prepared on, or a pooler's refusal of a session feature.
POOLING_ERRORS = ("prepared statement", "DuplicatePreparedStatement", "InvalidSqlStatementName")
CONSOLE_PASSWORD = "console-pw"


@pytest.fixture(scope="module")
def bouncer(pg: PostgresServer) -> Iterator[PgBouncer]:
    users = {
        SUPERUSER: SUPERUSER_PASSWORD,
        RELAY_ROLE: RELAY_ROLE_PASSWORD,
        "relay_console": CONSOLE_PASSWORD,
    }
    with PgBouncer(Path(tempfile.mkdtemp(prefix="relay-pgbouncer-")), pg, users) as pooler:
        yield pooler


@pytest.fixture
def pooled(bouncer: PgBouncer, relay_dsn: str) -> str:
    """The test's database as the relay role sees it through PgBouncer."""
    return bouncer.pooled(relay_dsn)


@contextmanager
def two_relays(env: dict[str, str], tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two `relay run` processes through the pooler, whose logs must hold no pooling
    error once they stopped (killed, if still running)."""
    logs = [tmp_path / f"relay-{n}.log" for n in range(2)]
    procs = [start_relay(env, log) for log in logs]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=20)
    for log in logs:
        assert pooling_errors(log) == [], log.read_text()[-3000:]


def pooling_errors(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    return [line for line in lines if any(e in line for e in POOLING_ERRORS)]


def test_the_relay_finds_the_pooler_and_keeps_its_timeouts_per_transaction(
    pooled: str, relay_dsn: str
) -> None:
    settings = CommonSettings(database_url=pooled, database_statement_timeout_seconds=0.2)
    with db.connect(settings, purpose="status") as conn:
        assert isinstance(conn, connection.RelayConnection) and conn.pooled
        assert conn.prepare_threshold is None  # nothing prepared: the next may meet another
        assert conn.execute("SHOW jit").fetchone() == {"jit": "off"}
        # The timeout holds on a statement outside a transaction, and inside one.
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(1)")
        with pytest.raises(psycopg.errors.QueryCanceled), conn.transaction():
            conn.execute("SELECT 1")
            conn.execute("SELECT pg_sleep(1)")
        for _ in range(10):  # past psycopg's threshold for preparing a statement
            assert conn.execute("SELECT %s::int AS n", (7,)).fetchone() == {"n": 7}
    # Nothing of it stayed on the server connections for the pooler's next client.
    with psycopg.connect(pooled, autocommit=True) as other:
        for _ in range(3):
            assert other.execute("SHOW statement_timeout").fetchone() == ("0",)
    with db.connect(CommonSettings(database_url=relay_dsn), purpose="status") as direct:
        assert isinstance(direct, connection.RelayConnection) and not direct.pooled


def test_a_backlog_drains_through_the_pooler_in_order_without_an_error(
    pooled: str, database: str, kafka: TansuBroker, topic: str, tmp_path: Path
) -> None:
    rows = keyed_rows(keys=50, per_key=100)
    insert_rows(database, topic, rows)
    env = relay_env(
        pooled,
        kafka.bootstrap_servers,
        RELAY_LEASE_TTL_SECONDS="3",
        RELAY_DATABASE_SYNCHRONOUS_COMMIT="on",
    )
    with two_relays(env, tmp_path) as procs:
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox") == 0,
            timeout=60,
            message="the backlog drained",
        )
        records = consume(kafka.bootstrap_servers, topic, min_count=len(rows), timeout=30)
        assert len(dedup_by_message_id(records)) == len(rows)
        assert_per_key_order(records)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(timeout=20) for proc in procs] == [0, 0]


def test_a_killed_holders_lease_is_taken_over_and_its_epoch_fenced_through_the_pooler(
    pooled: str, database: str, kafka: TansuBroker, topic: str, tmp_path: Path
) -> None:
    env = relay_env(
        pooled,
        kafka.bootstrap_servers,
        RELAY_LEASE_TTL_SECONDS="2",
        RELAY_BATCH_SIZE="50",
    )
    with two_relays(env, tmp_path):
        first = wait_until(lambda: live_holder(database), timeout=20, message="a holder")
        _, epoch = lease(database)
        rows = keyed_rows(keys=20, per_key=20)
        insert_rows(database, topic, rows[:200])
        wait_until(lambda: scalar(database, "SELECT count(*) FROM outbox") < 200, timeout=20)
        os.kill(pid_of(first), signal.SIGKILL)
        insert_rows(database, topic, rows[200:])
        second = wait_until(
            lambda: new_holder(database, first), timeout=15, message="the standby taking over"
        )
        assert lease(database)[1] > epoch
        wait_until(lambda: scalar(database, "SELECT count(*) FROM outbox") == 0, timeout=60)
        records = consume(kafka.bootstrap_servers, topic, min_count=len(rows), timeout=30)
        assert len(dedup_by_message_id(records)) == len(rows)
        assert_per_key_order(records)
        assert second != first


def run_cli(dsn: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        relay_command(*args),
        env=relay_env(dsn, **extra),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_commands_work_through_the_pooler(pooled: str, database: str, topic: str) -> None:
    insert_rows(database, topic, keyed_rows(keys=3, per_key=2))
    with psycopg.connect(database, autocommit=True) as conn:
        row_id = conn.execute(
            "SELECT outbox_dead_letter(ARRAY[(SELECT min(id) FROM outbox)], ARRAY[1],"
            " ARRAY['refused by the test'])"
        ).fetchone()
    assert row_id is not None
    sinkless = {"RELAY_SINK": "http", "RELAY_HTTP_URL": "http://127.0.0.1:9/{topic}"}
    for args in (
        ("status",),
        ("status", "--json"),
        ("check",),
        ("dead-letter", "list"),
        ("dead-letter", "requeue", "--all"),
        ("purge", "--older-than", "1h"),
    ):
        done = run_cli(pooled, *args, **sinkless)
        output = done.stdout + done.stderr
        # check reaches the database and then the (absent) receiver: the database half.
        if args == ("check",):
            assert "database: ok" in output, output
        else:
            assert done.returncode == 0, (args, output)
        assert not [e for e in POOLING_ERRORS if e in output], (args, output)
    assert scalar(database, "SELECT count(*) FROM outbox_dead") == 0  # requeued


def test_the_console_serves_its_pages_through_the_pooler(
    bouncer: PgBouncer, pg: PostgresServer, tmp_path: Path
) -> None:
    name = f"t_{uuid.uuid4().hex[:12]}"
    pg.create_database(name, template=TEMPLATE_DB)
    try:
        grant_console(pg, name)
        port = free_port()
        env = relay_env(
            bouncer.dsn("relay_console", CONSOLE_PASSWORD, name),
            RELAY_CONSOLE_TOKEN="operator-token-0123456789",
            RELAY_CONSOLE_PORT=str(port),
            RELAY_CONSOLE_TRUSTED_USER_HEADER=PROXY_HEADER,
        )
        log = tmp_path / "console.log"
        console = start_relay(env, log, relay_command("console"))
        try:
            wait_until(
                lambda: get(port, "/healthz") is not None or console.poll() is not None,
                timeout=30,
                message="the console listening",
            )
            for path in ("/", "/dead-letters", "/audit"):
                assert get(port, path) == 200, log.read_text()[-3000:]
        finally:
            console.terminate()
            console.wait(timeout=10)
        assert pooling_errors(log) == [], log.read_text()[-3000:]
    finally:
        pg.drop_database(name)


def get(port: int, path: str) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={PROXY_HEADER: "alice"})
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def test_what_needs_a_session_is_refused_without_a_direct_url_and_works_with_one(
    pooled: str, relay_dsn: str, database: str, kafka: TansuBroker, bouncer: PgBouncer
) -> None:
    superuser_pooled = bouncer.pooled(database)
    refused = run_cli(superuser_pooled, "migrate")
    assert refused.returncode == 2, refused.stderr
    assert "RELAY_DATABASE_DIRECT_URL" in refused.stderr
    assert "advisory lock" in refused.stderr
    done = run_cli(superuser_pooled, "migrate", RELAY_DATABASE_DIRECT_URL=database)
    assert done.returncode == 0, done.stderr
    # A direct URL that is not direct is refused too, naming it.
    again = run_cli(superuser_pooled, "migrate", RELAY_DATABASE_DIRECT_URL=superuser_pooled)
    assert again.returncode == 2 and "goes through a pooler too" in again.stderr
    # The LISTEN of instant wake-up: refused at start-up, before anything runs.
    listening = run_cli(
        pooled,
        "run",
        RELAY_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
        RELAY_NOTIFY_CHANNEL="outbox_wake",
    )
    assert listening.returncode == 2, listening.stderr
    assert "RELAY_DATABASE_DIRECT_URL" in listening.stderr
    assert "LISTEN" in listening.stderr
    with pytest.raises(SettingsError, match="RELAY_DATABASE_DIRECT_URL"):
        db.connect(CommonSettings(database_url=pooled), purpose="listen")
    with db.connect(
        CommonSettings(database_url=pooled, database_direct_url=relay_dsn), purpose="listen"
    ) as conn:
        assert isinstance(conn, connection.RelayConnection) and not conn.pooled
