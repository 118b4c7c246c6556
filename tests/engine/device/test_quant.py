"""Int4 weights: exact recovery of Q4_1 groups, the kernel choice by batch size, and the engine on
int4 against the same engine on bf16 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.device.quant as quant
from engine.device.platform import cpu_has_bf16
from engine.device.quant import Linear, padded_rows, quantize_int4
from engine.step import pack
from engine.types import GenerationRequest
from tests.engine.helpers import greedy, run_all, tiny_engine, tokens_of
from tests.tiny_model import make_tiny_model, snap_to_q4_1

CPU = torch.device("cpu")


def test_q4_1_weights_are_recovered_exactly() -> None:
    torch.manual_seed(0)
    weight = snap_to_q4_1(torch.randn(96, 128) * 0.05)
    q = quantize_int4(weight.to(torch.bfloat16), source=weight)
    assert q.max_abs_error < 1e-6
    x = torch.randn(3, 128).to(torch.bfloat16)
    got = quant.int4_mm(x, q).float()
    want = x.float() @ weight.t()
    # bf16 scale/zero and a bf16 output: rounding error only (relative 2^-8 of the output scale).
    assert (got - want).abs().max() <= 0.01 * want.abs().max()


def test_unsnapped_weights_are_quantized_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 64)
    q = quantize_int4(weight.to(torch.bfloat16), source=weight)
    groups = weight.view(64, 2, 32)
    half_step = ((groups.amax(-1) - groups.amin(-1)) / 30).max().item()
    assert 0 < q.max_abs_error <= half_step * 1.001


def test_linear_uses_int4_only_up_to_its_row_limit() -> None:
    torch.manual_seed(0)
    dense = torch.randn(32, 64).to(torch.bfloat16)
    other = snap_to_q4_1(torch.randn(32, 64))  # a different matrix, to tell the paths apart
    layer = Linear(dense, int4=quantize_int4(other.to(torch.bfloat16), source=other), int4_max_rows=4)
    small, large = torch.randn(4, 64).to(torch.bfloat16), torch.randn(5, 64).to(torch.bfloat16)
    assert torch.allclose(layer(small).float(), small.float() @ other.t(), atol=0.1, rtol=0.02)
    assert torch.equal(layer(large), F.linear(large, dense))


@pytest.fixture
def int4_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the int4 matmuls run (int4_calls["n"])."""
    calls = {"n": 0}
    real_mm = quant.int4_mm

    def counting_mm(x: torch.Tensor, w: quant.Int4Weight) -> torch.Tensor:
        calls["n"] += 1
        return real_mm(x, w)

    monkeypatch.setattr(quant, "int4_mm", counting_mm)
    return calls


def test_decode_logits_on_int4_match_bf16_on_q4_1_weights(
    tmp_path: Path, real_model_dir: Path, int4_calls: dict[str, int]
) -> None:
    model = make_tiny_model(
        tmp_path / "q4", real_model_dir, q4_1=True, hidden_size=128, intermediate_size=256
    )
    engine = tiny_engine(model, dtype="bfloat16", quantization="int4", int4_max_batch=2)
    for i, n in enumerate((7, 30)):
        engine.add_request(GenerationRequest(f"r{i}", list(range(200, 200 + n)), greedy(4)))
    engine.step()  # both prompts' prefill: 37 tokens, on the bf16 weights
    assert int4_calls["n"] == 0
    out = engine.scheduler.schedule()
    assert len(out.decodes) == 2
    batch = engine.runner.forward_batch(pack(out))
    layers = engine.runner.model.layers
    with torch.inference_mode():
        on_int4 = engine.runner.model.forward(batch, engine.runner.kv_caches)
        assert int4_calls["n"] == 4 * len(layers)  # qkv, o, gate_up, down of every layer
        for layer in layers:
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                linear.int4_max_rows = 0
        on_bf16 = engine.runner.model.forward(batch, engine.runner.kv_caches)
    assert int4_calls["n"] == 4 * len(layers)
    assert not torch.equal(on_int4, on_bf16)
    # Same weights, different kernels: bf16 rounding apart, and the same choice where it is clear.
    assert (on_int4 - on_bf16).abs().max() <= 0.02 * on_bf16.abs().max()
    top2 = on_bf16.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * on_bf16.abs().max()
    assert torch.equal(on_int4.argmax(-1)[clear], on_bf16.argmax(-1)[clear])


