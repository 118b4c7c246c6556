"""The README's session, for real: `batchgate serve` in a subprocess with the bundled SmolLM2-135M,
the curl and openai SDK examples exactly as documented, and a clean shutdown on SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(real_model_dir: Path) -> Iterator[str]:
    """`batchgate serve` (as `python -m gateway.cli serve`) on a free port; yields its base URL."""
    port = _free_port()
    env = {**os.environ, "BATCHGATE_PORT": str(port), "BATCHGATE_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--max-model-len",
            "2048",
            "--kv-cache-memory",
            "128MiB",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(base_url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        yield base_url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_readme_sdk_example(served: str) -> None:
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30,
        temperature=0,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"

    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=30,
            temperature=0,
            stream=True,
        )
        if chunk.choices
    )
    assert streamed == reply.choices[0].message.content


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_example(served: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 30,
        "temperature": 0,
    }
    out = subprocess.run(
        [
            "curl",
            "-s",
            served + "/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "Paris" in json.loads(out)["choices"][0]["message"]["content"]


def test_models_and_health(served: str) -> None:
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused")
    # `make serve` serves both bundled models: the chat model and the embedding model.
    assert [m.id for m in client.models.list()] == [MODEL, "all-MiniLM-L6-v2"]
    vectors = client.embeddings.create(model="all-MiniLM-L6-v2", input=["first text", "second text"])
    assert [len(d.embedding) for d in vectors.data] == [384, 384]  # the README's embeddings call
    assert httpx.get(served + "/health").json() == {"status": "ok"}
    doc = httpx.get(served + "/openapi.json").json()
    assert doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
