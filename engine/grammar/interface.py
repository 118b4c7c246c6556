"""What the engine holds of constrained decoding, whatever the backend: a sequence's grammar, a
compiled spec, the backend that compiles specs, the bitmask they fill, and the cache that compiles
each spec once, off the engine thread."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy
import torch

from engine.types import GrammarSpec

# One bit per token, 32 tokens per int32 word (the layout llguidance and xgrammar both fill).
BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A [num_rows, words] int32 bitmask with every token allowed (all bits set)."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def token_row(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """One bitmask row with exactly `token_ids` allowed."""
    bits = numpy.zeros(bitmask_words(vocab_size) * BITS_PER_WORD, dtype=bool)
    bits[token_ids] = True
    return torch.from_numpy(numpy.packbits(bits, bitorder="little").view(numpy.int32).copy())


class Grammar(Protocol):
    """One sequence's parser state. Not thread-safe: the engine thread alone drives it."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False if the grammar does not allow it (the state is then unusable)."""
        ...

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in turn, the grammar would accept from here (nothing advances)."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, closing: bool = False) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit set: allowed); `closing`: the
        budget is nearly spent, allow only those of them that end the output soonest (a grammar
        that cannot tell allows them all)."""
        ...

    def is_terminated(self) -> bool:
        """The output is complete: nothing but the end of the sequence may follow."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, stop-string trims)."""
        ...


class CompiledGrammar(Protocol):
    """Immutable and shared: the result of compiling one spec, cached."""

    def new_grammar(self) -> Grammar: ...


class GrammarBackend(Protocol):
    """A grammar engine. `compile` may be slow and is called off the engine thread."""

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec`, or raise GrammarError naming what is wrong with it."""
        ...


class GrammarCache:
    """Compiles specs on a worker pool, at most once per spec while it stays in the LRU.

    `get(spec)` returns a Future at once (done if cached). Failures are cached too, so a client
    repeating a bad schema costs nothing. Thread-safe: the gateway asks from the event loop (to
    fail a bad schema with a 400 before admission), the engine from its thread.
    """

    def __init__(self, backend: GrammarBackend, max_entries: int = 512, max_workers: int = 1) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.backend = backend
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[GrammarSpec, Future[CompiledGrammar]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="batchgate-grammar")
        self.num_compiles = 0

    def get(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        with self._lock:
            future = self._entries.get(spec)
            if future is not None and not future.cancelled():
                self._entries.move_to_end(spec)
                return future
            self.num_compiles += 1
            future = self._pool.submit(self.backend.compile, spec)
            self._entries[spec] = future
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
