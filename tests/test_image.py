"""The container image, built from the Dockerfile and run against the suite's servers.

`relay migrate` on an empty database, `relay check`, `relay run` publishing a row, the
non-root user, no pip at run time, and the HEALTHCHECK, all from the image podman built.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from relay.admin.migrate import migrations_dir
from tests.conftest import RELAY_ROLE, RELAY_ROLE_PASSWORD, REPO
from tests.harness import free_port
from tests.harness.image import Podman, available
from tests.harness.kafka import TansuBroker, consume
from tests.harness.postgres import PostgresServer
from tests.support import insert_rows, unsent_count, wait_until

pytestmark = pytest.mark.slow

TAG = "localhost/relay:test"


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    if not available():
        pytest.skip("needs root, podman, runc and debootstrap (./dev test installs them)")
    engine = Podman(tmp_path_factory.mktemp("podman"))
    engine.build(REPO, TAG)
    yield engine
    engine("rmi", "--force", TAG, check=False)


def test_the_image_migrates_checks_runs_and_reports_healthy(
    podman: Podman, pg: PostgresServer, kafka: TansuBroker, topic: str
) -> None:
    name = f"img_{uuid.uuid4().hex[:10]}"
    admin_dsn = pg.create_database(name)
    relay_dsn = pg.dsn(name, user=RELAY_ROLE, password=RELAY_ROLE_PASSWORD)
    container = f"relay-test-{uuid.uuid4().hex[:8]}"

    def relay(*args: str, dsn: str = relay_dsn) -> str:
        done = podman(
            "run", "--rm", "--network", "host",
            "-e", f"RELAY_DATABASE_URL={dsn}",
            "-e", f"RELAY_KAFKA_BOOTSTRAP_SERVERS={kafka.bootstrap_servers}",
            TAG, *args,
        )  # fmt: skip
        return done.stdout + done.stderr

    try:
        # The migrations travel inside the image.
        assert "migration.applied" in relay("migrate", dsn=admin_dsn)
        pg.execute((migrations_dir() / "grants.sql").read_text(), dbname=name)
        checked = relay("check")
        assert "database: ok" in checked and "kafka: ok" in checked
        assert RELAY_ROLE_PASSWORD not in checked

        metrics_port = free_port()
        podman(
            "run", "--detach", "--name", container, "--network", "host",
            "-e", f"RELAY_DATABASE_URL={relay_dsn}",
            "-e", f"RELAY_KAFKA_BOOTSTRAP_SERVERS={kafka.bootstrap_servers}",
            "-e", "RELAY_METRICS_HOST=127.0.0.1",
            "-e", f"RELAY_METRICS_PORT={metrics_port}",
            TAG,
        )  # fmt: skip
        insert_rows(admin_dsn, topic, [("k", b"from-the-image")])
        wait_until(lambda: unsent_count(admin_dsn) == 0, timeout=60, message="row published")
        records = consume(kafka.bootstrap_servers, topic, min_count=1)
        assert [r.value for r in records] == [b"from-the-image"]

        assert podman("exec", container, "id", "-u").stdout.strip() == "10001"
        no_pip = podman("exec", container, "python", "-c", "import pip", check=False)
        assert no_pip.returncode != 0, "the runtime image carries pip"
        # The Dockerfile's HEALTHCHECK, run by podman itself (no systemd timer here).
        wait_until(
            lambda: podman("healthcheck", "run", container, check=False).returncode == 0,
            timeout=60,
            interval=1.0,
            message="the image's HEALTHCHECK passing",
        )
        podman("stop", "--time", "20", container)
        logs = podman("logs", container).stdout + podman("logs", container).stderr
        assert "relay.stopped" in logs
        assert podman("inspect", container, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"
    finally:
        podman("rm", "--force", container, check=False)
        pg.drop_database(name)


def test_the_runtime_image_copies_nothing_in(podman: Podman) -> None:
    """Wheels and lock file are bind-mounted during the build: no layer holds them."""
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", TAG).stdout
    assert 'ENTRYPOINT ["relay"]' in history  # the runtime stage's steps are listed
    assert "COPY" not in history.upper(), history
