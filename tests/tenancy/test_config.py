from __future__ import annotations

from pathlib import Path

import pytest

from tenancy.config import load_config, parse_config
from tenancy.errors import TenancyConfigError
from tenancy.keys import hash_key

ACME_HASH = hash_key("bg-acme-key")

GOOD = f"""
[plans.paid]
priority = "paid"
tokens_per_minute = 200000
requests_per_minute = 600
max_concurrent_requests = 32
queue_deadline_seconds = 10

[plans.free]
priority = "free"
tokens_per_minute = 20000
requests_per_minute = 60
max_concurrent_requests = 4
queue_deadline_seconds = 2.5

[tenants.acme]
plan = "paid"
keys = ["{ACME_HASH}"]

[tenants.hobbyist]
plan = "free"
"""


def test_good_file_parses_into_resolved_records(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    config = load_config(path)
    assert set(config.plans) == {"paid", "free"}
    acme = config.tenants["acme"]
    assert acme.plan is config.plans["paid"]
    assert acme.plan.priority == "paid"
    assert acme.plan.tokens_per_minute == 200000
    assert acme.key_hashes == (ACME_HASH,)
    free = config.tenants["hobbyist"].plan
    assert (free.priority, free.max_concurrent_requests, free.queue_deadline_seconds) == ("free", 4, 2.5)
    assert config.tenants["hobbyist"].key_hashes == ()


def _replace(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_replace('plan = "paid"', 'plan = "gold"'), "tenants.acme.plan: unknown plan 'gold'"),
        (_replace('priority = "free"', 'priority = "vip"'), "plans.free.priority: must be 'paid' or 'free'"),
        (_replace("tokens_per_minute = 20000\n", "tokens_per_minute = 0\n"), "plans.free.tokens_per_minute:"),
        (
            _replace("requests_per_minute = 60\n", "requests_per_minute = 6.5\n"),
            "plans.free.requests_per_minute:",
        ),
        (_replace("max_concurrent_requests = 4\n", ""), "plans.free.max_concurrent_requests: missing"),
        (
            _replace("queue_deadline_seconds = 10", "queue_deadline_seconds = -1"),
            "plans.paid.queue_deadline_seconds",
        ),
        (
            _replace("queue_deadline_seconds = 10", "queue_deadline_seconds = true"),
            "plans.paid.queue_deadline",
        ),
        (
            _replace("max_concurrent_requests = 32", "max_concurrent_requests = true"),
            "plans.paid.max_concurrent",
        ),
        (
            _replace("queue_deadline_seconds = 10", "queue_deadline_seconds = 10\nburst = 3"),
            "plans.paid.burst: unknown",
        ),
        (
            _replace(f'keys = ["{ACME_HASH}"]', 'keys = ["bg-raw-key-pasted"]'),
            "tenants.acme.keys[0]: must be",
        ),
        (_replace(f'keys = ["{ACME_HASH}"]', f'keys = "{ACME_HASH}"'), "tenants.acme.keys: must be a list"),
        (_replace(f'keys = ["{ACME_HASH}"]', f'keys = ["{ACME_HASH}", "{ACME_HASH}"]'), "keys[1]: duplicate"),
        (
            _replace('plan = "free"', f'plan = "free"\nkeys = ["{ACME_HASH}"]'),
            "already a key of tenant 'acme'",
        ),
        (_replace('[tenants.acme]\nplan = "paid"\n', "[tenants.acme]\n"), "tenants.acme.plan: missing"),
        (_replace("[tenants.hobbyist]", '[tenants."evil}tag"]'), "tenants.evil}tag: invalid name"),
        (
            _replace(
                "queue_deadline_seconds = 10", "queue_deadline_seconds = 10\nbatch_max_concurrent_lines = 0"
            ),
            "plans.paid.batch_max_concurrent_lines: must be an integer >= 1",
        ),
        (
            _replace(
                "queue_deadline_seconds = 10", "queue_deadline_seconds = 10\nstorage_quota_bytes = '1GB'"
            ),
            "plans.paid.storage_quota_bytes: must be an integer >= 1",
        ),
        (GOOD + "\n[extra]\nx = 1\n", "extra: unknown section"),
        ("[tenants.a]\nplan = 'x'\n", "plans: at least one plan"),
    ],
)
def test_bad_field_is_named_in_the_error(text: str, message: str) -> None:
    with pytest.raises(TenancyConfigError) as info:
        parse_config(text)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_raw_key_in_file_is_not_echoed() -> None:
    with pytest.raises(TenancyConfigError) as info:
        parse_config(_replace(f'keys = ["{ACME_HASH}"]', 'keys = ["bg-secret-raw-key"]'))
    assert "bg-secret-raw-key" not in str(info.value)


