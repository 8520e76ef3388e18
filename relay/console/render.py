"""How rows become HTML: payloads (JSON pretty-printed, text, or hex), headers, times,
and the templates. Jinja2 escapes every value (autoescape on, and no template marks a
row's value safe): a header or payload holding markup renders as text."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from jinja2 import Environment, PackageLoader, StrictUndefined

_PRINTABLE = set(string.printable) - set("\x0b\x0c")


@dataclass(frozen=True, slots=True)
class Payload:
    kind: Literal["json", "text", "binary", "none"]
    text: str
    shown: int  # bytes shown
    size: int  # the payload's whole size

    @property
    def cut(self) -> bool:
        return self.shown < self.size


def payload(data: bytes | None, size: int | None) -> Payload:
    """JSON pretty-printed when the whole payload is JSON, text when it is UTF-8 text,
    else a hex dump; `data` may be the first bytes only (then it is shown as cut)."""
    if data is None:
        return Payload("none", "", 0, 0)
    size = len(data) if size is None else size
    text: str | None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = _cut_utf8(data) if len(data) < size else None
    if text is not None and all(ch in _PRINTABLE or ch.isprintable() for ch in text):
        if len(data) == size:
            try:
                pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
            except ValueError:
                pass
            else:
                return Payload("json", pretty, len(data), size)
        return Payload("text", text, len(data), size)
    return Payload("binary", hex_dump(data), len(data), size)


def _cut_utf8(data: bytes) -> str | None:
    """Text cut inside a multi-byte character is still text."""
    for trim in range(1, 4):
        try:
            return data[:-trim].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


def hex_dump(data: bytes) -> str:
    lines = []
    for offset in range(0, len(data), 16):
        chunk = data[offset : offset + 16]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        shown = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{offset:08x}  {hexes:<47}  {shown}")
    return "\n".join(lines)


def headers(value: Any) -> list[tuple[str, str]]:
    """A row's headers (jsonb) as name/value pairs; a value that is not a string is
    shown as its JSON."""
    if value is None:
        return []
    if not isinstance(value, dict):
        return [("(not an object)", json.dumps(value, ensure_ascii=False))]
    return [
        (str(name), item if isinstance(item, str) else json.dumps(item, ensure_ascii=False))
        for name, item in value.items()
    ]


def when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    value = max(0.0, float(value))
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.1f}min"
    if value < 172_800:
        return f"{value / 3600:.1f}h"
    return f"{value / 86400:.1f}d"


def count(value: int | None, cap: int) -> str:
    """A capped count; None: not counted."""
    if value is None:
        return "-"
    return f"≥ {value:,}" if value >= cap else f"{value:,}"


def size(value: int | None) -> str:
    if value is None:
        return "-"
    if value < 1024:
        return f"{value:,} B"
    if value < 1024 * 1024:
        return f"{value / 1024:,.1f} KiB"
    return f"{value / (1024 * 1024):,.1f} MiB"


def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("relay.console", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=when, seconds=seconds, size=size)
    env.globals.update(count=count)
    return env
