"""The records one engine step passes down, and their packing: nothing here imports the runner.

    Scheduler.schedule() --> SchedulerOutput       which chunks of which sequences run
    pack(output)          --> StepInputs            the batch as plain lists (what TP rank 0 sends)
    forward_batch(inputs) --> ForwardBatch          the same on one rank's device (the model reads it)
    ModelRunner.sample()  --> StepResult            the token each sampled sequence drew

Rows are the decodes first, then the prefill chunks, in the scheduler's order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from engine.sequence import Sequence
from engine.types import GrammarError, TokenLogprob


@dataclass(frozen=True)
class ScheduledChunk:
    """`seq` computes tokens [num_computed_tokens, num_computed_tokens + num_tokens) this step."""

    seq: Sequence
    num_tokens: int
    # A decode's draft (engine/speculative/): verified in the same pass, one decode row per token.
    # It is not counted in `num_tokens`: only the tokens it accepts are computed, after sampling.
    draft: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        """The token rows it runs this step: its tokens, and its draft's."""
        return self.num_tokens + len(self.draft)

    @property
    def completes(self) -> bool:
        """After this chunk every known token is computed, so the step samples a new one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: tuple[ScheduledChunk, ...]  # one token each
    prefills: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...]
    expired: tuple[Sequence, ...]  # waited past their queue deadline; the engine fails them
    # Their grammar failed to compile, each with the error; the engine fails them.
    grammar_failed: tuple[tuple[Sequence, GrammarError], ...] = ()
    # The prefill chunks' query-key pairs, counted when scheduled (the step-time budget's cost model).
    num_context_pairs: int = 0

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        return self.decodes + self.prefills

    @property
    def ended(self) -> list[Sequence]:
        """The sequences the scheduler took out for the engine to fail (expired, grammar failed)."""
        return list(self.expired) + [seq for seq, _ in self.grammar_failed]

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences whose chunk completes this step (they sample), in logits order."""
        return [c.seq for c in self.decodes] + [c.seq for c in self.prefills if c.completes]

    @property
    def num_batched_tokens(self) -> int:
        """The token rows of the step's forward pass, drafts included."""
        return sum(c.num_rows for c in self.chunks)

    @property
    def num_decode_rows(self) -> int:
        """The decode rows: one per decode, and one per draft token."""
        return sum(c.num_rows for c in self.decodes)

    @property
    def has_drafts(self) -> bool:
        return any(c.draft for c in self.decodes)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def by_adapter(self) -> SchedulerOutput:
        """The same step with its decodes and its prefills each ordered by LoRA slot (stable), so
        the rows of one adapter are consecutive (`lora_groups`); itself when no row has one."""
        if all(c.seq.lora_slot < 0 for c in self.chunks):
            return self

        def key(chunk: ScheduledChunk) -> int:
            return chunk.seq.lora_slot

        decodes, prefills = tuple(sorted(self.decodes, key=key)), tuple(sorted(self.prefills, key=key))
        return dataclasses.replace(self, decodes=decodes, prefills=prefills)


@dataclass
class StepInputs:
    """One step's batch as plain lists: everything a forward pass needs, and what rank 0 sends the
    other ranks of a tensor-parallel replica (engine/device/parallel.py). Rows: decodes, then prefills."""

    input_ids: list[int]
    positions: list[int]
    block_tables: list[list[int]]  # one row per sequence, zero-padded to one width
    num_decode: int  # the first D tokens (and rows) are single decode tokens
    prefill_ranges: list[tuple[int, int, int]]  # (start, end, context length) of each prefill chunk
    logits_rows: list[int]  # token rows whose next-token logits are wanted
    # Each row's LoRA slot (engine/lora.py), -1 for the base model; empty: no row has an adapter.
    lora_slots: list[int] = field(default_factory=list)


@dataclass
class PrefillSlice:
    """One sequence's prefill chunk: tokens [start, end) of the packed batch, attending to `slots`."""

    start: int
    end: int
    slots: torch.Tensor  # [context_len] slots of the whole context, the chunk's own tokens last


