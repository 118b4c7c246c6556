"""The engine's device side, assembled: the model loaded on its device in its dtype, the KV cache
sized, the tensor-parallel ranks started, and each rank's ModelRunner built (kernels, weight shard,
KV cache, CUDA graphs). Rank 0's side is `EngineWorker.start`; a rank > 0 is built by `_rank_main`,
the entry point of its process."""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ResolvedConfig, WeightFormat
from engine.device.cuda_graphs import DecodeGraphs, triton_decode_attention
from engine.device.kv_cache import allocate_kv_caches, num_kv_blocks
from engine.device.loader import LoadedModel, load_model
from engine.device.models.decoder import DecoderModel
from engine.device.models.registry import canonical_weights
from engine.device.native import native_kernels
from engine.device.parallel import (
    ParallelExecutor,
    RankArgs,
    TensorParallel,
    check_divisible,
    serve_rank,
    shard_weights,
)
from engine.device.runner import ModelRunner
from engine.model_spec import ModelSpec

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
    def start(cls, resolved: ResolvedConfig, model: LoadedModel | None = None) -> EngineWorker:
        """Load the model of `resolved` (or take `model`, already in memory in the engine's dtype on
        its device; its weights are consumed) and build rank 0's runner."""
        loaded = model if model is not None else load_engine_model(resolved)
        runner = build_engine_runner(resolved, loaded)
        del loaded.weights  # the runner holds (fused) copies
        return cls(
            runner,
            loaded.name,
            loaded.tokenizer,
            loaded.spec,
            resolved.device,
            resolved.dtype,
            resolved.weight_format,
        )


def load_engine_model(resolved: ResolvedConfig) -> LoadedModel:
    """The model of `resolved`, on its device. Quantized weights are recovered from float32 ones
    (exact for a GGUF's groups); the model casts the rest to the engine's dtype."""
    if resolved.model_dir is None:
        raise RuntimeError("the engine's model was to be handed over in memory, and was not")
    quantized = resolved.weight_format.layers or resolved.weight_format.int4_max_rows
    load_dtype = torch.float32 if quantized else resolved.dtype
    return load_model(resolved.config.model.model, resolved.model_dir, load_dtype, resolved.device)


def build_engine_runner(resolved: ResolvedConfig, model: LoadedModel) -> ModelRunner:
    """Rank 0's runner: the KV cache sized to its memory, the model's context bounded by the cache,
    and on a tensor-parallel replica the other ranks started first (the runner sends them each step)."""
    config = resolved.config
    num_blocks = num_kv_blocks(config, model, resolved.kv_cache_dtype, resolved.device)
    max_len = min(
        config.cache.max_model_len or model.spec.max_position_embeddings, num_blocks * config.cache.block_size
    )
    executor = None
    if config.parallel.tensor_parallel_size > 1:
        check_divisible(model.spec, config.parallel.tensor_parallel_size)
        executor = ParallelExecutor.start(resolved, model.spec, num_blocks, max_len, _rank_main)
    try:
        return build_runner(resolved, model, num_blocks, resolved.device, max_len, executor=executor)
    except BaseException:
        if executor is not None:
            executor.shutdown()
        raise


def build_runner(
    resolved: ResolvedConfig,
    model: LoadedModel,
    num_blocks: int,
    device: torch.device,
    max_model_len: int,
    tp: TensorParallel | None = None,
    executor: ParallelExecutor | None = None,
) -> ModelRunner:
    """One rank's runner, on `device` (this rank's). With tensor parallelism: `tp` is this rank's
    share (rank 0: its `executor`'s), and the model is this rank's shard of the weights (resolved
    to plain torch ops and float weights: the C++ kernels and int4 are single-rank paths)."""
    config = resolved.config
    spec, weights = model.spec, canonical_weights(model.spec, model.weights)
    if config.parallel.tensor_parallel_size > 1:
        check_divisible(spec, config.parallel.tensor_parallel_size)
        tp = executor.tp if executor is not None else tp
        if tp is None:
            raise RuntimeError(
                "a tensor-parallel runner needs its rank's TensorParallel or rank 0's executor"
            )
        spec, weights = shard_weights(spec, weights, tp.rank, tp.world_size)
    kernels = native_kernels() if resolved.kernels == "native" else None
    # On CUDA: decode attention by our Triton kernel, straight from the block table, and the
    # decode step replayed from CUDA graphs (one rank; engine/device/cuda_graphs.py).
    use_triton = resolved.kernels == "triton"
    use_graphs = resolved.cuda_graphs
    block_size = config.cache.block_size
    decoder = DecoderModel(
        spec,
        weights,
        max_model_len,
        dtype=resolved.dtype,
        weight_format=resolved.weight_format,
        kernels=kernels,
        tp=tp,
        paged_decode=triton_decode_attention() if use_triton else None,
        max_loras=config.model.max_loras,
    )
    # With graphs, one block more than the block manager hands out: padding rows write there.
    kv_caches = allocate_kv_caches(
        spec, num_blocks + int(use_graphs), block_size, resolved.kv_cache_dtype, device
    )
    graphs = None
    if use_graphs:
        graphs = DecodeGraphs(
            decoder,
            kv_caches,
            config.scheduler.max_num_seqs,
            block_size,
            max_blocks_per_seq=-(-max_model_len // block_size),
            pad_slot=num_blocks * block_size,
            device=device,
        )
    return ModelRunner(
        decoder, kv_caches, num_blocks, block_size, max_model_len, device, graphs, executor, resolved.kernels
    )


def _rank_main(args: RankArgs, ready: Connection) -> None:
    """The process of a rank > 0: serve steps with this rank's shard of the model."""
    serve_rank(args, ready, _build_rank_runner)


def _build_rank_runner(args: RankArgs, device: torch.device, group: Any) -> ModelRunner:
    resolved = args.resolved
    assert resolved.model_dir is not None, "a tensor-parallel rank loads its model from a folder"
    loaded = load_model(resolved.config.model.model, resolved.model_dir, resolved.dtype, device)
    tp = TensorParallel.of(loaded.spec, args.rank, resolved.config.parallel.tensor_parallel_size, group)
    return build_runner(resolved, loaded, args.num_blocks, device, args.max_model_len, tp=tp)
