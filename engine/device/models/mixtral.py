"""Mixtral checkpoints: Mistral's attention, and in each layer a `block_sparse_moe` of experts
w1 (gate), w3 (up), w2 (down) under a `gate` router (softmax over all experts, then the top k,
renormalized: engine/model_spec.py's routing)."""

from __future__ import annotations

from engine.device.models.checkpoint import Weights, rename, stack_experts
from engine.model_spec import ModelSpec


def canonical(spec: ModelSpec, weights: Weights) -> Weights:
    assert spec.moe is not None
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        rename(weights, p + "block_sparse_moe.gate.weight", p + "mlp.router.weight")
        names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        stack_experts(weights, p + "block_sparse_moe.experts.", spec.moe.num_experts, names)
        for ours in names.values():
            rename(weights, p + f"block_sparse_moe.experts.{ours}.weight", p + f"mlp.experts.{ours}.weight")
    return weights
