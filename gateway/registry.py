"""The model registry: each served model name -> the backend that serves it and its task.

One process can serve several models: a chat model in process (`--model`), more in process under
their own names and settings (the `models` file, gateway/settings.py), an embedding model, and
whatever the replicas behind `--upstream` report (each replica's /v1/models; a gateway can
front replica sets of different models). `/v1/models` lists them all. A name is looked up after
the caller is authenticated: an unknown one is a 404 `model_not_found`, or a 503 while a backend
that might serve it is loading or has no healthy replica. A tenant's LoRA adapter (a card with an
`owner`, gateway/loras.py) exists only for that tenant: listed to it alone, a 404 for anyone else.

A name no model is served under may be an alias (the models file's `[[aliases]]`: a name or a
pattern, such as Claude Code's `claude-*` ids): it resolves to the model the alias names, whose
name the request then carries (its response's `model`, the ledger, a replica's body).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admission import Caller
from gateway.backend import Backend, Endpoint, ModelCard, Task
from gateway.errors import APIError, ErrorKind, invalid_request, model_not_found
from gateway.loras import visible
from gateway.settings import ModelAlias


@dataclass(frozen=True)
class ServedModel:
    name: str
    backend: Backend
    task: Task | None  # None: a replica's model (the replica checks the task)


class ModelRegistry:
    """Backends in order of precedence: a name two of them serve goes to the first."""

    def __init__(self, backends: Sequence[Backend], aliases: Sequence[ModelAlias] = ()) -> None:
        self.backends = tuple(backends)
        self.aliases = tuple(aliases)

    def alias_of(self, model: str, caller: Caller | None = None) -> str | None:
        """The model an alias maps `model` to, when no model is served under that name."""
        if not self.aliases or self._lookup(model, caller) is not None:
            return None
        return next((a.model for a in self.aliases if a.matches(model)), None)

    def cards(self, caller: Caller | None = None) -> list[ModelCard]:
        """The models `caller` may use (None: the public ones)."""
        seen: dict[str, ModelCard] = {}
        for backend in self.backends:
            for card in backend.models():
                if visible(card.owner, caller):
                    seen.setdefault(card.id, card)
        return list(seen.values())

    def _lookup(self, model: str, caller: Caller | None) -> ServedModel | None:
        for backend in self.backends:
            for card in backend.models():
                if card.id == model and visible(card.owner, caller):
                    return ServedModel(card.id, backend, card.task)
        return None

    async def resolve(
        self, model: str, endpoint: Endpoint, caller: Caller | None = None, *, alias: bool = True
    ) -> ServedModel:
        """The model `endpoint` asks for; APIError 404 (unknown, or another tenant's adapter), 400
        (it does not do what the endpoint asks), or 503 (unknown while a backend loads or has no
        healthy replica). An alias resolves to its model, which must be served."""
        target = self.alias_of(model, caller) if alias else None
        if target is not None:
            try:
                return await self.resolve(target, endpoint, caller, alias=False)
            except APIError as exc:
                if exc.kind is ErrorKind.MODEL_NOT_FOUND:
                    exc.message = f"The model `{model}` is an alias of `{target}`, which is not served."
                raise
        served = self._lookup(model, caller)
        if served is None:
            for backend in self.backends:
                if await backend.find(model):  # replicas marked down are probed first
                    served = self._lookup(model, caller) or ServedModel(model, backend, None)
                    break
        if served is None:
            for backend in self.backends:
                not_ready = await backend.not_ready()
                if not_ready is not None:
                    raise not_ready.error()
            raise model_not_found(model, self._listing(endpoint.task, caller))
        if served.task is not None and served.task is not endpoint.task:
            raise invalid_request(
                _wrong_task(model, served.task, self._listing(endpoint.task, caller)), param="model"
            )
        return served

    def _listing(self, task: Task, caller: Caller | None) -> str:
        names = [c.id for c in self.cards(caller) if c.task in (task, None)]
        if not names:
            kind = "chat" if task is Task.GENERATE else "embedding"
            return f" This server serves no {kind} model."
        return " This server serves " + ", ".join(f"`{n}`" for n in names) + "."


def _wrong_task(model: str, task: Task, listing: str) -> str:
    if task is Task.EMBED:
        return f"`{model}` is an embedding model; send it to /v1/embeddings.{listing}"
    return f"`{model}` is a chat model; it does not make embeddings.{listing}"
