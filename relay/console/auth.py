"""Who is asking, and whether a state-changing request is really theirs.

Logins: the shared secret (RELAY_CONSOLE_TOKEN, or RELAY_CONSOLE_VIEWER_TOKEN for a
look-only session) typed into the login form sets a session cookie: HttpOnly (no
script reads it), SameSite=Strict (no other site's page sends it), Secure unless
turned off, signed with a key derived from the secrets (rotating a secret ends every
session) and carrying its expiry; logging out refuses that cookie for the rest of the
process's life. Or, off by default, the user an authenticating proxy (oauth2-proxy)
names in a header, believed only from the proxy's addresses.

Every POST must come from this console's own origin (relay/console/hosts.py) and, once
logged in, carry the session's CSRF token in its form.

The API (/api/v1/, relay/console/api.py) takes the same secrets as a bearer token
instead, and only that: the two never stand in for each other.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Literal

from starlette.requests import Request

from relay.console.settings import ConsoleSettings

COOKIE = "relay_console_session"
Via = Literal["token", "viewer", "proxy"]


@dataclass(frozen=True, slots=True)
class Identity:
    user: str  # what the audit records: "token", the proxy's user, or "api:token"
    via: Via
    may_change: bool  # requeue and discard; false for viewers and read-only consoles
    csrf: str  # empty for the API's callers: they post no forms


class Auth:
    def __init__(self, settings: ConsoleSettings) -> None:
        self._settings = settings
        secrets_given = [s.get_secret_value() for s in (settings.token, settings.viewer_token) if s]
        # Derived from the secrets: sessions outlive a console restart, not a rotation.
        # With the proxy alone there is no secret: a random key, sessions per process.
        seed = "\0".join(secrets_given).encode() if secrets_given else os.urandom(32)
        self._key = hashlib.sha256(b"relay-console-session\0" + seed).digest()
        self._networks = settings.proxy_networks
        # Sessions logged out before their expiry (nonce -> expiry): the cookie is its
        # own record, so a copy of it would otherwise outlive the logout. Per process:
        # a restart forgets them (docs/console.md).
        self._revoked: dict[str, int] = {}
        self._revoked_lock = threading.Lock()

    # --- logging in ---

    def _secret_of(self, typed: str) -> Via | None:
        """Which secret `typed` is: the console's token, the viewer's, or neither."""
        via: Via | None = None
        for secret, kind in (
            (self._settings.token, "token"),
            (self._settings.viewer_token, "viewer"),
        ):
            # Digests of equal length: the comparison tells nothing of the secret's length.
            if secret is not None and hmac.compare_digest(
                hashlib.sha256(typed.encode()).digest(),
                hashlib.sha256(secret.get_secret_value().encode()).digest(),
            ):
                via = "token" if kind == "token" else "viewer"
        return via

    def login(self, typed: str) -> str | None:
        """A session cookie's value for a right secret, else None."""
        via = self._secret_of(typed)
        if via is None:
            return None
        body = {
            "v": via,
            "exp": int(time.time() + self._settings.session_hours * 3600),
            "n": secrets.token_urlsafe(16),
        }
        raw = _b64(json.dumps(body, separators=(",", ":")).encode())
        return f"{raw}.{_b64(self._sign(raw.encode()))}"

    @property
    def cookie_max_age(self) -> int:
        return int(self._settings.session_hours * 3600)

    # --- every request ---

    def identify(self, request: Request) -> Identity | None:
        proxied = self._proxy_user(request)
        if proxied is not None:
            csrf = self._sign(b"csrf-proxy\0" + proxied.encode()).hex()[:40]
            return Identity(proxied, "proxy", not self._settings.read_only, csrf)
        cookie = request.cookies.get(COOKIE)
        if not cookie:
            return None
        body = self._verified(cookie)
        if body is None or str(body.get("n", "")) in self._revoked:
            return None
        via: Via = "viewer" if body.get("v") == "viewer" else "token"
        csrf = self._sign(b"csrf\0" + str(body.get("n", "")).encode()).hex()[:40]
        may_change = via == "token" and not self._settings.read_only
        return Identity(via, via, may_change, csrf)

    def bearer(self, request: Request) -> Identity | None:
        """The API's caller (relay/console/api.py): `Authorization: Bearer <secret>`,
        and nothing else: neither the session cookie nor the proxy's header. Those a
        browser sends by itself, to any page that makes it ask; a header of a script's
        own making it never adds, so an API request needs no CSRF token. The audit
        records "api:token" (or "api:viewer", who may not change)."""
        scheme, _, typed = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not typed.strip():
            return None
        via = self._secret_of(typed.strip())
        if via is None:
            return None
        may_change = via == "token" and not self._settings.read_only
        return Identity(f"api:{via}", via, may_change, csrf="")

    def log_out(self, request: Request) -> None:
        """The request's session cookie is refused from now on, even if replayed."""
        body = self._verified(request.cookies.get(COOKIE, ""))
        if body is None:
            return
        now = time.time()
        with self._revoked_lock:
            self._revoked = {n: exp for n, exp in self._revoked.items() if exp >= now}
            self._revoked[str(body.get("n", ""))] = int(str(body["exp"]))

    def _proxy_user(self, request: Request) -> str | None:
        header = self._settings.trusted_user_header
        if header is None or request.client is None:
            return None
        user = request.headers.get(header, "").strip()
        if not user or len(user) > 200:
            return None
        try:
            peer = ipaddress.ip_address(request.client.host)
        except ValueError:
            return None
        if not any(peer in network for network in self._networks):
            return None
        return user

    def _verified(self, cookie: str) -> dict[str, object] | None:
        raw, _, signature = cookie.partition(".")
        try:
            expected = self._sign(raw.encode())
            if not hmac.compare_digest(_unb64(signature), expected):
                return None
            body = json.loads(_unb64(raw))
        except (ValueError, TypeError):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("exp"), int):
            return None
        if body["exp"] < time.time():
            return None
        return body

    def _sign(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    # --- state-changing requests ---

    @staticmethod
    def csrf_mismatch(identity: Identity, sent: object) -> bool:
        """Also for an identity with no CSRF token (the API's): a form it posts never
        matches, whatever it carries."""
        return not (
            identity.csrf and isinstance(sent, str) and hmac.compare_digest(sent, identity.csrf)
        )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
