"""Sampling: a pure function of logits and per-sequence parameters, with a fast path for greedy.

Order per row: logit bias, presence/frequency penalties, min_tokens (stop ids masked), the grammar's
token bitmask (constrained rows), then temperature, top-k, top-p and a draw from the sequence's own
generator (a fixed seed gives the same output whatever else is in the batch). Logprobs are the
model's (log-softmax of the raw logits), as OpenAI and vLLM report them.

A constrained row skips min_tokens: its grammar alone decides when the output may end (masking
EOS where the grammar allows nothing else would leave no token to sample).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.types import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one sequence at this step."""

    params: SamplingParams
    output_token_ids: list[int]
    stop_ids: tuple[int, ...]  # EOS and extra stop ids, masked while below min_tokens
    generator: torch.Generator | None
    constrained: bool = False  # its row of the step's bitmask applies


def apply_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            vals = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, vals)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty
        if len(row.output_token_ids) < p.min_tokens and row.stop_ids and not row.constrained:
            logits[i, list(row.stop_ids)] = float("-inf")
    return logits


# -inf as the bits of a float32 (sign and exponent set, mantissa clear).
_NEG_INF_BITS = int(np.array(-np.inf, dtype=np.float32).view(np.int32))
_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Set to -inf, in place, the logits of `rows` whose bit in `bitmask` (same rows, int32 words,
    32 tokens each, least significant bit first, bit set: allowed) is clear; returns `logits`.

    A float32 logit x becomes x ^ ((x ^ -inf) & d), its bits as an int32, where d is -1 for a
    disallowed token and 0 for an allowed one: exactly -inf, or x unchanged bit for bit. On the
    CPU row by row in numpy, into two scratch rows that stay in cache: no batch-sized temporaries,
    which cost more in fresh pages than the arithmetic."""
    if not rows:
        return logits
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        _apply_bitmask_rows(logits, bitmask, rows)
    else:
        _apply_bitmask_batched(logits, bitmask, rows)
    return logits


def _apply_bitmask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    vocab = logits.shape[1]
    values = logits.numpy().view(np.int32)
    words = bitmask.numpy()
    disallowed = np.empty(vocab, dtype=np.int32)
    scratch = np.empty(vocab, dtype=np.int32)
    for r in rows:
        # Little-endian words: token t is bit t % 8 of byte t // 8 (bits past the words: masked).
        allowed = np.unpackbits(np.ascontiguousarray(words[r]).view(np.uint8), count=vocab, bitorder="little")
        np.subtract(allowed, 1, out=disallowed, dtype=np.int32)
        np.bitwise_xor(values[r], _NEG_INF_BITS, out=scratch)
        scratch &= disallowed
        values[r] ^= scratch


def _apply_bitmask_batched(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The same on any device, for all `rows` at once (on a GPU: a few kernels over the batch)."""
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:  # a read-only constant, so engine threads may share it
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        shifts = _BIT_SHIFTS.setdefault(logits.device, shifts)
    all_rows = rows == list(range(logits.shape[0]))
    words = (bitmask if all_rows else bitmask[rows]).to(logits.device)
    vocab = logits.shape[1]
    disallowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab] - 1
    target = logits if all_rows else logits[rows]
    if target.dtype == torch.float32:
        bits = target.view(torch.int32)
        bits.bitwise_xor_(bits.bitwise_xor(_NEG_INF_BITS).bitwise_and_(disallowed))
    else:
        target.masked_fill_(disallowed.bool(), float("-inf"))
    if not all_rows:
        logits.index_copy_(0, torch.tensor(rows, dtype=torch.long, device=logits.device), target)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The row's token as a 0-d tensor, left on the device (`sample` reads all rows back at once)."""
    if p.greedy:
        return logits.argmax()
    return draw(probabilities(logits, p), generator)


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (not greedy) row draws from: its processed `logits` [vocab]
    under temperature, top-k and top-p (the probabilities of the tokens cut are 0)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_probs >= p.top_p
        drop[0] = False  # a top_p that underflows float32 still keeps the most likely token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token from `probs` (non-negative, summing to about 1) by inverse transform: one uniform
    draw from the row's generator and a binary search of the cumulative sums (float64, so the
    tail's tokens keep their share). torch.multinomial on the CPU draws an exponential per token
    instead, far slower at a large vocabulary (docs/BENCHMARKS.md).

    A token without mass is never drawn: its cumulative sum equals its predecessor's. -1 when the
    row has no mass at all (every logit -inf or a NaN), which `sample` raises for, as multinomial
    did, without a read-back per row."""
    cdf = probs.cumsum(0, dtype=torch.float64)
    total = cdf[-1]
    u = torch.rand((), dtype=torch.float64, device=probs.device, generator=generator)
    token = torch.searchsorted(cdf, (u * total).reshape(1), right=True)[0]
    # u * total may round up to total: then stay on the last token with mass (where cdf reaches it).
    token = torch.minimum(token, torch.searchsorted(cdf, total.reshape(1))[0])
    return torch.where(total > 0, token, -1)  # NaN > 0 is false


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    bitmask: torch.Tensor | None = None,
    *,
    overwrite: bool = False,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Choose one token per row of float32 `logits` [S, vocab]; return tokens and logprobs.

    `bitmask` [S, ceil(vocab / 32)] int32 (engine/grammar/interface.py) applies to the rows marked
    `constrained`; it is required when any row is. `logits` is left as it was unless `overwrite`
    (the runner's, a fresh tensor each step): masking it in place saves a copy of the batch's
    logits. `argmax`: a faster op equal to `logits.argmax(dim=-1)` (the native CPU kernels')."""
    logits, raw_logprobs = prepare(logits, rows, bitmask, overwrite=overwrite)
    if all(r.params.greedy for r in rows):
        tokens = (logits.argmax(dim=-1) if argmax is None else argmax(logits)).tolist()
    else:
        # One read-back for the whole batch: on CUDA each row's own would wait for the device.
        tokens = torch.stack(
            [_sample_row(logits[i], r.params, r.generator) for i, r in enumerate(rows)]
        ).tolist()
        if min(tokens) < 0:
            raise RuntimeError(
                f"no token has probability in row {tokens.index(min(tokens))} (NaN or all -inf)"
            )
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    if raw_logprobs is not None:
        for i, row in enumerate(rows):
            logprobs[i] = logprob_of(raw_logprobs, i, tokens[i], row.params)
    return tokens, logprobs


