"""The RabbitMQ sink's settings (`RELAY_RABBITMQ_*`): fields, their validation, and the
secrets among them. Registered as `RELAY_SINK=rabbitmq` by `SINK` below.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from relay.errors import SettingsError
from relay.sinks.base import SinkSpec

RABBITMQ_SECRETS = ("rabbitmq_url",)  # amqp://user:password@host/vhost

MAX_SHORTSTR = 255  # AMQP short strings: routing keys, exchange names, message ids


class RabbitmqSettings(BaseModel):
    rabbitmq_url: SecretStr | None = Field(
        default=None, description="amqp://user:password@host:5672/vhost, or amqps://."
    )
    rabbitmq_exchange: str = Field(
        default="",
        max_length=MAX_SHORTSTR,
        description="Exchange to publish to; empty: the default exchange (routing key = "
        "queue name). It must exist: the relay declares nothing.",
    )
    rabbitmq_routing_key_map: dict[str, str] = Field(
        default_factory=dict,
        description='JSON: outbox topic -> routing key, e.g. {"orders": "orders.created"}.',
    )
    rabbitmq_tls_ca_file: str | None = Field(
        default=None,
        description="A PEM bundle of CAs to verify the broker against (default: the "
        "system's); with an amqps:// URL only.",
    )
    rabbitmq_tls_cert_file: str | None = Field(
        default=None,
        description="A client certificate (PEM) for mutual TLS, with an amqps:// URL; its "
        "key too, unless RELAY_RABBITMQ_TLS_KEY_FILE holds it.",
    )
    rabbitmq_tls_key_file: str | None = Field(
        default=None,
        description="The private key (PEM) of RELAY_RABBITMQ_TLS_CERT_FILE, when that file "
        "does not hold it.",
    )
    rabbitmq_publish_timeout_seconds: float = Field(
        default=5.0, gt=0, le=300, description="How long one publish waits for its confirm."
    )
    rabbitmq_max_in_flight: int = Field(
        default=64, ge=1, le=4096, description="Publishes awaiting their confirm at once (keys)."
    )

    @field_validator("rabbitmq_url")
    @classmethod
    def _url_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            parts = urlsplit(value.get_secret_value().strip())
            # Never quote the URL: it may hold a password.
            if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
                raise ValueError("must be an amqp:// or amqps:// URL with a host")
            try:
                parts.port  # noqa: B018 - raises on an out-of-range port
            except ValueError:
                raise ValueError("has an invalid port") from None
        return value

    @field_validator("rabbitmq_routing_key_map")
    @classmethod
    def _keys_shape(cls, value: dict[str, str]) -> dict[str, str]:
        for topic, key in value.items():
            if len(key.encode()) > MAX_SHORTSTR:
                raise ValueError(f"topic {topic!r}: a routing key is at most 255 bytes")
        return value

    @model_validator(mode="after")
    def _pairs(self) -> RabbitmqSettings:
        if self.rabbitmq_tls_key_file and not self.rabbitmq_tls_cert_file:
            raise SettingsError(
                "RELAY_RABBITMQ_TLS_CERT_FILE", "is required with RELAY_RABBITMQ_TLS_KEY_FILE"
            )
        return self

    @model_validator(mode="after")
    def _tls_needs_amqps(self) -> RabbitmqSettings:
        """An amqp:// URL never uses TLS: its TLS settings would be ignored, and the
        connection (credentials included) would go in plaintext while they suggest not."""
        if self.rabbitmq_url is None or uses_tls(self.rabbitmq_url.get_secret_value()):
            return self
        for name in ("rabbitmq_tls_ca_file", "rabbitmq_tls_cert_file", "rabbitmq_tls_key_file"):
            if getattr(self, name):
                raise SettingsError(
                    f"RELAY_{name.upper()}",
                    "takes effect with an amqps:// RELAY_RABBITMQ_URL only, and this one is"
                    " amqp:// (plaintext): use amqps://",
                )
        return self


def uses_tls(url: str) -> bool:
    """Whether the sink connects over TLS (amqps://): its TLS settings apply only then."""
    return url.strip().startswith("amqps://")


def _require(settings: RabbitmqSettings) -> None:
    if settings.rabbitmq_url is None:
        raise SettingsError("RELAY_RABBITMQ_URL", "is required when RELAY_SINK=rabbitmq")


SINK = SinkSpec(
    name="rabbitmq",
    settings=RabbitmqSettings,
    implementation="relay.sinks.rabbitmq.sink:RabbitmqSink",
    secrets=RABBITMQ_SECRETS,
    require=_require,
    extra="rabbitmq",
)
