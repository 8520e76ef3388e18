"""A bad setting stops start-up with one line that names it, exit code 2, no secret."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from relay.settings import Settings, SettingsError, load_settings
from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness.kafka import TansuBroker

URL = "postgresql://app:s3cr3t-pw@127.0.0.1:1/db"


def env_for(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("RELAY_"):
            monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("RELAY_BATCH_SIZE", "0", "greater than or equal to 1"),
        ("RELAY_BATCH_SIZE", "lots", "valid integer"),
        ("RELAY_LEASE_TTL_SECONDS", "-3", "greater than or equal to 1"),
        ("RELAY_SINK", "carrier-pigeon", "must be one of: "),
        ("RELAY_LOG_FORMAT", "xml", "'json' or 'console'"),
        ("RELAY_METRICS_PORT", "70000", "less than or equal to 65535"),
        ("RELAY_NOTIFY_CHANNEL", "Outbox; DROP", "should match pattern"),
    ],
)
def test_invalid_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, fragment: str
) -> None:
    env_for(monkeypatch, RELAY_DATABASE_URL=URL, RELAY_KAFKA_BOOTSTRAP_SERVERS="k:9092")
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == variable
    assert fragment in caught.value.message
    assert "s3cr3t-pw" not in str(caught.value)


def test_missing_database_url_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    env_for(monkeypatch, RELAY_KAFKA_BOOTSTRAP_SERVERS="k:9092")
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == "RELAY_DATABASE_URL"
    assert caught.value.message == "is required"


def test_kafka_sink_requires_bootstrap_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    env_for(monkeypatch, RELAY_DATABASE_URL=URL)
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == "RELAY_KAFKA_BOOTSTRAP_SERVERS"


def test_secret_from_file_and_librdkafka_passthrough(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "url"
    secret.write_text(URL + "\n")
    env_for(
        monkeypatch,
        RELAY_DATABASE_URL_FILE=str(secret),
        RELAY_KAFKA_BOOTSTRAP_SERVERS="k:9092",
        RELAY_KAFKA__SSL_CA_LOCATION="/etc/ca.pem",
        RELAY_KAFKA__QUEUE_BUFFERING_MAX_MESSAGES="5000",
    )
    settings = load_settings(Settings)
    assert settings.database_url.get_secret_value() == URL
    assert "s3cr3t-pw" not in repr(settings)
    assert settings.librdkafka_config() == {
        "ssl.ca.location": "/etc/ca.pem",
        "queue.buffering.max.messages": "5000",
    }


def test_unreadable_secret_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env_for(monkeypatch, RELAY_DATABASE_URL_FILE=str(tmp_path / "missing"))
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == "RELAY_DATABASE_URL_FILE"


def test_cli_exits_2_with_one_clear_line_and_no_password() -> None:
    env = relay_env(URL, "127.0.0.1:1", RELAY_LEASE_TTL_SECONDS="soon")
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2
    err = done.stderr.decode().strip()
    assert err.splitlines() == [
        "relay: configuration error: RELAY_LEASE_TTL_SECONDS: "
        "Input should be a valid number, unable to parse string as a number"
    ]
    assert "s3cr3t-pw" not in err + done.stdout.decode()
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("RELAY_KAFKA__ENABLE_IDEMPOTENCE", "false"),
        ("RELAY_KAFKA__ACKS", "1"),
        ("RELAY_KAFKA__DELIVERY_REPORT_ONLY_ERROR", "true"),
        ("RELAY_KAFKA__MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION", "20"),
        ("RELAY_KAFKA__TRANSACTIONAL_ID", "relay-1"),
        ("RELAY_KAFKA__MESSAGE_TIMEOUT_MS", "30000"),
        ("RELAY_KAFKA__DELIVERY_TIMEOUT_MS", "30000"),
        ("RELAY_KAFKA__ENABLE_GAPLESS_GUARANTEE", "false"),
    ],
)
def test_pass_through_cannot_switch_off_the_delivery_guarantees(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", "postgresql://h/db")
    monkeypatch.setenv("RELAY_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as err:
        load_settings(Settings)
    assert err.value.name == variable


def test_pass_through_may_restate_the_guarantees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", "postgresql://h/db")
    monkeypatch.setenv("RELAY_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    monkeypatch.setenv("RELAY_KAFKA__ACKS", "all")
    monkeypatch.setenv("RELAY_KAFKA__ENABLE_IDEMPOTENCE", "true")
    monkeypatch.setenv("RELAY_KAFKA__MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION", "5")
    assert load_settings(Settings).librdkafka_config()["acks"] == "all"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:s3cr%zzet@127.0.0.1:1/db",  # a bare % in the password
        "postgresql://relay:s3cr@et@127.0.0.1:1/db",  # a bare @ in the password
        "host=127.0.0.1 password=s3cr et",  # an unquoted space in a DSN
    ],
)
def test_a_malformed_database_url_is_refused_without_quoting_it(url: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(Settings, database_url=url, kafka_bootstrap_servers="x:1")
    assert err.value.name == "RELAY_DATABASE_URL"
    assert "s3cr" not in str(err.value)


def test_check_with_a_malformed_url_exits_2_without_the_password() -> None:
    env = relay_env("postgresql://relay:s3cr%zzet@127.0.0.1:1/db", "127.0.0.1:1")
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert b"RELAY_DATABASE_URL" in done.stderr
    assert b"s3cr" not in done.stdout + done.stderr


def test_synchronous_commit_reaches_every_daemon_session(make_settings: SettingsFactory) -> None:
    from relay import db

    settings = make_settings(database_synchronous_commit="remote_apply")
    with db.connect(settings, purpose="settle") as conn:
        row = conn.execute("SHOW synchronous_commit").fetchone()
    assert row is not None and row["synchronous_commit"] == "remote_apply"
    with pytest.raises(SettingsError) as err:
        load_settings(
            Settings,
            database_url="postgresql://h/db",
            kafka_bootstrap_servers="k:9092",
            database_synchronous_commit="sometimes",
        )
    assert err.value.name == "RELAY_DATABASE_SYNCHRONOUS_COMMIT"


def test_an_unknown_relay_variable_stops_start_up_naming_the_closest_setting() -> None:
    """Before: RELAY_BATCHSIZE=5 was dropped without a word and the batch kept its default."""
    env = relay_env("postgresql://relay@127.0.0.1:1/db", RELAY_BATCHSIZE="5")
    for command in ("run", "check", "migrate"):
        result = subprocess.run(
            relay_command(command), env=env, capture_output=True, timeout=60, check=False
        )
        assert result.returncode == 2, (command, result.stderr)
        line = result.stderr.decode()
        assert "RELAY_BATCHSIZE" in line and "did you mean RELAY_BATCH_SIZE" in line, line


SERVICE_LINKS = {
    # What Kubernetes injects for a Service named `relay` with a named port 9108.
    "RELAY_SERVICE_HOST": "10.96.0.12",
    "RELAY_SERVICE_PORT": "9108",
    "RELAY_SERVICE_PORT_METRICS": "9108",
    "RELAY_PORT": "tcp://10.96.0.12:9108",
    "RELAY_PORT_9108_TCP": "tcp://10.96.0.12:9108",
    "RELAY_PORT_9108_TCP_PROTO": "tcp",
    "RELAY_PORT_9108_TCP_PORT": "9108",
    "RELAY_PORT_9108_TCP_ADDR": "10.96.0.12",
}


def test_kubernetes_service_links_never_stop_a_replica(relay_dsn: str, kafka: TansuBroker) -> None:
    env = relay_env(relay_dsn, kafka.bootstrap_servers, **SERVICE_LINKS)
    result = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr.decode()
