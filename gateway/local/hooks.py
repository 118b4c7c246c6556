"""What each endpoint asks of the in-process generation engine: how it is planned (over the
backend's `LocalPlanner`) and how the engine's outputs become its reply. The endpoint table
(gateway/endpoints.py) fills in one `LocalRoute` per endpoint the engine serves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.backend import APIRequest, Plan, Work
from gateway.openai.bodies import Choice
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from gateway.openai.formats import ChatFormat
    from gateway.openai.generation import Job, Outputs
    from gateway.openai.tools import OutputPlan


# (prompt tokens, the model's window) -> the completion tokens a request runs with, or APIError:
# another protocol's rule where chat's (refuse what does not fit) is not its own.
Fit = Callable[[int, int], int]


class LocalPlanner(Protocol):
    """What an endpoint's local plan may call on the in-process generation backend."""

    @property
    def closed_arguments(self) -> bool: ...

    @property
    def chat_format(self) -> ChatFormat: ...

    async def plan_chat(
        self,
        work: Work,
        req: ChatCompletionRequest,
        *,
        param: str,
        output: OutputPlan | None = None,
        fit: Fit | None = None,
    ) -> Plan: ...

    async def plan_completion(self, work: Work, req: CompletionRequest) -> Plan: ...

    async def plan_count(self, req: ChatCompletionRequest) -> Plan: ...


@dataclass(frozen=True)
class Answer:
    """How the in-process engine's outputs become an endpoint's reply: SSE events, or one body."""

    events: Callable[[APIRequest, Outputs, Job], AsyncIterator[bytes]]
    body: Callable[[APIRequest, Job, list[Choice]], Mapping[str, object]]


@dataclass(frozen=True)
class LocalRoute:
    """One endpoint on the in-process engine: its plan, and its answer (None: it only counts)."""

    plan: Callable[[LocalPlanner, Work], Awaitable[Plan]]
    answer: Answer | None = None
