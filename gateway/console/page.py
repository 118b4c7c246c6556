"""What a console page's handler works with: the request, the session, the API, the templates.

Pages are rendered on the server (Jinja2, autoescaped) from what the API answers; a change is a
form POST answered by a redirect to the page it came from (post/redirect/get), with a one-shot
notice saying what it did or why the API refused it.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway.console.calls import Api
from gateway.console.sessions import Session

TEMPLATES = Path(__file__).parent / "templates"


def utc(seconds: float | None, width: str = "minute") -> str:
    if seconds is None:
        return "—"
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    formats = {"day": "%Y-%m-%d", "hour": "%Y-%m-%d %H:00", "minute": "%Y-%m-%d %H:%M UTC"}
    return moment.strftime(formats[width])


def usd(micros: float | None) -> str:
    return "—" if micros is None else f"${micros / 1e6:,.2f}" if micros >= 10_000 else f"${micros / 1e6:,.6f}"


def num(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "—"
    return f"{seconds * 1000:,.0f} ms" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def percent(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio * 100:.0f}%"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(utc=utc, usd=usd, num=num, ms=ms, percent=percent)
    return env


@dataclass
class Page:
    """One request to a console page. `back`: where a change's redirect goes (its page)."""

    request: Request
    session: Session
    api: Api
    templates: jinja2.Environment
    back: str = "/ui/"
    _form: FormData | None = field(default=None, repr=False)

    async def form(self) -> FormData:
        if self._form is None:
            self._form = await self.request.form()
        return self._form

    def render(self, template: str, status_code: int = 200, **context: Any) -> Response:
        # A partial (the live panel's refresh) leaves the notices to the next whole page.
        flashes = [] if template.startswith("_") else self.session.take_flashes()
        html = self.templates.get_template(template).render(
            csrf=self.session.csrf_token,
            flashes=flashes,
            path=self.request.url.path,
            **context,
        )
        return HTMLResponse(html, status_code)

    def done(self, text: str, to: str | None = None) -> Response:
        """After a change: say what it did on the next page, and go there."""
        self.session.flash("ok", text)
        return RedirectResponse(to or self.back, 303)

    def refused(self, text: str, to: str | None = None) -> Response:
        self.session.flash("error", text)
        return RedirectResponse(to or self.back, 303)
