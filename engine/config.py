"""Engine settings: read once at start-up into one typed object, validated early."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

# The inter-token latency the scheduler aims at while long prompts prefill (`--target-itl-ms`; 0 turns
# the step-time budget off): ~8 tokens/s per stream, faster than people read streamed text. The
# choice is measured in docs/BENCHMARKS.md ("Long prompts among chat turns").
DEFAULT_TARGET_ITL_MS = 120.0

# The allowed values of the string settings; the gateway's flags offer the same choices.
DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("auto", "none", "int4", "int8")
KERNELS = ("auto", "native", "torch")
BATCHING_MODES = ("continuous", "static")


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Defaults run on one CPU with the bundled model.

    The one place for each engine default: the gateway's `Settings` and the scheduler's
    `SchedulerConfig` default to these fields (`EngineConfig.max_num_seqs`, ...), never to a copy.

    `model`: a GGUF file, a Hugging Face folder (config.json + safetensors), or None for the bundled
    SmolLM2-135M-Instruct. `dtype`: "auto" (bf16 on CUDA and on CPUs with native bf16, else fp32),
    "bfloat16", "float16" or "float32". `device`: "auto" (CUDA when available), "cpu" or "cuda[:N]".
    KV memory: `kv_cache_memory_bytes` when set, else `kv_cache_memory_fraction` of free memory (on
    the CPU, within the cgroup's memory limit: a pod's limit, not the node's free memory)
    (capped by what `max_num_seqs` sequences of `max_model_len` tokens could ever use).
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.3
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "batchgate")
    seed: int = 0
    # ---- scheduling policy (engine/scheduler.py, engine/policy.py, engine/admission.py) ----
    # "continuous" (iteration-level) or "static" (a batch runs until its last member finishes).
    batching: str = "continuous"
    # Prompt-length bucket boundaries: bucket i holds prompts <= length_buckets[i], the last bucket
    # the longer ones; buckets take turns at admission. () turns buckets off (one FIFO per class).
    length_buckets: tuple[int, ...] = (256, 1024, 4096)
    # Fraction of a step's token budget that longer prompts' prefill chunks may take while shorter
    # prompts are waiting (1.0 disables the cap).
    long_prefill_share: float = 0.5
    # Step-time budget for long prompts' prefill chunks while others decode or wait (see
    # DEFAULT_TARGET_ITL_MS and engine/scheduler.py); 0: off (chunks bounded by tokens only).
    target_itl_ms: float = DEFAULT_TARGET_ITL_MS
    # A sequence preempted this many times is no longer preempted to make room for a higher class.
    max_preemptions_per_seq: int = 3
    # Seconds from arrival by which a request must start when it does not carry its own deadline;
    # None: no deadline.
    default_queue_deadline_s: float | None = None
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # Weight format of the layers' projections (engine/quant.py): "none" (dtype only); "int4" /
    # "int8" (Q4_1 / Q8_0 groups on our int8 kernels, CPU with AVX2 in float32; int4 in bfloat16:
    # an extra copy for steps of at most `int4_max_batch` tokens); "auto" (a Q4_1 GGUF's weights
    # as the file holds them, on our kernels or, with native bf16, the int4 copy).
    quantization: str = "auto"
    # "native" (engine/native.py: C++ kernels for decode attention straight from the paged cache
    # and the fused elementwise ops; CPU only, compiled on first use), "torch" (plain torch ops),
    # or "auto" (native on the CPU when they build, else torch).
    kernels: str = "auto"
    int4_max_batch: int = 8
    # Automatic prefix caching (engine/block_manager.py): full KV blocks are shared by content
    # between requests of the same cache salt, so a repeated prefix (a system prompt, a chat's
    # earlier turns) is not computed again.
    enable_prefix_caching: bool = True
    # LoRA adapters (engine/lora.py): how many different adapters one step may mix (resident
    # slots); further ones wait in CPU memory, their requests outside the batch.
    max_loras: int = 8
    # ---- tensor parallelism (engine/parallel.py) ----
    # Ranks one model copy is split over, one process each (rank 0 is this process and schedules).
    tensor_parallel_size: int = 1
    # Seconds a rank waits in one of a step's collectives before it gives up: a dead or hung rank
    # then makes the engine stop (and the replica exit) within this, never a silent hang.
    collective_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be auto, none, int4 or int8, got {self.quantization!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be auto, native or torch, got {self.kernels!r}")
        if self.int4_max_batch < 0:
            raise ValueError(f"int4_max_batch must be >= 0, got {self.int4_max_batch}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be continuous or static, got {self.batching!r}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        self.length_buckets = tuple(int(b) for b in self.length_buckets)
        buckets = self.length_buckets
        if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"length_buckets must be increasing positive token counts, got {buckets}")
        if not 0.0 < self.long_prefill_share <= 1.0:
            raise ValueError(f"long_prefill_share must be in (0, 1], got {self.long_prefill_share}")
        if self.max_preemptions_per_seq < 0:
            raise ValueError(f"max_preemptions_per_seq must be >= 0, got {self.max_preemptions_per_seq}")
        if not (math.isfinite(self.target_itl_ms) and self.target_itl_ms >= 0):
            raise ValueError(f"target_itl_ms must be >= 0 (0: off), got {self.target_itl_ms}")
        if self.default_queue_deadline_s is not None and not self.default_queue_deadline_s > 0:
            raise ValueError(f"default_queue_deadline_s must be > 0, got {self.default_queue_deadline_s}")
        self.cache_dir = Path(self.cache_dir)
