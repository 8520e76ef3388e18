"""What every command reads (`relay migrate`, the operator commands, the console's
database connection, `relay run`): the database, the lease's name, an own outbox table,
logging. `CommonSettings` also names where the settings come from (relay/settings/sources.py).
"""

from __future__ import annotations

import re
from typing import Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from relay.drain.batch import SetAside
from relay.errors import SettingsError
from relay.setting_checks import unreadable
from relay.settings.sources import ENV_PREFIX, FileSecretsSource

DEFAULT_CONNECT_TIMEOUT_SECONDS = 5  # with no connect_timeout in RELAY_DATABASE_URL
IDLE_IN_TRANSACTION_TIMEOUT_SECONDS = 30.0  # relay run caps it at the lease ttl

# Files libpq reads that RELAY_DATABASE_URL (and RELAY_DATABASE_DIRECT_URL) may name.
_URL_TLS_FILES = ("sslrootcert", "sslcert", "sslkey", "sslcrl")

# The relay's fields an own table's columns can be mapped to (RELAY_OUTBOX_COLUMNS).
OWN_TABLE_FIELDS = (
    "id",
    "message_id",
    "topic",
    "key",
    "payload",
    "headers",
    "created_at",
    "available_at",
)


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
        description="libpq URL or DSN of the PostgreSQL database that holds the outbox. "
        "Its parameters are libpq's: sslmode (unset: PGSSLMODE, else libpq's `prefer`, "
        "which checks no certificate; `?sslmode=verify-full&sslrootcert=/path/ca.crt` keeps "
        "the password from whoever answers), sslrootcert (the CA file, checked readable at "
        "start; `system` for the system's CAs, libpq 16+), connect_timeout (default here "
        "5 s), ..."
    )
    database_password: SecretStr | None = Field(
        default=None, description="Overrides the password in RELAY_DATABASE_URL."
    )
    database_direct_url: SecretStr | None = Field(
        default=None,
        description="A URL straight to PostgreSQL, for what needs a session of its own when "
        "RELAY_DATABASE_URL goes through a transaction pooler (PgBouncer, RDS Proxy, "
        "Supavisor): `relay migrate`'s lock and the LISTEN of RELAY_NOTIFY_CHANNEL. The relay "
        "finds a pooler by itself and then runs each transaction as one needs; without this "
        "URL those two are refused, naming it. Its TLS is its own: give it sslmode and "
        "sslrootcert as RELAY_DATABASE_URL has them. docs/howto/poolers.md.",
    )
    database_statement_timeout_seconds: float = Field(
        default=10.0,
        ge=0,
        le=86_400,
        description="statement_timeout on every relay session, so a statement stuck on a "
        "sick database fails and is retried instead of stalling a loop; 0: no limit.",
    )
    database_lock_timeout_seconds: float = Field(
        default=2.0,
        ge=0,
        le=86_400,
        description="lock_timeout on every relay session: how long a statement waits for a "
        "lock before it fails (a lease race lost, a purge put off to its next run); 0: no "
        "limit.",
    )
    database_synchronous_commit: (
        Literal["on", "off", "local", "remote_write", "remote_apply"] | None
    ) = Field(
        default=None,
        description="synchronous_commit for the relay's lease, settle and drain sessions "
        "(default: the server's). With asynchronous replication a failover can lose "
        "acknowledged lease writes and marks; remote_apply (or on, with synchronous "
        "standbys configured) trades commit latency for keeping them.",
    )

    lease_name: str = Field(
        default="default",
        min_length=1,
        max_length=200,
        description="The lease replicas contend for: those with the same name share it, so "
        "one drains (one per shard with RELAY_SHARDS). Each outbox needs its own; it also "
        "names the sink client (`relay-<name>`).",
    )
    # --- bring your own outbox table (relay/store/own_table.py) ---
    outbox_table: str | None = Field(
        default=None,
        pattern=r"^[a-z_][a-z0-9_]{0,62}\.[a-z_][a-z0-9_]{0,62}$",
        description="Drain this existing table (schema.table, lower-case names, the schema "
        "named) instead of "
        "the relay's own `outbox`: the relay reads it through a view that "
        "`relay migrate --own-table` creates from RELAY_OUTBOX_COLUMNS. Give each outbox "
        "its own RELAY_LEASE_NAME.",
    )
    outbox_columns: dict[str, str] = Field(
        default_factory=dict,
        description="With RELAY_OUTBOX_TABLE, for `relay migrate --own-table`: which column "
        "of the table is each of the relay's fields, as JSON, e.g. "
        '{"topic": "aggregatetype", "key": "aggregateid", "message_id": "id", '
        '"header:type": "type"}. Fields: id, message_id, topic, key, payload, headers, '
        "created_at, available_at, and header:NAME for a column sent as header NAME. A "
        "field not named maps to the column of its own name, if the table has one.",
    )
    log_format: Literal["json", "console"] | None = Field(
        default=None,
        description="Log lines on stderr as JSON objects, or readable console lines. Unset: "
        "console when stderr is a terminal, JSON otherwise.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="The least severe level logged."
    )

    @field_validator("lease_name")
    @classmethod
    def _lease_name_shape(cls, value: str) -> str:
        if "#" in value:
            raise ValueError("must not contain '#' (it names a shard's lease: default#3/8)")
        return value

    @field_validator("outbox_table")
    @classmethod
    def _outbox_table_fits(cls, value: str | None) -> str | None:
        if value == "public.outbox":
            raise ValueError("is the relay's own table: leave RELAY_OUTBOX_TABLE unset for it")
        if value is not None and len("relay_" + value) > 63:
            raise ValueError("too long: its view's schema, relay_<schema>_<table>, needs <= 63")
        return value

    @field_validator("outbox_columns")
    @classmethod
    def _outbox_columns_shape(cls, value: dict[str, str]) -> dict[str, str]:
        for field, column in value.items():
            name = field.removeprefix("header:")
            if field == name and field not in OWN_TABLE_FIELDS:
                raise ValueError(
                    f"unknown field {field!r}: one of {', '.join(OWN_TABLE_FIELDS)}, or header:NAME"
                )
            if not name or not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", name):
                raise ValueError(f"{field!r}: a header name is letters, digits, _ . -")
            if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", column):
                raise ValueError(f"{field!r}: {column!r} is not a lower-case column name")
        return value

    @property
    def database_connect_timeout_seconds(self) -> int:
        """How long opening a session may take: the URL's connect_timeout, else 5 s."""
        given = conninfo_to_dict(self.database_url.get_secret_value()).get("connect_timeout")
        try:
            seconds = int(str(given))
        except ValueError:
            return DEFAULT_CONNECT_TIMEOUT_SECONDS
        return seconds if seconds > 0 else DEFAULT_CONNECT_TIMEOUT_SECONDS

    @property
    def database_idle_in_transaction_timeout_seconds(self) -> float:
        """idle_in_transaction_session_timeout on every relay session. `relay run` caps
        it at the lease ttl, so a replica frozen inside a transaction holds the lease
        row's lock a ttl at most; the other commands' sessions keep 30 s."""
        return IDLE_IN_TRANSACTION_TIMEOUT_SECONDS

    @property
    def outbox_view_schema(self) -> str | None:
        """Where `relay migrate --own-table` puts the view the relay reads the table by."""
        if self.outbox_table is None:
            return None
        return "relay_" + self.outbox_table.replace(".", "_")

    @property
    def set_aside(self) -> SetAside:
        """Where the drain keeps dead letters and rows scheduled for later
        (relay/drain/batch.py, `SetAside`)."""
        return "move" if self.outbox_table is None else "mark"

    @field_validator("database_url", "database_direct_url")
    @classmethod
    def _database_url_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
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

    def database_urls(self) -> dict[str, SecretStr]:
        """Each database URL that is set, by its variable: RELAY_DATABASE_URL, and
        RELAY_DATABASE_DIRECT_URL (its TLS parameters are its own)."""
        urls = {"RELAY_DATABASE_URL": self.database_url}
        if self.database_direct_url is not None:
            urls["RELAY_DATABASE_DIRECT_URL"] = self.database_direct_url
        return urls

    @model_validator(mode="after")
    def _url_tls_files_readable(self) -> CommonSettings:
        """The certificate files the URLs name (?sslrootcert=...): a CA missing from its
        mount is a setting to fix, not a connection failure that every retry repeats."""
        for variable, url in self.database_urls().items():
            params = conninfo_to_dict(url.get_secret_value())
            for key in _URL_TLS_FILES:
                path = str(params.get(key) or "")
                if not path or (key == "sslrootcert" and path == "system"):  # libpq 16+
                    continue
                problem = unreadable(path)
                if problem:
                    raise SettingsError(
                        variable,
                        f"cannot read its {key} file: {problem} (the path is not shown: the"
                        " URL is a secret)",
                    )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, FileSecretsSource(settings_cls))
