"""LoRA adapters (engine/lora.py) on the tiny model: PEFT's files loaded and checked, versions
pinned and released, slots, and the engine mixing adapters in one batch (chunked prefill,
preemption, the prefix cache, grammars, our int8 kernels). Parity with transformers + PEFT on the
real model is tests/engine/test_lora_parity_real.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.device.lora_weights import LoraWeights
from engine.device.native import native_kernels
from engine.llm_engine import LLMEngine
from engine.lora import (
    TARGETS,
    LoraError,
    LoraInUseError,
    LoraNotFoundError,
    LoraRegistry,
    LoraSlots,
    load_adapter,
    module_shapes,
)
from engine.model_spec import ModelSpec
from engine.resolve import qmatmul_available
from engine.step import StepInputs, lora_decode_plan
from engine.types import GenerationRequest, GrammarSpec
from tests.engine.helpers import (
    chat_ids,
    compare_one_call_decode,
    greedy,
    hf_greedy,
    run_all,
    tiny_engine,
    tokens_of,
)
from tests.lora_adapters import ALL_TARGETS, make_adapter, peft_reference

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primes.", "Hi"]


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def spec(tiny_model_dir: Path) -> ModelSpec:
    return ModelSpec.from_config(json.loads((tiny_model_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def adapters(base: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "r8": make_adapter(base, root / "r8", r=8, alpha=8, seed=1),
        "r64": make_adapter(base, root / "r64", r=64, alpha=8, use_rslora=True, seed=2),
        "attn": make_adapter(base, root / "attn", r=4, targets=("q_proj", "v_proj"), seed=3),
        "mlp": make_adapter(base, root / "mlp", r=16, targets=("gate_proj", "down_proj"), seed=4),
        "r8b": make_adapter(base, root / "r8b", r=8, alpha=8, seed=5),
    }


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, adapters: dict[str, Path]) -> LLMEngine:
    engine = tiny_engine(tiny_model_dir)
    for name, path in adapters.items():
        engine.load_lora(name, str(path))
    return engine


def request(
    engine: LLMEngine, rid: str, text: str, lora: str | None, max_tokens: int = 8, **kw: Any
) -> GenerationRequest:
    adapter = engine.loras.get(lora) if lora else None
    return GenerationRequest(rid, chat_ids(engine.tokenizer, text), greedy(max_tokens, **kw), lora=adapter)


def alone(engine: LLMEngine, text: str, lora: str | None, max_tokens: int = 8) -> list[int]:
    outs = run_all(engine, [request(engine, "alone", text, lora, max_tokens)])
    return tokens_of(outs[("alone", 0)])


# ---- loading ----------------------------------------------------------------------------------


def test_an_adapter_loads_with_its_rank_scale_targets_and_hash(
    adapters: dict[str, Path], spec: ModelSpec
) -> None:
    a = load_adapter(adapters["r8"], spec, "r8")
    assert (a.rank, a.scale, set(a.target_modules)) == (8, 1.0, set(ALL_TARGETS))
    # each module's A [r, in] and B [out, r] as PEFT saved them (tiny model: hidden 64, q 64, kv 32)
    per_layer = 8 * (64 + 64) + 2 * 8 * (64 + 32) + 8 * (64 + 64) + 2 * 8 * (64 + 128) + 8 * (128 + 64)
    assert a.nbytes == spec.num_layers * per_layer * 4
    assert sorted(a.layers[0]) == sorted(ALL_TARGETS)
    rs = load_adapter(adapters["r64"], spec)
    assert rs.scale == pytest.approx(8 / 64**0.5)  # rsLoRA: alpha / sqrt(r)
    attn = load_adapter(adapters["attn"], spec)
    assert sorted(attn.layers[1]) == ["q_proj", "v_proj"]
    assert tuple(attn.layers[1]["v_proj"].b.shape) == (32, attn.rank)
    assert load_adapter(adapters["r8"], spec).content_hash == a.content_hash != rs.content_hash


def _broken_copy(src: Path, dst: Path, **config: Any) -> Path:
    dst.mkdir()
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text()) | config
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_naming_the_problem(
    adapters: dict[str, Path], spec: ModelSpec, base: Any, real_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(LoraError, match="not found"):
        load_adapter(tmp_path, spec, "nothing")
    with pytest.raises(LoraError, match="unsupported target module.*lm_head"):
        load_adapter(_broken_copy(adapters["r8"], tmp_path / "t", target_modules=["q_proj", "lm_head"]), spec)
    with pytest.raises(LoraError, match="DoRA"):
        load_adapter(_broken_copy(adapters["r8"], tmp_path / "d", use_dora=True), spec)
    with pytest.raises(LoraError, match=r"rank 128 is not in \[1, 64\]"):
        load_adapter(make_adapter(base, tmp_path / "big", r=128), spec)
    real = ModelSpec.from_config(json.loads((real_model_dir / "config.json").read_text()))
    with pytest.raises(LoraError, match=r"q_proj has A \(8, 64\).*needs A \(8, 576\).*different base model"):
        load_adapter(adapters["r8"], real, "tiny-one")


# ---- versions, pins, slots --------------------------------------------------------------------


def test_a_replaced_or_unloaded_adapter_stays_with_its_users_then_is_released(
    adapters: dict[str, Path], spec: ModelSpec
) -> None:
    reg = LoraRegistry(spec)
    v1 = reg.load("x", adapters["r8"])
    reg.pin(v1)
    v2 = reg.load("x", adapters["r8b"])  # replace: new requests get v2, v1 stays with its user
    assert (v1.version, v2.version, reg.get("x")) == (1, 2, v2)
    assert reg.nbytes == v1.nbytes + v2.nbytes and not v1.released
    reg.unpin(v1)
    assert v1.released and reg.nbytes == v2.nbytes
    reg.pin(v2)
    with pytest.raises(LoraInUseError, match="in use by 1"):
        reg.unload("x", wait=False)
    assert reg.get("x") is v2  # refused: nothing changed
    done = reg.unload("x")
    with pytest.raises(LoraNotFoundError):
        reg.get("x")
    assert not done.done() and reg.nbytes == v2.nbytes
    reg.unpin(v2)
    assert done.done() and reg.nbytes == 0 and reg.num_held == 0
    with pytest.raises(LoraNotFoundError, match="was unloaded"):
        reg.pin(v2)


def test_slots_are_reused_least_recently_used_and_never_while_in_use(
    adapters: dict[str, Path], spec: ModelSpec
) -> None:
    reg = LoraRegistry(spec)
    a, b, c = (reg.load(n, adapters[n]) for n in ("r8", "attn", "mlp"))
    installed: list[tuple[int, str | None]] = []
    slots = LoraSlots(2, lambda slot, ad: installed.append((slot, ad.name if ad else None)))
    sa, sb = slots.acquire(a), slots.acquire(b)
    assert (sa, sb) == (0, 1) and slots.acquire(c) is None  # both in use
    assert slots.acquire(a) == 0  # resident: no new install
    slots.release(sa)
    slots.release(sa)
    slots.release(sb)
    assert slots.acquire(c) == 0  # slot 0 was idle longest
    assert installed == [(0, "r8"), (1, "attn"), (0, "mlp")] and slots.num_loads == 3


# ---- the engine -------------------------------------------------------------------------------


def test_the_stacked_deltas_equal_each_module_s_own_matmuls(
    adapters: dict[str, Path], spec: ModelSpec
) -> None:
    """Decode rows of mixed slots (the grid as it lies, and gathered around base rows) and a run
    of prefill rows: the native op and the torch ops each equal x @ A.T @ B.T per module, also
    after a higher-rank adapter grew the stacks (ranks 4, 8, 16, 64: the kernel's 8-wide tails)
    and after it left and they shrank back to their bytes before;
    with A and B held in bfloat16 (`compact`), x @ A.T @ B.T of the bfloat16-rounded A and B."""
    loaded = [load_adapter(adapters[n], spec, n) for n in ("attn", "r8", "mlp", "r64")]
    weights = {
        "torch": LoraWeights(spec, 4, torch.float32, torch.device("cpu")),
        "native": LoraWeights(spec, 4, torch.float32, torch.device("cpu"), native_kernels()),
        "bf16": LoraWeights(spec, 4, torch.float32, torch.device("cpu"), native_kernels(), compact=True),
    }
    for w in weights.values():
        for slot, adapter in enumerate(loaded[:3]):
            w.install(slot, adapter)
    offsets = {module: offset for module, (_, _, offset) in module_shapes(spec).items()}
    widths = {"qkv": 128, "o": 64, "gate_up": 256, "down": 64}
    gen = torch.Generator().manual_seed(0)

    def expected(layer: int, linear: str, x: torch.Tensor, slots: list[int], held: str) -> torch.Tensor:
        y = torch.zeros(len(slots), widths[linear])
        for row, slot in enumerate(slots):
            for module, part in (loaded[slot].layers[layer] if slot >= 0 else {}).items():
                if TARGETS[module] == linear:
                    a, b = (part.a, part.b) if held != "bf16" else (part.a.bfloat16(), part.b.bfloat16())
                    cols = slice(offsets[module], offsets[module] + part.b.shape[0])
                    y[row, cols] += x[row] @ a.float().T @ b.float().T
        return y

    sizes = {name: w.nbytes for name, w in weights.items()}
    r8 = loaded[1]
    for phase in ("installed", "grown", "shrunk"):
        if phase != "installed":
            # rank 64 replaces rank 8 in slot 1: every stack grows; then back: they shrink again
            loaded[1] = loaded[3] if phase == "grown" else r8
            for name, w in weights.items():
                w.install(1, loaded[1])
                assert (w.nbytes > sizes[name]) == (phase == "grown"), (name, phase)
                assert phase == "grown" or w.nbytes == sizes[name]
        for slots in ([0, 0, 1, 1, 2, 2], [-1, 0, 0, 0, 1, 2, 2, 2, 2, 2]):
            n = len(slots)
            inputs = StepInputs([0] * n, [0] * n, [[0]] * n, n, [], [], slots)
            plan = lora_decode_plan(inputs, torch.device("cpu"))
            assert plan is not None and plan.dense == (slots[0] == 0)
            for linear, width in widths.items():
                x = torch.randn(len(slots), 128 if linear == "down" else 64, generator=gen)
                for name, w in weights.items():
                    want = expected(1, linear, x, slots, name)
                    y = torch.zeros(len(slots), width)
                    w.layers[1][linear].add_decode(y, x, plan)
                    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5, msg=f"{name} {linear} {slots}")
                    y.zero_()
                    w.layers[1][linear].add_rows(y, x, 2, slice(1, len(slots)))
                    ref = expected(1, linear, x, [-1] + [2] * (len(slots) - 1), name)
                    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5, msg=f"{name} rows {linear}")


def test_each_adapter_equals_transformers_and_peft(
    engine: LLMEngine, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    prompt = chat_ids(engine.tokenizer, PROMPTS[0])
    for name in ("r8", "r64", "attn", "mlp"):
        reference = peft_reference(tiny_model_dir, adapters[name])
        assert alone(engine, PROMPTS[0], name, 12) == hf_greedy(reference, prompt, 12), name


def test_a_batch_mixing_base_and_adapters_gives_each_row_its_own_tokens(engine: LLMEngine) -> None:
    loras = [None, "r8", "r64", "attn", "mlp", "r8b"]
    cases = [(text, lora) for text in PROMPTS[:2] for lora in loras]
    expected = [alone(engine, text, lora) for text, lora in cases]
    assert len({tuple(e) for e in expected}) == len(cases)  # each adapter changes the output
    outs = run_all(engine, [request(engine, f"m{i}", t, lora) for i, (t, lora) in enumerate(cases)])
    assert [tokens_of(outs[(f"m{i}", 0)]) for i in range(len(cases))] == expected
    assert engine.scheduler.parked == [] and all(a.users == 0 for a in engine.loras.names().values())


def test_two_ranks_with_adapters_answer_as_one_rank(
    engine: LLMEngine, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """2-rank tensor parallelism (gloo): each rank holds its shard of every adapter (B's rows of
    q/k/v and gate/up, A's columns of o and down, summed by the layer's all-reduce), and the
    mixed batch gives one rank's tokens. 2 slots for 3 adapters: slots are refilled between
    steps, and every refill reaches the other rank."""
    cases = [(t, lora) for t in PROMPTS[:2] for lora in (None, "r8", "attn", "mlp")]
    expected = [alone(engine, t, lora) for t, lora in cases]
    two = tiny_engine(tiny_model_dir, tensor_parallel_size=2, max_loras=2)
    try:
        for name in ("r8", "attn", "mlp"):
            two.load_lora(name, str(adapters[name]))
        outs = run_all(two, [request(two, f"t{i}", t, lora) for i, (t, lora) in enumerate(cases)])
        assert [tokens_of(outs[(f"t{i}", 0)]) for i in range(len(cases))] == expected
        assert two.lora_slots.num_loads >= 3 and two.runner.failure is None
    finally:
        two.close()


def test_more_adapters_than_slots_wait_outside_the_batch(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = tiny_engine(tiny_model_dir, max_loras=2)
    for name in ("r8", "attn", "mlp", "r8b"):
        engine.load_lora(name, str(adapters[name]))
    cases = [(PROMPTS[i % 3], lora) for i, lora in enumerate(["r8", "attn", "mlp", "r8b", None, "r8"])]
    expected = [alone(engine, t, lora) for t, lora in cases]
    for i, (t, lora) in enumerate(cases):
        engine.add_request(request(engine, f"s{i}", t, lora))
    got: dict[str, list[int]] = {}
    parked_seen = 0
    while engine.has_unfinished():
        parked_seen = max(parked_seen, len(engine.scheduler.parked))
        running_slots = {s.lora_slot for s in engine.scheduler.running if s.lora_slot >= 0}
        assert len(running_slots) <= 2
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert parked_seen >= 2  # two adapters' requests waited for a slot
    assert [got[f"s{i}"] for i in range(len(cases))] == expected
    assert engine.lora_slots.num_loads >= 4


def test_chunked_prefill_and_preemption_keep_adapter_outputs(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    roomy = tiny_engine(tiny_model_dir)
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # K+V, layers, kv heads, head_dim, fp32 bytes, block_size
    tight = tiny_engine(
        tiny_model_dir, kv_cache_memory_bytes=40 * per_block, max_model_len=160, max_num_batched_tokens=16
    )
    for engine in (roomy, tight):
        for name in ("r8", "mlp"):
            engine.load_lora(name, str(adapters[name]))
    cases = [(PROMPTS[i % 4] + " Tell me more." * (i % 3), ("r8", "mlp", None)[i % 3]) for i in range(6)]
    expected = [alone(roomy, t, lora, 24) for t, lora in cases]
    outs = run_all(tight, [request(tight, f"p{i}", t, lora, 24) for i, (t, lora) in enumerate(cases)])
    assert tight.scheduler.num_preemptions > 0
    assert [tokens_of(outs[(f"p{i}", 0)]) for i in range(len(cases))] == expected
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_the_prefix_cache_is_keyed_by_the_adapter_s_content(
    engine: LLMEngine, adapters: dict[str, Path]
) -> None:
    prompt = engine.tokenizer.encode(
        "Describe a long winding road through the hills, " * 4
    )  # no chat template

    def cached(rid: str, lora: str | None) -> int:
        adapter = engine.loras.get(lora) if lora else None
        outs = run_all(engine, [GenerationRequest(rid, prompt, greedy(2), lora=adapter)])
        return outs[(rid, 0)][-1].num_cached_tokens

    assert cached("c1", "r8") == 0
    assert cached("c2", "r8") > 0  # same adapter: its own blocks hit
    assert cached("c3", "r8b") == 0 and cached("c4", None) == 0  # never another adapter's, nor the base's
    engine.load_lora("r8", str(adapters["r8b"]))  # replaced under the same name: new content
    try:
        assert cached("c5", "r8") > 0  # ...equal to r8b's content, so r8b's blocks are the ones
        engine.load_lora("r8", str(adapters["mlp"]))
        assert cached("c6", "r8") == 0  # a new version never reuses the old one's blocks
    finally:
        engine.load_lora("r8", str(adapters["r8"]))


def test_adapters_with_a_grammar(engine: LLMEngine) -> None:
    req = request(engine, "g", "Give me a JSON object.", "r8", 24, grammar=GrammarSpec.json_object())
    text = "".join(o.new_text for o in run_all(engine, [req])[("g", 0)])
    json.loads(text)


def test_unloading_returns_the_bytes_held_after_the_last_user(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = tiny_engine(tiny_model_dir)
    before = engine.loras.nbytes
    adapter = engine.load_lora("x", str(adapters["r64"]))
    assert engine.loras.nbytes == before + adapter.nbytes
    stacks = engine.runner.model.lora
    assert stacks.nbytes == 0  # no slot holds an adapter: the stacks hold nothing
    engine.add_request(request(engine, "u", PROMPTS[0], "x", 4))
    engine.step()
    assert stacks.nbytes > 0  # rank 64 in a slot
    with pytest.raises(LoraInUseError):
        engine.loras.unload("x", wait=False)
    done = engine.loras.unload("x")
    assert not done.done()
    while engine.has_unfinished():
        engine.step()
    assert done.done() and engine.loras.nbytes == before
    engine.step()  # the slot lets go of the released weights
    assert engine.lora_slots.resident() == [] and stacks.installed == [None] * 8
    assert stacks.nbytes == 0  # and the stacks shrink with the largest rank left: none


@pytest.mark.skipif(
    not qmatmul_available("auto", torch.device("cpu")), reason="our int8 kernels need AVX2 or newer"
)
def test_adapters_over_our_int8_kernels_in_the_one_call_decode(
    tiny_model_dir: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On our int8 kernels a decode step with adapters runs every layer in one native call
    (engine/device/csrc/decode_layers.cpp): the same logits bit for bit as the Python layer loop, first
    with only q/v targeted (the other linears' stacks empty), then with ranks 8 and 64 mixed."""
    engine = tiny_engine(tiny_model_dir, quantization="int8")
    assert engine.runner.model.layers[0].qkv.quant is not None
    compared = compare_one_call_decode(engine, monkeypatch)
    for names in (["attn"], ["attn", "r8", "r64"]):
        for name in names:
            engine.load_lora(name, str(adapters[name]))
        cases = [(t, lora) for t in PROMPTS[:2] for lora in (None, *names)]
        expected = [alone(engine, t, lora) for t, lora in cases]
        assert len({tuple(e) for e in expected}) == len(cases)
        outs = run_all(engine, [request(engine, f"q{i}", t, lora) for i, (t, lora) in enumerate(cases)])
        assert [tokens_of(outs[(f"q{i}", 0)]) for i in range(len(cases))] == expected
    assert len(compared) >= 50 and all(compared)


def test_an_engine_without_adapter_slots_refuses_to_load_one(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    with pytest.raises(LoraError, match="max_loras is 0"):
        tiny_engine(tiny_model_dir, max_loras=0).load_lora("r8", str(adapters["r8"]))
