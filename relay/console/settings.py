"""The console's settings: RELAY_CONSOLE_*, beside the relay's database settings.

The database connection is the relay's own `CommonSettings` (RELAY_DATABASE_URL and the
rest, loaded by `relay.settings.load_settings`), so the console connects exactly as
`relay status` does; only the role differs (migrations/console_grants.sql). A bad value
stops `relay console` with exit status 2 and a message naming the variable.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from relay.console.hosts import AllowedHosts, default_hosts
from relay.errors import SettingsError
from relay.setting_checks import read_secret
from relay.settings import CommonSettings, load_settings

PREFIX = "RELAY_CONSOLE_"
DEFAULT_PORT = 9109  # beside the relay's metrics port, 9108
SECRETS = ("token", "viewer_token")
# What Kubernetes injects for a Service named relay-console into pods with service
# links on (the console's Deployment turns them off); never settings.
_SERVICE_LINKS = re.compile(
    r"RELAY_CONSOLE_(SERVICE_(HOST|PORT)(_[A-Z0-9_]+)?|PORT_\d+_(TCP|UDP|SCTP)(_[A-Z]+)?)"
)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ConsoleSettings(BaseSettings):
    """Every RELAY_CONSOLE_* variable (docs/console.md lists them with their defaults)."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, extra="ignore", case_sensitive=False, validate_default=True
    )

    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="The address to listen on (0.0.0.0 in a pod); it also sets the default "
        "of RELAY_CONSOLE_ALLOWED_HOSTS.",
    )
    port: int = Field(
        default=DEFAULT_PORT,
        ge=0,
        le=65535,
        description="The port to listen on (the relay's metrics port is 9108).",
    )
    token: SecretStr | None = Field(
        default=None, description="The shared secret typed into the login form."
    )
    viewer_token: SecretStr | None = Field(
        default=None, description="A second secret whose sessions may look but not change."
    )
    read_only: bool = Field(
        default=False,
        description="Nobody may requeue or discard, whatever their login; run it under the "
        "relay_console_viewer role, so the database refuses too.",
    )
    trusted_user_header: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9-]{1,100}$",
        description="A header an authenticating proxy sets to the user's name "
        "(oauth2-proxy: X-Forwarded-User); off unless set.",
    )
    trusted_proxies: str = Field(
        default="127.0.0.1/32,::1/128",
        description="Comma-separated networks whose requests may carry the user header.",
    )
    allowed_hosts: str = Field(
        default="",
        description="Comma-separated host names (name or name:port) the console answers "
        "to; empty: the bind host, plus localhost when it listens on loopback; * for any.",
    )
    allowed_origins: str = Field(
        default="",
        description="Comma-separated origins (https://console.example.com) accepted "
        "besides the request's own Host, for a proxy that rewrites Host.",
    )
    cookie_secure: bool = Field(
        default=True,
        description="Mark the session cookie Secure: browsers send it over HTTPS and to "
        "localhost only. Set false only for a plain-HTTP console on loopback whose browser "
        "drops it (logging in then returns to the login page).",
    )
    # Fixed by design, not settings: what the pages show and what bounds their cost.
    page_size: ClassVar[int] = 50  # rows a page of dead letters or of the audit
    payload_preview_bytes: ClassVar[int] = 64 * 1024  # of a payload a row's page reads
    count_cap: ClassVar[int] = 100_000  # counts stop here, shown as "at least"
    bulk_cap: ClassVar[int] = 100_000  # rows one requeue or discard changes at most
    rate_window_seconds: ClassVar[float] = 300.0  # the overview's settled rate's window
    pool_size: ClassVar[int] = 4  # database sessions; all busy for 30 s answers 503
    session_hours: ClassVar[float] = 8.0  # a login lasts this long
    # A ceiling on a console statement (a lower, non-zero database timeout stays).
    statement_timeout_seconds: ClassVar[float] = 5.0

    refresh_seconds: int = Field(
        default=10,
        ge=0,
        le=3600,
        description="The overview and blocked-keys pages reload themselves this often; 0 "
        "turns it off.",
    )

    @field_validator("token", "viewer_token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (a shared secret, not a password)")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: str) -> str:
        for part in _parts(value):
            try:
                ipaddress.ip_network(part, strict=False)
            except ValueError:
                raise ValueError(f"{part!r} is not an address or network") from None
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: str) -> str:
        AllowedHosts.parse(value)
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: str) -> str:
        for part in _parts(value):
            if not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", part):
                raise ValueError(f"{part!r} is not an origin (scheme://host[:port])")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ConsoleSettings:
        if self.token is None and self.trusted_user_header is None:
            raise SettingsError(
                f"{PREFIX}TOKEN",
                "is required (or RELAY_CONSOLE_TOKEN_FILE), unless "
                "RELAY_CONSOLE_TRUSTED_USER_HEADER names an authenticating proxy's header",
            )
        if self.token is not None and self.viewer_token == self.token:
            raise SettingsError(f"{PREFIX}VIEWER_TOKEN", "must differ from RELAY_CONSOLE_TOKEN")
        try:
            if not self.allowed_hosts.strip(" ,"):
                AllowedHosts.parse(default_hosts(self.host))
        except ValueError:
            raise SettingsError(
                f"{PREFIX}ALLOWED_HOSTS",
                f"has no default for RELAY_CONSOLE_HOST={self.host!r}: name the console's hosts",
            ) from None
        return self

    @property
    def proxy_networks(self) -> list[Network]:
        return [ipaddress.ip_network(part, strict=False) for part in _parts(self.trusted_proxies)]

    @property
    def hosts(self) -> AllowedHosts:
        """The Host names requests may carry (relay/console/hosts.py)."""
        return AllowedHosts.parse(self.allowed_hosts.strip(" ,") or default_hosts(self.host))

    @property
    def origins(self) -> set[str]:
        return {part.rstrip("/").lower() for part in _parts(self.allowed_origins)}


