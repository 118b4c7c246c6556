"""Each engine setting is defined once, by its EngineConfig field (engine/config.py): the server's
flags, variables and models-file keys are generated from those fields, under today's names."""

from __future__ import annotations

import dataclasses

from engine.config import SETTING_FIELDS, EngineConfig
from gateway.settings import MODEL_SETTINGS, Settings, option_specs

# Every setting's (name, flag, variable) as they were before the engine's fields generated them
# (main 18c48dd): clients' command lines, deployments' variables and models files keep working.
NAMES = [
    ("host", "--host", "BATCHGATE_HOST"),
    ("port", "--port", "BATCHGATE_PORT"),
    ("model", "--model", "BATCHGATE_MODEL"),
    ("served_model_name", "--served-model-name", "BATCHGATE_SERVED_MODEL_NAME"),
    ("dtype", "--dtype", "BATCHGATE_DTYPE"),
    ("device", "--device", "BATCHGATE_DEVICE"),
    ("block_size", "--block-size", "BATCHGATE_BLOCK_SIZE"),
    ("kv_cache_memory_bytes", "--kv-cache-memory", "BATCHGATE_KV_CACHE_MEMORY"),
    ("max_num_seqs", "--max-num-seqs", "BATCHGATE_MAX_NUM_SEQS"),
    ("max_num_batched_tokens", "--max-num-batched-tokens", "BATCHGATE_MAX_NUM_BATCHED_TOKENS"),
    ("max_model_len", "--max-model-len", "BATCHGATE_MAX_MODEL_LEN"),
    ("kv_cache_memory_fraction", "--kv-cache-memory-fraction", "BATCHGATE_KV_CACHE_MEMORY_FRACTION"),
    ("kv_cache_dtype", "--kv-cache-dtype", "BATCHGATE_KV_CACHE_DTYPE"),  # added after that snapshot
    ("queue_deadline_s", "--queue-deadline", "BATCHGATE_QUEUE_DEADLINE"),
    ("engine_stall_timeout_s", "--engine-stall-timeout", "BATCHGATE_ENGINE_STALL_TIMEOUT"),
    ("num_threads", "--num-threads", "BATCHGATE_NUM_THREADS"),
    ("quantization", "--quantization", "BATCHGATE_QUANTIZATION"),
    ("int4_max_batch", "--int4-max-batch", "BATCHGATE_INT4_MAX_BATCH"),
    ("kernels", "--kernels", "BATCHGATE_KERNELS"),
    ("tensor_parallel_size", "--tensor-parallel-size", "BATCHGATE_TENSOR_PARALLEL_SIZE"),
    ("prefix_caching", "--prefix-caching", "BATCHGATE_PREFIX_CACHING"),
    ("batching", "--batching", "BATCHGATE_BATCHING"),
    ("length_buckets", "--length-buckets", "BATCHGATE_LENGTH_BUCKETS"),
    ("long_prefill_share", "--long-prefill-share", "BATCHGATE_LONG_PREFILL_SHARE"),
    ("target_itl_ms", "--target-itl-ms", "BATCHGATE_TARGET_ITL_MS"),
    ("speculative_decoding", "--speculative-decoding", "BATCHGATE_SPECULATIVE_DECODING"),  # added since
    ("num_speculative_tokens", "--num-speculative-tokens", "BATCHGATE_NUM_SPECULATIVE_TOKENS"),
    ("max_body_bytes", "--max-body-bytes", "BATCHGATE_MAX_BODY_BYTES"),
    ("tenants", "--tenants", "BATCHGATE_TENANTS"),
    ("redis_url", "--redis-url", "BATCHGATE_REDIS_URL"),
    ("redis_policy", "--redis-policy", "BATCHGATE_REDIS_POLICY"),
    ("request_lease_s", "--request-lease", "BATCHGATE_REQUEST_LEASE"),  # added after that snapshot
    ("storage_dir", "--storage-dir", "BATCHGATE_STORAGE_DIR"),
    ("files_bucket", "--files-bucket", "BATCHGATE_FILES_BUCKET"),
    ("s3_endpoint_url", "--s3-endpoint-url", "BATCHGATE_S3_ENDPOINT_URL"),
    ("max_file_bytes", "--max-file-bytes", "BATCHGATE_MAX_FILE_BYTES"),
    ("max_files", "--max-files", "BATCHGATE_MAX_FILES"),  # issue 43's per-tenant bounds
    ("storage_quota_bytes", "--storage-quota-bytes", "BATCHGATE_STORAGE_QUOTA_BYTES"),
    ("batch_max_lines", "--batch-max-lines", "BATCHGATE_BATCH_MAX_LINES"),
    ("batch_max_concurrent_lines", "--batch-max-concurrent-lines", "BATCHGATE_BATCH_MAX_CONCURRENT_LINES"),
    ("batch_max_in_flight", "--batch-max-in-flight", "BATCHGATE_BATCH_MAX_IN_FLIGHT"),  # issue 25's
    ("batch_max_running", "--batch-max-running", "BATCHGATE_BATCH_MAX_RUNNING"),  # gateway caps, beside
    (
        "batch_max_running_per_tenant",
        "--batch-max-running-per-tenant",
        "BATCHGATE_BATCH_MAX_RUNNING_PER_TENANT",
    ),
    ("batch_max_open", "--batch-max-open", "BATCHGATE_BATCH_MAX_OPEN"),
    ("batch_max_queued_lines", "--batch-max-queued-lines", "BATCHGATE_BATCH_MAX_QUEUED_LINES"),
    ("batch_lease_s", "--batch-lease", "BATCHGATE_BATCH_LEASE"),  # issue 25's runner lease, added beside
    ("ledger_retention_days", "--ledger-retention-days", "BATCHGATE_LEDGER_RETENTION_DAYS"),
    ("usage_events_file", "--usage-events-file", "BATCHGATE_USAGE_EVENTS_FILE"),
    ("usage_events_exporter", "--usage-events-exporter", "BATCHGATE_USAGE_EVENTS_EXPORTER"),
    ("budget_webhook_url", "--budget-webhook-url", "BATCHGATE_BUDGET_WEBHOOK_URL"),
    ("budget_webhook_secret", "--budget-webhook-secret", "BATCHGATE_BUDGET_WEBHOOK_SECRET"),
    ("admin_key_hash", "--admin-key-hash", "BATCHGATE_ADMIN_KEY_HASH"),
    ("console_session_idle_s", "--console-session-idle", "BATCHGATE_CONSOLE_SESSION_IDLE"),  # issue 44
    ("console_session_max_s", "--console-session-max", "BATCHGATE_CONSOLE_SESSION_MAX"),
    ("keep_alive_s", "--keep-alive", "BATCHGATE_KEEP_ALIVE"),
    ("loras", "--lora", "BATCHGATE_LORAS"),
    ("max_loras", "--max-loras", "BATCHGATE_MAX_LORAS"),
    ("lora_roots", "--lora-root", "BATCHGATE_LORA_ROOTS"),
    ("upstreams", "--upstream", "BATCHGATE_UPSTREAMS"),
    ("long_prompt_upstreams", "--long-prompt-upstream", "BATCHGATE_LONG_PROMPT_UPSTREAMS"),
    ("long_prompt_threshold", "--long-prompt-threshold", "BATCHGATE_LONG_PROMPT_THRESHOLD"),
    ("internal_token", "--internal-token", "BATCHGATE_INTERNAL_TOKEN"),
    ("health_interval_s", "--health-interval", "BATCHGATE_HEALTH_INTERVAL"),
    ("route_affinity_tokens", "--route-affinity-tokens", "BATCHGATE_ROUTE_AFFINITY_TOKENS"),
    ("embedding_model", "--embedding-model", "BATCHGATE_EMBEDDING_MODEL"),
    ("embedding_max_batch_inputs", "--embedding-max-batch-inputs", "BATCHGATE_EMBEDDING_MAX_BATCH_INPUTS"),
    ("embedding_max_batch_tokens", "--embedding-max-batch-tokens", "BATCHGATE_EMBEDDING_MAX_BATCH_TOKENS"),
    ("embedding_max_wait_s", "--embedding-max-wait", "BATCHGATE_EMBEDDING_MAX_WAIT"),
    ("models_file", "--models-file", "BATCHGATE_MODELS_FILE"),
    ("drain_timeout_s", "--drain-timeout", "BATCHGATE_DRAIN_TIMEOUT"),
    ("tool_arguments", "--tool-arguments", "BATCHGATE_TOOL_ARGUMENTS"),
    ("responses_max_stored", "--responses-max-stored", "BATCHGATE_RESPONSES_MAX_STORED"),
    ("conversation_max_items", "--conversation-max-items", "BATCHGATE_CONVERSATION_MAX_ITEMS"),
    ("conversation_max_bytes", "--conversation-max-bytes", "BATCHGATE_CONVERSATION_MAX_BYTES"),
    ("compaction_key", "--compaction-key", "BATCHGATE_COMPACTION_KEY"),  # issue 42's
    ("websocket_max_open", "--websocket-max-open", "BATCHGATE_WEBSOCKET_MAX_OPEN"),
    ("websocket_cache_size", "--websocket-cache-size", "BATCHGATE_WEBSOCKET_CACHE_SIZE"),
    ("websocket_send_buffer_bytes", "--websocket-send-buffer-bytes", "BATCHGATE_WEBSOCKET_SEND_BUFFER_BYTES"),
    ("responses_ttl_s", "--responses-ttl", "BATCHGATE_RESPONSES_TTL"),
    ("responses_store_format", "--responses-store-format", "BATCHGATE_RESPONSES_STORE_FORMAT"),
    ("responses_background_lease_s", "--responses-background-lease", "BATCHGATE_RESPONSES_BACKGROUND_LEASE"),
    ("log_level", "--log-level", "BATCHGATE_LOG_LEVEL"),
]
MODEL_FILE_KEYS = (
    "dtype",
    "device",
    "block_size",
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "kv_cache_memory_fraction",
    "kv_cache_dtype",
    "queue_deadline_s",
    "num_threads",
    "quantization",
    "int4_max_batch",
    "kernels",
    "prefix_caching",
    "batching",
    "length_buckets",
    "long_prefill_share",
    "target_itl_ms",
    "speculative_decoding",
    "num_speculative_tokens",
    "max_loras",
)


