"""The HTTP sink's settings (`RELAY_HTTP_*`): fields, their validation, the secrets
among them, and the signing key; where each URL's credentials go is
relay/sinks/http/destinations.py. `relay.settings.Settings` is made of these and the
other sinks' settings.

Long: every RELAY_HTTP_* field with its description (the settings reference is made from
them), and the checks that refuse a bad URL, header or secret at start-up, not on the
first message.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)

from relay.errors import SettingsError
from relay.sinks.base import SinkSpec
from relay.sinks.http.destinations import (
    check_credentials_go_somewhere,
    check_not_plaintext,
    destinations,
    origin_limits,
)
from relay.sinks.settings import SinkSettings, refuse

MAX_RATE = 1_000_000.0  # requests a second: past this a limit is no limit, likely a typo

# Webhook URLs often carry a token; a topic URL may hold its own credentials.
HTTP_SECRETS = ("http_url", "http_topic_urls", "http_signing_secret", "http_auth_header")

# The header a credential given without a name goes in: a RELAY_HTTP_TOPIC_URLS entry's
# auth_header_value without auth_header_name, when RELAY_HTTP_AUTH_HEADER is unset.
DEFAULT_AUTH_HEADER_NAME = "Authorization"


class TopicUrl(BaseModel):
    """One RELAY_HTTP_TOPIC_URLS entry: its URL and the credentials that go there.
    Strict (unknown keys refused): a misspelt key would quietly send no credentials."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(repr=False)  # may carry a token, as RELAY_HTTP_URL may
    share_credentials: bool = Field(default=False, strict=True)
    auth_header_name: str | None = None
    auth_header_value: SecretStr | None = None
    signing_secret: SecretStr | None = None
    # Its origin's limit, in place of RELAY_HTTP_MAX_REQUESTS_PER_SECOND.
    max_requests_per_second: float | None = Field(default=None, gt=0, le=MAX_RATE)

    @field_validator("url")
    @classmethod
    def _url_shape(cls, value: str) -> str:
        _check_http_url(value)
        return value

    @field_validator("auth_header_name")
    @classmethod
    def _header_name_shape(cls, value: str | None) -> str | None:
        return None if value is None else _header_name(value)

    @field_validator("auth_header_value", "signing_secret", mode="before")
    @classmethod
    def _strip_secret(cls, value: Any) -> Any:
        return _stripped(value)

    @field_validator("auth_header_value")
    @classmethod
    def _auth_value_shape(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None else _auth_value(value)

    @field_validator("signing_secret")
    @classmethod
    def _signing_secret_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            signing_key(value)
        return value


class HttpSettings(BaseModel):
    http_url: str | None = Field(
        default=None,
        description="Default endpoint; `{topic}` in it is replaced by the row's topic.",
    )
    http_topic_urls: dict[str, TopicUrl] = Field(
        default_factory=dict,
        description="JSON: outbox topic -> URL, e.g. "
        '{"orders": "https://x/orders"}, or -> an object {"url": ..., "share_credentials": '
        'true, "auth_header_name": ..., "auth_header_value": ..., "signing_secret": ..., '
        '"max_requests_per_second": ...}. '
        "RELAY_HTTP_AUTH_HEADER and RELAY_HTTP_SIGNING_SECRET go to RELAY_HTTP_URL's "
        "origin (scheme, host, port) and to topic URLs on that origin; a topic URL on "
        "another origin gets them only with share_credentials, or has its own.",
    )
    http_max_requests_per_second: float | None = Field(
        default=None,
        gt=0,
        le=MAX_RATE,
        description="Requests a second to each destination origin (scheme, host, port), "
        "each its own budget; a RELAY_HTTP_TOPIC_URLS entry's max_requests_per_second sets "
        "its origin's instead. Unset: no limit.",
    )
    http_tls_verify: bool = Field(
        default=True,
        description="Verify the endpoint's certificate and host name; false accepts anyone "
        "who answers (logged as a warning at start).",
    )
    http_content_type: str = Field(
        default="application/octet-stream",
        min_length=1,
        description="The content-type of a request whose row has no content-type header of "
        "its own (set application/json for JSON payloads).",
    )
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
    http_auth_header: SecretStr | None = Field(
        default=None,
        description="A static credential header sent with every request to RELAY_HTTP_URL's "
        "origin, as `Name: value`, e.g. `Authorization: Bearer <token>`; a topic URL "
        "elsewhere gets it only with share_credentials. A RELAY_HTTP_TOPIC_URLS entry's own "
        "auth_header_value without auth_header_name goes in this header's name (unset: "
        "Authorization); a row's header of that name is never forwarded.",
    )
    http_allow_plaintext_credentials: bool = Field(
        default=False,
        description="Allow an http:// destination that would get an auth header value, or "
        "whose URL holds user:password@ (anyone on the path could read them). Loopback "
        "destinations (localhost, 127.0.0.0/8, ::1) need no opt-in: their traffic never "
        "leaves the host or pod (a sidecar).",
    )

    @field_validator("http_url")
    @classmethod
    def _http_url_shape(cls, value: str | None) -> str | None:
        if value is not None:
            _check_http_url(value)
        return value

    @field_validator("http_topic_urls", mode="before")
    @classmethod
    def _http_topic_urls_entries(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # the field's own type check says what it must be
        return {topic: _topic_url(topic, entry) for topic, entry in value.items()}

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

    @field_validator("http_auth_header", "http_signing_secret", mode="before")
    @classmethod
    def _strip_secret(cls, value: Any) -> Any:
        return _stripped(value)

    @field_validator("http_auth_header")
    @classmethod
    def _auth_header_shape(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None else AuthHeader.parse(value.get_secret_value())

    @property
    def http_auth_header_name(self) -> str:
        """The name of RELAY_HTTP_AUTH_HEADER, else Authorization: where a credential
        given without a name goes, and a header no row may set."""
        header = auth_header(self)
        return DEFAULT_AUTH_HEADER_NAME if header is None else header.name

    @field_validator("http_content_type")
    @classmethod
    def _content_type_shape(cls, value: str) -> str:
        if not _HEADER_VALUE.fullmatch(value):
            raise ValueError("must be a header value of visible ASCII characters")
        return value

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


def _stripped(value: Any) -> Any:
    """`echo token > secret` leaves a newline that would make an illegal header."""
    return value.strip() if isinstance(value, str) else value


def _header_name(value: str) -> str:
    if not HEADER_TOKEN.fullmatch(value):
        raise ValueError("must be an HTTP header name")
    return value


def _auth_value(value: SecretStr) -> SecretStr:
    if not _HEADER_VALUE.fullmatch(value.get_secret_value()):
        raise ValueError("must be a non-empty header value of visible ASCII characters")
    return value


class AuthHeader(SecretStr):
    """RELAY_HTTP_AUTH_HEADER, `Name: value`: a secret as a whole, and its two parts.

    The value is one object for the settings' lifetime, so what receives it can be told
    by identity from a topic URL's own value (relay/sinks/http/destinations.py)."""

    def __init__(self, name: str, value: str) -> None:
        super().__init__(f"{name}: {value}")
        self.name = name
        self.value = SecretStr(value)

    @classmethod
    def parse(cls, text: str) -> AuthHeader:
        """`Name: value`, checked without quoting it (the value is a credential)."""
        name, colon, value = text.partition(":")
        if not colon:
            raise ValueError(
                "must be `Name: value`, e.g. `Authorization: Bearer <token>` (it has no colon;"
                " not shown: a secret)"
            )
        if not HEADER_TOKEN.fullmatch(name):
            raise ValueError(
                "must be `Name: value`: before the colon an HTTP header name (letters, digits,"
                " ! # $ % & ' * + - . ^ _ ` | ~; no spaces)"
            )
        value = value.strip(" \t")
        if not _HEADER_VALUE.fullmatch(value):
            raise ValueError(
                "must be `Name: value`: after the colon a non-empty header value of visible"
                " ASCII characters (not shown: a secret)"
            )
        return cls(name, value)


def auth_header(settings: HttpSettings) -> AuthHeader | None:
    """RELAY_HTTP_AUTH_HEADER's name and value (None: unset)."""
    header = settings.http_auth_header
    if header is None or isinstance(header, AuthHeader):
        return header
    # Set without validation (model_copy(update=...)): parsed here, each time.
    return AuthHeader.parse(header.get_secret_value())


_TOPIC_URL_KEYS = ", ".join(TopicUrl.model_fields)


def _topic_url(topic: str, entry: Any) -> TopicUrl:
    """An entry of RELAY_HTTP_TOPIC_URLS, a URL or an object; errors name the topic and
    never quote a value (it may be a secret)."""
    if isinstance(entry, str):
        entry = {"url": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"topic {topic!r}: must be a URL or an object with a url")
    try:
        return TopicUrl.model_validate(entry)
    except ValidationError as exc:
        raise ValueError(f"topic {topic!r}: {_first_problem(exc)}") from None


def _first_problem(exc: ValidationError) -> str:
    error = exc.errors(include_input=False, include_url=False)[0]
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown key {key!r} (known: {_TOPIC_URL_KEYS})"
    if error["type"] == "missing":
        return f"{key} is required"
    return f"{key}: {str(error['msg']).removeprefix('Value error, ')}"


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
    _check_client_parses(url)


def _check_client_parses(url: str) -> None:
    """What the HTTP client refuses to parse would fail every request to it."""
    import httpx  # only where an HTTP URL is set: other sinks' start-up does not pay

    try:
        httpx.URL(url.replace("{topic}", "topic"))
    except httpx.InvalidURL:
        raise ValueError("is not a URL the HTTP client accepts") from None


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
    if isinstance(settings, SinkSettings):
        refuse(settings, "http", {"topic_map": "map topics to URLs in RELAY_HTTP_TOPIC_URLS"})
    found = list(destinations(settings).values())
    check_credentials_go_somewhere(settings, found)
    origin_limits(settings)  # entries on one origin agree on its limit
    if not settings.http_allow_plaintext_credentials:
        for destination in found:
            check_not_plaintext(destination)


SINK = SinkSpec(
    name="http",
    settings=HttpSettings,
    implementation="relay.sinks.http.sink:HttpSink",
    secrets=HTTP_SECRETS,
    require=_require,
)
