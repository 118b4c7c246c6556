"""CUDA graphs of the decode step at bucketed batch sizes.

A decode step is a few milliseconds of GPU work spread over hundreds of kernel launches; launched
one by one from Python they cost about as much again. So, as vLLM does, the decode-only forward pass is
captured once per batch-size bucket (1, 2, 4, 8, then multiples of 8 up to `max_num_seqs`) and
replayed: a step of D sequences runs the smallest bucket >= D, its extra rows padded.

Every tensor the graph reads lives at a fixed address: the step's ids, positions, slots, block
tables and lengths are written into pinned host buffers and copied into the graph's device buffers
with non-blocking copies, on the same stream, just before the replay. (The host buffers are not
written again until the sampler has read this step's tokens back, which waits for the stream.)
Padding rows write their K/V into a scratch block past the last one the block manager hands out,
and read a context of one token, so they touch no sequence's cache.

Needs a decode-attention kernel whose loop bounds come from device memory (engine/
triton_attention.py); the torch path sizes its gather by the longest context and cannot be captured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.device.models.decoder import DecoderModel
from engine.device.ops import cuda_stream
from engine.step import ForwardBatch, StepInputs

logger = logging.getLogger(__name__)


def triton_decode_attention() -> Callable[..., torch.Tensor]:
    """The Triton decode-attention kernel (engine/device/triton_attention.py), imported only when a CUDA
    runner asks for it: a CPU engine never loads triton."""
    from engine.device.triton_attention import paged_decode_attention

    return paged_decode_attention


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including `max_num_seqs`."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captured decode steps for every bucket; `run` replays the one that fits."""

    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        block_size: int,
        max_blocks_per_seq: int,
        pad_slot: int,
        device: torch.device,
    ) -> None:
        """`pad_slot`: a KV slot no sequence owns (padding rows write there)."""
        self.buckets = batch_buckets(max_num_seqs)
        self.block_size = block_size
        self.num_replays = 0
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pad_slot = pad_slot
        n = self.buckets[-1]
        long = torch.long
        self._host = {
            "ids": torch.zeros(n, dtype=long).pin_memory(),
            "positions": torch.zeros(n, dtype=long).pin_memory(),
            "slots": torch.full((n,), pad_slot, dtype=long).pin_memory(),
            "lens": torch.ones(n, dtype=long).pin_memory(),
            "tables": torch.zeros(n, max_blocks_per_seq, dtype=long).pin_memory(),
        }
        self._np = {k: v.numpy() for k, v in self._host.items()}
        self._dev = {k: v.to(device) for k, v in self._host.items()}
        rows = torch.arange(n, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
                batch = ForwardBatch(
                    input_ids=self._dev["ids"][:size],
                    positions=self._dev["positions"][:size],
                    slot_mapping=self._dev["slots"][:size],
                    num_decode=size,
                    decode_tables=self._dev["tables"][:size],
                    decode_lens=self._dev["lens"][:size],
                    prefills=[],
                    logits_indices=rows[:size],
                )
                side = cuda_stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm-up: compiles kernels, settles allocations
                    model.forward(batch, kv_caches)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = model.forward(batch, kv_caches)
                pool = graph.pool()
                self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(device)
        logger.info("captured CUDA graphs for decode batches of %s", self.buckets)

    def can_run(self, inputs: StepInputs) -> bool:
        return (
            not inputs.prefill_ranges
            and 0 < inputs.num_decode <= self.buckets[-1]
            and len(inputs.block_tables[0]) <= self.max_blocks_per_seq
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [D, vocab] of a decode-only step (valid until the next `run`)."""
        d = inputs.num_decode
        size = next(b for b in self.buckets if b >= d)
        h = self._np
        h["ids"][:d] = inputs.input_ids
        h["positions"][:d] = inputs.positions
        h["lens"][:d] = [p + 1 for p in inputs.positions]
        width = len(inputs.block_tables[0])
        h["tables"][:d, :width] = inputs.block_tables
        # Each decode token's slot: its block at position // block_size, offset position % block_size.
        block_size = self.block_size
        h["slots"][:d] = [
            row[p // block_size] * block_size + p % block_size
            for row, p in zip(inputs.block_tables, inputs.positions, strict=True)
        ]
        h["slots"][d:size] = self.pad_slot
        h["lens"][d:size] = 1
        h["positions"][d:size] = 0
        for name in ("ids", "positions", "slots", "lens"):
            self._dev[name][:size].copy_(self._host[name][:size], non_blocking=True)
        # Only the columns this step uses: the kernel reads no further than each row's length.
        self._dev["tables"][:size, :width].copy_(self._host["tables"][:size, :width], non_blocking=True)
        graph, logits = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return logits[:d]
