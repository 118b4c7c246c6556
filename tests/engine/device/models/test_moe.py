"""The experts' grouped matmuls (engine/device/models/moe.py): one call for every expert's rows
gives each expert's own linear, bit for bit on our int8 kernels (a row's result never depends on
the rows beside it), and within float rounding on torch._grouped_mm; experts with no rows cost
nothing and break nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.device.models.moe import Experts, GroupedLinear, Groups
from engine.device.native import native_kernels
from engine.device.platform import CpuIsa, cpu_isa
from engine.device.quant import OUTLIER_RATIO
from engine.model_spec import MoeSpec
from engine.resolve import qmatmul_available

needs_qmatmul = pytest.mark.skipif(
    cpu_isa() < CpuIsa.AVX2 or not qmatmul_available("auto", torch.device("cpu")),
    reason="the int8 kernels need AVX2, FMA and F16C",
)

# Rows per expert: none, one, a few, past the pair tiles' 16 and the 48-row chunks (and 44 outputs:
# a last block of 8 rows half padding).
COUNTS = [0, 1, 5, 17, 0, 3, 50]


def _case(
    out_features: int = 44, in_features: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Groups]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(len(COUNTS), out_features, in_features, generator=gen) * 0.1
    bias = torch.randn(len(COUNTS), out_features, generator=gen)
    x = torch.randn(sum(COUNTS), in_features, generator=gen)
    ends = torch.tensor(COUNTS).cumsum(0)
    experts = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    return weight, bias, x, Groups(F.pad(ends, (1, 0)), ends.to(torch.int32), experts)


@needs_qmatmul
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_grouped_int8_matmul_is_each_expert_s_own_bit_for_bit(kind: str) -> None:
    weight, bias, x, groups = _case()
    grouped = GroupedLinear.build(weight, bias, torch.float32, kind)
    got = grouped(x, groups)
    op = native_kernels().q4_linear if kind == "q4" else native_kernels().q8_linear
    assert grouped.quant is not None
    for e, (lo, hi) in enumerate(zip(groups.offsets[:-1].tolist(), groups.offsets[1:].tolist(), strict=True)):
        if hi > lo:
            own = op(x[lo:hi], grouped.quant.packed[e], weight.shape[1], bias[e], OUTLIER_RATIO)
            assert torch.equal(got[lo:hi], own), f"expert {e}"


def test_grouped_float_matmul_is_each_expert_s_linear() -> None:
    weight, bias, x, groups = _case()
    got = GroupedLinear.build(weight, bias, torch.float32, None)(x, groups)
    want = torch.cat(
        [F.linear(x[i : i + 1], weight[e], bias[e]) for i, e in enumerate(groups.experts.tolist())]
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_qmatmul
@pytest.mark.parametrize(
    ("routing", "normalize", "limit"),
    [("softmax_topk", True, None), ("softmax_topk", False, None), ("topk_softmax", False, 7.0)],
    ids=["mixtral", "qwen3-moe", "gpt-oss"],
)
def test_the_one_native_call_routes_and_weighs_as_the_torch_ops(
    routing: str, normalize: bool, limit: float | None
) -> None:
    """engine/device/csrc/moe.cpp against moe.py's torch ops over the same quantized experts: each
    family's routing, weights and activation (gpt-oss's biases and clamped SwiGLU)."""
    gen = torch.Generator().manual_seed(5)
    experts, hidden, inner = 8, 64, 32
    spec = MoeSpec(experts, 2, inner, routing, normalize, (True,), swiglu_limit=limit)
    biased = limit is not None

    def bias(*shape: int) -> torch.Tensor | None:
        return torch.randn(*shape, generator=gen) if biased else None

    layer = Experts(
        spec,
        router=torch.randn(experts, hidden, generator=gen),
        router_bias=bias(experts),
        gate_up=GroupedLinear.build(
            torch.randn(experts, 2 * inner, hidden, generator=gen) * 0.2,
            bias(experts, 2 * inner),
            torch.float32,
            "q8",
        ),
        down=GroupedLinear.build(
            torch.randn(experts, hidden, inner, generator=gen) * 0.2,
            bias(experts, hidden),
            torch.float32,
            "q8",
        ),
    )
    x = torch.randn(37, hidden, generator=gen)
    torch.testing.assert_close(layer(x), layer._ops(x), atol=1e-5, rtol=1e-5)
