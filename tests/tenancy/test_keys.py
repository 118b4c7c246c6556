from __future__ import annotations

import hashlib
import hmac
import re

import pytest

from tenancy.config import parse_config
from tenancy.keys import KeyStore, find_owner, hash_key, key_hash_of, new_key, static_owners

STATIC_KEY = "bg-static-acme"
CONFIG_TEXT = f"""
[plans.paid]
priority = "paid"
tokens_per_minute = 1000
requests_per_minute = 100
max_concurrent_requests = 4
queue_deadline_seconds = 5

[tenants.acme]
plan = "paid"
keys = ["{hash_key(STATIC_KEY)}"]

[tenants.globex]
plan = "paid"
keys = ["{hash_key("bg-globex-1")}", "{hash_key("bg-globex-2")}"]
"""


def test_hash_is_sha256_hex_with_prefix() -> None:
    assert hash_key("abc") == "sha256:" + hashlib.sha256(b"abc").hexdigest()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", hash_key("bg-anything"))


def test_new_keys_are_random_and_prefixed() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(k.startswith("bg-") and len(k) >= 40 for k in keys)


def test_key_hash_of_accepts_raw_or_hashed() -> None:
    digest = hash_key("bg-x")
    assert key_hash_of(digest) == digest
    assert key_hash_of("bg-x") == digest


def test_constant_time_lookup_finds_the_owner_and_compares_every_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    owners = static_owners(parse_config(CONFIG_TEXT))
    assert find_owner(hash_key("bg-globex-2"), owners) == "globex"
    assert find_owner(hash_key(STATIC_KEY), owners) == "acme"
    assert find_owner(hash_key("bg-unknown"), owners) is None
    assert find_owner("not-a-hash-\N{SNOWMAN}", owners) is None

    calls: list[bytes] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append(a)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    first = next(iter(owners))
    assert find_owner(first, owners) is not None
    assert len(calls) == len(owners) == 3  # no early exit on the first (matching) entry


async def test_static_keystore_resolves_keys_without_redis() -> None:
    config = parse_config(CONFIG_TEXT)
    store = KeyStore(config)
    tenant = await store.resolve(STATIC_KEY)
    assert tenant is not None and tenant.name == "acme" and tenant.plan.name == "paid"
    assert await store.resolve("bg-nope") is None
    assert await store.resolve(hash_key(STATIC_KEY)) is None  # the hash itself is not a key


async def test_concurrent_lookups_of_one_key_share_one_round_trip(redis_url: str) -> None:
    """A burst of one key's requests makes one Redis lookup, not one each (with hundreds in flight
    those queued past the timeout, 503s); a lookup after a revocation still sees it at once."""
    import asyncio

    import redis

    from tenancy.keys import revoke_key
    from tenancy.keyspace import open_async

    client = open_async(redis_url)
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        store = KeyStore(parse_config(CONFIG_TEXT), client)
        await store.resolve(STATIC_KEY)  # connect first
        sync.config_resetstat()
        tenants = await asyncio.gather(*(store.resolve(STATIC_KEY) for _ in range(200)))
        assert all(t is not None and t.name == "acme" for t in tenants)
        assert sync.info("commandstats")["cmdstat_sismember"]["calls"] <= 2
        revoke_key(sync, STATIC_KEY)
        assert await store.resolve(STATIC_KEY) is None
    finally:
        sync.close()
        await client.aclose()
