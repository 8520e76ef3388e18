"""What `relay run` reads besides the common settings: the sink chosen, the lease, the
drain (batches, fairness, pace caps, polling, retries, retention, shutdown), the metrics
endpoint and lag sampling. Each sink's own settings come from
relay/sinks/<name>/settings.py, and `Settings` is made of them all, so one environment
serves every command.

Long: every field `relay run` reads beyond the common ones, each with its description
(the settings reference is made from them), the checks that span them (the sink's
requirements, the poll bounds, the give-way time against the heartbeat), and the values
derived from them, so no caller derives them differently.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Literal, TypeVar, cast

from pydantic import BaseModel, Field, field_validator, model_validator

from relay.drain import fairness
from relay.drain.batch import SentRows
from relay.errors import SettingsError
from relay.settings.common import CommonSettings
from relay.sinks import sink_specs
from relay.sinks.http.settings import HttpSettings
from relay.sinks.kafka.settings import KafkaSettings
from relay.sinks.nats.settings import NatsSettings
from relay.sinks.rabbitmq.settings import RabbitmqSettings
from relay.sinks.settings import SinkSettings

M = TypeVar("M", bound=BaseModel)


def default_replica_id() -> str:
    # The pod name is the hostname in Kubernetes; pid and a random suffix keep two
    # processes on one host (and a restarted process) distinct as lease holders.
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


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
        "(outbox_key_hash_idx), which every row the app inserts also enters. `off`: "
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
