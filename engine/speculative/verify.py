"""Verifying drafts: from one step's logits, each sequence's accepted draft tokens and one more.

A sequence with draft d_1..d_k has k + 1 logits rows: row j is the model's next-token logits after
the draft's first j tokens. Every row is processed as the sampler processes a row (logit bias,
penalties and min_tokens over the output so far plus the draft tokens before it, the grammar's
mask of its state), so a token the sampler would not produce is never accepted.

Greedy: d_j is accepted while it equals row j-1's argmax; the first row that disagrees gives its
argmax (or, all accepted, the last row gives a bonus token): the output is the one decoding
without a draft would give. Sampled (the draft is a point mass): d_j is accepted with probability
p(d_j) under row j-1's distribution, else a token is drawn from that distribution with d_j taken
out (the residual max(0, p - q) normalized), which leaves every output token distributed exactly
as without speculation (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.sampler import SamplingRow, draw, logprob_of, prepare, probabilities
from engine.types import TokenLogprob


@dataclass(frozen=True)
class Verified:
    """One sequence's tokens from a step: its accepted draft tokens, then the model's own."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    num_accepted: int  # of the draft


def verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[tuple[int, ...]],
    bitmask: torch.Tensor | None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[Verified]:
    """`logits` [R, vocab] and `rows` (one per logits row) hold each sequence's 1 + len(draft)
    rows in turn, `drafts` each sequence's draft (() for a sequence without one). `argmax`: the
    one the sampler's greedy rows use (the native kernels'): ties break as they do without drafts."""
    logits, raw_logprobs = prepare(logits, rows, bitmask, overwrite=True)
    greedy_tokens: list[int] = []
    if any(r.params.greedy for r in rows):
        greedy_tokens = (logits.argmax(dim=-1) if argmax is None else argmax(logits)).tolist()
    results = []
    first = 0
    for draft in drafts:
        row = rows[first]
        tokens: list[int] = []
        if row.params.greedy:
            for j, proposed in enumerate(draft):
                if greedy_tokens[first + j] != proposed:
                    break
                tokens.append(proposed)
            tokens.append(greedy_tokens[first + len(tokens)])
        else:
            tokens = _rejection_sample(logits, first, rows[first : first + len(draft) + 1], draft)
        accepted = len(tokens) - 1
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if raw_logprobs is not None:
            logprobs = [logprob_of(raw_logprobs, first + j, t, row.params) for j, t in enumerate(tokens)]
        results.append(Verified(tokens, logprobs, accepted))
        first += len(draft) + 1
    return results


def _rejection_sample(
    logits: torch.Tensor, first: int, rows: list[SamplingRow], draft: tuple[int, ...]
) -> list[int]:
    tokens: list[int] = []
    generator = rows[0].generator
    for j, row in enumerate(rows):
        probs = probabilities(logits[first + j], row.params)
        if j == len(draft):  # every draft token accepted: the bonus token
            tokens.append(_checked(draw(probs, generator)))
            break
        proposed = draft[j]
        u = torch.rand((), dtype=torch.float64, device=probs.device, generator=generator)
        if float(u) < float(probs[proposed]):
            tokens.append(proposed)
            continue
        probs[proposed] = 0.0  # the residual of a point-mass draft
        tokens.append(_checked(draw(probs, generator)))
        break
    return tokens


def _checked(token: torch.Tensor) -> int:
    value = int(token)
    if value < 0:
        raise RuntimeError("no token has probability in a verified row (NaN or all -inf)")
    return value
