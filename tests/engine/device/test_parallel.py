"""Tensor parallelism on the CPU (gloo): N ranks answer token for token as one rank does, a rank
count that does not divide the heads is refused, and a dead or hung rank stops the replica within a
bounded time (the engine fails, /ready answers 503 and `batchgate serve` exits)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from engine.config import EngineConfig
from engine.device.parallel import check_divisible, kv_head_layout, shard_weights
from engine.llm_engine import LLMEngine
from engine.model_spec import ModelSpec
from engine.types import EngineDeadError, GenerationRequest
from tests.engine.helpers import chat_ids, greedy, run_all, tiny_engine, tokens_of
from tests.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [list(range(5, 12)), list(range(100, 190)), [7] * 13, list(range(100, 140)) + [3, 4]]


def _greedy_tokens(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    try:
        requests = [GenerationRequest(f"r{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
        outputs = run_all(engine, requests)
        return [tokens_of(outputs[(f"r{i}", 0)]) for i in range(len(prompts))]
    finally:
        engine.close()


def _worker_pids(pid: int) -> list[int]:
    """The tensor-parallel ranks among the children of `pid`, a `batchgate serve` process (not
    multiprocessing's resource tracker)."""
    return [
        c.pid
        for c in psutil.Process(pid).children()
        if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())
    ]


@pytest.fixture(scope="module")
def qwen_one_kv_head(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """Fewer KV heads than ranks (its one KV head replicated), QKV biases and tied embeddings."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen2"),
        real_model_dir,
        model_type="qwen2",
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )


@pytest.mark.parametrize("model", ["llama", "qwen2-one-kv-head"])
def test_two_ranks_answer_as_one_rank_on_tiny_models(
    model: str, tiny_model_dir: Path, qwen_one_kv_head: Path
) -> None:
    model_dir = tiny_model_dir if model == "llama" else qwen_one_kv_head
    # Prompts longer than the 64-token step budget are prefilled in chunks; two share a prefix.
    one = _greedy_tokens(tiny_engine(model_dir), PROMPTS, 12)
    two = _greedy_tokens(tiny_engine(model_dir, tensor_parallel_size=2), PROMPTS, 12)
    assert two == one


def test_shards_cover_the_heads_once_and_replicate_kv_heads_only_when_fewer(real_model_dir: Path) -> None:
    assert kv_head_layout(4, 2) == (2, 1)
    assert kv_head_layout(2, 4) == (1, 2)
    spec = ModelSpec.from_config(
        dict(
            model_type="llama",
            vocab_size=10,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=2,
        )
    )
    weights = {
        "model.embed_tokens.weight": torch.arange(80.0).view(10, 8),
        "lm_head.weight": torch.arange(80.0).view(10, 8),
        "model.layers.0.self_attn.q_proj.weight": torch.arange(64.0).view(8, 8),
        "model.layers.0.self_attn.k_proj.weight": torch.arange(32.0).view(4, 8),
        "model.layers.0.self_attn.v_proj.weight": torch.arange(32.0).view(4, 8),
        "model.layers.0.self_attn.o_proj.weight": torch.arange(64.0).view(8, 8),
    }
    shards = [shard_weights(spec, weights, r, 4) for r in range(4)]
    local = shards[0][0]
    assert (local.num_heads, local.num_kv_heads) == (1, 1)
    q = torch.cat([w["model.layers.0.self_attn.q_proj.weight"] for _, w in shards])
    assert torch.equal(q, weights["model.layers.0.self_attn.q_proj.weight"])
    o = torch.cat([w["model.layers.0.self_attn.o_proj.weight"] for _, w in shards], dim=1)
    assert torch.equal(o, weights["model.layers.0.self_attn.o_proj.weight"])
    k = [w["model.layers.0.self_attn.k_proj.weight"] for _, w in shards]
    assert torch.equal(k[0], k[1]) and torch.equal(k[2], k[3]) and not torch.equal(k[1], k[2])
    head = torch.cat([w["lm_head.weight"] for _, w in shards])  # 4 shards of 3 rows, 2 of padding
    assert head.shape == (12, 8) and torch.equal(head[:10], weights["lm_head.weight"])
    assert not head[10:].any()


def test_a_rank_count_that_does_not_divide_the_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide.*9 attention heads"):
        LLMEngine(EngineConfig.of(dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=64 << 20))
    spec = ModelSpec.from_config(
        dict(vocab_size=8, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8)
    )
    check_divisible(spec, 4)
    with pytest.raises(ValueError, match="MLP size 96"):
        check_divisible(spec, 64)


def test_a_dead_rank_fails_the_engine_at_once(tiny_model_dir: Path) -> None:
    engine = tiny_engine(tiny_model_dir, tensor_parallel_size=2)
    try:
        assert engine.failure is None
        assert engine.runner.executor is not None
        (worker,) = [proc.pid for proc in engine.runner.executor.procs]
        os.kill(worker, signal.SIGKILL)
        engine.add_request(GenerationRequest("r", PROMPTS[0], greedy(4)))
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - started < 10  # a closed connection, not a timeout
        assert engine.failure is not None
    finally:
        engine.close()


def test_a_hung_rank_fails_the_engine_within_the_collective_timeout(tiny_model_dir: Path) -> None:
    engine = tiny_engine(tiny_model_dir, tensor_parallel_size=2, collective_timeout_s=2.0)
    assert engine.runner.executor is not None
    (worker,) = [proc.pid for proc in engine.runner.executor.procs]
    try:
        os.kill(worker, signal.SIGSTOP)
        engine.add_request(GenerationRequest("r", PROMPTS[0], greedy(4)))
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - started < 30
    finally:
        os.kill(worker, signal.SIGKILL)
        engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def nine_heads(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """The bundled model's shape in small: 9 heads over 3 KV heads, an MLP divisible by 3 and
    tied embeddings, with 2 layers of width 144."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-nine-heads"),
        real_model_dir,
        hidden_size=144,
        intermediate_size=192,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )


def test_serve_with_three_ranks_answers_as_one_rank_and_exits_when_a_rank_dies(nine_heads: Path) -> None:
    """`batchgate serve --tensor-parallel-size 3 --dtype float32` over HTTP: greedy completions equal
    one in-process rank's; after a rank is killed, /ready is 503 (or the port is closed) and the
    process exits with status 1 within a bounded time."""
    config = EngineConfig.of(
        model=str(nine_heads), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024
    )
    reference = LLMEngine(config)
    prompts = [chat_ids(reference.tokenizer, q) for q in ("What is 12 times 7?", "Say hello to Ada.")]
    expected = [
        reference.tokenizer.decode(t, skip_special_tokens=True)
        for t in _greedy_tokens(reference, prompts, 16)
    ]

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--tensor-parallel-size", "3"]
        + [
            "--model",
            str(nine_heads),
            "--served-model-name",
            "nine-heads",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "64MiB",
            "--max-model-len",
            "1024",
            "--embedding-model",
            "none",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240  # a safety net: three processes start
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        for prompt, text in zip(prompts, expected, strict=True):
            body = {"model": "nine-heads", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            body["ignore_eos"] = True
            reply = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
            assert reply["choices"][0]["text"] == text

        workers = _worker_pids(proc.pid)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)
        saw_unready = False
        deadline = time.monotonic() + 60  # a safety net: the exit comes within a few seconds
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                saw_unready |= httpx.get(base + "/ready", timeout=2).status_code == 503
            except httpx.TransportError:
                saw_unready = True  # already shutting down
            time.sleep(0.1)
        assert saw_unready
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
