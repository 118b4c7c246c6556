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
import asyncio
import csv
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tenancy.config import load_config
from tenancy.errors import TenancyError, UnknownTenantError
from tenancy.keys import IssuedKey, Revocation, hash_key, issue_key, new_key, revoke_key
from tenancy.keyspace import open_async, open_sync
from tenancy.ledger import GROUPS, LEDGER_FILE, LedgerQuery, MemoryStore, Sums, page, read_redis_sums
from tenancy.usage import TenantUsage, read_redis_usage_sync

REDIS_URL_ENV = "BATCHGATE_REDIS_URL"
STORAGE_DIR_ENV = "BATCHGATE_STORAGE_DIR"
WIDTHS = {"1h": 3600, "1d": 86400}
CSV_COLUMNS = (
    "start_time", "end_time", "project_id", "model", "api_key_id", "batch",
    "num_model_requests", "input_tokens", "input_cached_tokens", "output_tokens", "cost_micros",
)  # fmt: skip
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


def usage_buckets(
    *,
    tenants: list[str],
    start_time: int,
    end_time: int,
    bucket_width: str = "1d",
    group_by: list[str] | None = None,
    redis_url: str | None = None,
    storage_dir: str | None = None,
    as_csv: bool = False,
    out: TextIO | None = None,
) -> list[dict[str, Any]]:
    """Print the ledger's buckets (the organization Usage API's shape, as JSON, or CSV) for
    ``tenants`` (all with usage in Redis when empty), from Redis or the storage directory."""
    out = out or sys.stdout
    if bucket_width not in WIDTHS:
        raise TenancyError(f"--bucket-width must be 1h or 1d, got {bucket_width!r}")
    for group in group_by or []:
        if group not in GROUPS:
            raise TenancyError(f"--group-by must be among {', '.join(GROUPS)}, got {group!r}")
    width = WIDTHS[bucket_width]
    start_hour, end_hour = (start_time - start_time % width) // 3600, -(-end_time // 3600)
    query = LedgerQuery(start_hour, end_hour, width // 3600, tuple(group_by or ()))
    sums: Sums
    if redis_url:
        if not tenants:
            client = open_sync(redis_url)
            try:
                tenants = list(read_redis_usage_sync(client))
            finally:
                client.close()
        sums = asyncio.run(_redis_sums(redis_url, tenants, query))
    elif storage_dir:
        path = Path(storage_dir) / LEDGER_FILE
        if not path.exists():
            raise TenancyError(f"no ledger at {path}")
        store = MemoryStore(path)
        try:
            if not tenants:
                tenants = sorted({r.tenant for r in store.ledger_all(start_hour, end_hour)})
            sums = store.sums(tenants, query)
        finally:
            store.close()
    else:
        raise TenancyError(
            f"--redis-url (or ${REDIS_URL_ENV}) or --storage-dir (or ${STORAGE_DIR_ENV}) is needed"
        )
    data = page(sums, start_time=start_time, end_time=end_time, bucket_width_s=width, group_by=group_by or [])
    if as_csv:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for bucket in data:
            for result in bucket["results"]:
                row = {**result, "start_time": bucket["start_time"], "end_time": bucket["end_time"]}
                writer.writerow(["" if row.get(c) is None else row[c] for c in CSV_COLUMNS])
    else:
        print(json.dumps({"object": "page", "data": data, "has_more": False}, indent=2), file=out)
    return data


async def _redis_sums(url: str, tenants: list[str], query: LedgerQuery) -> Sums:
    client = open_async(url, operation_timeout_s=10.0)
    try:
        return await read_redis_sums(client, tenants, query)
    finally:
        await client.aclose()


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

    usage_parser = subparsers.add_parser(
        "usage",
        help="show usage: lifetime totals per tenant, or the ledger's buckets (with --bucket-width, "
        "--start-time, --tenant or --group-by)",
    )
    usage_parser.add_argument("--redis-url", default=redis_default, help=redis_help)
    usage_parser.add_argument(
        "--storage-dir",
        default=os.environ.get(STORAGE_DIR_ENV),
        help=f"the gateway's storage directory: read its ledger without Redis (default: ${STORAGE_DIR_ENV})",
    )
    usage_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    usage_parser.add_argument("--csv", action="store_true", help="the ledger's buckets as CSV")
    usage_parser.add_argument("--tenant", action="append", default=[], help="only this tenant (repeatable)")
    usage_parser.add_argument("--start-time", type=int, help="Unix seconds (default: 24 hours ago)")
    usage_parser.add_argument("--end-time", type=int, help="Unix seconds, exclusive (default: now)")
    usage_parser.add_argument("--bucket-width", choices=tuple(WIDTHS), help="1h or 1d (default 1d)")
    usage_parser.add_argument("--group-by", action="append", default=[], choices=GROUPS, help="repeatable")
    usage_parser.set_defaults(**{_HANDLER: _run_usage})
    _add_admin(subparsers, redis_default)


def _add_admin(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], redis_default: str | None
) -> None:
    """``batchgate admin ...``: the admin API's verbs over the same code (tenancy.admin)."""
    admin = subparsers.add_parser(
        "admin", help="plans, tenants, prices, keys and the audit log at run time (Redis)"
    )
    admin.add_argument("--redis-url", default=redis_default, help=f"Redis URL (default: ${REDIS_URL_ENV})")
    admin.add_argument(
        "--tenants", default=os.environ.get(TENANTS_ENV), help=f"the tenants file (default: ${TENANTS_ENV})"
    )
    what = admin.add_subparsers(dest="admin_what", required=True)
    for noun in ("plans", "tenants", "prices"):
        sub = what.add_parser(noun, help=f"list, get, put or delete {noun}").add_subparsers(
            dest="admin_verb", required=True
        )
        sub.add_parser("list")
        for verb in ("get", "delete"):
            sub.add_parser(verb).add_argument("name")
        put = sub.add_parser("put", help="create or replace, from the table's fields as JSON")
        put.add_argument("name")
        put.add_argument(
            "--json", required=True, dest="table", help='e.g. \'{"plan": "paid", "budget_usd": 5}\''
        )
    keys = what.add_parser("keys", help="list, issue, rotate or revoke keys").add_subparsers(
        dest="admin_verb", required=True
    )
    keys.add_parser("list").add_argument("--tenant", required=True)
    issue = keys.add_parser("issue", help="a new key, printed once")
    issue.add_argument("--tenant", required=True)
    issue.add_argument("--name", default="")
    issue.add_argument("--expires-in-days", type=float)
    keys.add_parser("rotate", help="a new key for the same tenant; the old one revoked").add_argument("key")
    keys.add_parser("revoke").add_argument("key")
    audit = what.add_parser("audit", help="the newest changes")
    audit.add_argument("--limit", type=int, default=100)
    admin.set_defaults(**{_HANDLER: _run_admin})


