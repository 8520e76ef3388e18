"""Every setting the relay reads, validated once at start-up.

The rest of the code receives a `Settings` object and never looks at the environment:
a bad value fails here, with the name of the variable, before any connection is made.

Long: every setting the sinks do not own is one field here (the contract operators
configure against), with the loading rules (secrets from files, unknown variables
refused with the closest name). Each sink's own fields, validation and secrets live
with it (relay/sinks/<name>/settings.py); `Settings` is made of them all, so one
environment serves every command and a misspelt variable of any sink is caught.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
import uuid
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, cast, get_args, get_origin

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings import SettingsError as PydanticSettingsError

from relay.drain import fairness
from relay.drain.batch import SentRows, SetAside
from relay.errors import SettingsError
from relay.setting_checks import read_secret, unreadable
from relay.settings.retired import replacement
from relay.sinks import sink_specs
from relay.sinks.http.settings import HttpSettings
from relay.sinks.kafka.settings import KafkaSettings
from relay.sinks.nats.settings import NatsSettings
from relay.sinks.rabbitmq.settings import RabbitmqSettings
from relay.sinks.settings import SinkSettings

__all__ = ["CommonSettings", "Settings", "SettingsError", "load_settings"]

ENV_PREFIX = "RELAY_"

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

# Secret settings may also be given as a path in RELAY_<NAME>_FILE (Kubernetes Secret
# volumes, Docker secrets), so the secret never has to sit in the process environment.
SECRET_FIELDS = (
    "database_url",
    "database_password",
    "database_direct_url",
    *(name for spec in sink_specs().values() for name in spec.secrets),
)
M = TypeVar("M", bound=BaseModel)


class _FileSecretsSource(PydanticBaseSettingsSource):
    """Reads `RELAY_<NAME>_FILE` for the secret fields: a map as a JSON object. A secret
    given both ways is refused: whichever won, the other was meant to."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        environ = {name.upper(): value for name, value in os.environ.items()}
        values: dict[str, Any] = {}
        for name in SECRET_FIELDS:
            file_variable = f"{ENV_PREFIX}{name.upper()}_FILE"
            path = environ.get(file_variable)
            if not path:
                continue
            _refuse_both_sources(environ, f"{ENV_PREFIX}{name.upper()}", file_variable)
            text = read_secret(file_variable, path)
            values[name] = _json_object(file_variable, text) if _is_map(name) else text
        return values


def _refuse_both_sources(environ: Mapping[str, str], variable: str, file_variable: str) -> None:
    """A map may also come in parts (RELAY_HTTP_TOPIC_URLS__ORDERS): those count too."""
    given = sorted(name for name in environ if name == variable or name.startswith(variable + "__"))
    if given:
        raise SettingsError(
            file_variable, f"{given[0]} is set too: give the secret one way, not both"
        )


def _is_map(name: str) -> bool:
    annotation = Settings.model_fields[name].annotation
    return any(get_origin(t) is dict or t is dict for t in (annotation, *get_args(annotation)))


