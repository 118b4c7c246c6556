"""The decoder forward pass of every family (engine/device/models/registry.py) over a paged KV cache.

It reads a checkpoint in the canonical names (Llama's; each family's module converts its own), and
the model's `ModelSpec` for what differs between families: per-head q/k norms, Gemma's norms
around attention and the MLP, GELU-tanh, scaled embeddings, a softmax scale, a window and a rope
table per layer, attention sinks, experts in place of the MLP, a final logit softcap.

One call runs a packed batch: the decode tokens of running sequences first, then prefill chunks.
K/V of every new token are written into the paged cache first; attention then reads each
sequence's context back through its slots (engine/device/models/attention.py), so a prefill
chunk that continues an earlier one sees the earlier chunk's K/V exactly like a decode token does.

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     (D decode tokens, then prefill chunks)
    slots:   flat index into a layer's cache viewed as [kv_heads, num_blocks * block_size, head_dim]

A layer's cache is [kv_heads, num_blocks, block_size, head_dim], KV head outermost, so gathering a
decode batch's blocks with one `index_select` yields [kv_heads, D, context, head_dim]: the layout the
batched attention matmuls read directly, with no per-token gather and no transposing copy (much
faster than gathering [tokens, kv_heads, head_dim] rows by slot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.config import WeightFormat
from engine.device.lora_weights import LoraWeights
from engine.device.models.attention import AttentionShape, DecodeGather, PagedDecode, attend
from engine.device.models.moe import Experts, GroupedLinear
from engine.device.models.rope import rope_tables
from engine.device.ops import tensor_op, tensor_pair_op
from engine.device.quant import Linear
from engine.lora import LoraAdapter
from engine.model_spec import ModelSpec
from engine.step import ForwardBatch

if TYPE_CHECKING:
    from engine.device.parallel import TensorParallel


def _no_lora(y: torch.Tensor, x: torch.Tensor, layer: int, linear: str, batch: ForwardBatch) -> torch.Tensor:
    return y


@dataclass
class Mlp:
    gate_up: Linear  # gate and up projections fused
    down: Linear


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k, v projections fused
    o: Linear
    post_norm: torch.Tensor  # the norm before the MLP (Gemma's pre_feedforward_layernorm)
    mlp: Mlp | Experts
    attention: AttentionShape
    rope: int  # which cos/sin tables: 0 the model's, 1 the banded layers' own (Gemma 3)
    qk_norm: torch.Tensor | None = None  # [H + KV, head_dim]: each query head's row, then each key head's
    attn_out_norm: torch.Tensor | None = None  # Gemma: after attention, before the residual add
    mlp_out_norm: torch.Tensor | None = None  # Gemma: after the MLP, before the residual add

    # The dense MLP's linears, where the one-call decode and LoRA read them.
    @property
    def gate_up(self) -> Linear:
        assert isinstance(self.mlp, Mlp)
        return self.mlp.gate_up

    @property
    def down(self) -> Linear:
        assert isinstance(self.mlp, Mlp)
        return self.mlp.down


class DecoderModel:
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
        paged_decode: PagedDecode | None = None,
        max_loras: int = 0,
    ) -> None:
        """`weights`: in the canonical names (engine/device/models/registry.py's `canonical_weights`),
        cast to `dtype` (default: theirs). `weight_format` (engine/device/quant.py): the projections,
        experts and LM head quantized from the weights as given (pass float32 for exact recovery of
        a GGUF's groups). `kernels`: the native CPU kernels (engine/device/native.py), or None for
        plain torch ops. `tp`: this rank's share of a tensor-parallel replica, with `spec` and
        `weights` already this rank's shard (engine/device/parallel.py); o_proj and the MLP's down
        projections then all-reduce their partial sums (with the LoRA deltas: an adapter is sharded
        like the layers, `TensorParallel.shard_lora`). `paged_decode`: a decode-attention kernel that
        reads the paged cache through the block table (the Triton one on CUDA,
        engine/device/triton_attention.py), where `kernels` does not bring one. `max_loras`: the
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
            and spec.hidden_act == "silu"
        )

        def linear(names: list[str]) -> Linear:
            source = (
                torch.cat([w[n + ".weight"] for n in names]) if len(names) > 1 else w[names[0] + ".weight"]
            )
            biases = [w.get(n + ".bias") for n in names]
            b = None
            if any(x is not None for x in biases):
                b = torch.cat(
                    [
                        x if x is not None else source.new_zeros(w[n + ".weight"].shape[0])
                        for x, n in zip(biases, names, strict=True)
                    ]
                ).to(dtype)
            if fmt.layers is not None:
                return Linear.build(source, b, quant=fmt.layers)
            return Linear.build(source.to(dtype).contiguous(), b, fmt.int4_max_rows, source)

        self.embed = w["model.embed_tokens.weight"].to(dtype)
        self.embed_scale = (
            None if spec.embed_scale == 1.0 else torch.tensor(spec.embed_scale, dtype=torch.float32).to(dtype)
        )
        lm_head = self.embed if spec.tie_word_embeddings else w.get("lm_head.weight", self.embed).to(dtype)
        self.lm_head = (
            Linear.build(lm_head, quant=fmt.head) if fmt.head is not None else Linear.build(lm_head)
        )
        self.norm = w["model.norm.weight"].to(dtype)
        self.layers: list[Layer] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            window = spec.windows[i]
            sinks = w.get(attn + "sinks")
            qk_norm = None
            if spec.qk_norm:
                q_w, k_w = w[attn + "q_norm.weight"].to(dtype), w[attn + "k_norm.weight"].to(dtype)
                qk_norm = torch.cat(
                    [q_w.expand(spec.num_heads, -1), k_w.expand(spec.num_kv_heads, -1)]
                ).contiguous()
            mlp: Mlp | Experts
            if spec.is_sparse(i):
                mlp = _experts(spec, w, p, dtype, fmt.layers)
            else:
                mlp = Mlp(
                    gate_up=linear([p + "mlp.gate_proj", p + "mlp.up_proj"]),
                    down=linear([p + "mlp.down_proj"]),
                )
            sandwich = spec.sandwich_norms
            self.layers.append(
                Layer(
                    input_norm=w[p + "input_layernorm.weight"].to(dtype),
                    qkv=linear([attn + f"{n}_proj" for n in "qkv"]),
                    o=linear([attn + "o_proj"]),
                    post_norm=w[
                        p
                        + ("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")
                        + ".weight"
                    ].to(dtype),
                    mlp=mlp,
                    attention=AttentionShape(
                        spec.num_heads,
                        spec.num_kv_heads,
                        spec.head_dim,
                        spec.scale,
                        window,
                        None if sinks is None else sinks.float().contiguous(),
                    ),
                    rope=1 if window and spec.local_rope_theta is not None else 0,
                    qk_norm=qk_norm,
                    attn_out_norm=w[p + "post_attention_layernorm.weight"].to(dtype) if sandwich else None,
                    mlp_out_norm=w[p + "post_feedforward_layernorm.weight"].to(dtype) if sandwich else None,
                )
            )
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        rotary = spec.rotary
        tables = [
            rope_tables(
                spec.rope_theta,
                rotary,
                spec.rope_scaling,
                max_positions,
                spec.max_position_embeddings,
                self.dtype,
                self.device,
            )
        ]
        if spec.local_rope_theta is not None:
            tables.append(
                rope_tables(
                    spec.local_rope_theta,
                    rotary,
                    spec.local_rope_scaling,
                    max_positions,
                    spec.max_position_embeddings,
                    self.dtype,
                    self.device,
                )
            )
        self.rope_tables = tables
        self.cos, self.sin = tables[0]  # [max_positions, rotary_dim]
        self.scale = spec.scale
        # The LoRA slots' weights, stacked per layer and linear (engine/lora.py); None: no slots.
        # Over quantized layers (lossy already) they are held in bfloat16: half the bytes a step
        # reads; float weights (the exact mode PEFT parity is tested in) keep the model's dtype.
        compact = fmt.layers is not None
        self.lora = (
            LoraWeights(spec, max_loras, self.dtype, self.device, kernels, compact) if max_loras else None
        )
        self.decode_weights = self._native_decode_weights()

    def _native_decode_weights(self) -> tuple[list[torch.Tensor], list[int], list[int], float] | None:
        """The layers' weights for the one-call decode op (engine/device/csrc/decode_layers.cpp): a
        Llama-shaped model (full rope, no q/k norms, Gemma norms, sinks or experts, SiLU) with every
        projection on our quantized kernels, without a bias, on one rank; else None."""
        spec = self.spec
        plain = (
            not (
                spec.qk_norm
                or spec.sandwich_norms
                or spec.attention_sinks
                or spec.moe
                or spec.rotary != spec.head_dim
            )
            and spec.hidden_act == "silu"
            and len(self.rope_tables) == 1
        )
        if (
            not plain
            or self.kernels is None
            or self.tp is not None
            or not hasattr(self.kernels, "decode_layers")
        ):
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
            return tensor_op(self.kernels.rms_norm, x.contiguous(), weight, self.spec.rms_norm_eps)
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

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_silu_mul:
            return tensor_op(self.kernels.silu_mul, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.spec.hidden_act == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    def _qkv_heads(
        self, qkv: torch.Tensor, positions: torch.Tensor, layer: Layer
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed where the layer norms them, rotated) and v as [T, heads, head_dim] views or
        tensors."""
        spec = self.spec
        t, h, kv, d = qkv.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        cos, sin = self.rope_tables[layer.rope]
        if self.kernels is not None:
            if layer.qk_norm is not None:
                self.kernels.head_rms_norm_(qkv, layer.qk_norm, d, spec.rms_norm_eps)
            if spec.rotary == d:
                self.kernels.rope_(qkv, positions, cos, sin, h + kv, d)
                heads = qkv.view(t, h + 2 * kv, d)
                return heads[:, :h], heads[:, h : h + kv], heads[:, h + kv :]
        elif layer.qk_norm is not None:
            heads = qkv.view(t, h + 2 * kv, d)
            heads[:, : h + kv] = self._rms_norm(heads[:, : h + kv], layer.qk_norm)
        cos_t = cos[positions].unsqueeze(1)  # [T, 1, rotary_dim]
        sin_t = sin[positions].unsqueeze(1)
        q = self._rope(qkv[:, : h * d].view(t, h, d), cos_t, sin_t)
        k = self._rope(qkv[:, h * d : (h + kv) * d].view(t, kv, d), cos_t, sin_t)
        return q, k, qkv[:, (h + kv) * d :].view(t, kv, d)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope over the first rotary_dim (cos's width) dimensions of each head, the rest as they are."""
        dim = cos.shape[-1]
        rot, rest = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
        half = dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated * sin
        return out if rest is None else torch.cat([out, rest], dim=-1)

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
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
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
        logits = (logits if self.tp is None else self.tp.gather_logits(logits)).float()
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layers(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: Callable[[torch.Tensor, torch.Tensor, int, str, ForwardBatch], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the batch; (hidden, residual) after the last."""
        gathered = None if self.paged_decode is not None else DecodeGather.of(batch, kv_caches[0][0].shape[2])
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
            q, k, v = self._qkv_heads(qkv, batch.positions, layer)
            self._write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
            attn = attend(q, k, v, k_cache, v_cache, batch, layer.attention, gathered, self.paged_decode)
            o = self._row_sum(lora(layer.o(attn, int4_ok), attn, i, "o", batch))
            if layer.attn_out_norm is not None:
                o = self._rms_norm(o, layer.attn_out_norm)
            x, residual = self._add_rms_norm(o, residual, layer.post_norm)
            if isinstance(layer.mlp, Experts):
                hidden = self._row_sum(layer.mlp(x))
            else:
                gate_up = lora(layer.mlp.gate_up(x, int4_ok), x, i, "gate_up", batch)
                act = self._act_mul(gate_up)
                hidden = self._row_sum(lora(layer.mlp.down(act, int4_ok), act, i, "down", batch))
            if layer.mlp_out_norm is not None:
                hidden = self._rms_norm(hidden, layer.mlp_out_norm)
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
            list(spec.windows),
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


def _experts(
    spec: ModelSpec, w: dict[str, torch.Tensor], p: str, dtype: torch.dtype, quant: str | None
) -> Experts:
    """Layer `p`'s experts and router; their tensors are taken out of `w` as they are fused (a 30B
    model's experts are then never in memory twice)."""
    assert spec.moe is not None
    ex = p + "mlp.experts."
    gate_up = torch.cat([w.pop(ex + "gate_proj.weight"), w.pop(ex + "up_proj.weight")], dim=1)
    gate_up_bias = None
    if ex + "gate_proj.bias" in w:
        gate_up_bias = torch.cat([w.pop(ex + "gate_proj.bias"), w.pop(ex + "up_proj.bias")], dim=1)
    router_bias = w.get(p + "mlp.router.bias")
    return Experts(
        spec.moe,
        router=w[p + "mlp.router.weight"].to(dtype),
        router_bias=None if router_bias is None else router_bias.to(dtype),
        gate_up=GroupedLinear.build(gate_up, gate_up_bias, dtype, quant),
        down=GroupedLinear.build(
            w.pop(ex + "down_proj.weight"), w.pop(ex + "down_proj.bias", None), dtype, quant
        ),
    )


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
