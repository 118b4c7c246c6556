"""Paged decode attention for CUDA as a Triton kernel: read straight from the block table.

One program per (decode sequence, KV head) computes the attention of all the query heads that
share that KV head (GQA), walking the sequence's context BLOCK_N tokens at a time with an online
softmax (running max and sum in fp32), so no [D, context] gather is ever written. A banded layer
(window W > 0) walks only the last W positions; attention sinks (a logit per query head, gpt-oss)
join the softmax's running sum at the end, with no value:

    token p of sequence s  ->  block tables[s, p // block_size], offset p % block_size
    K[p] of KV head h      ->  k_cache[h, block, offset, :]   (cache [kv_heads, blocks, block, head_dim])

Every shape the loop depends on (the context length) is read from device memory, so the kernel
is safe to capture in a CUDA graph (engine/device/cuda_graphs.py). The torch path in
engine/device/models/attention.py is the reference; tests/engine/device/test_cuda_path.py checks one
against the other, on CUDA and in Triton's interpreter on the CPU (TRITON_INTERPRET=1).

Triton is optional (it comes with CUDA builds of torch): `available()` says whether it is installed
without importing it, and the runner imports this module only on CUDA.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, cast

import torch


def available() -> bool:
    """Whether Triton is installed (the kernel itself needs a CUDA device, or TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


if available():
    import triton
    import triton.language as tl

    # triton ships no types: its decorator typed here once (a kernel is launched as kernel[grid](...)).
    jit = cast(Callable[[Callable[..., None]], Any], triton.jit)

    # Triton reads a kernel's annotations itself (tl.constexpr, pointer dtypes), so the tensor
    # arguments stay unannotated for mypy.
    @jit
    def _paged_decode_kernel(  # type: ignore[no-untyped-def]
        q_ptr,  # [D, H, head_dim]
        k_ptr,  # [KV, num_blocks, block_size, head_dim], contiguous
        v_ptr,
        tables_ptr,  # [D, max_blocks] block ids
        lens_ptr,  # [D] context lengths, the new token included
        out_ptr,  # [D, H, head_dim]
        sinks_ptr,  # [H] float32 (read only with HAS_SINKS)
        scale,
        window,  # 0: the whole context
        stride_q_seq,
        stride_q_head,
        stride_tables,
        stride_kv_head,
        stride_out_seq,
        stride_out_head,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        length = tl.load(lens_ptr + seq)
        first = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # the first position attended
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        head_base = kv_head.to(tl.int64) * stride_kv_head
        for start in range((first // BLOCK_N) * BLOCK_N, length, BLOCK_N):
            pos = start + n
            valid = (pos >= first) & (pos < length)
            block = tl.load(tables_ptr + seq * stride_tables + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            offsets = head_base + slot[:, None] * HEAD_DIM + d[None, :]
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [G, N]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m_i = m_new
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.exp(sink - m_new)
            acc = acc * alpha[:, None]
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of decode queries q [D, H, head_dim] over their paged context: [D, H, head_dim].

    `k_cache`/`v_cache` [KV, num_blocks, block_size, head_dim] (contiguous), `block_tables`
    [D, >= ceil(max(lens) / block_size)] block ids, `lens` [D] context lengths (>= 1), `window`
    the positions a banded layer attends to (0: all), `sinks` [H] float32 sink logits or None.
    Same contract as the native CPU kernel (engine/device/native.py) and the torch path
    (engine/device/models/attention.py).
    """
    assert available(), "triton is not installed"
    num_seqs, num_heads, head_dim = q.shape
    num_kv, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    # tl.dot wants every dimension >= 16: pad the query group and the head dim with masked lanes.
    grid: Any = (num_seqs, num_kv)
    _paged_decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        lens,
        out,
        lens if sinks is None else sinks,  # any pointer: not read without sinks
        scale,
        window,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=_pow2_at_least(group, 16),
        BLOCK_D=_pow2_at_least(head_dim, 16),
        BLOCK_N=max(64, _pow2_at_least(block_size, 16)),
        # fp32 is the exact reference dtype: full-precision products, not tf32's 10-bit mantissas.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SINKS=sinks is not None,
    )
    return out
