"""Compaction (gateway/responses/compaction.py): `POST /v1/responses/compact` through the official
openai SDK's `client.responses.compact()` against a real server (the tiny model), its item sent
back as input; a forged item, or one sealed for another tenant, is a 400; a compact request
without `model` is a 400; `context_management`'s threshold compacts a create's history first
(the fake engine, whose prompts the test reads)."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import openai
import pytest

from gateway.responses.compaction import PREFIX, load_key
from tests.gateway.conftest import AppFactory, TinyServer, client_for
from tests.gateway.fakes import FakeEngine


def test_the_sdk_compacts_and_the_item_continues(tiny_server: TinyServer) -> None:
    client = tiny_server.openai()
    model = tiny_server.model
    first = client.responses.create(model=model, input="Remember the word kiwi.", max_output_tokens=4)
    compacted = client.responses.compact(
        model=model, previous_response_id=first.id, input=[{"role": "user", "content": "And mango."}]
    )
    assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
    kinds = [item.type for item in compacted.output]
    assert kinds == ["message", "message", "compaction"], kinds  # the user messages, then the item
    assert all(i.id and i.id.startswith("msg_") for i in compacted.output[:2])  # each output item has one
    item = compacted.output[-1]
    assert item.encrypted_content.startswith(PREFIX) and "kiwi" not in item.encrypted_content
    assert compacted.usage.output_tokens > 0  # the model wrote the summary
    # The compacted window sent back as input, with a new turn after it: accepted and answered.
    # (the SDK types every output message as an assistant one: dump without its warnings)
    window = [i.model_dump(exclude_none=True, warnings=False) for i in compacted.output]
    answer = client.responses.create(
        model=model, input=[*window, {"role": "user", "content": "Which fruits?"}], max_output_tokens=4
    )
    assert answer.status in ("completed", "incomplete")
    items = client.responses.input_items.list(answer.id).data
    assert [i.type for i in items] == ["message"]  # this turn's input; the window is its history
    with client.responses.connect() as conn:  # and over the WebSocket
        conn.response.create(
            model=model, input=[*window, {"role": "user", "content": "Again?"}], max_output_tokens=4
        )
        for event in conn:
            if event.type in ("response.completed", "response.incomplete", "error"):
                break
        assert event.type != "error", event
    # Forged: one byte of the sealed content changed.
    raw = bytearray(base64.urlsafe_b64decode(item.encrypted_content[len(PREFIX) :]))
    raw[20] ^= 1
    forged = {**window[-1], "encrypted_content": PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode()}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input=[forged, {"role": "user", "content": "x"}])
    assert (
        refused.value.code == "invalid_encrypted_content"
        and refused.value.param == "input[0].encrypted_content"
    )
    # Sealed for another tenant with this server's own key: refused alike.
    sealer = tiny_server.server.server.config.app.state.gateway.responses.compactor.sealer
    other = {"type": "compaction", "encrypted_content": sealer.seal("acme", {"summary": "s", "items": []})}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input=[other, {"role": "user", "content": "x"}])
    assert refused.value.code == "invalid_encrypted_content"
    # Without a model: OpenAI's 400 naming it.
    r = httpx.post(f"{tiny_server.base_url}/v1/responses/compact", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    tiny_server.wait_idle()


@pytest.mark.parametrize("store_format", ["1", "2"])
async def test_context_management_compacts_past_the_threshold(
    make_app: AppFactory, store_format: str
) -> None:
    engine = FakeEngine(max_model_len=4096)
    engine.reply = lambda request, index: "summary-or-answer"
    app = make_app(engine=engine, responses_store_format=store_format)
    async with client_for(app) as client:

        async def create(**body: Any) -> dict[str, Any]:
            r = await client.post(
                "/v1/responses", json={"model": "fake-model", "max_output_tokens": 8, **body}
            )
            assert r.status_code == 200, r.text
            return dict(r.json())

        first = await create(input="a long first turn " * 20)
        below = await create(
            input="next",
            previous_response_id=first["id"],
            context_management=[{"type": "compaction", "compact_threshold": 10_000}],
        )
        prompt = engine.tokenizer.decode(engine.submitted[-1].prompt_token_ids)
        assert "a long first turn" in prompt and "Summary of the conversation so far" not in prompt
        compacted = await create(
            input="next",
            previous_response_id=below["id"],
            context_management=[{"type": "compaction", "compact_threshold": 50}],
        )
        summary_prompt = engine.tokenizer.decode(engine.submitted[-2].prompt_token_ids)
        assert "Summarize the conversation so far" in summary_prompt  # the model was asked first
        prompt = engine.tokenizer.decode(engine.submitted[-1].prompt_token_ids)
        assert "Summary of the conversation so far:\nsummary-or-answer" in prompt
        # Stored with its compacted history (in either format): the next turn starts from it.
        await create(input="after", previous_response_id=compacted["id"])
        after = engine.tokenizer.decode(engine.submitted[-1].prompt_token_ids)
        assert after.startswith(prompt.removesuffix("<|im_start|>assistant\n"))
        assert after.count("Summary of the conversation so far") == 1
        metrics = (await client.get("/metrics")).text
        assert "batchgate_responses_compactions_total 1.0" in metrics
        r = await client.post(
            "/v1/responses",
            json={"model": "fake-model", "input": "x", "context_management": [{"type": "nope"}]},
        )
        assert r.status_code == 400 and "context_management" in r.json()["error"]["param"], r.text


def test_the_key_is_made_once_and_kept(tmp_path: Any) -> None:
    key = load_key(None, str(tmp_path))
    assert len(key) == 32 and load_key(None, str(tmp_path)) == key
    assert (tmp_path / "compaction.key").stat().st_mode & 0o777 == 0o600
    assert load_key(key.hex(), None) == key
    with pytest.raises(ValueError, match="compaction_key"):
        load_key("short", None)
