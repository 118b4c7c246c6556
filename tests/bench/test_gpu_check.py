"""bench/gpu_check.py, the one-shot device check, smoke-run on the CPU with the tiny shapes (a dense
one, then one with experts, as the GPU run does Qwen3-8B's and Qwen3-30B-A3B's): it runs from the
repository root with plain imports and prints every figure the device session records."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIGURES = (
    "memory bandwidth (device copy): ",
    "single-stream decode: ",
    "HBM bound ",
    "batch-64 output: ",
    "TTFT 2000-token prompt: ",
    "continuous batching: ",
    "static batching: ",
    "continuous vs static: ",
    "CUDA graphs: not used",
    "attention kernel: ",
    "cuda tests: not run (no CUDA device)",
    "gpu_check: done",
    "== tiny-moe (qwen3_moe)",
    "2 of 8 experts a token",
    "continuous vs static: measured on the first shape only",
)


def test_gpu_check_prints_every_figure_on_the_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the repo itself
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--dtype", "float32"]
        + ["--shape", "tiny,tiny-moe"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for figure in FIGURES:
        assert figure in done.stdout, f"{figure!r} missing from:\n{done.stdout}"
    assert "skipped" not in done.stdout
