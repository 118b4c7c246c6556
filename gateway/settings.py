"""The gateway's settings: read once at start-up, from flags, `BATCHGATE_*` variables and defaults.

Precedence: a command-line flag, else its environment variable, else the default. Every setting
has one row in the dataclass below (its flag, variable, parser and help come from the field's
metadata), so `batchgate serve --help` and docs/CONFIGURATION.md (gateway/settings_doc.py) cannot drift
from the code. A bad
value is a ValueError naming the flag and the variable, raised before anything starts.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import SETTING_FIELDS, EngineConfig
from engine.embeddings.policy import BatchLimits
from tenancy.limiter import DEFAULT_LEASE_TTL_S

ENV_PREFIX = "BATCHGATE_"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(I?B?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1000' -> 1000 (K/M/G/T and KiB/MiB/GiB/TiB)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"expected a size like 2GiB, 512MB or 1048576, got {text!r}")
    number, power, suffix = m.group(1), m.group(2).upper(), m.group(3).upper()
    if suffix == "I":  # "2Gi" is common shorthand for GiB
        suffix = "IB"
    base = 1024 if suffix == "IB" else 1000
    if suffix == "IB" and not power:
        raise ValueError(f"expected a size like 2GiB, 512MB or 1048576, got {text!r}")
    value = float(number) * base ** _SIZE_POWERS[power]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return int(value)


def _int(text: str) -> int:
    return int(text.strip())


def _float(text: str) -> float:
    value = float(text.strip())
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    """'256,1024,4096' -> (256, 1024, 4096); '' or '0' -> () (off)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if parts == ["0"]:
        return ()
    return tuple(int(p) for p in parts)


def _str(text: str) -> str:
    return text


def _urls(text: str) -> tuple[str, ...]:
    """'http://a:8000, http://b:8000' -> ('http://a:8000', 'http://b:8000')."""
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s) URL, got {url!r}")
    return urls


def _paths(text: str) -> tuple[str, ...]:
    """'/a, /b' -> ('/a', '/b')."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _loras(text: str) -> tuple[str, ...]:
    """'a=/x, b=/y' -> ('a=/x', 'b=/y'), each NAME=PATH (gateway/loras.py splits them)."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"expected NAME=PATH (a PEFT adapter folder), got {item!r}")
    return items


def _opt(
    default: Any,
    parse: Callable[[str], Any],
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] = (),
    multi: bool = False,
) -> Any:
    return field(
        default=default,
        metadata={"parse": parse, "help": help, "flag": flag, "choices": choices, "multi": multi},
    )


def _repeatable(parse: Callable[[str], tuple[str, ...]], help: str) -> Any:
    """A list setting (default empty): its flag, repeatable, names one value (the field's name in
    the singular, `--upstream`); its variable takes a comma-separated list (`BATCHGATE_UPSTREAMS`)."""
    return _opt((), parse, help, multi=True)


# An engine setting's parser, by its field's type (engine/config.py declares a `unit` where the type
# alone does not say how it is written).
_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": _int,
    "int | None": _int,
    "float": _float,
    "float | None": _float,
    "str": _str,
    "str | None": _str,
    "tuple[int, ...]": _int_list,
}
_UNIT_PARSERS: dict[str, Callable[[str], Any]] = {"bytes": parse_bytes}
# Each engine setting's field in its EngineConfig section, by the field's name.
_ENGINE_FIELDS = {name: f for name, (_section, f) in SETTING_FIELDS.items()}


def _engine(name: str) -> Any:
    """The setting of the engine's field `name` (in its EngineConfig section), as that field
    declares it (engine/config.py): its default, help, flag and choices are defined there only."""
    engine_field = _ENGINE_FIELDS[name]
    meta = engine_field.metadata
    default = engine_field.default if meta["server_default"] is None else meta["server_default"]
    parse: Callable[[str], Any] = _str  # choices: one of these words (its type may differ: a bool)
    if not meta["choices"]:
        parse = _UNIT_PARSERS.get(meta["unit"]) or _PARSERS[str(engine_field.type)]
    return field(
        default=default,
        metadata={
            "parse": parse,
            "help": meta["help"],
            "flag": meta["flag"],
            "choices": meta["choices"],
            "multi": False,
            "engine_field": name,
        },
    )


