"""Platform facts the engine is built on: the CPU's instruction-set level, whether it has native
bf16, and the memory a container may still use. Read here, once, and nowhere else; engine/resolve.py
decides the device and the dtype from them.

The CPU level is what our kernels may use: the features the CPU reports (Linux `/proc/cpuinfo`),
capped by torch's own capability (`ATEN_CPU_CAPABILITY`) and by `BATCHGATE_MAX_CPU_ISA`, so one
switch makes an AVX-512 machine behave as an AVX2 one (docs/OPERATIONS.md, "CPU profiles").
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import platform
from pathlib import Path

import psutil
import torch

MAX_ISA_ENV = "BATCHGATE_MAX_CPU_ISA"


class CpuIsa(enum.IntEnum):
    """The x86 levels our CPU kernels are written for, in order; each includes the ones below."""

    NONE = 0  # no SIMD we use (also every non-x86 CPU: torch ops there)
    AVX2 = 1  # AVX2 + FMA + F16C (x86-64-v3): int8 dot products with vpmaddubsw
    AVX512 = 2  # AVX-512 F/BW/DQ/VL (x86-64-v4)
    AVX512_VNNI = 3  # + vpdpbusd
    AVX512_BF16 = 4  # + native bf16 dot products: bf16 becomes the default dtype


_REQUIRED: dict[CpuIsa, frozenset[str]] = {
    CpuIsa.AVX2: frozenset({"avx2", "fma", "f16c"}),
    CpuIsa.AVX512: frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"}),
    CpuIsa.AVX512_VNNI: frozenset({"avx512_vnni"}),
    CpuIsa.AVX512_BF16: frozenset({"avx512_bf16"}),
}
# torch.backends.cpu.get_cpu_capability() -> the highest level torch itself will run.
_TORCH_CAPS = {"DEFAULT": CpuIsa.NONE, "AVX2": CpuIsa.AVX2, "AVX512": CpuIsa.AVX512_BF16}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The feature flags of the first CPU, empty where they cannot be read (not Linux)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_of_flags(flags: frozenset[str]) -> CpuIsa:
    """The highest level whose features (and every lower level's) are all in `flags`."""
    level = CpuIsa.NONE
    for isa in (CpuIsa.AVX2, CpuIsa.AVX512, CpuIsa.AVX512_VNNI, CpuIsa.AVX512_BF16):
        if not _REQUIRED[isa] <= flags:
            break
        level = isa
    return level


def parse_isa(name: str) -> CpuIsa:
    try:
        return CpuIsa[name.strip().upper()]
    except KeyError:
        choices = ", ".join(i.name.lower() for i in CpuIsa)
        raise ValueError(f"{MAX_ISA_ENV} must be one of {choices}, got {name!r}") from None


@functools.cache
def cpu_isa() -> CpuIsa:
    """The level our kernels run at on this process's CPU (see the module docstring)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return CpuIsa.NONE
    level = isa_of_flags(cpu_flags())
    level = min(level, _TORCH_CAPS.get(torch.backends.cpu.get_cpu_capability(), CpuIsa.AVX512_BF16))
    cap = os.environ.get(MAX_ISA_ENV)
    return min(level, parse_isa(cap)) if cap else level


def isa_build_key() -> str:
    """Names one build of the C++ kernels: the level they are compiled for, and at the native
    level the CPU's exact flags, so a cache built on another CPU is never loaded here."""
    level = cpu_isa()
    native = level == isa_of_flags(cpu_flags())
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:10] if native else "cap"
    return f"{platform.machine().lower()}_{level.name.lower()}_{digest}"


def cpu_has_bf16() -> bool:
    if cpu_isa() < CpuIsa.AVX512_BF16 and platform.machine().lower() in ("x86_64", "amd64"):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cgroup_memory_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the container's memory limit (cgroup v2, else v1) still allows this process group,
    or None when there is no limit. A pod's limit is usually far below the node's free memory,
    which is what psutil reports inside a container."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),  # v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            raw = (root / limit_file).read_text().strip()
            if raw == "max":
                return None
            limit = int(raw)
            if limit >= 1 << 60:  # v1 writes "unlimited" as a page-rounded 2**63 - 1
                return None
            return max(0, limit - int((root / usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def available_memory() -> int:
    """Free memory for the KV cache on the CPU: the machine's, capped by the container's limit."""
    free = int(psutil.virtual_memory().available)
    limited = cgroup_memory_available()
    return free if limited is None else min(free, limited)
