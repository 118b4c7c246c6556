"""`batchgate serve` with a memory reporter: where does the server's RSS go over time?

    python -m bench.memory_probe --port 8011 --kv-cache-memory 1GiB --out probe.jsonl -- --internal-token t &
    python -m bench.soak --url http://127.0.0.1:8011 --pid $! --internal-token t --minutes 5 --concurrency 8
    python -m bench.memory_probe --linear-rows unpadded   # one packed linear over row counts 9..512
    python -m bench.memory_probe --linear-rows padded     # the same with the engine's row padding

Every `--every-s` seconds it appends one JSON line: RSS; the KV cache's resident bytes (its
mappings, see bench/soak.py); glibc's heap (mallinfo2: bytes in use by malloc, bytes held free in
its arenas, bytes in mmapped chunks); Python's allocated blocks and tracked objects; the engine's
per-request maps (`_seqs`, `_detok`, AsyncEngine `_streams`) and prefix-cache maps. With
`--tracemalloc N`, Python allocations are traced (slower) and each line names the N sources that
grew most since the first report. Server flags after `--` are passed to `batchgate serve`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import psutil

from bench.soak import kv_cache_rss


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost",
        )
    ]  # fmt: skip


def mallinfo() -> dict[str, int]:
    """glibc's heap: `in_use` (malloc'd, not freed), `free_held` (freed, kept in arenas), `mmapped`."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"in_use": m.uordblks, "free_held": m.fordblks, "mmapped": m.hblkhd, "arena": m.arena}


def report(gateway: Any, budget: int, baseline: Any) -> dict[str, Any]:
    proc = psutil.Process()
    line: dict[str, Any] = {"t": round(time.monotonic(), 1), "rss": proc.memory_info().rss}
    line["kv_rss"] = kv_cache_rss(proc.pid, budget) if budget else 0
    line["malloc"] = mallinfo()
    line["py_blocks"] = sys.getallocatedblocks()
    line["gc_objects"] = len(gc.get_objects())
    line["gc_counts"] = gc.get_count()
    line["threads"] = threading.active_count()
    engine = getattr(gateway, "engine", None)
    if engine is not None:
        core = engine.engine
        bm = core.block_manager
        line["maps"] = {
            "seqs": len(core.output_processor.seqs),
            "detok": len(core.output_processor.detoks),
            "streams": len(engine._streams),
            "block_of": len(bm._block_of),
            "evictable": len(bm._evictable),
            "recent": len(core.counters._recent),
        }
    if baseline is not None:
        top = tracemalloc.take_snapshot().compare_to(baseline, "lineno")[: report.top]  # type: ignore[attr-defined]
        line["tracemalloc_top"] = [str(s) for s in top]
    return line


def linear_rows(pad: bool, num_cycles: int = 3) -> None:
    """RSS of one oneDNN-packed bf16 linear (3072x576, a SmolLM2 MLP shape) run at every row count
    9..512, `num_cycles` times, with the engine's row padding or without it."""
    import torch

    from engine.device import quant

    torch.manual_seed(0)
    torch.set_num_threads(1)
    proc = psutil.Process()
    linear = quant.Linear.build(torch.randn(3072, 576).bfloat16())
    inputs = {m: torch.randn(m, 576).bfloat16() for m in range(9, 513)}
    if not pad:
        quant._ROW_LADDER, quant._ROW_STEP_ABOVE = ((1 << 30, 1),), 1  # every count as it is
    start = proc.memory_info().rss
    for cycle in range(num_cycles):
        for m in range(9, 513):
            linear(inputs[m], int4_ok=False)
        grown = (proc.memory_info().rss - start) / 2**20
        held = {k: round(v / 2**20) for k, v in mallinfo().items()}
        print(f"{'padded' if pad else 'unpadded'} cycle {cycle}: RSS +{grown:.0f} MiB; malloc MiB {held}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--every-s", type=float, default=5.0)
    p.add_argument("--tracemalloc", type=int, default=0, metavar="N")
    p.add_argument("--out", type=Path, default=Path("memory_probe.jsonl"))
    p.add_argument(
        "--linear-rows",
        choices=("padded", "unpadded"),
        help="instead of serving: RSS of one packed linear over row counts 9..512 (no model needed)",
    )
    a = p.parse_args(own)
    if a.linear_rows:
        linear_rows(a.linear_rows == "padded")
        return 0

    import os

    import gateway.app as app_module
    from gateway.cli import _flag_value, build_parser, build_tenancy, serve
    from gateway.settings import Settings, option_specs

    args = build_parser().parse_args(
        ["serve", "--port", str(a.port), "--kv-cache-memory", a.kv_cache_memory, *serve_args]
    )
    flags = {spec.name: _flag_value(spec, getattr(args, spec.name)) for spec in option_specs()}
    settings = Settings.load(flags, os.environ)

    # Find the Gateway the app builds, to read its engine's maps.
    holder: dict[str, Any] = {}
    original = app_module.create_app

    def create_and_keep(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)
        holder["gateway"] = app.state.gateway
        return app

    app_module.create_app = create_and_keep  # type: ignore[assignment]
    baseline = None
    if a.tracemalloc:
        tracemalloc.start(8)
        report.top = a.tracemalloc  # type: ignore[attr-defined]

    def reporter() -> None:
        nonlocal baseline
        with a.out.open("a") as f:
            while True:
                time.sleep(a.every_s)
                if a.tracemalloc and baseline is None and holder.get("gateway") is not None:
                    if getattr(holder["gateway"], "engine", None) is not None:
                        baseline = tracemalloc.take_snapshot()
                budget = settings.kv_cache_memory_bytes or 0
                f.write(json.dumps(report(holder.get("gateway"), budget, baseline)) + "\n")
                f.flush()

    threading.Thread(target=reporter, name="memory-probe", daemon=True).start()
    serve(settings, build_tenancy(settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