def test_names_are_unchanged() -> None:
    assert [(s.name, s.flag, s.env) for s in option_specs()] == NAMES
    assert MODEL_SETTINGS == MODEL_FILE_KEYS


def test_every_engine_field_has_exactly_one_server_setting() -> None:
    """A server field names the engine field it sets; each server-exposed engine field is set by
    exactly one, and the others (tests' and benchmarks' knobs) by none."""
    setting_of: dict[str, list[str]] = {}
    for f in dataclasses.fields(Settings):
        if "engine_field" in f.metadata:
            setting_of.setdefault(f.metadata["engine_field"], []).append(f.name)
    for _section, f in SETTING_FIELDS.values():
        expected = [f.metadata["name"] or f.name] if f.metadata["server"] else []
        assert setting_of.pop(f.name, []) == expected, f.name
    assert setting_of == {}  # no server field names a field the engine does not have


def test_each_setting_reaches_its_engine_field() -> None:
    """A non-default value of each engine setting, given by its variable, changes exactly its own
    engine field, converted where the server's type differs (prefix_caching off -> False)."""
    values = {
        "BATCHGATE_DTYPE": ("dtype", "float32"),
        "BATCHGATE_KV_CACHE_MEMORY": ("kv_cache_memory_bytes", 2**20),
        "BATCHGATE_QUEUE_DEADLINE": ("default_queue_deadline_s", 2.5),
        "BATCHGATE_PREFIX_CACHING": ("enable_prefix_caching", False),
        "BATCHGATE_LENGTH_BUCKETS": ("length_buckets", (64, 128)),
        "BATCHGATE_MAX_NUM_SEQS": ("max_num_seqs", 3),
        "BATCHGATE_TENSOR_PARALLEL_SIZE": ("tensor_parallel_size", 2),
    }
    text = {
        "BATCHGATE_KV_CACHE_MEMORY": "1MiB",
        "BATCHGATE_PREFIX_CACHING": "off",
        "BATCHGATE_LENGTH_BUCKETS": "64,128",
    }
    default = _flat(EngineConfig())
    for env, (field_name, value) in values.items():
        config = Settings.load({}, {env: text.get(env, str(value))}).engine_config()
        assert _flat(config) == default | {field_name: value}, env


def _flat(config: EngineConfig) -> dict[str, object]:
    """Every engine field's value by its name, over the sections."""
    return {k: v for section in dataclasses.asdict(config).values() for k, v in section.items()}
