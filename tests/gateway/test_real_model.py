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


# ---- Predicted Outputs (engine/speculative/), through the SDK on the served default -------------

LISTING = "\n".join(f"def area_{i}(width, height):\n    return width * height + {i}\n" for i in range(6))
REPEAT = [{"role": "user", "content": "Repeat this code exactly, with no other text:\n\n" + LISTING}]


def test_predicted_outputs_through_the_sdk(served: str) -> None:
    """OpenAI's `prediction=`: the output is the one without it; usage reports the prediction's
    tokens the output took (accepted) and the rest (rejected), as OpenAI's does."""
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused")
    args: dict[str, object] = dict(model=MODEL, messages=REPEAT, max_tokens=100, temperature=0)
    plain = client.chat.completions.create(**args, extra_body={"speculative_decoding": False})  # type: ignore[call-overload]
    text = plain.choices[0].message.content or ""
    assert plain.usage is not None and plain.usage.completion_tokens_details is None
    right = client.chat.completions.create(**args, prediction={"type": "content", "content": text})  # type: ignore[call-overload]
    assert right.choices[0].message.content == text
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 0.8 * right.usage.completion_tokens
    assert details.rejected_prediction_tokens <= 0.2 * right.usage.completion_tokens
    edited = text.replace("height", "depth")
    parts = [{"type": "text", "text": edited[:40]}, {"type": "text", "text": edited[40:]}]
    streamed = client.chat.completions.create(  # type: ignore[call-overload]
        **args,
        prediction={"type": "content", "content": parts},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    metrics = httpx.get(served + "/metrics").text
    accepted = next(
        line
        for line in metrics.splitlines()
        if line.startswith("batchgate_spec_decode_accepted_tokens_total")
    )
    assert float(accepted.split()[-1]) > 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
            "tools",
        ),
        ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
        ({"prediction": {"type": "content", "content": "word " * 3000}}, "prediction"),
    ],
)
def test_predicted_outputs_refuse_what_openai_refuses(
    served: str, extra: dict[str, object], param: str
) -> None:
    body = {
        "model": MODEL,
        "messages": REPEAT,
        "max_tokens": 8,
        "prediction": {"type": "content", "content": LISTING},
    }
    r = httpx.post(served + "/v1/chat/completions", json=body | extra, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
