from __future__ import annotations

import pytest

from tenancy.tokens import TokenCounter, offline_encoding


def test_offline_cl100k_matches_known_ids() -> None:
    encoding = offline_encoding()
    assert encoding.encode("hello world") == [15339, 1917]  # cl100k_base ids
    assert TokenCounter().count("hello world") == 2
    assert not TokenCounter().exact


def test_special_token_text_is_counted_not_rejected() -> None:
    assert TokenCounter().count("<|endoftext|>") > 1


def test_local_tokenizer_is_used_when_given() -> None:
    counter = TokenCounter(lambda text: list(range(len(text.split()))))
    assert counter.exact
    assert counter.count("one two three") == 3
    assert counter.count("") == 0


def test_chat_messages_follow_openai_accounting() -> None:
    counter = TokenCounter(lambda text: text.split())  # type: ignore[arg-type, return-value]
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "hi there"}, {"type": "image_url"}],
        },
    ]
    # 3 priming + per message (3 + role + content) + name (1 + 1)
    assert counter.count_messages(messages) == 3 + (3 + 1 + 2) + (3 + 1 + 2 + 1 + 1)


@pytest.mark.parametrize(
    ("prompt", "expected"), [(None, 0), ("a b c", 3), ([5, 6, 7, 8], 4), (["a b", "c"], 3)]
)
def test_completion_prompts(prompt: object, expected: int) -> None:
    counter = TokenCounter(lambda text: text.split())  # type: ignore[arg-type, return-value]
    assert counter.count_prompt(prompt) == expected  # type: ignore[arg-type]
