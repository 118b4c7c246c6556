"""Incremental detokenization with the real SmolLM2 tokenizer: whole characters, stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 42, isn't it?",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\ttabs",
    "Hello 😀 world! 🎉🚀 naïve café, Straße, Ωμέγα.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "mixed: 👩‍👩‍👧 family, 🇫🇷 flag, é (combining: é), ｆｕｌｌｗｉｄｔｈ",
]


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say something."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def stream(
    tokenizer: Any, prompt: list[int], ids: list[int], stop: tuple[str, ...] = ()
) -> tuple[list[str], int | None, IncrementalDetokenizer]:
    """Feed `ids` one at a time as the engine does; return the deltas (the final flush last), the
    index of the token that matched a stop string (None if none did) and the detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    deltas = []
    for i, token in enumerate(ids):
        if detok.add(token):
            deltas.append(detok.take(final=True))
            return deltas, i, detok
        deltas.append(detok.take(final=False))
    deltas.append(detok.take(final=True))
    return deltas, None, detok


# ---- whole text, whole characters -------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_the_full_decode(tokenizer: Any, prompt: list[int], text: str) -> None:
    ids = encode(tokenizer, text)
    deltas, stopped, detok = stream(tokenizer, prompt, ids)
    assert stopped is None
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text


@pytest.mark.parametrize("text", TEXTS[2:])
def test_split_characters_never_appear_half(tokenizer: Any, prompt: list[int], text: str) -> None:
    ids = encode(tokenizer, text)
    # The test means something: some tokens carry only part of a character's UTF-8 bytes.
    assert any(REPLACEMENT in tokenizer.decode([t]) for t in ids)
    deltas, _, _ = stream(tokenizer, prompt, ids)
    assert not any(REPLACEMENT in d for d in deltas), deltas
    assert "".join(deltas) == text


def test_an_unfinished_character_at_the_end_is_not_emitted(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "ok 😀")
    assert tokenizer.decode(ids[:-1]).endswith(REPLACEMENT)
    deltas, _, detok = stream(tokenizer, prompt, ids[:-1])
    assert "".join(deltas) == detok.text == "ok"
    assert not any(REPLACEMENT in d for d in deltas)


def test_the_first_token_keeps_its_leading_space(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "Once upon a")
    ids = encode(tokenizer, " time there was")
    deltas, _, _ = stream(tokenizer, prompt, ids)
    assert "".join(deltas) == " time there was"
    assert deltas[0] == " time"


def test_special_tokens_add_no_text(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "Hi there") + [tokenizer.eos_token_id] + encode(tokenizer, " again")
    deltas, _, _ = stream(tokenizer, prompt, ids)
    assert "".join(deltas) == "Hi there again"


def test_without_stop_strings_nothing_is_held_back(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "Hello world, hello again")
    detok = IncrementalDetokenizer(tokenizer, prompt, ())
    for token in ids:
        assert not detok.add(token)
        detok.take(final=False)
        assert detok.take(final=True) == ""  # everything decodable was already returned


# ---- stop strings ---------------------------------------------------------------------------------


def test_a_stop_string_spanning_tokens_is_detected_and_not_returned(
    tokenizer: Any, prompt: list[int]
) -> None:
    ids = encode(tokenizer, "Hello world. STOP here and more text")
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "STOP" not in pieces and " ST" in pieces  # it really spans tokens
    deltas, stopped, detok = stream(tokenizer, prompt, ids, stop=("STOP",))
    assert stopped == pieces.index("OP")  # matched at the token that completes it
    assert detok.text == "Hello world. "
    assert "".join(deltas) == "Hello world. "
    assert not any("S" in d for d in deltas)  # not even its first letter was released early


def test_text_after_a_stop_string_in_the_same_token_is_dropped(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "one two three four")
    deltas, stopped, detok = stream(tokenizer, prompt, ids, stop=("wo th",))
    assert stopped is not None
    assert "".join(deltas) == detok.text == "one t"


def test_the_earliest_stop_string_wins(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "Hello world")
    deltas, stopped, _ = stream(tokenizer, prompt, ids, stop=("world", "lo wo"))
    assert stopped == len(ids) - 1
    assert "".join(deltas) == "Hel"


def test_a_multi_byte_stop_string(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "Hi 😀 there")
    deltas, stopped, _ = stream(tokenizer, prompt, ids, stop=("😀",))
    assert stopped is not None
    assert "".join(deltas) == "Hi "
    assert not any(REPLACEMENT in d for d in deltas)


def test_a_stop_string_across_a_split_character(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "日本語のテキスト")
    deltas, stopped, _ = stream(tokenizer, prompt, ids, stop=("のテ",))
    assert stopped is not None
    assert "".join(deltas) == "日本語"


def test_a_one_character_stop_string(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "alpha, beta, gamma")
    deltas, _, _ = stream(tokenizer, prompt, ids, stop=(",",))
    assert "".join(deltas) == "alpha"


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer: Any, prompt: list[int]) -> None:
    stop = ("\n\nUser:",)
    text = "The answer is 42.\n\nUse it wisely"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    released = ""
    for token in ids:
        assert not detok.add(token)
        released += detok.take(final=False)
        # Never more than the text minus a tail that could still begin the stop string.
        assert len(released) >= len(detok.text) - (len(stop[0]) - 1)
        assert detok.text.startswith(released)
    assert released == text[: len(text) - (len(stop[0]) - 1)]
    # "\n\nUse" looked like the stop string for a while; at the end the held-back tail is flushed.
    assert released + detok.take(final=True) == text
    assert detok.take(final=True) == ""


def test_the_held_back_tail_is_flushed_when_the_sequence_ends(tokenizer: Any, prompt: list[int]) -> None:
    ids = encode(tokenizer, "Finished by length ST")
    deltas, stopped, _ = stream(tokenizer, prompt, ids, stop=("STOP",))
    assert stopped is None
    assert not deltas[-2].endswith("ST")  # held back while it could begin "STOP"
    assert deltas[-1].endswith(" ST")  # released by take(final=True)
    assert "".join(deltas) == "Finished by length ST"