def _json_object(variable: str, text: str) -> dict[str, Any]:
    """A map secret's file, parsed here: the env source's JSON errors would not name the
    file variable, and must not quote the content."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise SettingsError(variable, "the file must hold a JSON object (not shown: a secret)")
    return value


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

    @model_validator(mode="after")
    def _url_tls_files_readable(self) -> CommonSettings:
        """The certificate files the URLs name (?sslrootcert=...): a CA missing from its
        mount is a setting to fix, not a connection failure that every retry repeats."""
        urls = {"RELAY_DATABASE_URL": self.database_url}
        if self.database_direct_url is not None:
            urls["RELAY_DATABASE_DIRECT_URL"] = self.database_direct_url
        for variable, url in urls.items():
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
        return (init_settings, env_settings, _FileSecretsSource(settings_cls))


class Settings(
    CommonSettings, SinkSettings, HttpSettings, KafkaSettings, NatsSettings, RabbitmqSettings
):
    """Everything `relay run` needs, from `RELAY_*` environment variables (12-factor).
    Each sink's own settings live with it (relay/sinks/<name>/settings.py): a sink reads
    them through `sink_options`, typed, and what every sink takes under one name from
    `SinkSettings`. The other bases are the sinks of `relay.sinks.SINK_SETTINGS`, and a
    test holds the two lists equal."""

    # --- sink ---
    sink: str = Field(default="kafka", description="Where rows go: " + ", ".join(sink_specs()))

    # --- lease ---
    lease_ttl_seconds: float = Field(
        default=10.0,
        ge=1.0,
        le=3600.0,
        description="How long a lease lasts after each acquisition or renewal, by the "
        "database's clock: after a crash (no release) a standby takes over within about "
        "this long; shorter also means renewing more often. The lease's other timings "
        "follow from it: a standby tries to acquire every fifteenth of it (at most 0.5 s), "
        "every replica beats every fifth (at most 2 s).",
    )
    shards: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Split the outbox into this many shards by a hash of the key, each "
        "with a lease of its own, so several replicas drain at once with per-key order "
        "kept. More than 1 needs `relay migrate --shards N` first (its indexes).",
    )
    replica_id: str = Field(
        default_factory=default_replica_id,
        min_length=1,
        max_length=200,
        description="This process's name as lease holder, in heartbeats, `relay status` and "
        "logs. Default: host:pid:random. Keep it unique: two replicas with one id would "
        "take the lease from each other.",
    )
    give_way_seconds: float = Field(
        default=30.0,
        ge=0,
        description="A leader that delivered nothing for this long while rows wait hands "
        "the lease to a live replica that reports it can reach the sink; 0 never does.",
    )

    # --- interoperability ---
    tracing: bool = Field(
        default=False,
        description="Emit OpenTelemetry spans (a span per published batch linked to its "
        "messages' traces; a span per HTTP request), exported over OTLP/HTTP as the "
        "standard OTEL_* variables say. Needs the `otel` extra.",
    )
    cloudevents_source: str | None = Field(
        default=None,
        min_length=1,
        max_length=2048,
        description="Send every message as a CloudEvent in binary content mode, with this "
        "`source` (a URI-reference naming this producer, e.g. `/orders-service`): the "
        "payload as its data, the context attributes as headers in each sink's binding "
        "(ce- for HTTP, NATS and RabbitMQ, ce_ for Kafka); `type` is the row's `type` "
        "header, else its topic. Unset: plain messages.",
    )

    # --- draining ---
    notify_channel: str | None = Field(
        default=None,
        pattern=r"^[a-z_][a-z0-9_]{0,62}$",
        description="Opt-in instant wake-up: every replica LISTENs on this channel and an "
        "idle drain loop looks at once when an app NOTIFYs it (relay.enqueue(notify=...) "
        "or the trigger of `relay migrate --notify-trigger`). Polling stays the safety net.",
    )
    batch_size: int = Field(
        default=1_000,
        ge=1,
        le=50_000,
        description="The most rows one fetch asks for. Each fetch asks for about what "
        "the sink published in 0.4 s (at least 64 rows), so a fast sink (Kafka) "
        "fetches this many and a slow receiver fewer, and a row committed meanwhile waits "
        "for about three small batches, not three of these. Larger batches spread the "
        "per-batch costs (a fetch, a settle, a flush) over more rows; a crash re-publishes "
        "up to about three batches (two unsettled, a batch of stragglers). "
        "docs/benchmarks.md.",
    )
    batch_max_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="A batch stops at this many bytes of payload and headers (at least one "
        "row): a batch is held in two stages at most (read ahead, publishing), so this "
        "bounds memory.",
    )
    message_max_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=1024 * 1024 * 1024,
        description="A row whose payload and headers pass this many bytes is dead-lettered "
        "with its size, without its bytes ever leaving PostgreSQL. Default: the sink's own "
        "limit (Kafka: message.max.bytes; NATS: 1 MiB; HTTP and RabbitMQ: 16 MiB).",
    )
    batch_max_per_key: int | None = Field(
        default=None,
        ge=1,
        description="Rows of one key in one batch while other keys' rows wait. Default: a "
        "fifth of the batch of the moment (RELAY_BATCH_SIZE's ask, sized by time) for Kafka, "
        "NATS and RabbitMQ (a key alone still fills whole batches); 4 for HTTP, "
        "which sends a key's rows one at a time (there it holds even when nobody waits).",
    )
    fairness: Literal["keys", "off"] = Field(
        default="keys",
        description="`keys`: each batch gives every waiting key its share, so a key's "
        "backlog holds back no other key. It reads the outbox's key index "
        "(outbox_due_key_hash_idx), which every row the app inserts also enters. `off`: "
        "first in, first out (a key that waits, in backoff or behind a scheduled row, is "
        "passed for at most sixteen batches' worth of rows), and nothing reads that index: "
        "drop it with `relay migrate --without-key-index` once every relay runs with `off`, "
        "and the app's inserts cost only the primary key.",
    )
    fairness_group: str | None = Field(
        default=None,
        description="Fairness per tenant: what a tenant is, `key-prefix:<delimiter>` (the key "
        "up to the first delimiter; `key-prefix::` makes `tenant-42:order-7` tenant-42's) or "
        "`header:<name>`. Each batch then gives every waiting tenant its share first, then "
        "keys within it. Needs `relay migrate --fairness-group <same value>` first (its "
        "index). Unset: fair across keys only.",
    )
    max_messages_per_second: float | None = Field(
        default=None,
        gt=0,
        le=10_000_000,
        description="A cap on the messages each drain loop (each lane: a shard held) hands "
        "the sink a second, whatever the sink; a batch waits until the budget allows it, "
        "and is made at most a tenth of a second of it. Unset: no cap.",
    )
    max_bytes_per_second: int | None = Field(
        default=None,
        gt=0,
        le=1 << 40,
        description="A cap on the bytes (payload, topic, key and the row's headers, as "
        "RELAY_BATCH_MAX_BYTES counts them) each drain loop hands the sink a second; a batch "
        "is made at most a tenth of a second of it (at least one row). Unset: no cap.",
    )
    poll_interval_min_seconds: float = Field(
        default=0.005,
        gt=0,
        le=10,
        description="An idle drain loop's first wait after traffic; each empty poll doubles "
        "it, up to RELAY_POLL_INTERVAL_MAX_SECONDS.",
    )
    poll_interval_max_seconds: float = Field(
        default=0.1,
        gt=0,
        le=60,
        description="The longest an idle drain loop waits between polls, so the first row "
        "after a quiet spell waits up to this long (less with RELAY_NOTIFY_CHANNEL); "
        "scheduled rows that came due are looked for at least this often (and at least "
        "every second).",
    )
    max_attempts: int = Field(
        default=10,
        ge=1,
        description="Failed publishes of a row before it is dead-lettered. An outage of the "
        "whole sink spends no attempt.",
    )
    retry_base_seconds: float = Field(
        default=0.5,
        gt=0,
        description="A failed row waits up to this long (at least half: jitter) before its "
        "first retry; each further failure doubles it, up to RELAY_RETRY_MAX_SECONDS.",
    )
    retry_max_seconds: float = Field(
        default=300.0,
        gt=0,
        description="The longest retry delay of a failed row; it also caps how long a sink's "
        "Retry-After hint (HTTP 429, 503) is honoured.",
    )
    retention_seconds: float = Field(
        default=0.0,
        ge=0,
        description="0 deletes rows once sent; above 0 keeps them (sent_at set) that long.",
    )
    purge_interval_seconds: float = Field(
        default=60.0,
        gt=0,
        description="With RELAY_RETENTION_SECONDS above 0: how often the lease holder (of "
        "shard 0) purges sent rows past the retention; a run cut short with rows left goes "
        "on at once.",
    )
    shutdown_timeout_seconds: float = Field(
        default=20.0,
        gt=0,
        description="After SIGTERM, how long the batch in flight may take before it is "
        "abandoned (its rows stay unsent: published again later, never lost); then the producer "
        "is flushed and the lease released. Keep the pod's termination grace period about "
        "10 s longer.",
    )

    # --- operations ---
    metrics_host: str = Field(
        default="127.0.0.1",
        description="The address the server of /metrics, /healthz and /readyz listens on; "
        "0.0.0.0 in a pod, so Prometheus and the probes reach it.",
    )
    metrics_port: int = Field(
        default=9108,
        ge=0,
        le=65535,
        description="Its port; 0 serves none of them (`relay healthcheck` then passes "
        "without probing).",
    )
    metrics_topic_labels: int = Field(
        default=100,
        ge=0,
        le=10_000,
        description="Distinct topic label values the per-topic series (relay_messages_total, "
        "relay_dead_lettered_total) carry, counted from process start; later topics, and "
        'topics longer than 255 characters, count under topic="_other", so an app writing a '
        'topic per tenant cannot grow /metrics without end. 0: every topic counts as "_other".',
    )

    @field_validator("fairness_group")
    @classmethod
    def _fairness_group_shape(cls, value: str | None) -> str | None:
        if value is not None:
            fairness.parse(value)
        return value

    @field_validator("sink")
    @classmethod
    def _known_sink(cls, value: str) -> str:
        if value not in sink_specs():
            raise ValueError(f"must be one of: {', '.join(sink_specs())}")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Settings:
        sink_specs()[self.sink].require(self)
        if self.poll_interval_min_seconds > self.poll_interval_max_seconds:
            raise SettingsError(
                "RELAY_POLL_INTERVAL_MIN_SECONDS", "must not exceed RELAY_POLL_INTERVAL_MAX_SECONDS"
            )
        if self.cloudevents_source is not None and any(
            ch.isspace() or not ch.isprintable() for ch in self.cloudevents_source
        ):
            raise SettingsError(
                "RELAY_CLOUDEVENTS_SOURCE",
                "must be a URI-reference (no spaces or control characters)",
            )
        if self.outbox_table is not None and self.lease_name == "default":
            raise SettingsError(
                "RELAY_LEASE_NAME",
                "set a lease name of its own with RELAY_OUTBOX_TABLE (one per outbox: "
                "the lease table is shared)",
            )
        if self.outbox_table is not None and self.shards > 1:
            raise SettingsError(
                "RELAY_SHARDS", "must be 1 with RELAY_OUTBOX_TABLE (not supported yet)"
            )
        if self.fairness == "off" and self.fairness_group is not None:
            raise SettingsError(
                "RELAY_FAIRNESS_GROUP",
                "must be unset with RELAY_FAIRNESS=off (groups share out batches, and off "
                "shares out none)",
            )
        if self.outbox_table is not None and self.fairness_group is not None:
            raise SettingsError(
                "RELAY_FAIRNESS_GROUP", "must be unset with RELAY_OUTBOX_TABLE (not supported yet)"
            )
        if 0 < self.give_way_seconds < 2 * self.heartbeat_seconds:
            raise SettingsError(
                "RELAY_GIVE_WAY_SECONDS",
                "must be 0 (never) or at least twice the heartbeat (a fifth of "
                "RELAY_LEASE_TTL_SECONDS, at most 2 s): the decision rests on the other "
                "replicas' heartbeats",
            )
        return self

    def sink_options(self, kind: type[M]) -> M:
        """This sink's own settings, typed (`settings.sink_options(KafkaSettings)`)."""
        if not isinstance(self, kind):
            raise TypeError(f"{kind.__name__} is not a registered sink's settings")
        return cast(M, self)

    # --- derived values, so no caller re-derives them differently ---

    @property
    def safety_margin(self) -> float:
        """A leader stops publishing this long before its lease would expire, counted on
        its own clock from before the acquiring or renewing transaction: clock drift and
        slow commits. A fifth of the ttl, at most 2 s."""
        return min(2.0, self.lease_ttl_seconds * 0.2)

    @property
    def metrics_enabled(self) -> bool:
        """Whether this replica serves /metrics, /healthz and /readyz (RELAY_METRICS_PORT)."""
        return self.metrics_port != 0

    @property
    def standby_poll_seconds(self) -> float:
        """How often a standby tries to acquire the lease (±20 % jitter): a lease
        released on shutdown is taken over within about this long. A fifteenth of the
        ttl, at most 0.5 s."""
        return min(0.5, self.lease_ttl_seconds / 15)

    @property
    def heartbeat_seconds(self) -> float:
        """How often each replica records in the database that it is alive and whether it
        reaches the sink (a standby probes it; a leader reports its progress): a fifth of
        the ttl, at most 2 s."""
        return min(2.0, self.lease_ttl_seconds * 0.2)

    @property
    def replica_live_seconds(self) -> float:
        """A replica whose heartbeat is older than this counts as gone."""
        return max(self.lease_ttl_seconds, 3 * self.heartbeat_seconds)

    @property
    def renew_interval(self) -> float:
        """A leader renews its lease when no settle has for this long (each settled batch
        renews it too): a third of the ttl, well inside the ttl minus the margin."""
        return self.lease_ttl_seconds / 3

    @property
    def keep_sent_rows(self) -> bool:
        return self.retention_seconds > 0

    @property
    def sent_rows(self) -> SentRows:
        """What a settle does with acknowledged rows (relay/drain/batch.py, `SentRows`)."""
        if not self.keep_sent_rows:
            return "delete"
        return "move" if self.outbox_table is None else "mark"

    # --- lag sampling (observability) ---
    lag_sample_seconds: float = Field(
        default=5.0,
        ge=0,
        le=3600,
        description="How often every replica refreshes the lag gauges; 0 turns sampling off.",
    )


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


