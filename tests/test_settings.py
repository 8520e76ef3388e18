"""A bad setting stops start-up with one line that names it, exit code 2, no secret."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import relay.settings.loading
import relay.settings.sources
from relay.settings import (
    SECRET_FIELDS,
    Settings,
    SettingsError,
    is_setting_variable,
    load_settings,
)
from relay.settings.retired import RETIRED
from relay.sinks.kafka.settings import LIBRDKAFKA_SECRETS
from relay.sinks.kafka.sink import producer_config
from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness.kafka import TansuBroker

URL = "postgresql://app:s3cr3t-pw@127.0.0.1:1/db"


def env_for(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("RELAY_"):
            monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@pytest.mark.unit
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
        ("RELAY_MAX_MESSAGES_PER_SECOND", "0", "greater than 0"),
        ("RELAY_MAX_MESSAGES_PER_SECOND", "fast", "valid number"),
        ("RELAY_MAX_BYTES_PER_SECOND", "-1", "greater than 0"),
        ("RELAY_MAX_BYTES_PER_SECOND", "1MB", "valid integer"),
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


@pytest.mark.unit
def test_missing_database_url_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    env_for(monkeypatch, RELAY_KAFKA_BOOTSTRAP_SERVERS="k:9092")
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == "RELAY_DATABASE_URL"
    assert caught.value.message == "is required"


@pytest.mark.unit
def test_kafka_sink_requires_bootstrap_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    env_for(monkeypatch, RELAY_DATABASE_URL=URL)
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == "RELAY_KAFKA_BOOTSTRAP_SERVERS"


@pytest.mark.unit
def test_secret_from_file_and_librdkafka_passthrough(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "url"
    secret.write_text(URL + "\n")
    ca = tmp_path / "ca.pem"  # a CA librdkafka must be able to open (checked at start)
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    env_for(
        monkeypatch,
        RELAY_DATABASE_URL_FILE=str(secret),
        RELAY_KAFKA_BOOTSTRAP_SERVERS="k:9092",
        RELAY_KAFKA__SSL_CA_LOCATION=str(ca),
        RELAY_KAFKA__QUEUE_BUFFERING_MAX_MESSAGES="5000",
    )
    settings = load_settings(Settings)
    assert settings.database_url.get_secret_value() == URL
    assert "s3cr3t-pw" not in repr(settings)
    assert settings.librdkafka_config() == {
        "ssl.ca.location": str(ca),
        "queue.buffering.max.messages": "5000",
    }


@pytest.mark.unit
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


def test_a_pace_cap_of_zero_exits_2_naming_it() -> None:
    env = relay_env(URL, "127.0.0.1:1", RELAY_MAX_MESSAGES_PER_SECOND="0")
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stderr.decode().strip().splitlines() == [
        "relay: configuration error: RELAY_MAX_MESSAGES_PER_SECOND: Input should be greater than 0"
    ]


@pytest.mark.unit
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


@pytest.mark.unit
def test_pass_through_may_restate_the_guarantees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", "postgresql://h/db")
    monkeypatch.setenv("RELAY_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    monkeypatch.setenv("RELAY_KAFKA__ACKS", "all")
    monkeypatch.setenv("RELAY_KAFKA__ENABLE_IDEMPOTENCE", "true")
    monkeypatch.setenv("RELAY_KAFKA__MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION", "5")
    assert load_settings(Settings).librdkafka_config()["acks"] == "all"


@pytest.mark.unit
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
    from relay.store import db

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


# --- secrets from files: every one, and never two sources for one ---


def map_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """RELAY_HTTP_TOPIC_URLS among the secrets, as the HTTP sink declares it (its URLs
    may carry tokens), whether or not its declaration is in this checkout yet."""
    if "http_topic_urls" not in SECRET_FIELDS:
        for module in (relay.settings.sources, relay.settings.loading):  # where it is read
            monkeypatch.setattr(module, "SECRET_FIELDS", (*SECRET_FIELDS, "http_topic_urls"))


HTTP = {"RELAY_DATABASE_URL": URL, "RELAY_SINK": "http"}
TOPIC_URLS = {"orders": "https://hooks.example/orders?token=s3cr3t-tok"}


@pytest.mark.unit
def test_a_map_secret_is_read_from_its_file_as_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before: the file's text was handed over as a string, which no map accepts."""
    map_secret(monkeypatch)
    urls = tmp_path / "topic-urls"
    urls.write_text(json.dumps(TOPIC_URLS) + "\n")
    env_for(monkeypatch, **HTTP, RELAY_HTTP_TOPIC_URLS_FILE=str(urls))
    settings = load_settings(Settings)
    urls_read = {
        topic: getattr(entry, "url", entry) for topic, entry in settings.http_topic_urls.items()
    }
    assert urls_read == TOPIC_URLS
    assert "s3cr3t-tok" not in repr(settings)


