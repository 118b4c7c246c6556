"""`/v1/conversations`: durable conversations per tenant, and what stored items have in common.

    POST   /v1/conversations                          create (items, metadata)
    GET    /v1/conversations/{id}                     retrieve
    POST   /v1/conversations/{id}                     update its metadata
    DELETE /v1/conversations/{id}                     delete
    GET    /v1/conversations/{id}/items               list (after, limit, order: desc by default)
    POST   /v1/conversations/{id}/items               add items
    GET    /v1/conversations/{id}/items/{item_id}     retrieve one
    DELETE /v1/conversations/{id}/items/{item_id}     delete one (answers the conversation)

A response created with `conversation` starts from the conversation's items, and its input and
output items are appended to it (gateway/responses/state.py). Conversations live in the response
store (gateway/responses/store.py) beside the responses, within the same per-tenant bound. Another
tenant's id is a 404. Appending is read-modify-write: two turns of one conversation at once may
lose one's items (clients send a conversation's turns one after another). In format 2 a
conversation names its latest stored response instead of holding the items through that turn
(`StoredConversation`), so each item is stored once; deleting one of those items stores the
conversation whole again.

A conversation holds at most the tenant's `conversation_max_items` items and
`conversation_max_bytes` bytes held whole (gateway/bounds.py): a create, an update or an add that
would go over is a 400 naming the bound, and so is a response whose conversation is already at it
(a response's own turn is appended whole, so a conversation may pass the bound by that turn).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission import Caller
from gateway.body import read_json
from gateway.bounds import Bounds, exceeded
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.openai.bodies import now
from gateway.openai.listing import list_page, list_params
from gateway.openai.protocol import StrictModel, validation_error
from gateway.responses.request import MAX_METADATA_KEYS, Parent, ResponsesRequest, _check_media, items_of
from gateway.responses.store import ResponseStore, StoredConversation

logger = logging.getLogger("batchgate.gateway")

T = TypeVar("T")
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
MAX_ITEMS_PER_ADD = 20  # OpenAI's, for create and items.create
_ITEM_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
}


@dataclass(frozen=True)
class Turn:
    """A stored response created with `conversation`: its id and object, and the ids of the items
    of the history it was given (`Conversations.append`)."""

    response_id: str
    response: dict[str, Any]
    history_ids: list[str | None]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items with an id each (kept where the client gave one)."""
    return [item if item.get("id") else {**item, "id": item_id(_ITEM_PREFIX[item["type"]])} for item in items]


async def guarded(call: Awaitable[T]) -> T:
    """A store call; a store that fails is a 503, never a silent drop."""
    try:
        return await call
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - any store failure
        logger.error("the response store failed: %r", exc)
        raise APIError(
            ErrorKind.UNAVAILABLE, "The response store is unavailable; retry shortly.", retry_after_s=1.0
        ) from None


