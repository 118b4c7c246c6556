"""Our paged attention op alone (`torch.ops.batchgate.paged_decode_attention`), at SmolLM2-135M's
shape (9 query heads, 3 KV heads of 64, bf16 where the CPU has AVX512-BF16, else fp32 queries over a
bf16 cache), blocks of 16 scattered over a 4,096-block cache.

    python -m bench.paged_attention                            # rows 1,8,32 at 1,504 keys, 1 thread
    python -m bench.paged_attention --rows 1,8 --context 3000 --threads 2
    PYTHONPATH=<checkout> python bench/paged_attention.py      # another checkout's kernels

Rows as a prefill chunk's (one-call layers) or a decode step's (`--decode`): a chunk's row i
attends to one position more than row i - 1 of the same blocks; a decode step's rows each read
their own blocks. Per case: the median of 9 timings of `--calls` calls, per call (one layer) and per
query-head-key pair.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.device.native import native_kernels
from engine.device.platform import CpuIsa, cpu_isa

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 9, 3, 64, 16, 4096


def case(rows: int, context: int, decode: bool) -> tuple[torch.Tensor, ...]:
    """q, the caches, block tables and lengths."""
    dtype = torch.bfloat16 if cpu_isa() >= CpuIsa.AVX512_BF16 else torch.float32
    k = torch.randn(KV_HEADS, BLOCKS, BLOCK, HEAD_DIM).to(torch.bfloat16)
    v = torch.randn(KV_HEADS, BLOCKS, BLOCK, HEAD_DIM).to(torch.bfloat16)
    per_row = -(-context // BLOCK)
    perm = torch.randperm(BLOCKS)
    if decode:
        tables = perm[: rows * per_row].view(rows, per_row)
        lens = torch.full((rows,), context)
    else:
        tables = perm[:per_row].repeat(rows, 1)
        lens = torch.arange(context - rows + 1, context + 1)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    return q, k, v, tables, lens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--context", type=int, default=1504, help="keys the last row attends to")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--decode", action="store_true", help="each row its own blocks")
    args = parser.parse_args()
    native_kernels()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    op = torch.ops.batchgate.paged_decode_attention
    print(f"cpu level {cpu_isa().name}, threads {args.threads}, {'decode' if args.decode else 'chunk'} rows")
    print("| rows | context | per layer, us | per query-key pair, ns |")
    print("|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        q, k, v, tables, lens = case(rows, args.context, args.decode)
        call = (q, k, v, tables, lens, HEAD_DIM**-0.5, 0)
        op(*call)
        times = []
        for _ in range(9):
            start = time.perf_counter()
            for _ in range(args.calls):
                op(*call)
            times.append((time.perf_counter() - start) / args.calls)
        seconds = statistics.median(times)
        pairs = HEADS * int(lens.sum())
        print(f"| {rows} | {args.context:,} | {seconds * 1e6:.0f} | {seconds * 1e9 / pairs:.2f} |")


if __name__ == "__main__":
    main()
