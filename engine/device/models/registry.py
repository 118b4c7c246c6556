"""The model registry: each family's module (engine/model_spec.py's MODEL_TYPES says which family
serves which model_type, and refuses any other) reads its checkpoint into the canonical names
(engine/device/models/checkpoint.py) that the one decoder runs (engine/device/models/decoder.py)."""

from __future__ import annotations

from collections.abc import Callable

from engine.device.models import gemma3, gpt_oss, llama, mixtral, phi3, qwen3_moe
from engine.device.models.checkpoint import Weights
from engine.model_spec import MODEL_TYPES, ModelSpec

FAMILIES: dict[str, Callable[[ModelSpec, Weights], Weights]] = {
    "llama": llama.canonical,
    "gemma3": gemma3.canonical,
    "phi3": phi3.canonical,
    "mixtral": mixtral.canonical,
    "qwen3_moe": qwen3_moe.canonical,
    "gpt_oss": gpt_oss.canonical,
}
assert set(FAMILIES) == set(MODEL_TYPES.values()), "a family without a module, or a module without a family"


def canonical_weights(spec: ModelSpec, weights: Weights) -> Weights:
    """`weights` (a checkpoint of `spec`'s family, consumed) in the canonical names."""
    return FAMILIES[spec.family](spec, weights)