def _parts(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def check_console_variables(environ: Mapping[str, str]) -> None:
    """A misspelt RELAY_CONSOLE_* is an error naming the closest setting."""
    names = {PREFIX + name.upper() for name in ConsoleSettings.model_fields}
    names |= {f"{PREFIX}{name.upper()}_FILE" for name in SECRETS}
    for variable in sorted(environ):
        name = variable.upper()
        if not name.startswith(PREFIX) or name in names or _SERVICE_LINKS.fullmatch(name):
            continue
        close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise SettingsError(variable, f"is not a console setting{hint}")
    port = environ.get(f"{PREFIX}PORT", "")
    if port.startswith("tcp://"):
        raise SettingsError(
            f"{PREFIX}PORT",
            "holds a Kubernetes service link (a Service named relay-console): set "
            "enableServiceLinks: false in the pod, or RELAY_CONSOLE_PORT explicitly",
        )


def _file_secrets(environ: Mapping[str, str]) -> dict[str, Any]:
    upper = {name.upper(): value for name, value in environ.items()}
    values: dict[str, Any] = {}
    for name in SECRETS:
        variable, file_variable = f"{PREFIX}{name.upper()}", f"{PREFIX}{name.upper()}_FILE"
        path = upper.get(file_variable)
        if not path:
            continue
        if variable in upper:
            raise SettingsError(file_variable, f"{variable} is set too: give it one way")
        values[name] = read_secret(file_variable, path)
    return values


def load_console_settings(
    environ: Mapping[str, str] | None = None, **overrides: Any
) -> ConsoleSettings:
    environ = os.environ if environ is None else environ
    check_console_variables(environ)
    try:
        return ConsoleSettings(**{**_file_secrets(environ), **overrides})
    except SettingsError:
        raise
    except ValidationError as exc:
        first = exc.errors(include_input=False, include_url=False)[0]
        ctx_error = (first.get("ctx") or {}).get("error")
        if isinstance(ctx_error, SettingsError):
            raise ctx_error from None
        field = str(first["loc"][0]) if first["loc"] else "*"
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise SettingsError(PREFIX + field.upper(), message) from None


def load_all() -> tuple[CommonSettings, ConsoleSettings]:
    """The database settings as every relay command reads them, then the console's."""
    return load_settings(CommonSettings), load_console_settings()
