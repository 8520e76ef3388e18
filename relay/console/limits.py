"""Bounds on what a client may make the console do before it knows who they are.

Starlette reads a urlencoded form whole, with no limit on its size or its fields (and a
multipart one spools its files to disk): without a bound, anyone who can reach /login
could fill the console's memory. The console's forms are a few ids and a search, so a
body is read here, up to `MAX_BODY` bytes, before any route sees it; more is refused
(413). Wrong tokens typed at /login, or sent to the API as bearer tokens, are counted
per client address, and past a few a minute that address is refused (429) until the
minute is over, right token or not, so the secret cannot be guessed at speed.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay.console.replies import refusal

MAX_BODY = 256 * 1024  # a page of 500 ids is ~10 KiB
LOGIN_FAILURES = 10  # wrong tokens per address per window before it is refused
LOGIN_WINDOW = 60.0  # seconds
_MAX_ADDRESSES = 10_000  # addresses remembered at once (bounded memory)


class BodyLimit:
    """Reads each request's body up to MAX_BODY, then hands it on; 413 past it."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await _too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await _too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


async def _too_large(scope: Scope, receive: Receive, send: Send) -> None:
    response = refusal(scope["path"], 413, f"request body over {MAX_BODY} bytes")
    await response(scope, receive, send)


class LoginThrottle:
    """Wrong tokens per client address in the last LOGIN_WINDOW seconds."""

    def __init__(self, failures: int = LOGIN_FAILURES, window: float = LOGIN_WINDOW) -> None:
        self._failures = failures
        self._window = window
        self._seen: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def refused(self, address: str) -> bool:
        """True while `address` has typed too many wrong tokens lately."""
        with self._lock:
            times = self._seen.get(address)
            if times is None:
                return False
            self._forget_old(times, time.monotonic())
            return len(times) >= self._failures

    def failed(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            if address not in self._seen and len(self._seen) >= _MAX_ADDRESSES:
                for known in list(self._seen):
                    self._forget_old(self._seen[known], now)
                    if not self._seen[known]:
                        del self._seen[known]
                if len(self._seen) >= _MAX_ADDRESSES:
                    self._seen.clear()
            self._seen.setdefault(address, deque()).append(now)

    def _forget_old(self, times: deque[float], now: float) -> None:
        while times and now - times[0] > self._window:
            times.popleft()
