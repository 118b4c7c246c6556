"""The runner's sizing of the KV cache against the memory it may use."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import runner
from engine.runner import cgroup_memory_available


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
    monkeypatch.setattr(runner, "cgroup_memory_available", lambda: 1 << 30)
    assert runner.available_memory() == min(1 << 30, runner.psutil.virtual_memory().available)
    monkeypatch.setattr(runner, "cgroup_memory_available", lambda: None)
    assert runner.available_memory() == pytest.approx(runner.psutil.virtual_memory().available, rel=0.2)
