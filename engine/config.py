"""Engine settings: read once at start-up into one typed object, validated early.

`EngineConfig` holds one frozen section per concern (as vLLM's `VllmConfig`): `model`, `cache`,
`scheduler`, `speculative` and `parallel`. Each section field is the one definition of its setting:
its default, its check (`_CHECKS`, run when the section is built), and (in its metadata, `setting()`) how a
server exposes it: its help, and where the server's name or value type differs from the field's
(`--kv-cache-memory`, `--queue-deadline`, `--prefix-caching tenant|global|off`). The gateway's
flags, variables and models-file keys are generated from these (gateway/settings.py).

What the "auto" settings become on this machine and model is a `ResolvedConfig`, decided once by
engine/resolve.py when the engine starts; the device side (engine/device/) reads only that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

if TYPE_CHECKING:
    import torch
    from _typeshed import DataclassInstance

# The inter-token latency the scheduler aims at while long prompts prefill (`--target-itl-ms`; 0 turns
# the step-time budget off); the choice is measured in docs/BENCHMARKS.md.
DEFAULT_TARGET_ITL_MS = 120.0

# The allowed values of the string settings; the gateway's flags offer the same choices.
DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("auto", "none", "int4", "int8")
KERNELS = ("auto", "native", "torch")
BATCHING_MODES = ("continuous", "static")


def setting(
    default: Any,
    help: str,
    *,
    name: str | None = None,
    flag: str | None = None,
    unit: str | None = None,
    choices: tuple[str, ...] = (),
    server_default: Any = None,
    to_engine: Callable[[Any], Any] | None = None,
    per_model: bool = True,
    server: bool = True,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A section field and how a server exposes it. `name`: the server's setting name where it is
    not the field's (`flag`: its flag where not `--name`); `unit` "bytes": given as a size (2GiB);
    `choices`, `server_default` and `to_engine`: where the server's value is of another type (the
    choice it offers, its default, and the field's value from it); `per_model`: a models file's
    model may set it; `server=False`: not a server setting (tests and benchmarks set it)."""
    meta = {
        "help": help,
        "name": name,
        "flag": flag,
        "unit": unit,
        "choices": choices,
        "server_default": server_default,
        "to_engine": to_engine,
        "per_model": per_model,
        "server": server,
    }
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def _power_of_two(v: int) -> bool:
    return v >= 1 and not v & (v - 1)


def _buckets(v: tuple[int, ...]) -> bool:
    return all(b >= 1 for b in v) and list(v) == sorted(set(v))


# Each setting's check and its message, in one place: every section runs them (`check_settings`)
# on its fields when it is built.
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "block_size": (_power_of_two, "block_size must be a power of two >= 1, got {v}"),
    "max_num_seqs": (lambda v: v >= 1, "max_num_seqs must be >= 1, got {v}"),
    "max_num_batched_tokens": (lambda v: v >= 1, "max_num_batched_tokens must be >= 1, got {v}"),
    "dtype": (lambda v: v in DTYPES, "dtype must be auto, bfloat16, float16 or float32, got {v!r}"),
    "kv_cache_dtype": (
        lambda v: v in DTYPES,
        "kv_cache_dtype must be auto, bfloat16, float16 or float32, got {v!r}",
    ),
    "kv_cache_memory_fraction": (lambda v: 0.0 < v <= 0.95, "kv_cache_memory_fraction must be in (0, 0.95]"),
    "kv_cache_memory_bytes": (lambda v: v is None or v > 0, "kv_cache_memory_bytes must be positive"),
    "quantization": (
        lambda v: v in QUANTIZATIONS,
        "quantization must be auto, none, int4 or int8, got {v!r}",
    ),
    "kernels": (lambda v: v in KERNELS, "kernels must be auto, native or torch, got {v!r}"),
    "int4_max_batch": (lambda v: v >= 0, "int4_max_batch must be >= 0, got {v}"),
    "batching": (lambda v: v in BATCHING_MODES, "batching must be continuous or static, got {v!r}"),
    "max_loras": (lambda v: v >= 0, "max_loras must be >= 0, got {v}"),
    "tensor_parallel_size": (lambda v: v >= 1, "tensor_parallel_size must be >= 1, got {v}"),
    "collective_timeout_s": (lambda v: v > 0, "collective_timeout_s must be > 0, got {v}"),
    "length_buckets": (_buckets, "length_buckets must be increasing positive token counts, got {v}"),
    "long_prefill_share": (lambda v: 0.0 < v <= 1.0, "long_prefill_share must be in (0, 1], got {v}"),
    "max_preemptions_per_seq": (lambda v: v >= 0, "max_preemptions_per_seq must be >= 0, got {v}"),
    "target_itl_ms": (
        lambda v: math.isfinite(v) and v >= 0,
        "target_itl_ms must be >= 0 (0: off), got {v}",
    ),
    "default_queue_deadline_s": (
        lambda v: v is None or v > 0,
        "default_queue_deadline_s must be > 0, got {v}",
    ),
    "min_long_prefill_chunk": (lambda v: v >= 1, "min_long_prefill_chunk must be >= 1, got {v}"),
    "max_long_prefill_stall_steps": (lambda v: v >= 1, "max_long_prefill_stall_steps must be >= 1, got {v}"),
    "max_yield_stall_steps": (lambda v: v >= 1, "max_yield_stall_steps must be >= 1, got {v}"),
    "num_speculative_tokens": (
        lambda v: 1 <= v <= 32,
        "num_speculative_tokens must be in [1, 32], got {v}",
    ),
}


