"""The API's answers are JSON, its errors `{"error": "..."}`, even where the answer comes
before any route (a foreign Host, a body too large): a script reads one format. The
pages' answers stay as they are."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse, PlainTextResponse, Response

from relay.admin.status import json_default

API_PREFIX = "/api/"


class Json(JSONResponse):
    """JSON with the times and UUIDs of rows as `relay status --json` prints them."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, default=json_default, separators=(",", ":")).encode()


def error(
    status: int, message: str, headers: Mapping[str, str] | None = None, **extra: Any
) -> Json:
    return Json({"error": message, **extra}, status_code=status, headers=headers)


def refusal(
    path: str, status: int, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    """A refusal in the format of what was asked: JSON under /api/, text elsewhere."""
    if path.startswith(API_PREFIX):
        return error(status, message, headers)
    return PlainTextResponse(message, status_code=status, headers=headers)