def test_prompts_are_prefilled_on_bf16_however_small_the_step(
    tmp_path: Path, real_model_dir: Path, int4_calls: dict[str, int]
) -> None:
    """int4 serves only steps that only decode: a prompt's logits must not depend on whether it was
    prefilled whole, in chunks, or after a cached prefix (int4 and bf16 differ at near-ties)."""
    model = make_tiny_model(
        tmp_path / "q4", real_model_dir, q4_1=True, hidden_size=128, intermediate_size=256
    )
    engine = tiny_engine(model, dtype="bfloat16", quantization="int4", int4_max_batch=8)
    per_step = 4 * len(engine.runner.model.layers)
    engine.add_request(GenerationRequest("a", [5, 6, 7], greedy(3)))
    engine.step()  # a 3-token prefill: small enough for int4, but a prefill
    assert int4_calls["n"] == 0
    engine.step()  # a's decode alone
    assert int4_calls["n"] == per_step
    engine.add_request(GenerationRequest("b", [5, 6, 7, 8], greedy(2)))
    engine.step()  # a's decode with b's prefill: 5 rows, still bf16
    assert int4_calls["n"] == per_step
    run_all(engine, [])
    assert int4_calls["n"] > per_step  # the later decode-only steps


def test_engine_on_int4_serves_and_frees_everything(tmp_path: Path, real_model_dir: Path) -> None:
    model = make_tiny_model(tmp_path / "q4", real_model_dir, q4_1=True)
    engine = tiny_engine(model, dtype="bfloat16", quantization="int4")
    requests = [
        GenerationRequest(f"r{i}", list(range(300, 300 + n)), greedy(12)) for i, n in enumerate((3, 9, 40))
    ]
    outputs = run_all(engine, requests)
    assert sorted(len(tokens_of(o)) for o in outputs.values()) == [12, 12, 12]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_weights_give_bit_identical_results(bias: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 64).to(torch.bfloat16)
    b = torch.randn(48).to(torch.bfloat16) if bias else None
    layer = Linear.build(weight, b)
    # oneDNN's packed bf16 layout exists only where the CPU has native bf16; elsewhere the plain
    # weight serves, with the same results.
    packs = cpu_has_bf16()
    assert (layer.packed is not None) == packs and (layer.weight is None) == packs
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, weight, b))


def test_packed_matmuls_run_at_a_bounded_set_of_row_counts() -> None:
    # oneDNN keeps memory for every row count a packed matmul has run (issue 15: RSS kept rising
    # as a served engine met new step sizes), so counts are padded onto a short ladder.
    counts = {padded_rows(m) for m in range(1, 513)}
    assert len(counts) <= 36
    for m in range(1, 513):
        step = 1 if m <= 8 else 8 if m <= 64 else 16 if m <= 256 else 32
        assert m <= padded_rows(m) < m + step and padded_rows(m) % step == 0
    torch.manual_seed(0)
    weight = torch.randn(48, 64).to(torch.bfloat16)
    b = torch.randn(48).to(torch.bfloat16)
    layer = Linear.build(weight, b)
    for rows in (9, 70, 300):  # off the ladder: padded, computed, cut back, bit-identical
        x = torch.randn(rows, 64).to(torch.bfloat16)
        y = layer(x, int4_ok=False)
        assert y.shape == (rows, 48) and torch.equal(y, F.linear(x, weight, b))


def test_float32_weights_stay_plain() -> None:
    weight = torch.randn(8, 32)
    layer = Linear.build(weight, int4_max_rows=8)
    assert layer.packed is None and layer.int4 is None and layer.weight is weight
