"""What every sink is configured by under one name (`RELAY_SINK_*`, `RELAY_TOPIC_MAP`):
where a topic goes, how many publishes may wait at once, how long one may wait, and the
TLS files a connection presents. Each sink reads them, with its own defaults where it
has them; a setting that means nothing to the chosen sink stops start-up, naming it.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from relay.errors import SettingsError

# The bounds every sink accepts; a sink may ask for less (Kafka: at least a second).
TIMEOUT_MAX_SECONDS = 3600.0


class SinkSettings(BaseModel):
    topic_map: dict[str, str] = Field(
        default_factory=dict,
        description="JSON: outbox topic -> the sink's name for it: a Kafka topic, a NATS "
        'subject, a RabbitMQ routing key; e.g. {"orders": "prod.orders"}. A topic not '
        "in it goes by its own name. (HTTP: RELAY_HTTP_TOPIC_URLS.)",
    )
    sink_max_in_flight: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Publishes awaiting their acknowledgement at once, across keys (a "
        "key's rows go one at a time). Unset: 16 requests for HTTP (also its connection "
        "pool's size), 64 for NATS and RabbitMQ. Kafka's producer queues a whole batch "
        "and takes none.",
    )
    sink_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        le=TIMEOUT_MAX_SECONDS,
        description="How long a publish may wait for its acknowledgement before it is "
        "retried. Unset: 30 s for Kafka (a batch's whole delivery: then what is still "
        "queued is purged and the producer replaced, so per-key order holds) and HTTP (the "
        "whole request, waiting for a connection included), 5 s for NATS and RabbitMQ.",
    )
    sink_tls_ca_file: str | None = Field(
        default=None,
        description="A PEM bundle of CAs to verify the sink's servers against (a private "
        "CA), for HTTP, NATS and RabbitMQ. Default: the system's CAs. Kafka: "
        "RELAY_KAFKA__SSL_CA_LOCATION.",
    )
    sink_tls_cert_file: str | None = Field(
        default=None,
        description="A client certificate (PEM) for mutual TLS, for HTTP, NATS and "
        "RabbitMQ; its key too, unless RELAY_SINK_TLS_KEY_FILE holds it. Kafka: "
        "RELAY_KAFKA__SSL_CERTIFICATE_LOCATION.",
    )
    sink_tls_key_file: str | None = Field(
        default=None,
        description="The private key (PEM) of RELAY_SINK_TLS_CERT_FILE, when that file does "
        "not hold it.",
    )

    @model_validator(mode="after")
    def _pairs(self) -> SinkSettings:
        if self.sink_tls_key_file and not self.sink_tls_cert_file:
            raise SettingsError(
                "RELAY_SINK_TLS_CERT_FILE", "is required with RELAY_SINK_TLS_KEY_FILE"
            )
        return self


def refuse(settings: SinkSettings, sink: str, fields: dict[str, str]) -> None:
    """Stop start-up on a shared setting the chosen sink has no use for: `fields` maps
    each to what that sink takes instead."""
    for field, instead in fields.items():
        value = getattr(settings, field)
        if value is not None and value != {}:
            raise SettingsError(
                f"RELAY_{field.upper()}", f"does not apply to RELAY_SINK={sink}: {instead}"
            )


def tls_files(settings: SinkSettings) -> tuple[str | None, str | None, str | None]:
    """(CA bundle, client certificate, its key), as `ssl` loads them."""
    return settings.sink_tls_ca_file, settings.sink_tls_cert_file, settings.sink_tls_key_file
