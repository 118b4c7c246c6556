"""A gateway-only process (pool mode, no model in it) does not load torch: importing the relay
backend, the app and the CLI leaves `torch` out of `sys.modules` (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["gateway.pool.relay", "gateway.app", "gateway.cli", "engine.client"])
def test_a_gateway_only_import_does_not_load_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} loaded {out.stdout.strip()}"
