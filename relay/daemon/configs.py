"""What each component reads of the settings, made once at start-up: the components
themselves take these small configs, never the whole `Settings`, so their constructors
say what they depend on and the fast tests build them by hand."""

from __future__ import annotations

from relay.drain import fairness
from relay.drain.batch import BatchLimits, a_fifth
from relay.drain.loop import DrainConfig
from relay.drain.pacer import PaceLimits
from relay.lease.elector import ElectorTimings
from relay.observe.lag import COUNT_CAP, LagConfig
from relay.settings import Settings
from relay.sinks import Sink, message_max_bytes
from relay.store.presence import PresenceConfig
from relay.store.purge import PurgeConfig
from relay.store.wakeup import ListenerConfig


def pace_limits(settings: Settings) -> PaceLimits:
    return PaceLimits(settings.max_messages_per_second, settings.max_bytes_per_second)


def batch_limits(settings: Settings, sink: Sink) -> BatchLimits:
    """The batch bounds and the per-key cap, with the sink's default for the cap. With
    a cap on the pace, a batch is at most a tenth of a second of it (relay/drain/pacer.py)."""
    pace = pace_limits(settings)
    rows = pace.batch_rows(settings.batch_size)
    per_key = settings.batch_max_per_key
    fifth = per_key is None and not sink.serial_per_key
    if per_key is None:
        per_key = a_fifth(rows) if fifth else 4
    return BatchLimits(
        rows=rows,
        bytes=pace.batch_bytes(settings.batch_max_bytes),
        per_key=per_key,
        fill=not sink.serial_per_key,
        message_bytes=message_max_bytes(settings),
        group=fairness.parse(settings.fairness_group) if settings.fairness_group else None,
        fair=settings.fairness == "keys",
        per_key_fifth=fifth,
    )


def elector_timings(settings: Settings) -> ElectorTimings:
    return ElectorTimings(
        ttl=settings.lease_ttl_seconds,
        renew_interval=settings.renew_interval,
        standby_poll=settings.standby_poll_seconds,
    )


def drain_config(settings: Settings, sink: Sink) -> DrainConfig:
    """All the drain reads of the settings (the drain itself never sees them)."""
    return DrainConfig(
        limits=batch_limits(settings, sink),
        max_attempts=settings.max_attempts,
        retry_base=settings.retry_base_seconds,
        retry_max=settings.retry_max_seconds,
        give_way_seconds=settings.give_way_seconds,
        poll_min=settings.poll_interval_min_seconds,
        poll_max=settings.poll_interval_max_seconds,
        lease_ttl=settings.lease_ttl_seconds,
        sent_rows=settings.sent_rows,
        pace=pace_limits(settings),
    )


def presence_config(settings: Settings) -> PresenceConfig:
    return PresenceConfig(
        lease_name=settings.lease_name,
        replica_id=settings.replica_id,
        heartbeat_seconds=settings.heartbeat_seconds,
        live_seconds=settings.replica_live_seconds,
        give_way_seconds=settings.give_way_seconds,
    )


def purge_config(settings: Settings) -> PurgeConfig:
    return PurgeConfig(
        retention_seconds=settings.retention_seconds,
        interval_seconds=settings.purge_interval_seconds,
        sent_rows=settings.sent_rows,
    )


def lag_config(settings: Settings) -> LagConfig:
    return LagConfig(
        lease_name=settings.lease_name,
        interval_seconds=settings.lag_sample_seconds,
        count_cap=COUNT_CAP,
        shards=settings.shards,
    )


def listener_config(settings: Settings) -> ListenerConfig | None:
    """None without RELAY_NOTIFY_CHANNEL: no listener, the lanes only poll."""
    if not settings.notify_channel:
        return None
    return ListenerConfig(channel=settings.notify_channel)
