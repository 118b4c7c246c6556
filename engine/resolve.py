"""Every "auto" setting, decided once, here, when the engine starts: `resolve(EngineConfig)` ->
`ResolvedConfig` (engine/config.py), which is all the device side reads.

    device          auto: cuda where torch sees a GPU, else the CPU
    kernels         auto: our C++ kernels on the CPU where they build (engine/device/native.py);
                    on CUDA the Triton decode attention where triton is installed; else torch ops
    dtype           auto: bf16 on CUDA and on CPUs with native bf16, else fp32; fp32 wherever a
                    Q4_1 GGUF runs on our int8 kernels (`resolve_engine_dtype`)
    weight format   `--quantization` on that device and dtype (`resolve_weight_format`)
    kv cache dtype  auto: bf16 under fp32 activations on our int8 kernels, else the dtype
    model folder    the bundled model when none is named; a GGUF file converted into the cache

The rules are plain functions of what they depend on (tests call them one by one); the facts they
read about the machine (CPU level, bf16 support, whether the kernels build) come from
engine/device/platform.py and engine/device/native.py.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, ResolvedConfig, WeightFormat
from engine.device import native
from engine.device.loader import (
    TRANSFORMERS_LOCK,
    bundled_model_path,
    convert_gguf,
    gguf_cache_folder,
    is_q4_1_gguf,
)
from engine.device.platform import CpuIsa, cpu_has_bf16, cpu_isa

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve(config: EngineConfig, *, in_memory_model: bool = False) -> ResolvedConfig:
    """`config` decided for this machine. `in_memory_model`: the caller brings the model (no
    folder is looked for). Raises ValueError for settings this machine or model cannot run."""
    tp = config.parallel.tensor_parallel_size
    if tp > 1 and config.model.kernels == "native":
        raise ValueError("kernels native needs tensor_parallel_size 1")
    device = resolve_device(config.model.device)
    # The C++ kernels and int4 are single-rank paths; a tensor-parallel replica runs torch ops.
    kernels = resolve_kernels(config.model.kernels, device) if tp == 1 else None
    has_qmatmul = kernels is not None and qmatmul_available(config.model.kernels, device)
    dtype = resolve_engine_dtype(config, device, resolve_dtype(config.model.dtype, device), has_qmatmul)
    weight_format = resolve_weight_format(config, device, dtype, has_qmatmul)
    kv_dtype = resolve_kv_dtype(config, dtype, weight_format.layers is not None, device)
    if kernels is not None:
        choice = "native"
    elif device.type == "cuda" and config.model.kernels != "torch" and importlib.util.find_spec("triton"):
        choice = "triton"
    else:
        choice = "torch"
    model_dir = None
    if not in_memory_model:
        with TRANSFORMERS_LOCK:  # converting a GGUF file imports transformers (engine/device/loader.py)
            model_dir = resolve_model_dir(config.model.model, config.model.cache_dir)
    return ResolvedConfig(config, device, dtype, weight_format, kv_dtype, choice, model_dir)


def resolve_model_dir(model: str | None, cache_dir: Path) -> Path:
    """Return a Hugging Face folder for `model`, converting a GGUF file into the cache if needed."""
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    if path.suffix != ".gguf":
        raise ValueError(f"model {path} is neither a folder nor a .gguf file")
    target = gguf_cache_folder(path, cache_dir)
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    convert_gguf(path, target)
    return target


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype a setting names; "auto": bf16 on CUDA and on CPUs with native bf16, else fp32."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def resolve_kernels(setting: str, device: torch.device) -> Any | None:
    """The native kernels for `setting` ("auto", "native", "torch") on `device`; None: torch ops."""
    if setting == "torch" or device.type != "cpu":
        if setting == "native" and device.type != "cpu":
            raise ValueError("kernels native is CPU-only")
        return None
    try:
        return native.native_kernels()
    except RuntimeError as exc:
        if setting == "native":
            raise
        logger.warning("%s; the engine falls back to torch ops", exc)
        return None


def qmatmul_available(setting: str, device: torch.device) -> bool:
    """Whether our quantized matmuls (engine/device/csrc/qmatmul_x86.cpp) can serve on `device`."""
    if device.type != "cpu" or cpu_isa() < CpuIsa.AVX2:
        return False
    kernels = resolve_kernels(setting, device)
    return kernels is not None and bool(kernels.has_qmatmul())


def resolve_engine_dtype(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, has_qmatmul: bool
) -> torch.dtype:
    """The engine's dtype: `dtype` (`resolve_dtype`'s for the setting), except that "auto" runs a
    Q4_1 GGUF on our int8 kernels (float32 activations) wherever they run, native bf16 or not:
    they beat bf16 there at every batch size (docs/BENCHMARKS.md)."""
    ours = (
        config.model.dtype == "auto"
        and config.model.quantization == "auto"
        and device.type == "cpu"
        and config.parallel.tensor_parallel_size == 1
        and has_qmatmul
    )
    return torch.float32 if ours and is_q4_1_gguf(config.model.model) else dtype


def resolve_weight_format(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, has_qmatmul: bool
) -> WeightFormat:
    """`config.model.quantization` on this device and dtype; `has_qmatmul`: our int8 kernels are built and
    the CPU runs them (engine/device/native.py). "auto" keeps a Q4_1 GGUF's weights as the file holds
    them and leaves any other model in its dtype, and leaves an explicit `--dtype float32` exact
    (the parity mode); "int4" / "int8" requantize (lossy unless the weights came from such a file)."""
    q, int4_max_batch = config.model.quantization, config.model.int4_max_batch
    if q == "none":
        return WeightFormat()
    single_cpu = device.type == "cpu" and config.parallel.tensor_parallel_size == 1
    exact = q == "auto" and config.model.dtype != "auto"  # "auto" beside an explicit dtype: parity
    ours = single_cpu and dtype == torch.float32 and has_qmatmul and not exact
    bf16_int4 = single_cpu and dtype == torch.bfloat16 and int4_max_batch > 0
    if q in ("int4", "int8"):
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError(f"quantization {q} needs tensor_parallel_size 1")
        if ours:
            return WeightFormat(layers="q4" if q == "int4" else "q8", head="q8")
        if q == "int4" and single_cpu and dtype == torch.bfloat16:
            return WeightFormat(int4_max_rows=int4_max_batch)
        raise ValueError(
            f"quantization {q} needs the CPU with dtype float32 and the native kernels (AVX2 or newer)"
            + (", or dtype bfloat16" if q == "int4" else "")
        )
    if not (ours or bf16_int4) or not is_q4_1_gguf(config.model.model):
        return WeightFormat()
    return WeightFormat(layers="q4", head="q8") if ours else WeightFormat(int4_max_rows=int4_max_batch)


def resolve_kv_dtype(
    config: EngineConfig, dtype: torch.dtype, int8_layers: bool, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype for `config.cache.kv_cache_dtype` under activations of `dtype`. "auto":
    bf16 where the layers run on our int8 kernels (float32 activations): half the memory and half
    the bytes decode attention reads, widened exactly as they are read; else `dtype`. Besides
    `dtype` itself, only bf16 under float32 on the CPU (the kernels and torch ops of
    engine/device/models/decoder.py convert on write and read)."""
    setting = config.cache.kv_cache_dtype
    if setting == "auto":
        return torch.bfloat16 if int8_layers and dtype == torch.float32 and device.type == "cpu" else dtype
    kv = resolve_dtype(setting, device)  # a name, not "auto": its dtype
    if kv != dtype and not (kv == torch.bfloat16 and dtype == torch.float32 and device.type == "cpu"):
        raise ValueError(
            f"kv_cache_dtype {setting} needs the engine's dtype to be {setting} (or float32 on the CPU "
            f"for bfloat16), got {str(dtype).removeprefix('torch.')} on {device.type}"
        )
    return kv
