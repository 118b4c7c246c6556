"""gpt-oss checkpoints: biased attention projections with a sink logit per head
(`self_attn.sinks`), and in every layer experts under a biased `mlp.router` (the top k logits,
then their softmax). The experts come as transformers keeps them, [E, in, out] with gate and up
interleaved in `gate_up_proj` (gate at even columns), or as OpenAI ships them, MXFP4: 4-bit
e2m1 values in groups of 32 along the input, each group with a power-of-two scale
(`*_blocks` [E, out, in / 32, 16] bytes, two values each, low nibble first; `*_scales` [E, out,
in / 32], 127 + the exponent). They are dequantized here, once, to the checkpoint's float dtype,
then taken apart into the canonical [E, out, in] gate, up and down; the int8 path quantizes them
again like any weight."""

from __future__ import annotations

import torch

from engine.device.models.checkpoint import Weights
from engine.model_spec import ModelSpec

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, out, groups, 16] bytes and [E, out, groups] exponents -> [E, out, groups * 32] in `dtype`."""
    blocks, exponents = blocks.to(torch.uint8), scales.to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., 16, 2]
    values = torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1).float())  # [E, out, groups, 32]
    return values.flatten(-2).to(dtype)


def _experts(weights: Weights, name: str, dtype: torch.dtype) -> torch.Tensor:
    """An expert projection as [E, out, in], dequantized if it came as MXFP4."""
    if name + "_blocks" in weights:
        return dequantize_mxfp4(weights.pop(name + "_blocks"), weights.pop(name + "_scales"), dtype)
    return weights.pop(name).transpose(1, 2)


def canonical(spec: ModelSpec, weights: Weights) -> Weights:
    dtype = weights["model.embed_tokens.weight"].dtype
    for i in range(spec.num_layers):
        ex = f"model.layers.{i}.mlp.experts."
        if ex + "gate_proj.weight" in weights:  # already in the canonical names
            continue
        gate_up = _experts(weights, ex + "gate_up_proj", dtype)  # [E, 2 I, H], gate rows even
        bias = weights.pop(ex + "gate_up_proj_bias")
        weights[ex + "gate_proj.weight"] = gate_up[:, 0::2].contiguous()
        weights[ex + "up_proj.weight"] = gate_up[:, 1::2].contiguous()
        weights[ex + "gate_proj.bias"] = bias[:, 0::2].contiguous()
        weights[ex + "up_proj.bias"] = bias[:, 1::2].contiguous()
        weights[ex + "down_proj.weight"] = _experts(weights, ex + "down_proj", dtype).contiguous()
        weights[ex + "down_proj.bias"] = weights.pop(ex + "down_proj_bias")
    return weights
