"""Fixed-size KV blocks: a free list, allocation on demand, freeing on every terminal path.

Pure bookkeeping, no tensors: block i owns slots [i * block_size, (i + 1) * block_size) of every
layer's cache. Admission is a check-then-act pair (`can_allocate` / `allocate`) as in nano-vllm;
"no room" is a `False`, answered by the scheduler with preemption, never an exception.
"""

from __future__ import annotations

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack, lowest ids on top: blocks just freed are reused first, so the cache's working set
        # stays small and warm instead of cycling through (and page-faulting in) the whole cache.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner: dict[int, tuple[str, int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_tokens) + reserve <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` slots for its first `num_tokens` tokens. False (and nothing taken) if short."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block = self._free.pop()
            self._owner[block] = seq.seq_id
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks. Idempotent: a sequence with no blocks is a no-op."""
        for block in seq.block_table:
            owner = self._owner.pop(block, None)
            assert owner == seq.seq_id, f"block {block} owned by {owner}, freed by {seq.seq_id}"
            self._free.append(block)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