# Variables of the operators' console (relay/console/settings.py), which checks them
# against its own names: the relay's commands let them pass, so one environment can
# serve both.
COMPONENT_PREFIXES = ("RELAY_CONSOLE_",)


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
    return name in names or name.startswith(nested) or name.startswith(COMPONENT_PREFIXES)


def check_unknown_variables(environ: Mapping[str, str]) -> None:
    """A misspelled setting (RELAY_BATCHSIZE) is an error, not a silent default."""
    names, nested = _setting_names()
    for variable in sorted(environ):
        name = variable.upper()  # settings are case-insensitive
        instead = replacement(name)
        if instead is not None:
            raise SettingsError(variable, f"was renamed or removed in 1.0: use {instead}")
        if (
            not name.startswith(ENV_PREFIX)
            or name in names
            or name.startswith(nested)
            or name.startswith(COMPONENT_PREFIXES)
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
    settings = _build(cls, **overrides)
    if isinstance(settings, Settings):
        check_sink_files(settings)
    return settings


def check_sink_files(settings: Settings) -> None:
    """Every file the chosen sink reads at start (its settings named *_file: CA,
    client certificate and key, credentials) is readable now, or a setting to fix."""
    for field in [*SinkSettings.model_fields, *sink_specs()[settings.sink].settings.model_fields]:
        path = getattr(settings, field)
        if field.endswith("_file") and isinstance(path, str):
            problem = unreadable(path)
            if problem:
                raise SettingsError(
                    f"{ENV_PREFIX}{field.upper()}", f"cannot read {path}: {problem}"
                )


def _build(cls: type[S], **overrides: Any) -> S:
    try:
        return cls(**overrides)
    except SettingsError:
        raise
    except PydanticSettingsError as exc:  # an env value that is not the JSON it must be
        field = re.search(r'field "([a-z_]+)"', str(exc))
        name = ENV_PREFIX + field.group(1).upper() if field else "RELAY_*"
        raise SettingsError(name, "is not valid JSON") from None
    except ValidationError as exc:
        first = exc.errors(include_input=False, include_url=False)[0]
        if first["loc"] and first["loc"][0] == "outbox_columns":  # a map: name the variable
            first["loc"] = first["loc"][:1]
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        ctx_error = (first.get("ctx") or {}).get("error")
        if isinstance(ctx_error, SettingsError):
            raise ctx_error from None
        if first.get("type") == "missing":
            message = "is required"
        raise SettingsError(_env_name(first["loc"]), message) from None
