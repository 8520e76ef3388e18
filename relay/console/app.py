"""The console's routes: pages rendered on the server, forms for every change.

Every page but /login, /healthz and /static needs a login (relay/console/auth.py); the
JSON API for scripts is mounted at /api/v1 (relay/console/api.py). A
change is two POSTs: a confirmation that states how many rows it will touch, then the
change itself, which touches exactly those rows or nothing (data.change) and is
recorded in the audit.

Long: one class is the route table and every route's body, so that each route is
wrapped by `guarded` in one place (login, CSRF token, Origin, read-only mode); the Host
check before routing (hosts.py), the parsing of forms (forms.py), the queries (data.py)
and the rendering (render.py) live apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

import psycopg
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from relay.admin import pauses, replay
from relay.console import api, data, forms, render
from relay.console.auth import COOKIE, Auth, Identity
from relay.console.headers import SecurityHeaders
from relay.console.hosts import HostCheck, foreign_origin
from relay.console.limits import BodyLimit, LoginThrottle
from relay.console.pool import Pool, capped
from relay.console.rate import RateSampler
from relay.console.settings import ConsoleSettings
from relay.observe.logging import get_logger
from relay.settings import CommonSettings
from relay.store import db

log = get_logger("relay.console")

Handler = Callable[[Request, Identity], Awaitable[Response]]


class Console:
    def __init__(self, common: CommonSettings, settings: ConsoleSettings) -> None:
        self.common = common
        self.settings = settings
        self.auth = Auth(settings)
        self.hosts = settings.hosts
        self.pool = Pool(common, settings.pool_size, settings.statement_timeout_seconds)
        self.templates = render.environment()
        self.rate = RateSampler(
            capped(common, settings.statement_timeout_seconds), settings.rate_window_seconds
        )
        self.throttle = LoginThrottle()  # wrong tokens at /login and at the API alike
        self.api = api.Api(self.auth, self.throttle, self.db, settings, common.set_aside)

    # --- plumbing ---

    def page(
        self,
        request: Request,
        name: str,
        identity: Identity | None,
        status: int = 200,
        **values: Any,
    ) -> HTMLResponse:
        html = self.templates.get_template(name).render(
            request_path=request.url.path,
            identity=identity,
            read_only=self.settings.read_only,
            **{"refresh": 0, **values},
        )
        return HTMLResponse(html, status_code=status)

    async def db(self, work: Callable[[db.Conn], Any]) -> Any:
        def run() -> Any:
            with self.pool.connection() as conn:
                return work(conn)

        return await run_in_threadpool(run)

    def guarded(
        self, handler: Handler, *, change: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        """A login for every page; for a POST, the console's own origin and the session's
        CSRF token; for a change, a session that may change."""

        async def endpoint(request: Request) -> Response:
            identity = self.auth.identify(request)
            if identity is None:
                if request.method != "GET":
                    return PlainTextResponse("login required", status_code=401)
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse("/login?" + urlencode({"next": target}), 303)
            if request.method == "POST":
                refused = foreign_origin(request, self.hosts, self.settings.origins)
                if refused is not None:
                    return PlainTextResponse(f"refused: {refused}", status_code=403)
                form = await request.form()
                if self.auth.csrf_mismatch(identity, form.get("csrf")):
                    return PlainTextResponse("refused: missing or wrong CSRF token", 403)
            if change and not identity.may_change:
                return PlainTextResponse("refused: this session may look, not change", 403)
            return await handler(request, identity)

        return endpoint

    # --- login ---

    async def login_form(self, request: Request) -> Response:
        return self.page(
            request,
            "login.html",
            None,
            next=forms.local_path(request.query_params.get("next")),
            error=None,
            proxy=self.settings.trusted_user_header,
        )

    async def login(self, request: Request) -> Response:
        refused = foreign_origin(request, self.hosts, self.settings.origins)
        if refused is not None:
            return PlainTextResponse(f"refused: {refused}", status_code=403)
        peer = request.client.host if request.client else "-"
        if self.throttle.refused(peer):
            log.warning("console.login_throttled", peer=peer)
            return PlainTextResponse(
                "refused: too many wrong tokens from this address; wait a minute",
                status_code=429,
                headers={"retry-after": "60"},
            )
        form = await request.form()
        typed = form.get("token")
        cookie = self.auth.login(typed) if isinstance(typed, str) else None
        target = forms.local_path(str(form.get("next") or "/"))
        if cookie is None:
            self.throttle.failed(peer)
            log.warning("console.login_refused", peer=peer)  # never what was typed
            return self.page(
                request,
                "login.html",
                None,
                status=401,
                next=target,
                error="That is not the console's token.",
                proxy=self.settings.trusted_user_header,
            )
        log.info("console.login", peer=peer)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE,
            cookie,
            max_age=self.auth.cookie_max_age,
            httponly=True,
            samesite="strict",
            secure=self.settings.cookie_secure,
            path="/",
        )
        return response

    async def logout(self, request: Request, _identity: Identity) -> Response:
        self.auth.log_out(request)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(
            COOKIE, path="/", httponly=True, samesite="strict", secure=self.settings.cookie_secure
        )
        return response

    # --- pages ---

    async def overview(self, request: Request, identity: Identity) -> Response:
        cap = self.settings.count_cap
        found: data.Overview
        found, paused = await self.db(
            lambda conn: (data.overview(conn, cap), pauses.paused_topics(conn))
        )
        return self.page(
            request,
            "overview.html",
            identity,
            o=found,
            paused=paused,
            cap=cap,
            rate=self.rate.rate(),
            refresh=self.settings.refresh_seconds,
        )

    async def dead_letters(self, request: Request, identity: Identity) -> Response:
        query = request.query_params
        try:
            search = forms.search_filter(query)
            after = forms.int_param(query.get("after"))
            before = forms.int_param(query.get("before"))
        except ValueError as exc:
            return PlainTextResponse(f"bad search: {exc}", status_code=400)
        s = self.settings
        found: data.Page = await self.db(
            lambda conn: data.dead_letter_page(
                conn, search, after=after, before=before, limit=s.page_size, cap=s.count_cap
            )
        )
        base = forms.search_query(search)
        return self.page(
            request,
            "dead_letters.html",
            identity,
            page=found,
            search=search,
            search_fields=forms.search_fields(search),
            base=base,
            **forms.page_links(base, found),
        )

    async def row(self, request: Request, identity: Identity) -> Response:
        row_id: int = request.path_params["row_id"]
        preview = self.settings.payload_preview_bytes
        found = None
        if forms.is_bigint(row_id):
            found = await self.db(lambda conn: data.row(conn, row_id, preview))
        if found is None:
            return self.page(request, "missing.html", identity, status=404, what=f"row {row_id}")
        shown = render.payload(found["payload"], found["payload_bytes"])
        return self.page(
            request,
            "row.html",
            identity,
            r=found,
            payload=shown,
            headers=render.headers(found["headers"]),
        )

    async def blocked(self, request: Request, identity: Identity) -> Response:
        cap = self.settings.count_cap
        rows = await self.db(lambda conn: data.blocked_keys(conn, 500, cap))
        return self.page(
            request,
            "blocked.html",
            identity,
            rows=rows,
            cap=cap,
            refresh=self.settings.refresh_seconds,
        )

    async def audit(self, request: Request, identity: Identity) -> Response:
        try:
            before = forms.int_param(request.query_params.get("before"))
        except ValueError as exc:
            return PlainTextResponse(f"bad request: {exc}", status_code=400)
        limit = self.settings.page_size
        rows = await self.db(lambda conn: data.audit_page(conn, before, limit + 1))
        more = len(rows) > limit
        rows = rows[:limit]
        return self.page(
            request,
            "audit.html",
            identity,
            rows=rows,
            entry=None,
            describe=data.describe_target,
            next_url=f"/audit?before={rows[-1]['id']}" if more else None,
        )

    async def audit_entry(self, request: Request, identity: Identity) -> Response:
        entry_id: int = request.path_params["entry_id"]
        entry = None
        if forms.is_bigint(entry_id):
            entry = await self.db(lambda conn: data.audit_entry(conn, entry_id))
        if entry is None:
            return self.page(request, "missing.html", identity, status=404, what="audit entry")
        return self.page(
            request,
            "audit.html",
            identity,
            rows=[entry],
            entry=entry,
            describe=data.describe_target,
            next_url=None,
        )

    # --- changes ---

    async def confirm(self, request: Request, identity: Identity) -> Response:
        form = await request.form()
        action = forms.action_of(form)
        if action is None:
            return PlainTextResponse("unknown action", status_code=400)
        try:
            target = forms.target_of(form)
        except ValueError as exc:
            return PlainTextResponse(f"bad request: {exc}", status_code=400)
        cap = self.settings.bulk_cap
        try:
            ids: list[int] = await self.db(lambda conn: data.matching_ids(conn, target, cap))
        except data.TooMany as exc:
            return self.page(
                request,
                "missing.html",
                identity,
                status=409,
                what=f"{exc}: narrow the search",
            )
        return self.page(
            request,
            "confirm.html",
            identity,
            action=action,
            target=target,
            ids=ids,
            digest=data.digest(ids),
            search_fields=forms.search_fields(target.search) if target.search else [],
        )

    async def apply(self, request: Request, identity: Identity) -> Response:
        form = await request.form()
        action = forms.action_of(form)
        digest = form.get("digest")
        try:
            confirmed = forms.int_param(str(form.get("confirmed", "")))
            target = forms.target_of(form)
        except ValueError as exc:
            return PlainTextResponse(f"bad request: {exc}", status_code=400)
        if action is None or confirmed is None or not isinstance(digest, str):
            return PlainTextResponse("bad request: not from a confirmation", status_code=400)
        cap = self.settings.bulk_cap
        try:
            done: data.Done = await self.db(
                lambda conn: data.change(
                    conn,
                    identity.user,
                    action,
                    target,
                    confirmed,
                    cap,
                    digest,
                    set_aside=self.common.set_aside,
                )
            )
        except (data.Changed, data.TooMany) as exc:
            return self.page(
                request,
                "missing.html",
                identity,
                status=409,
                what=f"nothing changed: {exc}; look again and confirm anew",
            )
        return RedirectResponse(f"/audit/{done.audit_id}", status_code=303)

    # --- replay ---

    async def replay_form(self, request: Request, identity: Identity) -> Response:
        return self.page(
            request,
            "replay.html",
            identity,
            cap=self.settings.bulk_cap,
            own_table=self.common.outbox_table is not None,
        )

    async def replay_confirm(self, request: Request, identity: Identity) -> Response:
        form = await request.form()
        try:
            asked = forms.replay_request(form)
        except ValueError as exc:
            return PlainTextResponse(f"bad request: {exc}", status_code=400)
        if self.common.outbox_table is not None:
            return self._refused(request, identity, "an own table keeps its sent rows in place")
        cap = self.settings.bulk_cap
        try:
            found: replay.Replay = await self.db(lambda conn: data.replay_count(conn, asked, cap))
        except data.Refused as exc:
            return self._refused(request, identity, str(exc))
        return self.page(
            request,
            "replay_confirm.html",
            identity,
            asked=asked,
            found=found,
            since=replay.stamp(found.sent_from),
            until=replay.stamp(found.sent_until),
        )

    async def replay_apply(self, request: Request, identity: Identity) -> Response:
        form = await request.form()
        try:
            asked = forms.replay_request(form)
            confirmed = forms.int_param(str(form.get("confirmed", "")))
        except ValueError as exc:
            return PlainTextResponse(f"bad request: {exc}", status_code=400)
        if confirmed is None or asked.until is None:
            return PlainTextResponse("bad request: not from a confirmation", status_code=400)
        if self.common.outbox_table is not None:
            return self._refused(request, identity, "an own table keeps its sent rows in place")
        cap = self.settings.bulk_cap
        try:
            done: replay.Replay = await self.db(
                lambda conn: data.replay_apply(conn, identity.user, asked, confirmed, cap)
            )
        except (data.Refused, data.Changed) as exc:
            return self._refused(request, identity, f"{exc}; look again and confirm anew")
        return RedirectResponse(f"/audit/{done.replay_id}", status_code=303)

    def _refused(self, request: Request, identity: Identity, why: str) -> Response:
        return self.page(
            request,
            "missing.html",
            identity,
            status=409,
            what=f"nothing replayed: {why}",
            back="/replay",
        )

    # --- pauses ---

    async def pauses_page(self, request: Request, identity: Identity) -> Response:
        paused = await self.db(pauses.paused_topics)
        return self.page(request, "pauses.html", identity, paused=paused)

    async def pause_topic(self, request: Request, identity: Identity) -> Response:
        form = await request.form()
        topic, reason = str(form.get("topic", "")), str(form.get("reason", "")).strip()
        problem = pauses.topic_problem(topic)
        if problem is None and "\0" in reason:
            problem = "the reason holds a NUL character"
        if problem is not None:
            return PlainTextResponse(f"bad request: {problem}", status_code=400)
        await self.db(
            lambda conn: pauses.pause(
                conn, topic, actor=identity.user, via="console", reason=reason or None
            )
        )
        return RedirectResponse("/pauses", status_code=303)

    async def resume_topic(self, request: Request, identity: Identity) -> Response:
        topic = str((await request.form()).get("topic", ""))
        await self.db(lambda conn: pauses.resume(conn, topic, actor=identity.user, via="console"))
        return RedirectResponse("/pauses", status_code=303)

    # --- probes ---

    async def healthz(self, _request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(self, _request: Request) -> Response:
        try:
            await self.db(lambda conn: conn.execute("SELECT 1").fetchone())
        except Exception as exc:
            # The reason goes to the log: the probe answers anyone, without a login.
            log.warning("console.not_ready", error=db.describe_error(exc))
            return PlainTextResponse("database unavailable", status_code=503)
        return PlainTextResponse("ok")

    async def unavailable(self, request: Request, exc: Exception) -> Response:
        """A busy pool, a statement timeout or a lost database: 503, the reason logged,
        nothing of the SQL or the server shown."""
        log.warning(
            "console.database_unavailable", path=request.url.path, error=db.describe_error(exc)
        )
        return PlainTextResponse("the database is unavailable or slow; try again", status_code=503)

    # --- the application ---

    def application(self) -> ASGIApp:
        g = self.guarded
        routes = [
            Route("/", g(self.overview)),
            Route("/login", self.login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", g(self.logout), methods=["POST"]),
            Route("/dead-letters", g(self.dead_letters)),
            Route("/dead-letters/confirm", g(self.confirm, change=True), methods=["POST"]),
            Route("/dead-letters/apply", g(self.apply, change=True), methods=["POST"]),
            Route("/rows/{row_id:int}", g(self.row)),
            Route("/blocked", g(self.blocked)),
            Route("/replay", g(self.replay_form)),
            Route("/replay/confirm", g(self.replay_confirm, change=True), methods=["POST"]),
            Route("/replay/apply", g(self.replay_apply, change=True), methods=["POST"]),
            Route("/pauses", g(self.pauses_page)),
            Route("/pauses/pause", g(self.pause_topic, change=True), methods=["POST"]),
            Route("/pauses/resume", g(self.resume_topic, change=True), methods=["POST"]),
            Route("/audit", g(self.audit)),
            Route("/audit/{entry_id:int}", g(self.audit_entry)),
            Mount(api.PREFIX, app=self.api.application()),
            Route("/healthz", self.healthz),
            Route("/readyz", self.readyz),
            Mount("/static", StaticFiles(packages=[("relay.console", "static")]), name="static"),
        ]
        app = Starlette(
            routes=routes,
            lifespan=self._lifespan,
            exception_handlers={
                TimeoutError: self.unavailable,
                psycopg.OperationalError: self.unavailable,
            },
        )
        return SecurityHeaders(HostCheck(BodyLimit(app), self.hosts))

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.rate.start()
        try:
            yield
        finally:
            self.rate.stop()
            self.pool.close()


def create_app(common: CommonSettings, settings: ConsoleSettings) -> ASGIApp:
    return Console(common, settings).application()
