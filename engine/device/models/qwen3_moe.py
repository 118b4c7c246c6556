"""Qwen3-MoE checkpoints: Qwen3's attention (q/k norms), and in each sparse layer experts
`mlp.experts.{e}.{gate,up,down}_proj` under a `mlp.gate` router (softmax over all experts, the top
k, renormalized when `norm_topk_prob`); `mlp_only_layers` keep a dense MLP."""

from __future__ import annotations

from engine.device.models.checkpoint import Weights, rename, stack_experts
from engine.model_spec import ModelSpec


def canonical(spec: ModelSpec, weights: Weights) -> Weights:
    assert spec.moe is not None
    for i in range(spec.num_layers):
        if not spec.is_sparse(i):
            continue
        p = f"model.layers.{i}.mlp."
        rename(weights, p + "gate.weight", p + "router.weight")
        names = {n: n for n in ("gate_proj", "up_proj", "down_proj")}
        stack_experts(weights, p + "experts.", spec.moe.num_experts, names)
    return weights
