"""Plans and tenants, parsed from a TOML file into frozen records.

The file looks like::

    [plans.paid]
    priority = "paid"                 # "paid" or "free"
    tokens_per_minute = 200000
    requests_per_minute = 600
    max_concurrent_requests = 32
    queue_deadline_seconds = 10

    [tenants.acme]
    plan = "paid"
    keys = ["sha256:<64 hex digits: SHA-256 of the raw key>"]

Every mistake is a :class:`TenancyConfigError` whose message starts with the dotted path of
the bad field, so a bad file fails at start-up with a line an operator can act on.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from tenancy.errors import TenancyConfigError

PriorityName = Literal["paid", "free"]
PRIORITIES: tuple[PriorityName, ...] = ("paid", "free")

# Tenant and plan names end up inside Redis hash tags (``{tenant:acme}:tokens``), so a brace
# or a colon would break the key layout; keep names to a safe, readable alphabet.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEY_HASH_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")

DEFAULT_TENANT = "default"

_PLAN_INT_FIELDS = ("tokens_per_minute", "requests_per_minute", "max_concurrent_requests")
_PLAN_FIELDS = {"priority", *_PLAN_INT_FIELDS, "queue_deadline_seconds"}
_TENANT_FIELDS = {"plan", "keys"}


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
    """A customer: its name, its resolved plan, and the hashes of its static API keys."""

    name: str
    plan: Plan
    key_hashes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TenancyConfig:
    """All plans and tenants, keyed by name. Cross-references are already resolved."""

    plans: Mapping[str, Plan] = field(default_factory=dict)
    tenants: Mapping[str, Tenant] = field(default_factory=dict)

    def tenant(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return self.tenants.get(name)


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
    unknown = set(raw) - {"plans", "tenants"}
    if unknown:
        raise TenancyConfigError(f"{sorted(unknown)[0]}: unknown section (expected 'plans' or 'tenants')")
    plans_raw = _table(raw.get("plans", {}), "plans")
    tenants_raw = _table(raw.get("tenants", {}), "tenants")
    if not plans_raw:
        raise TenancyConfigError("plans: at least one plan is required")
    if not tenants_raw:
        raise TenancyConfigError("tenants: at least one tenant is required")

    plans = {name: _parse_plan(name, body) for name, body in plans_raw.items()}
    tenants: dict[str, Tenant] = {}
    owner_of: dict[str, str] = {}
    for name, body in tenants_raw.items():
        tenant = _parse_tenant(name, body, plans)
        for key_hash in tenant.key_hashes:
            if key_hash in owner_of:
                raise TenancyConfigError(
                    f"tenants.{name}.keys: key {key_hash[:15]}... is already a key of tenant "
                    f"'{owner_of[key_hash]}'"
                )
            owner_of[key_hash] = name
        tenants[name] = tenant
    return TenancyConfig(plans=plans, tenants=tenants)


def _table(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TenancyConfigError(f"{path}: expected a table, got {type(value).__name__}")
    return cast(dict[str, Any], value)


def _check_name(name: str, path: str) -> None:
    if not NAME_PATTERN.match(name):
        raise TenancyConfigError(
            f"{path}: invalid name {name!r} (letters, digits, '_', '.', '-'; at most 64 characters)"
        )


def _parse_plan(name: str, body: object) -> Plan:
    path = f"plans.{name}"
    _check_name(name, path)
    table = _table(body, path)
    unknown = set(table) - _PLAN_FIELDS
    if unknown:
        raise TenancyConfigError(f"{path}.{sorted(unknown)[0]}: unknown field")
    for key in sorted(_PLAN_FIELDS):
        if key not in table:
            raise TenancyConfigError(f"{path}.{key}: missing")

    priority = table["priority"]
    if priority not in PRIORITIES:
        raise TenancyConfigError(f"{path}.priority: must be 'paid' or 'free', got {priority!r}")
    limits: dict[str, int] = {}
    for key in _PLAN_INT_FIELDS:
        value = table[key]
        # bool is an int subclass; `true` is never a sensible limit.
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TenancyConfigError(f"{path}.{key}: must be an integer >= 1, got {value!r}")
        limits[key] = value
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
    )


def _parse_tenant(name: str, body: object, plans: Mapping[str, Plan]) -> Tenant:
    path = f"tenants.{name}"
    _check_name(name, path)
    table = _table(body, path)
    unknown = set(table) - _TENANT_FIELDS
    if unknown:
        raise TenancyConfigError(f"{path}.{sorted(unknown)[0]}: unknown field")
    if "plan" not in table:
        raise TenancyConfigError(f"{path}.plan: missing")
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
    return Tenant(name=name, plan=plans[plan_name], key_hashes=tuple(keys))
