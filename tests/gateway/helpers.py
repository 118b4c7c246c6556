"""Small helpers shared by the gateway tests: SSE parsing and OpenAPI schema validation."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from gateway.openapi.document import build_openapi


def parse_sse(raw: str) -> tuple[list[Any], list[str]]:
    """The `data:` payloads of an SSE body (JSON-decoded, `[DONE]` kept as a string) and its comments."""
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events: list[Any] = []
    comments: list[str] = []
    for block in raw.split("\n\n")[:-1]:
        if block.startswith(":"):
            comments.append(block)
            continue
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events, comments


def validate(instance: Any, schema_name: str, model: str = "fake-model") -> None:
    """Validate a response body against the named schema of the served OpenAPI document."""
    doc = build_openapi(model)
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": doc["components"]}
    jsonschema.Draft202012Validator(schema).validate(instance)


class ASGICall:
    """Drive one HTTP request through an ASGI app by hand, to control when the client disconnects.

    `receive` hands over the body once, then blocks until `disconnect()` is called. Every message
    the app sends is kept in `sent`; `wait_until(pred)` waits (event-driven) until `pred(self)`.
    """

    def __init__(self, app: Any, path: str, body: dict[str, Any], method: str = "POST") -> None:
        import asyncio

        self.app = app
        self._asyncio = asyncio
        data = json.dumps(body).encode()
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
            "client": ("127.0.0.1", 1234),
            "server": ("test", 80),
            "state": {},
        }
        self._body = data
        self._body_sent = False
        self._disconnected = asyncio.Event()
        self._changed = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self.task: Any = None

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        self._changed.set()

    def start(self) -> ASGICall:
        self.task = self._asyncio.ensure_future(self.app(self.scope, self.receive, self.send))
        return self

    def disconnect(self) -> None:
        self._disconnected.set()

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    async def wait_until(self, predicate: Any, timeout_s: float = 5.0) -> None:
        """Wait until `predicate(self)`: woken by each message sent, and re-checked every 5 ms for
        state outside the call (e.g. the fake engine's), failing after `timeout_s`."""
        async with self._asyncio.timeout(timeout_s):
            while not predicate(self):
                self._changed.clear()
                try:
                    await self._asyncio.wait_for(self._changed.wait(), 0.005)
                except TimeoutError:
                    pass


def validate_answer(doc: dict[str, Any], method: str, template: str, response: Any) -> None:
    """That an httpx response of `method` on the path `template` is one the OpenAPI document
    `doc` names: its status is listed, and its JSON body matches that status's schema."""
    operation = doc["paths"][template][method.lower()]
    status = str(response.status_code)
    assert status in operation["responses"], (method, template, status, response.text)
    content = operation["responses"][status].get("content", {})
    if "application/json" in content:
        schema = {**content["application/json"]["schema"], "components": doc["components"]}
        jsonschema.Draft202012Validator(schema).validate(response.json())


def validate_request(doc: dict[str, Any], method: str, template: str, body: Any) -> bool:
    """Whether `body` is a request body the document accepts for `method` on `template`."""
    content = doc["paths"][template][method.lower()]["requestBody"]["content"]
    schema = {**content["application/json"]["schema"], "components": doc["components"]}
    return bool(jsonschema.Draft202012Validator(schema).is_valid(body))
