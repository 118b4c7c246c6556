"""Platform facts: the container's memory limit, the CPU's instruction-set level and its cap, and
the choices that follow from them (dtype, kernel build key)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.device import platform
from engine.device.platform import CpuIsa, cgroup_memory_available, isa_of_flags
from engine.resolve import resolve_dtype


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"memory.max": "4294967296", "memory.current": "1073741824"}, 3 << 30),  # v2, a pod limit
        ({"memory.max": "max", "memory.current": "1073741824"}, None),  # v2, no limit
        (
            {"memory/memory.limit_in_bytes": "2147483648", "memory/memory.usage_in_bytes": "536870912"},
            (2 << 30) - (512 << 20),
        ),  # v1
        (
            {"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1"},
            None,
        ),  # v1 "unlimited"
        ({"memory.max": "100", "memory.current": "200"}, 0),  # over the limit already: nothing left
        ({}, None),  # no cgroup files (not Linux, or not mounted)
    ],
)
def test_container_limit_is_read_from_cgroup_v2_or_v1(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    assert cgroup_memory_available(write(tmp_path, files)) == expected


def test_available_memory_is_capped_by_the_container(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "cgroup_memory_available", lambda: 1 << 30)
    assert platform.available_memory() == min(1 << 30, platform.psutil.virtual_memory().available)
    monkeypatch.setattr(platform, "cgroup_memory_available", lambda: None)
    assert platform.available_memory() == pytest.approx(platform.psutil.virtual_memory().available, rel=0.2)


ZEN4 = frozenset(
    "avx avx2 fma f16c avx512f avx512bw avx512dq avx512vl avx512_vnni avx512_bf16 avx512ifma".split()
)
ZEN3 = frozenset("sse4_2 avx avx2 fma f16c bmi2 vaes".split())


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (ZEN4, CpuIsa.AVX512_BF16),
        (ZEN3, CpuIsa.AVX2),
        (ZEN4 - {"avx512_bf16"}, CpuIsa.AVX512_VNNI),  # Ice Lake / Cascade Lake
        (ZEN4 - {"avx512_vnni"}, CpuIsa.AVX512),  # bf16 without VNNI: VNNI is below it
        (ZEN3 - {"f16c"}, CpuIsa.NONE),
        (frozenset(), CpuIsa.NONE),  # not Linux, or not x86
    ],
)
def test_the_isa_level_is_the_highest_whose_features_are_all_present(
    flags: frozenset[str], level: CpuIsa
) -> None:
    assert isa_of_flags(flags) == level


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma f16c\nbugs\t: none\n")
    assert platform.cpu_flags(cpuinfo) == {"fpu", "avx2", "fma", "f16c"}
    assert platform.cpu_flags(tmp_path / "missing") == frozenset()


def test_the_environment_caps_the_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(platform.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for cap, level in ((None, CpuIsa.AVX512_BF16), ("avx2", CpuIsa.AVX2), ("none", CpuIsa.NONE)):
        if cap is None:
            monkeypatch.delenv(platform.MAX_ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(platform.MAX_ISA_ENV, cap)
        platform.cpu_isa.cache_clear()
        assert platform.cpu_isa() == level
    # torch's own switch (ATEN_CPU_CAPABILITY=avx2) caps it too.
    monkeypatch.delenv(platform.MAX_ISA_ENV)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    platform.cpu_isa.cache_clear()
    assert platform.cpu_isa() == CpuIsa.AVX2
    assert not platform.cpu_has_bf16()  # so dtype auto is float32 under the AVX2 profile
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setenv(platform.MAX_ISA_ENV, "avx3")
    platform.cpu_isa.cache_clear()
    with pytest.raises(ValueError, match="BATCHGATE_MAX_CPU_ISA must be one of"):
        platform.cpu_isa()
    platform.cpu_isa.cache_clear()


def test_aarch64_refuses_nothing_and_runs_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform.platform, "machine", lambda: "aarch64")
    platform.cpu_isa.cache_clear()
    try:
        assert platform.cpu_isa() == CpuIsa.NONE
        assert platform.isa_build_key().startswith("aarch64_none_")
    finally:
        platform.cpu_isa.cache_clear()


def test_the_kernel_build_key_differs_between_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel cache built on a Zen 4 must not be loaded under the AVX2 profile (SIGILL)."""
    monkeypatch.setattr(platform, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(platform.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    keys = {}
    for cap in ("", "avx2"):
        monkeypatch.setenv(platform.MAX_ISA_ENV, cap)
        platform.cpu_isa.cache_clear()
        keys[cap] = platform.isa_build_key()
    monkeypatch.setattr(platform, "cpu_flags", lambda: ZEN4 | {"amx_tile"})  # another AVX-512 CPU
    monkeypatch.setenv(platform.MAX_ISA_ENV, "")
    platform.cpu_isa.cache_clear()
    keys["other"] = platform.isa_build_key()
    platform.cpu_isa.cache_clear()
    assert keys[""].startswith("x86_64_avx512_bf16_") and keys["avx2"] == "x86_64_avx2_cap"
    assert len(set(keys.values())) == 3


def test_this_machine_is_detected_as_its_features_say() -> None:
    """Runs everywhere: the level matches /proc/cpuinfo (capped only by the environment)."""
    expected = isa_of_flags(platform.cpu_flags()) if platform.platform.machine() == "x86_64" else CpuIsa.NONE
    cap = os.environ.get(platform.MAX_ISA_ENV)
    if cap:
        expected = min(expected, platform.parse_isa(cap))
    expected = min(expected, platform._TORCH_CAPS.get(torch.backends.cpu.get_cpu_capability(), expected))
    assert platform.cpu_isa() == expected
    assert platform.cpu_has_bf16() == (
        expected >= CpuIsa.AVX512_BF16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def test_a_capped_process_builds_and_loads_another_cache_than_the_native_one() -> None:
    """In real processes: the cap in the environment changes the kernels' build name and target,
    so a cache made by an uncapped process (here or on another CPU) is not the one a capped
    process loads."""
    import subprocess
    import sys

    probe = "from engine.device.native import march_flags; from engine.device.platform import isa_build_key; "
    probe += "print(isa_build_key(), *march_flags())"

    def run(cap: str | None) -> list[str]:
        # Without any cap: under `make test`'s AVX2 profile torch's own is set too.
        caps = (platform.MAX_ISA_ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
        env = {k: v for k, v in os.environ.items() if k not in caps}
        if cap is not None:
            env[platform.MAX_ISA_ENV] = cap
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    native, capped = run(None), run("none")
    assert native != capped
    if platform.platform.machine() == "x86_64":
        assert capped == ["x86_64_none_cap", "-march=x86-64"]
        assert native[1] == "-march=native" and not native[0].endswith("_cap")
