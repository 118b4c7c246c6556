"""From engine outputs to OpenAI responses: merging choices, gathering, and the SSE event streams.

One API request may be several engine requests (a completions call with a list of prompts); each
engine request yields outputs for its choices. `Outputs` merges them into one iterator of
`(choice_index, RequestOutput)` in arrival order, and owns the engine streams: `aclose()` aborts
whatever has not finished, which frees its KV blocks.

          engine stream 0 (choices 0..n-1) --pump--\\
          engine stream 1 (choices n..2n-1) --pump--> deque --> gather() / chat_events() / ...
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

import anyio

from engine.types import EngineError, FinishReason, RequestOutput
from gateway.errors import APIError, ErrorKind, from_engine_error, sse_error_event
from gateway.openai import bodies, parsers, schemas
from gateway.openai.parsers import DeltaParser
from gateway.openai.tokenizer import Tokenizer
from gateway.sse import DONE, encode_event

if TYPE_CHECKING:
    from engine.client import EngineStream

logger = logging.getLogger(__name__)

Item = tuple[int, RequestOutput]

_Reason = TypeVar("_Reason", bound=schemas.ChatFinishReason | None)


class Outputs:
    """The merged outputs of one API request's engine streams (see module docstring).

    Contract: iterate with `async for`; `wait_ready(timeout)` waits for the first item without
    consuming it; `aclose()` must be called on every path (it is idempotent and shielded).
    A stream that raises instead of reporting an error output surfaces here as that exception.
    """

    def __init__(self, streams: Sequence[tuple[int, EngineStream]]) -> None:
        self._streams = [s for _, s in streams]
        self._items: deque[Item | BaseException] = deque()
        self._changed = asyncio.Event()
        self._num_running = len(streams)
        self._closed = False
        self._tasks = [asyncio.ensure_future(self._pump(offset, s)) for offset, s in streams]

    async def _pump(self, offset: int, stream: EngineStream) -> None:
        try:
            async for out in stream:
                self._items.append((offset + out.index, out))
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which maps it
            self._items.append(exc)
        finally:
            self._num_running -= 1
            self._changed.set()

    async def _wait(self) -> None:
        while not self._items and self._num_running:
            self._changed.clear()
            await self._changed.wait()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Whether an item (or the end) is available within `timeout_s`; consumes nothing."""
        with anyio.move_on_after(timeout_s):
            await self._wait()
        return bool(self._items) or not self._num_running

    def first_error(self) -> APIError | None:
        """The error the next item carries, if it carries one (used before any byte was sent)."""
        if not self._items:
            return None
        return item_error(self._items[0])

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self) -> Item:
        await self._wait()
        if not self._items:
            raise StopAsyncIteration
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for stream in self._streams:
                try:
                    await stream.aclose()
                except Exception:  # noqa: BLE001 - closing must reach every stream
                    logger.exception("closing an engine stream failed")


def item_error(item: Item | BaseException) -> APIError | None:
    if isinstance(item, BaseException):
        return error_of(item)
    _, out = item
    if out.finish_reason is FinishReason.ERROR:
        return (
            error_of(out.error)
            if out.error is not None
            else APIError(ErrorKind.GENERATION_FAILED, "The generation failed.")
        )
    if out.finish_reason is FinishReason.ABORT:
        return APIError(ErrorKind.UNAVAILABLE, "The request was aborted by the server.", retry_after_s=1.0)
    return None


