"""Claude Code (npm `@anthropic-ai/claude-code`, installed under .tools by the Makefile) end to end:
`claude -p` with ANTHROPIC_BASE_URL at a real server and a tenant's key, its model ids unchanged
(`claude-*`, an alias of the served model in the models file), nothing else on the network
(telemetry, updates and error reports off). Its first request (~50 KB, ~20k tokens: a billing
line and cache_control blocks in `system`, 12 tools, `<system-reminder>` blocks, a system message
in `messages`, adaptive thinking, context_management, output_config, metadata.user_id, `?beta=true`)
is accepted whole; against the bundled model's window (8,192 tokens) Claude Code shows our
"prompt is too long"; against a 64k-window test model (protocol, not quality) it completes a
turn."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tests.gateway.conftest import LiveServer
from tests.tiny_model import ending_at_once

CLAUDE = Path(__file__).resolve().parents[2] / ".tools/node_modules/@anthropic-ai/claude-code/bin/claude.exe"
KEY = "sk-claude-code"
BUNDLED_WINDOW = 8192  # SmolLM2-135M-Instruct's
WINDOW = 65536
TENANTS = f"""
[plans.paid]
priority = "paid"
tokens_per_minute = 100000000
requests_per_minute = 10000
max_concurrent_requests = 16
queue_deadline_seconds = 120

[tenants.coder]
plan = "paid"
keys = ["{hash_key(KEY)}"]
"""


class Served:
    def __init__(self, server: LiveServer, engine: Any, events: Path) -> None:
        self.server = server
        self.engine = engine
        self.events = events


def _serve(model_dir: Path, window: int, work: Path) -> Iterator[Served]:
    """The model behind tenancy, with `claude-*` an alias of it, served for real."""
    (work / "tenants.toml").write_text(TENANTS)
    (work / "models.toml").write_text('[[aliases]]\nname = "claude-*"\nmodel = "terse"\n')
    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(model_dir),
            served_model_name="terse",
            dtype="float32",
            device="cpu",
            max_model_len=window,
            max_num_seqs=2,
            kv_cache_memory_bytes=64 << 20,
        )
    )
    settings = Settings(
        keep_alive_s=1.0,
        embedding_model="none",
        tenants=str(work / "tenants.toml"),
        models_file=str(work / "models.toml"),
        usage_events_file=str(work / "usage.jsonl"),
    )
    server = LiveServer(
        create_app(settings, engine=engine, tenancy=build_tenancy(settings), owns_tenancy=True)
    )
    try:
        yield Served(server, engine, work / "usage.jsonl")
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def terse_model(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model with a 64k window, ending every answer at once."""
    return ending_at_once(tiny_model_dir, tmp_path_factory.mktemp("terse64k") / "model", WINDOW)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory, terse_model: Path) -> Iterator[Served]:
    yield from _serve(terse_model, WINDOW, tmp_path_factory.mktemp("roomy"))


@pytest.fixture(scope="module")
def bundled_size(tmp_path_factory: pytest.TempPathFactory, terse_model: Path) -> Iterator[Served]:
    yield from _serve(terse_model, BUNDLED_WINDOW, tmp_path_factory.mktemp("bundled-size"))


def _claude(tmp_path: Path, served: Served) -> subprocess.CompletedProcess[str]:
    assert CLAUDE.exists(), "Claude Code missing: `make test` installs it (`make .tools/node_modules/...`)"
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "CLAUDE"))}
    env.update(
        HOME=str(home),
        ANTHROPIC_BASE_URL=served.server.base_url,
        ANTHROPIC_API_KEY=KEY,
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="4096",
        # Nothing but the server: no telemetry, update checks, error reports or other traffic.
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    return subprocess.run(
        [str(CLAUDE), "-p", "--output-format", "json", "Say hi."],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )


def _usage_events(served: Served) -> list[dict[str, Any]]:
    text = served.events.read_text() if served.events.exists() else ""
    return [json.loads(line) for line in text.splitlines()]


def test_claude_code_completes_a_turn(tmp_path: Path, roomy: Served) -> None:
    run = _claude(tmp_path, roomy)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    result = json.loads(run.stdout)
    assert result["type"] == "result" and result["is_error"] is False, result
    assert result["num_turns"] >= 1
    # Its requests were a tenant's, settled, with Claude Code's end user in the usage events.
    events = _usage_events(roomy)
    assert events and all(e["tenant"] == "coder" and e["status"] == "served" for e in events), events
    assert any(e["input_tokens"] > BUNDLED_WINDOW for e in events)  # its ~20k-token prompt
    assert any("session_id" in (e.get("user") or "") for e in events)


def test_claude_code_shows_our_prompt_is_too_long(tmp_path: Path, bundled_size: Served) -> None:
    run = _claude(tmp_path, bundled_size)
    assert run.returncode != 0
    result = json.loads(run.stdout)
    # Claude Code reads our error (`prompt is too long: N tokens > 8191 maximum`) and says so.
    assert (result["terminal_reason"], result["api_error_status"]) == ("prompt_too_long", 400), result
    assert result["api_error_type"] == "invalid_request_error"
    assert result["result"].startswith("Prompt is too long · the request is ~")
    assert f"(limit {BUNDLED_WINDOW - 1})" in result["result"]
