"""Durations and times as an operator writes them, for the command line and the
console's API alike: `90`, `45s`, `30m`, `12h`, `7d`; an ISO 8601 instant (UTC without
an offset) or how long ago. A text that is neither raises ValueError naming the forms."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_seconds(text: str) -> float:
    """`90`, `45s`, `30m`, `12h`, `7d` -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30m, 12h, 7d)")
    return float(match[1]) * _UNIT_SECONDS[match[2]]


def instant_or_ago(text: str) -> datetime | timedelta:
    """ISO 8601 (`2026-05-01T10:00:00Z`; without an offset, UTC), or how long ago (`2h`,
    `30m`, as `duration_seconds` takes them)."""
    if _DURATION.match(text):
        return timedelta(seconds=duration_seconds(text))
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (ISO 8601, e.g. 2026-05-01T10:00:00Z, or how long ago,"
            " e.g. 2h, 30m)"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
