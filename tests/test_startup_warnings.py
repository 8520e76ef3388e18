"""Settings that work but let credentials be read in transit: a password to PostgreSQL
over a connection whose server is not verified, SASL credentials to Kafka over
plaintext. `relay run` says so at start-up, naming the setting to change; loopback
hosts and verified connections pass in silence."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from relay.daemon.app import startup_warnings
from relay.settings import CommonSettings, Settings
from relay.sinks.kafka.settings import plaintext_sasl_warnings
from relay.store import db
from tests.conftest import relay_command, relay_env, start_relay
from tests.support import wait_until

REMOTE = "postgresql://relay:s3cr3t-pw@db.example.internal:5432/app"


@pytest.fixture
def ca(tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("url", "values", "environ", "mode"),
    [
        (REMOTE, {}, {}, "prefer"),  # libpq's default: plaintext if TLS fails
        (REMOTE + "?sslmode=require", {}, {}, "require"),
        (REMOTE + "?sslmode=disable", {}, {}, "disable"),
        (REMOTE, {}, {"PGSSLMODE": "allow"}, "allow"),
        # The URL's sslmode wins over PGSSLMODE (libpq's rule).
        (REMOTE + "?sslmode=prefer", {}, {"PGSSLMODE": "verify-full"}, "prefer"),
        # sslrootcert makes only require verify.
        (REMOTE + "?sslmode=prefer&sslrootcert={ca}", {}, {}, "prefer"),
        ("postgresql://relay@db.example.internal/app", {"database_password": "pw"}, {}, "prefer"),
        ("postgresql://relay@db.example.internal/app", {}, {"PGPASSWORD": "pw"}, "prefer"),
        ("host=127.0.0.1,db.example.internal user=relay password=pw", {}, {}, "prefer"),
    ],
)
def test_a_password_over_an_unverified_connection_is_warned_about(
    url: str, values: dict[str, Any], environ: dict[str, str], mode: str, ca: str
) -> None:
    settings = CommonSettings(database_url=url.replace("{ca}", ca), **values)
    warning = db.unverified_password(settings, environ)
    assert warning is not None
    assert f"sslmode={mode}" in warning
    assert "put sslmode=verify-full and sslrootcert=" in warning
    assert "in RELAY_DATABASE_URL" in warning
    assert "s3cr3t" not in warning


@pytest.mark.parametrize(
    ("url", "values", "environ"),
    [
        (REMOTE + "?sslmode=verify-full", {}, {}),
        (REMOTE + "?sslmode=verify-ca&sslrootcert={ca}", {}, {}),
        (REMOTE, {}, {"PGSSLMODE": "verify-full"}),
        # require with a root certificate verifies as verify-ca does (libpq's rule).
        (REMOTE + "?sslmode=require&sslrootcert={ca}", {}, {}),
        (REMOTE + "?sslmode=require", {}, {"PGSSLROOTCERT": "{ca}"}),
        ("host=db.example.internal password=pw sslmode=verify-full sslrootcert={ca}", {}, {}),
        ("postgresql://relay:pw@127.0.0.1:5432/app", {}, {}),
        ("postgresql://relay:pw@localhost/app", {}, {}),
        ("postgresql://relay:pw@[::1]:5432/app", {}, {}),
        ("host=/var/run/postgresql user=relay password=pw", {}, {}),
        ("postgresql://relay:pw@/app", {}, {}),  # libpq's default socket
        ("postgresql://relay@db.example.internal/app", {}, {}),  # no password: a client cert
    ],
)
def test_no_warning_for_a_verified_or_local_connection(
    url: str, values: dict[str, Any], environ: dict[str, str], ca: str
) -> None:
    environ = {k: v.replace("{ca}", ca) for k, v in environ.items()}
    settings = CommonSettings(database_url=url.replace("{ca}", ca), **values)
    assert db.unverified_password(settings, environ) is None


@pytest.mark.unit
def test_the_direct_url_is_warned_about_on_its_own(ca: str) -> None:
    """RELAY_DATABASE_SSLMODE covered both URLs; now each carries its own sslmode, and a
    direct URL left without one is named."""
    verified = f"{REMOTE}?sslmode=verify-full&sslrootcert={ca}"
    settings = CommonSettings(database_url=verified, database_direct_url=REMOTE)
    ((variable, warning),) = db.unverified_passwords(settings, {})
    assert variable == "RELAY_DATABASE_DIRECT_URL"
    assert "sslmode=prefer" in warning and "in RELAY_DATABASE_DIRECT_URL" in warning
    assert "s3cr3t" not in warning
    both = CommonSettings(database_url=REMOTE, database_direct_url=REMOTE)
    assert [v for v, _ in db.unverified_passwords(both, {})] == [
        "RELAY_DATABASE_URL",
        "RELAY_DATABASE_DIRECT_URL",
    ]
    assert db.unverified_passwords(CommonSettings(database_url=verified), {}) == []
    neither = CommonSettings(database_url=verified, database_direct_url=verified)
    assert db.unverified_passwords(neither, {}) == []


def kafka_settings(**values: Any) -> Settings:
    return Settings(database_url="postgresql://relay@/app", **values)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("values", "mechanism"),
    [
        ({"security_protocol": "sasl_plaintext", "sasl_mechanism": "PLAIN"}, "PLAIN"),
        (
            {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512"},
            "SCRAM-SHA-512",
        ),
        ({"security_protocol": "sasl_plaintext", "sasl_mechanisms": "plain"}, "PLAIN"),
        ({"security_protocol": "sasl_plaintext", "sasl_mechanism": "OAUTHBEARER"}, "OAUTHBEARER"),
    ],
)
def test_sasl_credentials_over_plaintext_are_warned_about(
    values: dict[str, Any], mechanism: str
) -> None:
    settings = kafka_settings(
        kafka_bootstrap_servers="127.0.0.1:9092,kafka-1.example.internal:9092",
        kafka={**values, "sasl_password": "s3cr3t-pw"},
    )
    ((named, warning),) = plaintext_sasl_warnings(settings)
    assert named == "RELAY_KAFKA__SECURITY_PROTOCOL"
    assert f"SASL {mechanism} over sasl_plaintext" in warning and "sasl_ssl" in warning
    assert "s3cr3t" not in warning


@pytest.mark.unit
@pytest.mark.parametrize(
    ("bootstrap", "values"),
    [
        ("kafka.example.internal:9092", {"security_protocol": "sasl_ssl"}),
        ("kafka.example.internal:9092", {"security_protocol": "plaintext"}),
        ("kafka.example.internal:9092", {"security_protocol": "sasl_plaintext"}),  # GSSAPI
        (
            "kafka.example.internal:9092",
            {"security_protocol": "sasl_plaintext", "sasl_mechanism": "GSSAPI"},
        ),
        (
            "localhost:9092,127.0.0.1:9093,[::1]:9094,SASL_PLAINTEXT://127.0.0.2:9095",
            {"security_protocol": "sasl_plaintext", "sasl_mechanism": "PLAIN"},
        ),
    ],
)
def test_no_sasl_warning_over_tls_for_kerberos_or_on_loopback(
    bootstrap: str, values: dict[str, Any]
) -> None:
    settings = kafka_settings(kafka_bootstrap_servers=bootstrap, kafka=values)
    assert plaintext_sasl_warnings(settings) == []


@pytest.mark.unit
def test_only_the_kafka_sinks_warnings_apply_to_the_kafka_sink() -> None:
    settings = Settings(
        database_url="postgresql://relay@/app",
        sink="http",
        http_url="https://hooks.example/in",
        kafka={"security_protocol": "sasl_plaintext", "sasl_mechanism": "PLAIN"},
        kafka_bootstrap_servers="kafka.example.internal:9092",
    )
    assert startup_warnings(settings) == []


def _events(log: Path) -> list[dict[str, Any]]:
    events = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a library's own line
    return events


def _run_until(env: dict[str, str], log: Path, event: str) -> list[dict[str, Any]]:
    """`relay run` until it logs `event`, then SIGTERM; every JSON event it logged."""
    process = start_relay(env, log)
    try:
        wait_until(
            lambda: any(e.get("event") == event for e in _events(log)),
            timeout=30,
            message=f"{event} in {log}",
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return _events(log)


def test_relay_run_warns_at_start_up_naming_the_settings(tmp_path: Path) -> None:
    """Before: nothing said that the password could be read on the way to PostgreSQL,
    nor that SASL PLAIN sends the Kafka password in clear. The hosts are .invalid: no
    connection is ever made, the warnings come from the settings alone."""
    password = tmp_path / "kafka-password"
    password.write_text("s3cr3t-kafka\n")
    env = relay_env(
        "postgresql://relay:s3cr3t-pw@db.invalid:5432/app?connect_timeout=1",
        "kafka.invalid:9092",
        RELAY_KAFKA__SECURITY_PROTOCOL="sasl_plaintext",
        RELAY_KAFKA__SASL_MECHANISM="PLAIN",
        RELAY_KAFKA__SASL_USERNAME="relay",
        RELAY_KAFKA__SASL_PASSWORD_FILE=str(password),
    )
    log = tmp_path / "relay.log"
    events = _run_until(env, log, "relay.started")
    warned = {e["setting"]: e for e in events if e.get("event") == "settings.insecure"}
    assert set(warned) == {"RELAY_DATABASE_URL", "RELAY_KAFKA__SECURITY_PROTOCOL"}
    assert all(e["level"] == "warning" for e in warned.values())
    assert "sslmode=prefer" in warned["RELAY_DATABASE_URL"]["problem"]
    assert "in clear" in warned["RELAY_KAFKA__SECURITY_PROTOCOL"]["problem"]
    assert "s3cr3t" not in log.read_text(errors="replace")


def test_relay_run_says_nothing_for_a_loopback_database(tmp_path: Path) -> None:
    env = relay_env(
        "postgresql://relay:s3cr3t-pw@127.0.0.1:1/app?connect_timeout=1",
        RELAY_SINK="http",
        RELAY_HTTP_URL="https://hooks.invalid/in",
    )
    log = tmp_path / "relay.log"
    events = _run_until(env, log, "relay.started")
    assert not [e for e in events if e.get("event") == "settings.insecure"]


def test_relay_check_prints_the_same_warnings(tmp_path: Path) -> None:
    env = relay_env(
        "postgresql://relay:s3cr3t-pw@db.invalid:5432/app?connect_timeout=1",
        RELAY_SINK="http",
        RELAY_HTTP_URL="https://hooks.invalid/in",
    )
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert "settings: warning: RELAY_DATABASE_URL: " in done.stdout, done.stdout
    assert "s3cr3t" not in done.stdout + done.stderr
