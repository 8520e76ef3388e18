"""Sinks: where outbox rows go. `create_sink` picks one by RELAY_SINK."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.errors import SettingsError
from relay.sinks.base import Outcome, Result, Sink

if TYPE_CHECKING:  # relay.settings is made of the sinks' own settings modules
    from relay.settings import Settings

__all__ = ["Outcome", "Result", "Sink", "create_sink"]


def create_sink(settings: Settings) -> Sink:
    if settings.sink == "kafka":
        from relay.sinks.kafka import KafkaSink

        return KafkaSink(settings)
    if settings.sink == "http":
        from relay.sinks.http import HttpSink

        return HttpSink(settings)
    raise SettingsError("RELAY_SINK", f"sink {settings.sink!r} is not available in this version")