def test_toml_syntax_error_keeps_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD + "\n[tenants.broken\nplan = 1\n")
    with pytest.raises(TenancyConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert str(path) in text
    bad_line = (GOOD + "\n").count("\n") + 1
    assert f"line {bad_line}, column" in text


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(TenancyConfigError, match="cannot read tenants file"):
        load_config(tmp_path / "nope.toml")


BUDGETS = (
    GOOD.replace(
        "queue_deadline_seconds = 2.5\n",
        'queue_deadline_seconds = 2.5\nbudget_usd = 5.0\nbudget_window = "monthly"\n'
        "budget_soft_ratio = 0.8\n",
    )
    + """
[tenants.big]
plan = "free"
budget_usd = 50.25
budget_tokens = 2000000

[prices."SmolLM2-135M-Instruct"]
input = 0.10
cached_input = 0.05
output = 0.40
batch_multiplier = 0.5
"""
)


def test_prices_and_budgets_parse_with_the_issue_field_names() -> None:
    config = parse_config(BUDGETS)
    price = config.price("SmolLM2-135M-Instruct")
    assert (price.input, price.cached_input, price.output, price.batch_multiplier_ppm) == (
        100_000,
        50_000,
        400_000,
        500_000,
    )
    assert config.price("unpriced").cost(10**6, 0, 10**6) == 0
    (plan_budget,) = config.tenants["hobbyist"].budgets
    assert (plan_budget.metric, plan_budget.limit, plan_budget.window) == ("usd", 5_000_000, "monthly")
    assert plan_budget.soft_ratio == 0.8 and plan_budget.source == "plan free"
    usd, tokens = config.tenants["big"].budgets  # the tenant's own override the plan's, per metric
    assert (usd.limit, usd.source, usd.window) == (50_250_000, "tenant big", "monthly")
    assert (tokens.metric, tokens.limit) == ("tokens", 2_000_000)
    assert config.tenants["acme"].budgets == ()


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            ("[tenants.big]\n", "[tenants.big]\nbudget_window = 'weekly'\n"),
            "tenants.big.budget_window: must be",
        ),
        (("budget_usd = 50.25", "budget_usd = -1"), "tenants.big.budget_usd: must be a number >= 0"),
        (("budget_usd = 50.25", "budget_usd = 0.0000001"), "at most 6 decimals"),
        (("budget_tokens = 2000000", "budget_tokens = 1.5"), "tenants.big.budget_tokens: must be an integer"),
        (
            ("budget_soft_ratio = 0.8", "budget_soft_ratio = 1.5"),
            "plans.free.budget_soft_ratio: must be in (0, 1]",
        ),
        (('budget_window = "monthly"\n', ""), "plans.free.budget_window: missing"),
        (("output = 0.40\n", ""), 'prices."SmolLM2-135M-Instruct".output: missing'),
        (("batch_multiplier", "multiplier"), 'prices."SmolLM2-135M-Instruct".multiplier: unknown field'),
    ],
)
def test_bad_budgets_and_prices_name_the_field(patch: tuple[str, str], message: str) -> None:
    with pytest.raises(TenancyConfigError, match=None) as info:
        parse_config(BUDGETS.replace(*patch, 1))
    assert message in str(info.value)


def test_the_batch_limits_are_optional_per_plan() -> None:
    patch = "queue_deadline_seconds = 10\nbatch_tokens_per_minute = 5000\nbatch_max_concurrent_lines = 8"
    config = parse_config(GOOD.replace("queue_deadline_seconds = 10", patch + "\nstorage_quota_bytes = 1000"))
    paid, free = config.plans["paid"], config.plans["free"]
    assert (paid.batch_tokens_per_minute, paid.batch_max_concurrent_lines, paid.storage_quota_bytes) == (
        5000,
        8,
        1000,
    )
    assert (free.batch_tokens_per_minute, free.batch_max_concurrent_lines, free.storage_quota_bytes) == (
        None,
    ) * 3
