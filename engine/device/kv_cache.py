"""The paged KV cache's memory: how many blocks fit, and the zeroed tensors that hold them."""

from __future__ import annotations

import math
import mmap

import torch

from engine.config import EngineConfig
from engine.device.loader import LoadedModel
from engine.device.platform import available_memory
from engine.model_spec import ModelSpec

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # (K, V) of each layer

def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    return (
        2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.empty((), dtype=dtype).element_size()
    )


def num_kv_blocks(config: EngineConfig, model: LoadedModel, dtype: torch.dtype, device: torch.device) -> int:
    """Blocks that fit the configured KV memory, never more than the engine could ever use."""
    per_block = kv_bytes_per_token(model.spec, dtype) * config.cache.block_size
    if config.cache.kv_cache_memory_bytes is not None:
        budget = config.cache.kv_cache_memory_bytes
    else:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
        budget = int(free * config.cache.kv_cache_memory_fraction)
    max_len = config.cache.max_model_len or model.spec.max_position_embeddings
    useful = config.scheduler.max_num_seqs * -(-max_len // config.cache.block_size)
    num_blocks = min(budget // per_block, useful)
    if num_blocks < 1:
        raise ValueError(
            f"KV cache memory {budget} bytes holds no block of {per_block} bytes: raise kv_cache_memory"
        )
    return int(num_blocks)


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor, its memory committed now.

    Zeros, not garbage: decode attention reads whole blocks, and a NaN left in the masked tail of a
    last block would still make NaN (0 * NaN). On the CPU it is an anonymous mapping of its own
    (outside the malloc heap, so its resident size can be read apart) with every page written at
    start: the RSS a server reaches at start is the one it keeps, and a memory limit that cannot
    hold the cache fails the start, not a request hours later."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    cache = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    cache.fill_(0)  # commit every page (they read as zeros already)
    return cache.view(dtype).view(shape)


def allocate_kv_caches(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    """Each layer's (K, V), [kv_heads, num_blocks, block_size, head_dim] (the layout of
    engine/device/models/attention.py)."""
    shape = (spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
    return [
        (zeroed_cache(shape, dtype, device), zeroed_cache(shape, dtype, device))
        for _ in range(spec.num_layers)
    ]


def kv_cache_bytes(caches: KVCaches) -> int:
    return sum(t.numel() * t.element_size() for kv in caches for t in kv)
