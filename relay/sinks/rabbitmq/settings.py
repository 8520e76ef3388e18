"""The RabbitMQ sink's settings (`RELAY_RABBITMQ_*`): fields, their validation, and the
secrets among them. Registered as `RELAY_SINK=rabbitmq` by `SINK` below.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator

from relay.errors import SettingsError
from relay.sinks.base import SinkSpec
from relay.sinks.settings import SinkSettings

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


def uses_tls(url: str) -> bool:
    """Whether the sink connects over TLS (amqps://): its TLS settings apply only then."""
    return url.strip().startswith("amqps://")


def _require(settings: RabbitmqSettings) -> None:
    if settings.rabbitmq_url is None:
        raise SettingsError("RELAY_RABBITMQ_URL", "is required when RELAY_SINK=rabbitmq")
    if not isinstance(settings, SinkSettings):
        return
    for topic, key in settings.topic_map.items():
        if len(key.encode()) > MAX_SHORTSTR:
            raise SettingsError(
                "RELAY_TOPIC_MAP", f"topic {topic!r}: a routing key is at most 255 bytes"
            )
    # An amqp:// URL never uses TLS: its TLS settings would be ignored, and the connection
    # (credentials included) would go in plaintext while they suggest not.
    if not uses_tls(settings.rabbitmq_url.get_secret_value()):
        for name in ("sink_tls_ca_file", "sink_tls_cert_file", "sink_tls_key_file"):
            if getattr(settings, name):
                raise SettingsError(
                    f"RELAY_{name.upper()}",
                    "takes effect with an amqps:// RELAY_RABBITMQ_URL only, and this one is"
                    " amqp:// (plaintext): use amqps://",
                )


SINK = SinkSpec(
    name="rabbitmq",
    settings=RabbitmqSettings,
    implementation="relay.sinks.rabbitmq.sink:RabbitmqSink",
    secrets=RABBITMQ_SECRETS,
    require=_require,
    extra="rabbitmq",
)
