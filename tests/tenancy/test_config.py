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
