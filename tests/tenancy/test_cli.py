"""The tenancy subcommands, parsed the way the gateway's CLI will wire them."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
from pathlib import Path

import pytest

from tenancy import cli
from tenancy.keys import hash_key
from tenancy.limiter import MemoryLimiter
from tenancy.redis_limiter import RedisLimiter
from tests.tenancy.conftest import make_plan


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="batchgate")
    subparsers = top.add_subparsers(dest="command", required=True)
    subparsers.add_parser("serve")  # the gateway's own subcommand, untouched
    cli.add_subcommands(subparsers)
    return top


def test_gateway_subcommands_are_not_claimed() -> None:
    assert not cli.handles(parser().parse_args(["serve"]))


def test_keys_new_without_redis_prints_a_key_and_its_hash(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["keys", "new", "--tenant", "acme"])
    assert cli.handles(args)
    assert cli.run(args) == 0
    out, err = capsys.readouterr()
    raw = out.strip()
    assert raw.startswith("bg-") and hash_key(raw) in err and raw not in err


def test_keys_hash_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("bg-secret\n"))
    assert cli.run(parser().parse_args(["keys", "hash"])) == 0
    assert capsys.readouterr().out.strip() == hash_key("bg-secret")


def test_commands_needing_redis_say_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(cli.REDIS_URL_ENV, raising=False)
    assert cli.run(parser().parse_args(["usage"])) == 1
    assert "--redis-url" in capsys.readouterr().err


def test_unreachable_redis_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.conftest_redis import free_port

    args = parser().parse_args(["keys", "revoke", "bg-x", "--redis-url", f"redis://127.0.0.1:{free_port()}"])
    assert cli.run(args) == 1
    assert "Redis unavailable" in capsys.readouterr().err


async def test_usage_lists_tenants_from_redis(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    limiter = RedisLimiter.from_url(redis_url)
    try:
        for i, (tenant, prompt, completion) in enumerate([("acme", 10, 3), ("acme", 5, 1), ("globex", 7, 7)]):
            lease = (await limiter.admit(tenant, make_plan(), prompt + 10, f"r{i}")).lease
            assert lease is not None
            await limiter.settle(lease, prompt, completion)
    finally:
        await limiter.aclose()
    assert cli.run(parser().parse_args(["usage", "--redis-url", redis_url, "--json"])) == 0
    assert json.loads(capsys.readouterr().out) == {
        "acme": {"requests": 2, "prompt_tokens": 15, "completion_tokens": 4, "total_tokens": 19},
        "globex": {"requests": 1, "prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14},
    }
    totals = cli.usage(redis_url, out=io.StringIO())
    assert totals["acme"].num_requests == 2


async def test_memory_usage_is_per_process() -> None:
    limiter = MemoryLimiter()
    lease = (await limiter.admit("acme", make_plan(), 5, "r")).lease
    assert lease is not None
    await limiter.settle(lease, 2, 3)
    assert (await limiter.usage())["acme"].total_tokens == 5


def test_usage_reads_the_ledgers_buckets_from_redis_and_the_storage_dir(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tenancy.billing import Charge, Price
    from tenancy.ledger import LEDGER_FILE, MemoryStore
    from tenancy.limiter import MemoryLimiter

    price = Price(1_000_000, 500_000, 2_000_000)

    async def fill() -> None:
        redis_limiter = RedisLimiter.from_url(redis_url)
        memory_limiter = MemoryLimiter(store=MemoryStore(tmp_path / LEDGER_FILE))
        try:
            for limiter in (redis_limiter, memory_limiter):
                for i, model in enumerate(("m1", "m2", "m1")):
                    charge = Charge(model=model, key_id="key_x", price=price)
                    lease = (await limiter.admit("acme", make_plan(), 20, f"r{i}", charge)).lease
                    assert lease is not None
                    await limiter.settle(lease, 10, 5)
        finally:
            await redis_limiter.aclose()
            await memory_limiter.aclose()

    asyncio.run(fill())
    for source in (["--redis-url", redis_url], ["--storage-dir", str(tmp_path)]):
        argv = ["usage", *source, "--bucket-width", "1h", "--group-by", "model", "--tenant", "acme"]
        assert cli.run(parser().parse_args(argv)) == 0
        page = json.loads(capsys.readouterr().out)
        results = [r for bucket in page["data"] for r in bucket["results"]]
        assert {
            (r["model"], r["num_model_requests"], r["output_tokens"], r["cost_micros"]) for r in results
        } == {
            ("m1", 2, 10, 40),
            ("m2", 1, 5, 20),
        }
        assert cli.run(parser().parse_args([*argv, "--csv"])) == 0
        header, *lines = capsys.readouterr().out.splitlines()
        assert header.startswith("start_time,end_time,project_id,model") and len(lines) == 2


def test_admin_verbs_change_what_the_gateway_serves(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tenancy.service import Tenancy

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[plans.paid]\npriority = "paid"\ntokens_per_minute = 1000\nrequests_per_minute = 10\n'
        'max_concurrent_requests = 2\nqueue_deadline_seconds = 5\n\n[tenants.seed]\nplan = "paid"\n'
    )
    base = ["admin", "--redis-url", redis_url, "--tenants", str(tenants)]

    def run(*argv: str) -> str:
        assert cli.run(parser().parse_args([*base, *argv])) == 0
        return capsys.readouterr().out

    run(
        "tenants", "put", "newco", "--json", '{"plan": "paid", "budget_usd": 2.5, "budget_window": "monthly"}'
    )
    assert json.loads(run("tenants", "get", "newco"))["budget_usd"] == 2.5
    raw = run("keys", "issue", "--tenant", "newco", "--name", "ci").strip()
    assert raw.startswith("bg-")
    (listed,) = json.loads(run("keys", "list", "--tenant", "newco"))
    assert listed["key_hash"] == hash_key(raw) and listed["name"] == "ci" and raw not in json.dumps(listed)

    async def resolve(key: str) -> str | None:
        tenancy = Tenancy.from_settings(str(tenants), redis_url)
        try:
            assert tenancy.admin is not None
            tenancy.reconfigure(await tenancy.admin.config())  # what the gateway's watcher does
            identity = await tenancy.identify(f"Bearer {key}")
            return f"{identity.tenant.name}:{identity.tenant.budgets[0].limit}"
        except Exception:  # noqa: BLE001 - AuthError: the key does not resolve
            return None
        finally:
            await tenancy.aclose()

    assert asyncio.run(resolve(raw)) == "newco:2500000"
    run("keys", "revoke", hash_key(raw))
    assert asyncio.run(resolve(raw)) is None
    run("prices", "put", "org/m1", "--json", '{"input": 0.1, "output": 0.4}')
    assert json.loads(run("prices", "list")) == {"org/m1": {"input": 0.1, "output": 0.4}}
    run("prices", "delete", "org/m1")
    assert json.loads(run("prices", "list")) == {}
    audit = json.loads(run("audit"))
    assert [e["action"] for e in reversed(audit)] == [
        "tenant.put",
        "key.issue",
        "key.revoke",
        "price.put",
        "price.delete",
    ]
    assert all(e["actor"].startswith("cli:") for e in audit) and raw not in json.dumps(audit)
    assert cli.run(parser().parse_args([*base, "plans", "delete", "paid"])) == 1  # the only plan: refused
    assert "plans: at least one plan is required" in capsys.readouterr().err
