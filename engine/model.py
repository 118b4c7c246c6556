"""Our Llama-family forward pass (Llama / SmolLM2, Qwen2, Mistral shapes) over a paged KV cache.

One call runs a packed batch: the decode tokens of running sequences first, then prefill chunks.
K/V of every new token are written into the paged cache first; attention then reads each
sequence's whole context back through its slots, so a prefill chunk that continues an earlier one
sees the earlier chunk's K/V exactly like a decode token does.

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     (D decode tokens, then prefill chunks)
    slots:   flat index into a layer's cache viewed as [num_blocks * block_size, kv_heads, head_dim]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.loader import ModelSpec


@dataclass
class PrefillSlice:
    """One sequence's prefill chunk: tokens [start, end) of the packed batch, attending to `slots`."""

    start: int
    end: int
    slots: torch.Tensor  # [context_len] slots of the whole context, the chunk's own tokens last


@dataclass
class ForwardBatch:
    """Everything one forward pass needs; built by the runner, read-only here."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode: int  # the first D tokens are single decode tokens
    decode_slots: torch.Tensor | None  # [D, L] context slots per decode sequence (padded)
    decode_pad: torch.Tensor | None  # [D, 1, 1, L] True where a slot is padding, not context
    prefills: list[PrefillSlice]
    logits_indices: torch.Tensor  # [S] token rows whose next-token logits are wanted


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies, with the config's rope scaling (default, linear, llama3)."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"unsupported rope scaling type {kind!r}: expected default, linear or llama3")


class LlamaModel:
    """Weights plus the forward pass. Weights are fused (QKV, gate/up) at construction."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int) -> None:
        self.spec = spec
        w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if spec.tie_word_embeddings else w.get("lm_head.weight", self.embed)
        self.norm = w["model.norm.weight"]
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            qkv_bias = None
            if spec.attention_bias and p + "self_attn.q_proj.bias" in w:
                qkv_bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            self.layers.append(
                {
                    "input_norm": w[p + "input_layernorm.weight"],
                    "qkv": qkv.contiguous(),
                    "qkv_bias": qkv_bias,
                    "o": w[p + "self_attn.o_proj.weight"],
                    "post_norm": w[p + "post_attention_layernorm.weight"],
                    "gate_up": torch.cat(
                        [w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]
                    ).contiguous(),
                    "down": w[p + "mlp.down_proj.weight"],
                }
            )
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        inv_freq = rope_inv_freq(spec).to(self.device)
        t = torch.arange(max_positions, dtype=torch.float32, device=self.device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.dtype)  # [max_positions, head_dim]
        self.sin = emb.sin().to(self.dtype)
        self.scale = spec.head_dim**-0.5

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(var + self.spec.rms_norm_eps)).to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run the batch, writing its K/V into `kv_caches`; return float32 logits [S, vocab]."""
        spec = self.spec
        num_heads, num_kv, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = num_heads * head_dim, num_kv * head_dim
        hidden = F.embedding(batch.input_ids, self.embed)
        cos = self.cos[batch.positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin[batch.positions].unsqueeze(1)
        num_tokens = hidden.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            residual = hidden
            x = self._rms_norm(hidden, layer["input_norm"])  # type: ignore[arg-type]
            qkv = F.linear(x, layer["qkv"], layer["qkv_bias"])  # type: ignore[arg-type]
            q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv, head_dim)
            v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv, head_dim)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            k_flat = k_cache.view(-1, num_kv, head_dim)
            v_flat = v_cache.view(-1, num_kv, head_dim)
            k_flat.index_copy_(0, batch.slot_mapping, k)
            v_flat.index_copy_(0, batch.slot_mapping, v)
            attn = self._attention(q, k, v, k_flat, v_flat, batch)
            hidden = residual + F.linear(attn, layer["o"])  # type: ignore[arg-type]
            residual = hidden
            x = self._rms_norm(hidden, layer["post_norm"])  # type: ignore[arg-type]
            gate_up = F.linear(x, layer["gate_up"])  # type: ignore[arg-type]
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = residual + F.linear(F.silu(gate) * up, layer["down"])  # type: ignore[arg-type]
        last = hidden.index_select(0, batch.logits_indices)
        last = self._rms_norm(last, self.norm)
        return F.linear(last, self.lm_head).float()

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        spec = self.spec
        num_heads, num_kv, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        group = num_heads // num_kv
        out = torch.empty_like(q)
        d = batch.num_decode
        if d:
            assert batch.decode_slots is not None and batch.decode_pad is not None
            ctx = batch.decode_slots.shape[1]
            keys = k_flat[batch.decode_slots].view(d, ctx, num_kv, head_dim).transpose(1, 2)  # [D, kv, L, hd]
            values = v_flat[batch.decode_slots].view(d, ctx, num_kv, head_dim).transpose(1, 2)
            qg = q[:d].view(d, num_kv, group, head_dim)
            scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale  # [D, kv, g, L]
            scores.masked_fill_(batch.decode_pad, float("-inf"))
            probs = scores.softmax(dim=-1).to(q.dtype)
            out[:d] = torch.matmul(probs, values).reshape(d, num_heads, head_dim)
        for p in batch.prefills:
            q_len, ctx = p.end - p.start, p.slots.shape[0]
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
            if ctx == q_len:
                # No earlier context: the chunk's own K/V are all there is, no need to read the cache.
                keys = k[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, kv, q, hd]
                values = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
            else:
                keys = k_flat[p.slots].transpose(0, 1).unsqueeze(0)  # [1, kv, ctx, hd]
                values = v_flat[p.slots].transpose(0, 1).unsqueeze(0)
                # Query i (absolute position ctx - q_len + i) sees context slots j <= that position.
                rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx - q_len)
                mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
                o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], num_heads * head_dim)
