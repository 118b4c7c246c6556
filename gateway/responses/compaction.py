"""Compaction: a long conversation made short, as an opaque item the client sends back.

    POST /v1/responses/compact {model, input?, previous_response_id?, instructions?}
      -> the conversation (the stored one before, then `input`) summarized by the model (a turn
         through the pipeline: limits, budgets, ledger) -> {"object": "response.compaction",
         "output": [the user messages, {"type": "compaction", "encrypted_content": ...}]}
    create with `context_management: [{"type": "compaction", "compact_threshold": N}]`
      -> a prompt estimated over N tokens has its history compacted before it runs (and the
         response is stored with the compacted history, so its continuations stay short)

`encrypted_content` is ours: the summary and the last `RETAINED_ITEMS` items that are not user
messages, as JSON, sealed with AES-256-GCM under the server's key with the tenant's name in the
associated data, so it can be neither read nor forged, nor replayed by another tenant (a 400
`invalid_encrypted_content`). In an input, the last compaction item marks where the compacted
history ends: it and what comes before it are the history the turn starts with (the summary as a
user message, then the retained items), what follows is the turn's input.

The key (`compaction_key`, 32 bytes in hex or base64) is a setting; unset, it is generated once
and kept in `--storage-dir` (`compaction.key`, mode 0600); without a storage directory it lives as
long as the process (compaction items do not outlive a restart, nor cross gateways of a pool:
set the key there).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.admission import Caller
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.openai.bodies import now
from gateway.responses.conversations import item_id

logger = logging.getLogger("batchgate.gateway")

KEY_FILE = "compaction.key"
PREFIX = "bgc1."  # the format's version: a later format gets a new prefix, the old still opens
RETAINED_ITEMS = 4  # the newest items (not user messages) kept whole beside the summary
SUMMARY_PROMPT = (
    "Summarize the conversation so far for your own later use: the task, what was done, what was "
    "found, and what remains. Be brief and concrete."
)
SUMMARY_MAX_TOKENS = 256
_AAD = b"batchgate compaction v1\x00"

# (caller, model, the conversation) -> the model's summary and the usage of writing it.
Summarize = Callable[[Caller, str, Sequence[dict[str, Any]]], Awaitable[tuple[str, dict[str, Any]]]]
# A prompt's tokens as compaction estimates them, before any tokenizer: 4 bytes of its JSON a token.
BYTES_PER_TOKEN = 4


def load_key(setting: str | None, storage_dir: str | None) -> bytes:
    """The sealing key: the setting's, else the storage directory's (made once), else a new one
    for this process."""
    if setting:
        return _decode_key(setting)
    if storage_dir:
        path = Path(storage_dir) / KEY_FILE
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(AESGCM.generate_key(bit_length=256).hex())
        return _decode_key(path.read_text().strip())
    logger.warning("compaction: no compaction_key nor storage dir; items last as long as this process")
    return AESGCM.generate_key(bit_length=256)


def _decode_key(text: str) -> bytes:
    for decode in (bytes.fromhex, base64.b64decode):
        try:
            key = decode(text)
        except (ValueError, binascii.Error):
            continue
        if len(key) == 32:
            return key
    raise ValueError("compaction_key must be 32 bytes in hex (64 digits) or base64")


class Sealer:
    """Seals compacted histories for one tenant and opens only that tenant's."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, tenant: str, content: dict[str, Any]) -> str:
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, orjson.dumps(content), _AAD + tenant.encode())
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()

    def open(self, tenant: str, token: str, param: str) -> dict[str, Any]:
        if not token.startswith(PREFIX):
            raise _invalid(param)
        try:
            raw = base64.urlsafe_b64decode(token[len(PREFIX) :])
            plain = self._aead.decrypt(raw[:12], raw[12:], _AAD + tenant.encode())
        except (ValueError, binascii.Error, InvalidTag):
            raise _invalid(param) from None
        content = orjson.loads(plain)
        assert isinstance(content, dict)  # we sealed it
        return content


