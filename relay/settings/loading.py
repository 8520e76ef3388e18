"""Loading the settings: every `RELAY_*` variable checked against every setting (a
misspelt one names the closest; one 1.0 retired names its replacement,
relay/settings/retired.py), then the model built, its first error raised as a
`SettingsError` naming the variable, never quoting the value.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import SettingsError as PydanticSettingsError

from relay.errors import SettingsError
from relay.setting_checks import unreadable
from relay.settings.common import CommonSettings
from relay.settings.retired import replacement
from relay.settings.run import Settings
from relay.settings.sources import ENV_PREFIX, SECRET_FIELDS
from relay.sinks import sink_specs
from relay.sinks.settings import SinkSettings

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
