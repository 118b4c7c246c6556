"""What a server may call on an engine: the seam between the gateway and any engine behind it.

`AsyncEngine` (this process, engine/async_engine.py) implements it, and so does the gateway tests'
`FakeEngine`; a remote or adapter-aware engine would too. Importing this module loads no torch: the
gateway imports it in every mode, also when it serves no model itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.types import EngineHealth, EngineStats, GenerationRequest, GrammarSpec, RequestOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.grammar.interface import CompiledGrammar
    from engine.lora import LoraAdapter


@runtime_checkable
class EngineStream(Protocol):
    """The outputs of one submitted request, its choices interleaved; it ends once every choice
    has had its final output. Closing it before then aborts the request (its blocks are freed)."""

    @property
    def request_id(self) -> str: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """One model's engine, as the gateway uses it. Every method may be called from the event loop
    and returns at once: none waits for a step."""

    @property
    def model_name(self) -> str:
        """The name the engine serves its model under."""
        ...

    @property
    def model_type(self) -> str:
        """The served model's `model_type` (its config's, e.g. "qwen3", "gpt_oss"): which family's chat
        template conventions, tool-call and reasoning formats apply (engine/model_spec.py's
        MODEL_TYPES lists those served)."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output tokens) it accepts."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer: the gateway renders chat templates and counts tokens with it."""
        ...

    @property
    def ready(self) -> bool:
        """Whether it takes requests (its loop runs and it was not shut down)."""
        ...

    def submit(self, request: GenerationRequest) -> EngineStream:
        """Validate and queue `request`; raises an EngineError (too long, overloaded, not running)
        at once instead of streaming one."""
        ...

    def abort(self, request_id: str) -> None:
        """End the request at the next step; unknown ids are ignored."""
        ...

    def stats(self) -> EngineStats:
        """A snapshot of queues, rates and counters (routing, metrics, /v1/internal/stats)."""
        ...

    def health(self) -> EngineHealth:
        """Liveness: whether the loop runs and how long it has been stuck while work waits."""
        ...

    def grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """`spec` compiled off the event loop (cached); its failure is a GrammarError."""
        ...

    def loras(self) -> dict[str, LoraAdapter]:
        """The LoRA adapters loaded now, by name (each its current version)."""
        ...

    def lora_bytes(self) -> int:
        """Bytes of adapter weights held now (loaded versions and those still pinned by requests)."""
        ...

    def resolve_lora(self, name: str) -> LoraAdapter:
        """The current version of adapter `name`, for a request to pin (GenerationRequest.lora);
        LoraNotFoundError if it is not loaded."""
        ...

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Load or replace adapter `name` from a PEFT folder (blocking: reads the files; call it
        off the event loop); LoraError names what is wrong with it."""
        ...

    def unload_lora(self, name: str, wait: bool = True) -> Future[None]:
        """Take `name` from new requests; the future is done once its last user ended and its
        memory is released. `wait=False`: LoraInUseError (nothing changes) while it is in use."""
        ...

    def shutdown(self) -> None:
        """Stop the engine (blocking); pending requests end with an error."""
        ...
