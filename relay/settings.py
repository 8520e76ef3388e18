"""Every setting the relay reads, validated once at start-up.

The rest of the code receives a `Settings` object and never looks at the environment:
a bad value fails here, with the name of the variable, before any connection is made.

Long: every `RELAY_*` setting is one field here, the contract operators configure
against, read in one place. The sinks' own fields move to their sinks with the
one-module-per-sink interface.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import os
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from relay.errors import SettingsError

__all__ = ["CommonSettings", "Settings", "SettingsError", "load_settings"]

ENV_PREFIX = "RELAY_"

# Secret settings may also be given as a path in RELAY_<NAME>_FILE (Kubernetes Secret
# volumes, Docker secrets), so the secret never has to sit in the process environment.
SECRET_FIELDS = (
    "database_url",
    "database_password",
    "kafka_sasl_password",
    "http_url",  # webhook URLs often carry a token
    "http_signing_secret",
    "http_auth_header_value",
)


class _FileSecretsSource(PydanticBaseSettingsSource):
    """Reads `RELAY_<NAME>_FILE` for the secret fields."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name in SECRET_FIELDS:
            env_name = f"{ENV_PREFIX}{name.upper()}_FILE"
            path = os.environ.get(env_name)
            if not path:
                continue
            try:
                values[name] = Path(path).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise SettingsError(env_name, f"cannot read file: {exc.strerror}") from None
        return values


