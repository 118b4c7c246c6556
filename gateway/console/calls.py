"""The console's one way to the data: the gateway's own HTTP API, called in process.

Every page reads and changes through the routes curl reaches (/admin/..., the usage routes,
/metrics, /health, /ready), sent to this app as ASGI requests with the session's admin key: the
console has no second path into the stores, and whatever the API checks and audits, it checks
and audits for the console too. An answer of 400 or more is an `ApiError` with the API's own
message; a page shows it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx
from starlette.types import ASGIApp

Params = Mapping[str, str | int | Sequence[str]]


class ApiError(Exception):
    """The API refused a call: its status and its message (OpenAI's error shape, read)."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body


def segment(name: str) -> str:
    """A path segment for a name (a tenant, a plan, a model that may hold '/')."""
    return quote(name, safe="")


class Api:
    """Calls into `app` as the admin: `admin_key` in the Authorization header, and the browser's
    address as the client (the audit log's `admin@<address>`)."""

    def __init__(self, app: ASGIApp, admin_key: str, client: tuple[str, int] | None) -> None:
        self._app = app
        self._client = client or ("127.0.0.1", 0)
        self._headers = {"authorization": f"Bearer {admin_key}"}

    async def call(
        self, method: str, path: str, *, params: Params | None = None, body: Any = None
    ) -> httpx.Response:
        """The API's answer; ApiError for a status of 400 or more."""
        transport = httpx.ASGITransport(app=self._app, raise_app_exceptions=False, client=self._client)
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as client:
            response = await client.request(
                method, path, params=params, json=body, headers=self._headers, timeout=30.0
            )
        if response.status_code >= 400:
            raise ApiError(response.status_code, *_message(response))
        return response

    async def probe(self, path: str) -> tuple[int, Any]:
        """A probe's status and JSON body, whatever the status (/health, /ready)."""
        try:
            response = await self.call("GET", path)
        except ApiError as exc:
            return exc.status, exc.body
        return response.status_code, response.json()

    async def get(self, path: str, params: Params | None = None) -> Any:
        return (await self.call("GET", path, params=params)).json()

    async def put(self, path: str, body: Any) -> Any:
        return (await self.call("PUT", path, body=body)).json()

    async def post(self, path: str, body: Any = None, params: Params | None = None) -> Any:
        return (await self.call("POST", path, body=body, params=params)).json()

    async def delete(self, path: str) -> Any:
        return (await self.call("DELETE", path)).json()


def _message(response: httpx.Response) -> tuple[str, Any]:
    """What a refusal says (OpenAI's `error.message`, else its status), and its JSON body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"]), body
    return f"{response.status_code} {response.reason_phrase}", body
