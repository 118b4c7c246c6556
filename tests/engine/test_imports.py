"""What the gateway imports from the engine without a model (engine/client.py's seam, the settings,
the records, the JSON-schema bounds, the embedding batching policy) loads no torch: checked in a
fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = [
    "engine.client",
    "engine.config",
    "engine.embeddings.policy",
    "engine.json_schema",
    "engine.types",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_gateway_side_of_the_engine_imports_without_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} loaded {out.stdout.strip()}"
