"""The NATS JetStream sink's settings (`RELAY_NATS_*`): fields, their validation, and
the secrets among them. Registered as `RELAY_SINK=nats` by `SINK` below.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator

from relay.errors import SettingsError
from relay.sinks.base import SinkSpec
from relay.sinks.settings import SinkSettings

# A server URL may carry user:password or a token.
NATS_SECRETS = ("nats_url",)  # it may carry user:password or a token


class NatsSettings(BaseModel):
    nats_url: SecretStr | None = Field(
        default=None,
        description="Server URL(s), comma-separated: nats://host:4222 or tls://host:4222; "
        "with user and password auth nats://user:password@host:4222, with token auth "
        "nats://token@host:4222 (a secret: give it as RELAY_NATS_URL_FILE).",
    )
    nats_creds_file: str | None = Field(
        default=None, description="A .creds file (JWT and NKey seed) for decentralized auth."
    )

    @field_validator("nats_url")
    @classmethod
    def _url_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            nats_servers(value)
        return value


def nats_servers(url: SecretStr) -> list[str]:
    """The server URLs of RELAY_NATS_URL. Errors never quote it: it may hold a password."""
    servers = [part.strip() for part in url.get_secret_value().split(",") if part.strip()]
    if not servers:
        raise ValueError("must name at least one server")
    for server in servers:
        parts = urlsplit(server)
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise ValueError("must be nats:// or tls:// URLs with a host, comma-separated")
        try:
            parts.port  # noqa: B018 - raises on an out-of-range port
        except ValueError:
            raise ValueError("has an invalid port") from None
    return servers


def subject_problem(subject: str) -> str | None:
    """Why `subject` cannot be published to, or None. Publishing never takes wildcards."""
    if not subject or len(subject) > 1024:
        return "a subject must be 1-1024 characters"
    if any(ch.isspace() or not ch.isprintable() for ch in subject):
        return f"subject {subject!r} has whitespace or control characters"
    tokens = subject.split(".")
    if any(not token for token in tokens):
        return f"subject {subject!r} has an empty token (leading, trailing or double dot)"
    if any(token in ("*", ">") for token in tokens):
        return f"subject {subject!r} has a wildcard: a message is published to one subject"
    return None


def _require(settings: NatsSettings) -> None:
    if settings.nats_url is None:
        raise SettingsError("RELAY_NATS_URL", "is required when RELAY_SINK=nats")
    if isinstance(settings, SinkSettings):
        for topic, subject in settings.topic_map.items():
            problem = subject_problem(subject)
            if problem:
                raise SettingsError("RELAY_TOPIC_MAP", f"topic {topic!r}: {problem}")


SINK = SinkSpec(
    name="nats",
    settings=NatsSettings,
    implementation="relay.sinks.nats.sink:NatsSink",
    secrets=NATS_SECRETS,
    require=_require,
    extra="nats",
    # The server's default max_payload; a server configured higher needs
    # RELAY_MESSAGE_MAX_BYTES to match.
    message_max_bytes=lambda _settings: 1 << 20,
)
