"""The HTTP sink's settings (`RELAY_HTTP_*`): fields, their validation, the secrets
among them, and the helpers that read them (endpoint origins, the signing key).
`relay.settings.Settings` is made of these and the other sinks' settings.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from relay.errors import SettingsError
from relay.sinks.base import SinkSpec

# Webhook URLs often carry a token.
HTTP_SECRETS = ("http_url", "http_signing_secret", "http_auth_header_value")


class HttpSettings(BaseModel):
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
    def _client_certificate(self) -> HttpSettings:
        if self.http_client_key_file and not self.http_client_cert_file:
            raise SettingsError(
                "RELAY_HTTP_CLIENT_CERT_FILE", "is required with RELAY_HTTP_CLIENT_KEY_FILE"
            )
        return self

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


HEADER_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e\t]*[\x21-\x7e])?")


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


def configured_origins(settings: HttpSettings) -> set[tuple[str, str, int]]:
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


def _require(settings: HttpSettings) -> None:
    if not (settings.http_url or settings.http_topic_urls):
        raise SettingsError(
            "RELAY_HTTP_URL", "is required when RELAY_SINK=http (or RELAY_HTTP_TOPIC_URLS)"
        )


SINK = SinkSpec(
    name="http",
    settings=HttpSettings,
    implementation="relay.sinks.http:HttpSink",
    secrets=HTTP_SECRETS,
    require=_require,
)
