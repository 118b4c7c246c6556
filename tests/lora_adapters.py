"""LoRA adapters generated in the test with PEFT (no downloads): random A and B
(`init_lora_weights=False`; PEFT's default B = 0 would change nothing), saved as PEFT saves them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Two tenants of one paid plan, acme and beta ({acme} and {beta}: their key hashes), for the
# adapter ownership tests (tests/gateway/test_lora_e2e.py, tests/pool/test_pool_loras.py).
TENANTS = """
[plans.paid]
priority = "paid"
tokens_per_minute = 1000000
requests_per_minute = 6000
max_concurrent_requests = 16
queue_deadline_seconds = 30

[tenants.acme]
plan = "paid"
keys = ["{acme}"]

[tenants.beta]
plan = "paid"
keys = ["{beta}"]
"""

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: Any,
    target: Path,
    r: int = 8,
    alpha: float | None = None,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """Save a random LoRA of rank `r` over `base` (a transformers model, left unchanged) in `target`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else r / 2,
        target_modules=list(targets),
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    model.save_pretrained(target)
    model.unload()  # the base model's own modules back, unchanged
    return target


def peft_reference(base_dir: Path, adapter_dir: Path) -> Any:
    """transformers + PEFT on `adapter_dir`, fp32: the reference implementation."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