def prepare(
    logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor | None, *, overwrite: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logits` [S, vocab] with each row's processors and grammar mask applied (a copy unless
    `overwrite`), and the model's raw logprobs where any row asks for logprobs (else None)."""
    want_logprobs = any(r.params.logprobs for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    needs_processing = any(
        r.params.logit_bias
        or r.params.presence_penalty
        or r.params.frequency_penalty
        or len(r.output_token_ids) < r.params.min_tokens
        for r in rows
    )
    constrained = [i for i, r in enumerate(rows) if r.constrained]
    if (needs_processing or constrained) and not overwrite:
        logits = logits.clone()
    if needs_processing:
        apply_processors(logits, rows)
    if constrained:
        if bitmask is None:
            raise RuntimeError("constrained rows need the step's bitmask")
        apply_bitmask(logits, bitmask, constrained)
    return logits, raw_logprobs


def logprob_of(raw_logprobs: torch.Tensor, row: int, token: int, p: SamplingParams) -> TokenLogprob | None:
    """Row `row`'s logprob of `token` and its top alternatives, if `p` asks for logprobs."""
    if not p.logprobs:
        return None
    top: tuple[tuple[int, float], ...] = ()
    if p.top_logprobs:
        vals, ids = raw_logprobs[row].topk(p.top_logprobs)
        top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token, float(raw_logprobs[row, token]), top)
