"""The Responses API over the bundled SmolLM2-135M (the real model, in process): a turn continued by
`previous_response_id` renders its prompt starting with exactly the previous turn's prompt and
output tokens, so the prefix cache serves them."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import TinyServer

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("max_output_tokens", [3, 200])  # cut at the limit; ended by the model
def test_a_continued_turn_is_served_from_the_prefix_cache(
    real_server: TinyServer, max_output_tokens: int
) -> None:
    client: openai.OpenAI = real_server.openai(timeout=120)
    facts = f"List {max_output_tokens}. " + " ".join(
        f"{i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(40)
    )
    fields = {"model": real_server.model, "instructions": "Answer in one short sentence.", "temperature": 0}
    first = client.responses.create(
        **fields, input=facts + " Is 7 even or odd?", max_output_tokens=max_output_tokens
    )
    assert first.usage is not None
    turn = first.usage.input_tokens + first.usage.output_tokens
    assert turn >= 256, first.usage
    second = client.responses.create(
        **fields, previous_response_id=first.id, input="And 8?", max_output_tokens=2
    )
    assert second.usage is not None and second.usage.input_tokens > turn
    # Every full block of turn k's prompt and output (16-token blocks: at least 90% of 256).
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 0.9 * turn and cached >= turn // 16 * 16, (cached, turn, first.status, first.output_text)
    print(f"turn k {turn} tokens ({first.status}), turn k+1 cached {cached} of {second.usage.input_tokens}")
    real_server.wait_idle()