@dataclass(frozen=True)
class Settings:
    """Everything `batchgate serve` needs; defaults serve the bundled model on 127.0.0.1:8000."""

    host: str = _opt("127.0.0.1", _str, "address to bind")
    port: int = _opt(8000, _int, "port to bind")
    # The engine's settings (EngineConfig's sections model, cache, scheduler, speculative, parallel):
    # each defined once, by its section's field (engine/config.py); here only its name and type, for
    # the typed attribute.
    model: str | None = _engine("model")
    served_model_name: str | None = _engine("served_model_name")
    dtype: str = _engine("dtype")
    device: str = _engine("device")
    block_size: int = _engine("block_size")
    kv_cache_memory_bytes: int | None = _engine("kv_cache_memory_bytes")
    max_num_seqs: int = _engine("max_num_seqs")
    max_num_batched_tokens: int = _engine("max_num_batched_tokens")
    max_model_len: int | None = _engine("max_model_len")
    kv_cache_memory_fraction: float = _engine("kv_cache_memory_fraction")
    kv_cache_dtype: str = _engine("kv_cache_dtype")
    queue_deadline_s: float | None = _engine("default_queue_deadline_s")
    engine_stall_timeout_s: float = _opt(
        60.0,
        _float,
        "seconds the engine may go without a step while work waits before /health fails (503), so "
        "the orchestrator restarts the process",
        flag="--engine-stall-timeout",
    )
    num_threads: int | None = _engine("num_threads")
    quantization: str = _engine("quantization")
    int4_max_batch: int = _engine("int4_max_batch")
    kernels: str = _engine("kernels")
    tensor_parallel_size: int = _engine("tensor_parallel_size")
    prefix_caching: str = _engine("enable_prefix_caching")
    batching: str = _engine("batching")
    length_buckets: tuple[int, ...] = _engine("length_buckets")
    long_prefill_share: float = _engine("long_prefill_share")
    target_itl_ms: float = _engine("target_itl_ms")
    speculative_decoding: str = _engine("enable_speculative_decoding")
    num_speculative_tokens: int = _engine("num_speculative_tokens")
    max_body_bytes: int = _opt(
        DEFAULT_MAX_BODY_BYTES, parse_bytes, "largest request body accepted, e.g. 4MiB"
    )
    tenants: str | None = _opt(None, _str, "tenants/plans TOML file (default: open mode, no API keys)")
    redis_url: str | None = _opt(None, _str, "Redis for rate limits shared by replicas (default: in-process)")
    redis_policy: str = _opt(
        "fail_closed",
        _str,
        "when Redis is unreachable: refuse (fail_closed) or admit (fail_open)",
        choices=("fail_closed", "fail_open"),
    )
    request_lease_s: float = _opt(
        DEFAULT_LEASE_TTL_S,
        _float,
        "a request's concurrency lease (and budget hold), renewed every third of it while the request "
        "runs; the leases of a gateway that died lapse after this",
        flag="--request-lease",
    )
    storage_dir: str | None = _opt(
        None,
        _str,
        "directory for the state kept without Redis (SQLite files: budgets' use and the usage "
        "ledger; stored responses and conversations, responses.sqlite3; uploaded files and batches, "
        "batches.sqlite3 and files/), so a restart keeps it "
        "(default: in memory only)",
    )
    files_bucket: str | None = _opt(
        None,
        _str,
        "s3://<bucket>[/<prefix>]: keep the Batch API's file bytes in this S3-compatible bucket instead "
        "of the storage directory's files/ (credentials and region from the AWS_* variables)",
    )
    s3_endpoint_url: str | None = _opt(
        None, _str, "the S3 API's URL for --files-bucket, for MinIO or another S3-compatible store"
    )
    max_file_bytes: int = _opt(
        200 * 1000 * 1000, parse_bytes, "largest file /v1/files accepts (OpenAI's: 200 MB)"
    )
    max_files: int = _opt(
        10_000,
        _int,
        "most files one tenant keeps (uploads and batch outputs), where its plan sets no max_files",
    )
    storage_quota_bytes: int = _opt(
        10 * 1000**3,
        parse_bytes,
        "most bytes of files one tenant keeps (uploads and batch outputs), where its plan sets no "
        "storage_quota_bytes",
    )
    batch_max_lines: int = _opt(50_000, _int, "most requests in one batch's input file (OpenAI's: 50,000)")
    batch_max_concurrent_lines: int = _opt(
        64,
        _int,
        "lines of one tenant's batches in flight at once, where its plan sets no "
        "batch_max_concurrent_lines (open mode, or a plan without it)",
    )
    batch_max_in_flight: int = _opt(
        256,
        _int,
        "lines of all batches this gateway runs in flight at once (the engine's batch class, or the "
        "pool's), over all tenants",
    )
    batch_max_running: int = _opt(
        16,
        _int,
        "batches this gateway runs at once; the others wait, validating (with --redis-url and a "
        "bucket, another gateway with room takes them)",
    )
    batch_max_running_per_tenant: int = _opt(
        4,
        _int,
        "batches of one tenant this gateway runs at once, where its plan sets none; the run slots "
        "go round the tenants with batches waiting",
    )
    batch_max_open: int = _opt(
        100,
        _int,
        "most batches of one tenant not yet completed, failed, expired or cancelled, where its plan "
        "sets no batch_max_open",
    )
    batch_max_queued_lines: int = _opt(
        500_000,
        _int,
        "most lines of one tenant's open batches, where its plan sets no batch_max_queued_lines",
    )
    batch_lease_s: float = _opt(
        30.0,
        _float,
        "a batch's runner lease, renewed every third of it by the gateway running the batch; with "
        "--redis-url, another gateway takes over a batch whose runner's lease lapsed (its gateway died)",
        flag="--batch-lease",
    )
    ledger_retention_days: int = _opt(
        90, _int, "days the usage ledger keeps its hourly counters (Redis or the storage directory)"
    )
    usage_events_file: str | None = _opt(
        None,
        _str,
        "append one JSON line per settled request (tenant, model, key id, tokens, cost, times) to this "
        "file, for a billing pipeline (default: none)",
    )
    usage_events_exporter: str = _opt(
        "none",
        _str,
        "also send each usage event as an OpenTelemetry log record (otlp: OTLP/HTTP protobuf, to "
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT + /v1/logs)",
        choices=("none", "otlp"),
    )
    budget_webhook_url: str | None = _opt(
        None,
        _str,
        "POST here when a settlement crosses a budget's soft threshold (once per window; retried)",
    )
    budget_webhook_secret: str | None = _opt(
        None,
        _str,
        "the budget webhook's signing secret (whsec_<base64>, or any other text as the key itself): "
        "each POST carries webhook-id, webhook-timestamp and webhook-signature (HMAC-SHA256, as "
        "Standard Webhooks and OpenAI's webhooks)",
    )
    admin_key_hash: str | None = _opt(
        None,
        _str,
        "sha256:<hex> of the admin key that opens /admin/... and the all-tenant usage API "
        "(`batchgate keys hash`); without it those routes answer 401",
    )
    console_session_idle_s: float = _opt(
        1800.0,
        _float,
        "the admin console (/ui, on with --admin-key-hash): a session ends after this many seconds "
        "without a page opened or a change made",
        flag="--console-session-idle",
    )
    console_session_max_s: float = _opt(
        28800.0,
        _float,
        "the admin console: a session ends this many seconds after its login, however busy",
        flag="--console-session-max",
    )
    keep_alive_s: float = _opt(15.0, _float, "seconds between SSE keep-alive comments", flag="--keep-alive")
    loras: tuple[str, ...] = _repeatable(
        _loras,
        "a public LoRA adapter of the chat model, NAME=PATH of a PEFT folder (repeatable; the variable "
        "takes a comma-separated list), served as model NAME; tenant-owned ones: the models file's [[loras]]",
    )
    max_loras: int = _engine("max_loras")
    lora_roots: tuple[str, ...] = _repeatable(
        _paths,
        "a folder the admin API (PUT /admin/loras/{name}) may load adapters from, with everything "
        "under it (repeatable; the variable takes a comma-separated list); none: the admin API loads "
        "no adapter from a path",
    )
    upstreams: tuple[str, ...] = _repeatable(
        _urls,
        "gateway-only mode: an engine replica's base URL (repeatable; the variable takes a comma-separated "
        "list); no local model is loaded",
    )
    long_prompt_upstreams: tuple[str, ...] = _repeatable(
        _urls,
        "gateway-only mode: an engine replica reserved for prompts over --long-prompt-threshold "
        "(repeatable; the variable takes a comma-separated list); the --upstream replicas get the "
        "others; either set takes the other's prompts when none of its own replicas is healthy",
    )
    long_prompt_threshold: int = _opt(
        1024,
        _int,
        "gateway-only mode: prompts of more tokens than this go to the --long-prompt-upstream replicas",
    )
    internal_token: str | None = _opt(
        None,
        _str,
        "shared secret between gateways and replicas (x-batchgate-internal header); a replica trusts the "
        "priority and deadline headers of calls that carry it",
    )
    health_interval_s: float = _opt(
        1.0,
        _float,
        "gateway-only mode: seconds between upstream health/stats polls",
        flag="--health-interval",
    )
    route_affinity_tokens: int = _opt(
        4096,
        _int,
        "gateway-only mode: extra outstanding tokens a replica may carry and still get a request whose "
        "tenant and leading prompt it is preferred for (prefix-cache hits); 0: least loaded only",
    )
    embedding_model: str = _opt(
        "bundled",
        _str,
        "the embedding model served at /v1/embeddings beside the chat model: a BERT-family folder "
        "(sentence-transformers layout), bundled (all-MiniLM-L6-v2) or none",
    )
    embedding_max_batch_inputs: int = _opt(
        BatchLimits.max_batch_inputs, _int, "most inputs in one embedding model call"
    )
    embedding_max_batch_tokens: int = _opt(
        BatchLimits.max_batch_tokens, _int, "most padded tokens (inputs x the longest) in one embedding call"
    )
    embedding_max_wait_s: float = _opt(
        BatchLimits.max_wait_s,
        _float,
        "seconds the oldest queued embedding input waits for a fuller batch (a request that finds the "
        "model idle never waits)",
        flag="--embedding-max-wait",
    )
    models_file: str | None = _opt(
        None,
        _str,
        "a TOML file declaring more models served in this process, each under its own name and "
        "settings (see docs/MODELS.md, Several models)",
    )
    drain_timeout_s: float = _opt(
        60.0,
        _float,
        "on SIGTERM/SIGINT, seconds in-flight requests get to finish (new ones get 503) before the "
        "rest are ended (streams with an error event and [DONE]) and the process exits",
        flag="--drain-timeout",
    )
    tool_arguments: str = _opt(
        "declared",
        _str,
        "a tool call's arguments: only the keys its function declares where the parameters schema "
        "does not set additionalProperties (declared, as xgrammar's strict mode), or JSON Schema's "
        "default, any further keys (schema)",
        choices=("declared", "schema"),
    )
    responses_max_stored: int = _opt(
        10_000,
        _int,
        "most stored responses and conversations one tenant keeps (in the storage directory or "
        "Redis), where its plan sets no responses_max_stored; the tenant's least recently used go first",
    )
    conversation_max_items: int = _opt(
        1_000,
        _int,
        "most items of one conversation, where the tenant's plan sets no conversation_max_items",
    )
    conversation_max_bytes: int = _opt(
        4 * 1024 * 1024,
        parse_bytes,
        "most bytes of one conversation held whole, where the tenant's plan sets no conversation_max_bytes",
    )
    compaction_key: str | None = _opt(
        None,
        _str,
        "the key that seals compaction items (32 bytes, hex or base64; gateway/responses/compaction.py): "
        "unset, one is made and kept in --storage-dir (compaction.key), else made per process; a pool's "
        "gateways share one",
    )
    websocket_max_open: int = _opt(
        16,
        _int,
        "most Responses WebSockets one tenant holds open on this gateway, where its plan sets no "
        "websocket_max_open; one more is refused (429) before the upgrade",
    )
    websocket_cache_size: int = _opt(
        32,
        _int,
        "responses a Responses WebSocket keeps for continuing from (store false included); its "
        "least recently used go first",
    )
    websocket_send_buffer_bytes: int = _opt(
        4 * 1024 * 1024,
        parse_bytes,
        "bytes of events a Responses WebSocket holds for a client that reads slower than the model "
        "writes; past it the turn is ended and the socket closed (1008)",
    )
    responses_ttl_s: int = _opt(
        30 * 24 * 3600,
        _int,
        "with --redis-url: seconds a stored response is kept after it was written",
        flag="--responses-ttl",
    )
    responses_store_format: str = _opt(
        "1",
        _str,
        "the format stored responses are written in (both are read): 1 holds each response's whole "
        "history, as the previous release reads it; 2 holds only its own items and a link to the one "
        "before (bytes linear in a conversation's length). Set 2 once every gateway sharing the store "
        "runs this release (docs/OPERATIONS.md)",
        choices=("1", "2"),
    )
    responses_background_lease_s: float = _opt(
        15.0,
        _float,
        "a background response's lease in the response store, renewed while its gateway runs it: "
        "one whose gateway died reads failed once this many seconds have passed",
        flag="--responses-background-lease",
    )
    log_level: str = _opt(
        "info", _str, "log level", choices=("critical", "error", "warning", "info", "debug")
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.health_interval_s > 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if self.long_prompt_upstreams and not self.upstreams:
            raise ValueError("long_prompt_upstreams needs upstreams (--upstream) for the other prompts")
        if set(self.long_prompt_upstreams) & set(self.upstreams):
            raise ValueError("a replica cannot be both an --upstream and a --long-prompt-upstream")
        if self.long_prompt_threshold < 1:
            raise ValueError(f"long_prompt_threshold must be >= 1, got {self.long_prompt_threshold}")
        if self.route_affinity_tokens < 0:
            raise ValueError(f"route_affinity_tokens must be >= 0, got {self.route_affinity_tokens}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.ledger_retention_days < 1:
            raise ValueError(f"ledger_retention_days must be >= 1, got {self.ledger_retention_days}")
        if self.admin_key_hash is not None and not re.match(r"^sha256:[0-9a-f]{64}$", self.admin_key_hash):
            # Never echo it: a raw key may have been pasted here by mistake.
            raise ValueError(
                "admin_key_hash must be 'sha256:' and 64 lowercase hex digits (from `batchgate keys hash`), "
                "not the raw key"
            )
        for name in ("console_session_idle_s", "console_session_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.keep_alive_s > 0:
            raise ValueError(f"keep_alive_s must be > 0, got {self.keep_alive_s}")
        for name in ("websocket_max_open", "websocket_cache_size", "websocket_send_buffer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.responses_max_stored < 1:
            raise ValueError(f"responses_max_stored must be >= 1, got {self.responses_max_stored}")
        if self.responses_background_lease_s <= 0:
            raise ValueError(
                f"responses_background_lease_s must be > 0, got {self.responses_background_lease_s}"
            )
        batch_caps = ("batch_max_lines", "batch_max_concurrent_lines", "batch_max_in_flight")
        bounds = ("max_files", "batch_max_running_per_tenant", "batch_max_open", "batch_max_queued_lines")
        for name in (*batch_caps, "batch_max_running", *bounds, "conversation_max_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.request_lease_s > 0:
            raise ValueError(f"request_lease_s must be > 0, got {self.request_lease_s}")
        if not self.batch_lease_s > 0:
            raise ValueError(f"batch_lease_s must be > 0, got {self.batch_lease_s}")
        if self.responses_ttl_s < 1:
            raise ValueError(f"responses_ttl_s must be >= 1, got {self.responses_ttl_s}")
        if not self.engine_stall_timeout_s > 0:
            raise ValueError(f"engine_stall_timeout_s must be > 0, got {self.engine_stall_timeout_s}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{f.name} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}"
                )
        self.engine_config()  # EngineConfig validates its own fields; fail here, before anything starts
        self.embedding_batch_limits()  # likewise BatchLimits
        for spec in self.served_models():  # and each declared model's own settings
            self.for_model(spec)
        self.served_loras()

    def engine_config(self) -> EngineConfig:
        """The engine's settings, each converted where its server value differs (engine/config.py)."""
        values = {}
        for f in dataclasses.fields(self):
            name = f.metadata.get("engine_field")
            if name is not None:
                to_engine = _ENGINE_FIELDS[name].metadata["to_engine"]
                value = getattr(self, f.name)
                values[name] = value if to_engine is None else to_engine(value)
        return EngineConfig.of(**values)

    def served_loras(self) -> list[LoraSpec]:
        """The adapters `--lora` (public, of the chat model) and the models file's [[loras]] declare."""
        flags = [LoraSpec(*(part.strip() for part in item.split("=", 1))) for item in self.loras]
        declared = [] if self.models_file is None else load_lora_specs(self.models_file)
        names = [spec.name for spec in flags + declared]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"LoRA adapter name(s) declared twice: {', '.join(twice)}")
        return flags + declared

    def served_models(self) -> list[ModelSpec]:
        """The models `models_file` declares (none without one); ValueError naming what is wrong."""
        return [] if self.models_file is None else load_models_file(self.models_file)

    def model_aliases(self) -> list[ModelAlias]:
        """The aliases `models_file` declares (none without one), in order."""
        return [] if self.models_file is None else load_model_aliases(self.models_file)

    def for_model(self, spec: ModelSpec) -> Settings:
        """These settings with one declared model's own: its source, its name, its overrides."""
        if spec.task == "embed":
            return dataclasses.replace(self, embedding_model=spec.source, models_file=None)
        model = None if spec.source == "bundled" else spec.source
        return dataclasses.replace(
            self, model=model, served_model_name=spec.name, models_file=None, loras=(), **spec.overrides
        )

    def embedding_batch_limits(self) -> BatchLimits:
        return BatchLimits(
            max_batch_inputs=self.embedding_max_batch_inputs,
            max_batch_tokens=self.embedding_max_batch_tokens,
            max_wait_s=self.embedding_max_wait_s,
            window_inputs=max(BatchLimits.window_inputs, self.embedding_max_batch_inputs),
        )

    @classmethod
    def load(
        cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """Settings from parsed flags (None = not given), then `BATCHGATE_*` variables, then defaults.

        `flags` values are already parsed (see `option_specs`); environment values are strings.
        """
        flags = flags or {}
        environ = environ or {}
        values: dict[str, Any] = {}
        for spec in option_specs():
            if flags.get(spec.name) is not None:
                values[spec.name] = flags[spec.name]
            elif spec.env in environ and environ[spec.env] != "":
                try:
                    values[spec.name] = spec.parse(environ[spec.env])
                except ValueError as exc:
                    raise ValueError(f"{spec.env}: {exc}") from None
        return cls(**values)


# The settings one model of a models file may set for itself (the engine's that EngineConfig
# declares per model); the rest are the server's.
MODEL_SETTINGS = tuple(
    f.name
    for f in dataclasses.fields(Settings)
    if "engine_field" in f.metadata and _ENGINE_FIELDS[f.metadata["engine_field"]].metadata["per_model"]
)


@dataclass(frozen=True)
class ModelSpec:
    """One model declared in a models file: a chat model (`model = ...`) or an embedding model
    (`embedding_model = ...`), "bundled" or a path, served as `name`, with its own settings."""

    name: str
    task: str  # "generate" or "embed"
    source: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelAlias:
    """Another name for a served model: `name` is a model id or a glob pattern (`claude-*`: `*`,
    `?` and `[...]` as in shell patterns) that requests may send for `model`."""

    name: str
    model: str

    def matches(self, requested: str) -> bool:
        return fnmatch.fnmatchcase(requested, self.name)


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter to load at start: served as `name`, owned by `tenant` (None: public), over
    the chat model named `model` (None: the main one, `--model`)."""

    name: str
    path: str
    tenant: str | None = None
    model: str | None = None


def _read_models_file(path: str) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"models file {path}: {exc}") from None
    tables = ("models", "loras", "aliases")
    extra = sorted(set(data) - set(tables))
    if extra or not all(isinstance(data.get(t, []), list) for t in tables):
        raise ValueError(
            f"models file {path}: expected only [[models]], [[loras]] and [[aliases]] tables, got {extra}"
        )
    return data


def load_model_aliases(path: str) -> list[ModelAlias]:
    """A models file's aliases, tried in order for a model name no model is served under::

        [[aliases]]
        name = "claude-*"                # a model id, or a pattern of them (Claude Code's ids)
        model = "SmolLM2-135M-Instruct"  # the served model (or a replica's) that answers them
    """
    aliases: list[ModelAlias] = []
    for i, entry in enumerate(_read_models_file(path).get("aliases", [])):
        where = f"models file {path}, alias {i + 1}"
        extra = sorted(set(entry) - {"name", "model"})
        if extra:
            raise ValueError(f"{where}: unknown field(s) {', '.join(extra)}; expected name, model")
        for key in ("name", "model"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ValueError(f"{where}: needs a {key} (a string)")
        aliases.append(ModelAlias(entry["name"], entry["model"]))
    return aliases


def load_lora_specs(path: str) -> list[LoraSpec]:
    """A models file's adapters::

        [[loras]]
        name = "acme-support"    # the model id clients send
        path = "/adapters/acme"  # a PEFT folder (adapter_config.json + adapter_model.safetensors)
        tenant = "acme"          # its owner: only acme's keys see and use it (omit: public)
        model = "smollm2-small"  # optional: a [[models]] chat model (default: the main --model)
    """
    specs: list[LoraSpec] = []
    for i, entry in enumerate(_read_models_file(path).get("loras", [])):
        where = f"models file {path}, lora {i + 1}"
        extra = sorted(set(entry) - {"name", "path", "tenant", "model"})
        if extra:
            raise ValueError(
                f"{where}: unknown field(s) {', '.join(extra)}; expected name, path, tenant, model"
            )
        for key in ("name", "path"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ValueError(f"{where}: needs a {key}")
        for key in ("tenant", "model"):
            if key in entry and not isinstance(entry[key], str):
                raise ValueError(f"{where} ({entry['name']}): {key} must be a string")
        specs.append(LoraSpec(entry["name"], entry["path"], entry.get("tenant"), entry.get("model")))
    return specs


def load_models_file(path: str) -> list[ModelSpec]:
    """Read a models file::

        [[models]]
        name = "smollm2-small"   # the id clients send
        model = "bundled"        # a Hugging Face folder, a .gguf file, or bundled
        max_num_seqs = 8         # any of MODEL_SETTINGS (names as in Settings)

        [[models]]
        name = "minilm"
        embedding_model = "bundled"
    """
    data = _read_models_file(path)
    by_name = {f.name: f for f in dataclasses.fields(Settings)}
    specs: list[ModelSpec] = []
    for i, entry in enumerate(data.get("models", [])):
        where = f"models file {path}, model {i + 1}"
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: needs a name")
        if name in {s.name for s in specs}:
            raise ValueError(f"{where}: the name {name!r} is declared twice")
        sources = [k for k in ("model", "embedding_model") if k in entry]
        if len(sources) != 1 or not isinstance(entry[sources[0]], str):
            raise ValueError(
                f"{where} ({name}): give exactly one of model or embedding_model, a path or bundled"
            )
        overrides: dict[str, Any] = {}
        for key, value in entry.items():
            if key in ("name", *sources):
                continue
            if key not in MODEL_SETTINGS or sources[0] == "embedding_model":
                raise ValueError(f"{where} ({name}): {key!r} is not a setting a model can have")
            parse = by_name[key].metadata["parse"]
            overrides[key] = parse(value) if isinstance(value, str) and parse is not _str else value
        task = "generate" if sources[0] == "model" else "embed"
        specs.append(ModelSpec(name, task, entry[sources[0]], overrides))
    return specs


@dataclass(frozen=True)
class OptionSpec:
    name: str
    flag: str
    env: str
    parse: Callable[[str], Any]
    help: str
    default: Any
    choices: tuple[str, ...]
    multi: bool = False  # repeatable flag; its values are concatenated


def option_specs() -> list[OptionSpec]:
    """One row per setting: field name, flag, environment variable, parser, help, default."""
    specs = []
    for f in dataclasses.fields(Settings):
        multi = f.metadata.get("multi", False)
        # A repeatable flag names one value (`--lora`); its variable, the list (`BATCHGATE_LORAS`).
        flag = f.metadata.get("flag") or "--" + f.name.removesuffix("s" if multi else "").replace("_", "-")
        env = ENV_PREFIX + (f.name if multi else flag.removeprefix("--").replace("-", "_")).upper()
        specs.append(
            OptionSpec(
                f.name,
                flag,
                env,
                f.metadata["parse"],
                f.metadata["help"],
                f.default,
                f.metadata["choices"],
                multi,
            )
        )
    return specs
