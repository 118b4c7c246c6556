"""Prices, budgets and their windows: the arithmetic of money, shared by every limiter backend.

Money is integer micro-dollars (1 USD = 1,000,000), never a float. A price is kept as integer
micro-dollars per 1M tokens (``input = 0.10`` in the file is 100,000), so a request's cost is

    ceil((uncached_input * input + cached_input * cached_input_price + output * output) / 1e6)

micro-dollars: exact integer arithmetic, rounded up once per request (a request that costs
anything costs at least one micro-dollar). ``budget_tokens`` counts input (cached included) plus
output tokens.

A budget's window is calendar-aligned in UTC: ``daily`` resets at 00:00 UTC, ``monthly`` at
00:00 UTC on the 1st, ``none`` never. A window is named by an integer index (days since the
epoch; ``year * 12 + month - 1``; 0), computed from the store's clock: the Redis scripts do the
same arithmetic in Lua (``WINDOW_LUA``), and the tests check both agree.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Metric = Literal["usd", "tokens"]
WindowName = Literal["daily", "monthly", "none"]
WINDOWS: tuple[WindowName, ...] = ("daily", "monthly", "none")
MICROS_PER_USD = 1_000_000
TOKENS_PER_PRICE_UNIT = 1_000_000  # prices are per 1M tokens
_PPM = 1_000_000  # batch_multiplier is kept in parts per million


@dataclass(frozen=True)
class Price:
    """One model's price: micro-dollars per 1M input, cached input and output tokens, and the
    multiplier (parts per million) applied to batch work."""

    input: int
    cached_input: int
    output: int
    batch_multiplier_ppm: int = _PPM

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int, *, batch: bool = False) -> int:
        """Micro-dollars for one request (``input_tokens`` includes the ``cached_tokens``)."""
        cached = min(max(cached_tokens, 0), input_tokens)
        scaled = (
            (input_tokens - cached) * self.input + cached * self.cached_input + output_tokens * self.output
        )
        if batch:
            return -(-scaled * self.batch_multiplier_ppm // (TOKENS_PER_PRICE_UNIT * _PPM))
        return -(-scaled // TOKENS_PER_PRICE_UNIT)


FREE = Price(0, 0, 0)
# Weight of a prompt excess that no completion token can pay for (the prompt costs, output is free).
UNPAYABLE_WEIGHT = 2**31


def prompt_excess_weight(budgets: tuple[Budget, ...], price: Price) -> int:
    """How many completion tokens, at most, pay for one prompt token beyond a budget's hold: 1
    for a token budget; a money budget's input over output price, rounded up. A pool replica
    cuts that many from its completion tokens per excess prompt token (gateway/local/engine_backend.py), so a
    request whose gateway under-estimated its prompt still costs no more than its hold."""
    weight = 1 if budgets else 0
    for budget in budgets:
        if budget.metric == "usd" and price.input > price.output:
            weight = max(weight, UNPAYABLE_WEIGHT if price.output == 0 else -(-price.input // price.output))
    return weight


def micros_of(value: float, path: str) -> int:
    """``value`` dollars (or dollars per 1M tokens) as integer micro-dollars; ValueError naming
    ``path`` for a negative value or one with more than 6 decimals."""
    scaled = value * MICROS_PER_USD
    micros = round(scaled)
    if value < 0 or not math.isfinite(value) or abs(scaled - micros) > 1e-6 * max(1.0, abs(scaled)):
        raise ValueError(f"{path}: must be a number >= 0 with at most 6 decimals, got {value!r}")
    return micros


def format_usd(micros: int) -> str:
    """``$5.00``, ``$0.000123``: cents when exact, else every micro-dollar digit."""
    dollars, rest = divmod(micros, MICROS_PER_USD)
    if rest % 10_000 == 0:
        return f"${dollars}.{rest // 10_000:02d}"
    return f"${dollars}.{rest:06d}".rstrip("0")


@dataclass(frozen=True)
class Budget:
    """A cap on a tenant's (or one key's) use over a window: ``limit`` micro-dollars (metric
    ``usd``) or tokens (``tokens``). ``soft_ratio``: the share of ``limit`` whose crossing is
    reported (a metric, once per window). ``scope``: ``tenant`` or ``key:<key id>``; ``source``
    says where it was set (``plan free``, ``tenant acme``), for the refusal's message."""

    metric: Metric
    limit: int
    window: WindowName
    soft_ratio: float | None = None
    scope: str = "tenant"
    source: str = ""

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"a budget's limit must be >= 0, got {self.limit}")
        if self.window not in WINDOWS:
            raise ValueError(f"budget_window: must be one of {', '.join(WINDOWS)}, got {self.window!r}")
        if self.soft_ratio is not None and not 0 < self.soft_ratio <= 1:
            raise ValueError(f"budget_soft_ratio: must be in (0, 1], got {self.soft_ratio!r}")

    @property
    def name(self) -> str:
        """``tenant.usd``, ``key:ab12.tokens``: unique within a tenant, a Redis key suffix."""
        return f"{self.scope}.{self.metric}"

    def describe(self, amount: int) -> str:
        return format_usd(amount) if self.metric == "usd" else f"{amount} tokens"