def admin(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> Any:
    """Run one ``batchgate admin`` verb; JSON (or a raw key, once) to ``out``."""
    import getpass

    from tenancy.admin import AdminStore

    out, err = out or sys.stdout, err or sys.stderr
    if not args.tenants:
        raise TenancyError(f"--tenants (or ${TENANTS_ENV}) is required: run-time changes merge over it")
    redis_url = _require_redis(args)
    actor = f"cli:{getpass.getuser()}"

    async def run() -> Any:
        store = AdminStore(open_async(redis_url, operation_timeout_s=5.0), load_config(args.tenants))
        try:
            return await _admin_verb(store, args, actor)
        finally:
            await store.client.aclose()

    result = asyncio.run(run())
    if hasattr(result, "raw_key"):
        print(result.raw_key, file=out)
        print(f"issued {result.key_hash} for tenant {result.tenant!r}; shown only this once", file=err)
    else:
        print(json.dumps(result, indent=2, sort_keys=True), file=out)
    return result


async def _admin_verb(store: Any, args: argparse.Namespace, actor: str) -> Any:
    what, verb = args.admin_what, getattr(args, "admin_verb", None)
    now = time.time()
    if what in ("plans", "tenants", "prices"):
        noun = what[:-1]
        if verb == "put":
            try:
                table = json.loads(args.table)
            except ValueError as exc:
                raise TenancyError(f"--json: not JSON: {exc}") from None
            await getattr(store, f"put_{noun}")(args.name, table, actor)
        elif verb == "delete":
            await getattr(store, f"delete_{noun}")(args.name, actor)
            return {"deleted": args.name}
        source = (await store.config()).source[what]
        if verb == "list":
            return source
        if args.name not in source:
            raise UnknownTenantError(f"no {what[:-1]} named {args.name!r}")
        return source[args.name]
    if what == "keys":
        if verb == "list":
            return [k.body(now) for k in await store.keys(args.tenant)]
        if verb == "issue":
            expires = None if args.expires_in_days is None else now + args.expires_in_days * 86400
            return await store.issue_key(args.tenant, actor, name=args.name, expires_at=expires)
        if verb == "rotate":
            return await store.rotate_key(args.key, actor)
        info = await store.revoke_key(args.key, actor)
        return {"revoked": info.key_id, "tenant": info.tenant}
    return await store.audit(args.limit)


def _run_admin(args: argparse.Namespace) -> None:
    from tenancy.admin import NotFoundError

    try:
        admin(args)
    except NotFoundError as exc:
        raise TenancyError(str(exc)) from None


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
    ledger = any((args.csv, args.tenant, args.group_by, args.bucket_width))
    ledger = ledger or args.start_time is not None or args.end_time is not None
    if not ledger and (args.redis_url or not args.storage_dir):  # lifetime totals live in Redis only
        usage(_require_redis(args), as_json=args.json)
        return
    end = args.end_time if args.end_time is not None else int(time.time()) + 1
    usage_buckets(
        tenants=args.tenant,
        start_time=args.start_time if args.start_time is not None else end - 86400,
        end_time=end,
        bucket_width=args.bucket_width or "1d",
        group_by=args.group_by,
        redis_url=args.redis_url,
        storage_dir=args.storage_dir,
        as_csv=args.csv,
    )


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m tenancy.cli keys new ...``) with just these subcommands."""
    parser = argparse.ArgumentParser(prog="batchgate")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
