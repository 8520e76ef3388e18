"""Every setting the relay reads, validated once at start-up.

The rest of the code receives a `Settings` object and never looks at the environment:
a bad value fails here, with the name of the variable, before any connection is made.

Every setting the sinks do not own is one field of this package (the contract operators
configure against), with the loading rules (secrets from files, unknown variables
refused with the closest name). Each sink's own fields, validation and secrets live
with it (relay/sinks/<name>/settings.py); `Settings` is made of them all, so one
environment serves every command and a misspelt variable of any sink is caught.

By the part that reads them, one module each, all re-exported here:

- `common`: what every command reads (`CommonSettings`: the database, the lease's
  name, an own outbox table, logging);
- `run`: what `relay run` reads besides (`Settings`: the sink chosen, the lease, the
  drain, the metrics endpoint), made of the common and every sink's settings;
- `sources`: the secrets read from `RELAY_<NAME>_FILE`;
- `loading`: `load_settings`, which checks the environment's names first (`retired`:
  what 1.0 renamed or removed), and turns a validation error into a `SettingsError`.

The console's own settings (RELAY_CONSOLE_*) are relay/console/settings.py's.
"""

from __future__ import annotations

from relay.errors import SettingsError
from relay.settings.common import (
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    IDLE_IN_TRANSACTION_TIMEOUT_SECONDS,
    OWN_TABLE_FIELDS,
    CommonSettings,
)
from relay.settings.loading import (
    COMPONENT_PREFIXES,
    check_sink_files,
    check_unknown_variables,
    is_setting_variable,
    load_settings,
)
from relay.settings.run import Settings, default_replica_id
from relay.settings.sources import ENV_PREFIX, SECRET_FIELDS

__all__ = [
    "COMPONENT_PREFIXES",
    "DEFAULT_CONNECT_TIMEOUT_SECONDS",
    "ENV_PREFIX",
    "IDLE_IN_TRANSACTION_TIMEOUT_SECONDS",
    "OWN_TABLE_FIELDS",
    "SECRET_FIELDS",
    "CommonSettings",
    "Settings",
    "SettingsError",
    "check_sink_files",
    "check_unknown_variables",
    "default_replica_id",
    "is_setting_variable",
    "load_settings",
]
