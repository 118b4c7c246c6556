"""Plans and tenants, parsed from a TOML file into frozen records.

The file looks like::

    [plans.paid]
    priority = "paid"                 # "paid" or "free"
    tokens_per_minute = 200000
    requests_per_minute = 600
    max_concurrent_requests = 32
    queue_deadline_seconds = 10
    batch_max_concurrent_lines = 64   # optional Batch API limits (gateway/batches/api.py), a lane of
    batch_tokens_per_minute = 2000000 # their own beside the interactive limits: lines in flight,
    batch_enqueued_tokens = 20000000  # tokens a minute, prompt tokens of unfinished batches per
                                      # model; unset: no limit
    storage_quota_bytes = 10000000000 # optional bounds on what the tenant makes the server keep
    max_files = 10000                 # (gateway/bounds.py); unset: the gateway's default
                                      # (--storage-quota-bytes, --max-files, ...)

    budget_usd = 500.0                # optional: or budget_tokens = 2000000 (or both)
    budget_window = "monthly"         # "daily", "monthly" or "none"; UTC calendar windows
    budget_soft_ratio = 0.8           # optional: report crossing 80% of the budget

    [tenants.acme]
    plan = "paid"
    keys = ["sha256:<64 hex digits: SHA-256 of the raw key>"]
    budget_usd = 2000.0               # optional: the same budget_* fields override the plan's

    [prices."SmolLM2-135M-Instruct"]  # USD per 1M tokens (see tenancy.billing)
    input = 0.10
    cached_input = 0.05               # default: input
    output = 0.40
    batch_multiplier = 0.5            # default: 1.0

A plan's budget is a default for each of its tenants, not a pool they share.

Every mistake is a :class:`TenancyConfigError` whose message starts with the dotted path of
the bad field, so a bad file fails at start-up with a line an operator can act on.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from tenancy.billing import FREE, WINDOWS, Budget, Metric, Price, WindowName, micros_of
from tenancy.errors import TenancyConfigError

PriorityName = Literal["paid", "free"]
PRIORITIES: tuple[PriorityName, ...] = ("paid", "free")

# Tenant and plan names end up inside Redis hash tags (``{tenant:acme}:tokens``), so a brace
# or a colon would break the key layout; keep names to a safe, readable alphabet.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEY_HASH_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")

DEFAULT_TENANT = "default"

_PLAN_INT_FIELDS = ("tokens_per_minute", "requests_per_minute", "max_concurrent_requests")
_BUDGET_FIELDS = {"budget_usd", "budget_tokens", "budget_window", "budget_soft_ratio"}
_PLAN_REQUIRED = {"priority", *_PLAN_INT_FIELDS, "queue_deadline_seconds"}
# Optional batch-queue limits (the Batch API, gateway/batches/api.py); unset: no limit.
_PLAN_BATCH_FIELDS = (
    "batch_tokens_per_minute",
    "batch_max_concurrent_lines",
    "batch_enqueued_tokens",
)
# Optional bounds on what a tenant makes the server keep (gateway/bounds.py); unset: the gateway's
# setting of the same name (--storage-quota-bytes, --max-files, ...).
PLAN_BOUND_FIELDS = (
    "responses_max_stored",
    "conversation_max_items",
    "conversation_max_bytes",
    "max_files",
    "storage_quota_bytes",
    "batch_max_open",
    "batch_max_queued_lines",
    "batch_max_running_per_tenant",
    "websocket_max_open",
)
_PLAN_FIELDS = _PLAN_REQUIRED | _BUDGET_FIELDS | set(_PLAN_BATCH_FIELDS) | set(PLAN_BOUND_FIELDS)
_TENANT_FIELDS = {"plan", "keys"} | _BUDGET_FIELDS
_PRICE_FIELDS = {"input", "cached_input", "output", "batch_multiplier"}


@dataclass(frozen=True)
class Plan:
    """What a tenant may use: rates per minute, a concurrency cap, a priority and a deadline.

    ``None`` limits mean "no limit", and a ``None`` deadline "the engine's default"; both are
    used only by the open-mode plan. Plans read from a file always have every value set.
    """

    name: str
    priority: PriorityName
    tokens_per_minute: int | None
    requests_per_minute: int | None
    max_concurrent_requests: int | None
    queue_deadline_seconds: float | None
    budgets: tuple[Budget, ...] = ()  # a default for each tenant of the plan
    batch_tokens_per_minute: int | None = None  # prompt + output tokens of its batches' lines
    batch_max_concurrent_lines: int | None = None  # lines of its batches in flight at once
    # Prompt tokens of its unfinished batches, per model (OpenAI's batch queue limit): a batch that
    # would go over fails validation with `token_limit_exceeded`.
    batch_enqueued_tokens: int | None = None
    # Bounds on what it makes the server keep (gateway/bounds.py; None: the gateway's default).
    responses_max_stored: int | None = None  # stored responses and conversations (the LRU evicts)
    conversation_max_items: int | None = None  # items of one conversation
    conversation_max_bytes: int | None = None  # bytes of one conversation as stored
    max_files: int | None = None  # its files (/v1/files, batch outputs)
    storage_quota_bytes: int | None = None  # bytes of its files
    batch_max_open: int | None = None  # its batches not yet completed, failed, expired or cancelled
    batch_max_queued_lines: int | None = None  # the lines of those batches
    batch_max_running_per_tenant: int | None = None  # of them running at once on one gateway
    websocket_max_open: int | None = None  # its Responses WebSockets open at once on one gateway

    @property
    def unlimited(self) -> bool:
        """True when the plan sets no rate or concurrency limit at all."""
        return (
            self.tokens_per_minute is None
            and self.requests_per_minute is None
            and self.max_concurrent_requests is None
        )


@dataclass(frozen=True)
class Tenant:
    """A customer: its name, its resolved plan, the hashes of its static API keys, and its
    budgets (the plan's, each overridden by the tenant's own of the same metric)."""

    name: str
    plan: Plan
    key_hashes: tuple[str, ...] = ()
    budgets: tuple[Budget, ...] = ()


@dataclass(frozen=True)
class TenancyConfig:
    """All plans, tenants and model prices, keyed by name. Cross-references are already resolved."""

    plans: Mapping[str, Plan] = field(default_factory=dict)
    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    prices: Mapping[str, Price] = field(default_factory=dict)
    # The validated document it was built from (tables by section), so that run-time changes
    # (tenancy.admin) can be merged over it and validated by the same rules.
    source: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    def tenant(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return self.tenants.get(name)

    def price(self, model: str) -> Price:
        """The price of ``model``; a model without one costs nothing (token budgets still count)."""
        return self.prices.get(model, FREE)


OPEN_PLAN = Plan(
    name="open",
    priority="paid",
    tokens_per_minute=None,
    requests_per_minute=None,
    max_concurrent_requests=None,
    queue_deadline_seconds=None,
)
OPEN_TENANT = Tenant(name=DEFAULT_TENANT, plan=OPEN_PLAN)


def load_config(path: str | Path) -> TenancyConfig:
    """Read and validate the tenants file at ``path``.

    Raises :class:`TenancyConfigError` for a missing or unreadable file, a TOML syntax error
    (tomllib's line and column kept in the message) or any invalid field.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TenancyConfigError(f"{path}: cannot read tenants file: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TenancyConfigError(f"{path}: not UTF-8 text: {exc}") from exc
    return parse_config(text, source=str(path))


def parse_config(text: str, *, source: str = "<tenants>") -> TenancyConfig:
    """Parse TOML text into a :class:`TenancyConfig`; see :func:`load_config` for errors."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message already ends in "(at line L, column C)".
        raise TenancyConfigError(f"{source}: invalid TOML: {exc}") from exc
    return config_from_dict(raw)


def config_from_dict(raw: Mapping[str, Any]) -> TenancyConfig:
    """Validate an already-parsed mapping (the TOML document) into a :class:`TenancyConfig`."""
    unknown = set(raw) - {"plans", "tenants", "prices"}
    if unknown:
        raise TenancyConfigError(
            f"{sorted(unknown)[0]}: unknown section (expected 'plans', 'tenants' or 'prices')"
        )
    prices = {
        model: _parse_price(model, body) for model, body in _table(raw.get("prices", {}), "prices").items()
    }
    plans_raw = _table(raw.get("plans", {}), "plans")
    tenants_raw = _table(raw.get("tenants", {}), "tenants")
    if not plans_raw:
        raise TenancyConfigError("plans: at least one plan is required")
    if not tenants_raw:
        raise TenancyConfigError("tenants: at least one tenant is required")

    plans = {name: _parse_plan(name, body) for name, body in plans_raw.items()}
    plan_fields = {
        name: _budget_fields(body, f"plans.{name}", f"plan {name}") for name, body in plans_raw.items()
    }
    tenants: dict[str, Tenant] = {}
    owner_of: dict[str, str] = {}
    for name, body in tenants_raw.items():
        tenant = _parse_tenant(name, body, plans, plan_fields)
        for key_hash in tenant.key_hashes:
            if key_hash in owner_of:
                raise TenancyConfigError(
                    f"tenants.{name}.keys: key {key_hash[:15]}... is already a key of tenant "
                    f"'{owner_of[key_hash]}'"
                )
            owner_of[key_hash] = name
        tenants[name] = tenant
    source = {
        section: dict(_table(raw.get(section, {}), section)) for section in ("plans", "tenants", "prices")
    }
    return TenancyConfig(plans=plans, tenants=tenants, prices=prices, source=source)


def _table(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TenancyConfigError(f"{path}: expected a table, got {type(value).__name__}")
    return cast(dict[str, Any], value)


def _check_fields(
    table: Mapping[str, Any],
    path: str,
    allowed: set[str],
    required: Iterable[str] = (),
    *,
    unknown_note: str = "",
    missing_note: str = "",
) -> None:
    """That ``table`` has only ``allowed`` fields and each ``required`` one; else the error naming
    the first field at fault (the notes end its message)."""
    unknown = set(table) - allowed
    if unknown:
        raise TenancyConfigError(f"{path}.{sorted(unknown)[0]}: unknown field{unknown_note}")
    for key in required:
        if key not in table:
            raise TenancyConfigError(f"{path}.{key}: missing{missing_note}")


def _check_name(name: str, path: str) -> None:
    if not NAME_PATTERN.match(name):
        raise TenancyConfigError(
            f"{path}: invalid name {name!r} (letters, digits, '_', '.', '-'; at most 64 characters)"
        )


def _parse_plan(name: str, body: object) -> Plan:
    path = f"plans.{name}"
    _check_name(name, path)
    table = _table(body, path)
    _check_fields(table, path, _PLAN_FIELDS, sorted(_PLAN_REQUIRED))

    priority = table["priority"]
    if priority not in PRIORITIES:
        raise TenancyConfigError(f"{path}.priority: must be 'paid' or 'free', got {priority!r}")
    limits = {key: _integer(table, key, path) for key in _PLAN_INT_FIELDS}
    for key in (*_PLAN_BATCH_FIELDS, *PLAN_BOUND_FIELDS):
        if table.get(key) is not None:
            _integer(table, key, path)
    deadline = table["queue_deadline_seconds"]
    if not isinstance(deadline, int | float) or isinstance(deadline, bool) or not deadline > 0:
        raise TenancyConfigError(f"{path}.queue_deadline_seconds: must be a number > 0, got {deadline!r}")
    return Plan(
        name=name,
        priority=cast(PriorityName, priority),
        tokens_per_minute=limits["tokens_per_minute"],
        requests_per_minute=limits["requests_per_minute"],
        max_concurrent_requests=limits["max_concurrent_requests"],
        queue_deadline_seconds=float(deadline),
        budgets=_budgets(_budget_fields(table, path, f"plan {name}"), path, _both(f"plan {name}")),
        **{key: table[key] for key in (*_PLAN_BATCH_FIELDS, *PLAN_BOUND_FIELDS) if key in table},
    )


def _parse_tenant(
    name: str, body: object, plans: Mapping[str, Plan], plan_fields: Mapping[str, _BudgetFields]
) -> Tenant:
    path = f"tenants.{name}"
    _check_name(name, path)
    table = _table(body, path)
    _check_fields(table, path, _TENANT_FIELDS, ("plan",))
    plan_name = table["plan"]
    if not isinstance(plan_name, str):
        raise TenancyConfigError(f"{path}.plan: must be a plan name (string), got {plan_name!r}")
    if plan_name not in plans:
        raise TenancyConfigError(f"{path}.plan: unknown plan {plan_name!r}")

    keys = table.get("keys", [])
    if not isinstance(keys, list):
        raise TenancyConfigError(f"{path}.keys: must be a list of 'sha256:<hex>' strings")
    seen: set[str] = set()
    for index, key in enumerate(keys):
        if not isinstance(key, str) or not KEY_HASH_PATTERN.match(key):
            # Never echo the value: someone may have pasted a raw key here by mistake.
            raise TenancyConfigError(
                f"{path}.keys[{index}]: must be 'sha256:' followed by 64 lowercase hex digits "
                "(the SHA-256 of the raw key, e.g. from `batchgate keys hash`), not the raw key"
            )
        if key in seen:
            raise TenancyConfigError(f"{path}.keys[{index}]: duplicate key")
        seen.add(key)
    plan = plans[plan_name]
    own = _budget_fields(table, path, f"tenant {name}")
    base = plan_fields[plan_name]
    sources = {
        "usd": own.source if own.usd is not None else base.source,
        "tokens": own.source if own.tokens is not None else base.source,
    }
    budgets = _budgets(own.over(base), path, sources)
    return Tenant(name=name, plan=plan, key_hashes=tuple(keys), budgets=budgets)


def _both(source: str) -> dict[str, str]:
    return {"usd": source, "tokens": source}


def _integer(table: Mapping[str, Any], key: str, path: str, minimum: int = 1) -> int:
    value = table[key]
    # bool is an int subclass; `true` is never a sensible count.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TenancyConfigError(f"{path}.{key}: must be an integer >= {minimum}, got {value!r}")
    return value


def _number(table: Mapping[str, Any], key: str, path: str) -> float:
    value = table[key]
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise TenancyConfigError(f"{path}.{key}: must be a number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class _BudgetFields:
    """The ``budget_*`` fields one table sets, validated; None: not set there."""

    usd: int | None = None
    tokens: int | None = None
    window: str | None = None
    soft_ratio: float | None = None
    source: str = ""

    def over(self, base: _BudgetFields) -> _BudgetFields:
        """These fields, each falling back to ``base``'s (a tenant's over its plan's)."""
        return _BudgetFields(
            self.usd if self.usd is not None else base.usd,
            self.tokens if self.tokens is not None else base.tokens,
            self.window or base.window,
            self.soft_ratio if self.soft_ratio is not None else base.soft_ratio,
            self.source,
        )


def _budget_fields(table: Mapping[str, Any], path: str, source: str) -> _BudgetFields:
    usd: int | None = None
    tokens: int | None = None
    soft: float | None = None
    window = table.get("budget_window")
    if window is not None and window not in WINDOWS:
        raise TenancyConfigError(
            f"{path}.budget_window: must be 'daily', 'monthly' or 'none', got {window!r}"
        )
    if "budget_soft_ratio" in table:
        soft = _number(table, "budget_soft_ratio", path)
        if not 0 < soft <= 1:
            raise TenancyConfigError(f"{path}.budget_soft_ratio: must be in (0, 1], got {soft!r}")
    if "budget_usd" in table:
        try:
            usd = micros_of(_number(table, "budget_usd", path), f"{path}.budget_usd")
        except ValueError as exc:
            raise TenancyConfigError(str(exc)) from None
    if "budget_tokens" in table:
        tokens = _integer(table, "budget_tokens", path, minimum=0)
    return _BudgetFields(usd, tokens, window, soft, source)


def _budgets(fields: _BudgetFields, path: str, sources: Mapping[str, str]) -> tuple[Budget, ...]:
    """The budgets ``fields`` define; ``sources`` names where each metric was set."""
    if fields.usd is None and fields.tokens is None:
        if fields.window is not None or fields.soft_ratio is not None:
            raise TenancyConfigError(
                f"{path}: budget_window/budget_soft_ratio need budget_usd or budget_tokens"
            )
        return ()
    if fields.window is None:
        raise TenancyConfigError(f"{path}.budget_window: missing ('daily', 'monthly' or 'none')")
    window = cast(WindowName, fields.window)
    budgets = []
    for metric, limit in (("usd", fields.usd), ("tokens", fields.tokens)):
        if limit is not None:
            budgets.append(
                Budget(cast(Metric, metric), limit, window, fields.soft_ratio, source=sources[metric])
            )
    return tuple(budgets)


def key_budgets(table: Mapping[str, Any], key_id: str) -> tuple[Budget, ...]:
    """The budgets of one API key, from its ``budget_*`` fields (as a tenant's); scope
    ``key:<key id>``. Raises TenancyConfigError naming the field."""
    path = f"keys.{key_id}"
    _check_fields(table, path, _BUDGET_FIELDS, unknown_note=" (budget_* fields only)")
    fields = _budget_fields(table, path, f"key {key_id}")
    budgets = _budgets(fields, path, _both(f"key {key_id}"))
    return tuple(
        Budget(b.metric, b.limit, b.window, b.soft_ratio, scope=f"key:{key_id}", source=b.source)
        for b in budgets
    )


def _parse_price(model: str, body: object) -> Price:
    path = f'prices."{model}"'
    table = _table(body, path)
    _check_fields(table, path, _PRICE_FIELDS, ("input", "output"), missing_note=" (USD per 1M tokens)")
    try:
        values = {
            key: micros_of(_number(table, key, path), f"{path}.{key}")
            for key in ("input", "cached_input", "output", "batch_multiplier")
            if key in table
        }
    except ValueError as exc:
        raise TenancyConfigError(str(exc)) from None
    return Price(
        input=values["input"],
        cached_input=values.get("cached_input", values["input"]),
        output=values["output"],
        batch_multiplier_ppm=values.get("batch_multiplier", 1_000_000),
    )