def page(items: list[dict[str, Any]], request: Request) -> dict[str, Any]:
    """A list page of `items` (oldest first) by the query's `order`, `after` and `limit`."""
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request("'order' must be 'asc' or 'desc'.", param="order")
    _, limit = list_params(query, DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [i.get("id") for i in ordered]
        if after not in ids:
            raise invalid_request(f"No item with id '{after}' here.", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    return list_page(ordered, limit)


def _items(raw: Any, param: str) -> list[dict[str, Any]]:
    """Validated input items (the create-response rules) in OpenAI's item shape, with ids."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_request(f"Invalid value for '{param}': must be an array of items.", param=param)
    try:
        _check_media(raw)
        req = ResponsesRequest.model_validate({"model": "", "input": raw})
    except APIError as exc:
        if exc.param is not None:
            exc.param = param + exc.param.removeprefix("input")
        raise
    except ValidationError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.errors()[0]["loc"][1:])
        raise invalid_request(f"Invalid item in '{param}{where}'.", param=f"{param}{where}") from None
    return with_ids(items_of(req))


Items = Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS_PER_ADD)]
Metadata = Annotated[dict[str, str], Field(max_length=MAX_METADATA_KEYS)]


class ConversationCreateRequest(StrictModel):
    items: Items | None = None
    metadata: Metadata | None = None


class ConversationUpdateRequest(StrictModel):
    metadata: Metadata


class ConversationItemsRequest(StrictModel):
    items: Items


M = TypeVar("M", bound=StrictModel)


def parse_body(model: type[M], body: Any) -> M:
    """`body` as `model` (a JSON object); APIError 400 naming the bad field."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


class Conversations:
    """The routes above, over one store; `bounds`: a caller's tenant's bounds (gateway/bounds.py);
    `store_format`: the format conversations are written in (gateway/responses/store.py)."""

    def __init__(
        self,
        store: ResponseStore,
        max_body_bytes: int,
        bounds: Callable[[Caller], Bounds] | None = None,
        store_format: int = 1,
    ) -> None:
        self.store = store
        self.max_body_bytes = max_body_bytes
        self.bounds = bounds
        self.store_format = store_format

    def check_room(
        self, caller: Caller, conversation: StoredConversation, param: str = "items", *, adding: int = 0
    ) -> None:
        """APIError 400 naming the bound when `conversation` (with `adding` more items, and their
        bytes already in it) is over the caller's tenant's bounds; `param`: the field at fault."""
        if self.bounds is None:
            return
        bounds = self.bounds(caller)
        num_items = len(conversation.items) + adding
        if num_items > bounds.conversation_max_items:
            what = f"The conversation would hold {num_items:,} items"
            raise exceeded("conversation_max_items", bounds.conversation_max_items, what, param)
        size = conversation.size()
        if size > bounds.conversation_max_bytes:
            what = f"The conversation would take {size:,} bytes"
            raise exceeded("conversation_max_bytes", bounds.conversation_max_bytes, what, param)

    # -- used by the Responses API -------------------------------------------------------------

    async def load(self, tenant: str, conversation_id: str, param: str | None = None) -> StoredConversation:
        conversation = await self.find(tenant, conversation_id)
        if conversation is None:
            raise APIError(
                ErrorKind.NOT_FOUND, f"Conversation with id '{conversation_id}' not found.", param=param
            )
        return conversation

    async def find(self, tenant: str, conversation_id: str) -> StoredConversation | None:
        """The conversation, or None where the tenant has none of that id."""
        if not conversation_id.startswith("conv_"):
            return None
        return await guarded(self._read(tenant, conversation_id))

    async def _read(self, tenant: str, conversation_id: str) -> StoredConversation | None:
        chain = await self.store.chain(tenant, conversation_id)
        if not chain:
            return None
        conversation = StoredConversation.from_chain(chain)
        if conversation is None:  # the links keep a head's chain: a store that lost it fails
            raise ValueError(f"conversation {conversation_id}'s head is not stored")
        return conversation

    async def save(self, tenant: str, conversation: StoredConversation) -> None:
        """Stored naming its head where it has one (format 2) still stored, else whole."""
        key, head = conversation.conversation_id, conversation.head
        if self.store_format == 2 and head is not None:
            if await guarded(self.store.put_linked(tenant, key, conversation.dumps(2), head.response_id)):
                return
        await guarded(self.store.put(tenant, key, conversation.dumps(1)))

    async def append(
        self,
        tenant: str,
        conversation_id: str,
        items: list[dict[str, Any]],
        turn: Turn | None = None,
    ) -> None:
        """Add a turn's items (read-modify-write; see the module docstring). `turn`: the stored
        response whose turn they are; it becomes the head where the history it was given is the
        conversation's items still (by their ids: not compacted, and nothing added since)."""
        current = await self.load(tenant, conversation_id)
        grown = [*current.items, *items]
        head = current.head
        if turn is not None and [i.get("id") for i in current.items] == turn.history_ids:
            head = Parent(turn.response_id, len(grown), turn.response)
        await self.save(tenant, StoredConversation(current.conversation, grown, head))

    # -- routes ----------------------------------------------------------------------------------

    async def create(self, caller: Caller, request: Request) -> Response:
        body = parse_body(ConversationCreateRequest, await read_json(request, self.max_body_bytes))
        items = _items(body.items, "items")
        conversation = {
            "id": item_id("conv"),
            "object": "conversation",
            "created_at": now(),
            "metadata": dict(body.metadata or {}),
        }
        stored = StoredConversation(conversation, items)
        self.check_room(caller, stored)
        await self.save(caller.name, stored)
        return JSONResponse(conversation)

    async def retrieve(self, caller: Caller, request: Request) -> Response:
        stored = await self.load(caller.name, request.path_params["conversation_id"])
        return JSONResponse(stored.conversation)

    async def update(self, caller: Caller, request: Request) -> Response:
        body = parse_body(ConversationUpdateRequest, await read_json(request, self.max_body_bytes))
        stored = await self.load(caller.name, request.path_params["conversation_id"])
        conversation = {**stored.conversation, "metadata": dict(body.metadata)}
        updated = StoredConversation(conversation, stored.items, stored.head)
        self.check_room(caller, updated, "metadata")
        await self.save(caller.name, updated)
        return JSONResponse(conversation)

    async def delete(self, caller: Caller, request: Request) -> Response:
        conversation_id = request.path_params["conversation_id"]
        await self.load(caller.name, conversation_id)
        await guarded(self.store.delete(caller.name, conversation_id))
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, caller: Caller, request: Request) -> Response:
        stored = await self.load(caller.name, request.path_params["conversation_id"])
        return JSONResponse(page(stored.items, request))

    async def add_items(self, caller: Caller, request: Request) -> Response:
        body = parse_body(ConversationItemsRequest, await read_json(request, self.max_body_bytes))
        items = _items(body.items, "items")
        conversation_id = request.path_params["conversation_id"]
        current = await self.load(caller.name, conversation_id)
        grown = StoredConversation(current.conversation, [*current.items, *items], current.head)
        self.check_room(caller, grown)
        await self.save(caller.name, grown)
        return JSONResponse(
            {
                "object": "list",
                "data": items,
                "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None,
                "has_more": False,
            }
        )

    def _item_index(self, stored: StoredConversation, item_id: str) -> int:
        for i, item in enumerate(stored.items):
            if item.get("id") == item_id:
                return i
        raise APIError(ErrorKind.NOT_FOUND, f"Item with id '{item_id}' not found.")

    async def get_item(self, caller: Caller, request: Request) -> Response:
        stored = await self.load(caller.name, request.path_params["conversation_id"])
        return JSONResponse(stored.items[self._item_index(stored, request.path_params["item_id"])])

    async def delete_item(self, caller: Caller, request: Request) -> Response:
        stored = await self.load(caller.name, request.path_params["conversation_id"])
        index = self._item_index(stored, request.path_params["item_id"])
        head = stored.head if stored.head is not None and index >= stored.head.num_items else None
        items = stored.items[:index] + stored.items[index + 1 :]
        await self.save(caller.name, StoredConversation(stored.conversation, items, head))
        return JSONResponse(stored.conversation)
