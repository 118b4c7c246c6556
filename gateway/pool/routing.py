"""Where a proxied request goes: the routing policy over the healthy replicas of its model.

Least outstanding work: the tokens a replica reports waiting and running plus the tokens this
gateway has in flight there (prompt estimate + max_tokens of each request it sent). With prefix
affinity (bounded-load rendezvous hashing): each request has a preferred order of replicas, from
a hash of its tenant and the start of its prompt (the first message, or the prompt's first 512
characters), and goes to the first in that order whose load is within `--route-affinity-tokens`
of the least loaded. So requests sharing a system prompt meet the KV blocks that replica's prefix
cache holds for it, while no replica takes more than that margin above the rest. With
`--long-prompt-upstream` replicas, prompts of more than `--long-prompt-threshold` tokens go to
those and the others to the `--upstream` ones (a long prefill on a replica serving chat turns
stalls their streams), each set taking the other's prompts when none of its own is healthy.
A request for a LoRA adapter (gateway/pool/adapters.py) goes to a replica that holds it or can load
it; among those within `--route-affinity-tokens` of the least loaded, to one that has it resident
in an engine slot, else one that holds it loaded, else one where it is loaded first.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from gateway.admission import Caller

# How much of a prompt's start the affinity key holds.
AFFINITY_PREFIX_CHARS = 512


class Candidate(Protocol):
    """What routing reads of a replica (gateway/pool/replicas.py's Upstream)."""

    url: str
    healthy: bool
    models: tuple[str, ...]
    long_prompts: bool

    @property
    def load(self) -> int: ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class AdapterRoute(Generic[C]):
    """Where a request for a LoRA adapter may go: `takes(replica)`, it holds the adapter or can
    load it; `warmth(replica)`, 2 resident in a slot, 1 loaded, 0 not held."""

    takes: Callable[[C], bool]
    warmth: Callable[[C], int]


def pick(
    replicas: Sequence[C],
    model: str,
    exclude: set[str],
    affinity: bytes = b"",
    slack_tokens: int = 0,
    num_prompt_tokens: int = 0,
    long_prompt_threshold: int = 0,
    adapter: AdapterRoute[C] | None = None,
) -> C | None:
    """The least-loaded candidate; with an `affinity` key, the candidate that key ranks first
    among those whose load is at most `slack_tokens` above the least. Candidates: the healthy
    replicas serving `model` (for an `adapter`: that take it), not in `exclude`, of the set for
    the prompt's length (replicas for long prompts when it has more than `long_prompt_threshold`
    tokens, else the others) when that set has any, else of either set; for an adapter, only
    the warmest of those within `slack_tokens` of the least loaded."""
    serves = adapter.takes if adapter is not None else (lambda u: model in u.models)
    candidates = [u for u in replicas if u.healthy and u.url not in exclude and serves(u)]
    if not candidates:
        return None
    if any(u.long_prompts for u in replicas):
        long = num_prompt_tokens > long_prompt_threshold
        candidates = [u for u in candidates if u.long_prompts == long] or candidates
    best = min(u.load for u in candidates)
    if adapter is not None:
        near = [u for u in candidates if u.load <= best + slack_tokens]
        warmest = max(adapter.warmth(u) for u in near)
        candidates = [u for u in near if adapter.warmth(u) == warmest]
        best = min(u.load for u in candidates)
    if affinity and slack_tokens > 0:
        near = [u for u in candidates if u.load <= best + slack_tokens]
        return max(near, key=lambda u: _rendezvous(affinity, u.url))
    return random.choice([u for u in candidates if u.load == best])


def _rendezvous(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest()


def affinity_key(caller: Caller, body: dict[str, Any]) -> bytes:
    """What requests that could share cached prompt blocks have in common: the tenant (the prefix
    cache's namespace) and the start of the prompt (or the request's `prompt_cache_key`)."""
    messages = body.get("messages")
    items = body.get("input")
    if isinstance(body.get("prompt_cache_key"), str):
        lead: Any = ["prompt_cache_key", body["prompt_cache_key"]]  # the client's own routing hint
    elif isinstance(messages, list) and messages:
        lead = messages[0]
    elif "input" in body and "model" in body and not isinstance(body.get("prompt"), str):
        # A Responses request: its instructions and first item (a continuation, expanded by the
        # gateway, starts with its conversation's first item, so it goes where that turn went).
        lead = [body.get("instructions"), items[0] if isinstance(items, list) and items else items]
    else:
        prompt: Any = body.get("prompt")
        # A batch of prompts (strings or token lists): its first; else the prompt (text or ids).
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        lead = prompt[0] if batch else prompt
    text = lead if isinstance(lead, str) else json.dumps(lead, sort_keys=True, default=str)
    return caller.cache_salt.encode() + b"\0" + text[:AFFINITY_PREFIX_CHARS].encode()
