"""`batchgate`: `serve` starts the gateway; `keys` and `usage` come from tenancy when installed.

batchgate serve                          # bundled model on 127.0.0.1:8000, open mode
batchgate serve --model ./my-llama --port 9000 --kv-cache-memory 2GiB
BATCHGATE_PORT=9000 batchgate serve      # every flag has a BATCHGATE_* variable
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.settings import Settings, option_specs


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _add_serve(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Run the OpenAI-compatible server. Each flag can also be set by the environment "
        "variable shown; a flag wins over its variable.",
    )
    for spec in option_specs():
        default = "none" if spec.default in (None, ()) else spec.default
        serve.add_argument(
            spec.flag,
            dest=spec.name,
            type=_argument_type(spec.parse),
            default=None,
            action="append" if spec.multi else "store",
            choices=spec.choices or None,
            metavar=None if spec.choices else spec.flag.removeprefix("--").replace("-", "_").upper(),
            help=f"{spec.help} [env {spec.env}; default {default}]",
        )


def _flag_value(spec: Any, value: Any) -> Any:
    if spec.multi and value is not None:  # a repeatable flag: a list of parsed tuples
        return tuple(item for parsed in value for item in parsed)
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgate", description="OpenAI-compatible LLM gateway.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(subparsers)
    tenancy_cli = _tenancy_cli()
    if tenancy_cli is not None:
        tenancy_cli.add_subcommands(subparsers)
    return parser


def _tenancy_cli() -> Any:
    try:
        import tenancy.cli as tenancy_cli
    except ImportError:
        return None
    return tenancy_cli


def build_tenancy(settings: Settings) -> Any | None:
    """A `tenancy.Tenancy` when tenants or Redis are configured; None (open mode) otherwise."""
    if settings.tenants is None and settings.redis_url is None:
        return None
    try:
        from tenancy import Tenancy
    except ImportError:
        raise ValueError("--tenants/--redis-url need the tenancy package, which is not installed") from None
    return Tenancy.from_settings(settings.tenants, settings.redis_url, settings.redis_policy)


def serve(settings: Settings, tenancy: Any | None) -> None:
    import uvicorn

    from gateway import telemetry
    from gateway.app import create_app

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    telemetry.setup()  # only when OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_TRACES_EXPORTER ask for traces
    app = create_app(settings, tenancy=tenancy, owns_tenancy=True)
    try:
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            timeout_graceful_shutdown=10,
        )
    finally:
        telemetry.shutdown()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        flags = {spec.name: _flag_value(spec, getattr(args, spec.name)) for spec in option_specs()}
        try:
            settings = Settings.load(flags, os.environ if environ is None else environ)
            if settings.model not in (None, "none") and not Path(settings.model).expanduser().exists():
                raise ValueError(f"--model: {settings.model} does not exist")
            if settings.embedding_model not in ("bundled", "none") and not (
                Path(settings.embedding_model).expanduser().exists()
            ):
                raise ValueError(f"--embedding-model: {settings.embedding_model} does not exist")
            if settings.model == "none" and settings.embedding_model == "none" and not settings.upstreams:
                raise ValueError("--model none and --embedding-model none: nothing to serve")
            tenancy = build_tenancy(settings)
        except ValueError as exc:
            print(f"batchgate: error: {exc}", file=sys.stderr)
            return 2
        serve(settings, tenancy)
        return 0
    tenancy_cli = _tenancy_cli()
    if tenancy_cli is not None and tenancy_cli.handles(args):
        return int(tenancy_cli.run(args))
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