def check_settings(obj: DataclassInstance) -> None:
    """ValueError naming the first of `obj`'s engine settings that is out of range."""
    for f in fields(obj):
        check = _CHECKS.get(f.name)
        if check is not None and not check[0](getattr(obj, f.name)):
            raise ValueError(check[1].format(v=getattr(obj, f.name)))


@dataclass(frozen=True)
class ModelConfig:
    """What runs, on what, in which format."""

    model: str | None = setting(
        None,
        "a Hugging Face folder or a .gguf file (default: the bundled SmolLM2-135M), or none (no chat "
        "model: an embedding-only replica)",
        per_model=False,  # a models file's entry names its own (`model = ...`)
    )
    served_model_name: str | None = setting(
        None, "the model id clients send and /v1/models lists", per_model=False
    )
    # "auto": bf16 on CUDA and on CPUs with native bf16, else fp32; fp32 activations wherever a Q4_1
    # GGUF runs on our int8 kernels (engine/device/quant.py).
    dtype: str = setting("auto", "weights and KV dtype", choices=DTYPES)
    device: str = setting("auto", "auto, cpu or cuda[:N]")
    # Weight format of the layers' projections (engine/device/quant.py): "none" (dtype only); "int4" /
    # "int8" (Q4_1 / Q8_0 groups on our int8 kernels); "auto" (a Q4_1 GGUF's weights as it holds them).
    quantization: str = setting(
        "auto",
        "quantized weights on the CPU: int4, int8 (requantize), none, or auto (a Q4_1 GGUF as it is)",
        choices=QUANTIZATIONS,
    )
    int4_max_batch: int = setting(8, "largest step (tokens) that runs on the int4 weights")
    # "native": engine/device/native.py's C++ kernels (CPU only, compiled on first use); "torch": plain ops.
    kernels: str = setting(
        "auto",
        "native (C++ kernels: paged decode attention, fused norms; CPU), torch, or auto",
        choices=KERNELS,
    )
    num_threads: int | None = setting(None, "torch CPU threads (default: torch's choice)")
    # LoRA adapters (engine/lora.py): further ones wait in CPU memory, their requests outside the batch.
    max_loras: int = setting(
        8, "LoRA adapters one engine step may mix (resident slots); requests of further ones wait"
    )
    cache_dir: Path = setting(
        None,
        "where compiled and converted model files are kept",
        server=False,
        default_factory=lambda: Path.home() / ".cache" / "batchgate",
    )
    seed: int = setting(0, "the engine's random seed", server=False)

    def __post_init__(self) -> None:
        check_settings(self)
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache (engine/device/kv_cache.py, engine/block_manager.py)."""

    block_size: int = setting(16, "tokens per KV-cache block (a power of two)")
    # KV memory: this when set, else `kv_cache_memory_fraction` of free memory (on the CPU, within
    # the cgroup's limit), capped by what max_num_seqs sequences of max_model_len tokens could use.
    kv_cache_memory_bytes: int | None = setting(
        None,
        "KV-cache size, e.g. 2GiB (default: a fraction of free memory)",
        flag="--kv-cache-memory",
        unit="bytes",
    )
    kv_cache_memory_fraction: float = setting(
        0.3, "KV-cache size as a fraction of free memory, when --kv-cache-memory is not given"
    )
    max_model_len: int | None = setting(None, "context length (default: the model's, capped by KV memory)")
    # "auto": bf16 under fp32 activations on our int8 kernels (engine/device/kv_cache.py), else the dtype.
    kv_cache_dtype: str = setting(
        "auto",
        "KV-cache dtype: auto (bfloat16 on the CPU's int8 kernels, else --dtype's), bfloat16, float16 or "
        "float32 (only --dtype's, or bfloat16 under float32)",
        choices=DTYPES,
    )
    # Automatic prefix caching (engine/block_manager.py): full KV blocks shared by content between
    # requests of the same cache salt. The server chooses the salt's scope (a tenant's, or one).
    enable_prefix_caching: bool = setting(
        True,
        "reuse the KV of repeated prompt prefixes: within each tenant (tenant), across tenants (global), "
        "or off",
        name="prefix_caching",
        choices=("tenant", "global", "off"),
        server_default="tenant",
        to_engine=lambda value: value != "off",
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling (engine/scheduler/, engine/deadlines.py)."""

    max_num_seqs: int = setting(64, "most sequences in one batch")
    max_num_batched_tokens: int = setting(512, "token budget of one engine step")
    # "continuous" (iteration-level) or "static" (a batch runs until its last member finishes).
    batching: str = setting(
        "continuous", "continuous batching, or static (the baseline)", choices=BATCHING_MODES
    )
    # Bucket i holds prompts <= length_buckets[i], the last the longer ones; () is one FIFO per class.
    length_buckets: tuple[int, ...] = setting(
        (256, 1024, 4096),
        "prompt-length bucket boundaries taking turns at prefill, e.g. 256,1024,4096 ('' or 0: off)",
    )
    long_prefill_share: float = setting(
        0.5, "most of a step's token budget one long prompt may take while shorter ones wait"
    )
    target_itl_ms: float = setting(
        DEFAULT_TARGET_ITL_MS,
        "inter-token latency (ms) that long prompts' prefill chunks leave to running streams and "
        "waiting short prompts: chunks shrink to fit steps of this length (step costs measured "
        "online); 0: off",
    )
    # A sequence preempted this many times is no longer preempted to make room for a higher class.
    max_preemptions_per_seq: int = setting(
        3, "preemptions after which a sequence is not preempted for priority", server=False
    )
    default_queue_deadline_s: float | None = setting(
        None,
        "seconds a request may wait to start before a fast 503 (default: no deadline; plans set their own)",
        name="queue_deadline_s",
        flag="--queue-deadline",
    )
    # Free blocks kept back when admitting new sequences, so running ones can still grow.
    watermark_blocks: int = setting(1, "free KV blocks kept back from admission", server=False)
    # Below a few dozen tokens a chunk's fixed cost (one pass over the weights) buys too little prefill.
    min_long_prefill_chunk: int = setting(
        32,
        "floor of a long prompt's chunk when it must progress although nothing fits the budget",
        server=False,
    )
    max_long_prefill_stall_steps: int = setting(
        4, "a long prompt still prefilling progresses at least once in this many steps", server=False
    )
    max_yield_stall_steps: int = setting(
        4,
        "steps after which a lower class's decode row, left out to yield to a higher class, joins",
        server=False,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "length_buckets", tuple(int(b) for b in self.length_buckets))
        check_settings(self)

    @property
    def long_prefill_budget(self) -> int:
        return max(1, int(self.long_prefill_share * self.max_num_batched_tokens))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative/)."""

    # Per step and sequence, drafts run only where their expected accepted tokens pay for their
    # rows (measured step costs and acceptance): a full batch gets none.
    enable_speculative_decoding: bool = setting(
        True,
        "verify drafts (prompt lookup, a request's predicted output) where they pay, or off",
        name="speculative_decoding",
        choices=("auto", "off"),
        server_default="auto",
        to_engine=lambda value: value != "off",
    )
    num_speculative_tokens: int = setting(16, "most draft tokens one sequence verifies in a step")
    # Tests and benchmarks: every draft verified in full, whatever it costs (the measured choice off).
    speculate_always: bool = setting(False, "verify every draft in full, paying or not", server=False)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (engine/device/parallel.py)."""

    # Ranks one model copy is split over, one process each (rank 0 is this process and schedules).
    tensor_parallel_size: int = setting(
        1,
        "ranks (processes; GPUs on CUDA) one model copy is split over; must divide the model's attention "
        "and KV heads (the C++ kernels and int4 are single-rank only)",
        per_model=False,
    )
    # A dead or hung rank makes the engine stop (and the replica exit) within this, never a silent hang.
    collective_timeout_s: float = setting(
        30.0, "seconds a rank waits in one collective before it gives up", server=False
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start, one section per concern. Defaults run on one CPU
    with the bundled model. `EngineConfig.of(...)` builds one from settings by their names."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def of(cls, **settings: Any) -> EngineConfig:
        """An EngineConfig from settings by their field names, each routed to its section
        (`block_size=16, max_num_seqs=8`); the others keep their defaults."""
        unknown = sorted(set(settings) - set(SETTING_FIELDS))
        if unknown:
            raise TypeError(f"EngineConfig has no setting {', '.join(unknown)}")
        sections: dict[str, Any] = {
            name: section(**{k: v for k, v in settings.items() if SETTING_FIELDS[k][0] == name})
            for name, section in SECTIONS.items()
        }
        return cls(**sections)


# Each section's name and class, and each setting's section and field, by the field's name (the
# names are unique across sections, so the server's flags and `EngineConfig.of` use them alone).
SECTIONS: dict[str, type[DataclassInstance]] = {
    f.name: get_type_hints(EngineConfig)[f.name] for f in fields(EngineConfig)
}
SETTING_FIELDS: dict[str, tuple[str, Field[Any]]] = {
    f.name: (name, f) for name, section in SECTIONS.items() for f in fields(section)
}
assert len(SETTING_FIELDS) == sum(len(fields(s)) for s in SECTIONS.values()), "a field name twice"


# ---- what the settings become on this machine (engine/resolve.py) -------------------------------


@dataclass(frozen=True)
class WeightFormat:
    """How the layers' projections and the LM head are stored (engine/device/quant.py)."""

    layers: str | None = None  # "q4" or "q8": our kernels serve every step
    head: str | None = None  # the LM head's kind for our kernels, or None: float
    int4_max_rows: int = 0  # torch's int4 copy for decode steps of at most this many rows (bf16)

    def describe(self) -> str:
        if self.layers:
            return f", {self.layers} layers and {self.head or 'float'} LM head on the int8 kernels"
        return f", int4 weights for steps of <= {self.int4_max_rows} tokens" if self.int4_max_rows else ""


@dataclass(frozen=True)
class ResolvedConfig:
    """An `EngineConfig` with every "auto" decided for this machine and model, once, by
    engine/resolve.py. The device side (engine/device/) reads the concrete values here, never the
    settings they came from; `config` keeps the rest (sizes, limits, sections)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype  # activations, and the weights' float copies
    weight_format: WeightFormat
    kv_cache_dtype: torch.dtype
    # "native": engine/device/native.py's C++ CPU kernels; "triton": the CUDA decode-attention
    # kernel (engine/device/triton_attention.py), with CUDA graphs on one rank; "torch": plain ops.
    kernels: str
    # The Hugging Face folder the weights load from (a GGUF file converted into the cache); None
    # where the caller hands the engine its model in memory (`EngineWorker.start(resolved, model)`).
    model_dir: Path | None

    @property
    def cuda_graphs(self) -> bool:
        """The decode step replayed from CUDA graphs (engine/device/cuda_graphs.py)."""
        return self.kernels == "triton" and self.config.parallel.tensor_parallel_size == 1
