"""Llama-family checkpoints: Llama 2/3.x and SmolLM2, Mistral, Qwen2/2.5 and Qwen3 (q/k norms).
Their names are the canonical ones (engine/device/models/checkpoint.py); what differs among them
is in their configs (engine/model_spec.py: biases, windows, q/k norms)."""

from __future__ import annotations

from engine.device.models.checkpoint import Weights
from engine.model_spec import ModelSpec


def canonical(spec: ModelSpec, weights: Weights) -> Weights:
    return weights