@pytest.mark.unit
@pytest.mark.parametrize(
    "content", ['{"orders": "https://hooks.example/s3cr3t-tok"', '["s3cr3t-tok"]', "s3cr3t-tok"]
)
def test_a_map_secret_file_that_is_no_json_object_is_named_and_not_quoted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str
) -> None:
    map_secret(monkeypatch)
    urls = tmp_path / "topic-urls"
    urls.write_text(content)
    env_for(monkeypatch, **HTTP, RELAY_HTTP_TOPIC_URLS_FILE=str(urls))
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == "RELAY_HTTP_TOPIC_URLS_FILE"
    assert "JSON object" in caught.value.message
    assert "s3cr3t-tok" not in str(caught.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("variable", "file_variable"),
    [
        ("RELAY_DATABASE_PASSWORD", "RELAY_DATABASE_PASSWORD_FILE"),
        ("RELAY_DATABASE_URL", "RELAY_DATABASE_URL_FILE"),
        ("RELAY_HTTP_TOPIC_URLS", "RELAY_HTTP_TOPIC_URLS_FILE"),
        ("RELAY_HTTP_TOPIC_URLS__ORDERS", "RELAY_HTTP_TOPIC_URLS_FILE"),  # a map, in parts
        ("RELAY_KAFKA__SASL_PASSWORD", "RELAY_KAFKA__SASL_PASSWORD_FILE"),
    ],
)
def test_a_secret_given_two_ways_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str, file_variable: str
) -> None:
    """Before: the variable won without a word, and a rotated file was never read."""
    map_secret(monkeypatch)
    secret = tmp_path / "secret"
    is_map = "TOPIC_URLS" in file_variable
    secret.write_text(json.dumps(TOPIC_URLS) if is_map else "s3cr3t-file")
    values = {
        "RELAY_DATABASE_URL": URL,
        "RELAY_KAFKA_BOOTSTRAP_SERVERS": "k:9092",
        variable: json.dumps(TOPIC_URLS) if variable.endswith("TOPIC_URLS") else "s3cr3t-env",
        file_variable: str(secret) if file_variable.endswith("_FILE") else "s3cr3t-env2",
    }
    if "DATABASE_URL" in variable:
        values[variable] = URL
    env_for(monkeypatch, **values)
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    message = str(caught.value)
    assert variable in message and file_variable in message, message
    assert "s3cr3t" not in message


def test_run_with_a_secret_given_two_ways_exits_2_naming_both(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("s3cr3t-file")
    env = relay_env(
        URL,
        "127.0.0.1:1",
        RELAY_DATABASE_PASSWORD="s3cr3t-env",
        RELAY_DATABASE_PASSWORD_FILE=str(password),
    )
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "RELAY_DATABASE_PASSWORD_FILE" in done.stderr
    assert "RELAY_DATABASE_PASSWORD is set too" in done.stderr
    assert "s3cr3t" not in done.stdout + done.stderr


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(LIBRDKAFKA_SECRETS))
def test_every_librdkafka_secret_is_read_from_a_file_and_never_shown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    """RELAY_KAFKA__SASL_PASSWORD_FILE for sasl.password, and so on. Before: passed to
    librdkafka as the unknown property sasl.password.file, and a secret given directly
    showed in the settings' repr."""
    variable = f"RELAY_KAFKA__{name.upper().replace('.', '_')}_FILE"
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-from-file\n")
    env_for(
        monkeypatch,
        RELAY_DATABASE_URL=URL,
        RELAY_KAFKA_BOOTSTRAP_SERVERS="k:9092",
        **{variable: str(secret)},
    )
    assert is_setting_variable(variable)
    settings = load_settings(Settings)
    assert settings.librdkafka_config()[name] == "s3cr3t-from-file"
    assert producer_config(settings)[name] == "s3cr3t-from-file"
    assert name + ".file" not in producer_config(settings)
    for shown in (repr(settings), str(settings), settings.model_dump_json()):
        assert "s3cr3t" not in shown


