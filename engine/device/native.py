"""The engine's C++ kernels for the CPU (engine/device/csrc/kernels.cpp): decode attention straight from
the paged KV cache (with sliding windows and attention sinks), K/V writes into it, and the fused
elementwise parts of a layer (RMSNorm with the residual add, per-head q/k RMSNorm, RoPE in place,
SiLU-and-multiply), the LoRA deltas of decode rows (csrc/lora.cpp), and the experts of a
mixture-of-experts layer in one call (csrc/moe.cpp, over csrc/qmatmul_x86.cpp's grouped matmuls).

Compiled with the machine's C++ compiler on first use (tens of seconds) through
`torch.utils.cpp_extension`, then cached (under $TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions) and loaded in well under a second. Built for the CPU level it runs at
(engine/device/platform.py): `-march=native` at the CPU's own level, the level's x86-64-vN baseline under
a cap, and cached under a name that says which, so a cache made on another CPU is never loaded
(it could die with SIGILL). The name also holds a digest of the sources, so two checkouts never
rebuild each other's cache in place. Without a compiler the engine falls back to plain torch ops.

torch guards a build with a `lock` file that a killed build leaves behind, and every later load
then waits for it forever; we build under an OS lock (`flock`, released when its holder dies), and
a `lock` file found while holding it is stale and removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from engine.device.platform import CpuIsa, cpu_flags, cpu_isa, isa_build_key, isa_of_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "kernels.cpp"
# Plain C++, every ISA: LoRA's decode deltas, and a decode step's layers and a mixture-of-experts
# MLP each in one call over the ops of the other files.
_COMMON_SOURCES = [CSRC / "lora.cpp", CSRC / "decode_layers.cpp", CSRC / "moe.cpp"]
# The quantized matmuls are per ISA: one file each (x86 only so far; elsewhere torch ops serve).
_ISA_SOURCES = {"x86_64": [CSRC / "qmatmul_x86.cpp"], "amd64": [CSRC / "qmatmul_x86.cpp"]}


def sources() -> list[str]:
    return [str(p) for p in (SOURCE, *_COMMON_SOURCES, *_ISA_SOURCES.get(platform.machine().lower(), []))]

def build_name() -> str:
    """The cache entry of this build: the CPU level's key and the sources' digest."""
    digest = hashlib.sha256()
    for path in [*map(Path, sources()), *sorted(CSRC.glob("*.h"))]:  # and the headers they include
        digest.update(path.read_bytes())
    return f"batchgate_kernels_{isa_build_key()}_{digest.hexdigest()[:10]}"


@contextlib.contextmanager
def _build_lock(name: str) -> Any:
    """Hold the OS lock of build `name`; torch's own `lock` file, if one is there, is stale."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir.parent / f"{name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process of ours building: wait for it
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing a stale build lock left by a killed build: %s", stale)
            stale.unlink(missing_ok=True)
        yield


_lock = threading.Lock()
_loaded: Any = None
_error: str | None = None


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv's own (the `ninja` package) is not on it unless the
    venv is activated."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


# Each level's baseline, used when a cap puts the build below the CPU's own level.
_MARCH = {
    CpuIsa.NONE: ["-march=x86-64"],
    CpuIsa.AVX2: ["-march=x86-64-v3"],
    CpuIsa.AVX512: ["-march=x86-64-v4"],
    CpuIsa.AVX512_VNNI: ["-march=x86-64-v4", "-mavx512vnni"],
    CpuIsa.AVX512_BF16: ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
}


def march_flags() -> list[str]:
    """The compiler's target for this process's CPU level."""
    level = cpu_isa()
    if level == isa_of_flags(cpu_flags()):
        return ["-march=native"]
    return _MARCH[level]


def native_kernels() -> Any:
    """The compiled ops (`torch.ops.batchgate`: paged_decode_attention, write_kv_, rms_norm,
    add_rms_norm, rope_, silu_mul, lora_decode_); raises RuntimeError (with the compiler's reason)
    if they cannot be built."""
    global _loaded, _error
    with _lock:
        if _loaded is None and _error is None:
            try:
                from torch.utils.cpp_extension import load

                _put_ninja_on_path()
                name = build_name()
                with _build_lock(name):
                    load(
                        name=name,
                        sources=sources(),
                        # -fopenmp: at::parallel_for is inlined from ATen's headers and runs
                        # serially without it; the runtime is torch's own libgomp (already loaded).
                        # -ffp-contract=off: no implicit FMA, so fused ops round as torch's do.
                        extra_cflags=["-O3", *march_flags(), "-fopenmp", "-ffp-contract=off"],
                        extra_ldflags=["-fopenmp"],
                        is_python_module=False,
                        verbose=False,
                    )
                _loaded = torch.ops.batchgate
            except Exception as exc:  # noqa: BLE001 - any build failure means "not available"
                _error = f"{type(exc).__name__}: {exc}"
        if _loaded is None:
            raise RuntimeError(f"the native CPU kernels could not be built: {_error}")
        return _loaded
