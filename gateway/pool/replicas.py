"""The replica registry: the remote engine replicas a gateway fronts, their health and load.

Each replica is polled (GET /ready, /v1/models and /v1/internal/stats, every `--health-interval`
seconds) for whether it takes requests, which models it serves, the tokens it reports waiting
and running, and the LoRA adapters it holds (gateway/pool/adapters.py). A replica failing its
poll, or a call, or answering that it drains (/ready 503, or a 503 marked
`x-batchgate-draining`), gets no new requests until a poll finds it ready again; a
replica marked down is polled again after 0.1 s, then at a doubling interval up to
`--health-interval`, and when a request finds no healthy replica left, the marked-down ones are
probed at once (concurrently, 0.5 s each) before it is answered 503: a replica back from a short
freeze is not left idle until its next poll. Where a request goes among the healthy ones is
gateway/pool/routing.py; how it is relayed, gateway/pool/relay.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import anyio
import httpx

from gateway import admission, telemetry
from gateway.pool import routing

logger = logging.getLogger("batchgate.pool")

# A replica marked down is polled again after this, then at a doubling interval up to the
# health interval: one back from a short freeze or a restart gets requests again within ~that.
DOWN_POLL_FIRST_S = 0.1
# When no healthy replica is left for a request, the marked-down ones are probed at once, each
# within this, before the request is answered 503.
REPROBE_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class HeldAdapter:
    """A LoRA adapter as a replica reports it: its owner (None: public), the chat model it is
    attached to, whether it is resident in an engine slot now, and its current version."""

    owner: str | None
    model: str | None
    resident: bool = False
    version: int = 0
    content_hash: str = ""


@dataclass
class Upstream:
    url: str
    healthy: bool = False
    models: tuple[str, ...] = ()
    reported_tokens: int = 0  # waiting + running tokens, as the replica last reported them
    inflight: int = 0  # requests this gateway has open there
    inflight_tokens: int = 0  # their prompt estimates + max_tokens
    num_sent: int = 0
    last_error: str | None = None
    created: dict[str, int] = field(default_factory=dict)
    tasks: dict[str, str] = field(default_factory=dict)  # model -> "generate" | "embed", as reported
    long_prompts: bool = False  # one of the replicas reserved for prompts over the threshold
    loras: dict[str, HeldAdapter] = field(default_factory=dict)  # the adapters it holds, by name
    chat_model: str | None = None  # its main chat model (what an adapter without a model attaches to)
    marked_down: asyncio.Event = field(default_factory=asyncio.Event)  # wakes its poller

    @property
    def load(self) -> int:
        return self.reported_tokens + self.inflight_tokens


class ReplicaSet:
    """The replicas, their health and load, and the HTTP client that reaches them."""

    def __init__(
        self,
        urls: tuple[str, ...],
        internal_token: str | None,
        interval_s: float,
        long_prompt_urls: tuple[str, ...] = (),
        long_prompt_threshold: int = 0,
    ) -> None:
        self.upstreams = [Upstream(u) for u in urls] + [
            Upstream(u, long_prompts=True) for u in long_prompt_urls
        ]
        self.long_prompt_threshold = long_prompt_threshold
        self.internal_token = internal_token
        self.interval_s = interval_s
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=2.0, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        telemetry.instrument_client(self.client)  # client spans + traceparent, when tracing is on
        self._poll_client = httpx.AsyncClient(timeout=httpx.Timeout(max(interval_s, 1.0)))
        self._task: asyncio.Task[None] | None = None
        self._reprobing: asyncio.Future[None] | None = None
        self.polled = asyncio.Event()  # set after the first round of polls

    def internal_headers(self) -> dict[str, str]:
        return {admission.INTERNAL_HEADER: self.internal_token} if self.internal_token else {}

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def aclose(self) -> None:
        for task in (self._task, self._reprobing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.client.aclose()
        await self._poll_client.aclose()

    async def _loop(self) -> None:
        await self.refresh()
        self.polled.set()
        await asyncio.gather(*(self._watch(u) for u in self.upstreams))

    async def _watch(self, up: Upstream) -> None:
        """Poll one replica: every interval while healthy; soon after it is marked down, then
        backing off (see DOWN_POLL_FIRST_S)."""
        delay = DOWN_POLL_FIRST_S
        while True:
            if up.healthy:
                delay = DOWN_POLL_FIRST_S
                up.marked_down.clear()
                with anyio.move_on_after(self.interval_s):
                    await up.marked_down.wait()
                if not up.healthy:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.interval_s)
            await self._poll(up)

    async def refresh(self) -> None:
        await asyncio.gather(*(self._poll(u) for u in self.upstreams))

    async def reprobe(self) -> None:
        """Poll every marked-down replica now, concurrently, each within REPROBE_TIMEOUT_S; callers
        arriving while a round runs share it."""
        if self._reprobing is None or self._reprobing.done():
            down = [u for u in self.upstreams if not u.healthy]
            self._reprobing = asyncio.ensure_future(self._probe_all(down))
        await asyncio.shield(self._reprobing)

    async def _probe_all(self, upstreams: list[Upstream]) -> None:
        await asyncio.gather(*(self._poll(u, REPROBE_TIMEOUT_S) for u in upstreams))

    async def _poll(self, up: Upstream, timeout_s: float | None = None) -> None:
        try:
            with anyio.fail_after(timeout_s):
                await self._check(up)
        except Exception as exc:  # noqa: BLE001 - any failure marks the replica down
            self.mark_down(up, f"{type(exc).__name__}: {exc}")

    async def _check(self, up: Upstream) -> None:
        ready = await self._poll_client.get(up.url + "/ready")
        if ready.status_code != 200:
            raise RuntimeError(f"/ready answered {ready.status_code} {ready.text[:200]}")
        headers = self.internal_headers()
        models = await self._poll_client.get(up.url + "/v1/models", headers=headers)
        models.raise_for_status()
        stats = await self._poll_client.get(up.url + "/v1/internal/stats", headers=headers)
        stats.raise_for_status()
        s = stats.json()
        cards = models.json()["data"]
        up.models = tuple(str(m["id"]) for m in cards)
        up.created = {str(m["id"]): int(m.get("created", 0)) for m in cards}
        up.tasks = {str(k): str(v) for k, v in (s.get("tasks") or {}).items()}
        up.reported_tokens = int(s.get("num_waiting_tokens", 0)) + int(s.get("num_running_tokens", 0))
        up.loras = {str(name): _held(a) for name, a in (s.get("loras") or {}).items()}
        up.chat_model = s.get("chat_model")
        if not up.healthy:
            logger.info("upstream %s is healthy (models: %s)", up.url, ", ".join(up.models))
        up.healthy = True
        up.last_error = None

    def mark_down(self, up: Upstream, why: str) -> None:
        if up.healthy or up.last_error is None:  # log transitions, not every failed poll
            logger.warning("upstream %s is down: %s", up.url, why)
        up.healthy = False
        up.last_error = why
        up.marked_down.set()

    def counts(self) -> tuple[int, int]:
        """(healthy, all) replicas, for the batchgate_upstreams* gauges."""
        return len(self.healthy()), len(self.upstreams)

    def snapshot(self) -> list[dict[str, object]]:
        """Each replica's state, for GET /v1/internal/upstreams."""
        return [
            {
                "url": u.url,
                "healthy": u.healthy,
                "models": list(u.models),
                "long_prompts": u.long_prompts,
                "loras": {n: {"resident": a.resident, "version": a.version} for n, a in u.loras.items()},
                "reported_tokens": u.reported_tokens,
                "inflight": u.inflight,
                "num_sent": u.num_sent,
                "last_error": u.last_error,
            }
            for u in self.upstreams
        ]

    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy]

    def task_of(self, model: str) -> str | None:
        """What `model` does, as a healthy replica serving it reports (None: not reported)."""
        for u in self.healthy():
            if model in u.tasks:
                return u.tasks[model]
        return None

    def models(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for u in self.healthy():
            for m in u.models:
                out.setdefault(m, u.created.get(m, 0))
        return out

    def pick(
        self,
        model: str,
        exclude: set[str],
        affinity: bytes = b"",
        slack_tokens: int = 0,
        num_prompt_tokens: int = 0,
        adapter: routing.AdapterRoute[Upstream] | None = None,
    ) -> Upstream | None:
        """Where a request goes now (gateway/pool/routing.py)."""
        return routing.pick(
            self.upstreams,
            model,
            exclude,
            affinity,
            slack_tokens,
            num_prompt_tokens,
            self.long_prompt_threshold,
            adapter,
        )


def _held(report: dict[str, object]) -> HeldAdapter:
    owner, model = report.get("owner"), report.get("model")
    return HeldAdapter(
        owner=str(owner) if owner is not None else None,
        model=str(model) if model is not None else None,
        resident=bool(report.get("resident")),
        version=int(str(report.get("version", 0))),
        content_hash=str(report.get("content_hash", "")),
    )