@pytest.mark.unit
def test_a_librdkafka_secret_given_directly_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    env_for(
        monkeypatch,
        RELAY_DATABASE_URL=URL,
        RELAY_KAFKA_BOOTSTRAP_SERVERS="k:9092",
        RELAY_KAFKA__SASL_PASSWORD="s3cr3t-direct",
        RELAY_KAFKA__SASL_USERNAME="relay",
    )
    settings = load_settings(Settings)
    assert settings.librdkafka_config()["sasl.password"] == "s3cr3t-direct"
    assert settings.librdkafka_config()["sasl.username"] == "relay"
    assert "s3cr3t" not in repr(settings) + settings.model_dump_json()


@pytest.mark.unit
def test_librdkafkas_own_file_properties_stay_paths(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """sasl.oauthbearer.assertion.private.key.file is librdkafka's: a path it reads."""
    key = tmp_path / "assertion.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    env_for(
        monkeypatch,
        RELAY_DATABASE_URL=URL,
        RELAY_KAFKA_BOOTSTRAP_SERVERS="k:9092",
        RELAY_KAFKA__SASL_OAUTHBEARER_ASSERTION_PRIVATE_KEY_FILE=str(key),
    )
    config = load_settings(Settings).librdkafka_config()
    assert config["sasl.oauthbearer.assertion.private.key.file"] == str(key)


# --- files the settings name: a missing one is a setting to fix ---

MISSING = "/nonexistent/relay-test/ca.pem"
KAFKA = {"RELAY_KAFKA_BOOTSTRAP_SERVERS": "k:9092"}
HTTPS = {"RELAY_SINK": "http", "RELAY_HTTP_URL": "https://hooks.example/in"}
NATS = {"RELAY_SINK": "nats", "RELAY_NATS_URL": "tls://nats.example:4222"}
RABBITMQ = {"RELAY_SINK": "rabbitmq", "RELAY_RABBITMQ_URL": "amqps://u:s3cr3t-pw@mq.example/"}
FILE_SETTINGS = [
    ("RELAY_SINK_TLS_CA_FILE", HTTPS),
    ("RELAY_SINK_TLS_CERT_FILE", HTTPS),
    ("RELAY_SINK_TLS_KEY_FILE", {**HTTPS, "RELAY_SINK_TLS_CERT_FILE": "{cert}"}),
    ("RELAY_KAFKA__SSL_CA_LOCATION", KAFKA),
    ("RELAY_KAFKA__SSL_CERTIFICATE_LOCATION", KAFKA),
    ("RELAY_KAFKA__SSL_KEY_LOCATION", KAFKA),
    ("RELAY_KAFKA__SSL_KEYSTORE_LOCATION", KAFKA),
    ("RELAY_KAFKA__SSL_CRL_LOCATION", KAFKA),
    ("RELAY_SINK_TLS_CA_FILE", NATS),
    ("RELAY_SINK_TLS_CERT_FILE", NATS),
    ("RELAY_SINK_TLS_KEY_FILE", {**NATS, "RELAY_SINK_TLS_CERT_FILE": "{cert}"}),
    ("RELAY_NATS_CREDS_FILE", NATS),
    ("RELAY_SINK_TLS_CA_FILE", RABBITMQ),
    ("RELAY_SINK_TLS_CERT_FILE", RABBITMQ),
    ("RELAY_SINK_TLS_KEY_FILE", {**RABBITMQ, "RELAY_SINK_TLS_CERT_FILE": "{cert}"}),
]


def file_env(tmp_path: Path, extra: dict[str, str], **values: str) -> dict[str, str]:
    cert = tmp_path / "client.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"RELAY_DATABASE_URL": URL, **extra, **values}
    return {name: value.replace("{cert}", str(cert)) for name, value in env.items()}


@pytest.mark.unit
@pytest.mark.parametrize(("variable", "extra"), FILE_SETTINGS)
def test_a_missing_tls_file_is_a_settings_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str, extra: dict[str, str]
) -> None:
    """Before: a traceback when the sink or the connection first opened it (exit 1), or
    a database connection failing on every retry."""
    env_for(monkeypatch, **file_env(tmp_path, extra, **{variable: MISSING}))
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == variable
    assert caught.value.message == f"cannot read {MISSING}: No such file or directory"


@pytest.mark.unit
def test_a_directory_where_a_file_belongs_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env_for(monkeypatch, **file_env(tmp_path, HTTPS, RELAY_SINK_TLS_CA_FILE=str(tmp_path)))
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == "RELAY_SINK_TLS_CA_FILE"
    assert "Is a directory" in caught.value.message


