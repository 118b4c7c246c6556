"""The native paged decode-attention kernel against plain attention over the same context."""

from __future__ import annotations

import pytest
import torch

from engine.native import paged_decode_attention, resolve_decode_attention


def reference(q, k_cache, v_cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """Attention of each sequence's one query over its context, gathered token by token."""
    num_kv, _, block_size, _ = k_cache.shape
    group = q.shape[1] // num_kv
    out = torch.empty_like(q, dtype=torch.float32)
    for s in range(q.shape[0]):
        pos = torch.arange(int(lens[s]))
        blocks = tables[s, pos // block_size]
        keys = k_cache[:, blocks, pos % block_size].float()  # [kv, ctx, hd]
        values = v_cache[:, blocks, pos % block_size].float()
        for h in range(q.shape[1]):
            scores = keys[h // group] @ q[s, h].float() * scale
            out[s, h] = scores.softmax(-1) @ values[h // group]
    return out


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv", "head_dim", "tol"),
    [
        (torch.float32, 4, 2, 16, 1e-5),
        (torch.float32, 9, 3, 64, 1e-5),
        (torch.bfloat16, 9, 3, 64, 2e-2),
        (torch.float16, 8, 8, 32, 2e-3),
    ],
)
def test_kernel_matches_attention_over_the_gathered_context(
    dtype: torch.dtype, num_heads: int, num_kv: int, head_dim: int, tol: float
) -> None:
    op = paged_decode_attention()
    torch.manual_seed(0)
    block_size, num_blocks = 4, 40
    k_cache = torch.randn(num_kv, num_blocks, block_size, head_dim).to(dtype)
    v_cache = torch.randn(num_kv, num_blocks, block_size, head_dim).to(dtype)
    lens = torch.tensor([1, 4, 5, 13, 30])  # one token, exactly a block, ragged, longest
    max_blocks = -(-int(lens.max()) // block_size)
    # Scattered, distinct blocks; padding past each sequence's blocks is block 0.
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    used = 0
    for s, n in enumerate(lens.tolist()):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    got = op(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert (got.float() - want).abs().max().item() <= tol


def test_kernel_refuses_out_of_range_blocks_and_lengths() -> None:
    op = paged_decode_attention()
    k = torch.zeros(1, 4, 2, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(q, k, k, torch.tensor([[7]]), torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        op(q, k, k, torch.tensor([[0]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        op(q, k, k, torch.tensor([[0]]), torch.tensor([0]), 1.0)


def test_backend_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_decode_attention("auto", cpu) is paged_decode_attention()
    assert resolve_decode_attention("torch", cpu) is None
    assert resolve_decode_attention("auto", cuda) is None
    with pytest.raises(ValueError, match="CPU-only"):
        resolve_decode_attention("native", cuda)


def test_auto_falls_back_to_torch_when_the_kernel_cannot_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.native as native

    def broken() -> None:
        raise RuntimeError("the native paged attention kernel could not be built: no compiler")

    monkeypatch.setattr(native, "paged_decode_attention", broken)
    assert native.resolve_decode_attention("auto", torch.device("cpu")) is None
    with pytest.raises(RuntimeError, match="no compiler"):
        native.resolve_decode_attention("native", torch.device("cpu"))
