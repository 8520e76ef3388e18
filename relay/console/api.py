"""The console's JSON API for scripts, under /api/v1/: what the pages show and change,
with the same queries (relay/console/data.py), caps, confirmation and audit.

A caller is a bearer token (`Authorization: Bearer <secret>`, relay/console/auth.py):
RELAY_CONSOLE_TOKEN reads and changes, RELAY_CONSOLE_VIEWER_TOKEN only reads. The
session cookie and the proxy's user header are never a caller here, and a bearer token
is never a login on the pages, so neither stands in for the other's proof (the CSRF
token is the pages'). Wrong tokens count against the address as wrong logins do.

An endpoint is a method taking the request and its caller and returning a JSON-able
value, or raising `Refused`; `routes` lists each once, `change=True` for those that
change something (403 for a caller who may not). Every answer is JSON, every error
`{"error": "..."}` (relay/console/replies.py). A change goes through `data.change`,
which checks, changes and writes the audit row in one transaction, so every endpoint
that changes rows is audited as the pages' changes are, the actor "api:token".

Long: one short method per endpoint, in the order `routes` lists them; the reads, the
dead-letter changes, then pause, resume and replay, which share the reading of a body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import psycopg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from relay.admin import pauses, replay, status
from relay.console import api_input, data
from relay.console.auth import Auth, Identity
from relay.console.limits import LoginThrottle
from relay.console.replies import Json, error
from relay.console.settings import ConsoleSettings
from relay.drain.batch import SetAside
from relay.observe.logging import get_logger
from relay.store import db

log = get_logger("relay.console")

PREFIX = "/api/v1"
T = TypeVar("T")
Handler = Callable[[Request, Identity], Awaitable[Any]]
Runner = Callable[[Callable[[db.Conn], Any]], Awaitable[Any]]  # Console.db


class Refused(Exception):
    """An answer other than 200: its status, its message and any fields beside it."""

    def __init__(self, status_code: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.extra = extra


class Api:
    def __init__(
        self,
        auth: Auth,
        throttle: LoginThrottle,
        run: Runner,
        settings: ConsoleSettings,
        set_aside: SetAside,
    ) -> None:
        self.auth = auth
        self.throttle = throttle
        self.run = run
        self.settings = settings
        self.set_aside = set_aside

    def routes(self) -> list[Route]:
        e = self.endpoint
        return [
            Route("/status", e(self.status), methods=["GET"]),
            Route("/dead-letters", e(self.dead_letters), methods=["GET"]),
            Route("/dead-letters/requeue", e(self.requeue, change=True), methods=["POST"]),
            Route("/dead-letters/discard", e(self.discard, change=True), methods=["POST"]),
            Route("/pause", e(self.pause, change=True), methods=["POST"]),
            Route("/resume", e(self.resume, change=True), methods=["POST"]),
            Route("/replay", e(self.replay, change=True), methods=["POST"]),
        ]

    def application(self) -> Starlette:
        """Mounted at PREFIX; its own errors (an unknown path, a wrong method, the
        database unavailable) answer JSON too."""
        return Starlette(
            routes=self.routes(),
            exception_handlers={
                HTTPException: self._http_error,
                TimeoutError: self._unavailable,
                psycopg.OperationalError: self._unavailable,
            },
        )

    # --- every request ---

    def endpoint(
        self, handler: Handler, *, change: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            peer = request.client.host if request.client else "-"
            if self.throttle.refused(peer):
                log.warning("console.api_throttled", peer=peer)
                return error(
                    429,
                    "too many wrong tokens from this address; wait a minute",
                    {"retry-after": "60"},
                )
            caller = self.auth.bearer(request)
            if caller is None:
                return self._unauthorized(request, peer)
            if change and not caller.may_change:
                if self.settings.read_only:
                    return error(403, "refused: the console is read-only (RELAY_CONSOLE_READ_ONLY)")
                return error(403, "refused: the viewer's token may read, not change")
            try:
                return Json(await handler(request, caller))
            except Refused as exc:
                return error(exc.status_code, str(exc), **exc.extra)

        return answer

    def _unauthorized(self, request: Request, peer: str) -> Response:
        scheme = request.headers.get("authorization", "").strip().partition(" ")[0]
        if scheme.lower() != "bearer":
            return error(
                401,
                "an Authorization: Bearer <token> header is required",
                {"www-authenticate": 'Bearer realm="relay-console"'},
            )
        self.throttle.failed(peer)
        log.warning("console.api_refused", peer=peer)  # never what was sent
        return error(
            401,
            "that is not the console's token",
            {"www-authenticate": 'Bearer realm="relay-console", error="invalid_token"'},
        )

    async def _http_error(self, _request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error(exc.status_code, str(exc.detail), exc.headers)

    async def _unavailable(self, request: Request, exc: Exception) -> Response:
        log.warning(
            "console.database_unavailable", path=request.url.path, error=db.describe_error(exc)
        )
        return error(503, "the database is unavailable or slow; try again")

    # --- reads ---

    async def status(self, _request: Request, _caller: Identity) -> Any:
        """`relay status --json`'s document, counts stopping at the console's cap."""
        cap = self.settings.count_cap
        found: status.Status = await self.run(lambda conn: status.read_status(conn, cap))
        return found.as_json()

    async def dead_letters(self, request: Request, _caller: Identity) -> Any:
        """A keyset page of the console's search, oldest first; `next` is the `after`
        of the page that follows (null: none does)."""
        try:
            asked = api_input.listing(request.query_params.multi_items(), self.settings.page_size)
        except ValueError as exc:
            raise Refused(400, f"bad query: {exc}") from None
        cap = self.settings.count_cap
        page: data.Page = await self.run(
            lambda conn: data.dead_letter_page(
                conn, asked.search, after=asked.after, before=None, limit=asked.limit, cap=cap
            )
        )
        return {
            "dead_letters": page.rows,
            "matching": page.matching,
            "count_cap": page.cap,
            "next": page.rows[-1]["id"] if page.more_after else None,
        }

    # --- changes ---

    async def requeue(self, request: Request, caller: Identity) -> Any:
        return await self._change(request, caller, "requeue")

    async def discard(self, request: Request, caller: Identity) -> Any:
        return await self._change(request, caller, "discard")

    async def _change(self, request: Request, caller: Identity, action: data.Action) -> Any:
        """The pages' confirm then apply, in one request: a change names exactly the
        rows it changes (its ids, or its filter's count and, if the script wants the
        very rows it saw, their digest), else nothing changes (409). A dry run, or a
        filter without its count, answers what the confirmation page would state."""
        try:
            asked = api_input.change_request(api_input.parse_body(await request.body()))
        except ValueError as exc:
            raise Refused(400, f"bad request: {exc}") from None
        target, cap = asked.target, self.settings.bulk_cap
        if asked.dry_run or (target.search is not None and asked.expected is None):
            ids = await self._matching(target)
            if asked.dry_run:
                return {
                    "action": action,
                    "dry_run": True,
                    "matching": len(ids),
                    "digest": data.digest(ids),
                    "ids": ids,
                    **self._missing(target, ids),
                }
            raise Refused(
                409,
                f"a change by filter states its count: {len(ids)} dead letter(s) match;"
                f' send "expected": {len(ids)} to {action} them',
                matching=len(ids),
                digest=data.digest(ids),
            )
        confirmed = len(target.ids) if target.search is None else asked.expected
        digest = data.digest(target.ids) if target.search is None else asked.digest
        assert confirmed is not None  # a filter without its count was answered above
        try:
            done: data.Done = await self.run(
                lambda conn: data.change(
                    conn,
                    caller.user,
                    action,
                    target,
                    confirmed,
                    cap,
                    digest,
                    set_aside=self.set_aside,
                )
            )
        except data.TooMany as exc:
            raise self._too_many(exc) from None
        except data.Changed as exc:
            ids = await self._matching(target)
            raise Refused(
                409,
                f"nothing changed: {exc}",
                matching=len(ids),
                digest=data.digest(ids),
                **self._missing(target, ids),
            ) from None
        return {
            "action": action,
            "changed": len(done.ids),
            "ids": done.ids,
            "audit_id": done.audit_id,
            "note": done.note,
        }

    async def pause(self, request: Request, caller: Identity) -> Any:
        """Pause a topic; pausing one paused already changes nothing (and says so)."""
        asked = await self._body(request, api_input.pause_request)
        done: pauses.Change = await self.run(
            lambda conn: pauses.pause(
                conn, asked.topic, actor=caller.user, via="api", reason=asked.reason
            )
        )
        return {
            "topic": asked.topic,
            "paused": done.done,
            "paused_since": done.paused_since,
            "audit_id": done.audit_id,
        }

    async def resume(self, request: Request, caller: Identity) -> Any:
        """Resume a paused topic; one not paused is a 409, nothing changed."""
        asked = await self._body(request, partial(api_input.pause_request, reason=False))
        done: pauses.Change = await self.run(
            lambda conn: pauses.resume(conn, asked.topic, actor=caller.user, via="api")
        )
        if not done.done:
            raise Refused(409, f"nothing changed: topic {asked.topic!r} is not paused")
        return {
            "topic": asked.topic,
            "resumed": True,
            "paused_since": done.paused_since,
            "audit_id": done.audit_id,
        }

    async def replay(self, request: Request, caller: Identity) -> Any:
        """`relay replay` for scripts, with the console's confirmation: without the
        `expected` count (or as a dry run) it answers how many rows match and replays
        nothing; with it, it replays exactly that many, else nothing (409)."""
        asked = await self._body(request, api_input.replay_request)
        if self.set_aside == "mark":
            raise Refused(409, "nothing replayed: an own table keeps its sent rows in place")
        cap = self.settings.bulk_cap
        try:
            if asked.dry_run or asked.expected is None:
                found: replay.Replay = await self.run(
                    lambda conn: data.replay_count(conn, asked.request, cap)
                )
            else:
                expected = asked.expected
                found = await self.run(
                    lambda conn: data.replay_apply(
                        conn, caller.user, asked.request, expected, cap, via="api"
                    )
                )
        except data.Refused as exc:
            raise Refused(409, f"nothing replayed: {exc}", cap=cap) from None
        except data.Changed as exc:
            raise Refused(409, f"nothing replayed: {exc}; count again") from None
        answer = {
            "topic": asked.request.topic,
            "key": asked.request.key,
            "since": found.sent_from,
            "until": found.sent_until,
            "matching": found.matching,
        }
        if found.replay_id is None:
            if not (asked.dry_run or found.matching == 0):
                answer["message"] = (
                    f'a replay states its count: send "expected": {found.matching} to replay'
                )
            return {**answer, "replayed": 0, "dry_run": asked.dry_run}
        return {
            **answer,
            "replayed": found.replayed,
            "replay_id": found.replay_id,
            "first_id": found.first_id,
            "last_id": found.last_id,
        }

    async def _body(self, request: Request, read: Callable[[object], T]) -> T:
        try:
            return read(api_input.parse_body(await request.body()))
        except ValueError as exc:
            raise Refused(400, f"bad request: {exc}") from None

    async def _matching(self, target: data.Target) -> list[int]:
        """The dead letters a change of `target` would touch now (409 past the cap)."""
        cap = self.settings.bulk_cap
        try:
            ids: list[int] = await self.run(lambda conn: data.matching_ids(conn, target, cap))
        except data.TooMany as exc:
            raise self._too_many(exc) from None
        return ids

    def _too_many(self, exc: data.TooMany) -> Refused:
        cap = self.settings.bulk_cap
        return Refused(
            409,
            f"nothing changed: {exc}; one change touches at most {cap}: narrow the filter",
            cap=cap,
            matching_at_least=cap + 1,
        )

    @staticmethod
    def _missing(target: data.Target, ids: list[int]) -> dict[str, list[int]]:
        """For rows named by id: those that are no dead letter (now)."""
        if target.search is not None:
            return {}
        return {"not_dead_letters": sorted(set(target.ids) - set(ids))}
