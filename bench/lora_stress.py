"""LoRA adapters hot-loaded, replaced and unloaded under concurrent streams of several tenants
(issue 26's stress run): no response may be computed with another adapter or version than the one
it started with.

    python -m bench.lora_stress --seconds 120 --streams 32 --tenants 4   # the issue's run (bundled model)
    python -m bench.lora_stress --tiny --seconds 4 --streams 8           # CI: tests/bench/test_lora_stress.py

A real gateway (uvicorn, in this process) over the engine in float32 (the parity mode), with
`--tenants` tenants. Tenant k owns two adapter names: `tK-tuned`, which the admin API replaces back
and forth between two versions, and `tK-extra`, which it loads and unloads. `--streams` client
threads (the official openai SDK, streaming) each send one tenant's requests, one after another: to
the base model, to its adapters, or now and then to another tenant's adapter, which must be a 404.

An admin change waits until no request is between being sent and its first token (a
writer-preferring lock), so every request's adapter version is known: the one current when it
was sent. Each response is compared with that version's reference, the same prompt alone through
the same server before the run. Equal: ok; equal to another adapter's or version's reference: a
mix-up; neither: a divergence. At the end every adapter is unloaded: the engine's adapter bytes
must be back to what they were (0), and RSS after malloc_trim is printed. Exit status 0 when there
were no mix-ups, divergences or leaks and the bytes came back.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

BASE = "base"
ADMIN_KEY = "bg-admin-stress"
VERSIONS = ("a", "b")  # the two versions `tK-tuned` alternates between; "x" is `tK-extra`'s


class ChangeLock:
    """Many requests start at once (shared); an admin change (exclusive) waits for the ones
    starting, and new ones wait while a change is pending (so changes are not starved)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._starting = 0
        self._changing = False
        self._waiting = 0

    def start(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._changing and not self._waiting)
            self._starting += 1

    def started(self) -> None:
        with self._cond:
            self._starting -= 1
            self._cond.notify_all()

    def change(self) -> Any:
        lock = self

        class Held:
            def __enter__(self) -> None:
                with lock._cond:
                    lock._waiting += 1
                    lock._cond.wait_for(lambda: not lock._changing and not lock._starting)
                    lock._waiting -= 1
                    lock._changing = True

            def __exit__(self, *exc: object) -> None:
                with lock._cond:
                    lock._changing = False
                    lock._cond.notify_all()

        return Held()


@dataclass
class Tally:
    ok: int = 0
    mixups: list[str] = field(default_factory=list)
    divergences: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)  # another tenant's adapter answered
    errors: list[str] = field(default_factory=list)  # a request that failed
    refused: int = 0  # another tenant's adapter: 404, as it must be
    changes: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def tenants_toml(count: int) -> str:
    from tenancy import hash_key

    plan = (
        '[plans.paid]\npriority = "paid"\ntokens_per_minute = 100000000\nrequests_per_minute = 1000000\n'
        "max_concurrent_requests = 64\nqueue_deadline_seconds = 120\n"
    )
    return plan + "".join(
        f'\n[tenants.t{k}]\nplan = "paid"\nkeys = ["{hash_key(f"sk-t{k}")}"]\n' for k in range(count)
    )


