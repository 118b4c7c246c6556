"""The engine's device side, assembled: the model loaded on its device in its dtype, the KV cache
sized, the tensor-parallel ranks started, and each rank's ModelRunner built (kernels, weight shard,
KV cache, CUDA graphs). Rank 0's side is `EngineWorker.start`; a rank > 0 is built by `_rank_main`,
the entry point of its process."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, triton_decode_attention
from engine.kv_cache import allocate_kv_caches, num_kv_blocks, resolve_kv_dtype
from engine.loader import LoadedModel, ModelSpec, load_model
from engine.model import LlamaModel
from engine.native import qmatmul_available, resolve_kernels
from engine.parallel import (
    ParallelExecutor,
    RankArgs,
    TensorParallel,
    check_divisible,
    serve_rank,
    shard_weights,
)
from engine.platform import resolve_device, resolve_dtype
from engine.quant import WeightFormat, resolve_engine_dtype, resolve_weight_format
from engine.runner import ModelRunner

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class EngineWorker:
    """Rank 0's device side, ready to run steps: the runner and the model facts the engine needs."""

    runner: ModelRunner
    name: str
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    weight_format: WeightFormat

    @classmethod
    def start(cls, config: EngineConfig, model: LoadedModel | None = None) -> EngineWorker:
        """Load `config.model.model` (or take `model`, already in memory in the engine's dtype on its
        device; its weights are consumed) and build rank 0's runner."""
        loaded, device, dtype, weight_format = load_engine_model(config, model)
        runner = build_engine_runner(config, loaded, device, dtype, weight_format)
        del loaded.weights  # the runner holds (fused) copies
        return cls(runner, loaded.name, loaded.tokenizer, loaded.spec, device, dtype, weight_format)


def load_engine_model(
    config: EngineConfig, model: LoadedModel | None
) -> tuple[LoadedModel, torch.device, torch.dtype, WeightFormat]:
    """`model` (or `config.model.model` loaded), with the engine's device, dtype and weight format."""
    device = resolve_device(config.model.device)
    has_qmatmul = qmatmul_available(config.model.kernels, device)
    dtype = resolve_engine_dtype(config, device, resolve_dtype(config.model.dtype, device), has_qmatmul)
    weight_format = resolve_weight_format(config, device, dtype, has_qmatmul)
    # Quantized weights are recovered from float32 ones (exact for a GGUF's groups); the model
    # casts the rest to `dtype`.
    load_dtype = torch.float32 if weight_format.layers or weight_format.int4_max_rows else dtype
    if model is None:
        model = load_model(config.model.model, config.model.cache_dir, load_dtype, device)
    return model, device, dtype, weight_format


def build_engine_runner(
    config: EngineConfig,
    model: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    weight_format: WeightFormat | None = None,
) -> ModelRunner:
    """Rank 0's runner: the KV cache sized to its memory, the model's context bounded by the cache,
    and on a tensor-parallel replica the other ranks started first (the runner sends them each step)."""
    kv_dtype = resolve_kv_dtype(config, dtype, bool(weight_format and weight_format.layers), device)
    num_blocks = num_kv_blocks(config, model, kv_dtype, device)
    max_len = min(
        config.cache.max_model_len or model.spec.max_position_embeddings, num_blocks * config.cache.block_size
    )
    executor = None
    if config.parallel.tensor_parallel_size > 1:
        _check_parallel(config, model.spec)
        executor = ParallelExecutor.start(config, model.spec, num_blocks, max_len, dtype, device, _rank_main)
    try:
        return build_runner(
            config, model, num_blocks, device, dtype, max_len, weight_format, executor=executor
        )
    except BaseException:
        if executor is not None:
            executor.shutdown()
        raise


def build_runner(
    config: EngineConfig,
    model: LoadedModel,
    num_blocks: int,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    weight_format: WeightFormat | None = None,
    tp: TensorParallel | None = None,
    executor: ParallelExecutor | None = None,
) -> ModelRunner:
    """One rank's runner. With `config.parallel.tensor_parallel_size` > 1: `tp` is this rank's share (rank 0:
    its `executor`'s), and the model is this rank's shard of the weights."""
    spec, weights = model.spec, model.weights
    if config.parallel.tensor_parallel_size > 1:
        _check_parallel(config, spec)
        tp = executor.tp if executor is not None else tp
        if tp is None:
            raise RuntimeError(
                "a tensor-parallel runner needs its rank's TensorParallel or rank 0's executor"
            )
        # The C++ kernels and int4 are single-rank CPU paths; a TP replica runs plain torch ops.
        weight_format, kernels = WeightFormat(), None
        spec, weights = shard_weights(spec, weights, tp.rank, tp.world_size)
    else:
        kernels = resolve_kernels(config.model.kernels, device)
    # On CUDA: decode attention by our Triton kernel, straight from the block table, and the
    # decode step replayed from CUDA graphs (one rank; engine/cuda_graphs.py).
    use_triton = (
        device.type == "cuda"
        and config.model.kernels != "torch"
        and importlib.util.find_spec("triton") is not None
    )
    use_graphs = use_triton and config.parallel.tensor_parallel_size == 1
    block_size = config.cache.block_size
    llama = LlamaModel(
        spec,
        weights,
        max_model_len,
        dtype=dtype,
        weight_format=weight_format or WeightFormat(),
        kernels=kernels,
        tp=tp,
        paged_decode=triton_decode_attention() if use_triton else None,
        max_loras=config.model.max_loras,
    )
    # With graphs, one block more than the block manager hands out: padding rows write there.
    kv_dtype = resolve_kv_dtype(config, dtype, bool(weight_format and weight_format.layers), device)
    kv_caches = allocate_kv_caches(spec, num_blocks + int(use_graphs), block_size, kv_dtype, device)
    graphs = None
    if use_graphs:
        graphs = DecodeGraphs(
            llama,
            kv_caches,
            config.scheduler.max_num_seqs,
            block_size,
            max_blocks_per_seq=-(-max_model_len // block_size),
            pad_slot=num_blocks * block_size,
            device=device,
        )
    backend = "native" if kernels is not None else "triton" if use_triton else "torch"
    return ModelRunner(
        llama, kv_caches, num_blocks, block_size, max_model_len, device, graphs, executor, backend
    )


def _check_parallel(config: EngineConfig, spec: ModelSpec) -> None:
    check_divisible(spec, config.parallel.tensor_parallel_size)
    if config.model.kernels == "native":
        raise ValueError("kernels native needs tensor_parallel_size 1")


def _rank_main(args: RankArgs, ready: Connection) -> None:
    """The process of a rank > 0: serve steps with this rank's shard of the model."""
    serve_rank(args, ready, _build_rank_runner)


def _build_rank_runner(args: RankArgs, device: torch.device, group: Any) -> ModelRunner:
    config = args.config
    loaded = load_model(config.model.model, config.model.cache_dir, args.dtype, device)
    tp = TensorParallel.of(loaded.spec, args.rank, config.parallel.tensor_parallel_size, group)
    return build_runner(config, loaded, args.num_blocks, device, args.dtype, args.max_model_len, tp=tp)
