"""Which names the console answers to, and which pages may post to it.

A DNS-rebinding page (a name of the attacker's, pointed at the console's address once
the page has loaded) is, to the browser, of its own origin: it may read the console's
pages, CSRF token included, and post them back, with Host and Origin both the
attacker's name; with the proxy user header believed from loopback, it needs no login
either. So every request's Host must be a name the console is known by
(RELAY_CONSOLE_ALLOWED_HOSTS; by default its bind address, and localhost when it
listens on loopback), checked before routing (400), and a POST's Origin must be that
Host and allowed, or one of RELAY_CONSOLE_ALLOWED_ORIGINS. The probes answer any Host:
the kubelet sends the pod's address, and they show nothing and change nothing.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from relay.console.replies import refusal
from relay.observe.logging import get_logger
from relay.setting_checks import is_loopback

log = get_logger("relay.console")

PROBES = frozenset({"/healthz", "/readyz"})
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_DEFAULT_PORTS = {80, 443}  # behind a proxy the console cannot tell which one was used
Host = tuple[str, int | None]


def split_host(value: str) -> Host | None:
    """`name[:port]` as a Host header or an allow-list entry carries it, normalised
    (lower case, no trailing dot, IPv6 bracketed and compressed); None if it is not one.
    A bare IPv6 address (no port) is accepted too."""
    value = value.strip().lower()
    try:
        return f"[{ipaddress.IPv6Address(value).compressed}]", None
    except ValueError:
        pass
    if value.startswith("["):
        inside, bracket, rest = value[1:].partition("]")
        try:
            name = f"[{ipaddress.IPv6Address(inside).compressed}]"
        except ValueError:
            return None
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, colon, port_text_or_empty = value.partition(":")
        port_text = port_text_or_empty if colon else None
        name = name.removesuffix(".")
        if len(name) > 253 or not _NAME.fullmatch(name):
            return None
    if port_text is None:
        return name, None
    if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        return None
    return name, int(port_text)


@dataclass(frozen=True, slots=True)
class AllowedHosts:
    """RELAY_CONSOLE_ALLOWED_HOSTS: names, each with an optional port; `*` is any."""

    entries: frozenset[Host]
    any_host: bool = False

    @classmethod
    def parse(cls, text: str) -> AllowedHosts:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if "*" in parts:
            if len(parts) > 1:
                raise ValueError("'*' (any host) stands alone")
            return cls(frozenset(), any_host=True)
        entries = set()
        for part in parts:
            host = split_host(part)
            if host is None:
                raise ValueError(f"{part!r} is not a host name (name or name:port)")
            entries.add(host)
        return cls(frozenset(entries))

    def allows(self, value: str | None) -> bool:
        """Whether a Host header (or an origin's host) names this console."""
        if self.any_host:
            return True
        host = split_host(value) if value else None
        if host is None:
            return False
        name, port = host
        if (name, None) in self.entries or (name, port) in self.entries:
            return True
        return port is None and any((name, p) in self.entries for p in _DEFAULT_PORTS)

    def __str__(self) -> str:
        if self.any_host:
            return "*"
        return ",".join(sorted(n if p is None else f"{n}:{p}" for n, p in self.entries))


def default_hosts(bind: str) -> str:
    """The bind host, plus localhost and the loopback addresses when the console
    listens on loopback (bound to it, or to every address)."""
    bind = bind.strip()
    every = _unspecified(bind)
    names = [] if every else [bind]
    if every or is_loopback(bind):
        names += ["localhost", "127.0.0.1", "[::1]"]
    return ",".join(names)


def _unspecified(bind: str) -> bool:
    """Bound to every address (0.0.0.0, ::), loopback among them."""
    try:
        return not bind or ipaddress.ip_address(bind.strip("[]")).is_unspecified
    except ValueError:
        return False


class HostCheck:
    """A request whose Host is not allowed is refused (400) before any route sees it."""

    def __init__(self, app: ASGIApp, hosts: AllowedHosts) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or self.hosts.any_host
            or scope["path"] in PROBES
        ):
            await self.app(scope, receive, send)
            return
        host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
        if self.hosts.allows(host):
            await self.app(scope, receive, send)
            return
        log.warning("console.host_refused", host=host[:100])
        refused = refusal(
            scope["path"],
            400,
            "refused: this Host is not one the console answers to (RELAY_CONSOLE_ALLOWED_HOSTS)",
        )
        await refused(scope, receive, send)


def foreign_origin(request: Request, hosts: AllowedHosts, origins: set[str]) -> str | None:
    """Why this POST is not from the console's own pages, or None: its Origin (else its
    Referer; neither is a refusal) must be one of `origins`, or the request's own Host
    and an allowed one."""
    origin = request.headers.get("origin")
    if origin is None:
        referer = request.headers.get("referer")
        if referer is None:
            return "no Origin or Referer header"
        parts = urlsplit(referer)
        origin = f"{parts.scheme}://{parts.netloc}"
    origin = origin.rstrip("/").lower()
    if origin in origins:
        return None
    host = request.headers.get("host", "").lower()
    netloc = urlsplit(origin).netloc
    if origin == "null" or not host or netloc != host or not hosts.allows(netloc):
        return f"foreign origin {origin!r}"
    return None
