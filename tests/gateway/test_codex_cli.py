"""Codex CLI (npm `@openai/codex`, installed under .tools by the Makefile) end to end: `codex exec`
with a custom model provider (`wire_api = "responses"`) pointed at a real server. Its first
request (~40 KB, ~10k tokens: developer messages, function and namespace tools, the hosted
web_search tool, reasoning, include, client_metadata, store false) is accepted whole; against a
window too small for it Codex shows our context-length error; against a 32k-window test model
(protocol, not quality) it completes a turn."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import TinyServer, serve_model
from tests.tiny_model import ending_at_once

CODEX = Path(__file__).resolve().parents[2] / ".tools/node_modules/@openai/codex/bin/codex.js"
WINDOW = 32768


@pytest.fixture(scope="module")
def terse_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TinyServer]:
    """A 32k-window test model that ends every answer at once, served for real."""
    model = ending_at_once(tiny_model_dir, tmp_path_factory.mktemp("terse") / "model", WINDOW)
    yield from serve_model(model, WINDOW, max_num_seqs=2)


def _codex(
    tmp_path: Path, server: TinyServer, *, websockets: bool = False
) -> subprocess.CompletedProcess[str]:
    assert CODEX.exists(), "Codex CLI missing: `make test` installs it (`make .tools/node_modules/...`)"
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{server.model}"\n'
        'model_provider = "batchgate"\n'
        "[model_providers.batchgate]\n"
        'name = "batchgate"\n'
        f'base_url = "{server.base_url}/v1"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n" + ("supports_websockets = true\n" if websockets else "")
    )
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "CODEX"))}
    env["CODEX_HOME"] = str(home)
    return subprocess.run(
        [
            shutil.which("node") or "node",
            str(CODEX),
            "exec",
            "--json",
            "--skip-git-repo-check",
            "--ephemeral",
            "-s",
            "read-only",
            "-C",
            str(work),
            "Say hi.",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def _events(run: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_codex_completes_a_turn(tmp_path: Path, terse_server: TinyServer) -> None:
    run = _codex(tmp_path, terse_server)
    kinds = [e.get("type") for e in _events(run)]
    assert run.returncode == 0 and "turn.completed" in kinds, (kinds, run.stderr[-2000:])
    terse_server.wait_idle()


def _websocket_turns(server: TinyServer) -> float:
    metrics = httpx.get(f"{server.base_url}/metrics").text
    found = re.search(r"^batchgate_responses_websocket_turns_total (\S+)$", metrics, re.MULTILINE)
    assert found is not None, "no websocket turn counter"
    return float(found.group(1))


def test_codex_completes_a_turn_over_the_websocket(tmp_path: Path, terse_server: TinyServer) -> None:
    before = _websocket_turns(terse_server)
    run = _codex(tmp_path, terse_server, websockets=True)
    kinds = [e.get("type") for e in _events(run)]
    assert run.returncode == 0 and "turn.completed" in kinds, (kinds, run.stderr[-2000:])
    # It went over the socket, not Codex's fallback to HTTP.
    assert _websocket_turns(terse_server) > before, run.stderr[-2000:]
    terse_server.wait_idle()


def test_codex_shows_our_context_length_error(tmp_path: Path, tiny_server: TinyServer) -> None:
    run = _codex(tmp_path, tiny_server)  # a 1024-token window: Codex's ~10k-token prompt does not fit
    assert run.returncode != 0
    # Codex reads our error code (context_length_exceeded) and says so in its own words.
    assert "ran out of room in the model's context window" in run.stdout, run.stdout[-2000:]
