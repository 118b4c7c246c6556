"""The engine's device side, assembled: the model loaded on its device in its dtype."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.loader import LoadedModel, load_model
from engine.native import qmatmul_available
from engine.platform import resolve_device, resolve_dtype
from engine.quant import WeightFormat, resolve_weight_format


def load_engine_model(
    config: EngineConfig, model: LoadedModel | None
) -> tuple[LoadedModel, torch.device, torch.dtype, WeightFormat]:
    """`model` (or `config.model` loaded), with the engine's device, dtype and weight format."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    weight_format = resolve_weight_format(
        config, device, dtype, qmatmul_available(config.kernels, device)
    )
    # Quantized weights are recovered from float32 ones (exact for a GGUF's groups); the model
    # casts the rest to `dtype`.
    load_dtype = torch.float32 if weight_format.layers or weight_format.int4_max_rows else dtype
    loaded = (
        model if model is not None else load_model(config.model, config.cache_dir, load_dtype, device)
    )
    return loaded, device, dtype, weight_format
