"""Where the settings come from besides the environment: `RELAY_<NAME>_FILE` for the
secret ones (Kubernetes Secret volumes, Docker secrets), a map's file as JSON, and a
secret given both ways refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

from relay.errors import SettingsError
from relay.setting_checks import read_secret
from relay.sinks import sink_specs

ENV_PREFIX = "RELAY_"

# Secret settings may also be given as a path in RELAY_<NAME>_FILE (Kubernetes Secret
# volumes, Docker secrets), so the secret never has to sit in the process environment.
SECRET_FIELDS = (
    "database_url",
    "database_password",
    "database_direct_url",
    *(name for spec in sink_specs().values() for name in spec.secrets),
)


class FileSecretsSource(PydanticBaseSettingsSource):
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
            values[name] = _json_object(file_variable, text) if self._is_map(name) else text
        return values

    def _is_map(self, name: str) -> bool:
        """Whether the secret field `name` holds a map: a field of the model read, or of
        a sink's (the common settings read every secret's file too, and drop the sinks')."""
        fields = {
            field: info
            for spec in sink_specs().values()
            for field, info in spec.settings.model_fields.items()
        }
        annotation = {**fields, **self.settings_cls.model_fields}[name].annotation
        return any(get_origin(t) is dict or t is dict for t in (annotation, *get_args(annotation)))


def _refuse_both_sources(environ: Mapping[str, str], variable: str, file_variable: str) -> None:
    """A map may also come in parts (RELAY_HTTP_TOPIC_URLS__ORDERS): those count too."""
    given = sorted(name for name in environ if name == variable or name.startswith(variable + "__"))
    if given:
        raise SettingsError(
            file_variable, f"{given[0]} is set too: give the secret one way, not both"
        )


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