def error_of(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    logger.error("engine stream raised %r", exc, exc_info=exc)
    return APIError(ErrorKind.INTERNAL, "The server had an error while processing your request.")


@dataclass
class Job:
    """What the response builders need to know about one API request."""

    request_id: str
    created: int
    model: str
    num_choices: int
    num_prompt_tokens: int  # over all prompts
    tokenizer: Tokenizer
    logprobs: bool
    include_usage: bool = False
    # A gateway in front asked for a final usage chunk (to settle exact tokens) that its client
    # did not: that chunk alone, with the other chunks as the client asked (no `usage: null`).
    report_usage: bool = False
    echo_prefixes: list[str] = field(default_factory=list)  # per choice; completions with echo
    on_usage: Callable[[int], None] = lambda num_completion_tokens: None
    # Prompt tokens found in the prefix cache, per engine request (its choices share the prompt).
    cached_by_request: dict[str, int] = field(default_factory=dict)
    parse_tool_calls: bool = False  # chat with tools: calls become `tool_calls` (gateway/openai/tools.py)
    # How each choice's text is read: its calls and reasoning in the model family's format
    # (gateway/openai/formats.py); None: as text.
    parser: Callable[[], DeltaParser] | None = None
    # A chat request's Predicted Output: its length in tokens, and how many the output took.
    num_prediction_tokens: int | None = None
    num_accepted_prediction_tokens: int = 0
    # Speculative decoding, per choice: (draft tokens verified, accepted).
    drafts: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def observe(self, out: RequestOutput) -> None:
        seen = self.cached_by_request.get(out.request_id, 0)
        self.cached_by_request[out.request_id] = max(seen, out.num_cached_tokens)
        accepted = max(self.num_accepted_prediction_tokens, out.num_accepted_prediction_tokens)
        self.num_accepted_prediction_tokens = accepted
        if out.num_draft_tokens:
            self.drafts[(out.request_id, out.index)] = (out.num_draft_tokens, out.num_accepted_draft_tokens)

    def speculation(self) -> dict[str, int]:
        """The span's attributes of speculative decoding (none where no draft was verified)."""
        attributes: dict[str, int] = {}
        if self.drafts:
            attributes["batchgate.speculative.draft_tokens"] = sum(d for d, _ in self.drafts.values())
            attributes["batchgate.speculative.accepted_tokens"] = sum(a for _, a in self.drafts.values())
        usage = self.prediction_usage
        if usage is not None:
            attributes["batchgate.prediction.accepted_tokens"] = usage[0]
            attributes["batchgate.prediction.rejected_tokens"] = usage[1]
        return attributes

    @property
    def prediction_usage(self) -> tuple[int, int] | None:
        """(accepted, rejected) prediction tokens, as OpenAI's usage reports them; None: no prediction."""
        if self.num_prediction_tokens is None:
            return None
        accepted = min(self.num_accepted_prediction_tokens, self.num_prediction_tokens)
        return accepted, self.num_prediction_tokens - accepted

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_by_request.values())


async def gather(outputs: Outputs, job: Job) -> list[bodies.Choice]:
    """Run every choice to its end; APIError if any choice failed."""
    choices = [
        bodies.Choice(index=i, prefix=job.echo_prefixes[i] if job.echo_prefixes else "")
        for i in range(job.num_choices)
    ]
    async for index, out in outputs:
        error = item_error((index, out))
        if error is not None:
            raise error
        choices[index].add(out)
        job.observe(out)
        job.on_usage(sum(c.num_output_tokens for c in choices))
    return choices


def chat_body(job: Job, choices: Sequence[bodies.Choice]) -> schemas.ChatCompletion:
    """The `chat.completion` object for gathered choices."""
    body = bodies.chat_completion(
        request_id=job.request_id,
        created=job.created,
        model=job.model,
        choices=choices,
        num_prompt_tokens=job.num_prompt_tokens,
        tokenizer=job.tokenizer,
        with_logprobs=job.logprobs,
        num_cached_tokens=job.num_cached_tokens,
        prediction=job.prediction_usage,
    )
    if job.parser is not None:
        for choice in body["choices"]:
            message = parsers.read_whole(job.parser(), choice["message"]["content"] or "")
            choice["message"]["content"] = message.content
            if message.reasoning is not None:
                choice["message"]["reasoning_content"] = message.reasoning
            if message.calls:
                choice["message"]["tool_calls"] = message.calls
                choice["finish_reason"] = _with_calls(choice["finish_reason"], len(message.calls))
    return body


