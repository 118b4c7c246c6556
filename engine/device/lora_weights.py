"""The model's LoRA slots on its device: every resident adapter's deltas, stacked per layer and
fused linear so one step adds the deltas of rows of several adapters in a few batched matmuls.

The adapters themselves (loading, versions, the slots a step may mix) are engine/lora.py's; this is
what engine/device/models/decoder.py adds after each base matmul:
`y[rows] += (x[rows] @ A.T) @ (scale * B).T`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.lora import TARGETS, LayerLora, LoraAdapter, module_shapes
from engine.model_spec import ModelSpec


class LoraStack:
    """Every slot's delta for one fused linear (qkv, o, gate_up, down) of one layer, stacked for
    batched matmuls on the model's device: A of each of the linear's modules side by side
    [slots, in, modules * R], and B cut into equal column chunks of the fused output
    [slots, chunks, R, chunk], R the largest rank of the installed adapters (zero-padded: exact;
    the stacks are rebuilt larger or smaller when an install changes it, between steps). A chunk
    (the gcd of the modules' widths: q is 3 chunks of k's width) belongs to one module, so one
    batched expand writes each module's own output columns, without block-diagonal zeros."""

    def __init__(
        self,
        modules: list[tuple[str, int]],
        fan_in: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: Any = None,
    ) -> None:
        """`dtype`: of A and B as held (the rows' own, or bfloat16 under `kernel`). `kernel`:
        engine/device/csrc/lora.cpp's lora_decode_ for the decode rows (float32 rows on the CPU), or None
        for the torch ops."""
        self.modules = [name for name, _ in modules]
        widths = [width for _, width in modules]
        self.chunk = math.gcd(*widths)
        owner = [m for m, width in enumerate(widths) for _ in range(width // self.chunk)]
        self.num_chunks = len(owner)
        # which module's shrink output each chunk expands; None: chunk i is module i's
        self.owner = None if owner == list(range(len(widths))) else torch.tensor(owner, device=device)
        self.kernel = kernel
        self.kernel_owner = torch.tensor(owner)
        self.first_chunk = [owner.index(m) for m in range(len(widths))]
        self.fan_in, self.num_slots, self.dtype, self.device = fan_in, num_slots, dtype, device
        self.rank = 0
        self.slot_ranks = [0] * num_slots  # each slot's own largest rank here
        self.a = self.b = torch.empty(0)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def install(self, slot: int, layer: LayerLora | None) -> None:
        """Slot `slot` holds `layer`'s deltas of this linear's modules (None or none: zero)."""
        parts = [(m, layer[name]) for m, name in enumerate(self.modules) if layer and name in layer]
        self.slot_ranks[slot] = max((p.a.shape[0] for _, p in parts), default=0)
        if max(self.slot_ranks) != self.rank:
            self._resize(max(self.slot_ranks))
        if self.rank == 0:
            return
        r_max = self.rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        for m, part in parts:
            r = part.a.shape[0]
            self.a[slot, :, m * r_max : m * r_max + r] = part.a.T
            b_t = part.b.T.reshape(r, -1, self.chunk).transpose(0, 1)  # [its chunks, r, chunk]
            self.b[slot, self.first_chunk[m] : self.first_chunk[m] + b_t.shape[0], :r] = b_t

    def _resize(self, rank: int) -> None:
        """New stacks of `rank` with every slot's deltas (a shrink drops only zero padding: no
        slot has a larger rank); rank 0 frees them."""
        old_a, old_b, old = self.a, self.b, self.rank
        self.rank = rank
        if rank == 0:
            self.a = self.b = torch.empty(0)
            return
        m = len(self.modules)
        self.a = torch.zeros(self.num_slots, self.fan_in, m * rank, dtype=self.dtype, device=self.device)
        self.b = torch.zeros(
            self.num_slots, self.num_chunks, rank, self.chunk, dtype=self.dtype, device=self.device
        )
        keep = min(old, rank)
        if keep:
            self.a.view(self.num_slots, self.fan_in, m, rank)[..., :keep] = old_a.view(
                self.num_slots, self.fan_in, m, old
            )[..., :keep]
            self.b[:, :, :keep] = old_b[:, :, :keep]

    def _per_chunk(self, shrunk: torch.Tensor, dim: int) -> torch.Tensor:
        """The shrink output of each chunk's module: [..., modules, R] -> [..., chunks, R] on `dim`."""
        return shrunk if self.owner is None else shrunk.index_select(dim, self.owner)

    def add_decode(self, y: torch.Tensor, x: torch.Tensor, plan: Any) -> None:
        """y[plan.lo:plan.hi] += each decode row's delta: one shrink and one expand for all slots
        (`plan`: engine/step.py's LoraDecodePlan; `dense`: its rows are the [slots, width] grid)."""
        if self.kernel is not None and y.is_contiguous():
            self.kernel(y, x.contiguous(), self.a, self.b, plan.slot, self.kernel_owner, plan.lo)
            return
        s, w, r, c, n = plan.num_slots, plan.width, self.rank, self.num_chunks, plan.hi - plan.lo
        rows = x[plan.lo : plan.hi] if plan.dense else x.index_select(0, plan.gather)
        a, b = self.a[:s].to(x.dtype), self.b[:s].to(x.dtype)  # no copy unless held narrower
        shrunk = torch.bmm(rows.view(s, w, -1), a)
        lhs = self._per_chunk(shrunk.view(s, w, -1, r), 2).transpose(1, 2).reshape(s * c, w, r)
        out = torch.bmm(lhs, b.view(s * c, r, self.chunk))  # [slots * chunks, width, chunk]
        target = y[plan.lo : plan.hi]
        if plan.dense:
            target.view(s, w, c, self.chunk).add_(out.view(s, c, w, self.chunk).transpose(1, 2))
        else:
            picked = out.view(-1, self.chunk).index_select(0, plan.back(c).view(-1))
            target.view(n, c, self.chunk).add_(picked.view(n, c, self.chunk))

    def add_rows(self, y: torch.Tensor, x: torch.Tensor, slot: int, rows: slice) -> None:
        """y[rows] += slot `slot`'s delta of x[rows] (a run of prefill rows)."""
        n, r = rows.stop - rows.start, self.rank
        a, b = self.a[slot].to(x.dtype), self.b[slot].to(x.dtype)  # no copy unless held narrower
        lhs = self._per_chunk((x[rows] @ a).view(n, -1, r), 1)  # [n, chunks, R]
        out = torch.bmm(lhs.transpose(0, 1), b)  # [chunks, n, chunk]
        y[rows].view(n, self.num_chunks, self.chunk).add_(out.transpose(0, 1))


class LoraWeights:
    """The model's LoRA slots: a LoraStack per layer and fused linear, for `spec`'s shapes.
    `kernels`: engine/device/native.py's, whose lora_decode_ serves float32 decode rows on the CPU.
    `compact`: hold A and B in bfloat16 where that kernel serves (half the bytes a decode step
    reads; engine/device/models/decoder.py asks for it over quantized base weights, never in the
    exact mode)."""

    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels: Any = None,
        compact: bool = False,
    ) -> None:
        shapes = module_shapes(spec)
        fused: dict[str, list[tuple[str, int]]] = {}
        for module, linear in TARGETS.items():  # in fusion order
            fused.setdefault(linear, []).append((module, shapes[module][1]))
        fan_in = {linear: shapes[modules[0][0]][0] for linear, modules in fused.items()}
        kernel = kernels.lora_decode_ if kernels is not None and dtype == torch.float32 else None
        held = torch.bfloat16 if compact and kernel is not None else dtype
        self.num_slots = num_slots
        # the decode rows' deltas run natively (and inside the one-call decode, models/decoder.py)
        self.native = kernel is not None
        self.installed: list[str | None] = [None] * num_slots  # each slot's adapter id
        self._decode_args: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None
        self.layers = [
            {
                linear: LoraStack(modules, fan_in[linear], num_slots, held, device, kernel)
                for linear, modules in fused.items()
            }
            for _ in range(spec.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        """Bytes the stacks hold (they follow the largest rank installed)."""
        return sum(stack.nbytes for stacks in self.layers for stack in stacks.values())

    def install(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put `adapter`'s weights into `slot` (None empties it); between steps only."""
        self.installed[slot] = adapter.id if adapter is not None else None
        self._decode_args = None  # an install may grow a stack: new tensors
        for i, stacks in enumerate(self.layers):
            layer = adapter.layers[i] if adapter is not None else None
            for stack in stacks.values():
                stack.install(slot, layer)  # the copy into the stack casts and moves

    def decode_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Every stack's A, B and chunk owners, layer by layer in the order qkv, o, gate_up, down:
        the one-call decode's LoRA inputs (engine/device/csrc/decode_layers.cpp; an empty A: no delta)."""
        if self._decode_args is None:
            stacks = [layer[linear] for layer in self.layers for linear in ("qkv", "o", "gate_up", "down")]
            self._decode_args = (
                [s.a for s in stacks],
                [s.b for s in stacks],
                [s.kernel_owner for s in stacks],
            )
        return self._decode_args