@pytest.mark.unit
@pytest.mark.parametrize("variable", ["RELAY_DATABASE_URL", "RELAY_DATABASE_DIRECT_URL"])
@pytest.mark.parametrize("key", ["sslrootcert", "sslcert", "sslkey"])
def test_a_missing_file_the_database_url_names_is_refused_without_quoting_the_url(
    monkeypatch: pytest.MonkeyPatch, key: str, variable: str
) -> None:
    """RELAY_DATABASE_SSLROOTCERT, checked readable at start, is sslrootcert in the URLs
    now: they are checked as it was."""
    env_for(monkeypatch, **KAFKA, **{"RELAY_DATABASE_URL": URL, variable: f"{URL}?{key}={MISSING}"})
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == variable
    assert key in caught.value.message
    assert MISSING not in str(caught.value) and "s3cr3t" not in str(caught.value)


@pytest.mark.unit
def test_the_special_locations_are_no_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """libpq's sslrootcert=system, librdkafka's ssl.ca.location=probe or a directory."""
    system = f"{URL}?sslmode=verify-full&sslrootcert=system"
    env_for(
        monkeypatch,
        **KAFKA,
        RELAY_DATABASE_URL=system,
        RELAY_DATABASE_DIRECT_URL=system,
        RELAY_KAFKA__SSL_CA_LOCATION="probe",
        RELAY_KAFKA__HTTPS_CA_LOCATION=str(tmp_path),
    )
    assert load_settings(Settings).database_url.get_secret_value() == system


@pytest.mark.unit
def test_the_files_of_a_sink_not_chosen_are_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    env_for(monkeypatch, RELAY_DATABASE_URL=URL, **KAFKA, RELAY_NATS_CREDS_FILE=MISSING)
    assert load_settings(Settings).nats_creds_file == MISSING


@pytest.mark.parametrize(
    ("command", "variable", "extra"),
    [
        ("run", "RELAY_SINK_TLS_CA_FILE", HTTPS),
        ("check", "RELAY_SINK_TLS_CA_FILE", HTTPS),
        ("run", "RELAY_KAFKA__SSL_CA_LOCATION", KAFKA),
        ("run", "RELAY_SINK_TLS_CA_FILE", NATS),
        ("run", "RELAY_SINK_TLS_CA_FILE", RABBITMQ),
    ],
)
def test_a_missing_ca_file_exits_2_naming_it(
    tmp_path: Path, command: str, variable: str, extra: dict[str, str]
) -> None:
    """Before: `relay run` with a missing HTTP or Kafka CA died with a traceback (exit
    1); with a missing database CA it ran, failing every connection."""
    env = relay_env(URL, **file_env(tmp_path, extra, **{variable: MISSING}))
    done = subprocess.run(
        relay_command(command), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"relay: configuration error: {variable}: cannot read {MISSING}: No such file or directory"
    )
    assert "s3cr3t" not in done.stdout + done.stderr


@pytest.mark.parametrize("command", ["run", "check", "migrate"])
def test_a_missing_database_ca_exits_2_naming_the_url(command: str) -> None:
    """With a missing database CA the relay ran, failing every connection (before
    RELAY_DATABASE_SSLROOTCERT was checked; now the URL's sslrootcert is)."""
    env = relay_env(f"{URL}?sslmode=verify-full&sslrootcert={MISSING}", "k:9092")
    done = subprocess.run(
        relay_command(command), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "relay: configuration error: RELAY_DATABASE_URL: cannot read its sslrootcert file:"
        " No such file or directory (the path is not shown: the URL is a secret)"
    )
    assert "s3cr3t" not in done.stdout + done.stderr


@pytest.mark.unit
@pytest.mark.parametrize("variable", ["RELAY_SINK_TLS_CA_FILE", "RELAY_SINK_TLS_CERT_FILE"])
def test_rabbitmq_tls_settings_with_an_amqp_url_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str
) -> None:
    """Before: ignored without a word, and the connection went in plaintext."""
    plain = {**RABBITMQ, "RELAY_RABBITMQ_URL": "amqp://u:s3cr3t-pw@mq.example/"}
    env_for(monkeypatch, **file_env(tmp_path, plain, **{variable: "{cert}"}))
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == variable
    assert "amqps://" in caught.value.message
    assert "s3cr3t" not in str(caught.value)
    env_for(monkeypatch, **file_env(tmp_path, RABBITMQ, **{variable: "{cert}"}))
    assert load_settings(Settings).rabbitmq_url is not None


