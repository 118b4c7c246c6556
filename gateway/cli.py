"""`batchgate`: `serve` starts the gateway; `keys` and `usage` come from tenancy when installed.

batchgate serve                          # bundled model on 127.0.0.1:8000, open mode
batchgate serve --model ./my-llama --port 9000 --kv-cache-memory 2GiB
BATCHGATE_PORT=9000 batchgate serve      # every flag has a BATCHGATE_* variable
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.settings import Settings, option_specs

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from tenancy.service import Tenancy


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


def build_tenancy(settings: Settings) -> Tenancy | None:
    """A `tenancy.Tenancy` when tenants or Redis are configured; None (open mode) otherwise."""
    if settings.tenants is None and settings.redis_url is None:
        return None
    try:
        from tenancy import Tenancy
    except ImportError:
        raise ValueError("--tenants/--redis-url need the tenancy package, which is not installed") from None
    return Tenancy.from_settings(
        settings.tenants,
        settings.redis_url,
        settings.redis_policy,
        lease_ttl_s=settings.request_lease_s,
        storage_dir=settings.storage_dir,
        retention_s=settings.ledger_retention_days * 86400.0,
    )


# After the drain, how long uvicorn waits for connections to close (by then no request runs).
SHUTDOWN_GRACE_S = 5
# After a tensor-parallel replica's engine stops (a rank died or hung), the seconds uvicorn gets to
# end its responses before the process exits regardless.
ENGINE_DEATH_GRACE_S = 15.0


def _stop_when_engine_fails(engine: AsyncEngine, stop: Callable[[], None], poll_s: float = 0.5) -> None:
    """Watch a tensor-parallel engine; once it stops on its own (not by shutdown), call `stop` (the
    server's graceful shutdown), and exit hard if that has not ended the process within the grace
    period. A replica without all its ranks cannot serve again: its supervisor restarts it."""

    def watch() -> None:
        while engine.ready:
            time.sleep(poll_s)
        if engine.stopping:
            return
        logging.getLogger(__name__).error("the engine stopped (%s); exiting", engine.failure_reason)
        stop()
        time.sleep(ENGINE_DEATH_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="batchgate-engine-watch", daemon=True).start()


def check_model_types(settings: Settings) -> None:
    """ValueError (one line: the model, its `model_type`, the families served) for a model folder
    whose config names a model_type the engine cannot serve: refused before anything loads, in
    well under a second, instead of after the server started (engine/model_spec.py)."""
    from engine.model_spec import ModelSpec, UnsupportedModelError

    models = [("--model", settings.model)]
    models += [(f"model {m.name!r}", m.source) for m in settings.served_models() if m.task == "generate"]
    for what, model in models:
        if model is None or model in ("none", "bundled"):
            continue
        config = Path(model).expanduser() / "config.json"
        if not config.is_file():
            continue  # a GGUF file, or no config: the load says what is wrong
        try:
            ModelSpec.from_config(json.loads(config.read_text()))
        except UnsupportedModelError as exc:
            raise ValueError(f"{what} {model}: {exc}") from None
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a config the load reads and refuses with its own message


def serve(settings: Settings, tenancy: Tenancy | None) -> int:
    """Serve until SIGTERM/SIGINT, then drain (see gateway/drain.py); the exit status: 0, or 1
    after a tensor-parallel engine failed or a model failed to load (the server stops as soon as
    the load fails, the reason the last line of stderr: never a live process that cannot get
    ready)."""
    import uvicorn

    from gateway import telemetry
    from gateway.app import create_app
    from gateway.drain import DrainingServer
    from gateway.local.engine_backend import default_engine_factory

    engine_failed = threading.Event()
    load_failures: list[str] = []
    server: uvicorn.Server | None = None

    def stop_failed() -> None:
        engine_failed.set()
        if server is not None:
            server.should_exit = True

    def stop_unloaded(why: str) -> None:  # on the event loop, once the background load failed
        load_failures.append(why)
        if server is not None:
            server.should_exit = True

    def engine_factory(settings: Settings) -> AsyncEngine:
        engine = default_engine_factory(settings)
        if settings.tensor_parallel_size > 1:
            _stop_when_engine_fails(engine, stop_failed)
        return engine

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A native crash (a kernel's SIGSEGV, SIGFPE, SIGILL) prints every thread's Python stack to
    # stderr before the process dies, instead of leaving an empty log.
    faulthandler.enable()
    telemetry.setup()  # only when OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_TRACES_EXPORTER ask for traces
    app = create_app(
        settings,
        tenancy=tenancy,
        owns_tenancy=True,
        engine_factory=engine_factory,
        on_load_failure=stop_unloaded,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = DrainingServer(config, app.state.gateway.drain, settings.drain_timeout_s)
    try:
        server.run()
    finally:
        telemetry.shutdown()
    if load_failures:
        print(f"batchgate: error: {load_failures[0]}", file=sys.stderr)
        return 1
    return 1 if engine_failed.is_set() else 0


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
            check_model_types(settings)
            nothing = settings.model == "none" and settings.embedding_model == "none"
            if nothing and not settings.upstreams and not settings.served_models():
                raise ValueError("--model none and --embedding-model none: nothing to serve")
            tenancy = build_tenancy(settings)
            if settings.tenants and not settings.internal_token:
                raise ValueError(
                    "--tenants needs --internal-token (BATCHGATE_INTERNAL_TOKEN): with tenants, the "
                    "internal routes (/v1/internal/*) take only callers with the token"
                )
        except ValueError as exc:
            print(f"batchgate: error: {exc}", file=sys.stderr)
            return 2
        return serve(settings, tenancy)
    tenancy_cli = _tenancy_cli()
    if tenancy_cli is not None and tenancy_cli.handles(args):
        return int(tenancy_cli.run(args))
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
