"""A model-free OpenAI-compatible server that imitates a continuous-batching engine, for checking the
load generator, the sweep and the plots in seconds (not a benchmark of anything).

    python -m bench.fake_server --port 8011 --step-ms 10 --per-seq-ms 1.5 --max-batch 32

One background loop runs "steps": each step takes `step_ms + per_seq_ms * batch` of wall time and
gives every running sequence one token; prefill costs `prefill_ms_per_token` per prompt word. At most
`max_batch` sequences run; the rest wait. So throughput rises with concurrency until `max_batch`,
then flattens while latency keeps growing: the knee the sweep is meant to show.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


class FakeEngine:
    def __init__(
        self, step_ms: float, per_seq_ms: float, prefill_ms_per_token: float, max_batch: int
    ) -> None:
        self.step_s = step_ms / 1000
        self.per_seq_s = per_seq_ms / 1000
        self.prefill_s = prefill_ms_per_token / 1000
        self.max_batch = max_batch
        self.waiting: list[tuple[asyncio.Queue, int, int]] = []  # (queue, tokens to go, prompt words)
        self.running: list[list] = []
        self.wake = asyncio.Event()

    def submit(self, max_tokens: int, prompt_words: int) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.waiting.append((q, max_tokens, prompt_words))
        self.wake.set()
        return q

    async def loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            prefill = 0
            while self.waiting and len(self.running) < self.max_batch:
                q, n, words = self.waiting.pop(0)
                prefill += words
                self.running.append([q, n])
            await asyncio.sleep(self.step_s + self.per_seq_s * len(self.running) + self.prefill_s * prefill)
            still = []
            for item in self.running:
                item[1] -= 1
                item[0].put_nowait(item[1] == 0)
                if item[1] > 0:
                    still.append(item)
            self.running = still


def build_app(engine: FakeEngine) -> Starlette:
    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def chat(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        max_tokens = int(body.get("max_tokens") or 16)
        words = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        request_id = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        q = engine.submit(max_tokens, words)

        def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
            obj = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": "fake",
                "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            if usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            yield chunk({"role": "assistant", "content": ""})
            n = 0
            while True:
                last = await q.get()
                n += 1
                yield chunk({"content": f" tok{n}"}, "length" if last else None)
                if last:
                    break
            if include_usage:
                yield chunk(
                    {}, usage={"prompt_tokens": words, "completion_tokens": n, "total_tokens": words + n}
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        task = asyncio.get_running_loop().create_task(engine.loop())
        yield
        task.cancel()

    return Starlette(
        routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])],
        lifespan=lifespan,
    )


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--per-seq-ms", type=float, default=1.5)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.2)
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args()
    engine = FakeEngine(args.step_ms, args.per_seq_ms, args.prefill_ms_per_token, args.max_batch)
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
