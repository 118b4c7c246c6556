"""A mixture-of-experts MLP without a Python loop over experts.

    router logits [T, E] -> each token's top k experts and weights (as its family routes)
    the T * k (token, expert) pairs sorted by expert:   rows of expert 0 | rows of expert 1 | ...
    gate_up of every expert over its rows: one grouped matmul   [T * k, 2 I]
    activation, then down: one grouped matmul                  [T * k, H]
    weighted, and added back to each pair's token

The grouped matmul is our int8 kernel's (engine/device/csrc/qmatmul_x86.cpp, `q8_grouped_linear`:
the activations quantized once, each expert's weights read once for all its rows) over quantized
weights, else `torch._grouped_mm` (CUDA's grouped GEMM; a CPU implementation in torch >= 2.8).
Nothing here waits for the device: the offsets come from a sort and a `searchsorted`, so a decode
step with experts is captured in a CUDA graph like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.device.ops import tensor_op
from engine.device.quant import OUTLIER_RATIO, QuantWeight, pack_q4, pack_q8
from engine.model_spec import MoeSpec


@dataclass(frozen=True)
class Groups:
    """A step's (token, expert) pairs grouped by expert, in the forms the paths take: rows
    offsets[e]..offsets[e+1]-1 are expert e's (`offsets` [E + 1] int64, from 0; `ends` its [E]
    ends as int32, torch._grouped_mm's), `experts` [M] each row's expert."""

    offsets: torch.Tensor
    ends: torch.Tensor
    experts: torch.Tensor


@dataclass
class GroupedLinear:
    """`E` experts' [N, K] weights: x's rows of each expert times its weight, plus its bias."""

    weight: torch.Tensor | None  # [E, N, K] float; None where `quant` holds it
    bias: torch.Tensor | None  # [E, N]
    quant: QuantWeight | None = None  # packed [E, N / 8, K / 32, bytes] for our kernels
    n: int = 0

    @classmethod
    def build(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quant: str | None
    ) -> GroupedLinear:
        """`quant` ("q4", "q8"): packed for our kernels from `weight` (float32 preferred), else the
        weights in `dtype`."""
        n = weight.shape[1]
        if quant is None:
            return cls(weight.to(dtype).contiguous(), None if bias is None else bias.to(dtype), n=n)
        pack = pack_q4 if quant == "q4" else pack_q8
        packed = [pack(w) for w in weight]
        stacked = torch.stack([p.packed for p in packed])
        error = max(p.max_abs_error for p in packed)
        qw = QuantWeight(quant, stacked, n, error)
        return cls(None, None if bias is None else bias.float().contiguous(), qw, n)

    def __call__(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        if self.quant is not None:
            q4 = self.quant.kind == "q4"
            op = torch.ops.batchgate.q4_grouped_linear if q4 else torch.ops.batchgate.q8_grouped_linear
            return tensor_op(op, x, self.quant.packed, self.n, groups.offsets, self.bias, OUTLIER_RATIO)
        assert self.weight is not None
        if x.shape[0] == 0:
            return x.new_empty(0, self.n)
        if x.is_cuda and x.dtype != torch.bfloat16:
            # CUDA's grouped GEMM is bf16's; other dtypes (fp32 parity runs) gather each row's
            # expert instead: more memory, no wait for the device, so still graph-capturable.
            w = self.weight.index_select(0, groups.experts)  # [M, N, K]
            y = torch.bmm(w, x.unsqueeze(2)).squeeze(2)
        else:
            y = tensor_op(torch._grouped_mm, x, self.weight.transpose(1, 2), groups.ends)
        return y if self.bias is None else y + self.bias.index_select(0, groups.experts)


@dataclass
class Experts:
    """One layer's experts and router, as its family routes and activates them (`MoeSpec`)."""

    spec: MoeSpec
    router: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None  # [E]
    gate_up: GroupedLinear  # [E, 2 I, H]: each expert's gate rows, then its up rows
    down: GroupedLinear  # [E, H, I]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (weights [T, k] float32, experts [T, k]) as transformers' routers choose them."""
        logits = F.linear(x, self.router, self.router_bias)
        k = self.spec.top_k
        if self.spec.routing == "topk_softmax":  # gpt-oss: softmax over the top k logits
            top, experts = logits.topk(k, dim=-1)
            return top.softmax(dim=-1).float(), experts
        probs = logits.float().softmax(dim=-1)  # Mixtral, Qwen3-MoE: softmax over all experts first
        weights, experts = probs.topk(k, dim=-1)
        if self.spec.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        limit = self.spec.swiglu_limit
        if limit is None:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.spec.swiglu_alpha))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP output [T, H] for x [T, H]: in one native call over quantized experts,
        else in torch ops."""
        if self.gate_up.quant is not None and self.down.quant is not None:
            return self._native(x)
        return self._ops(x)

    def _ops(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, expert) pairs grouped by expert
        sorted_experts = flat.index_select(0, order)
        ids = torch.arange(self.spec.num_experts, device=x.device)
        ends = torch.searchsorted(sorted_experts, ids, right=True)
        groups = Groups(F.pad(ends, (1, 0)), ends.to(torch.int32), sorted_experts)
        tokens = order // self.spec.top_k
        out = self.down(self.activation(self.gate_up(x.index_select(0, tokens), groups)), groups)
        out *= weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        """The same on our quantized kernels, in one native call (engine/device/csrc/moe.cpp)."""
        gate_up, down = self.gate_up.quant, self.down.quant
        assert gate_up is not None and down is not None
        return tensor_op(
            torch.ops.batchgate.moe_experts,
            x,
            self.router,
            self.router_bias,
            self.spec.top_k,
            self.spec.routing == "topk_softmax",
            self.spec.normalize,
            gate_up.packed,
            0 if gate_up.kind == "q4" else 1,
            self.gate_up.bias,
            down.packed,
            0 if down.kind == "q4" else 1,
            self.down.bias,
            self.spec.swiglu_limit or 0.0,
            self.spec.swiglu_alpha,
            OUTLIER_RATIO,
        )
