"""The admin console at /ui: server-rendered pages over the admin and usage APIs (gateway/console/).

    GET  /ui                    -> /ui/tenants
    GET  /ui/login, POST /ui/login    the admin key in a password field; a session cookie back
    POST /ui/logout
    GET  /ui/static/...         the console's CSS and JS, and the vendored htmx and Chart.js
    the pages: gateway/console/tenancy_pages.py and serving_pages.py

Served only when an admin key is configured (`--admin-key-hash`; otherwise /ui is a 404, as any
unknown path). Only a console session opens a page, never an Authorization header: a tenant's key
(or the admin key itself) sent to /ui gets the login page. Every change is a POST that must carry
the session's CSRF token (a hidden form field, or an X-CSRF-Token header), else 403; the cookie is
SameSite=Strict besides. Pages are sent with a Content-Security-Policy that allows scripts,
styles and connections to this server only, and `Cache-Control: no-store`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from gateway import admission
from gateway.console import serving_pages, tenancy_pages
from gateway.console.calls import Api, ApiError
from gateway.console.forms import FormError
from gateway.console.live import Readings
from gateway.console.page import Page, environment
from gateway.console.sessions import COOKIE, COOKIE_PATH, LoginThrottle, Session, Sessions
from gateway.errors import APIError

STATIC = Path(__file__).parent / "static"
CSRF_FIELD, CSRF_HEADER = "csrf_token", "x-csrf-token"
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'; object-src 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}

Handler = Callable[[Page], Awaitable[Response]]


def _secure(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def _next_path(raw: str | None) -> str:
    """Where to go after the login: a console page of this server, nothing else (no open redirect)."""
    if not raw or not raw.startswith("/ui/") or raw.startswith("/ui/log") or "//" in raw or "\\" in raw:
        return "/ui/tenants"
    return raw


class Console:
    """The console's routes and state: its sessions, the login throttle, the live page's readings.
    `clock` (monotonic seconds) is the sessions' and the readings'; tests move it."""

    def __init__(self, admin_key_hash: str, *, idle_s: float, max_s: float) -> None:
        self.admin_key_hash = admin_key_hash
        self.sessions = Sessions(idle_s, max_s)
        self.throttle = LoginThrottle()
        self.readings = Readings()
        self.templates = environment()

    @property
    def clock(self) -> Callable[[], float]:
        return self.sessions.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.sessions.clock = clock
        self.throttle.clock = clock

    def routes(self) -> list[BaseRoute]:
        page, change = self._page, self._change
        t, s = tenancy_pages, serving_pages
        live = functools.partial(s.live_page, readings=self.readings, clock=lambda: self.clock())
        panel = functools.partial(s.live_panel, readings=self.readings, clock=lambda: self.clock())
        return [
            Route("/ui", self.index, methods=["GET"]),
            Route("/ui/", self.index, methods=["GET"]),
            Route("/ui/login", self.login_form, methods=["GET"]),
            Route("/ui/login", self.login, methods=["POST"]),
            Route("/ui/logout", change(self.logout), methods=["POST"]),
            Mount("/ui/static", StaticFiles(directory=STATIC)),
            Route("/ui/tenants", page(t.tenants), methods=["GET"]),
            Route("/ui/tenants/save", change(t.save_tenant), methods=["POST"]),
            Route("/ui/tenants/delete", change(t.delete_tenant), methods=["POST"]),
            Route("/ui/tenants/{name}", page(t.tenant), methods=["GET"]),
            Route("/ui/plans", page(t.plans), methods=["GET"]),
            Route("/ui/plans/save", change(t.save_plan), methods=["POST"]),
            Route("/ui/plans/delete", change(t.delete_plan), methods=["POST"]),
            Route("/ui/plans/{name}", page(t.plan), methods=["GET"]),
            Route("/ui/keys", page(t.keys), methods=["GET"]),
            Route("/ui/keys/issue", change(t.issue_key), methods=["POST"]),
            Route("/ui/keys/rotate", change(t.rotate_key), methods=["POST"]),
            Route("/ui/keys/revoke", change(t.revoke_key), methods=["POST"]),
            Route("/ui/prices", page(t.prices), methods=["GET"]),
            Route("/ui/prices/save", change(t.save_price), methods=["POST"]),
            Route("/ui/prices/delete", change(t.delete_price), methods=["POST"]),
            Route("/ui/audit", page(t.audit), methods=["GET"]),
            Route("/ui/usage", page(s.usage), methods=["GET"]),
            Route("/ui/usage.csv", page(s.usage_csv), methods=["GET"]),
            Route("/ui/live", page(live), methods=["GET"]),
            # The panel's own refresh is no activity: a forgotten tab still times out.
            Route("/ui/live/panel", page(panel, touch=False), methods=["GET"]),
            Route("/ui/batches", page(s.batches), methods=["GET"]),
            Route("/ui/batches/cancel", change(s.cancel_batch), methods=["POST"]),
            Route("/ui/batches/{batch_id}", page(s.batch), methods=["GET"]),
            Route("/ui/adapters", page(s.adapters), methods=["GET"]),
            Route("/ui/adapters/load", change(s.load_adapter), methods=["POST"]),
            Route("/ui/adapters/unload", change(s.unload_adapter), methods=["POST"]),
        ]

    # -- sessions ----------------------------------------------------------------------------

    def _session(self, request: Request, touch: bool = True) -> Session | None:
        return self.sessions.find(request.cookies.get(COOKIE), touch=touch)

    def _to_login(self, request: Request) -> Response:
        """No live session: to the login page, and back here after it. An htmx refresh is told
        to go there (HX-Redirect) with a 200, which htmx follows without reporting an error."""
        ended = "&ended=1" if request.cookies.get(COOKIE) else ""
        target = "/ui/login?next=" + quote(request.url.path, safe="/") + ended
        if request.headers.get("hx-request"):
            return _secure(Response(status_code=200, headers={"hx-redirect": target}))
        return _secure(RedirectResponse(target, 303))

    def _make_page(self, request: Request, session: Session) -> Page:
        client = (request.client.host, request.client.port) if request.client is not None else None
        api = Api(request.app, session.admin_key, client)
        return Page(request, session, api, self.templates, back="/ui/" + request.url.path.split("/")[2])

    def _page(self, handler: Handler, *, touch: bool = True) -> Callable[[Request], Awaitable[Response]]:
        """A page (GET): a live session, else the login; an API refusal is shown in the page."""

        async def endpoint(request: Request) -> Response:
            session = self._session(request, touch)
            if session is None:
                return self._to_login(request)
            page = self._make_page(request, session)
            try:
                response = await handler(page)
            except ApiError as exc:
                status = exc.status if exc.status < 500 else 502
                response = page.render("problem.html", status, error=exc)
            return _secure(response)

        return endpoint

    def _change(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A change (POST): a live session and its CSRF token (403 without), then the handler; a
        refusal, by a form check or the API, is said on the page it came from."""

        async def endpoint(request: Request) -> Response:
            session = self._session(request)
            if session is None:
                return self._to_login(request)
            page = self._make_page(request, session)
            token = request.headers.get(CSRF_HEADER)
            if token is None:
                field = (await page.form()).get(CSRF_FIELD)
                token = field if isinstance(field, str) else None
            if not session.csrf_ok(token):
                return _secure(HTMLResponse(self.templates.get_template("csrf.html").render(), 403))
            try:
                response = await handler(page)
            except (ApiError, FormError) as exc:
                response = page.refused(exc.message if isinstance(exc, ApiError) else str(exc))
            return _secure(response)

        return endpoint

    # -- login and logout --------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return _secure(RedirectResponse("/ui/tenants", 303))

    def _login_page(
        self, request: Request, status: int = 200, error: str | None = None, next_path: str | None = None
    ) -> Response:
        ended = request.query_params.get("ended")
        html = self.templates.get_template("login.html").render(
            next=_next_path(next_path or request.query_params.get("next")),
            error=error,
            ended=ended == "1",
            logged_out=ended == "logout",
        )
        return _secure(HTMLResponse(html, status))

    async def login_form(self, request: Request) -> Response:
        if self._session(request) is not None:
            return _secure(RedirectResponse(_next_path(request.query_params.get("next")), 303))
        return self._login_page(request)

    async def login(self, request: Request) -> Response:
        form = await request.form()
        client = request.client.host if request.client is not None else "?"
        next_path = _next_path(str(form.get("next") or ""))
        if self.throttle.blocked(client):
            wait = "Too many failed logins from this address: wait a minute."
            return self._login_page(request, 429, wait, next_path)
        key = str(form.get("admin_key") or "").strip()
        try:
            admission.check_admin(self.admin_key_hash, {"authorization": f"Bearer {key}"})
        except APIError:
            self.throttle.failed(client)
            return self._login_page(request, 401, "That is not the admin key.", next_path)
        self.sessions.close(request.cookies.get(COOKIE))  # a login never continues an older session
        session_id, _ = self.sessions.open(key)
        response = RedirectResponse(next_path, 303)
        response.set_cookie(
            COOKIE,
            session_id,
            max_age=int(self.sessions.max_s),
            path=COOKIE_PATH,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return _secure(response)

    async def logout(self, page: Page) -> Response:
        self.sessions.close(page.request.cookies.get(COOKIE))
        response = RedirectResponse("/ui/login?ended=logout", 303)
        response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
        return response
