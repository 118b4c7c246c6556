"""From engine outputs to the Responses API's `response` object and its typed event stream.

One response has one choice. Its text is read by the model family's parser (gateway/openai/
formats.py: its reasoning, its tool calls) into a `reasoning` item (one `reasoning_text` part:
Qwen3's <think>, gpt-oss's analysis channel), an assistant `message` item (one `output_text` part)
and `function_call` items, in the order the model wrote them. The stream is OpenAI's event
sequence, each event with its `sequence_number`:

    response.created, response.in_progress,
      per item: response.output_item.added,
        reasoning: response.content_part.added, response.reasoning_text.delta...,
                   response.reasoning_text.done, response.content_part.done
        message: response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
        function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
      response.output_item.done,
    response.completed | response.incomplete (max_output_tokens) | response.failed (an error)

Each event is sent as `event: <type>` + `data: <json>` (OpenAI's framing), then `data: [DONE]`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.types import TokenLogprob
from gateway.errors import APIError
from gateway.openai import bodies, generation
from gateway.openai.generation import Job, Outputs
from gateway.openai.parsers import DeltaParser, HarmonyParser
from gateway.openai.tools import ToolCallParser
from gateway.responses import custom_tools
from gateway.responses.chat_form import text_echo, tool_choice_echo, tools_echo
from gateway.responses.request import ResponsesRequest
from gateway.sse import DONE

TEXT_EVENTS = (
    b"response.output_text.delta",
    b"response.function_call_arguments.delta",
    b"response.reasoning_text.delta",
)
TERMINAL_EVENTS = (
    b"event: response.completed\n",
    b"event: response.incomplete\n",
    b"event: response.failed\n",
)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(num_input: int, num_output: int, num_cached: int) -> dict[str, Any]:
    """OpenAI's ResponseUsage; `cached_tokens`: input tokens whose K/V came from the prefix cache."""
    return {
        "input_tokens": num_input,
        "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input + num_output,
    }


def skeleton(req: ResponsesRequest, response_id: str, created: int, model: str) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed, as OpenAI does."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": bool(req.background),
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "conversation": {"id": req.conversation_id} if req.conversation_id else None,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.stores,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "presence_penalty": 0.0,  # not request fields here; Open Responses' object requires them
        "frequency_penalty": 0.0,
        "text": text_echo(req),
        "tool_choice": tool_choice_echo(req),
        "tools": tools_echo(req),
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": dict(req.metadata or {}),
    }


def _logprobs(job: Job, logprobs: Sequence[TokenLogprob], with_bytes: bool) -> list[dict[str, Any]]:
    out = []
    for lp in bodies.chat_logprobs(job.tokenizer, logprobs)["content"] or ():
        top = [
            {
                "token": t["token"],
                "logprob": t["logprob"],
                **({"bytes": t["bytes"] or []} if with_bytes else {}),
            }
            for t in lp["top_logprobs"]
        ]
        entry: dict[str, Any] = {"token": lp["token"], "logprob": lp["logprob"], "top_logprobs": top}
        if with_bytes:
            entry["bytes"] = lp["bytes"] or []
        out.append(entry)
    return out


def _message(
    text: str, status: str, logprobs: list[dict[str, Any]], phase: str | None = None
) -> dict[str, Any]:
    item = {
        "id": item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}],
    }
    if phase is not None:  # a model with channels (gpt-oss): commentary or final_answer
        item["phase"] = phase
    return item


def _phases(reader: custom_tools.CallSplitter | DeltaParser | None) -> list[str | None] | None:
    """The phases of the content deltas `reader` returned, in order (taken: the list empties as
    it is read), where its model has channels; else None."""
    inner = reader.inner if isinstance(reader, custom_tools.CallSplitter) else reader
    return inner.content_phases if isinstance(inner, HarmonyParser) else None


