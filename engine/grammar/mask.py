"""The step's grammar mask: which rows close, and one bitmask filled for the constrained rows,
on a worker thread during the forward pass (GPU) or on the engine thread after it (CPU)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.grammar.interface import Grammar, allocate_bitmask

# A sequence closes its output (Grammar.fill_bitmask(closing=True)) once at most this many of its
# max_tokens are left, or half of them if fewer: enough to close from wherever it is (the required
# keys left, a comma or two, the brackets).
CLOSE_RESERVE = 32


def closing_reserve(max_tokens: int) -> int:
    return min(CLOSE_RESERVE, max_tokens // 2)


# One row of a step's mask: the row's grammar and whether it closes (`closing_due`); None: free.
MaskRow = tuple[Grammar, bool] | None


def closing_due(max_tokens: int, num_output_tokens: int) -> bool:
    """Whether a constrained output should be steered to its end now: its budget runs out soon."""
    return max_tokens - num_output_tokens <= closing_reserve(max_tokens)


def fill_bitmask(
    rows: list[MaskRow], vocab_size: int, bitmask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The step's one token bitmask (`bitmask`, all bits set, or a new one): each constrained row
    filled by its grammar, all tokens allowed in the others; None when no row is constrained."""
    if all(row is None for row in rows):
        return None
    if bitmask is None:
        bitmask = allocate_bitmask(len(rows), vocab_size)
    # One llguidance call per row: its batch call measured slower in the engine on few cores.
    for i, row in enumerate(rows):
        if row is not None:
            grammar, closing = row
            grammar.fill_bitmask(bitmask, i, closing=closing)
    return bitmask


class StepMask:
    """One step's bitmask: being filled on the filler thread, or filled when asked for."""

    def __init__(
        self, rows: list[MaskRow], vocab_size: int, future: Future[torch.Tensor | None] | None
    ) -> None:
        self._rows, self._vocab_size, self._future = rows, vocab_size, future

    def result(self) -> torch.Tensor | None:
        """The bitmask (None: no row is constrained); raises what filling it raised."""
        if self._future is not None:
            return self._future.result()
        return fill_bitmask(self._rows, self._vocab_size)


class MaskFiller:
    """Starts each step's mask. With `overlap` (the GPU default) it is filled on a worker thread
    while the forward pass runs, when the CPU is idle (llguidance fills with the GIL released); on
    the CPU after the pass, which keeps every core busy already."""

    def __init__(self, vocab_size: int, overlap: bool) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgate-masks")

    def start(self, rows: list[MaskRow]) -> StepMask:
        """The mask of a step whose sampled rows are `rows` (every grammar's state is final now)."""
        if not self.overlap or all(row is None for row in rows):
            return StepMask(rows, self.vocab_size, None)
        # Allocated here, not on the filler thread: a torch op that may go parallel there would give
        # that thread an OpenMP team of its own, and more OpenMP threads than cores slow every step.
        with torch.inference_mode(False):  # a grammar may write it in place from that thread
            bitmask = allocate_bitmask(len(rows), self.vocab_size)
        future = self._thread.submit(fill_bitmask, rows, self.vocab_size, bitmask)
        return StepMask(rows, self.vocab_size, future)
