"""Prompt-length buckets: which bucket a prompt falls in, and which prompts are long.

Bucket i holds prompts of at most `length_buckets[i]` tokens, the last bucket the longer ones; ()
is one bucket. The waiting queue lets the buckets take turns at admission (waiting_queue.py). A
prompt beyond the first bucket is long, and the scheduler holds its prefill back in two ways:

- the share: while shorter prompts (of the same or a higher class) wait and a slot is free, the
  prefill chunks of longer prompts share at most `long_prefill_share` of the step's token budget
  (`StepBuilder.long_budget`), so a burst of long prompts cannot hold back short ones;
- the step-time budget: its chunks shrink to what leaves running streams their inter-token
  latency (budget.py).
"""

from __future__ import annotations

import bisect


def bucket_of(num_tokens: int, boundaries: tuple[int, ...]) -> int:
    """Index of the bucket for a prompt of `num_tokens`: bucket i holds prompts <= boundaries[i]."""
    return bisect.bisect_left(boundaries, num_tokens)


def bucket_labels(boundaries: tuple[int, ...]) -> tuple[str, ...]:
    """Names of the buckets in order, e.g. ("<=256", "<=1024", ">1024"); ("all",) without boundaries."""
    if not boundaries:
        return ("all",)
    return (*(f"<={b}" for b in boundaries), f">{boundaries[-1]}")


def validate_boundaries(boundaries: tuple[int, ...]) -> None:
    if any(b < 1 for b in boundaries) or list(boundaries) != sorted(set(boundaries)):
        raise ValueError(f"length_buckets must be increasing positive token counts, got {boundaries}")


def is_long(num_prompt_tokens: int, boundaries: tuple[int, ...]) -> bool:
    """A prompt beyond the first length bucket: its chunks yield to interactive work."""
    return bool(boundaries) and num_prompt_tokens > boundaries[0]
