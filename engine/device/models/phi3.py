"""Phi-3 and Phi-4 checkpoints (`phi3`): q, k and v in one `qkv_proj`, gate and up in one
`gate_up_proj`, cut apart here (so tensor parallelism and LoRA see Llama's names; the model fuses
them again). Partial rotary (Phi-4-mini) and longrope are the config's (engine/model_spec.py)."""

from __future__ import annotations

from engine.device.models.checkpoint import Weights
from engine.model_spec import ModelSpec


def canonical(spec: ModelSpec, weights: Weights) -> Weights:
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for i in range(spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            qkv = weights.pop(f"{attn}qkv_proj.{kind}", None)
            if qkv is not None:
                q, k, v = qkv[:q_rows], qkv[q_rows : q_rows + kv_rows], qkv[q_rows + kv_rows :]
                weights |= {f"{attn}q_proj.{kind}": q, f"{attn}k_proj.{kind}": k, f"{attn}v_proj.{kind}": v}
        gate, up = weights.pop(f"{mlp}gate_up_proj.weight").chunk(2)
        weights |= {f"{mlp}gate_proj.weight": gate, f"{mlp}up_proj.weight": up}
    return weights
