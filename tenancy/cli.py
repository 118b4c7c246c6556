"""The tenancy subcommands of ``batchgate``: ``keys new|revoke|hash`` and ``usage``.

The gateway's CLI owns the top-level parser and wires these in::

    subparsers = parser.add_subparsers(dest="command")
    tenancy.cli.add_subcommands(subparsers)
    ...
    args = parser.parse_args(argv)
    if tenancy.cli.handles(args):
        return tenancy.cli.run(args)

Each ``keys_*``/``usage`` function also works on its own (tests call them directly). Raw keys
go to stdout once and nowhere else; everything else goes to stderr, so
``KEY=$(batchgate keys new --tenant acme)`` captures just the key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from tenancy.config import load_config
from tenancy.errors import TenancyError, UnknownTenantError
from tenancy.keys import IssuedKey, Revocation, hash_key, issue_key, new_key, revoke_key
from tenancy.keyspace import open_sync
from tenancy.usage import TenantUsage, read_redis_usage_sync

REDIS_URL_ENV = "BATCHGATE_REDIS_URL"
TENANTS_ENV = "BATCHGATE_TENANTS"
_HANDLER = "tenancy_handler"


def keys_new(
    redis_url: str | None,
    tenant: str,
    *,
    tenants_file: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> IssuedKey:
    """Issue a key for ``tenant``; print the raw key (once) to ``out``.

    With ``redis_url`` the hash is stored in Redis and the key works at once, no restart.
    Without it nothing is stored: the hash is printed for the tenants file's ``keys`` list.
    With ``tenants_file`` an unknown tenant is refused (UnknownTenantError).
    """
    out, err = out or sys.stdout, err or sys.stderr
    config = load_config(tenants_file) if tenants_file else None
    if redis_url:
        client = open_sync(redis_url)
        try:
            issued = issue_key(client, tenant, config)
        finally:
            client.close()
        print(issued.raw_key, file=out)
        print(f"stored {issued.key_hash} for tenant {tenant!r}; the key is shown only this once", file=err)
        return issued
    if config is not None and config.tenant(tenant) is None:
        raise UnknownTenantError(f"unknown tenant {tenant!r} (not in the tenants file)")
    raw = new_key()
    issued = IssuedKey(raw_key=raw, key_hash=hash_key(raw), tenant=tenant)
    print(raw, file=out)
    print(
        f"no Redis configured: add this key's hash to tenants.{tenant}.keys and restart:\n"
        f'  "{issued.key_hash}"',
        file=err,
    )
    return issued


def keys_revoke(redis_url: str, key_or_hash: str, *, err: TextIO | None = None) -> Revocation:
    """Revoke a key (raw or ``sha256:<hex>``) in Redis; takes effect on the next request."""
    err = err or sys.stderr
    client = open_sync(redis_url)
    try:
        revocation = revoke_key(client, key_or_hash)
    finally:
        client.close()
    owner = f"issued to {revocation.issued_to!r}" if revocation.issued_to else "static or unknown key"
    print(f"revoked {revocation.key_hash} ({owner})", file=err)
    return revocation


def keys_hash(raw_key: str, *, out: TextIO | None = None) -> str:
    """Print and return the ``sha256:<hex>`` form of ``raw_key`` (for the tenants file)."""
    key_hash = hash_key(raw_key)
    print(key_hash, file=out or sys.stdout)
    return key_hash


def usage(redis_url: str, *, as_json: bool = False, out: TextIO | None = None) -> dict[str, TenantUsage]:
    """Print and return every tenant's prompt/completion token and request totals."""
    out = out or sys.stdout
    client = open_sync(redis_url)
    try:
        totals = read_redis_usage_sync(client)
    finally:
        client.close()
    if as_json:
        rows = {
            name: {
                "requests": u.num_requests,
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "total_tokens": u.total_tokens,
            }
            for name, u in totals.items()
        }
        print(json.dumps(rows, indent=2), file=out)
        return totals
    header = f"{'tenant':<24} {'requests':>10} {'prompt_tokens':>14} {'completion_tokens':>18} {'total':>12}"
    print(header, file=out)
    for name, u in totals.items():
        print(
            f"{name:<24} {u.num_requests:>10} {u.prompt_tokens:>14} {u.completion_tokens:>18} "
            f"{u.total_tokens:>12}",
            file=out,
        )
    return totals


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``keys`` and ``usage`` to the ``add_subparsers()`` object of the gateway's parser."""
    redis_default = os.environ.get(REDIS_URL_ENV)
    redis_help = f"Redis URL (default: ${REDIS_URL_ENV})"

    keys = subparsers.add_parser("keys", help="issue, revoke and hash API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)

    new = keys_sub.add_parser("new", help="issue a key for a tenant (printed once)")
    new.add_argument("--tenant", required=True, help="tenant name from the tenants file")
    new.add_argument(
        "--redis-url", default=redis_default, help=redis_help + "; without it, print a hash for the file"
    )
    new.add_argument(
        "--tenants",
        default=os.environ.get(TENANTS_ENV),
        help=f"tenants file to check the name against (default: ${TENANTS_ENV})",
    )
    new.set_defaults(**{_HANDLER: _run_keys_new})

    revoke = keys_sub.add_parser("revoke", help="revoke a key, given raw or as sha256:<hex>")
    revoke.add_argument("key", help="the raw key or its sha256:<hex> hash")
    revoke.add_argument("--redis-url", default=redis_default, help=redis_help)
    revoke.set_defaults(**{_HANDLER: _run_keys_revoke})

    hash_parser = keys_sub.add_parser("hash", help="print the sha256:<hex> of a raw key read from stdin")
    hash_parser.set_defaults(**{_HANDLER: _run_keys_hash})

    usage_parser = subparsers.add_parser("usage", help="show prompt/completion tokens per tenant")
    usage_parser.add_argument("--redis-url", default=redis_default, help=redis_help)
    usage_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    usage_parser.set_defaults(**{_HANDLER: _run_usage})


def handles(args: argparse.Namespace) -> bool:
    """Whether ``args`` came from one of the subcommands added by :func:`add_subcommands`."""
    return callable(getattr(args, _HANDLER, None))


def run(args: argparse.Namespace) -> int:
    """Run the parsed tenancy subcommand; returns the exit status (errors go to stderr)."""
    try:
        getattr(args, _HANDLER)(args)
    except TenancyError as exc:
        print(f"batchgate: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _require_redis(args: argparse.Namespace) -> str:
    if not args.redis_url:
        raise TenancyError(f"--redis-url (or ${REDIS_URL_ENV}) is required for this command")
    return str(args.redis_url)


def _run_keys_new(args: argparse.Namespace) -> None:
    keys_new(args.redis_url, args.tenant, tenants_file=args.tenants)


def _run_keys_revoke(args: argparse.Namespace) -> None:
    keys_revoke(_require_redis(args), args.key)


def _run_keys_hash(args: argparse.Namespace) -> None:
    raw = sys.stdin.readline().strip()
    if not raw:
        raise TenancyError("keys hash: expected the raw key on stdin")
    keys_hash(raw)


def _run_usage(args: argparse.Namespace) -> None:
    usage(_require_redis(args), as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m tenancy.cli keys new ...``) with just these subcommands."""
    parser = argparse.ArgumentParser(prog="batchgate")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
