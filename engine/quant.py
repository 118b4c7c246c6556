"""Int4 weights for small decode batches on the CPU, and the linear layer that picks a kernel.

A decode step of a few sequences is bound by reading weights from memory, not by arithmetic: at one
sequence, reading the bf16 weights of SmolLM2-135M (270 MB) is the whole step. The bundled model
ships as Q4_1 GGUF, i.e. groups of 32 weights stored as `w = d * q + m` with q in 0..15. Q4_1's
quantizer always uses both q = 0 (the group's minimum) and q = 15 (its maximum), so regrouping the
dequantized weights by min and max recovers d, m and q exactly, and torch's int4 CPU kernel
(`_weight_int4pack_mm_for_cpu`, which computes `(q - 8) * scale + zero`) then runs the very weights
the file holds, reading 4.5 bits per weight instead of 16. Scale and zero are stored in the
activations' dtype (bf16): the same rounding the bf16 dequantized weights have.

Large batches are compute-bound, and there the bf16 matmul (AMX/AVX-512) is faster than the int4
kernel, so `Linear` keeps both and picks per step by the number of rows (measured crossover on
this machine: docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP_SIZE = 32
PACK_BATCH_HINT = 32  # the batch size oneDNN tunes a packed layout for; any batch size runs on it
# The packed matmul runs only at these row counts: above 8, inputs are padded with zero rows up to
# the next multiple of 8 (to 64 rows), 16 (to 256) or 32. oneDNN keeps memory for every row count
# it has run (kernels and scratch held by its caches and the malloc arenas: ~1.5 MiB per count for
# one 3072x576 weight, measured), and a served engine meets new counts (the tokens of a step) for
# as long as it runs: RSS outside the KV cache kept rising under a mixed soak (issue 15). With the
# ladder it meets at most ~35 counts up to 512: one 3072x576 layer run at every count 9..512 took
# +758 MiB of RSS unpadded, +39 MiB padded, flat on repeats (`python -m bench.memory_probe
# --linear-rows`). The padding costs at most 7, 15 or 31 rows (under a quarter above 64 rows);
# 1..8 rows and multiples of the step run as they are.
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
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight.packed, GROUP_SIZE, weight.scales_and_zeros)


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout (what inductor's freezing does), or None
    where that does not apply. A bf16 matmul against a plain [N, K] weight re-blocks it on every
    call; prepacked, the 30 layers of SmolLM2 take 25-45% less time at 4..64 rows on this CPU, with
    bit-identical results. bf16 only: for fp32 the packed kernel rounds differently (~1e-4), and
    fp32 is the exact-parity reference."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):
        return None


@dataclass
class Linear:
    """`x @ weight.T + bias` over one of three copies of the weight: int4 for batches of at most
    `int4_max_rows` rows (when the caller allows), else the oneDNN-packed bf16 weight, else the
    plain one."""

    weight: torch.Tensor | None  # [N, K] plain; None when `packed` holds it
    bias: torch.Tensor | None = None
    int4: Int4Weight | None = None
    int4_max_rows: int = 0
    packed: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        int4_max_rows: int = 0,
        source: torch.Tensor | None = None,
    ) -> Linear:
        """The fastest copies `weight` supports; int4 quantized from `source` (default `weight`)."""
        int4 = None
        if int4_max_rows > 0 and int4_supported(weight):
            int4 = quantize_int4(weight, source=source)
        packed = pack_for_onednn(weight)
        return cls(None if packed is not None else weight, bias, int4, int4_max_rows, packed)

    def __call__(self, x: torch.Tensor, int4_ok: bool = True) -> torch.Tensor:
        """`int4_ok=False` keeps even a small batch on the bf16 weights (the model passes it for
        steps that prefill, see engine/model.py)."""
        if self.int4 is not None and int4_ok and x.shape[0] <= self.int4_max_rows:
            y = int4_mm(x, self.int4)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            rows = x.shape[0]
            padded = padded_rows(rows)
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y if padded == rows else y[:rows]
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
