"""Fixed-size KV blocks: a free list, allocation on demand, freeing on every terminal path, and
automatic prefix caching (blocks shared by content, as vLLM v1 does).

Pure bookkeeping, no tensors: block i owns slots [i * block_size, (i + 1) * block_size) of every
layer's cache. Admission is a check-then-act pair (`can_allocate` / `allocate`) as in nano-vllm;
"no room" is a `False`, answered by the scheduler with preemption, never an exception.

Prefix caching. Once a block is full (all its tokens computed), it is registered under a hash of
its tokens chained to the hash of the block before it, so equal hashes mean equal whole prefixes.
A new sequence first takes the registered blocks that match its prompt (`take_cached_prefix`) and
computes only the rest. Blocks are reference-counted: a block shared by several sequences returns
to the free pool when the last one lets go, and a registered block there keeps its content until
it is needed for something else (least recently freed first), so a prompt seen a while ago can
still hit. Only full blocks are shared and a sequence never writes below its computed tokens, so a
shared block is never written. The chain starts from a salt (the gateway passes the tenant), so
one tenant's cache hits are invisible to another: no timing side channel between tenants; and
from the LoRA adapter's content hash, so blocks computed with one adapter (or one version of it)
are never another's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.sequence import Sequence


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a full block: its tokens, chained to the previous block's hash (or the salt's)."""
    return hashlib.blake2b(parent + array("l", tokens).tobytes(), digest_size=16).digest()


def salt_hash(salt: str) -> bytes:
    return hashlib.blake2b(b"batchgate-prefix\0" + salt.encode(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks that hold nothing reusable: a stack, lowest ids on top, so blocks just freed
        # are reused first and the cache's working set stays small and warm instead of cycling
        # through (and page-faulting in) the whole cache.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that hold a registered full block: reusable by hash until evicted, least
        # recently freed first. Both pools count as free.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, found there

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, in use or free (the prefix cache's size)."""
        return len(self._block_of)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` slots for its first `num_tokens` tokens. False (and nothing taken) if short."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently freed cached block
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Let go of all of `seq`'s blocks. Idempotent: a sequence with no blocks is a no-op.

        Last block first, so that of one sequence's cached blocks the tail (the least shareable)
        is evicted before the head."""
        for block in reversed(seq.block_table):
            assert self._refs[block] > 0, f"block {block} freed by {seq.seq_id} but held by nobody"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Let go of `seq`'s blocks past its first `num_tokens` tokens' (slots a verified draft took
        and its rejected tokens left unused; never registered: past the computed tokens)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            assert self._refs[block] == 1 and block not in self._hash_of, (
                f"block {block} is not {seq.seq_id}'s alone"
            )
            self._refs[block] = 0
            self._free.append(block)

    def reclaimable(self, seq: Sequence) -> int:
        """Blocks that freeing `seq` would return to the pool (those nobody else holds)."""
        return sum(1 for block in seq.block_table if self._refs[block] == 1)

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- prefix caching ---------------------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of `seq`'s first `num_blocks` full blocks (memoized on the sequence: a
        block's tokens never change once it is full)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_hash(seq.cache_namespace)
            hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence that holds no blocks the cached blocks matching the start of its tokens;
        they count as computed. Returns the number of tokens found. At least the last token is left
        to compute (its logits are needed), so a fully cached prompt recomputes its last block."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        if not self.enable_prefix_caching:
            return 0
        usable = (seq.num_tokens - 1) // self.block_size
        for h in self._hashes(seq, usable):
            block = self._block_of.get(h)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            seq.block_table.append(block)
        hits = len(seq.block_table)
        seq.num_registered_blocks = hits
        seq.num_computed_tokens = hits * self.block_size
        return seq.num_computed_tokens

    def release_cached_prefix(self, seq: Sequence) -> None:
        """Undo `take_cached_prefix` for a sequence that was not admitted after all."""
        self.free(seq)
        seq.num_computed_tokens = 0

    def count_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that became full since the last call. A block whose content is
        already registered elsewhere (the same prefix computed twice at once) stays private."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block
                self._hash_of[block] = h
        seq.num_registered_blocks = full