def _invalid(param: str) -> APIError:
    return APIError(
        ErrorKind.INVALID_REQUEST,
        "The compaction item's encrypted_content could not be verified (not made by this server "
        "for this organization).",
        param=param,
        code="invalid_encrypted_content",
    )


def _is_user_message(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


def compact_content(summary: str, conversation: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a compaction item seals: the summary and the newest items that are not user messages
    (a function call is never kept without its output, nor an output without its call)."""
    others = [i for i in conversation if not _is_user_message(i) and i.get("type") != "reasoning"]
    kept = others[-RETAINED_ITEMS:]
    calls = {i.get("call_id") for i in kept if i.get("type") in ("function_call", "custom_tool_call")}
    kept = [i for i in kept if not (i.get("type", "").endswith("_output") and i.get("call_id") not in calls)]
    return {"summary": summary, "items": kept}


def expand(content: dict[str, Any]) -> list[dict[str, Any]]:
    """The history a compaction item stands for: its summary as a message, then the items kept."""
    summary = {
        "type": "message",
        "role": "user",
        "content": [
            {"type": "input_text", "text": f"Summary of the conversation so far:\n{content['summary']}"}
        ],
        "status": "completed",
    }
    return [summary, *content["items"]]


def compaction_item(token: str) -> dict[str, Any]:
    return {"id": f"cmp_{uuid.uuid4().hex}", "type": "compaction", "encrypted_content": token}


def split_at_compaction(
    sealer: Sealer, tenant: str, items: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int] | None:
    """Input items with compaction items: the history up to the last one (each expanded) and the
    index of the first item after it; None without one."""
    last = max((n for n, i in enumerate(items) if i.get("type") == "compaction"), default=None)
    if last is None:
        return None
    history: list[dict[str, Any]] = []
    for n, item in enumerate(items[: last + 1]):
        if item.get("type") == "compaction":
            history += expand(
                sealer.open(tenant, str(item["encrypted_content"]), f"input[{n}].encrypted_content")
            )
        else:
            history.append(item)
    return history, last + 1


def compacted_response(
    sealer: Sealer, tenant: str, summary: str, usage: dict[str, Any], conversation: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The `response.compaction` object of `POST /v1/responses/compact`."""
    # Output items carry ids (the spec's message requires one); input ones may have none.
    users = [i if i.get("id") else {**i, "id": item_id("msg")} for i in conversation if _is_user_message(i)]
    token = sealer.seal(tenant, compact_content(summary, conversation))
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": now(),
        "output": [*users, compaction_item(token)],
        "usage": usage,
    }


def check_compact_body(body: Any) -> str:
    """The compact request's model; a 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    model = body.get("model")
    if model is None:
        raise invalid_request("Missing required parameter: 'model'.", param="model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' must be a non-empty string.", param="model")
    if body.get("input") is None and body.get("previous_response_id") is None:
        raise invalid_request("Give 'input', 'previous_response_id', or both.", param="input")
    return model


def estimate_tokens(items: Sequence[dict[str, Any]]) -> int:
    return len(orjson.dumps(list(items))) // BYTES_PER_TOKEN


class Compactor:
    """The server's sealer and the model's summaries (`summarize`: wired by the app, a turn
    through the pipeline)."""

    def __init__(self, sealer: Sealer) -> None:
        self.sealer = sealer
        self.summarize: Summarize | None = None

    async def summary(
        self, caller: Caller, model: str, conversation: Sequence[dict[str, Any]]
    ) -> tuple[str, dict[str, Any]]:
        if self.summarize is None:
            raise RuntimeError("Compactor.summarize is not wired")
        return await self.summarize(caller, model, conversation)

    async def compact_history(
        self, caller: Caller, model: str, history: Sequence[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """A create's history compacted server-side: its user messages, the summary, the items kept."""
        summary, _ = await self.summary(caller, model, history)
        users = [i for i in history if _is_user_message(i)]
        return [*users, *expand(compact_content(summary, history))]
