"""A continuation's history is its stored items as they are (never parsed again): it renders to
the chat request the same items sent inline render to, tool calls and their outputs included, and
`truncation: auto` drops stored items as it drops inline ones."""

from __future__ import annotations

from typing import Any

from gateway.responses.chat_form import drop_oldest, to_chat
from gateway.responses.request import ResponsesRequest, parse_responses_request

STORED: list[dict[str, Any]] = [  # in OpenAI's item shape, as the store keeps them
    {
        "type": "message",
        "id": "msg_1",
        "role": "developer",
        "status": "completed",
        "content": [{"type": "input_text", "text": "Be brief."}],
    },
    {
        "type": "message",
        "id": "msg_2",
        "role": "user",
        "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}],
    },
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    },
    {
        "type": "function_call_output",
        "id": "fco_1",
        "call_id": "c1",
        "output": [{"type": "input_text", "text": "sun"}],
    },
    {
        "type": "message",
        "id": "msg_3",
        "role": "assistant",
        "status": "completed",
        "content": [
            {"type": "output_text", "text": "Sunny.", "annotations": []},
            {"type": "refusal", "refusal": " No more."},
        ],
    },
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
    {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "c2", "output": "done"},
]
TURN = {"role": "user", "content": "And tomorrow?"}


def _continued() -> ResponsesRequest:
    return parse_responses_request({"model": "m", "input": [TURN]}).model_copy(
        update={"history": tuple(STORED)}
    )


def _inline() -> ResponsesRequest:
    return parse_responses_request({"model": "m", "input": [*STORED, TURN]})


def _rendered(req: ResponsesRequest) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in to_chat(req).messages]


def test_stored_history_renders_as_the_same_items_sent_inline() -> None:
    messages = _rendered(_continued())
    assert messages == _rendered(_inline())
    assert [m["role"] for m in messages] == [
        "developer",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "user",
    ]
    assert messages[1]["content"] == "Weather in Paris?" and messages[4]["content"].startswith(
        "Sunny. No more.\n"
    )


def test_truncation_drops_stored_items_as_it_drops_inline_ones() -> None:
    stored: ResponsesRequest | None = _continued()
    inline: ResponsesRequest | None = _inline()
    steps = 0
    while stored is not None and inline is not None:
        assert _rendered(stored) == _rendered(inline)
        stored, inline, steps = drop_oldest(stored), drop_oldest(inline), steps + 1
    assert stored is None and inline is None and steps > 3
