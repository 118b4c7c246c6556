"""The CUDA decode path: the Triton paged-attention kernel against the torch reference, and decode
steps replayed from CUDA graphs against the same steps run eagerly.

The `cuda` tests run only where CUDA is (bench/gpu_check.py runs them on a GPU machine; CI has no
GPU, and tests/conftest.py skips them there, saying so). The kernel is also checked on the CPU in
Triton's interpreter, where triton is installed. Self-contained: a bare GPU image runs this file
without the suite's conftest, so nothing here needs its fixtures.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.device.cuda_graphs import batch_buckets
from engine.device.loader import LoadedModel
from engine.device.worker import EngineWorker, build_runner
from engine.llm_engine import LLMEngine
from engine.model_spec import ModelSpec
from engine.resolve import resolve
from engine.step import StepInputs
from engine.types import SamplingParams

REPO = Path(__file__).resolve().parents[3]

# (query heads, KV heads, head_dim, block_size, context lengths): GQA groups of 1, 2 and 3 (the
# bundled model's, not a power of two), contexts of one token and ones spanning several tiles.
CASES = [
    (4, 4, 16, 4, [1, 7, 30]),
    (4, 2, 64, 16, [5, 64, 65, 150]),
    (9, 3, 64, 16, [1, 17, 200]),
]
# (case, window, sinks): banded layers whose window starts mid-block and mid-tile (and one longer
# than some contexts), attention sinks alone and with a window (gpt-oss's layers).
BANDED = [(CASES[0], 6, False), (CASES[1], 70, True), (CASES[2], 0, True), (CASES[2], 33, False)]


def reference_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The definition, one sequence and head at a time, in float64: each query over its context's
    last `window` positions (0: all), with `sinks` [H] (each head's logit in its softmax) or none."""
    num_kv, _, block_size, head_dim = k_cache.shape
    group = q.shape[1] // num_kv
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, length in enumerate(lens.tolist()):
        pos = torch.arange(max(0, length - window) if window else 0, length)
        slots = (tables[s].cpu()[pos // block_size] * block_size + pos % block_size).to(k_cache.device)
        keys = k_cache.reshape(num_kv, -1, head_dim)[:, slots].double().cpu()
        values = v_cache.reshape(num_kv, -1, head_dim)[:, slots].double().cpu()
        for h in range(q.shape[1]):
            scores = keys[h // group] @ q[s, h].double().cpu() * head_dim**-0.5
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double().cpu()])
            out[s, h] = scores.softmax(-1)[: len(pos)] @ values[h // group]
    return out


def _sinks(case: tuple[int, int, int, int, list[int]], device: str) -> torch.Tensor:
    return (torch.randn(case[0], generator=torch.Generator().manual_seed(2)) * 2).to(device)


def _case_tensors(
    case: tuple[int, int, int, int, list[int]], dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, ...]:
    heads, num_kv, head_dim, block_size, lengths = case
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    k_cache = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen).to(device, dtype)
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lengths]).to(device)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(device, dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, device=device)


def check_in_interpreter() -> None:
    """Every case through the kernel in Triton's interpreter, plain and banded or with sinks; run in
    a process started with TRITON_INTERPRET=1 (triton reads it when it is first imported)."""
    from engine.device.triton_attention import paged_decode_attention

    for case, window, with_sinks in [(case, 0, False) for case in CASES] + BANDED:
        q, k_cache, v_cache, tables, lens = _case_tensors(case, torch.float32, "cpu")
        sinks = _sinks(case, "cpu") if with_sinks else None
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, q.shape[-1] ** -0.5, window, sinks)
        expected = reference_decode_attention(q, k_cache, v_cache, tables, lens, window, sinks)
        torch.testing.assert_close(
            out.double(), expected, atol=1e-5, rtol=1e-5, msg=lambda m, c=(case, window): f"{c}: {m}"
        )


def test_triton_kernel_matches_the_reference_in_the_interpreter() -> None:
    # Looked up, not imported: triton's bindings report "leaked" objects at the exit of any process
    # that imported it, and this one is pytest's.
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (it comes with CUDA builds of torch)")
    done = subprocess.run(
        [sys.executable, "-c", "from tests.engine.device.test_cuda_path import check_in_interpreter; "
         "check_in_interpreter()"],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["mha-bs4", "gqa2", "gqa3"])
def test_triton_kernel_matches_the_reference_on_cuda(case: Any, dtype: torch.dtype) -> None:
    from engine.device.triton_attention import paged_decode_attention

    q, k_cache, v_cache, tables, lens = _case_tensors(case, dtype, "cuda")
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, q.shape[-1] ** -0.5)
    expected = reference_decode_attention(q, k_cache, v_cache, tables, lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("case", "window", "with_sinks"), BANDED, ids=["w6", "w70-sinks", "sinks", "w33"])
