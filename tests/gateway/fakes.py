"""Stand-ins for the engine, its tokenizer and the tenancy facade, for unit tests of the gateway.

`FakeEngine` implements `engine.client.EngineClient` (what the gateway may call on an engine) on
the event loop, with no model: each choice "generates" a scripted reply one byte-token at a time,
and it compiles no grammar (a constrained request is refused with a 400). Tests steer it with
`gate` (outputs wait until it is set), `fail_after` (a choice fails
after that many tokens) and `submit_error` (submit raises). End-to-end tests use the real engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.types import (
    EngineError,
    EngineHealth,
    EngineStats,
    FinishReason,
    GenerationFailedError,
    GenerationRequest,
    GrammarError,
    GrammarSpec,
    LoraError,
    LoraNotFoundError,
    RequestOutput,
    TokenLogprob,
)

IM_START, IM_END = 256, 257
SPECIALS = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}


class FakeTokenizer:
    """Byte-level ids 0..255 plus two control tokens; pieces in the `<0xNN>` byte-fallback form."""

    bos_token_id = IM_START
    eos_token_id = IM_END

    def __len__(self) -> int:
        return 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for t in ids:
            out += SPECIALS[t].encode() if t in SPECIALS else bytes([t])
        return out.decode(errors="replace")

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return SPECIALS.get(token_id, f"<0x{token_id:02X}>")

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> list[int]:
        assert (
            kwargs.get("add_generation_prompt") and kwargs.get("tokenize") and not kwargs.get("return_dict")
        )
        ids: list[int] = []
        for m in conversation:
            if m["content"] == "reject me":
                raise ValueError("the template refuses this conversation")
            ids += [IM_START, *self.encode(f"{m['role']}\n{m['content']}"), IM_END, *self.encode("\n")]
        return ids + [IM_START, *self.encode("assistant\n")]


@dataclass
class FakeEngine:
    model_name: str = "fake-model"
    model_type: str = "llama"
    max_model_len: int = 256
    reply: Callable[[GenerationRequest, int], str] = lambda request, index: f"Hello {index}!"
    num_total_blocks: int = 64
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    ready: bool = True
    stalled_s: float = 0.0  # what health() reports while ready
    step_failures_by_stage: dict[str, int] = field(default_factory=dict)
    gate: asyncio.Event | None = None
    fail_after: int | None = None
    submit_error: EngineError | ValueError | None = None
    error_before_first: EngineError | None = None
    submitted: list[GenerationRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)

    def submit(self, request: GenerationRequest) -> FakeStream:
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted.append(request)
        stream = FakeStream(self, request)
        self.streams.append(stream)
        return stream

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def grammar(self, spec: GrammarSpec) -> Future[Any]:
        compiled: Future[Any] = Future()
        compiled.set_exception(GrammarError("this engine compiles no grammar"))
        return compiled

    def loras(self) -> dict[str, Any]:
        return {}

    def lora_bytes(self) -> int:
        return 0

    def resolve_lora(self, name: str) -> Any:
        raise LoraNotFoundError(f"the adapter {name!r} is not loaded")

    def load_lora(self, name: str, path: str) -> Any:
        raise LoraError("this engine serves no LoRA adapters")

    def unload_lora(self, name: str, wait: bool = True) -> Future[None]:
        raise LoraNotFoundError(f"the adapter {name!r} is not loaded")

    @property
    def num_active(self) -> int:
        return sum(1 for s in self.streams if not s.done)

    def stats(self) -> EngineStats:
        used = min(self.num_active, self.num_total_blocks)
        return EngineStats(
            num_running=self.num_active,
            num_waiting=0,
            num_free_blocks=self.num_total_blocks - used,
            num_total_blocks=self.num_total_blocks,
            block_size=16,
            output_tokens_per_s=0.0,
            num_preemptions=0,
            num_waiting_tokens=0,
            num_running_tokens=0,
            step_failures_by_stage=dict(self.step_failures_by_stage),
        )

    def health(self) -> EngineHealth:
        if not self.ready:
            return EngineHealth(alive=False, reason="the engine was shut down")
        return EngineHealth(alive=True, stalled_s=self.stalled_s)

    def shutdown(self) -> None:
        self.ready = False


class FakeStream:
    """Outputs of one request: every choice advances one token per round, choices interleaved."""

    def __init__(self, engine: FakeEngine, request: GenerationRequest) -> None:
        self.engine = engine
        self.request = request
        self.request_id = request.request_id
        self.done = False
        self.closed = False
        self._outputs = self._generate()

    def _generate(self) -> list[RequestOutput]:
        request, engine = self.request, self.engine
        p = request.sampling
        n_prompt = len(request.prompt_token_ids)
        if engine.error_before_first is not None:
            err = engine.error_before_first
            return [
                RequestOutput(request.request_id, i, (), "", n_prompt, 0, FinishReason.ERROR, error=err)
                for i in range(p.n)
            ]
        per_choice: list[list[RequestOutput]] = []
        for i in range(p.n):
            text = engine.reply(request, i)
            for s in p.stop:
                if s in text:
                    text = text[: text.index(s)] + "\x00"  # \x00 marks "stopped here"
            stopped = text.endswith("\x00")
            ids = list(text.rstrip("\x00").encode())
            finish = FinishReason.STOP
            if len(ids) >= p.max_tokens:
                ids, finish = ids[: p.max_tokens], FinishReason.LENGTH
            elif stopped:
                finish = FinishReason.STOP
            outs = []
            for k, t in enumerate(ids):
                last = k == len(ids) - 1
                failed = engine.fail_after is not None and k == engine.fail_after
                lp = (TokenLogprob(t, -0.5, tuple((t + j, -0.5 - j) for j in range(p.top_logprobs))),)
                outs.append(
                    RequestOutput(
                        request.request_id,
                        i,
                        (t,),
                        "" if failed else bytes([t]).decode(errors="replace"),
                        n_prompt,
                        k + 1,
                        FinishReason.ERROR if failed else (finish if last else None),
                        logprobs=lp if p.logprobs else (),
                        error=GenerationFailedError("generation failed: boom") if failed else None,
                    )
                )
                if failed:
                    break
            if not ids:
                outs.append(RequestOutput(request.request_id, i, (), "", n_prompt, 0, finish))
            per_choice.append(outs)
        merged = []
        for k in range(max(len(o) for o in per_choice)):
            merged += [o[k] for o in per_choice if k < len(o)]
        return merged

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.engine.gate is not None:
            await self.engine.gate.wait()
        await asyncio.sleep(0)
        if self.closed or not self._outputs:
            self.done = True
            raise StopAsyncIteration
        out = self._outputs.pop(0)
        if not self._outputs:
            self.done = True
        return out

    async def aclose(self) -> None:
        if not self.done:
            self.engine.abort(self.request.request_id)
        self.done = self.closed = True


# -- tenancy --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakePlan:
    priority: str = "free"
    queue_deadline_seconds: float = 7.0


@dataclass(frozen=True)
class FakeTenant:
    name: str
    plan: FakePlan = FakePlan()


@dataclass
class FakeDecision:
    admitted: bool
    reason: str = "ok"
    retry_after_s: float = 0.0
    lease: Any = None

    def headers(self) -> dict[str, str]:
        h = {"x-ratelimit-limit-requests": "10"}
        if not self.admitted and self.retry_after_s:
            h["retry-after"] = str(int(self.retry_after_s))
        return h

    def message(self) -> str:
        return "" if self.admitted else f"Rate limit reached ({self.reason})."


class FakeHolder:
    def __init__(self, tenancy: FakeTenancy, lease: Any) -> None:
        self.tenancy, self.lease = tenancy, lease
        self.prompt_tokens = self.completion_tokens = 0
        self.settled = False

    async def __aenter__(self) -> FakeHolder:
        return self

    def record(
        self,
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        if prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens
        if completion_tokens is not None:
            self.completion_tokens = completion_tokens

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        return 0

    def settle(self) -> None:
        if not self.settled:
            self.settled = True
            self.tenancy.settled.append((self.lease, self.prompt_tokens, self.completion_tokens))

    async def close(self) -> None:
        self.settle()


class FakeTenancy:
    """The `tenancy.Tenancy` facade's shape: key "sk-good" is tenant "acme"; `refuse` refuses admission."""

    redis_up: bool | None = None  # no Redis
    admin: None = None  # no Redis: no run-time admin store (nor its audit log)
    open_mode = False  # a tenants file

    def __init__(self) -> None:
        self.refuse: FakeDecision | None = None
        self.admitted: list[tuple[str, int, int, str]] = []
        self.settled: list[tuple[Any, int, int]] = []

    async def ready(self) -> bool:
        return True

    async def authenticate(self, authorization: str | None) -> FakeTenant:
        from tenancy.errors import AuthError

        if authorization != "Bearer sk-good":
            raise AuthError("Incorrect API key provided.")
        return FakeTenant("acme")

    async def identify(self, authorization: str | None) -> Any:
        from tenancy.service import Identity

        return Identity(await self.authenticate(authorization), "key_fake")  # type: ignore[arg-type]

    def on_soft_limit(self, callback: Any) -> None:
        return None

    async def admit(
        self, tenant: FakeTenant, prompt_tokens: int, max_tokens: int, request_id: str, **charge: Any
    ) -> FakeDecision:
        if self.refuse is not None:
            return self.refuse
        self.admitted.append((tenant.name, prompt_tokens, max_tokens, request_id))
        return FakeDecision(admitted=True, lease=request_id)

    def hold(self, lease: Any) -> FakeHolder:
        return FakeHolder(self, lease)
