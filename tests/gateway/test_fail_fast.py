"""`batchgate serve` with a model it cannot serve exits at once, non-zero, its last line saying what
and why (gateway/cli.py): never a live process that cannot get ready."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.tiny_model import TOKENIZER_FILES

# A Qwen3-shaped config (its tokenizer the bundled one's); the tests change what they need.
CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def model_folder(target: Path, real_model_dir: Path, **config: object) -> Path:
    """A model folder with the bundled tokenizer and this config, and no weights."""
    target.mkdir()
    for name in TOKENIZER_FILES:
        if (real_model_dir / name).exists():
            shutil.copy(real_model_dir / name, target / name)
    (target / "config.json").write_text(json.dumps({**CONFIG, **config}))
    return target


def serve(*args: str, timeout_s: float) -> tuple[int, float, list[str]]:
    """Run `python -m gateway.cli serve ...` to its end: exit status, seconds, stderr's lines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--embedding-model", "none"]
    start = time.monotonic()
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout_s)
    return done.returncode, time.monotonic() - start, done.stderr.strip().splitlines()


def test_an_unsupported_model_type_exits_non_zero_within_10s_naming_it(
    tmp_path: Path, real_model_dir: Path
) -> None:
    folder = model_folder(tmp_path / "unknown", real_model_dir, model_type="qwen3_next")
    status, seconds, lines = serve("--model", str(folder), timeout_s=60)
    assert status != 0 and seconds < 10, (status, seconds, lines)
    assert lines[-1] == (
        f"batchgate: error: --model {folder}: unsupported model_type 'qwen3_next': batchgate serves "
        "llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, gemma3_text, gemma3, phi3, gpt_oss"
    )
    assert not any("Traceback" in line for line in lines)


def test_a_checkpoint_that_does_not_load_stops_the_server_with_its_reason(
    tmp_path: Path, real_model_dir: Path
) -> None:
    """The load runs in the background (so /health answers while it does); when it fails, the
    server stops at once with status 1 instead of answering 503 until a probe kills it."""
    folder = model_folder(tmp_path / "no-weights", real_model_dir)
    status, seconds, lines = serve("--model", str(folder), timeout_s=120)
    assert status == 1, lines
    assert lines[-1] == (
        f"batchgate: error: model {folder} failed to load: ValueError: model folder {folder} has no "
        "*.safetensors weights"
    )
    assert not any("Traceback" in line for line in lines)  # a bad model is a line, not a stack
    assert any("Uvicorn running" in line for line in lines)  # it did serve /health meanwhile
    assert seconds < 60


def test_a_kv_cache_that_does_not_fit_stops_the_server(tmp_path: Path, tiny_model_dir: Path) -> None:
    status, _, lines = serve(
        "--model", str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "1KiB", timeout_s=120
    )
    assert status == 1, lines
    assert lines[-1].startswith(
        f"batchgate: error: model {tiny_model_dir} failed to load: ValueError: KV cache"
    )
