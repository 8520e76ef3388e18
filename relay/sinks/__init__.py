"""Sinks: where outbox rows go, chosen by RELAY_SINK.

Each sink is a package, `relay/sinks/<name>/`, whose `settings` module declares
`SINK = SinkSpec(...)`: its settings, secrets and where its implementation lives.
`SINK_SETTINGS` below lists them; a new sink is added there. A sink's client library
is imported only when it is the one chosen.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, cast

from relay.errors import SettingsError
from relay.sinks.base import Outcome, Result, Sink, SinkSpec

if TYPE_CHECKING:  # relay.settings is made of the sinks' own settings modules
    from relay.observe.tracing import Tracing
    from relay.settings import Settings

__all__ = [
    "Outcome",
    "Result",
    "Sink",
    "SinkSpec",
    "create_sink",
    "message_max_bytes",
    "sink_specs",
]

# The settings module of every sink this installation knows, each declaring SINK.
SINK_SETTINGS = (
    "relay.sinks.http.settings",
    "relay.sinks.kafka.settings",
    "relay.sinks.nats.settings",
    "relay.sinks.rabbitmq.settings",
)


@functools.cache
def sink_specs() -> dict[str, SinkSpec]:
    """Every sink this installation knows, by name."""
    found: dict[str, SinkSpec] = {}
    for module_name in SINK_SETTINGS:
        spec = getattr(importlib.import_module(module_name), "SINK", None)
        if not isinstance(spec, SinkSpec):
            raise TypeError(f"{module_name} declares no SINK = SinkSpec(...)")
        if spec.name in found:
            raise TypeError(f"two sinks named {spec.name!r}")
        found[spec.name] = spec
    return found


def message_max_bytes(settings: Settings) -> int:
    """The largest row the relay loads: RELAY_MESSAGE_MAX_BYTES, else the sink's own."""
    if settings.message_max_bytes is not None:
        return settings.message_max_bytes
    spec = sink_specs().get(settings.sink)
    return (16 << 20) if spec is None else spec.message_max_bytes(settings)


def create_sink(settings: Settings, tracing: Tracing | None = None) -> Sink:
    """The chosen sink; `tracing` (RELAY_TRACING) for the sinks that make spans of
    their own (HTTP: one per request)."""
    spec = sink_specs().get(settings.sink)
    if spec is None:  # Settings validated the name; only a hand-built one gets here
        raise SettingsError("RELAY_SINK", f"no sink named {settings.sink!r}")
    module_name, _, class_name = spec.implementation.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if spec.extra is None or exc.name is None or exc.name.startswith("relay"):
            raise
        raise SettingsError(
            "RELAY_SINK",
            f"the {spec.name} sink needs the {exc.name!r} package:"
            f" pip install 'pg-outbox-relay[{spec.extra}]'",
        ) from None
    factory = getattr(module, class_name)
    return cast(Sink, factory(settings, tracing=tracing))