@dataclass
class ForwardBatch:
    """Everything one forward pass needs, on the device; built by `forward_batch`, read-only after."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode: int  # the first D tokens are single decode tokens
    decode_tables: torch.Tensor | None  # [D, B] int64 block ids of each decode sequence (padded)
    decode_lens: torch.Tensor | None  # [D] int64 context length of each, the new token included
    prefills: list[PrefillSlice]
    logits_indices: torch.Tensor  # [S] token rows whose next-token logits are wanted
    # Where the step's prefill may run in the one-call layers (engine/device/models/decoder.py; see
    # ONE_CALL_PREFILL_CONTEXT): every token as a row of its own, [T, B] its sequence's block ids
    # and [T] its context length (its position + 1), run exactly as a decode token. None: the step
    # only decodes, or its prefill runs in the Python layer loop.
    token_tables: torch.Tensor | None = None
    token_lens: torch.Tensor | None = None
    # (LoRA slot, a run of consecutive prefill rows using it); empty: none.
    lora_groups: list[tuple[int, slice]] = field(default_factory=list)
    # The decode rows with an adapter, all slots in one batched shrink and expand; None: none.
    lora_decode: LoraDecodePlan | None = None


@dataclass
class LoraDecodePlan:
    """The decode rows with an adapter, rows [lo, hi) in slot order (`SchedulerOutput.by_adapter`),
    as one batched matmul over slots 0..num_slots-1: `gather` [num_slots * width] takes each slot's
    rows into [num_slots, width] (padded with row lo, whose padded results are never read); row
    lo + i is entry `j[i]` of slot `slot[i]` (engine/device/lora_weights.py's LoraStack reads
    it). `dense`: every slot has `width` rows, so the rows are that grid as they lie (no gather, no
    scatter)."""

    num_slots: int
    width: int
    lo: int
    hi: int
    dense: bool
    gather: torch.Tensor
    slot: torch.Tensor
    j: torch.Tensor
    _back: dict[int, torch.Tensor] = field(default_factory=dict)

    def back(self, chunks: int) -> torch.Tensor:
        """[hi - lo, chunks]: where each row's `chunks` column chunks lie in a flat
        [num_slots * chunks * width] expand output; the same for every linear of the step."""
        if chunks not in self._back:
            first = self.slot * (chunks * self.width) + self.j
            steps = torch.arange(chunks, device=first.device) * self.width
            self._back[chunks] = first.unsqueeze(1) + steps
        return self._back[chunks]


def lora_decode_plan(inputs: StepInputs, device: torch.device) -> LoraDecodePlan | None:
    rows = [(row, slot) for row, slot in enumerate(inputs.lora_slots[: inputs.num_decode]) if slot >= 0]
    if not rows:
        return None
    lo, hi = rows[0][0], rows[-1][0] + 1
    slots = [slot for _, slot in rows]
    assert hi - lo == len(rows) and slots == sorted(slots), "decode rows are not in slot order"
    counts: dict[int, int] = {}
    js = []
    for slot in slots:
        js.append(counts.get(slot, 0))
        counts[slot] = js[-1] + 1
    num_slots, width = slots[-1] + 1, max(counts.values())
    gather = [lo] * (num_slots * width)
    for (row, slot), j in zip(rows, js, strict=True):
        gather[slot * width + j] = row

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    dense = num_slots * width == len(rows)
    return LoraDecodePlan(num_slots, width, lo, hi, dense, tensor(gather), tensor(slots), tensor(js))


@dataclass
class StepResult:
    """Sequences that sampled this step, each with its new tokens (one, or the draft tokens it
    accepted and one more) and their logprobs (None where not asked)."""

    seqs: list[Sequence]
    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def pack(out: SchedulerOutput) -> StepInputs:
    """The step's batch as lists: each decode's next token (and its draft's, a row each), then
    each prefill chunk's tokens."""
    input_ids: list[int] = []
    positions: list[int] = []
    decode_seqs = []  # one per decode row: a decode with a draft has a row per token
    for chunk in out.decodes:
        seq, first = chunk.seq, chunk.seq.num_computed_tokens
        for j, token in enumerate((seq.token_ids[first], *chunk.draft)):
            input_ids.append(token)
            positions.append(first + j)
            decode_seqs.append(seq)
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
    lora_slots = [s.lora_slot for s in all_seqs] if any(s.lora_slot >= 0 for s in all_seqs) else []
    return StepInputs(input_ids, positions, tables, len(decode_seqs), prefill_ranges, logits_rows, lora_slots)


def lora_groups(inputs: StepInputs) -> list[tuple[int, slice]]:
    """The runs of consecutive prefill rows that share a LoRA slot (chunk j is its range): each
    linear runs one shrink and one expand per run. The engine orders a step's prefills by slot
    (`SchedulerOutput.by_adapter`), so consecutive chunks of one adapter make one run."""
    spans = [(s, e) for s, e, _ in inputs.prefill_ranges]
    runs: list[tuple[int, slice]] = []
    for slot, (start, end) in zip(inputs.lora_slots[inputs.num_decode :], spans, strict=True):
        if slot < 0:
            continue
        if runs and runs[-1][0] == slot and runs[-1][1].stop == start:
            runs[-1] = (slot, slice(runs[-1][1].start, end))
        else:
            runs.append((slot, slice(start, end)))
    return runs


# A step's prefill runs in the one-call layers when its attention work (the sum of the prefill
# tokens' context lengths) is at most ONE_CALL_PREFILL_CONTEXT, or its prefill tokens are at most
# ONE_CALL_PREFILL_TOKENS at any depth: they win on fresh prompts and on small chunks (the Python
# loop's per-op overhead outweighs re-reading the context per row), and lose on big chunks deep
# into a long context (bench/one_call_prefill.py, docs/BENCHMARKS.md).
ONE_CALL_PREFILL_CONTEXT = 16384
ONE_CALL_PREFILL_TOKENS = 64


def _slots(block_tables: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """Slots of positions 0..num_positions-1 for each row of `block_tables` [R, max_blocks]."""
    pos = torch.arange(num_positions, device=block_tables.device)
    return block_tables[:, pos // block_size] * block_size + pos % block_size


def forward_batch(inputs: StepInputs, block_size: int, device: torch.device) -> ForwardBatch:
    """The step's tensors on `device`."""
    num_decode, prefill_ranges = inputs.num_decode, inputs.prefill_ranges
    tables = torch.tensor(inputs.block_tables, dtype=torch.long, device=device)
    pos_t = torch.tensor(inputs.positions, dtype=torch.long, device=device)
    # Each token's slot: its sequence's block at pos // block_size, offset pos % block_size.
    row_of_token = torch.tensor(
        [i for i in range(num_decode)]
        + [num_decode + j for j, (s, e, _) in enumerate(prefill_ranges) for _ in range(e - s)],
        dtype=torch.long,
        device=device,
    )
    slot_mapping = tables[row_of_token, pos_t // block_size] * block_size + pos_t % block_size
    decode_tables = decode_lens = None
    if num_decode:
        lens = [p + 1 for p in inputs.positions[:num_decode]]
        decode_lens = torch.tensor(lens, device=device)
        decode_tables = tables[:num_decode, : -(-max(lens) // block_size)].contiguous()
    prefills = [
        PrefillSlice(start, end, _slots(tables[num_decode + j : num_decode + j + 1], ctx, block_size)[0])
        for j, (start, end, ctx) in enumerate(prefill_ranges)
    ]
    groups = lora_groups(inputs) if inputs.lora_slots else []
    token_tables = token_lens = None
    attention_work = sum((e - s) * ctx - (e - s) * (e - s - 1) // 2 for s, e, ctx in prefill_ranges)
    num_prefill = sum(e - s for s, e, _ in prefill_ranges)
    small = attention_work <= ONE_CALL_PREFILL_CONTEXT or num_prefill <= ONE_CALL_PREFILL_TOKENS
    if prefill_ranges and small and not groups:
        token_lens = pos_t + 1
        width = -(-(max(inputs.positions) + 1) // block_size)  # the blocks of the longest context
        token_tables = tables[row_of_token, :width].contiguous()
    return ForwardBatch(
        input_ids=torch.tensor(inputs.input_ids, dtype=torch.long, device=device),
        positions=pos_t,
        slot_mapping=slot_mapping,
        num_decode=num_decode,
        decode_tables=decode_tables,
        decode_lens=decode_lens,
        prefills=prefills,
        logits_indices=torch.tensor(inputs.logits_rows, dtype=torch.long, device=device),
        token_tables=token_tables,
        token_lens=token_lens,
        lora_groups=groups,
        lora_decode=lora_decode_plan(inputs, device) if inputs.lora_slots else None,
    )