@dataclass(frozen=True)
class Charge:
    """What a request will be charged with: its model's price, its key, the budgets that apply
    and the worst case reserved against each (``reserved[i]`` for ``budgets[i]``)."""

    model: str = ""
    key_id: str = ""
    price: Price = FREE
    budgets: tuple[Budget, ...] = ()
    reserved: tuple[int, ...] = ()
    batch: bool = False

    def __post_init__(self) -> None:
        assert len(self.budgets) == len(self.reserved), "one reservation per budget"

    @classmethod
    def worst_case(
        cls,
        budgets: Sequence[Budget],
        *,
        num_prompt_tokens: int,
        max_tokens: int,
        model: str = "",
        key_id: str = "",
        price: Price = FREE,
        batch: bool = False,
    ) -> Charge:
        """Reserve each budget at the request's worst case: every prompt token uncached and
        ``max_tokens`` of output."""
        worst = [spent(b, price, num_prompt_tokens, 0, max_tokens, batch=batch) for b in budgets]
        return cls(model, key_id, price, tuple(budgets), tuple(worst), batch)

    def amounts(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> tuple[int, ...]:
        """What each budget is charged with for the real usage."""
        return tuple(
            spent(b, self.price, input_tokens, cached_tokens, output_tokens, batch=self.batch)
            for b in self.budgets
        )

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> int:
        return self.price.cost(input_tokens, cached_tokens, output_tokens, batch=self.batch)


NO_CHARGE = Charge()


def spent(
    budget: Budget, price: Price, input_tokens: int, cached_tokens: int, output_tokens: int, *, batch: bool
) -> int:
    """What ``budget`` counts for one request: micro-dollars or input + output tokens."""
    if budget.metric == "tokens":
        return input_tokens + output_tokens
    return price.cost(input_tokens, cached_tokens, output_tokens, batch=batch)


# -- windows -------------------------------------------------------------------------------

_WINDOW_CODES: dict[str, str] = {"daily": "d", "monthly": "m", "none": "n"}


def window_code(window: WindowName) -> str:
    """The one-letter name the Lua scripts take."""
    return _WINDOW_CODES[window]


def window_index(window: WindowName, now: float) -> int:
    """The index of the window holding ``now`` (Unix seconds, UTC)."""
    if window == "none":
        return 0
    days = math.floor(now / 86400)
    if window == "daily":
        return days
    date = dt.date(1970, 1, 1) + dt.timedelta(days=days)
    return date.year * 12 + date.month - 1


def window_bounds(window: WindowName, index: int) -> tuple[float | None, float | None]:
    """The window's start and end (Unix seconds; None for ``none``, which never resets)."""
    if window == "none":
        return None, None
    if window == "daily":
        return index * 86400.0, (index + 1) * 86400.0
    year, month0 = divmod(index, 12)
    start = dt.datetime(year, month0 + 1, 1, tzinfo=dt.UTC)
    end = dt.datetime(year + (month0 + 1) // 12, (month0 + 1) % 12 + 1, 1, tzinfo=dt.UTC)
    return start.timestamp(), end.timestamp()


def iso(ts: float) -> str:
    """``2027-01-01T00:00:00Z``."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# The same as window_index, for the scripts: Howard Hinnant's civil_from_days.
WINDOW_LUA = """
local function window_index(kind, now)
  if kind == 'n' then return 0 end
  local days = math.floor(now / 86400)
  if kind == 'd' then return days end
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)
  yoe = math.floor(yoe / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return y * 12 + (m - 1)
end
"""


@dataclass(frozen=True)
class BudgetRefusal:
    """Why a request did not fit a budget: which, how much is used and held, and when it resets."""

    budget: Budget
    used: int
    reserved: int
    requested: int
    window: int

    @property
    def resets_at(self) -> float | None:
        return window_bounds(self.budget.window, self.window)[1]

    def message(self) -> str:
        b = self.budget
        what = {"daily": "daily ", "monthly": "monthly ", "none": ""}[b.window]
        scope = "this API key's" if b.scope.startswith("key:") else "your"
        where = f" (set on {b.source})" if b.source else ""
        resets = self.resets_at
        when = f" It resets at {iso(resets)}." if resets is not None else " It does not reset."
        return (
            f"You exceeded {scope} {what}{'spend' if b.metric == 'usd' else 'token'} budget of "
            f"{b.describe(b.limit)}{where}: {b.describe(self.used)} used and {b.describe(self.reserved)} "
            f"held by requests in flight; this request may need up to {b.describe(self.requested)}." + when
        )


@dataclass(frozen=True)
class BudgetState:
    """One budget's state now, for ``/v1/usage``."""

    budget: Budget
    used: int
    reserved: int
    window: int

    def body(self) -> dict[str, object]:
        start, end = window_bounds(self.budget.window, self.window)
        b = self.budget
        return {
            "scope": b.scope,
            "metric": b.metric,
            "window": b.window,
            "limit": b.limit,
            "used": self.used,
            "reserved": self.reserved,
            "remaining": max(0, b.limit - self.used - self.reserved),
            "soft_limit": None if b.soft_ratio is None else math.floor(b.limit * b.soft_ratio),
            "window_start": None if start is None else int(start),
            "resets_at": None if end is None else int(end),
            "source": b.source,
        }
