"""The Kafka sink's settings (`RELAY_KAFKA_*`, and `RELAY_KAFKA__<NAME>` for librdkafka):
fields, their validation, and the secrets among them. `relay.settings.Settings` is
made of these and the other sinks' settings, so every variable keeps its name.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, Field, PrivateAttr, SecretStr, model_validator

from relay.errors import SettingsError
from relay.setting_checks import is_loopback, read_secret, unreadable
from relay.sinks.base import SinkSpec
from relay.sinks.settings import SinkSettings, refuse

KAFKA_SECRETS: tuple[str, ...] = ()  # the pass-through's own: LIBRDKAFKA_SECRETS

# librdkafka properties whose values are secrets (of those it flags sensitive, the ones
# that are no path or name): kept out of `kafka`, so no repr or log shows them, and
# each may be read from a file, RELAY_KAFKA__SASL_PASSWORD_FILE for sasl.password.
LIBRDKAFKA_SECRETS = frozenset(
    {
        "sasl.password",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "sasl.oauthbearer.assertion.private.key.pem",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl.keystore.password",
    }
)

# Paths librdkafka opens when the producer is created: checked at start-up. The CA
# locations may also be a directory of certificates, or `probe` (the system's).
_CA_LOCATIONS = frozenset({"ssl.ca.location", "https.ca.location"})
_LIBRDKAFKA_PATHS = _CA_LOCATIONS | {
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.keystore.location",
    "ssl.crl.location",
    "sasl.kerberos.keytab",
    "sasl.oauthbearer.assertion.file",
    "sasl.oauthbearer.assertion.jwt.template.file",
    "sasl.oauthbearer.assertion.private.key.file",
}

# SASL mechanisms whose credentials an eavesdropper on a plaintext connection can use.
_EXPOSED_MECHANISMS = {
    "PLAIN": "sends the password in clear",
    "SCRAM-SHA-256": "exposes the exchange to offline password guessing",
    "SCRAM-SHA-512": "exposes the exchange to offline password guessing",
    "OAUTHBEARER": "sends a bearer token anyone who reads it can replay",
}


class KafkaSettings(BaseModel):
    kafka_bootstrap_servers: str | None = Field(
        default=None,
        description="Brokers to connect to first, comma-separated host:port; required with "
        "RELAY_SINK=kafka.",
    )
    kafka_straggler_seconds: float = Field(
        default=1.0,
        ge=0.05,
        le=900,
        description="A batch whose other messages were acknowledged stops waiting for the "
        "rest after this long without a report: they stay in flight (their keys held) "
        "while other partitions flow.",
    )
    kafka: dict[str, str] = Field(
        default_factory=dict,
        description="librdkafka pass-through: RELAY_KAFKA__SSL_CA_LOCATION sets ssl.ca.location;"
        " a secret property may come from a file: RELAY_KAFKA__SASL_PASSWORD_FILE. The relay "
        "sets compression.type=lz4 and linger.ms=5 unless given here.",
    )
    # The pass-through's secret properties (LIBRDKAFKA_SECRETS), by their dotted names.
    _kafka_secrets: dict[str, SecretStr] = PrivateAttr(default_factory=dict)

    def librdkafka_config(self) -> dict[str, str]:
        """Pass-through librdkafka settings with their dotted names restored, secrets in."""
        config = {_property(key): value for key, value in self.kafka.items()}
        config.update(
            (name, value.get_secret_value()) for name, value in self._kafka_secrets.items()
        )
        return config

    @model_validator(mode="after")
    def _pass_through_checked(self) -> KafkaSettings:
        _secret_variables(self.kafka)  # one way each
        self._kafka_secrets = _take_secrets(self.kafka)
        _check_guarantees(self.librdkafka_config())
        return self


def _property(key: str) -> str:
    return key.lower().replace("_", ".")


def _variable(name: str) -> str:
    return f"RELAY_KAFKA__{name.upper().replace('.', '_')}"


def _secret_of(name: str) -> str | None:
    """The secret property `name` sets, directly or as its file form (`<secret>.file`)."""
    secret = name.removesuffix(".file")
    return secret if secret in LIBRDKAFKA_SECRETS else None


def _secret_variables(kafka: dict[str, str]) -> dict[str, str]:
    """Each secret property given, by the variable that gives it."""
    found: dict[str, str] = {}
    for key, value in kafka.items():
        name = _property(key)
        secret = _secret_of(name)
        if secret is None or (name != secret and not value):  # an empty _FILE: unset
            continue
        if secret in found:
            raise SettingsError(
                _variable(secret + ".file"),
                f"{_variable(secret)} is set too: give the secret one way, not both",
            )
        found[secret] = _variable(name)
    return found


def _take_secrets(kafka: dict[str, str]) -> dict[str, SecretStr]:
    """Moves the secret properties out of `kafka`, reading those given as files."""
    secrets: dict[str, SecretStr] = {}
    for key in list(kafka):
        name = _property(key)
        secret = _secret_of(name)
        if secret is None:
            continue
        value = kafka.pop(key)
        if secret == name:
            secrets[secret] = SecretStr(value)
        elif value:
            secrets[secret] = SecretStr(read_secret(_variable(name), value))
    return secrets


# librdkafka settings the delivery guarantees rest on: the pass-through may tune
# anything else, but not quietly turn these off.
_KAFKA_GUARDED: dict[str, tuple[Callable[[str], bool], str]] = {
    "enable.idempotence": (
        lambda v: v.lower() in {"true", "1"},
        "must stay true: without it a retried batch can be duplicated or reordered",
    ),
    "acks": (lambda v: v.lower() in {"all", "-1"}, "must stay all (-1): the relay marks on acks"),
    "delivery.report.only.error": (
        lambda v: v.lower() in {"false", "0"},
        "must stay false: rows are marked sent from success reports",
    ),
    "max.in.flight.requests.per.connection": (
        lambda v: v.isdigit() and 1 <= int(v) <= 5,
        "must be 1-5: the idempotent producer keeps order only up to 5",
    ),
    "max.in.flight": (  # librdkafka's alias of the above
        lambda v: v.isdigit() and 1 <= int(v) <= 5,
        "must be 1-5: the idempotent producer keeps order only up to 5",
    ),
    "message.timeout.ms": (
        lambda v: v.strip() == "0",
        "must stay 0: the relay times deliveries out itself"
        " (RELAY_SINK_TIMEOUT_SECONDS), keeping per-key order",
    ),
    "delivery.timeout.ms": (  # librdkafka's alias of the above
        lambda v: v.strip() == "0",
        "must stay 0: the relay times deliveries out itself"
        " (RELAY_SINK_TIMEOUT_SECONDS), keeping per-key order",
    ),
    "enable.gapless.guarantee": (
        lambda v: v.lower() in {"true", "1"},
        "must stay true: a gap in a partition would break per-key order",
    ),
    "transactional.id": (
        lambda _v: False,
        "is not supported: the relay does not run a transactional producer (yet)",
    ),
}


def _check_guarantees(config: dict[str, str]) -> None:
    for name, value in config.items():
        rule = _KAFKA_GUARDED.get(name)
        if rule is not None and not rule[0](str(value).strip()):
            raise SettingsError(_variable(name), rule[1])


def _message_max_bytes(settings: KafkaSettings) -> int:
    """The producer's own limit, message.max.bytes (librdkafka's default 1,000,000):
    a larger row would only come back from the client as too large."""
    value = settings.librdkafka_config().get("message.max.bytes", "")
    return int(value) if value.strip().isdigit() else 1_000_000


def _require(settings: KafkaSettings) -> None:
    if not settings.kafka_bootstrap_servers:
        raise SettingsError("RELAY_KAFKA_BOOTSTRAP_SERVERS", "is required when RELAY_SINK=kafka")
    if isinstance(settings, SinkSettings):
        refuse(
            settings,
            "kafka",
            {
                "sink_max_in_flight": "the producer queues a whole batch",
                "sink_tls_ca_file": "set RELAY_KAFKA__SSL_CA_LOCATION",
                "sink_tls_cert_file": "set RELAY_KAFKA__SSL_CERTIFICATE_LOCATION",
                "sink_tls_key_file": "set RELAY_KAFKA__SSL_KEY_LOCATION",
            },
        )
        if settings.sink_timeout_seconds is not None and settings.sink_timeout_seconds < 1:
            raise SettingsError(
                "RELAY_SINK_TIMEOUT_SECONDS", "must be at least 1 for RELAY_SINK=kafka"
            )
    _check_paths(settings.librdkafka_config())


def _check_paths(config: dict[str, str]) -> None:
    """The files librdkafka would fail to open when the producer is created (a
    traceback then, with no setting named)."""
    for name, path in config.items():
        if name not in _LIBRDKAFKA_PATHS or (name in _CA_LOCATIONS and path == "probe"):
            continue
        problem = unreadable(path, directory_ok=name in _CA_LOCATIONS)
        if problem:
            raise SettingsError(_variable(name), f"cannot read {path}: {problem}")


def plaintext_sasl_warnings(settings: KafkaSettings) -> list[tuple[str, str]]:
    """(variable, why) when SASL credentials go over plaintext to a broker that is not
    on this machine: they work, and anyone on the path can use them."""
    config = settings.librdkafka_config()
    protocol = config.get("security.protocol", "")
    if protocol.lower() != "sasl_plaintext":
        return []
    mechanism = (
        config.get("sasl.mechanism")
        or config.get("sasl.mechanisms")  # librdkafka's alias
        or "GSSAPI"  # librdkafka's default, made for untrusted networks
    ).upper()
    exposure = _EXPOSED_MECHANISMS.get(mechanism)
    servers = config.get("bootstrap.servers") or settings.kafka_bootstrap_servers or ""
    if exposure is None or all(is_loopback(_broker_host(s)) for s in servers.split(",")):
        return []
    return [
        (
            _variable("security.protocol"),
            f"SASL {mechanism} over sasl_plaintext {exposure}, and every message travels"
            " unencrypted: use sasl_ssl",
        )
    ]


def _broker_host(server: str) -> str:
    """The host of `host:port`, `[v6]:port` or `PROTOCOL://host:port`."""
    address = server.strip().rpartition("://")[2]
    if address.startswith("["):
        return address[1:].partition("]")[0]
    return address.rpartition(":")[0] if address.count(":") == 1 else address


SINK = SinkSpec(
    name="kafka",
    settings=KafkaSettings,
    implementation="relay.sinks.kafka.sink:KafkaSink",
    secrets=KAFKA_SECRETS,
    require=_require,
    message_max_bytes=_message_max_bytes,
)
