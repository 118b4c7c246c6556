"""Everything that touches the device: the KV cache, packing a scheduled step into tensors, the
forward pass and sampling."""

from __future__ import annotations

import importlib.util
import logging
import math
import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.grammar import allocate_bitmask, closing_reserve
from engine.loader import LoadedModel
from engine.model import ForwardBatch, LlamaModel, PrefillSlice
from engine.native import resolve_kernels
from engine.parallel import ParallelExecutor, TensorParallel, check_divisible, shard_weights
from engine.platform import available_memory
from engine.quant import WeightFormat
from engine.sampler import SamplingRow
from engine.sampler import sample as sample_logits
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.types import TokenLogprob

logger = logging.getLogger(__name__)

def kv_bytes_per_token(model: LoadedModel, dtype: torch.dtype) -> int:
    s = model.spec
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.empty((), dtype=dtype).element_size()


def plan_num_blocks(
    config: EngineConfig, model: LoadedModel, dtype: torch.dtype, device: torch.device
) -> int:
    """Blocks that fit the configured KV memory, never more than the engine could ever use."""
    per_block = kv_bytes_per_token(model, dtype) * config.block_size
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    else:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
        budget = int(free * config.kv_cache_memory_fraction)
    max_len = config.max_model_len or model.spec.max_position_embeddings
    useful = config.max_num_seqs * -(-max_len // config.block_size)
    num_blocks = min(budget // per_block, useful)
    if num_blocks < 1:
        raise ValueError(
            f"KV cache memory {budget} bytes holds no block of {per_block} bytes: raise kv_cache_memory"
        )
    return int(num_blocks)


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor, its memory committed now. Zeros, not garbage: decode attention
    reads whole blocks, and the unwritten tail of a sequence's last block is masked to probability
    0, which a NaN left in fresh memory would still turn into NaN (0 * NaN).

    On the CPU the memory is its own anonymous mapping (outside the malloc heap; bench/soak.py
    reads its resident size from /proc/<pid>/smaps), and every page is written at once. Left to be
    committed as blocks were first written, the cache grew the RSS for as long as new prompts came:
    with prefix caching, freed blocks keep their prompts and new blocks are taken from the
    never-used ones first, so a 1 GiB cache grew RSS by ~70 MiB/min under a mixed soak until all of
    it was resident, while the RSS outside its mappings stayed flat (bench/memory_probe.py).
    Committed at start, the RSS a server reaches in its first seconds is the one it keeps, and a
    pod whose memory limit cannot hold the cache fails at start, not hours later. Writing 1 GiB
    took 0.65 s on the busy 2-core development machine."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    cache = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    cache.fill_(0)  # commit every page (they read as zeros already)
    return cache.view(dtype).view(shape)


def _triton_decode_attention() -> Any:
    """The Triton kernel (engine/triton_attention.py), imported only on CUDA: a CPU engine never
    loads triton."""
    from engine.triton_attention import paged_decode_attention

    return paged_decode_attention


@dataclass
class StepResult:
    """Sequences that sampled a token this step, with the token and its logprob (if asked)."""

    seqs: list[Sequence]
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class StepInputs:
    """One step's batch as plain lists: everything a forward pass needs, and what rank 0 sends the
    other ranks of a tensor-parallel replica (engine/parallel.py). Rows: decodes, then prefills."""

    input_ids: list[int]
    positions: list[int]
    block_tables: list[list[int]]  # one row per sequence, zero-padded to one width
    num_decode: int  # the first D tokens (and rows) are single decode tokens
    prefill_ranges: list[tuple[int, int, int]]  # (start, end, context length) of each prefill chunk
    logits_rows: list[int]  # token rows whose next-token logits are wanted


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LoadedModel,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        weight_format: WeightFormat | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        """`tp`: this rank's share of a tensor-parallel replica (a rank > 0 passes its own); with
        `config.tensor_parallel_size` > 1 and none given, this is rank 0, which starts the others."""
        self.block_size = config.block_size
        self.device = device
        self.dtype = dtype
        self.executor: ParallelExecutor | None = None
        spec, weights = model.spec, model.weights
        if config.tensor_parallel_size > 1:
            check_divisible(spec, config.tensor_parallel_size)
            if config.kernels == "native":
                raise ValueError("kernels native needs tensor_parallel_size 1")
            if tp is None:
                self.executor = ParallelExecutor.start(
                    config, spec.vocab_size, num_blocks, max_model_len, dtype, device
                )
                tp = self.executor.tp
            # The C++ kernels and int4 are single-rank CPU paths; a TP replica runs plain torch ops.
            weight_format, kernels = WeightFormat(), None
            spec, weights = shard_weights(spec, weights, tp.rank, tp.world_size)
        else:
            kernels = resolve_kernels(config.kernels, device)
        # On CUDA: decode attention by our Triton kernel, straight from the block table, and the
        # decode step replayed from CUDA graphs (one rank; engine/cuda_graphs.py).
        use_triton = (
            device.type == "cuda"
            and config.kernels != "torch"
            and importlib.util.find_spec("triton") is not None
        )
        use_graphs = use_triton and config.tensor_parallel_size == 1
        self.attention_backend = "native" if kernels is not None else "triton" if use_triton else "torch"
        self.model = LlamaModel(
            spec,
            weights,
            max_model_len,
            dtype=dtype,
            weight_format=weight_format or WeightFormat(),
            kernels=kernels,
            tp=tp,
            paged_decode=_triton_decode_attention() if use_triton else None,
        )
        # With graphs, one block more than the block manager hands out: padding rows write there.
        shape = (spec.num_kv_heads, num_blocks + int(use_graphs), config.block_size, spec.head_dim)
        self.kv_caches = [
            (zeroed_cache(shape, dtype, device), zeroed_cache(shape, dtype, device))
            for _ in range(spec.num_layers)
        ]
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                config.max_num_seqs,
                config.block_size,
                max_blocks_per_seq=-(-max_model_len // config.block_size),
                pad_slot=num_blocks * config.block_size,
                device=device,
            )
        self.eos_token_ids = spec.eos_token_ids
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv)
        # Grammar masks are filled on this thread while the forward pass runs on a GPU, where the
        # CPU is idle meanwhile (the fill is llguidance's Rust with the GIL released). On the CPU
        # after the pass: on the 2-core machine, where torch's two threads take both cores,
        # overlapping gained nothing once the filler ran no torch op (see forward); before that it
        # cost every step ~30%. bench/structured.py throughput, 32 constrained rows, back to back
        # (2026-11-30 19:18 UTC): constrained/unconstrained 92.6% overlapped, 93.7% after the pass.
        self.overlap_masks = device.type == "cuda"
        self._mask_filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgate-masks")
        self._masks: Future[torch.Tensor | None] | None = None  # forward() -> sample()

    @staticmethod
    def _sampled(out: SchedulerOutput) -> list[Sequence]:
        """The sequences whose chunk completes this step (they sample), in logits order."""
        return [c.seq for c in out.decodes] + [c.seq for c in out.prefills if c.completes]

    @property
    def failure(self) -> str | None:
        """Why this replica cannot run steps any more (a rank died), or None while it can."""
        return None if self.executor is None else self.executor.failure

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel replica; nothing to do on one rank."""
        if self.executor is not None:
            self.executor.shutdown()

    def _slots(self, block_tables: torch.Tensor, num_positions: int) -> torch.Tensor:
        """Slots of positions 0..num_positions-1 for each row of `block_tables` [R, max_blocks]."""
        pos = torch.arange(num_positions, device=self.device)
        return block_tables[:, pos // self.block_size] * self.block_size + pos % self.block_size

    @staticmethod
    def step_inputs(out: SchedulerOutput) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        decode_seqs = [c.seq for c in out.decodes]
        for seq in decode_seqs:
            input_ids.append(seq.token_ids[seq.num_computed_tokens])
            positions.append(seq.num_computed_tokens)
        logits_rows = list(range(len(decode_seqs)))
        prefill_ranges = []
        for chunk in out.prefills:
            start = len(input_ids)
            first = chunk.seq.num_computed_tokens
            input_ids.extend(chunk.seq.token_ids[first : first + chunk.num_tokens])
            positions.extend(range(first, first + chunk.num_tokens))
            prefill_ranges.append((start, len(input_ids), first + chunk.num_tokens))
            if chunk.completes:
                logits_rows.append(len(input_ids) - 1)
        all_seqs = decode_seqs + [c.seq for c in out.prefills]
        width = max(len(s.block_table) for s in all_seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in all_seqs]
        return StepInputs(input_ids, positions, tables, len(decode_seqs), prefill_ranges, logits_rows)

    def forward_batch(self, inputs: StepInputs) -> ForwardBatch:
        """The step's tensors on this rank's device."""
        num_decode, prefill_ranges = inputs.num_decode, inputs.prefill_ranges
        tables = torch.tensor(inputs.block_tables, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)
        # Each token's slot: its sequence's block at pos // block_size, offset pos % block_size.
        row_of_token = torch.tensor(
            [i for i in range(num_decode)]
            + [num_decode + j for j, (s, e, _) in enumerate(prefill_ranges) for _ in range(e - s)],
            dtype=torch.long,
            device=self.device,
        )
        slot_mapping = (
            tables[row_of_token, pos_t // self.block_size] * self.block_size + pos_t % self.block_size
        )
        decode_tables = decode_lens = None
        if num_decode:
            lens = [p + 1 for p in inputs.positions[:num_decode]]
            decode_lens = torch.tensor(lens, device=self.device)
            decode_tables = tables[:num_decode, : -(-max(lens) // self.block_size)].contiguous()
        prefills = [
            PrefillSlice(start, end, self._slots(tables[num_decode + j : num_decode + j + 1], ctx)[0])
            for j, (start, end, ctx) in enumerate(prefill_ranges)
        ]
        return ForwardBatch(
            input_ids=torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device),
            positions=pos_t,
            slot_mapping=slot_mapping,
            num_decode=num_decode,
            decode_tables=decode_tables,
            decode_lens=decode_lens,
            prefills=prefills,
            logits_indices=torch.tensor(inputs.logits_rows, dtype=torch.long, device=self.device),
        )

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        return self.forward_batch(self.step_inputs(out))

    # A step is two calls, so that the engine knows which of them failed (engine/llm_engine.py).

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one scheduled step's forward pass (writing its K/V to the cache); returns the logits
        of every sequence whose chunk completes, in `sample`'s order.

        On a tensor-parallel replica any failure is fatal (EngineDeadError): the ranks' collectives
        would no longer pair up."""
        seqs = self._sampled(out)
        self._masks = None
        if self.overlap_masks and any(s.grammar is not None for s in seqs):
            # Every grammar's state is final before the forward pass: fill the mask during it. The
            # bitmask is allocated here: the filler thread must run no torch op that may go parallel
            # (torch.full of a 32-row mask does). Its first one gave that thread an OpenMP team of
            # its own, and with more OpenMP threads than cores libgomp stops spinning between
            # parallel regions for good: every later step, constrained or not, ran ~30% slower on
            # the 2-core machine (bench/structured.py: unconstrained 930 -> 670 tok/s once a
            # process had filled one overlapped mask).
            with torch.inference_mode(False):  # a grammar may write it in place from that thread
                bitmask = allocate_bitmask(len(seqs), self.model.spec.vocab_size)
            self._masks = self._mask_filler.submit(fill_bitmask, seqs, self.model.spec.vocab_size, bitmask)
        inputs = self.step_inputs(out)
        if self.executor is not None:
            return self.executor.run(self.forward_inputs, inputs)
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
        return self.model.forward(self.forward_batch(inputs), self.kv_caches)

    @torch.inference_mode()
    def forward_inputs(self, inputs: StepInputs) -> torch.Tensor:
        """One forward pass over `inputs` (every rank of a tensor-parallel replica runs it)."""
        return self.model.forward(self.forward_batch(inputs), self.kv_caches)

    @torch.inference_mode()
    def sample(self, out: SchedulerOutput, logits: torch.Tensor) -> StepResult:
        """Choose the next token of every sequence whose chunk completes, from `forward`'s logits."""
        seqs = self._sampled(out)
        rows = [
            SamplingRow(
                params=s.sampling,
                output_token_ids=s.output_token_ids,
                stop_ids=(() if s.sampling.ignore_eos else self.eos_token_ids) + s.sampling.stop_token_ids,
                generator=s.generator,
                constrained=s.grammar is not None,
            )
            for s in seqs
        ]
        masks, self._masks = self._masks, None
        bitmask = masks.result() if masks is not None else fill_bitmask(seqs, logits.shape[-1])
        # The logits are this step's alone (a CUDA graph's output buffer is read by nothing after
        # this either, until the next replay rewrites it): the sampler may mask them in place.
        tokens, logprobs = sample_logits(logits, rows, bitmask, overwrite=True) if seqs else ([], [])
        return StepResult(seqs, tokens, logprobs)


def fill_bitmask(
    seqs: list[Sequence], vocab_size: int, bitmask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The step's one token bitmask (`bitmask`, all bits set, or a new one): a row per sampled
    sequence, filled by its grammar where it has one (all tokens allowed elsewhere); None when no
    sequence is constrained."""
    if all(s.grammar is None for s in seqs):
        return None
    if bitmask is None:
        bitmask = allocate_bitmask(len(seqs), vocab_size)
    # One llguidance call per row: its batch call (fill_next_token_bitmask_par, one thread) measured
    # slower in the engine on 2 cores, 2.2-2.4 ms against 1.4-1.5 ms a 32-row step.
    for i, seq in enumerate(seqs):
        if seq.grammar is not None:
            left = seq.sampling.max_tokens - seq.num_output_tokens
            seq.grammar.fill_bitmask(bitmask, i, closing=left <= closing_reserve(seq.sampling.max_tokens))
    return bitmask
