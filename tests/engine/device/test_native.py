"""The native CPU kernels against the torch ops they replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.device.native import native_kernels
from engine.resolve import resolve_kernels


def reference(q, k_cache, v_cache, tables, lens, scale, window=0, sinks=None):  # type: ignore[no-untyped-def]
    """Attention of each sequence's one query over its context (its last `window` positions when
    given), gathered token by token; `sinks` [H]: each head's sink logit joins its softmax."""
    num_kv, _, block_size, _ = k_cache.shape
    group = q.shape[1] // num_kv
    out = torch.empty_like(q, dtype=torch.float32)
    for s in range(q.shape[0]):
        n = int(lens[s])
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blocks = tables[s, pos // block_size]
        keys = k_cache[:, blocks, pos % block_size].float()  # [kv, ctx, hd]
        values = v_cache[:, blocks, pos % block_size].float()
        for h in range(q.shape[1]):
            scores = keys[h // group] @ q[s, h].float() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1]])
            out[s, h] = scores.softmax(-1)[: len(pos)] @ values[h // group]
    return out


def _paged_case(
    dtype: torch.dtype,
    num_heads: int,
    num_kv: int,
    head_dim: int,
    block_size: int = 4,
    sizes: tuple[int, ...] = (),
) -> tuple[torch.Tensor, ...]:
    """q, the caches, block tables and lengths: one token, exactly a block, ragged, longest (or
    `sizes`)."""
    torch.manual_seed(0)
    lens = torch.tensor(sizes or [1, 4, 5, 13, 30])
    num_blocks = max(40, 2 * sum(-(-n // block_size) for n in lens.tolist()))
    k_cache = torch.randn(num_kv, num_blocks, block_size, head_dim).to(dtype)
    v_cache = torch.randn(num_kv, num_blocks, block_size, head_dim).to(dtype)
    max_blocks = -(-int(lens.max()) // block_size)
    # Scattered, distinct blocks; padding past each sequence's blocks is block 0.
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    used = 0
    for s, n in enumerate(lens.tolist()):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv", "head_dim", "tol"),
    [
        (torch.float32, 4, 2, 16, 1e-5),
        (torch.float32, 9, 3, 64, 1e-5),  # SmolLM2's shape; the AVX2 fp32 path where the CPU has it
        (torch.float32, 8, 8, 32, 1e-5),
        (torch.float32, 8, 2, 128, 1e-5),
        (torch.float32, 16, 2, 64, 1e-5),  # a group of 8
        (torch.float32, 10, 2, 64, 1e-5),  # a group of 5: the portable kernel
        (torch.bfloat16, 9, 3, 64, 2e-2),  # SmolLM2's shape; the AVX512-BF16 path where the CPU has it
        (torch.bfloat16, 4, 4, 64, 2e-2),
        (torch.bfloat16, 8, 4, 64, 2e-2),
        (torch.bfloat16, 8, 2, 128, 2e-2),  # Llama-3's head_dim and group
        (torch.bfloat16, 10, 2, 64, 2e-2),  # a group of 5: the portable kernel
        (torch.bfloat16, 4, 2, 48, 2e-2),  # an unusual head_dim: the portable kernel
        (torch.float16, 8, 8, 32, 2e-3),
    ],
)
def test_kernel_matches_attention_over_the_gathered_context(
    dtype: torch.dtype, num_heads: int, num_kv: int, head_dim: int, tol: float
) -> None:
    op = native_kernels().paged_decode_attention
    q, k_cache, v_cache, tables, lens = _paged_case(dtype, num_heads, num_kv, head_dim)
    got = op(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert (got.float() - want).abs().max().item() <= tol


@pytest.mark.parametrize(("window", "with_sinks"), [(0, True), (3, False), (6, True), (13, False)])
@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv", "head_dim", "tol"),
    [
        (torch.float32, 4, 2, 16, 1e-5),  # the portable kernel
        (torch.float32, 9, 3, 64, 1e-5),  # the AVX2 fp32 path where the CPU has it
        (torch.bfloat16, 8, 2, 128, 2e-2),  # the AVX512-BF16 path where the CPU has it
        (torch.bfloat16, 10, 2, 64, 2e-2),  # the portable kernel
    ],
)
def test_kernel_attends_to_the_window_and_the_sinks(
    dtype: torch.dtype, num_heads: int, num_kv: int, head_dim: int, tol: float, window: int, with_sinks: bool
) -> None:
    """A banded layer's last `window` positions (a window that starts mid-block, and one longer than
    some contexts), and attention sinks in each softmax's denominator, on every kernel path."""
    op = native_kernels().paged_decode_attention
    q, k_cache, v_cache, tables, lens = _paged_case(dtype, num_heads, num_kv, head_dim)
    sinks = torch.randn(num_heads) * 2 if with_sinks else None
    got = op(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, sinks)
    want = reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, sinks)
    assert (got.float() - want).abs().max().item() <= tol


@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize(("num_heads", "num_kv", "head_dim"), [(9, 3, 64), (8, 2, 128), (10, 2, 64)])
def test_kernel_attends_over_whole_blocks_of_16_keys(
    num_heads: int, num_kv: int, head_dim: int, window: int
) -> None:
    """The engine's block size (16 keys): whole and partial blocks, with and without a window that
    starts mid-block, against the gathered reference, on each bf16 path."""
    op = native_kernels().paged_decode_attention
    case = _paged_case(torch.bfloat16, num_heads, num_kv, head_dim, block_size=16, sizes=(1, 16, 17, 40, 77))
    q, k_cache, v_cache, tables, lens = case
    got = op(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, None)
    want = reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window)
    assert (got.float() - want).abs().max().item() <= 2e-2


def test_kernel_refuses_out_of_range_blocks_and_lengths() -> None:
    op = native_kernels().paged_decode_attention
    k = torch.zeros(1, 4, 2, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(q, k, k, torch.tensor([[7]]), torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        op(q, k, k, torch.tensor([[0]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        op(q, k, k, torch.tensor([[0]]), torch.tensor([0]), 1.0)


def test_kernels_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernels("auto", cpu) is native_kernels()
    assert resolve_kernels("native", cpu) is native_kernels()
    assert resolve_kernels("torch", cpu) is None
    assert resolve_kernels("auto", cuda) is None
    with pytest.raises(ValueError, match="CPU-only"):
        resolve_kernels("native", cuda)


def test_auto_falls_back_to_torch_when_the_kernel_cannot_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.device.native as native

    def broken() -> None:
        raise RuntimeError("the native CPU kernels could not be built: no compiler")

    monkeypatch.setattr(native, "native_kernels", broken)
    assert resolve_kernels("auto", torch.device("cpu")) is None
    with pytest.raises(RuntimeError, match="no compiler"):
        resolve_kernels("native", torch.device("cpu"))


# ---- the fused elementwise kernels: the torch ops they replace, as in engine/device/models/decoder.py --

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return w * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's spacing at b's magnitude."""
    spacing = torch.finfo(b.dtype).eps * b.float().abs().clamp_min(1e-3)
    return ((a.float() - b.float()).abs() / spacing).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 96: several OpenMP chunks
def test_rms_norm_and_residual_add(dtype: torch.dtype, rows: int) -> None:
    k = native_kernels()
    torch.manual_seed(0)
    x, residual = torch.randn(rows, 96).to(dtype), torch.randn(rows, 96).to(dtype)
    w = (torch.rand(96) + 0.5).to(dtype)
    tol = 4 if dtype == torch.float32 else 1  # the sum of squares adds in another order
    assert ulps(k.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5)) <= tol
    summed = residual + x
    out = k.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, summed)  # updated in place, rounded as torch rounds
    assert ulps(out, torch_rms_norm(summed, w, 1e-5)) <= tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm_on_q_and_k_heads_only(dtype: torch.dtype) -> None:
    """Qwen3's and Gemma 3's q/k norms: each of the first H + KV heads of a qkv row normalized
    over its head_dim and scaled by its own weight row, in place; v untouched."""
    torch.manual_seed(0)
    t, h, kv, d = 5, 4, 2, 32
    qkv = torch.randn(t, (h + 2 * kv) * d).to(dtype)
    w = (torch.rand(h + kv, d) + 0.5).to(dtype)
    heads = qkv.view(t, h + 2 * kv, d)
    want = torch_rms_norm(heads[:, : h + kv].reshape(-1, d), w.repeat(t, 1), 1e-6).view(t, h + kv, d)
    want_v = heads[:, h + kv :].clone()
    native_kernels().head_rms_norm_(qkv, w, d, 1e-6)
    assert ulps(heads[:, : h + kv], want) <= (4 if dtype == torch.float32 else 1)
    assert torch.equal(heads[:, h + kv :], want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_q_and_k_only(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t, h, kv, d = 6, 4, 2, 16
    qkv = torch.randn(t, (h + 2 * kv) * d).to(dtype)
    angles = torch.rand(50, d // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    positions = torch.tensor([0, 3, 49, 7, 7, 1])
    heads = qkv.view(t, h + 2 * kv, d)
    want_qk = torch_rope(heads[:, : h + kv], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    want_v = heads[:, h + kv :].clone()
    native_kernels().rope_(qkv, positions, cos, sin, h + kv, d)
    assert torch.equal(heads[:, : h + kv], want_qk)
    assert torch.equal(heads[:, h + kv :], want_v)
    with pytest.raises(RuntimeError, match="position out of range"):
        native_kernels().rope_(qkv, torch.tensor([0, 0, 0, 0, 0, 50]), cos, sin, h + kv, d)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_write_kv_matches_index_copy(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Rows of the cache's dtype are copied; float32 rows into a bf16 cache round as torch's `.to`."""
    kernels = native_kernels()
    torch.manual_seed(0)
    num_kv, num_blocks, block_size, head_dim, tokens = 3, 10, 4, 16, 7
    qkv = torch.randn(tokens, (2 + 2 * num_kv) * head_dim).to(dtype)
    qkv[0, :4] = torch.tensor([float("nan"), float("inf"), 1 + 2**-8, 1 + 3 * 2**-8])  # ties to even
    heads = qkv.view(tokens, 2 + 2 * num_kv, head_dim)
    k, v = heads[:, 2 : 2 + num_kv], heads[:, 2 + num_kv :]  # strided views, as the model passes
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    caches = [torch.randn(num_kv, num_blocks, block_size, head_dim).to(cache_dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    want[0].view(num_kv, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1).to(cache_dtype))
    want[1].view(num_kv, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1).to(cache_dtype))
    kernels.write_kv_(caches[0], caches[1], k, v, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.write_kv_(caches[0], caches[1], k, v, slots + num_blocks * block_size)
    if dtype != cache_dtype:  # the other way round is refused
        with pytest.raises(RuntimeError, match="bf16 under float32"):
            kernels.write_kv_(caches[0].float(), caches[1].float(), k.bfloat16(), v.bfloat16(), slots)


@pytest.mark.parametrize(("num_heads", "num_kv", "head_dim"), [(9, 3, 64), (10, 2, 64), (4, 2, 48)])
def test_a_bf16_cache_under_float32_queries_is_read_widened(
    num_heads: int, num_kv: int, head_dim: int
) -> None:
    """The fast path (SmolLM2's shape) and the portable kernel (a group of 5, head_dim 48) give
    exactly what they give over the same cache widened to float32, and a float32 output."""
    op = native_kernels().paged_decode_attention
    torch.manual_seed(1)
    k_cache = torch.randn(num_kv, 12, 4, head_dim).bfloat16()
    v_cache = torch.randn(num_kv, 12, 4, head_dim).bfloat16()
    tables, lens = torch.randperm(12)[:9].view(3, 3), torch.tensor([1, 7, 12])
    q = torch.randn(3, num_heads, head_dim)
    got = op(q, k_cache, v_cache, tables, lens, 0.125)
    assert got.dtype == torch.float32
    assert torch.equal(got, op(q, k_cache.float(), v_cache.float(), tables, lens, 0.125))
    with pytest.raises(RuntimeError, match="bf16 under float32"):
        op(q.bfloat16(), k_cache.float(), v_cache.float(), tables, lens, 0.125)


@pytest.mark.parametrize(("rows", "n"), [(1, 48), (5, 1536), (32, 1536), (100, 64)])
def test_silu_mul_rounds_as_the_torch_ops(rows: int, n: int) -> None:
    if not native_kernels().has_fast_silu_mul():
        pytest.skip("the fused SiLU-and-multiply needs AVX512-BF16; the model uses the torch ops")
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * n) * 4).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # exp's range ends
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = native_kernels().silu_mul(gate_up)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # exp differs from torch's by an ulp of fp32 at most: a bf16 rounding flips only rarely.
    differ = got != want
    assert differ.float().mean().item() < 1e-3
    assert torch.allclose(got.float()[differ], want.float()[differ], rtol=1e-2)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 23, 49152])
def test_argmax_rows_is_torch_s_argmax(n: int) -> None:
    """The first index of the largest value, NaN counting as the largest, as torch.argmax."""
    torch.manual_seed(n)
    x = torch.randn(9, n)
    x[1] = float("-inf")  # a row fully masked: index 0
    x[2] = x[2].round()  # ties: the first of them
    x[3, -1] = float("nan")
    x[4, n // 2] = float("nan")
    x[5, : n // 2] = float("-inf")
    x[6] = 0.0
    x[7, -1] = float("inf")
    x[8, n // 3 :] = float("nan")
    assert torch.equal(native_kernels().argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(native_kernels().argmax_rows(x[:, :n]), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        native_kernels().argmax_rows(x.bfloat16())


def test_a_build_killed_mid_way_does_not_hang_the_next_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch leaves its `lock` file behind when a build is killed, and its next load waits for that
    file forever. A copy of this process's build with such a lock in it loads in a fresh process."""
    import os
    import shutil
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    from engine.device.native import build_name

    native_kernels()  # this process's build exists
    name = build_name()
    copy = tmp_path / "ext" / Path(_get_build_directory(name, verbose=False)).parent.name / name
    shutil.copytree(_get_build_directory(name, verbose=False), copy)
    (copy / "lock").touch()  # what a killed build leaves
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext" / copy.parent.name))
    probe = "from engine.device.native import native_kernels; print(native_kernels().has_qmatmul is not None)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    assert not (copy / "lock").exists()


def test_the_cache_entry_changes_with_a_header_the_sources_include(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A kernel's shared header (engine/device/csrc/simd_avx2.h) is part of what names the build, so an
    edited header is rebuilt rather than an old build loaded."""
    from engine.device import native

    header = tmp_path / "shared.h"
    header.write_text("inline int one() { return 1; }\n")
    monkeypatch.setattr(native, "CSRC", tmp_path)
    monkeypatch.setattr(native, "sources", lambda: [])
    before = native.build_name()
    header.write_text("inline int one() { return 2; }\n")
    assert native.build_name() != before
