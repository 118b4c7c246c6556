"""bench/lora_stress.py, the CI version of issue 26's stress run: 4 tenants' adapters replaced,
loaded and unloaded for a few seconds under 8 concurrent streams (tiny model, fp32, the real
gateway and openai SDK); every response equals its version's reference, another tenant's adapter
is a 404, and the engine's adapter bytes come back to where they were."""

from __future__ import annotations

import json
from pathlib import Path

from bench import lora_stress


def test_the_stress_run_mixes_up_nothing_and_gives_the_bytes_back(tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    argv = ["--tiny", "--seconds", "3", "--streams", "8", "--prompts", "2", "--max-tokens", "12"]
    status = lora_stress.main([*argv, "--change-every", "0.15", "--rank", "8", "--out", str(out)])
    summary = json.loads(out.read_text())
    assert status == 0, summary
    assert (summary["mixups"], summary["divergences"], summary["leaks"], summary["errors"]) == (
        [],
        [],
        [],
        [],
    )
    assert summary["ok"] >= 20 and summary["foreign_refused"] >= 1 and summary["indistinct_references"] == 0
    assert min(summary["changes"].get(k, 0) for k in ("replaced", "loaded", "unloaded")) >= 1, summary[
        "changes"
    ]
    held = summary["adapter_bytes"]
    assert held["before"] == held["after"] == 0 < held["peak"]
