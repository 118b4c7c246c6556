"""Quantized weights on the CPU, and the linear layer that picks a kernel.

A decode step of a few sequences is bound by reading weights from memory, not by arithmetic. The
bundled model ships as a GGUF file whose layers are Q4_1 (groups of 32 weights stored as
`w = d * q + m` with q in 0..15) and whose embedding (the tied LM head) is Q8_0. Q4_1's quantizer
always uses both q = 0 (the group's minimum) and q = 15 (its maximum), and Q8_0's uses q = +-127
for the group's largest weight, so regrouping the dequantized weights recovers the file's values
exactly. Two ways to run them, by the CPU (engine/device/platform.py):

- our kernels (engine/device/csrc/qmatmul_x86.cpp, AVX2 and up, float32 activations quantized to int8 per
  group): faster than the float32 matmul at every batch size, and a row's result does not depend
  on its batch, so they serve every step and no float copy of the weights is kept;
- torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16 only) for decode steps of a few rows,
  beside oneDNN-packed bf16 weights for larger steps, on CPUs with native bf16.

engine/resolve.py's `resolve_weight_format` picks per model, device, dtype and `--quantization`;
docs/BENCHMARKS.md has the measurements behind each choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.device.ops import mkldnn_available, tensor_op

GROUP_SIZE = 32
PACK_BATCH_HINT = 32  # the batch size oneDNN tunes a packed layout for; any batch size runs on it
# The packed matmul runs only at these row counts: above 8, inputs are padded with zero rows up to
# the next multiple of 8 (to 64 rows), 16 (to 256) or 32. oneDNN keeps memory for every row count
# it has run (kernels and scratch held by its caches and the malloc arenas), and a served engine
# meets new counts (the tokens of a step) for as long as it runs, so its RSS would keep rising;
# with the ladder it meets at most ~35 counts up to 512 (`python -m bench.memory_probe
# --linear-rows`, docs/BENCHMARKS.md). The padding costs at most 7, 15 or 31 rows (under a
# quarter above 64 rows); 1..8 rows and multiples of the step run as they are.
_ROW_LADDER = ((8, 1), (64, 8), (256, 16))
_ROW_STEP_ABOVE = 32


def padded_rows(num_rows: int) -> int:
    """The row count a packed matmul of `num_rows` rows runs at (see _ROW_LADDER)."""
    step = next((s for limit, s in _ROW_LADDER if num_rows <= limit), _ROW_STEP_ABOVE)
    return -(-num_rows // step) * step


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # torch's int4 CPU packing of q [N, K]
    scales_and_zeros: torch.Tensor  # [K / GROUP_SIZE, N, 2]: (scale, zero) per group and output row
    max_abs_error: float  # largest |dequantized - original| over the weight: 0.0 means exact


def int4_supported(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight can take the int4 CPU kernel: CPU, bf16, K in whole groups."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % GROUP_SIZE == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def quantize_int4(weight: torch.Tensor, source: torch.Tensor | None = None) -> Int4Weight:
    """Q4_1-style groups of 32 along K (min/max, 16 levels) of `source` (fp32 preferred; defaults
    to `weight`), packed for the CPU kernel in `weight`'s dtype."""
    src = (weight if source is None else source).float()
    n, k = src.shape
    groups = src.view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((groups - low.unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp_(0, 15)
    error = (q * scale.unsqueeze(-1) + low.unsqueeze(-1) - groups).abs().max().item()
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
    return Int4Weight(packed, scales_and_zeros, error)


def int4_mm(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    return tensor_op(
        torch.ops.aten._weight_int4pack_mm_for_cpu, x, weight.packed, GROUP_SIZE, weight.scales_and_zeros
    )


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight packed for our quantized matmuls (engine/device/csrc/qmatmul_x86.cpp): `kind` "q4"
    (Q4_1: w = d * q + m, q in 0..15) or "q8" (Q8_0: w = d * q, q in -127..127), in groups of 32
    along K with fp16 d and m, output rows in blocks of 8."""

    kind: str
    packed: torch.Tensor  # uint8 [ceil(N / 8), K / 32, 160 or 272]
    n: int
    max_abs_error: float  # largest |dequantized - original|: 0.0 means the file's weights exactly


Q4_GROUP_BYTES, Q8_GROUP_BYTES = 160, 272
# Activation groups whose max|x| exceeds this times their mean|x| keep 15 bits on our kernels
# (engine/device/csrc/qmatmul_x86.cpp); chosen by bench/quant_parity.py (docs/BENCHMARKS.md).
OUTLIER_RATIO = 6.0


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[B, 8, G] floats -> [B, G, 16] bytes: each group's 8 rows as fp16."""
    return values.half().permute(0, 2, 1).contiguous().view(torch.uint8)


def pack_q4(weight: torch.Tensor) -> QuantWeight:
    """Q4_1 groups (min and max over each 32 weights, 16 levels) of a float [N, K] weight. Exact for
    weights that came from a Q4_1 file: its quantizer uses both q = 0 and q = 15 in every group."""
    w, n = _padded_rows(weight)
    blocks, groups = w.shape[0] // 8, w.shape[1] // GROUP_SIZE
    g = w.view(-1, groups, GROUP_SIZE)
    low = g.amin(-1).half().float()
    d = ((g.amax(-1) - low) / 15).half().float()
    q = ((g - low.unsqueeze(-1)) / torch.where(d > 0, d, 1).unsqueeze(-1)).round().clamp_(0, 15)
    error = (q * d.unsqueeze(-1) + low.unsqueeze(-1) - g)[:n].abs().max().item()
    q = q.to(torch.uint8).view(blocks, 8, groups, 2, 4, 4)  # [block, row, group, half, p, t]
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 128)
    scales = _fp16_bytes(d.view(blocks, 8, groups))
    mins = _fp16_bytes(low.view(blocks, 8, groups))
    return QuantWeight("q4", torch.cat([nibbles, scales, mins], -1).contiguous(), n, error)


def pack_q8(weight: torch.Tensor) -> QuantWeight:
    """Q8_0 groups (d = max |w| / 127 over each 32 weights) of a float [N, K] weight; exact for
    weights that came from a Q8_0 file."""
    w, n = _padded_rows(weight)
    blocks, groups = w.shape[0] // 8, w.shape[1] // GROUP_SIZE
    g = w.view(-1, groups, GROUP_SIZE)
    d = (g.abs().amax(-1) / 127).half().float()
    q = (g / torch.where(d > 0, d, 1).unsqueeze(-1)).round().clamp_(-127, 127)
    error = (q * d.unsqueeze(-1) - g)[:n].abs().max().item()
    q = q.to(torch.int8).view(blocks, 8, groups, 8, 4)  # [block, row, group, c, t]
    values = q.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256).view(torch.uint8)
    scales = _fp16_bytes(d.view(blocks, 8, groups))
    return QuantWeight("q8", torch.cat([values, scales], -1).contiguous(), n, error)


def _padded_rows(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"a quantized weight needs K in whole groups of {GROUP_SIZE}, got {k}")
    w = weight.detach().float()
    return (F.pad(w, (0, 0, 0, -n % 8)) if n % 8 else w), n


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The float [N, K] weight `weight` holds (tests, and a reference for the kernels)."""
    p = weight.packed
    blocks, groups = p.shape[0], p.shape[1]
    d = p[..., -16:] if weight.kind == "q8" else p[..., 128:144]
    d = d.contiguous().view(torch.float16).float().permute(0, 2, 1).reshape(-1, groups, 1)
    if weight.kind == "q8":
        q = p[..., :256].contiguous().view(torch.int8).view(blocks, groups, 8, 8, 4).permute(0, 3, 1, 2, 4)
        w = q.reshape(-1, groups, GROUP_SIZE).float() * d
    else:
        nib = p[..., :128].view(blocks, groups, 4, 8, 4).permute(0, 3, 1, 2, 4)  # [block, row, group, p, t]
        q = torch.stack([nib & 15, nib >> 4], dim=3).reshape(-1, groups, GROUP_SIZE).float()
        m = p[..., 144:160].contiguous().view(torch.float16).float().permute(0, 2, 1).reshape(-1, groups, 1)
        w = q * d + m
    return w.reshape(blocks * 8, groups * GROUP_SIZE)[: weight.n]


def quantize_activations(x: torch.Tensor, outlier_ratio: float = math.inf) -> torch.Tensor:
    """What the kernels compute with: each row's groups of 32 at steps of max|x| / 32512 (15 bits)
    where max|x| > outlier_ratio * mean|x|, else at steps of max|x| / 127.5 (8 bits)."""
    g = x.float().view(x.shape[0], -1, GROUP_SIZE)
    amax = g.abs().amax(-1, keepdim=True)
    wide = amax > outlier_ratio * (g.abs().sum(-1, keepdim=True) / GROUP_SIZE)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    fine = (g * (32512.0 / safe)).round()
    coarse = (g * ((32512.0 / 255.0) / safe)).round() * 255
    return (torch.where(wide, fine, coarse) * (amax / 32512.0)).view_as(x)


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout (what inductor's freezing does), or None
    where that does not apply. A bf16 matmul against a plain [N, K] weight re-blocks it on every
    call; prepacked it does not, with bit-identical results. bf16 only: for fp32 the packed kernel
    rounds differently, and fp32 is the exact-parity reference."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or not mkldnn_available()
    ):
        return None
    try:
        return tensor_op(torch.ops.mkldnn._reorder_linear_weight, weight, PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):
        return None


@dataclass
class Linear:
    """`x @ weight.T + bias` over one of four copies of the weight: our quantized one for every
    batch, else int4 for batches of at most `int4_max_rows` rows (when the caller allows), else
    the oneDNN-packed bf16 weight, else the plain one."""

    weight: torch.Tensor | None  # [N, K] plain; None when `packed` or `quant` holds it
    bias: torch.Tensor | None = None
    int4: Int4Weight | None = None
    int4_max_rows: int = 0
    packed: torch.Tensor | None = None
    quant: QuantWeight | None = None
    # Our kernels keep 15 bits of an activation group whose max|x| exceeds this times its mean|x|
    # (an outlier), 8 bits elsewhere (engine/device/csrc/qmatmul_x86.cpp); inf: 8 bits everywhere.
    outlier_ratio: float = math.inf

    @classmethod
    def build(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        int4_max_rows: int = 0,
        source: torch.Tensor | None = None,
        quant: str | None = None,
    ) -> Linear:
        """The fastest copies `weight` supports; int4 or `quant` ("q4", "q8": our kernels, which
        then serve alone) quantized from `source` (default `weight`)."""
        if quant is not None:
            src = weight if source is None else source
            packed_weight = pack_q4(src) if quant == "q4" else pack_q8(src)
            float_bias = None if bias is None else bias.float()
            return cls(None, float_bias, quant=packed_weight, outlier_ratio=OUTLIER_RATIO)
        int4 = None
        if int4_max_rows > 0 and int4_supported(weight):
            int4 = quantize_int4(weight, source=source)
        packed = pack_for_onednn(weight)
        return cls(None if packed is not None else weight, bias, int4, int4_max_rows, packed)

    def __call__(self, x: torch.Tensor, int4_ok: bool = True) -> torch.Tensor:
        """`int4_ok=False` keeps even a small batch on the bf16 weights (the model passes it for
        steps that prefill, see engine/device/models/decoder.py); our kernels serve every step."""
        if self.quant is not None:
            op = torch.ops.batchgate.q4_linear if self.quant.kind == "q4" else torch.ops.batchgate.q8_linear
            return tensor_op(op, x, self.quant.packed, self.quant.n, self.bias, self.outlier_ratio)
        if self.int4 is not None and int4_ok and x.shape[0] <= self.int4_max_rows:
            y = int4_mm(x, self.int4)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            rows = x.shape[0]
            padded = padded_rows(rows)
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            y = tensor_op(torch.ops.mkldnn._linear_pointwise, x, self.packed, self.bias, "none", [], "")
            return y if padded == rows else y[:rows]
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
