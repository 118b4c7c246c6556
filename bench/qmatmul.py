"""Our quantized matmuls against float32 at SmolLM2-135M's shapes, with the machine's memory
bandwidth measured in the same run (a decode step of one sequence is bound by reading weights).

    .venv/bin/python -m bench.qmatmul [--rows 1,8,32,128,512]

Per shape and row count: the median time of float32 `F.linear`, of our kernel with 8-bit
activations everywhere (outlier ratio inf, llama.cpp's Q8_1 arithmetic) and at the served outlier
ratio, and for one row the time reading the packed weight at the measured bandwidth would take.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.device import quant
from engine.device.native import native_kernels

SHAPES = (
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
)


def median_us(fn: Callable[..., object], args: tuple[object, ...], reps: int) -> float:
    fn(*args)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def bandwidth_gb_s() -> float:
    """Read bandwidth: sums over a 512 MiB buffer (far beyond the caches), best of 5."""
    buf = torch.ones(128 << 20, dtype=torch.float32)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,32,128,512")
    args = parser.parse_args()
    ops = native_kernels()
    rows = [int(r) for r in args.rows.split(",")]
    gbs = bandwidth_gb_s()
    print(f"threads {torch.get_num_threads()}, read bandwidth {gbs:.1f} GB/s")
    print("| shape | rows | float32 us | int8 us | served us | served vs float32 | 1-row bound us |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    for name, n, k in SHAPES:
        weight = torch.randn(n, k) * 0.05
        packed = quant.pack_q8(weight) if name == "lm_head" else quant.pack_q4(weight)
        op = ops.q8_linear if name == "lm_head" else ops.q4_linear
        for m in rows:
            if name == "lm_head" and m > 32:  # the head runs only the rows that sample
                continue
            x = torch.randn(m, k)
            x[:, 7] *= 30  # an outlier channel
            reps = max(5, min(200, 4000 // m))
            t_float = median_us(F.linear, (x, weight), reps)
            t_int8 = median_us(op, (x, packed.packed, n, None, math.inf), reps)
            t_served = median_us(op, (x, packed.packed, n, None, quant.OUTLIER_RATIO), reps)
            bound = packed.packed.numel() / (gbs * 1e3) if m == 1 else float("nan")
            print(
                f"| {name} {n}x{k} | {m} | {t_float:.0f} | {t_int8:.0f} | {t_served:.0f} "
                f"| {t_float / t_served:.2f}x | {bound:.0f} |"
            )


if __name__ == "__main__":
    main()
