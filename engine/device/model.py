"""Our Llama-family forward pass (Llama / SmolLM2, Qwen2, Mistral shapes) over a paged KV cache.

One call runs a packed batch: the decode tokens of running sequences first, then prefill chunks.
K/V of every new token are written into the paged cache first; attention then reads each
sequence's whole context back through its slots, so a prefill chunk that continues an earlier one
sees the earlier chunk's K/V exactly like a decode token does.

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     (D decode tokens, then prefill chunks)
    slots:   flat index into a layer's cache viewed as [kv_heads, num_blocks * block_size, head_dim]

A layer's cache is [kv_heads, num_blocks, block_size, head_dim], KV head outermost, so gathering a
decode batch's blocks with one `index_select` yields [kv_heads, D, context, head_dim]: the layout the
batched attention matmuls read directly, with no per-token gather and no transposing copy (much
faster than gathering [tokens, kv_heads, head_dim] rows by slot).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.config import WeightFormat
from engine.device.lora_weights import LoraWeights
from engine.device.ops import tensor_op, tensor_pair_op
from engine.device.quant import Linear
from engine.lora import LoraAdapter
from engine.model_spec import ModelSpec
from engine.step import ForwardBatch

if TYPE_CHECKING:
    from engine.device.parallel import TensorParallel


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


def _no_lora(y: torch.Tensor, x: torch.Tensor, layer: int, linear: str, batch: ForwardBatch) -> torch.Tensor:
    return y


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k, v projections fused
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up projections fused
    down: Linear


class LlamaModel:
    """Weights plus the forward pass. Weights are fused (QKV, gate/up) at construction."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        dtype: torch.dtype | None = None,
        weight_format: WeightFormat | None = None,
        kernels: Any = None,
        tp: TensorParallel | None = None,
        paged_decode: Callable[..., torch.Tensor] | None = None,
        max_loras: int = 0,
    ) -> None:
        """`weights` are cast to `dtype` (default: theirs). `weight_format` (engine/device/quant.py): the
        projections and LM head quantized from the weights as given (pass float32 for exact
        recovery of a GGUF's groups).
        `kernels`: the native CPU kernels (engine/device/native.py), or None for plain torch ops. `tp`: this
        rank's share of a tensor-parallel replica, with `spec` and `weights` already this rank's shard
        (engine/device/parallel.py); o_proj and down_proj then all-reduce their partial sums (with the
        LoRA deltas: an adapter is sharded like the layers, `TensorParallel.shard_lora`). `paged_decode`:
        a decode-attention kernel that reads the paged cache through the block table (the Triton one
        on CUDA, engine/device/triton_attention.py), where `kernels` does not bring one. `max_loras`: the
        LoRA slots a batch may mix (engine/lora.py), filled by `set_lora_slot`."""
        self.spec = spec
        self.kernels = kernels
        self.tp = tp
        self.paged_decode = kernels.paged_decode_attention if kernels is not None else paged_decode
        w = weights
        fmt = weight_format or WeightFormat()
        dtype = dtype or w["model.embed_tokens.weight"].dtype
        # The native SiLU-and-multiply exists where the CPU has AVX512-BF16, for bf16 only.
        self.fused_silu_mul = (
            kernels is not None
            and dtype == torch.bfloat16
            and bool(kernels.has_fast_silu_mul())
            and spec.intermediate_size % 16 == 0
        )

        def linear(names: list[str], bias: bool = False) -> Linear:
            source = (
                torch.cat([w[n + ".weight"] for n in names]) if len(names) > 1 else w[names[0] + ".weight"]
            )
            b = torch.cat([w[n + ".bias"] for n in names]).to(dtype) if bias else None
            if fmt.layers is not None:
                return Linear.build(source, b, quant=fmt.layers)
            return Linear.build(source.to(dtype).contiguous(), b, fmt.int4_max_rows, source)

        self.embed = w["model.embed_tokens.weight"].to(dtype)
        lm_head = self.embed if spec.tie_word_embeddings else w.get("lm_head.weight", self.embed).to(dtype)
        self.lm_head = (
            Linear.build(lm_head, quant=fmt.head) if fmt.head is not None else Linear.build(lm_head)
        )
        self.norm = w["model.norm.weight"].to(dtype)
        self.layers: list[Layer] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
            self.layers.append(
                Layer(
                    input_norm=w[p + "input_layernorm.weight"].to(dtype),
                    qkv=linear(attn, bias=spec.attention_bias and attn[0] + ".bias" in w),
                    o=linear([p + "self_attn.o_proj"]),
                    post_norm=w[p + "post_attention_layernorm.weight"].to(dtype),
                    gate_up=linear([p + "mlp.gate_proj", p + "mlp.up_proj"]),
                    down=linear([p + "mlp.down_proj"]),
                )
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
        # The LoRA slots' weights, stacked per layer and linear (engine/lora.py); None: no slots.
        # Over quantized layers (lossy already) they are held in bfloat16: half the bytes a step
        # reads; float weights (the exact mode PEFT parity is tested in) keep the model's dtype.
        compact = fmt.layers is not None
        self.lora = (
            LoraWeights(spec, max_loras, self.dtype, self.device, kernels, compact) if max_loras else None
        )
        self.decode_weights = self._native_decode_weights()

    def _native_decode_weights(self) -> tuple[list[torch.Tensor], list[int], list[int], float] | None:
        """The layers' weights for the one-call decode op (engine/device/csrc/decode_layers.cpp): every
        projection on our quantized kernels, without a bias, on one rank; else None."""
        if self.kernels is None or self.tp is not None or not hasattr(self.kernels, "decode_layers"):
            return None
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        sizes: list[int] = []
        ratios: set[float] = set()
        for layer in self.layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            quants = [lin.quant for lin in linears if lin.quant is not None and lin.bias is None]
            if len(quants) != len(linears):
                return None
            kinds += [0 if q.kind == "q4" else 1 for q in quants]
            sizes += [q.n for q in quants]
            ratios.update(lin.outlier_ratio for lin in linears)
        if len(ratios) != 1:
            return None
        order = [[layer.qkv, layer.o, layer.gate_up, layer.down] for layer in self.layers]
        _contiguous([lin for chain in order for lin in chain] + [self.lm_head])
        for layer, chain in zip(self.layers, order, strict=True):
            qkv, o, gate_up, down = (lin.quant.packed for lin in chain if lin.quant is not None)
            weights += [layer.input_norm, qkv, o, layer.post_norm, gate_up, down]
        return weights, kinds, sizes, ratios.pop()

    def set_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put `adapter`'s weights into `slot` (None empties it; on a tensor-parallel rank, its
        shard of them); between steps only."""
        assert self.lora is not None
        self.lora.install(
            slot, adapter if adapter is None or self.tp is None else self.tp.shard_lora(adapter)
        )

    def _row_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output (o_proj, down_proj): on a tensor-parallel rank its
        partial sum, LoRA deltas included, all-reduced over the ranks."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _add_lora(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, linear: str, batch: ForwardBatch
    ) -> torch.Tensor:
        """y (the base matmul's output for all rows) plus each row's adapter delta, in place: the
        decode rows of every slot in one batched shrink and expand, each run of prefill rows of
        one slot in one shrink and expand (engine/device/lora_weights.py's LoraStack)."""
        assert self.lora is not None
        stack = self.lora.layers[layer][linear]
        if stack.rank == 0:
            return y
        if batch.lora_decode is not None:
            stack.add_decode(y, x, batch.lora_decode)
        for slot, rows in batch.lora_groups:
            stack.add_rows(y, x, slot, rows)
        return y

    # ---- the elementwise parts: native fused kernels, or the torch ops they replace ----------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return tensor_op(self.kernels.rms_norm, x, weight, self.spec.rms_norm_eps)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(var + self.spec.rms_norm_eps)).to(x.dtype)

    def _add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual add fused into the next norm."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, residual, weight, self.spec.rms_norm_eps), residual
        residual = residual + x
        return self._rms_norm(residual, weight), residual

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_silu_mul:
            return tensor_op(self.kernels.silu_mul, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rope_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v as [T, heads, head_dim] views or tensors."""
        spec = self.spec
        t, h, kv, d = qkv.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        if self.kernels is not None:
            self.kernels.rope_(qkv, positions, self.cos, self.sin, h + kv, d)
            heads = qkv.view(t, h + 2 * kv, d)
            return heads[:, :h], heads[:, h : h + kv], heads[:, h + kv :]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        q = self._rope(qkv[:, : h * d].view(t, h, d), cos, sin)
        k = self._rope(qkv[:, h * d : (h + kv) * d].view(t, kv, d), cos, sin)
        return q, k, qkv[:, (h + kv) * d :].view(t, kv, d)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    # ---- the forward pass ---------------------------------------------------------------------

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run the batch, writing its K/V into `kv_caches`; return float32 logits [S, vocab]."""
        hidden = (
            F.embedding(batch.input_ids, self.embed)
            if self.tp is None
            else self.tp.embed(batch.input_ids, self.embed)
        )
        lora = self._add_lora if batch.lora_groups or batch.lora_decode is not None else _no_lora
        one_call = lora is _no_lora or self.lora is not None and self.lora.native
        # A short prefill (no adapter on its rows) runs in the one call too, each token as a decode
        # row: no Python layer loop, and the same logits bit for bit however the prompt is chunked
        # or how much of it the prefix cache held. Past a bound on the attention work, SDPA's
        # blocked kernel reads a long context once where per-row attention reads it per token.
        small_prefill = batch.token_tables is not None  # built only within the bound (engine/step.py)
        if self.decode_weights is not None and one_call and (not batch.prefills or small_prefill):
            hidden, residual = self._decode_layers(hidden, batch, kv_caches, self.decode_weights)
        else:
            hidden, residual = self._layers(hidden, batch, kv_caches, lora)
        rows = batch.logits_indices
        last, _ = self._add_rms_norm(hidden.index_select(0, rows), residual.index_select(0, rows), self.norm)
        logits = self.lm_head(last)
        return (logits if self.tp is None else self.tp.gather_logits(logits)).float()

    def _layers(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: Callable[[torch.Tensor, torch.Tensor, int, str, ForwardBatch], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the batch; (hidden, residual) after the last."""
        gathered = (
            None
            if self.paged_decode is not None
            else self._decode_gather_plan(batch, kv_caches[0][0].shape[2])
        )
        # int4 weights only for steps that only decode: every prompt is prefilled on the same bf16
        # weights however it is chunked or however much of it the prefix cache held, so a
        # (greedy) request's answer does not depend on that. (The int4 copy holds the file's exact
        # Q4_1 values, the bf16 one rounds them: near-ties of the two can differ.)
        int4_ok = not batch.prefills
        residual: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if residual is None:
                residual = hidden
                x = self._rms_norm(hidden, layer.input_norm)
            else:
                x, residual = self._add_rms_norm(hidden, residual, layer.input_norm)
            qkv = lora(layer.qkv(x, int4_ok), x, i, "qkv", batch)
            q, k, v = self._rope_qkv(qkv, batch.positions)
            self._write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
            attn = self._attention(q, k, v, k_cache, v_cache, batch, gathered)
            o = self._row_sum(lora(layer.o(attn, int4_ok), attn, i, "o", batch))
            x, residual = self._add_rms_norm(o, residual, layer.post_norm)
            gate_up = lora(layer.gate_up(x, int4_ok), x, i, "gate_up", batch)
            act = self._silu_mul(gate_up)
            hidden = self._row_sum(lora(layer.down(act, int4_ok), act, i, "down", batch))
        assert residual is not None
        return hidden, residual

    def _decode_layers(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        weights: tuple[list[torch.Tensor], list[int], list[int], float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_layers` in one native call, for a step that only decodes (the same ops, bit for bit, the
        decode rows' LoRA deltas included) or whose prefill tokens run as decode rows."""
        tables, lens = (
            (batch.token_tables, batch.token_lens)
            if batch.prefills
            else (batch.decode_tables, batch.decode_lens)
        )
        assert tables is not None and lens is not None
        spec = self.spec
        tensors, kinds, sizes, outlier_ratio = weights
        plan = batch.lora_decode
        lora: list[Any] = [[], [], [], None, 0]  # no adapter rows
        if plan is not None:
            assert self.lora is not None
            lora = [*self.lora.decode_args(), plan.slot, plan.lo]
        return tensor_pair_op(
            self.kernels.decode_layers,
            hidden,
            tensors,
            kinds,
            sizes,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            batch.positions,
            batch.slot_mapping,
            tables,
            lens,
            self.cos,
            self.sin,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            self.scale,
            spec.rms_norm_eps,
            outlier_ratio,
            *lora,
        )

    def _write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Each new token's K/V [T, kv_heads, head_dim] into its slot of every KV head (rounded to
        the cache's dtype where it is narrower, engine/device/kv_cache.py)."""
        if self.kernels is not None:
            self.kernels.write_kv_(k_cache, v_cache, k, v, slots)
            return
        num_kv, head_dim = self.spec.num_kv_heads, self.spec.head_dim
        k_cache.view(num_kv, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.view(num_kv, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))

    @staticmethod
    def _decode_gather_plan(batch: ForwardBatch, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For the torch decode path: the blocks to gather, flat [D * B], and the additive mask
        [1, D, 1, B * block_size] (0 on context, -inf on padding), built once per forward."""
        if not batch.num_decode:
            return None
        assert batch.decode_tables is not None and batch.decode_lens is not None
        d, width = batch.decode_tables.shape[0], batch.decode_tables.shape[1] * block_size
        pad = torch.arange(width, device=batch.decode_lens.device).unsqueeze(
            0
        ) >= batch.decode_lens.unsqueeze(1)
        bias = torch.zeros(pad.shape, dtype=torch.float32, device=pad.device).masked_fill_(pad, float("-inf"))
        return batch.decode_tables.reshape(-1), bias.view(1, d, 1, width)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        gathered: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        spec = self.spec
        num_heads, num_kv, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        group = num_heads // num_kv
        out = torch.empty_like(q)
        d = batch.num_decode
        if d and self.paged_decode is not None:
            assert batch.decode_tables is not None and batch.decode_lens is not None
            out[:d] = self.paged_decode(
                q[:d], k_cache, v_cache, batch.decode_tables, batch.decode_lens, self.scale
            )
        elif d:
            assert gathered is not None
            blocks, bias = gathered
            ctx = bias.shape[-1]
            by_block = (num_kv, k_cache.shape[1], -1)
            keys = k_cache.view(by_block).index_select(1, blocks).view(num_kv, d, ctx, head_dim).to(q.dtype)
            values = v_cache.view(by_block).index_select(1, blocks).view(num_kv, d, ctx, head_dim).to(q.dtype)
            qg = q[:d].view(d, num_kv, group, head_dim).transpose(0, 1)  # [kv, D, g, hd]
            scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [kv, D, g, L]
            scores = scores.mul_(self.scale).add_(bias)
            probs = scores.softmax(dim=-1).to(q.dtype)
            out[:d] = torch.matmul(probs, values).transpose(0, 1).reshape(d, num_heads, head_dim)
        k_flat = k_cache.view(num_kv, -1, head_dim)
        v_flat = v_cache.view(num_kv, -1, head_dim)
        for p in batch.prefills:
            q_len, ctx = p.end - p.start, p.slots.shape[0]
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
            if ctx == q_len:
                # No earlier context: the chunk's own K/V are all there is, no need to read the cache
                # (rounded as the cache holds them, so a chunked prefill attends to the same values).
                keys = k[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, kv, q, hd]
                values = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                if k_cache.dtype != q.dtype:
                    keys, values = keys.to(k_cache.dtype).to(q.dtype), values.to(v_cache.dtype).to(q.dtype)
                o = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
            else:
                keys = k_flat.index_select(1, p.slots).unsqueeze(0).to(q.dtype)  # [1, kv, ctx, hd]
                values = v_flat.index_select(1, p.slots).unsqueeze(0).to(q.dtype)
                # Query i (absolute position ctx - q_len + i) sees context slots j <= that position.
                rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx - q_len)
                mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
                o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], num_heads * head_dim)


def _contiguous(linears: list[Linear]) -> None:
    """Move the quantized weights of `linears` (those with one) into one buffer, in this order:
    the order a decode step reads them, so the kernels' prefetches and the hardware's run on from
    one weight into the next (docs/BENCHMARKS.md)."""
    quants = [(lin, lin.quant) for lin in linears if lin.quant is not None]
    buffer = torch.empty(sum(q.packed.numel() for _, q in quants), dtype=torch.uint8)
    offset = 0
    for lin, q in quants:
        view = buffer[offset : offset + q.packed.numel()].view(q.packed.shape)
        view.copy_(q.packed)
        lin.quant = replace(q, packed=view)
        offset += q.packed.numel()