def test_triton_kernel_attends_to_the_window_and_sinks_on_cuda(
    case: Any, window: int, with_sinks: bool, dtype: torch.dtype
) -> None:
    from engine.device.triton_attention import paged_decode_attention

    q, k_cache, v_cache, tables, lens = _case_tensors(case, dtype, "cuda")
    sinks = _sinks(case, "cuda") if with_sinks else None
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, q.shape[-1] ** -0.5, window, sinks)
    expected = reference_decode_attention(q, k_cache, v_cache, tables, lens, window, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)


def test_decode_batch_buckets_cover_every_size_up_to_max_num_seqs() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(1) == [1]
    for max_num_seqs in (1, 3, 12, 64):
        buckets = batch_buckets(max_num_seqs)
        assert all(any(b >= d for b in buckets) for d in range(1, max_num_seqs + 1))


# ---- a small random model on CUDA -----------------------------------------------------------------

SPEC = ModelSpec.from_config(
    dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
    )
)


class _NoText:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def _random_model(dtype: torch.dtype, device: str) -> LoadedModel:
    """Wide random weights (std 0.2): greedy choices are not near-ties."""
    gen = torch.Generator().manual_seed(0)
    h, d, i = SPEC.hidden_size, SPEC.head_dim, SPEC.intermediate_size
    shapes = {"model.embed_tokens.weight": (SPEC.vocab_size, h), "lm_head.weight": (SPEC.vocab_size, h)}
    for layer in range(SPEC.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (SPEC.num_heads * d, h),
            p + "self_attn.k_proj.weight": (SPEC.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (SPEC.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, SPEC.num_heads * d),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    weights = {n: (torch.randn(s, generator=gen) * 0.2).to(device, dtype) for n, s in shapes.items()}
    ones = ["model.norm.weight"] + [
        f"model.layers.{n}.{kind}.weight"
        for n in range(SPEC.num_layers)
        for kind in ("input_layernorm", "post_attention_layernorm")
    ]
    weights |= {n: torch.ones(h, dtype=dtype, device=device) for n in ones}
    return LoadedModel(Path("."), "random", SPEC, {}, _NoText(), weights)


def _config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(
        device="cuda",
        dtype="float32",
        block_size=16,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=16,
        max_model_len=512,
        quantization="none",
    )
    return EngineConfig.of(**(settings | overrides))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_graph_replay_equals_the_eager_step(dtype: torch.dtype) -> None:
    resolved = resolve(_config(dtype=str(dtype).removeprefix("torch.")), in_memory_model=True)
    runner = build_runner(resolved, _random_model(dtype, "cuda"), 64, torch.device("cuda"), 512)
    assert runner.graphs is not None and runner.attention_backend == "triton"
    gen = torch.Generator().manual_seed(1)
    for k_cache, v_cache in runner.kv_caches:  # a context already in the cache
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen).to(k_cache))
        v_cache.copy_(torch.randn(v_cache.shape, generator=gen).to(v_cache))
    # 5 sequences (the bucket of 8, padded) with contexts of 1..70 tokens in scattered blocks.
    positions = [0, 15, 16, 40, 69]
    tables = [
        [b * 7 % 60, (b * 7 + 1) % 60, (b * 7 + 2) % 60, (b * 7 + 3) % 60, b + 60 - 5] for b in range(5)
    ]
    inputs = StepInputs(
        input_ids=[11, 22, 33, 44, 55],
        positions=positions,
        block_tables=tables,
        num_decode=5,
        prefill_ranges=[],
        logits_rows=list(range(5)),
    )
    assert runner.graphs.can_run(inputs)
    with torch.inference_mode():
        replayed = runner.graphs.run(inputs).clone()
        eager = runner.model.forward(runner.forward_batch(inputs), runner.kv_caches)
    assert runner.graphs.num_replays == 1
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(replayed, eager, atol=tol, rtol=tol)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


@pytest.mark.cuda
def test_the_cuda_engine_answers_as_the_torch_path() -> None:
    """Greedy fp32 outputs of the engine on CUDA with the Triton kernel and CUDA graphs equal the
    plain torch path's (`kernels="torch"`: eager steps, gathered attention)."""
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 17, 40, 100)]
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = []
    for kernels in ("auto", "torch"):
        config = _config(kernels=kernels)
        resolved = resolve(config, in_memory_model=True)
        engine = LLMEngine(config, worker=EngineWorker.start(resolved, _random_model(torch.float32, "cuda")))
        outputs.append(engine.generate(prompts, sampling))
        graphs = engine.runner.graphs
        assert (graphs is not None and graphs.num_replays > 0) == (kernels == "auto")
    assert outputs[0] == outputs[1]