@pytest.mark.unit
@pytest.mark.parametrize("variable", sorted(RETIRED))
def test_a_variable_1_0_retired_stops_start_up_naming_what_replaces_it(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """A deployment that still sets an old name must not lose the setting silently."""
    env_for(monkeypatch, RELAY_DATABASE_URL=URL, **KAFKA, **{variable: "1"})
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == variable
    assert caught.value.message == f"was renamed or removed in 1.0: use {RETIRED[variable]}"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("variable", "key"),
    [("RELAY_DATABASE_SSLMODE", "sslmode="), ("RELAY_DATABASE_SSLROOTCERT", "sslrootcert=")],
)
def test_the_database_tls_settings_stop_the_console_too_naming_the_urls(
    monkeypatch: pytest.MonkeyPatch, variable: str, key: str
) -> None:
    """They applied to every command's connections and to RELAY_DATABASE_DIRECT_URL's: the
    console (the common settings and its own) stops as `relay run` does."""
    from relay.console.settings import load_all

    env_for(monkeypatch, RELAY_DATABASE_URL=URL, RELAY_CONSOLE_TOKEN="t" * 16, **{variable: "x"})
    with pytest.raises(SettingsError) as caught:
        load_all()
    assert caught.value.name == variable
    assert key in caught.value.message
    assert "RELAY_DATABASE_URL" in caught.value.message
    assert "RELAY_DATABASE_DIRECT_URL" in caught.value.message


def test_relay_run_with_a_retired_variable_exits_2_naming_its_replacement() -> None:
    env = relay_env(URL, "k:9092", RELAY_KAFKA_DELIVERY_TIMEOUT_MS="3000")
    done = subprocess.run(
        relay_command("run"), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "RELAY_KAFKA_DELIVERY_TIMEOUT_MS" in done.stderr
    assert "RELAY_SINK_TIMEOUT_SECONDS (seconds, not milliseconds)" in done.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    ("extra", "variable", "says"),
    [
        ({**HTTPS, "RELAY_TOPIC_MAP": '{"a": "b"}'}, "RELAY_TOPIC_MAP", "RELAY_HTTP_TOPIC_URLS"),
        ({**KAFKA, "RELAY_SINK_MAX_IN_FLIGHT": "8"}, "RELAY_SINK_MAX_IN_FLIGHT", "whole batch"),
        ({**KAFKA, "RELAY_SINK_TLS_CA_FILE": "/x"}, "RELAY_SINK_TLS_CA_FILE", "SSL_CA_LOCATION"),
        (
            {**KAFKA, "RELAY_SINK_TIMEOUT_SECONDS": "0.5"},
            "RELAY_SINK_TIMEOUT_SECONDS",
            "at least 1",
        ),
        ({**NATS, "RELAY_TOPIC_MAP": '{"a": "b.*"}'}, "RELAY_TOPIC_MAP", "wildcard"),
        ({**RABBITMQ, "RELAY_TOPIC_MAP": json.dumps({"a": "k" * 256})}, "RELAY_TOPIC_MAP", "255"),
    ],
)
def test_a_shared_sink_setting_the_chosen_sink_cannot_take_is_refused(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, str], variable: str, says: str
) -> None:
    env_for(monkeypatch, RELAY_DATABASE_URL=URL, **extra)
    with pytest.raises(SettingsError) as caught:
        load_settings(Settings)
    assert caught.value.name == variable
    assert says in caught.value.message


@pytest.mark.unit
def test_the_shared_sink_settings_reach_each_sink_with_its_own_defaults() -> None:
    from relay.sinks.http.sink import DEFAULT_MAX_IN_FLIGHT as HTTP_IN_FLIGHT
    from relay.sinks.kafka.sink import DEFAULT_TIMEOUT_SECONDS as KAFKA_TIMEOUT
    from relay.sinks.nats.sink import DEFAULT_TIMEOUT_SECONDS as NATS_TIMEOUT

    assert (HTTP_IN_FLIGHT, KAFKA_TIMEOUT, NATS_TIMEOUT) == (16, 30.0, 5.0)
    settings = Settings(
        database_url=URL, kafka_bootstrap_servers="k:9092", topic_map={"orders": "prod.orders"}
    )
    config = producer_config(settings)
    assert (config["compression.type"], config["linger.ms"]) == ("lz4", 5)
    tuned = Settings(database_url=URL, kafka_bootstrap_servers="k:9092", kafka={"linger_ms": "20"})
    assert producer_config(tuned)["linger.ms"] == "20"
