"""The Kafka sink's settings (`RELAY_KAFKA_*`, and `RELAY_KAFKA__<NAME>` for librdkafka):
fields, their validation, and the secrets among them. `relay.settings.Settings` is
made of these and the other sinks' settings, so every variable keeps its name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

from relay.errors import SettingsError
from relay.sinks.base import SinkSpec

KAFKA_SECRETS = ("kafka_sasl_password",)


class KafkaSettings(BaseModel):
    kafka_bootstrap_servers: str | None = None
    kafka_compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "lz4"
    kafka_linger_ms: int = Field(default=5, ge=0, le=60_000)
    kafka_delivery_timeout_ms: int = Field(default=30_000, ge=1_000, le=900_000)
    kafka_straggler_ms: int = Field(
        default=1_000,
        ge=50,
        le=900_000,
        description="A batch whose other messages were acknowledged stops waiting for the "
        "rest after this long without a report: they stay in flight (their keys held) "
        "while other partitions flow.",
    )
    kafka_security_protocol: Literal["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"] | None = None
    kafka_sasl_mechanism: str | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_topic_map: dict[str, str] = Field(
        default_factory=dict,
        description='JSON: outbox topic -> Kafka topic, e.g. {"orders": "prod.orders"}.',
    )
    kafka: dict[str, str] = Field(
        default_factory=dict,
        description="librdkafka pass-through: RELAY_KAFKA__SSL_CA_LOCATION sets ssl.ca.location.",
    )

    def librdkafka_config(self) -> dict[str, str]:
        """Pass-through librdkafka settings with their dotted names restored."""
        return {key.lower().replace("_", "."): value for key, value in self.kafka.items()}

    @model_validator(mode="after")
    def _guarantees_kept(self) -> KafkaSettings:
        _check_guarantees(self.librdkafka_config())
        return self


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
        " (RELAY_KAFKA_DELIVERY_TIMEOUT_MS), keeping per-key order",
    ),
    "delivery.timeout.ms": (  # librdkafka's alias of the above
        lambda v: v.strip() == "0",
        "must stay 0: the relay times deliveries out itself"
        " (RELAY_KAFKA_DELIVERY_TIMEOUT_MS), keeping per-key order",
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
            env = f"RELAY_KAFKA__{name.upper().replace('.', '_')}"
            raise SettingsError(env, rule[1])


def _require(settings: KafkaSettings) -> None:
    if not settings.kafka_bootstrap_servers:
        raise SettingsError("RELAY_KAFKA_BOOTSTRAP_SERVERS", "is required when RELAY_SINK=kafka")


SINK = SinkSpec(
    name="kafka",
    settings=KafkaSettings,
    implementation="relay.sinks.kafka:KafkaSink",
    secrets=KAFKA_SECRETS,
    require=_require,
)