def build_adapters(model_dir: Path, root: Path, tenants: int, rank: int) -> dict[str, Path]:
    """Folder per (tenant, version): `tK-a`, `tK-b` (the tuned name's versions), `tK-x` (extra)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.lora_adapters import make_adapter

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    folders = [f"t{k}-{v}" for k in range(tenants) for v in (*VERSIONS, "x")]
    return {f: make_adapter(base, root / f, r=rank, alpha=rank, seed=i + 1) for i, f in enumerate(folders)}


class Stress:
    def __init__(self, base_url: str, args: argparse.Namespace, prompts: list[list[int]]) -> None:
        self.url = base_url
        self.args = args
        self.prompts = prompts
        self.lock = ChangeLock()
        self.tally = Tally()
        self.current: dict[str, str | None] = {}  # adapter name -> folder of its current version
        self.refs: dict[tuple[str, int], str] = {}  # (folder or BASE, prompt) -> reference text
        self.indistinct = 0  # references equal to another's for the same prompt

    def admin(self, method: str, path: str, body: Any = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.request(method, self.url + path, json=body, headers=headers, timeout=60)

    def put(self, name: str, folders: dict[str, Path], folder: str, tenant: str | None) -> None:
        done = self.admin("PUT", f"/admin/loras/{name}", {"path": str(folders[folder]), "tenant": tenant})
        assert done.status_code == 200, done.text
        self.current[name] = folder

    def complete(self, key: str, model: str, prompt: int, on_first: Any = None) -> str:
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)
        stream = client.completions.create(
            model=model,
            prompt=self.prompts[prompt],
            max_tokens=self.args.max_tokens,
            temperature=0,
            stream=True,
        )
        text, first = [], True
        for chunk in stream:
            if first and on_first is not None:
                on_first()
            first = False
            text.append(chunk.choices[0].text if chunk.choices else "")
        return "".join(text)

    def references(self, folders: dict[str, Path]) -> None:
        """Each version's output for each prompt, alone, under a public name loaded for it."""
        for p in range(len(self.prompts)):
            self.refs[(BASE, p)] = self.complete("sk-t0", BASE, p)
        for folder in folders:
            self.put("ref", folders, folder, None)
            for p in range(len(self.prompts)):
                self.refs[(folder, p)] = self.complete("sk-t0", "ref", p)
        assert self.admin("DELETE", "/admin/loras/ref").status_code == 200
        del self.current["ref"]
        for p in range(len(self.prompts)):  # a swap between two of these would go unseen: say so
            texts = [text for (_, q), text in self.refs.items() if q == p]
            self.indistinct += len(texts) - len(set(texts))

    def stream(self, worker: int, deadline: float) -> None:
        rng = random.Random(worker)
        tenant = worker % self.args.tenants
        key = f"sk-t{tenant}"
        while time.monotonic() < deadline:
            p = rng.randrange(len(self.prompts))
            roll = rng.random()
            if roll < 1 / 16 and self.args.tenants > 1:
                other = (tenant + 1 + rng.randrange(self.args.tenants - 1)) % self.args.tenants
                self.foreign(key, f"t{other}-tuned", p)
                continue
            self.lock.start()
            name = BASE if roll < 0.3 else f"t{tenant}-extra" if roll < 0.55 else f"t{tenant}-tuned"
            folder = BASE if name == BASE else self.current.get(name)
            if folder is None:  # the extra adapter is unloaded right now
                name, folder = f"t{tenant}-tuned", self.current[f"t{tenant}-tuned"]
            released = False

            def first() -> None:
                nonlocal released
                released = True
                self.lock.started()

            what = f"{key} {name} ({folder}) prompt {p}"
            try:
                text = self.complete(key, name, p, first)
            except Exception as exc:  # noqa: BLE001 - counted: every request must end in its answer
                with self.tally.lock:
                    self.tally.errors.append(f"{what}: {type(exc).__name__}: {exc}")
                continue
            finally:
                if not released:
                    self.lock.started()
            self.judge(what, folder, p, text)

    def foreign(self, key: str, name: str, p: int) -> None:
        import openai

        try:
            text = self.complete(key, name, p)
        except openai.NotFoundError:
            with self.tally.lock:
                self.tally.refused += 1
            return
        with self.tally.lock:
            self.tally.leaks.append(f"{key} got an answer from {name}: {text[:40]!r}")

    def judge(self, what: str, folder: str, p: int, text: str) -> None:
        want = self.refs[(folder, p)]
        with self.tally.lock:
            if text == want:
                self.tally.ok += 1
                return
            others = [f for (f, q), ref in self.refs.items() if q == p and ref == text]
            if others:
                self.tally.mixups.append(f"{what}: got the output of {others[0]}")
            else:
                self.tally.divergences.append(f"{what}: {text[:60]!r} != {want[:60]!r}")

    def churn(self, folders: dict[str, Path], deadline: float) -> None:
        """Every `--change-every` seconds one change: a tenant's tuned adapter replaced by its other
        version, or its extra adapter loaded or unloaded (without waiting for its users)."""
        rng = random.Random(-1)
        while time.monotonic() + self.args.change_every < deadline:
            time.sleep(self.args.change_every)
            tenant = rng.randrange(self.args.tenants)
            with self.lock.change():
                if rng.random() < 0.5:
                    name = f"t{tenant}-tuned"
                    now = self.current[name]
                    other = VERSIONS[1 - VERSIONS.index(now[-1])] if now else VERSIONS[0]
                    self.put(name, folders, f"t{tenant}-{other}", f"t{tenant}")
                    self.tally.changes["replaced"] += 1
                elif self.current.get(f"t{tenant}-extra") is None:
                    self.put(f"t{tenant}-extra", folders, f"t{tenant}-x", f"t{tenant}")
                    self.tally.changes["loaded"] += 1
                else:
                    gone = self.admin("DELETE", f"/admin/loras/t{tenant}-extra?timeout_s=0")
                    assert gone.status_code == 200, gone.text
                    self.current[f"t{tenant}-extra"] = None
                    self.tally.changes["unloaded"] += 1


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def trimmed_rss_mib() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mib()


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from bench.model import hf_folder
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from gateway.app import create_app
    from gateway.cli import build_tenancy
    from gateway.settings import Settings
    from tenancy import hash_key
    from tests.gateway.conftest import LiveServer
    from tests.tiny_model import make_tiny_model

    model_dir = make_tiny_model(work / "tiny", hf_folder()) if args.tiny else hf_folder(args.model)
    folders = build_adapters(model_dir, work / "loras", args.tenants, args.rank)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["Once upon a time", "The capital of France is", "List three primes:", "def fibonacci(n):"]
    prompts = [list(tokenizer.encode(t)) for t in texts[: args.prompts]]
    (work / "tenants.toml").write_text(tenants_toml(args.tenants))
    settings = Settings(
        tenants=str(work / "tenants.toml"),
        admin_key_hash=hash_key(ADMIN_KEY),
        embedding_model="none",
        lora_roots=(str(work / "loras"),),
    )
    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(model_dir),
            served_model_name=BASE,
            dtype="float32",
            max_num_seqs=args.streams,
            max_loras=args.max_loras,
            max_model_len=512,
            kv_cache_memory_bytes=args.kv_cache_mib << 20,
        )
    )
    live = LiveServer(create_app(settings, engine=engine, tenancy=build_tenancy(settings), owns_tenancy=True))
    try:
        stress = Stress(live.base_url, args, prompts)
        held_before = stress.admin("GET", "/admin/loras").json()["bytes_held"][BASE]
        rss_start = trimmed_rss_mib()
        stress.references(folders)
        for k in range(args.tenants):
            stress.put(f"t{k}-tuned", folders, f"t{k}-a", f"t{k}")
            stress.put(f"t{k}-extra", folders, f"t{k}-x", f"t{k}")
        start = time.monotonic()
        deadline = start + args.seconds
        with ThreadPoolExecutor(args.streams + 1) as pool:
            jobs = [pool.submit(stress.stream, w, deadline) for w in range(args.streams)]
            jobs.append(pool.submit(stress.churn, folders, deadline))
            for job in jobs:
                job.result()
        elapsed = time.monotonic() - start
        held_peak = stress.admin("GET", "/admin/loras").json()["bytes_held"][BASE]
        rss_peak = rss_mib()
        for name, folder in stress.current.items():
            if folder is not None:
                assert stress.admin("DELETE", f"/admin/loras/{name}").json()["released"] is True
        held_after = stress.admin("GET", "/admin/loras").json()["bytes_held"][BASE]
        rss_after = trimmed_rss_mib()
    finally:
        live.stop()
        engine.shutdown()
    t = stress.tally
    return {
        "seconds": round(elapsed, 1),
        "streams": args.streams,
        "tenants": args.tenants,
        "indistinct_references": stress.indistinct,
        "responses": t.ok + len(t.mixups) + len(t.divergences),
        "ok": t.ok,
        "mixups": t.mixups,
        "divergences": t.divergences,
        "foreign_refused": t.refused,
        "leaks": t.leaks,
        "errors": t.errors,
        "changes": dict(t.changes),
        "responses_per_s": round((t.ok + len(t.mixups) + len(t.divergences)) / elapsed, 1),
        "adapter_bytes": {"before": held_before, "peak": held_peak, "after": held_after},
        "rss_mib": {"start": round(rss_start), "peak": round(rss_peak), "after_trim": round(rss_after)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts (at most 4)")
    parser.add_argument(
        "--max-loras", type=int, default=8, help="resident slots (fewer than versions: some wait)"
    )
    parser.add_argument("--change-every", type=float, default=0.25, help="seconds between admin changes")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--model", help="a Hugging Face folder or .gguf (default: the bundled model)")
    parser.add_argument("--tiny", action="store_true", help="a random 2-layer model (CI)")
    parser.add_argument("--out", type=Path, help="write the summary as JSON here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-stress-") as tmp:
        summary = run(args, Path(tmp))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    bytes_back = summary["adapter_bytes"]["after"] == summary["adapter_bytes"]["before"]
    clean = not any(summary[k] for k in ("mixups", "divergences", "leaks", "errors"))
    return 0 if clean and bytes_back and summary["ok"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