def default_replica_id() -> str:
    # The pod name is the hostname in Kubernetes; pid and a random suffix keep two
    # processes on one host (and a restarted process) distinct as lease holders.
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class CommonSettings(BaseSettings):
    """What every command needs: the database, the lease name, logging.

    `relay migrate` and the operator commands use only these, so a migration Job does
    not have to carry sink settings.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="ignore",
        case_sensitive=False,
        validate_default=True,
    )

    # --- database ---
    database_url: SecretStr = Field(
        description="libpq URL or DSN of the PostgreSQL database that holds the outbox."
    )
    database_password: SecretStr | None = Field(
        default=None, description="Overrides the password in RELAY_DATABASE_URL."
    )
    database_sslmode: (
        Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"] | None
    ) = None
    database_sslrootcert: str | None = None
    database_connect_timeout_seconds: int = Field(default=5, ge=1, le=300)
    database_statement_timeout_ms: int = Field(default=10_000, ge=0)
    database_lock_timeout_ms: int = Field(default=2_000, ge=0)
    database_idle_in_transaction_timeout_ms: int = Field(default=30_000, ge=0)
    database_synchronous_commit: (
        Literal["on", "off", "local", "remote_write", "remote_apply"] | None
    ) = Field(
        default=None,
        description="synchronous_commit for the relay's lease, settle and drain sessions "
        "(default: the server's). With asynchronous replication a failover can lose "
        "acknowledged lease writes and marks; remote_apply (or on, with synchronous "
        "standbys configured) trades commit latency for keeping them.",
    )

    lease_name: str = Field(default="default", min_length=1, max_length=200)
    log_format: Literal["json", "console"] | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("database_url")
    @classmethod
    def _database_url_shape(cls, value: SecretStr) -> SecretStr:
        raw = value.get_secret_value().strip()
        if not raw:
            raise ValueError("must not be empty")
        if "://" in raw and not raw.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL or a key=value DSN")
        # Parse it here: libpq's parse errors quote the offending text, which may be the
        # password, and they would otherwise surface in `relay check` and in logs.
        try:
            parsed = conninfo_to_dict(raw)
        except psycopg.Error:
            raise ValueError(
                "is not a valid libpq URL or DSN (not shown: it may hold a password;"
                " percent-encode special characters such as % @ / in a URL)"
            ) from None
        if "@" in str(parsed.get("host", "")):
            raise ValueError("has an '@' in the host part: write an '@' in the password as %40")
        return SecretStr(raw)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _FileSecretsSource(settings_cls))


class Settings(CommonSettings):
    """Everything `relay run` needs, from `RELAY_*` environment variables (12-factor)."""

    # --- sink ---
    sink: Literal["kafka", "http"] = "kafka"
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
    # --- HTTP sink (relay/sinks/http.py) ---
    http_url: str | None = Field(
        default=None,
        description="Default endpoint; `{topic}` in it is replaced by the row's topic.",
    )
    http_topic_urls: dict[str, str] = Field(
        default_factory=dict,
        description='JSON: outbox topic -> URL, e.g. {"orders": "https://x/orders"}.',
    )
    http_max_in_flight: int = Field(default=16, ge=1, le=1024)
    http_connect_timeout_seconds: float = Field(default=5.0, gt=0, le=300)
    http_read_timeout_seconds: float = Field(default=10.0, gt=0, le=3600)
    http_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    http_tls_verify: bool = True
    http_ca_file: str | None = None
    http_client_cert_file: str | None = None
    http_client_key_file: str | None = None
    http_content_type: str = Field(default="application/octet-stream", min_length=1)
    http_forward_headers: str = Field(
        default="*",
        description="Row headers to send: `*` for all, or a comma-separated allow-list.",
    )
    http_retry_statuses: str = Field(
        default="",
        description="More statuses to retry instead of dead-letter, e.g. `401,403,404`.",
    )
    http_signing_secret: SecretStr | None = Field(
        default=None, description="Standard Webhooks secret (`whsec_<base64>`)."
    )
    http_auth_header_name: str = "Authorization"
    http_auth_header_value: SecretStr | None = None

    # --- lease ---
    lease_ttl_seconds: float = Field(default=10.0, ge=1.0, le=3600.0)
    lease_renew_interval_seconds: float | None = Field(default=None, gt=0)
    lease_safety_margin_seconds: float | None = Field(default=None, ge=0)
    standby_poll_seconds: float = Field(default=0.5, gt=0, le=60)
    replica_id: str = Field(default_factory=default_replica_id, min_length=1, max_length=200)
    heartbeat_seconds: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="How often each replica records in the database that it is alive and "
        "whether it reaches the sink (a standby probes it; a leader reports its progress).",
    )
    give_way_seconds: float = Field(
        default=30.0,
        ge=0,
        description="A leader that delivered nothing for this long while rows wait hands "
        "the lease to a live replica that reports it can reach the sink; 0 never does.",
    )

    # --- draining ---
    batch_size: int = Field(default=500, ge=1, le=50_000)
    batch_max_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="A batch stops at this many bytes of payload and headers (at least one "
        "row): a batch is held in two stages at most (read ahead, publishing), so this "
        "bounds memory.",
    )
    batch_max_per_key: int | None = Field(
        default=None,
        ge=1,
        description="Rows of one key in one batch while other keys' rows wait. Default: a "
        "fifth of the batch for Kafka (a key alone still fills whole batches); 4 for HTTP, "
        "which sends a key's rows one at a time (there it holds even when nobody waits).",
    )
    poll_interval_min_seconds: float = Field(default=0.005, gt=0, le=10)
    poll_interval_max_seconds: float = Field(default=0.1, gt=0, le=60)
    max_attempts: int = Field(default=10, ge=1)
    retry_base_seconds: float = Field(default=0.5, gt=0)
    retry_max_seconds: float = Field(default=300.0, gt=0)
    retention_seconds: float = Field(
        default=0.0,
        ge=0,
        description="0 deletes rows once sent; above 0 keeps them (sent_at set) that long.",
    )
    purge_interval_seconds: float = Field(default=60.0, gt=0)
    purge_batch_size: int = Field(default=1_000, ge=1, le=100_000)
    shutdown_timeout_seconds: float = Field(default=20.0, gt=0)

    # --- operations ---
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9108, ge=0, le=65535)
    metrics_enabled: bool = True

    @field_validator("http_url")
    @classmethod
    def _http_url_shape(cls, value: str | None) -> str | None:
        if value is not None:
            _check_http_url(value)
        return value

    @field_validator("http_topic_urls")
    @classmethod
    def _http_topic_urls_shape(cls, value: dict[str, str]) -> dict[str, str]:
        for topic, url in value.items():
            try:
                _check_http_url(url)
            except ValueError as exc:
                raise ValueError(f"topic {topic!r}: {exc}") from None
        return value

    @field_validator("http_retry_statuses")
    @classmethod
    def _retry_statuses_shape(cls, value: str) -> str:
        for part in value.split(","):
            code = part.strip()
            if code and not (code.isdigit() and 300 <= int(code) <= 499):
                raise ValueError("must be a comma-separated list of 3xx/4xx status codes")
        return value

    @field_validator("http_signing_secret")
    @classmethod
    def _signing_secret_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            signing_key(value)  # fail at start-up, not on the first message
        return value

    @field_validator("http_auth_header_name")
    @classmethod
    def _header_name_shape(cls, value: str) -> str:
        if not HEADER_TOKEN.fullmatch(value):
            raise ValueError("must be an HTTP header name")
        return value

    @field_validator("http_auth_header_value", "http_signing_secret", mode="before")
    @classmethod
    def _strip_secret(cls, value: Any) -> Any:
        # `echo token > secret` leaves a newline that would make an illegal header.
        return value.strip() if isinstance(value, str) else value

    @field_validator("http_auth_header_value")
    @classmethod
    def _auth_value_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not _HEADER_VALUE.fullmatch(value.get_secret_value()):
            raise ValueError("must be a non-empty header value of visible ASCII characters")
        return value

    @field_validator("http_content_type")
    @classmethod
    def _content_type_shape(cls, value: str) -> str:
        if not _HEADER_VALUE.fullmatch(value):
            raise ValueError("must be a header value of visible ASCII characters")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Settings:
        if self.sink == "kafka" and not self.kafka_bootstrap_servers:
            raise SettingsError(
                "RELAY_KAFKA_BOOTSTRAP_SERVERS", "is required when RELAY_SINK=kafka"
            )
        if self.sink == "http" and not (self.http_url or self.http_topic_urls):
            raise SettingsError(
                "RELAY_HTTP_URL", "is required when RELAY_SINK=http (or RELAY_HTTP_TOPIC_URLS)"
            )
        if self.http_client_key_file and not self.http_client_cert_file:
            raise SettingsError(
                "RELAY_HTTP_CLIENT_CERT_FILE", "is required with RELAY_HTTP_CLIENT_KEY_FILE"
            )
        if self.poll_interval_min_seconds > self.poll_interval_max_seconds:
            raise SettingsError(
                "RELAY_POLL_INTERVAL_MIN_SECONDS", "must not exceed RELAY_POLL_INTERVAL_MAX_SECONDS"
            )
        if self.renew_interval >= self.lease_ttl_seconds - self.safety_margin:
            raise SettingsError(
                "RELAY_LEASE_RENEW_INTERVAL_SECONDS",
                "must be shorter than RELAY_LEASE_TTL_SECONDS minus the safety margin",
            )
        if 0 < self.give_way_seconds < 2 * self.heartbeat_seconds:
            raise SettingsError(
                "RELAY_GIVE_WAY_SECONDS",
                "must be 0 (never) or at least twice RELAY_HEARTBEAT_SECONDS: the decision "
                "rests on the other replicas' heartbeats",
            )
        _check_guarantees(self.librdkafka_config())
        return self

    # --- derived values, so no caller re-derives them differently ---

    @property
    def safety_margin(self) -> float:
        """Time subtracted from the ttl for the local deadline (clock drift, slow commits)."""
        if self.lease_safety_margin_seconds is not None:
            return self.lease_safety_margin_seconds
        return min(2.0, self.lease_ttl_seconds * 0.2)

    @property
    def replica_live_seconds(self) -> float:
        """A replica whose heartbeat is older than this counts as gone."""
        return max(self.lease_ttl_seconds, 3 * self.heartbeat_seconds)

    @property
    def renew_interval(self) -> float:
        if self.lease_renew_interval_seconds is not None:
            return self.lease_renew_interval_seconds
        return self.lease_ttl_seconds / 3

    @property
    def keep_sent_rows(self) -> bool:
        return self.retention_seconds > 0

    @property
    def http_retry_status_codes(self) -> frozenset[int]:
        return frozenset(int(c) for c in self.http_retry_statuses.split(",") if c.strip())

    @property
    def http_forward_allowlist(self) -> frozenset[str] | None:
        """Lower-cased row header names to forward; None forwards every row header."""
        raw = self.http_forward_headers.strip()
        if raw == "*":
            return None
        return frozenset(name.strip().lower() for name in raw.split(",") if name.strip())

    def librdkafka_config(self) -> dict[str, str]:
        """Pass-through librdkafka settings with their dotted names restored."""
        return {key.lower().replace("_", "."): value for key, value in self.kafka.items()}

    # --- lag sampling (observability) ---
    lag_sample_seconds: float = Field(
        default=5.0,
        ge=0,
        le=3600,
        description="How often every replica refreshes the lag gauges; 0 turns sampling off.",
    )
    lag_count_cap: int = Field(
        default=100_000,
        ge=1,
        le=100_000_000,
        description="Row counts in the lag gauges stop here, so a sample's cost is bounded.",
    )


HEADER_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e\t]*[\x21-\x7e])?")


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
            env = f"{ENV_PREFIX}KAFKA__{name.upper().replace('.', '_')}"
            raise SettingsError(env, rule[1])


def _check_http_url(url: str) -> None:
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    if "{" in parsed.netloc:
        raise ValueError("{topic} may appear in the path or query, not in the host")
    try:
        parsed.port  # noqa: B018 - raises on an out-of-range port
    except ValueError:
        raise ValueError("has an invalid port") from None


def url_origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an endpoint URL: what one connection pool talks to."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname or "", port


def configured_origins(settings: Settings) -> set[tuple[str, str, int]]:
    urls = list(settings.http_topic_urls.values())
    if settings.http_url:
        urls.append(settings.http_url)
    return {url_origin(url) for url in urls}


def signing_key(secret: SecretStr) -> bytes:
    """The HMAC key of a Standard Webhooks secret: base64, optionally prefixed `whsec_`."""
    raw = secret.get_secret_value().strip().removeprefix("whsec_")
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("must be base64, optionally prefixed whsec_") from None
    if len(key) < 16:
        raise ValueError("must decode to at least 16 bytes")
    return key


S = TypeVar("S", bound=CommonSettings)


def _env_name(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    if not parts:
        return "RELAY_*"
    head = f"{ENV_PREFIX}{parts[0].upper()}"
    if len(parts) > 1:
        head += "__" + "__".join(p.upper() for p in parts[1:])
    return head


# RELAY_* variables that are not settings and must never stop a replica: the service
# links Kubernetes injects into every pod of a namespace with a Service named `relay`
# (RELAY_SERVICE_HOST, RELAY_SERVICE_PORT_METRICS, RELAY_PORT, RELAY_PORT_9108_TCP_ADDR,
# ...; the manifests also set enableServiceLinks: false), and the test-only failpoint
# hook (relay/failpoints.py).
_NOT_SETTINGS = re.compile(
    r"RELAY_(SERVICE_(HOST|PORT)(_[A-Z0-9_]+)?"
    r"|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?"
    r"|FAILPOINTS)"
)


def _setting_names() -> tuple[set[str], tuple[str, ...]]:
    """Every settings variable, and the prefixes of the nested ones (dict settings:
    RELAY_KAFKA__SSL_CA_LOCATION)."""
    names = {f"{ENV_PREFIX}{field.upper()}" for field in Settings.model_fields}
    names |= {f"{ENV_PREFIX}{field.upper()}_FILE" for field in SECRET_FIELDS}
    nested = tuple(
        f"{ENV_PREFIX}{field.upper()}__"
        for field, info in Settings.model_fields.items()
        if info.annotation is not None and "dict" in str(info.annotation)
    )
    return names, nested


def is_setting_variable(name: str) -> bool:
    names, nested = _setting_names()
    return name in names or name.startswith(nested)


def check_unknown_variables(environ: Mapping[str, str]) -> None:
    """A misspelled setting (RELAY_BATCHSIZE) is an error, not a silent default."""
    names, nested = _setting_names()
    for variable in sorted(environ):
        name = variable.upper()  # settings are case-insensitive
        if (
            not name.startswith(ENV_PREFIX)
            or name in names
            or name.startswith(nested)
            or _NOT_SETTINGS.fullmatch(name)
        ):
            continue
        close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise SettingsError(variable, f"is not a relay setting{hint}")


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build the settings or raise `SettingsError` naming the first bad variable.

    Every command checks the whole RELAY_* environment against every setting (not
    only its own): one environment usually serves all of them. The message never
    carries the offending value: it might be a password.
    """
    check_unknown_variables(os.environ)
    try:
        return cls(**overrides)
    except SettingsError:
        raise
    except ValidationError as exc:
        first = exc.errors(include_input=False, include_url=False)[0]
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        ctx_error = (first.get("ctx") or {}).get("error")
        if isinstance(ctx_error, SettingsError):
            raise ctx_error from None
        if first.get("type") == "missing":
            message = "is required"
        raise SettingsError(_env_name(first["loc"]), message) from None
