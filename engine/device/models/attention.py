"""Attention over the paged KV cache, for every layer kind: full or banded (a sliding window of W
tokens, the query's own included), with or without attention sinks (gpt-oss: a learned logit per
query head that joins the softmax's denominator and adds no value).

Decode rows go to a paged kernel when the model has one (the native CPU kernel or the Triton one:
both take the window and the sinks) or else through a gather of their blocks; prefill chunks read
their context back through its slots and run SDPA (with a window, over only the keys the window
can reach) or, with sinks, the same softmax written out. Every block stays in the cache, so a
banded layer's mask by position is right in decode, in a chunk that continues an earlier one,
after a prefix-cache hit and after a preemption's recompute alike:

    query at position p of a banded layer sees keys at positions (p - W, p]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.step import ForwardBatch

PagedDecode = Callable[..., torch.Tensor]  # (q, k_cache, v_cache, tables, lens, scale, window, sinks)


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention: its heads, softmax scale, window (0: none) and sinks ([H] float32)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int = 0
    sinks: torch.Tensor | None = None


@dataclass
class DecodeGather:
    """The torch decode path's plan for one forward: the decode rows' blocks, flat [D * B], and the
    additive mask [1, D, 1, B * block_size] (0 on context, -inf on padding), with a banded
    layer's own (also -inf before its window) built once per window."""

    blocks: torch.Tensor
    bias: torch.Tensor
    lens: torch.Tensor
    _banded: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: ForwardBatch, block_size: int) -> DecodeGather | None:
        if not batch.num_decode:
            return None
        assert batch.decode_tables is not None and batch.decode_lens is not None
        d, width = batch.decode_tables.shape[0], batch.decode_tables.shape[1] * block_size
        pad = torch.arange(width, device=batch.decode_lens.device).unsqueeze(
            0
        ) >= batch.decode_lens.unsqueeze(1)
        bias = torch.zeros(pad.shape, dtype=torch.float32, device=pad.device).masked_fill_(pad, float("-inf"))
        return cls(batch.decode_tables.reshape(-1), bias.view(1, d, 1, width), batch.decode_lens)

    def bias_for(self, window: int) -> torch.Tensor:
        if not window:
            return self.bias
        if window not in self._banded:
            width = self.bias.shape[-1]
            early = torch.arange(width, device=self.lens.device).unsqueeze(0) < (
                self.lens - window
            ).unsqueeze(1)
            self._banded[window] = self.bias.masked_fill(early.view(self.bias.shape), float("-inf"))
        return self._banded[window]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    shape: AttentionShape,
    gathered: DecodeGather | None,
    paged_decode: PagedDecode | None,
) -> torch.Tensor:
    """Attention output [T, H * head_dim] of the batch's queries q [T, H, head_dim]; k, v [T, KV,
    head_dim] are the new tokens' (already written to the caches)."""
    num_heads, num_kv, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    out = torch.empty_like(q)
    d = batch.num_decode
    if d and paged_decode is not None:
        assert batch.decode_tables is not None and batch.decode_lens is not None
        out[:d] = paged_decode(
            q[:d],
            k_cache,
            v_cache,
            batch.decode_tables,
            batch.decode_lens,
            shape.scale,
            shape.window,
            shape.sinks,
        )
    elif d:
        assert gathered is not None
        out[:d] = _gathered_decode(q[:d], k_cache, v_cache, gathered, shape)
    k_flat = k_cache.view(num_kv, -1, head_dim)
    v_flat = v_cache.view(num_kv, -1, head_dim)
    for p in batch.prefills:
        q_len, ctx = p.end - p.start, p.slots.shape[0]
        first = ctx - q_len  # the chunk's first query's position
        lo = max(0, first - shape.window + 1) if shape.window else 0  # the first key any query sees
        qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
        if ctx == q_len:
            # No earlier context: the chunk's own K/V are all there is, no need to read the cache
            # (rounded as the cache holds them, so a chunked prefill attends to the same values).
            keys = k[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, kv, q, hd]
            values = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if k_cache.dtype != q.dtype:
                keys, values = keys.to(k_cache.dtype).to(q.dtype), values.to(v_cache.dtype).to(q.dtype)
        else:
            slots = p.slots[lo:]
            keys = k_flat.index_select(1, slots).unsqueeze(0).to(q.dtype)  # [1, kv, ctx - lo, hd]
            values = v_flat.index_select(1, slots).unsqueeze(0).to(q.dtype)
        mask = None
        if ctx > q_len or (shape.window and q_len > shape.window):
            # Query i (position first + i) sees keys at positions j in (first + i - W, first + i].
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + first
            cols = torch.arange(lo, ctx, device=q.device).unsqueeze(0)
            mask = cols <= rows
            if shape.window:
                mask &= cols > rows - shape.window
        if shape.sinks is not None:
            o = _explicit_attention(qs, keys, values, mask, shape)
        elif mask is None:
            o = F.scaled_dot_product_attention(
                qs, keys, values, is_causal=True, scale=shape.scale, enable_gqa=True
            )
        else:
            o = F.scaled_dot_product_attention(
                qs, keys, values, attn_mask=mask, scale=shape.scale, enable_gqa=True
            )
        out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
    return out.view(q.shape[0], num_heads * head_dim)


def _gathered_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gathered: DecodeGather,
    shape: AttentionShape,
) -> torch.Tensor:
    """Decode rows q [D, H, hd] over their gathered blocks, in the torch ops (the reference)."""
    num_heads, num_kv, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    d, group = q.shape[0], num_heads // num_kv
    bias = gathered.bias_for(shape.window)
    ctx = bias.shape[-1]
    by_block = (num_kv, k_cache.shape[1], -1)
    keys = k_cache.view(by_block).index_select(1, gathered.blocks).view(num_kv, d, ctx, head_dim).to(q.dtype)
    values = (
        v_cache.view(by_block).index_select(1, gathered.blocks).view(num_kv, d, ctx, head_dim).to(q.dtype)
    )
    qg = q.view(d, num_kv, group, head_dim).transpose(0, 1)  # [kv, D, g, hd]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [kv, D, g, L]
    scores = scores.mul_(shape.scale).add_(bias)
    if shape.sinks is not None:
        sinks = shape.sinks.view(num_kv, 1, group, 1).expand(num_kv, d, group, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(d, num_heads, head_dim)


def _explicit_attention(
    qs: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    shape: AttentionShape,
) -> torch.Tensor:
    """SDPA written out, with the sinks in each softmax (as transformers' eager gpt-oss attention):
    qs [1, H, q, hd], keys/values [1, KV, n, hd], mask [q, n] (True: seen) or None (causal)."""
    group = shape.num_heads // shape.num_kv_heads
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(qs, keys.transpose(-1, -2)) * shape.scale  # [1, H, q, n]
    if mask is None:
        q_len = qs.shape[2]
        mask = torch.ones(q_len, q_len, dtype=torch.bool, device=qs.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if shape.sinks is not None:
        sinks = shape.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(1, shape.num_heads, scores.shape[2], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = scores.softmax(dim=-1)
    if shape.sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)