def _with_calls(finish_reason: _Reason, num_calls: int) -> _Reason | Literal["tool_calls"]:
    """A choice that stopped after calling tools finished with "tool_calls", as OpenAI's do."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def completion_body(job: Job, choices: Sequence[bodies.Choice]) -> schemas.Completion:
    """The `text_completion` object for gathered choices."""
    return bodies.text_completion(
        request_id=job.request_id,
        created=job.created,
        model=job.model,
        choices=[
            bodies.completion_choice(
                c.index,
                c.text,
                finish_reason=c.finish_reason,
                logprobs=bodies.completion_logprobs(job.tokenizer, c.logprobs, len(c.prefix))
                if job.logprobs
                else None,
            )
            for c in choices
        ],
        include_usage=True,
        usage_=bodies.usage(
            job.num_prompt_tokens, sum(c.num_output_tokens for c in choices), job.num_cached_tokens
        ),
    )


def _chunk_encoder(job: Job, build: Callable[..., Mapping[str, object]]) -> Callable[..., bytes]:
    """An SSE encoder of one stream's chunks; `build` is the chunk's shape (chat or completion).
    A chunk carries `usage` when the client asked for it (null but on the last), and the last
    one does when a gateway in front asked for it (`Job.report_usage`)."""

    def chunk(choices: Sequence[Mapping[str, object]], usage: schemas.Usage | None = None) -> bytes:
        return encode_event(
            build(
                request_id=job.request_id,
                created=job.created,
                model=job.model,
                choices=list(choices),
                include_usage=job.include_usage or usage is not None,
                usage_=usage,
            )
        )

    return chunk


def chat_events(outputs: Outputs, job: Job) -> AsyncIterator[bytes]:
    """`chat.completion.chunk` events: per choice a role delta, content deltas, a finish chunk;
    then the usage chunk (include_usage) and `[DONE]`. An error becomes an error event."""
    started = [False] * job.num_choices
    readers = [job.parser() for _ in range(job.num_choices)] if job.parser is not None else None

    def chunks(index: int, out: RequestOutput) -> Iterator[Sequence[schemas.ChatCompletionChunkChoice]]:
        if not started[index]:
            started[index] = True
            yield [bodies.chat_delta(index, {"role": "assistant", "content": "", "refusal": None})]
        logprobs = bodies.chat_logprobs(job.tokenizer, out.logprobs) if job.logprobs else None
        deltas: list[schemas.ChatCompletionDelta]
        if readers is None:
            deltas = [{"content": out.new_text}] if out.new_text else []
        else:  # text, reasoning and tool-call deltas, as OpenAI (and vLLM) stream them
            deltas = readers[index].feed(out.new_text, final=out.finished)
        if not deltas and job.logprobs and out.logprobs:
            deltas = [{"content": ""}]
        for k, delta in enumerate(deltas):
            yield [bodies.chat_delta(index, delta, logprobs=logprobs if k == 0 else None)]
        if out.finished:
            reason: schemas.ChatFinishReason | None = bodies.finish_reason_of(out)
            if readers is not None:
                reason = _with_calls(reason, readers[index].num_calls)
            yield [bodies.chat_delta(index, {}, finish_reason=reason)]

    return _events(outputs, job, bodies.chat_chunk, chunks)


def completion_events(outputs: Outputs, job: Job) -> AsyncIterator[bytes]:
    """`text_completion` chunks (one choice each), the usage chunk (include_usage), `[DONE]`."""
    echoed = [not job.echo_prefixes] * job.num_choices
    text_offsets = [len(p) for p in job.echo_prefixes] if job.echo_prefixes else [0] * job.num_choices

    def chunks(index: int, out: RequestOutput) -> Iterator[Sequence[schemas.CompletionChoice]]:
        text = out.new_text
        if not echoed[index]:
            echoed[index] = True
            text = job.echo_prefixes[index] + text
        logprobs = None
        if job.logprobs:
            logprobs = bodies.completion_logprobs(job.tokenizer, out.logprobs, text_offsets[index])
        text_offsets[index] += len(out.new_text)
        if text or out.finished or logprobs:
            finish_reason = bodies.finish_reason_of(out)
            yield [bodies.completion_choice(index, text, finish_reason=finish_reason, logprobs=logprobs)]

    return _events(outputs, job, bodies.text_completion, chunks)


async def _events(
    outputs: Outputs,
    job: Job,
    build: Callable[..., Mapping[str, object]],
    chunks: Callable[[int, RequestOutput], Iterable[Sequence[Mapping[str, object]]]],
) -> AsyncIterator[bytes]:
    """One stream's SSE events: per output, a chunk `build` makes of each choice list `chunks`
    gives; then the usage chunk (include_usage, or a gateway in front asked) and `[DONE]`. An error
    output or exception ends it with an error event."""
    num_output_tokens = [0] * job.num_choices
    chunk = _chunk_encoder(job, build)
    try:
        async for index, out in outputs:
            error = item_error((index, out))
            if error is not None:
                yield sse_error_event(error)
                break
            num_output_tokens[index] = max(num_output_tokens[index], out.num_output_tokens)
            job.observe(out)
            job.on_usage(sum(num_output_tokens))
            for choices in chunks(index, out):
                yield chunk(choices)
        else:
            if job.include_usage or job.report_usage:
                yield chunk(
                    [],
                    bodies.usage(
                        job.num_prompt_tokens,
                        sum(num_output_tokens),
                        job.num_cached_tokens,
                        job.prediction_usage,
                    ),
                )
    except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel as events
        yield sse_error_event(error_of(exc))
    yield DONE
