"""The in-process generation backend: chat and completions on an `AsyncEngine` in this process.

    plan:    tokenize (chat template, tools) -> sampling params and the context rule (400)
             -> compile the grammar (400) -> tokens to reserve
    execute: submit (one engine request per prompt) -> stream (first output awaited up to the
             keep-alive) or gather -> the OpenAI body or SSE chunks (gateway/openai/generation.py)

The event loop never runs the model: the engine computes in its own thread and hands outputs
back through its stream; large prompts are tokenized in a worker thread. The engine's streams
are closed with the call (an unfinished sequence is aborted, its KV blocks freed).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio

from engine.types import EngineError, GenerationRequest, LoraError, SamplingParams
from gateway.admission import Caller
from gateway.backend import Body, Call, ModelCard, NotReady, Plan, Reply, Stream, Task, Work
from gateway.errors import UNAVAILABLE_RETRY_AFTER_S, APIError, ErrorKind, from_engine_error, invalid_request
from gateway.local.hooks import Fit, LocalRoute
from gateway.loras import wait_released
from gateway.metrics import Metrics, TimedStream
from gateway.openai import generation, protocol, tools
from gateway.openai.formats import ChatFormat
from gateway.openai.tokenizer import Tokenizer, inline_or_thread
from gateway.settings import LoraSpec, Settings

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.client import EngineClient
    from engine.lora import LoraAdapter

logger = logging.getLogger("batchgate.gateway")

EngineFactory = Callable[[Settings], "EngineClient"]


def default_engine_factory(settings: Settings) -> AsyncEngine:
    """The in-process engine of `settings`' model (blocking: it loads the model)."""
    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(settings.engine_config())


