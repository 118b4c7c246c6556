"""The architecture facts the forward pass needs, read from a model's Hugging Face config.

Plain data, no torch: the LoRA loader checks adapters against it, the engine reads the vocabulary
and the end-of-sequence ids from it, the gateway may read a model's family from it without loading
anything, and the device side (engine/device/models/) builds the model by it. Each supported
`model_type` belongs to a family (`MODEL_TYPES`); what a family's config says differently is read
here (its windows, norms, rope, experts), what its checkpoint says differently is its module in
engine/device/models/. Any other `model_type` is refused at once (`UnsupportedModelError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

# model_type -> the family that serves it (engine/device/models/registry.py: one module each).
MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "gpt_oss": "gpt_oss",
}


class UnsupportedModelError(ValueError):
    """A config whose `model_type` (or a feature of it) the engine cannot serve; the message is one
    line naming it and what is supported."""


def supported_model_types() -> str:
    return ", ".join(MODEL_TYPES)


def model_family(cfg: dict[str, Any]) -> str:
    """The family serving a config's `model_type` (engine/device/models/), or UnsupportedModelError."""
    model_type = str(cfg.get("model_type", "llama"))
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}: batchgate serves {supported_model_types()}"
        )
    return MODEL_TYPES[model_type]


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP: each token's `top_k` of `num_experts` experts, weighted.

    `routing`: "softmax_topk" (softmax over all experts, then the top k, renormalized when
    `normalize`: Mixtral, Qwen3-MoE) or "topk_softmax" (the top k logits, then their softmax:
    gpt-oss). `sparse_layers[i]`: whether layer i has experts (others a dense MLP of the model's
    `intermediate_size`). `swiglu_limit`/`swiglu_alpha`: gpt-oss's clamped SwiGLU, (up + 1) *
    gate * sigmoid(alpha * gate), instead of silu(gate) * up."""

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str
    normalize: bool
    sparse_layers: tuple[bool, ...]
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the forward pass needs, read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    family: str = "llama"
    # Per layer: the tokens a banded (sliding-window) layer attends to, the query's own included
    # (transformers' `kv_idx > q_idx - sliding_window`); 0: the whole context. Empty: all 0.
    layer_windows: tuple[int, ...] = ()
    qk_norm: bool = False  # RMSNorm over each query and key head before rope (Qwen3, Gemma 3)
    # Gemma 3: a norm after attention and after the MLP, each before its residual add, and one
    # before the MLP (its `pre_feedforward_layernorm`).
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # the dense MLP's: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    query_scale: float | None = None  # attention's softmax scale; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator
    rotary_dim: int = 0  # rope's dimensions of each head (partial rotary); 0: head_dim
    # Banded layers' own rope, where it differs (Gemma 3's local base): theta and scaling.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    moe: MoeSpec | None = None

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's window (0: the whole context)."""
        return self.layer_windows or (0,) * self.num_layers

    @property
    def rotary(self) -> int:
        return self.rotary_dim or self.head_dim

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        """The spec of a config.json (a `gemma3` one's `text_config`); UnsupportedModelError for a
        model_type or feature the engine cannot serve."""
        family = model_family(cfg)
        model_type = str(cfg.get("model_type", "llama"))
        if model_type == "gemma3":
            cfg = {
                **cfg["text_config"],
                "eos_token_id": cfg.get("eos_token_id", cfg["text_config"].get("eos_token_id")),
            }
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta, scaling, partial = _rope(cfg, "full_attention" if family == "gemma3" else None)
        spec = cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=eos_ids,
            family=family,
            layer_windows=_windows(cfg, model_type, num_layers),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        )
        return _FAMILY_FACTS.get(family, _no_facts)(spec, cfg)


def _rope(cfg: dict[str, Any], layer_type: str | None) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling or None for plain rope, partial rotary factor) of a config: transformers >= 5
    nest them in `rope_parameters` (Gemma 3: one per layer type); older configs keep rope_theta,
    rope_scaling and partial_rotary_factor at the top level."""
    rope = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None:
        rope = dict(rope.get(layer_type) or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    )
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    if scaling is not None and "original_max_position_embeddings" in cfg:  # older configs keep it apart
        scaling = {"original_max_position_embeddings": cfg["original_max_position_embeddings"], **scaling}
    return theta, scaling, partial


def _windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: none), as transformers reads the config."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return (0,) * num_layers
    types = cfg.get("layer_types")
    if model_type in ("mistral", "mixtral", "phi3", "qwen3_moe"):
        types = None  # every layer banded (their modeling files ignore layer_types)
    elif types is None and model_type in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", num_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    elif types is None and model_type in ("gemma3_text", "gemma3"):
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif types is None and model_type == "gpt_oss":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def _no_facts(spec: ModelSpec, cfg: dict[str, Any]) -> ModelSpec:
    return spec


def _llama(spec: ModelSpec, cfg: dict[str, Any]) -> ModelSpec:
    return replace(spec, qk_norm=spec.model_type == "qwen3")


def _gemma3(spec: ModelSpec, cfg: dict[str, Any]) -> ModelSpec:
    if cfg.get("attn_logit_softcapping") is not None or cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            f"unsupported {spec.model_type} variant: attention logit softcapping and bidirectional "
            "attention (Gemma 2, EmbeddingGemma) are not served"
        )
    local_theta, local_scaling, _ = _rope(cfg, "sliding_attention")
    if not cfg.get("rope_parameters"):  # the older keys: rope_local_base_freq for banded layers
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq", 10000.0)), None
        if cfg.get("rope_theta") is None:
            spec = replace(spec, rope_theta=1_000_000.0)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(
            f"unsupported {spec.model_type} activation {act!r}: expected gelu_pytorch_tanh"
        )
    return replace(
        spec,
        qk_norm=True,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embed_scale=math.sqrt(spec.hidden_size),
        query_scale=float(cfg.get("query_pre_attn_scalar", spec.head_dim)) ** -0.5,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def _moe(
    spec: ModelSpec, cfg: dict[str, Any], routing: str, normalize: bool, sparse: tuple[bool, ...]
) -> MoeSpec:
    return MoeSpec(
        num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg.get("moe_intermediate_size") or spec.intermediate_size),
        routing=routing,
        normalize=normalize,
        sparse_layers=sparse,
    )


def _mixtral(spec: ModelSpec, cfg: dict[str, Any]) -> ModelSpec:
    return replace(spec, moe=_moe(spec, cfg, "softmax_topk", True, (True,) * spec.num_layers))


def _qwen3_moe(spec: ModelSpec, cfg: dict[str, Any]) -> ModelSpec:
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(spec.num_layers))
    moe = _moe(spec, cfg, "softmax_topk", bool(cfg.get("norm_topk_prob", False)), sparse)
    return replace(spec, qk_norm=True, moe=moe)


def _gpt_oss(spec: ModelSpec, cfg: dict[str, Any]) -> ModelSpec:
    moe = replace(
        _moe(spec, cfg, "topk_softmax", False, (True,) * spec.num_layers),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )
    return replace(spec, attention_sinks=True, attention_bias=True, moe=moe)


_FAMILY_FACTS = {
    "llama": _llama,
    "gemma3": _gemma3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
}
