"""Gemma 3 checkpoints: `gemma3_text`, and the text part of `gemma3` (its language model's tensors,
under `language_model.model.` as the Hub has them or `model.language_model.` as transformers 5
holds them; the vision tower and projector are left out). Gemma's RMSNorm scales by (1 + w): the
norms are stored here as 1 + w (in float32, as transformers adds them), so the model's norms are
Llama's. The rest (interleaved banded layers and a rope base per layer type, scaled embeddings,
GELU-tanh, q/k norms, the softmax scale) is the config's (engine/model_spec.py)."""

from __future__ import annotations

from engine.device.models.checkpoint import Weights
from engine.model_spec import ModelSpec

_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.", ""),
)


def canonical(spec: ModelSpec, weights: Weights) -> Weights:
    if spec.model_type == "gemma3":
        text: Weights = {}
        for name, tensor in weights.items():
            for old, new in _PREFIXES:
                if name.startswith(old):
                    text[new + name.removeprefix(old)] = tensor
                    break
        weights.clear()
        weights |= text
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + tensor.float()).to(tensor.dtype)
    return weights