class EngineBackend:
    """One chat model served by an in-process engine (given started, or built at `start()`)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        engine: EngineClient | None = None,
        engine_factory: EngineFactory = default_engine_factory,
        *,
        routes: Mapping[str, LocalRoute],
        loras: Sequence[LoraSpec] = (),
    ) -> None:
        """`loras`: the adapters to load at start (a failure to load one fails the start).
        `routes`: by endpoint path, how each endpoint it serves is planned and answered (the
        endpoint table's `LOCAL_ROUTES`)."""
        self.settings = settings
        self.metrics = metrics
        self.engine_factory = engine_factory
        self.owns_engine = engine is None
        self.engine: EngineClient | None = None
        self.tokenizer: Tokenizer | None = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self.lora_specs = tuple(loras)
        self.routes = routes
        self.lora_owners: dict[str, str | None] = {}  # adapter name -> its tenant (None: public)
        if engine is not None:
            self.tokenizer = Tokenizer(engine.tokenizer, engine.model_type)
            self.engine = engine

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model and its adapters (in a worker thread; errors are kept for /health and
        /ready)."""
        if self.engine is not None:
            await self._load_start_loras(self.engine)
            return
        try:
            engine = await anyio.to_thread.run_sync(self.engine_factory, self.settings)
            tokenizer = await anyio.to_thread.run_sync(Tokenizer, engine.tokenizer, engine.model_type)
            await self._load_start_loras(engine)
        except Exception as exc:  # noqa: BLE001 - reported by /health and /ready, and logged
            self.load_error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ValueError | OSError):  # the model or a setting: its message says it
                logger.error("loading the model failed: %s", self.load_error)
            else:
                logger.exception("loading the model failed")
            return
        self.tokenizer = tokenizer
        self.engine = engine
        freeze_startup_heap()
        logger.info("serving %s (max_model_len %d)", self.name, engine.max_model_len)

    async def _load_start_loras(self, engine: EngineClient) -> None:
        for spec in self.lora_specs:
            try:
                await anyio.to_thread.run_sync(engine.load_lora, spec.name, spec.path)
            except LoraError as exc:
                self.load_error = f"LoRA adapter {spec.name}: {exc}"
                raise
            self.lora_owners[spec.name] = spec.tenant

    # -- LoRA adapters (gateway/loras.py) ----------------------------------------------------

    def adapters(self) -> dict[str, LoraAdapter]:
        """The adapters this backend serves, by name (those the engine has and we know the owner of)."""
        if self.engine is None:
            return {}
        return {n: a for n, a in self.engine.loras().items() if n in self.lora_owners}

    def adapter_bytes(self) -> int:
        return 0 if self.engine is None else self.engine.lora_bytes()

    def resident(self) -> tuple[str, ...]:
        return () if self.engine is None else self.engine.stats().loras_resident

    async def load_lora(self, name: str, path: str, tenant: str | None) -> LoraAdapter:
        engine, _ = self._running()
        if name == self.name:
            raise APIError(ErrorKind.INVALID_REQUEST, f"{name!r} is the base model's name.", param="name")
        adapter = await anyio.to_thread.run_sync(engine.load_lora, name, path)
        self.lora_owners[name] = tenant
        return adapter

    async def unload_lora(self, name: str, wait: bool, timeout_s: float) -> bool:
        """Unload `name`; whether its memory was released within `timeout_s` (see gateway/loras.py)."""
        engine, _ = self._running()
        done = engine.unload_lora(name, wait)
        self.lora_owners.pop(name, None)
        return await wait_released(done, timeout_s)

    async def aclose(self) -> None:
        if self.owns_engine and self.engine is not None:
            await anyio.to_thread.run_sync(self.engine.shutdown)

    # -- what it serves, and whether it can -----------------------------------------------------

    @property
    def name(self) -> str | None:
        if self.engine is None:
            return self.settings.served_model_name
        return self.settings.served_model_name or self.engine.model_name

    def models(self) -> list[ModelCard]:
        name = self.name
        if self.engine is None or name is None:
            return []
        adapters = [ModelCard(n, self.created, Task.GENERATE, self.lora_owners[n]) for n in self.adapters()]
        return [ModelCard(name, self.created, Task.GENERATE), *adapters]

    async def find(self, model: str) -> bool:
        return False

    def problem(self) -> str | None:
        if self.load_error is not None:
            return f"model {self.settings.model or 'bundled'} failed to load: {self.load_error}"
        if self.engine is not None:
            return self.engine.health().problem(self.settings.engine_stall_timeout_s)
        return None

    async def not_ready(self) -> NotReady | None:
        if self.load_error is not None:
            return NotReady(
                "error",
                f"model failed to load: {self.load_error}",
                f"The model failed to load: {self.load_error}",
            )
        if self.engine is None:
            return NotReady("loading", "loading", "The model is still loading; retry shortly.")
        # A stalled engine is unready at once, so gateways route around it while the
        # orchestrator's liveness probe (/health) takes its time to restart the process.
        problem = self.engine.health().problem(self.settings.engine_stall_timeout_s)
        if problem is not None:
            return NotReady("unavailable", problem, "The engine is not running.")
        if not self.engine.ready:
            return NotReady("unavailable", "the engine is not running", "The engine is not running.")
        return None

    def _running(self) -> tuple[EngineClient, Tokenizer]:
        if self.engine is None or self.tokenizer is None or not self.engine.ready:
            raise APIError(
                ErrorKind.UNAVAILABLE, "The engine is not running.", retry_after_s=UNAVAILABLE_RETRY_AFTER_S
            )
        return self.engine, self.tokenizer

    # -- requests ----------------------------------------------------------------------------

    async def plan(self, work: Work) -> Plan:
        self._running()
        route = self.routes.get(work.endpoint.path)
        if route is None:
            raise RuntimeError(f"{work.endpoint.path} is not served by the generation engine")
        return await route.plan(self, work)

    async def plan_completion(self, work: Work, req: protocol.CompletionRequest) -> Plan:
        """A completions request's plan: every prompt tokenized, echo prefixes kept."""
        engine, tokenizer = self._running()
        size = sum(len(p) for p in req.prompt)
        prompts = await inline_or_thread(
            lambda ps: [tokenizer.encode_prompt(p) for p in ps], req.prompt, size
        )
        params = protocol.sampling_params(
            req,
            num_prompt_tokens=len(max(prompts, key=len)),
            max_model_len=engine.max_model_len,
            vocab_size=tokenizer.vocab_size,
        )
        params = _within_reservation(params, work.caller, sum(len(p) for p in prompts), len(prompts))
        job = self._job(work, params, params.n * len(prompts), sum(len(p) for p in prompts), tokenizer)
        if req.echo:
            texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompt]
            job.echo_prefixes = [text for text in texts for _ in range(params.n)]
        return self._plan(work, job, prompts, params, param="prompt")

    async def plan_chat(
        self,
        work: Work,
        req: protocol.ChatCompletionRequest,
        *,
        param: str,
        output: tools.OutputPlan | None = None,
        fit: Fit | None = None,
    ) -> Plan:
        """A chat request's plan; a Responses request is planned as the chat request it renders
        (with its own `output` plan: custom tools, its field names), a Messages request too (with
        its own rule for a max_tokens over the window's room: `fit`)."""
        engine, tokenizer = self._running()
        fmt = tokenizer.format  # the model family's calls and reasoning (gateway/openai/formats.py)
        if output is None:  # response_format and tools, in the family's syntax
            output = fmt.plan_output(req, closed_arguments=self.closed_arguments)
        size = sum(len(m.text) for m in req.messages)
        template_kwargs = req.chat_template_kwargs
        prompt = await inline_or_thread(
            lambda ms: tokenizer.encode_chat(ms, output.tools, template_kwargs), req.messages, size
        )
        if fit is not None:
            max_tokens = fit(len(prompt), engine.max_model_len)
            req = req.model_copy(update={"max_tokens": max_tokens, "max_completion_tokens": None})
        params = protocol.sampling_params(
            req,
            num_prompt_tokens=len(prompt),
            max_model_len=engine.max_model_len,
            vocab_size=tokenizer.vocab_size,
            prompt_param=param,
            limit="max_output_tokens" if param == "input" else "max_tokens",
        )
        params = _within_reservation(params, work.caller, len(prompt))
        if req.prediction is not None:
            params = dataclasses.replace(
                params,
                prediction=_prediction(tokenizer, req.prediction.content, len(prompt), engine.max_model_len),
            )
        if output.grammar is not None:
            await tools.compile_checks(engine, output)  # a schema it cannot compile: 400 here
            params = dataclasses.replace(params, grammar=output.grammar)
        if fmt.keep_special_tokens:  # its markers are special tokens: the parser reads them
            params = dataclasses.replace(params, skip_special_tokens=False)
        job = self._job(work, params, params.n, len(prompt), tokenizer)
        job.num_prediction_tokens = len(params.prediction) if req.prediction is not None else None
        job.parse_tool_calls = output.parse_tool_calls
        job.parser = fmt.parser(output, fmt.reasoning(template_kwargs))
        return self._plan(work, job, [prompt], params, param=param)

    @property
    def chat_format(self) -> ChatFormat:
        """The served model's chat conventions (its tool-call syntax, its reasoning)."""
        return self._running()[1].format

    @property
    def closed_arguments(self) -> bool:
        return self.settings.tool_arguments == "declared"

    async def plan_count(self, req: protocol.ChatCompletionRequest) -> Plan:
        """The prompt's exact token count, as `POST /v1/responses/input_tokens` answers it."""
        _, tokenizer = self._running()
        output = tools.plan_output(req)
        size = sum(len(m.text) for m in req.messages)
        prompt = await inline_or_thread(
            lambda ms: tokenizer.encode_chat(ms, output.tools, req.chat_template_kwargs), req.messages, size
        )

        async def execute(call: Call) -> Reply:
            return Body({"object": "response.input_tokens", "input_tokens": len(prompt)})

        return Plan(len(prompt), 0, execute)

    def _job(
        self,
        work: Work,
        params: SamplingParams,
        num_choices: int,
        num_prompt_tokens: int,
        tokenizer: Tokenizer,
    ) -> generation.Job:
        return generation.Job(
            request_id=work.request_id,
            created=int(time.time()),
            model=work.model,
            num_choices=num_choices,
            num_prompt_tokens=num_prompt_tokens,
            tokenizer=tokenizer,
            logprobs=params.logprobs,
            include_usage=bool(getattr(work.request, "include_usage", False)),
            report_usage=work.caller.report_usage,
        )

    def _plan(
        self,
        work: Work,
        job: generation.Job,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        param: str,
    ) -> Plan:
        async def execute(call: Call) -> Reply:
            return await self._execute(call, job, prompts, params, param)

        return Plan(job.num_prompt_tokens, params.max_tokens * job.num_choices, execute)

    async def _execute(
        self,
        call: Call,
        job: generation.Job,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        param: str,
    ) -> Reply:
        usage = call.usage

        def on_usage(num_completion_tokens: int) -> None:
            usage.served = True
            usage.num_completion_tokens = num_completion_tokens
            usage.num_cached_tokens = job.num_cached_tokens
            if call.span.recording:
                for name, value in job.speculation().items():
                    call.span.set(name, value)

        job.on_usage = on_usage
        try:
            outputs = self._submit(call, prompts, params, param)
            call.on_close(outputs.aclose)
            req = call.work.request
            answer = self.routes[call.work.endpoint.path].answer
            if answer is None:
                raise RuntimeError(f"{call.work.endpoint.path} has no answer from the generation engine")
            if call.work.stream:
                ready = await outputs.wait_ready(call.keep_alive_s)
                error = outputs.first_error()
                if error is not None:
                    raise error
                return Stream(answer.events(req, outputs, job), ready)
            choices = await generation.gather(outputs, job)
        except APIError as error:
            if error.kind is ErrorKind.OVERLOADED:
                error.refusal = None  # the engine counts its own deadline refusals
            raise
        usage.served = True
        usage.num_cached_tokens = job.num_cached_tokens
        return Body(answer.body(req, job, choices))

    def _submit(
        self, call: Call, prompts: Sequence[list[int]], params: SamplingParams, param: str
    ) -> generation.Outputs:
        engine, _ = self._running()
        work = call.work
        caller = work.caller
        streams: list[tuple[int, TimedStream]] = []
        try:
            # The adapter's current version, pinned for the whole request (a replace or an
            # unload from now on changes nothing it computes); its id and hash go in the span.
            lora = engine.resolve_lora(work.model) if work.model in self.lora_owners else None
            if lora is not None:
                call.span.set("batchgate.lora.id", lora.id)
                call.span.set("batchgate.lora.content_hash", lora.content_hash)
            for i, prompt in enumerate(prompts):
                request = GenerationRequest(
                    request_id=work.request_id if len(prompts) == 1 else f"{work.request_id}-{i}",
                    prompt_token_ids=prompt,
                    sampling=params,
                    priority=caller.priority,
                    queue_deadline_s=caller.queue_deadline_s,
                    fairness_key=caller.name,
                    cache_salt=caller.cache_salt if self.settings.prefix_caching == "tenant" else "",
                    lora=lora,
                )
                streams.append((i * params.n, TimedStream(engine.submit(request), self.metrics, call.span)))
        except EngineError as exc:
            # Submitted streams are closed with the call (below); the rest never opened.
            outputs = generation.Outputs(streams)
            call.on_close(outputs.aclose)
            raise from_engine_error(exc, param=param) from None
        return generation.Outputs(streams)

    def stats(self) -> dict[str, object]:
        engine, _ = self._running()
        return dataclasses.asdict(engine.stats())


