"""What the family modules share to read a checkpoint into the canonical names: the names
themselves, experts stacked, prefixes taken off.

The canonical names are Llama's (what engine/device/models/decoder.py, tensor parallelism and LoRA
read), plus what other families add:

    model.embed_tokens.weight  model.norm.weight  lm_head.weight (absent: tied)
    model.layers.{i}.input_layernorm.weight  .post_attention_layernorm.weight
    model.layers.{i}.pre_feedforward_layernorm.weight  .post_feedforward_layernorm.weight  (Gemma 3)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}  .{q,k}_norm.weight  .sinks
    model.layers.{i}.mlp.{gate,up,down}_proj.weight                       a dense MLP
    model.layers.{i}.mlp.router.{weight,bias}                             experts: [E, H], [E]
    model.layers.{i}.mlp.experts.{gate,up,down}_proj.{weight,bias}        [E, out, in], [E, out]
"""

from __future__ import annotations

import torch

Weights = dict[str, torch.Tensor]


def stack_experts(weights: Weights, layer: str, num_experts: int, names: dict[str, str]) -> None:
    """Replace per-expert tensors `{layer}{e}.{theirs}.weight` (e = 0..num_experts-1) by one stacked
    `{layer[:-len("experts.")]}experts.{ours}.weight` [E, out, in] per `names` (theirs -> ours),
    taking each out of `weights` as it goes (one layer's experts in memory twice at most). Weights
    already stacked (built in memory, bench/gpu_check.py) are left as they are."""
    base = layer.removesuffix("experts.")
    for theirs, ours in names.items():
        if f"{layer}0.{theirs}.weight" not in weights:
            continue
        parts = [weights.pop(f"{layer}{e}.{theirs}.weight") for e in range(num_experts)]
        weights[f"{base}experts.{ours}.weight"] = torch.stack(parts)


def rename(weights: Weights, old: str, new: str) -> None:
    if old in weights:
        weights[new] = weights.pop(old)
