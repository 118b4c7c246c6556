"""What a step costs, learned online from the engine's own step times.

    seconds(step) ~= fixed_s + per_prefill_token_s * prefill tokens + per_decode_row_s * decode rows
                     + per_context_pair_s * the prefill chunks' query-key pairs

The scheduler asks how many prefill tokens fit a step-time budget next to the decode rows it has
already scheduled (`StepCost.max_prefill_tokens`), so that a long prompt's chunk shrinks while
streams are decoding. The coefficients are not constants: they differ by model, dtype, machine and
thread count, so they are fitted to the measured time of every step that prefilled something, by
exponentially weighted least squares (recent steps count most: a machine whose other load changes
changes its costs). Decode-only steps are left out: small ones run on other weights (int4) and
other kernels than a step with a prompt chunk, and they are not the steps whose size the scheduler
chooses.

Why a small linear fit and not a table or a model of the forward pass: on the CPU a prefill token
costs about the same in any chunk size above a few dozen (the matmuls are compute-bound), decode
rows add little each (they share one pass over the weights), and the fixed part (reading the weights
once, Python, sampling) dominates small steps. What grows with context is a chunk's attention: each
of its tokens attends to every token before it, so a chunk of n tokens after c computed ones has
n * c + n * (n + 1) / 2 query-key pairs (`context_pairs`). On a 2-core CPU a 32-token chunk's
step took 38 ms at context 0 and 75-85 ms past 1,900; without that term such chunks were
predicted low, and steps meant to stay within the 120 ms target took up to 171 ms
(docs/BENCHMARKS.md, fair shares).

Ties in the data (every step alike: prefill tokens and the fixed cost cannot be told apart) are
broken by a weak pull (ridge) toward "every batched token costs the same and nothing is fixed",
which predicts costs that grow with the chunk, the safe side for a budget. Coefficients are kept
non-negative (a feature whose fitted cost would be negative is dropped from that fit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_NUM_FEATURES = 4  # 1 (fixed), prefill tokens, decode rows, thousands of query-key pairs
_PAIRS_SCALE = 1e-3  # pairs enter the fit in thousands, near the other features' magnitudes


def context_pairs(num_computed: int, num_tokens: int) -> int:
    """The query-key pairs of a chunk of `num_tokens` after `num_computed` tokens (causal)."""
    return num_tokens * num_computed + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepCost:
    """A fitted step-cost model (seconds)."""

    fixed_s: float
    per_prefill_token_s: float
    per_decode_row_s: float
    per_context_pair_s: float = 0.0

    def predict(self, num_prefill_tokens: int, num_decode_rows: int, num_context_pairs: int = 0) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_decode_row_s * num_decode_rows
            + self.per_context_pair_s * num_context_pairs
        )

    def max_prefill_tokens(
        self,
        budget_s: float,
        num_decode_rows: int,
        num_prefill_tokens: int = 0,
        num_context_pairs: int = 0,
        context: int = 0,
    ) -> int | None:
        """The most tokens a chunk after `context` computed tokens may have, in a step that already
        holds `num_decode_rows` decodes and `num_prefill_tokens` prefill tokens of
        `num_context_pairs` pairs, and still be predicted within `budget_s`; 0 when even none would
        be; None when prefill costs nothing measurable (no limit)."""
        a, c = self.per_prefill_token_s + self.per_context_pair_s * (context + 0.5), self.per_context_pair_s
        if a <= 0:
            return None
        room = budget_s - self.predict(num_prefill_tokens, num_decode_rows, num_context_pairs)
        if room <= 0:
            return 0
        if c <= 0:
            return math.floor(room / a)
        # c/2 n^2 + a n <= room (context_pairs: n c + n (n + 1) / 2)
        return max(0, math.floor((math.sqrt(a * a + 2 * c * room) - a) / c))


class StepCostModel:
    """Exponentially weighted least squares of step seconds on (1, prefill tokens, decode rows,
    the prefill chunks' query-key pairs).

    `decay`: weight kept by the past at each new step (0.98: the last ~50 steps count most).
    `min_steps`: steps with prefill seen before `cost` is anything but None.
    `ridge`: strength of the pull toward the proportional model, relative to each feature's scale.
    Not thread-safe: the engine thread records, the scheduler (same thread) reads.
    """

    def __init__(self, decay: float = 0.98, min_steps: int = 8, ridge: float = 1e-3) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.min_steps = min_steps
        self.ridge = ridge
        self._sxx = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
        self._sxy = [0.0] * _NUM_FEATURES
        self._sy = 0.0  # weighted sum of seconds, for the proportional prior
        self._st = 0.0  # weighted sum of batched tokens (prefill + decode)
        self.num_steps = 0
        self.cost: StepCost | None = None

    def observe(
        self, seconds: float, num_prefill_tokens: int, num_decode_rows: int, num_context_pairs: int = 0
    ) -> None:
        """Record one step; steps without prefill, and non-positive or non-finite times, are ignored."""
        if num_prefill_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        x = (1.0, float(num_prefill_tokens), float(num_decode_rows), num_context_pairs * _PAIRS_SCALE)
        lam = self.decay
        for i in range(_NUM_FEATURES):
            self._sxy[i] = lam * self._sxy[i] + x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._sxx[i][j] = lam * self._sxx[i][j] + x[i] * x[j]
        self._sy = lam * self._sy + seconds
        self._st = lam * self._st + x[1] + x[2]
        self.num_steps += 1
        if self.num_steps >= self.min_steps:
            self.cost = self._fit()

    def _fit(self) -> StepCost:
        per_token = self._sy / self._st if self._st > 0 else 0.0
        prior = [0.0, per_token, per_token, 0.0]
        active = list(range(_NUM_FEATURES))
        while True:
            beta = self._solve(active, prior)
            negative = [i for i, b in zip(active, beta, strict=True) if b < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda i: beta[active.index(i)]))
            if not active:
                beta = []
                break
        coef = [0.0] * _NUM_FEATURES
        for i, b in zip(active, beta, strict=True):
            coef[i] = b
        return StepCost(coef[0], coef[1], coef[2], coef[3] * _PAIRS_SCALE)

    def _solve(self, active: list[int], prior: list[float]) -> list[float]:
        """Ridge-regularised normal equations over the `active` features (Gaussian elimination)."""
        n = len(active)
        a = [[self._sxx[i][j] for j in active] for i in active]
        b = [self._sxy[i] for i in active]
        for k, i in enumerate(active):
            pull = self.ridge * max(self._sxx[i][i], 1e-12)
            a[k][k] += pull
            b[k] += pull * prior[i]
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            a[col], a[pivot] = a[pivot], a[col]
            b[col], b[pivot] = b[pivot], b[col]
            if a[col][col] == 0.0:
                continue
            for r in range(col + 1, n):
                f = a[r][col] / a[col][col]
                for c in range(col, n):
                    a[r][c] -= f * a[col][c]
                b[r] -= f * b[col]
        beta = [0.0] * n
        for r in reversed(range(n)):
            if a[r][r] == 0.0:
                continue
            beta[r] = (b[r] - sum(a[r][c] * beta[c] for c in range(r + 1, n))) / a[r][r]
        return beta