def _reasoning(text: str, status: str, item: str | None = None) -> dict[str, Any]:
    return {
        "id": item or item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _function_call(
    req: ResponsesRequest, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    item: dict[str, Any] = {
        "id": item_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }
    if name in req.namespaces:
        item["namespace"] = req.namespaces[name]
    return item


def finish(body: dict[str, Any], length: bool, num_output: int, job: Job) -> dict[str, Any]:
    """`body` as a finished response: completed, or incomplete when it ran into max_output_tokens."""
    body["status"] = "incomplete" if length else "completed"
    body["incomplete_details"] = {"reason": "max_output_tokens"} if length else None
    body["completed_at"] = None if length else bodies.now()
    body["usage"] = usage(job.num_prompt_tokens, num_output, job.num_cached_tokens)
    return body


def response_body(req: ResponsesRequest, job: Job, choice: bodies.Choice) -> dict[str, Any]:
    """The whole `response` object of a gathered choice."""
    body = skeleton(req, job.request_id, job.created, job.model)
    length = choice.final_reason == "length"
    status = "incomplete" if length else "completed"
    logprobs = _logprobs(job, choice.logprobs, with_bytes=True) if job.logprobs else []
    contents, reasoning, calls = _split(choice.text, job)
    if reasoning:
        body["output"].append(_reasoning(reasoning, status))
    if not calls and not any(text.strip() for _, text in contents):
        contents = [(contents[0][0] if contents else None, "".join(text for _, text in contents))]
    for phase, text in contents:  # one message per phase (gpt-oss's commentary, then its answer)
        if text.strip() or not calls:
            body["output"].append(_message(text, status, logprobs, phase))
            logprobs = []
    for call in calls:
        if call["type"] == "function_call":
            item = _function_call(req, call["call_id"], call["name"], call["arguments"], status)
        else:
            item = _custom_call(call["call_id"], call["name"], call["input"])
        body["output"].append(item)
    return finish(body, length, choice.num_output_tokens, job)


def _reader(job: Job) -> custom_tools.CallSplitter | DeltaParser | None:
    """How one choice's text is read: its tool calls (custom ones too) and reasoning; None: as text."""
    if job.parse_tool_calls:
        return custom_tools.CallSplitter(job.parser() if job.parser is not None else ToolCallParser())
    return job.parser() if job.parser is not None else None


def _split(text: str, job: Job) -> tuple[list[tuple[str | None, str]], str, list[dict[str, Any]]]:
    """A whole output -> its text by phase, its reasoning and its calls (function and custom, in
    order), by the stream's own parser, so a streamed response assembles to exactly the
    non-streamed one."""
    reader = _reader(job)
    if reader is None:
        return [(None, text)], "", []
    phases = _phases(reader)
    content: list[tuple[str | None, str]] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    functions: dict[int, dict[str, Any]] = {}
    for event in reader.feed(text, final=True):
        if isinstance(event, custom_tools.CustomStart):
            call = {"type": "custom_tool_call", "call_id": event.call_id, "name": event.name}
            calls.append({**call, "input": ""})
        elif isinstance(event, custom_tools.CustomInput):
            calls[-1]["input"] += event.text
        elif isinstance(event, custom_tools.CustomEnd):
            continue
        elif "content" in event:
            phase = phases.pop(0) if phases else None
            if content and content[-1][0] == phase:
                content[-1] = (phase, content[-1][1] + (event["content"] or ""))
            else:
                content.append((phase, event["content"] or ""))
        elif "reasoning_content" in event:
            reasoning.append(event["reasoning_content"])
        else:
            for part in event["tool_calls"]:
                if "id" in part:
                    call = {"type": "function_call", "call_id": part["id"], "name": part["function"]["name"]}
                    functions[part["index"]] = {**call, "arguments": ""}
                    calls.append(functions[part["index"]])
                functions[part["index"]]["arguments"] += part.get("function", {}).get("arguments", "")
    return content or [(None, "")], "".join(reasoning), calls


def _custom_call(call_id: str, name: str, text: str) -> dict[str, Any]:
    return {"id": item_id("ctc"), "type": "custom_tool_call", "call_id": call_id, "name": name, "input": text}


def failed(body: dict[str, Any], error: APIError) -> dict[str, Any]:
    detail = error.body()["error"]
    body["status"] = "failed"
    body["error"] = {"code": detail["code"] or "server_error", "message": detail["message"]}
    return body


@dataclass
class _Writer:
    """The stream's state: its sequence numbers and the item being written."""

    req: ResponsesRequest
    job: Job
    body: dict[str, Any]
    seq: int = 0
    open_item: dict[str, Any] | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    args: list[str] = field(default_factory=list)

    def emit(self, kind: str, **fields: Any) -> bytes:
        payload = _event(kind, self.seq, **fields)
        self.seq += 1
        return encode(payload)

    def snapshot(self) -> dict[str, Any]:
        copy: dict[str, Any] = json.loads(json.dumps(self.body))
        return copy

    @property
    def index(self) -> int:
        return len(self.body["output"])

    def _content_item(
        self, item_type: str, new_item: Callable[[], dict[str, Any]], part: dict[str, Any]
    ) -> tuple[dict[str, Any], list[bytes]]:
        """The open item if it is of `item_type`; else a new one, opened with its one content part
        (`part`), and the frames that say so."""
        item = self.open_item
        if item is not None and item["type"] == item_type:
            return item, []
        item = {**new_item(), "content": []}
        frames = self._open(item)
        where = {"item_id": item["id"], "output_index": self.index, "content_index": 0}
        frames.append(self.emit("response.content_part.added", **where, part=part))
        return item, frames

    def text_delta(self, text: str, logprobs: list[dict[str, Any]], phase: str | None = None) -> list[bytes]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        frames: list[bytes] = []
        if (
            self.open_item is not None
            and self.open_item["type"] == "message"
            and self.open_item.get("phase") != phase
        ):
            frames += self.close_item("completed")  # a new phase is a new message
        item, opened = self._content_item("message", lambda: _message("", "in_progress", [], phase), part)
        frames += opened
        self.text.append(text)
        self.logprobs += logprobs
        frames.append(
            self.emit(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self.index,
                content_index=0,
                delta=text,
                logprobs=[{k: v for k, v in lp.items() if k != "bytes"} for lp in logprobs],
            )
        )
        return frames

    def reasoning_delta(self, text: str) -> list[bytes]:
        part = {"type": "reasoning_text", "text": ""}
        item, frames = self._content_item("reasoning", lambda: _reasoning("", "in_progress"), part)
        self.text.append(text)
        where = {"item_id": item["id"], "output_index": self.index, "content_index": 0}
        frames.append(self.emit("response.reasoning_text.delta", **where, delta=text))
        return frames

    def call_start(self, call_id: str, name: str) -> list[bytes]:
        return self._start_call(_function_call(self.req, call_id, name, "", "in_progress"))

    def custom_start(self, call_id: str, name: str) -> list[bytes]:
        return self._start_call(_custom_call(call_id, name, ""))

    def call_delta(self, fragment: str) -> list[bytes]:
        return self._call_delta("response.function_call_arguments.delta", fragment)

    def custom_delta(self, fragment: str) -> list[bytes]:
        return self._call_delta("response.custom_tool_call_input.delta", fragment)

    def _start_call(self, item: dict[str, Any]) -> list[bytes]:
        """Open the tool call `item`, its input empty so far (after the open item closed with its own)."""
        frames = self._open(item)
        self.args = []
        return frames

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        """Close the open item (completed) and open `item`."""
        frames = self.close_item("completed")
        self.open_item = item
        frames.append(self.emit("response.output_item.added", output_index=self.index, item=self.open_item))
        return frames

    def _call_delta(self, event: str, fragment: str) -> list[bytes]:
        """The open tool call's next input `fragment`, as `event`."""
        if self.open_item is None or not fragment:
            return []
        self.args.append(fragment)
        return [self.emit(event, item_id=self.open_item["id"], output_index=self.index, delta=fragment)]

    def close_item(self, status: str) -> list[bytes]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        index, frames = self.index, []
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            text = "".join(self.text)
            done = {**_message(text, status, self.logprobs, item.get("phase")), "id": item["id"]}
            logprobs = [{k: v for k, v in lp.items() if k != "bytes"} for lp in self.logprobs]
            frames.append(self.emit("response.output_text.done", **where, text=text, logprobs=logprobs))
            frames.append(self.emit("response.content_part.done", **where, part=done["content"][0]))
            self.text, self.logprobs = [], []
        elif item["type"] == "reasoning":
            text = "".join(self.text)
            done = _reasoning(text, status, item["id"])
            frames.append(self.emit("response.reasoning_text.done", **where, text=text))
            frames.append(self.emit("response.content_part.done", **where, part=done["content"][0]))
            self.text = []
        elif item["type"] == "custom_tool_call":
            done = {**item, "input": "".join(self.args)}
            frames.append(
                self.emit(
                    "response.custom_tool_call_input.done",
                    item_id=item["id"],
                    output_index=index,
                    input=done["input"],
                )
            )
        else:
            arguments = "".join(self.args)
            done = {**item, "arguments": arguments, "status": status}
            frames.append(
                self.emit(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=arguments,
                )
            )
        self.body["output"].append(done)
        frames.append(self.emit("response.output_item.done", output_index=index, item=done))
        return frames


async def response_events(req: ResponsesRequest, outputs: Outputs, job: Job) -> AsyncIterator[bytes]:
    """The typed event stream of one response (see the module docstring), then `[DONE]`."""
    writer = _Writer(req, job, skeleton(req, job.request_id, job.created, job.model))
    yield writer.emit("response.created", response=writer.snapshot())
    yield writer.emit("response.in_progress", response=writer.snapshot())
    parser = _reader(job)
    phases = _phases(parser)
    num_output, length = 0, False
    try:
        async for index, out in outputs:
            error = generation.item_error((index, out))
            if error is not None:
                raise error
            num_output = max(num_output, out.num_output_tokens)
            job.observe(out)
            job.on_usage(num_output)
            logprobs = _logprobs(job, out.logprobs, with_bytes=True) if job.logprobs else []
            if parser is None:
                deltas: list[Any] = [{"content": out.new_text}] if out.new_text else []
            else:
                deltas = list(parser.feed(out.new_text, final=out.finished))
            for delta in deltas:
                if isinstance(delta, custom_tools.CustomStart):
                    for frame in writer.custom_start(delta.call_id, delta.name):
                        yield frame
                    continue
                if isinstance(delta, custom_tools.CustomInput):
                    for frame in writer.custom_delta(delta.text):
                        yield frame
                    continue
                if isinstance(delta, custom_tools.CustomEnd):
                    for frame in writer.close_item("completed"):
                        yield frame
                    continue
                if "content" in delta:
                    phase = phases.pop(0) if phases else None
                    for frame in writer.text_delta(delta["content"] or "", logprobs, phase):
                        yield frame
                    logprobs = []
                    continue
                if "reasoning_content" in delta:
                    for frame in writer.reasoning_delta(delta["reasoning_content"]):
                        yield frame
                    continue
                for part in delta["tool_calls"]:
                    if "id" in part:
                        for frame in writer.call_start(part["id"], part["function"]["name"]):
                            yield frame
                    for frame in writer.call_delta(part.get("function", {}).get("arguments", "")):
                        yield frame
            if out.finished:
                length = bodies.finish_reason_of(out) == "length"
        status = "incomplete" if length else "completed"
        if not any(item["type"] != "reasoning" for item in writer.body["output"]) and (
            writer.open_item is None or writer.open_item["type"] == "reasoning"
        ):
            for frame in writer.text_delta("", []):  # an empty answer is still one message
                yield frame
        for frame in writer.close_item(status):
            yield frame
        final = finish(writer.body, length, num_output, job)
        yield writer.emit(f"response.{final['status']}", response=final)
    except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel as events
        error = generation.error_of(exc)
        for frame in writer.close_item("incomplete"):
            yield frame
        body = failed(writer.body, error)
        body["usage"] = usage(job.num_prompt_tokens, num_output, job.num_cached_tokens)
        yield writer.emit("response.failed", response=body)
    yield DONE


def _event(kind: str, seq: int, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "sequence_number": seq, **fields}


def encode(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def _item_events(item: dict[str, Any], index: int, seq: int) -> list[dict[str, Any]]:
    """One stored output item as the stream wrote it: added, its content in one delta, done."""
    at = {"item_id": item.get("id"), "output_index": index}
    kind = item.get("type")
    if kind == "message":
        parts = item.get("content") or []
        added = {**item, "status": "in_progress", "content": []}
        events = [_event("response.output_item.added", seq, output_index=index, item=added)]
        for c, part in enumerate(parts):
            text = part.get("text", "")
            logprobs = [{k: v for k, v in lp.items() if k != "bytes"} for lp in part.get("logprobs") or []]
            empty = {**part, "text": "", "logprobs": []} if part.get("type") == "output_text" else part
            events.append(_event("response.content_part.added", 0, **at, content_index=c, part=empty))
            if part.get("type") == "output_text":
                delta = {"delta": text, "logprobs": logprobs}
                events.append(_event("response.output_text.delta", 0, **at, content_index=c, **delta))
                done = {"text": text, "logprobs": logprobs}
                events.append(_event("response.output_text.done", 0, **at, content_index=c, **done))
            events.append(_event("response.content_part.done", 0, **at, content_index=c, part=part))
    elif kind == "reasoning":
        parts = item.get("content") or []
        added = {**item, "status": "in_progress", "content": []}
        events = [_event("response.output_item.added", seq, output_index=index, item=added)]
        for c, part in enumerate(parts):
            text = part.get("text", "")
            empty = {**part, "text": ""}
            events.append(_event("response.content_part.added", 0, **at, content_index=c, part=empty))
            events.append(_event("response.reasoning_text.delta", 0, **at, content_index=c, delta=text))
            events.append(_event("response.reasoning_text.done", 0, **at, content_index=c, text=text))
            events.append(_event("response.content_part.done", 0, **at, content_index=c, part=part))
    elif kind in ("function_call", "custom_tool_call"):
        field_name, prefix = (
            ("arguments", "response.function_call_arguments")
            if kind == "function_call"
            else ("input", "response.custom_tool_call_input")
        )
        added = {**item, field_name: ""}
        if kind == "function_call":
            added["status"] = "in_progress"
        value = item.get(field_name, "")
        done = {"name": item.get("name"), "arguments": value} if kind == "function_call" else {"input": value}
        events = [
            _event("response.output_item.added", seq, output_index=index, item=added),
            _event(f"{prefix}.delta", 0, **at, delta=value),
            _event(f"{prefix}.done", 0, **at, **done),
        ]
    else:
        events = [_event("response.output_item.added", seq, output_index=index, item=item)]
    events.append(_event("response.output_item.done", 0, output_index=index, item=item))
    for n, event in enumerate(events):
        event["sequence_number"] = seq + n
    return events


def stored_events(response: dict[str, Any], final: bool) -> list[dict[str, Any]]:
    """The event stream of a stored background `response`, derived from it alone, so every replay
    numbers the same events the same: `response.created` (queued) and `response.in_progress`; once
    `final`, each output item as a stream writes it (its text or arguments in one delta) and the
    terminal event (`response.failed` for a cancelled one too: OpenAI has no cancelled event)."""
    opening = {**response, "output": [], "usage": None, "completed_at": None}
    opening.update(error=None, incomplete_details=None)
    events = [
        _event("response.created", 0, response={**opening, "status": "queued"}),
        _event("response.in_progress", 1, response={**opening, "status": "in_progress"}),
    ]
    if not final:
        return events
    for index, item in enumerate(response.get("output") or []):
        events += _item_events(item, index, len(events))
    status = response.get("status")
    terminal = status if status in ("completed", "incomplete") else "failed"
    events.append(_event(f"response.{terminal}", len(events), response=response))
    return events