def _prediction(
    tokenizer: Tokenizer, text: str, num_prompt_tokens: int, max_model_len: int
) -> tuple[int, ...]:
    """A Predicted Output's tokens; 400 if they could not fit the window after the prompt."""
    ids = tokenizer.encode_output(text)
    if num_prompt_tokens + len(ids) > max_model_len:
        raise invalid_request(
            f"'prediction' is {len(ids)} tokens; with the prompt's {num_prompt_tokens} that is more than "
            f"this model's context length ({max_model_len} tokens).",
            param="prediction",
        )
    return tuple(ids)


def _within_reservation(
    params: SamplingParams, caller: Caller, num_prompt_tokens: int, num_prompts: int = 1
) -> SamplingParams:
    """`params` with max_tokens cut to what a gateway in front reserved (pool mode): the
    completion tokens per choice it held, less, when it held a hard budget on a prompt estimate
    shorter than the exact prompt, the excess (times the completion tokens that pay for one
    prompt token, tenancy.billing.prompt_excess_weight) spread over the choices: the request then
    never costs more than its hold; one with no completion token left is refused
    (insufficient_quota)."""
    cap = caller.max_tokens_cap
    held = caller.prompt_tokens_held
    if held is not None and num_prompt_tokens > held:
        outputs = params.n * num_prompts
        excess = (num_prompt_tokens - held) * caller.prompt_excess_weight
        room = min(cap or params.max_tokens, params.max_tokens) * outputs - excess
        if room < outputs:
            raise APIError(
                ErrorKind.INSUFFICIENT_QUOTA,
                f"The prompt is {num_prompt_tokens} tokens, more than the {held} its budget hold "
                "allows for with room for the completion; shorten the prompt or lower max_tokens.",
                headers={"x-should-retry": "false"},
            )
        cap = room // outputs
    if cap is None or cap >= params.max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))


def freeze_startup_heap() -> None:
    """Take what start-up allocated (modules, tokenizer, model wrappers) out of the cyclic GC's
    full collections, as vLLM's server does: those then scan only what came since. A full
    collection over a big heap stops the event loop, and every stream with it."""
    gc.collect()
    gc.freeze()
