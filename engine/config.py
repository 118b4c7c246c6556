"""Engine settings: read once at start-up into one typed object, validated early."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Defaults run on one CPU with the bundled model.

    `model`: a GGUF file, a Hugging Face folder (config.json + safetensors), or None for the bundled
    SmolLM2-135M-Instruct. `dtype`: "auto" (bf16 on CUDA and on CPUs with native bf16, else fp32),
    "bfloat16", "float16" or "float32". `device`: "auto" (CUDA when available), "cpu" or "cuda[:N]".
    KV memory: `kv_cache_memory_bytes` when set, else `kv_cache_memory_fraction` of free memory
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
    # Fraction of a step's token budget that one long prompt's prefill chunk may take when shorter
    # prompts are waiting (length buckets; 1.0 disables the cap).
    # Scheduling-policy seams (filled by the scheduling-policy work).
    default_queue_deadline_s: float | None = None
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        self.cache_dir = Path(self.cache_dir)
