"""Tensor parallelism, Megatron-style, over torch.distributed: one process per rank.

Rank 0 is the engine's own process: it loads the model, schedules, samples and serves. At start-up
it spawns ranks 1..N-1 (`ParallelExecutor.start`); each loads the same checkpoint, keeps only its
shard and waits. Every step rank 0 broadcasts the step's `StepInputs` (a few lists of ints, pickled)
and all ranks run the same forward pass on their shards:

    embed        vocabulary-parallel: rank r holds rows [r*s, (r+1)*s); a token's row comes from the
                 rank that holds it (the others add zeros): one all-reduce
    q, k, v      column-parallel: rank r holds its query heads and their KV heads
    o_proj       row-parallel: partial sums over the rank's heads, all-reduced
    gate, up     column-parallel: rank r holds 1/N of the intermediate features
    down_proj    row-parallel, all-reduced
    lm_head      vocabulary-parallel: each rank's logits slice, all-gathered (rank 0 samples)

so a step costs 2 all-reduces per layer, one for the embedding and one all-gather of the logits.
A LoRA adapter is cut like the layer it attaches to (`shard_lora`): B's output rows of a column-
parallel projection, A's input columns of a row-parallel one, whose delta joins the partial sum
before the all-reduce. Rank 0 sends each LoRA slot change to the others between steps.
The KV cache is sharded with the KV heads; where a model has fewer KV heads than ranks, each KV
head is replicated on N / kv_heads ranks (as vLLM does). Norms, RoPE and sampling are replicated.

Backends: NCCL for a step's collectives on CUDA, gloo on the CPU (so CI tests it); the step
broadcast always goes over gloo (it carries Python objects). Failure is bounded: a step's
collectives time out after `collective_timeout_s`, rank 0 watches the other processes and marks the
replica failed as soon as one exits (`failure`: /ready answers 503 and `batchgate serve` exits),
and a rank whose parent is gone exits at once. Any error in a step is fatal on a TP replica, since
the ranks' collectives would no longer pair up.

A process holds at most one tensor-parallel replica at a time (torch.distributed's default group).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.config import EngineConfig, ResolvedConfig
from engine.lora import LoraAdapter, LoraModule
from engine.model_spec import ModelSpec
from engine.step import StepInputs
from engine.types import EngineDeadError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # every rank joins and loads its shard within this, or start-up fails
CONTROL_TIMEOUT_S = 3600.0  # an idle rank waits this long for the next step broadcast ...
HEARTBEAT_S = 60.0  # ... and rank 0 broadcasts a heartbeat after this long without a step
WATCH_INTERVAL_S = 0.2  # how often rank 0 checks the other processes, and they check rank 0

_HEARTBEAT = "heartbeat"

Message = TypeVar("Message")
Result = TypeVar("Result")


def kv_head_layout(num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """(KV heads per rank, ranks per KV head): heads split when they divide by the ranks, else each
    head replicated on world_size / num_kv_heads ranks."""
    if num_kv_heads % world_size == 0:
        return num_kv_heads // world_size, 1
    return 1, world_size // num_kv_heads


def check_divisible(spec: ModelSpec, world_size: int) -> None:
    """Raise ValueError unless `spec` splits over `world_size` ranks: query heads and the MLP's
    features divide by the ranks, and the KV heads divide by them or they by the KV heads."""
    heads, kv = spec.num_heads, spec.num_kv_heads
    problems = []
    if heads % world_size:
        problems.append(f"its {heads} attention heads")
    if kv % world_size and world_size % kv:
        problems.append(f"its {kv} KV heads (nor do they divide it)")
    if spec.intermediate_size % world_size:
        problems.append(f"its MLP size {spec.intermediate_size}")
    if spec.moe is not None and spec.moe.intermediate_size % world_size:
        problems.append(f"its experts' size {spec.moe.intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's shape: "
            f"{' or '.join(problems)} (attention heads {heads}, KV heads {kv}); "
            f"use a size that divides both head counts"
        )


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)


@dataclass(frozen=True)
class ShardRows:
    """Which output rows of the column-parallel projections a rank holds (the row-parallel o_proj
    and down_proj take the same ranges as their input columns)."""

    q: slice  # of q_proj (and o_proj's input)
    kv: slice  # of k_proj and v_proj
    mlp: slice  # of gate_proj and up_proj (and down_proj's input)
    heads: slice  # the query heads (their attention sinks)
    experts: slice  # of each expert's gate and up (and its down's input)

    @classmethod
    def of(cls, spec: ModelSpec, rank: int, world_size: int) -> ShardRows:
        d = spec.head_dim
        heads = spec.num_heads // world_size
        kv_heads, kv_replicas = kv_head_layout(spec.num_kv_heads, world_size)
        kv_first = (rank // kv_replicas) * kv_heads
        inter = spec.intermediate_size // world_size
        expert = spec.moe.intermediate_size // world_size if spec.moe is not None else 0
        return cls(
            q=slice(rank * heads * d, (rank + 1) * heads * d),
            kv=slice(kv_first * d, (kv_first + kv_heads) * d),
            mlp=slice(rank * inter, (rank + 1) * inter),
            heads=slice(rank * heads, (rank + 1) * heads),
            experts=slice(rank * expert, (rank + 1) * expert),
        )


def shard_weights(
    spec: ModelSpec, weights: dict[str, torch.Tensor], rank: int, world_size: int
) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Rank `rank`'s spec and weights, under the canonical names (engine/device/models/checkpoint.py;
    the model reads them as it reads a whole model). The embedding and LM head are padded with zero
    rows to equal shards, so the all-gathered logits are [S, world_size * shard], of which the first
    vocab_size count. Experts are split like the MLP, every expert on every rank (its share of
    each expert's intermediate size); a row-parallel bias (o_proj's, the experts' down) stays on
    rank 0 only, so the all-reduce adds it once."""
    check_divisible(spec, world_size)
    shard = ShardRows.of(spec, rank, world_size)
    q_rows, kv_rows, mlp_rows, experts = shard.q, shard.kv, shard.mlp, shard.experts
    vocab = vocab_shard_size(spec.vocab_size, world_size)

    def vocab_rows(w: torch.Tensor) -> torch.Tensor:
        part = w[rank * vocab : (rank + 1) * vocab]
        return F.pad(part, (0, 0, 0, vocab - part.shape[0])).contiguous()

    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name == "model.embed_tokens.weight":
            out[name] = vocab_rows(w)
        elif name == "lm_head.weight":
            continue
        elif ".self_attn.q_proj." in name:
            out[name] = w[q_rows].contiguous()
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            out[name] = w[kv_rows].contiguous()
        elif ".self_attn.o_proj." in name:
            out[name] = _row_parallel(name, w, q_rows, rank)
        elif ".self_attn.sinks" in name:
            out[name] = w[shard.heads].contiguous()
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            out[name] = w[mlp_rows].contiguous()
        elif ".mlp.down_proj." in name:
            out[name] = _row_parallel(name, w, mlp_rows, rank)
        elif ".mlp.experts.gate_proj." in name or ".mlp.experts.up_proj." in name:
            out[name] = w[:, experts].contiguous()
        elif ".mlp.experts.down_proj." in name:
            out[name] = w[:, :, experts].contiguous() if name.endswith(".weight") else w * (rank == 0)
        else:  # norms, routers: replicated
            out[name] = w
    head = weights["model.embed_tokens.weight"] if spec.tie_word_embeddings else weights["lm_head.weight"]
    out["lm_head.weight"] = vocab_rows(head)
    local = dataclasses.replace(
        spec,
        num_heads=spec.num_heads // world_size,
        num_kv_heads=kv_head_layout(spec.num_kv_heads, world_size)[0],
        intermediate_size=spec.intermediate_size // world_size,
        tie_word_embeddings=False,
    )
    return local, out


def shard_lora(adapter: LoraAdapter, shard: ShardRows) -> LoraAdapter:
    """A rank's part of `adapter`, cut like the layers it attaches to: B's output rows of the
    column-parallel q/k/v and gate/up (A whole), A's input columns of the row-parallel o and down
    (B whole), whose deltas then join the partial sums that the layer's all-reduce adds up."""
    cuts = {  # module -> (A's columns, B's rows); None: whole
        "q_proj": (None, shard.q),
        "k_proj": (None, shard.kv),
        "v_proj": (None, shard.kv),
        "o_proj": (shard.q, None),
        "gate_proj": (None, shard.mlp),
        "up_proj": (None, shard.mlp),
        "down_proj": (shard.mlp, None),
    }

    def cut(module: str, part: LoraModule) -> LoraModule:
        cols, rows = cuts[module]
        a = part.a if cols is None else part.a[:, cols].contiguous()
        return LoraModule(a, part.b if rows is None else part.b[rows].contiguous())

    layers = [{module: cut(module, part) for module, part in layer.items()} for layer in adapter.layers]
    nbytes = sum(m.nbytes for layer in layers for m in layer.values())
    return dataclasses.replace(adapter, layers=layers, nbytes=nbytes)


@dataclass(frozen=True)
class LoraSlotChange:
    """Rank 0's message to the other ranks, between steps: LoRA slot `slot` now holds `adapter`
    (the whole adapter; each rank keeps its shard), or nothing."""

    slot: int
    adapter: LoraAdapter | None


def _row_parallel(name: str, w: torch.Tensor, cols: slice, rank: int) -> torch.Tensor:
    """A row-parallel projection's shard: its input columns `cols`; its bias on rank 0 only (the
    all-reduce would add it once per rank)."""
    if name.endswith(".bias"):
        return w * (rank == 0)
    return w[:, cols].contiguous()


@dataclass
class TensorParallel:
    """One rank's view of the replica: its rank, and the collectives the forward pass uses."""

    rank: int
    world_size: int
    vocab_size: int  # the whole vocabulary; this rank holds rows [rank * shard, (rank + 1) * shard)
    rows: ShardRows  # this rank's rows of the projections (and of a LoRA adapter's A and B)
    group: Any = None  # the process group of the step's collectives (None: the default group)

    @classmethod
    def of(cls, spec: ModelSpec, rank: int, world_size: int, group: Any = None) -> TensorParallel:
        """Rank `rank`'s share of a replica of the model `spec` (the whole model's)."""
        return cls(rank, world_size, spec.vocab_size, ShardRows.of(spec, rank, world_size), group)

    @property
    def vocab_shard(self) -> int:
        return vocab_shard_size(self.vocab_size, self.world_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def shard_lora(self, adapter: LoraAdapter) -> LoraAdapter:
        return shard_lora(adapter, self.rows)

    def embed(self, input_ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Hidden states of `input_ids` from a vocabulary-parallel embedding `shard` [vocab_shard, H]."""
        local = input_ids - self.rank * self.vocab_shard
        outside = (local < 0) | (local >= self.vocab_shard)
        hidden = F.embedding(local.clamp(0, self.vocab_shard - 1), shard)
        return self.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[S, vocab] logits from every rank's [S, vocab_shard] slice."""
        if local.shape[0] == 0:  # every rank knows S: all skip alike
            return local.new_empty((0, self.vocab_size))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankArgs:
    """What a rank > 0 is started with (pickled into its process)."""

    resolved: ResolvedConfig  # rank 0's: each rank runs what it decided
    rank: int
    init_method: str
    num_blocks: int
    max_model_len: int
    num_threads: int


def _init_groups(config: EngineConfig, rank: int, init_method: str, device: torch.device) -> tuple[Any, Any]:
    """Join the replica: (control group for the step broadcast, group for the step's collectives)."""
    world = config.parallel.tensor_parallel_size
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=START_TIMEOUT_S),
    )
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    timeout = timedelta(seconds=config.parallel.collective_timeout_s)
    compute = dist.new_group(backend=_backend(device), timeout=timeout)
    return control, compute


class ParallelExecutor:
    """Rank 0's handle on the other ranks: starts them, sends them each step, watches them."""

    def __init__(self, procs: list[Any], tp: TensorParallel, control: Any, timeout_s: float) -> None:
        self.procs = procs
        self.timeout = timedelta(seconds=timeout_s)
        self.tp = tp
        self.control = control
        self.failure: str | None = None
        self._lock = threading.Lock()  # the step broadcast and the heartbeat share the control group
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="batchgate-tp-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(
        cls,
        resolved: ResolvedConfig,
        spec: ModelSpec,
        num_blocks: int,
        max_model_len: int,
        rank_main: Callable[[RankArgs, Connection], None],
    ) -> ParallelExecutor:
        """Spawn ranks 1..N-1, each running `rank_main` (a module-level function: `serve_rank` with
        what the rank runs), join them, and wait until each has loaded its shard (rank 0 loads its
        own after this returns). Raises RuntimeError naming the rank that failed to start."""
        config, device = resolved.config, resolved.device
        world = config.parallel.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel_size {world} needs {world} GPUs, found {torch.cuda.device_count()}"
            )
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        # CPU ranks share the cores: each gets its share of rank 0's threads.
        threads = config.model.num_threads or max(1, torch.get_num_threads() // world)
        ctx = mp.get_context("spawn")
        procs, pipes = [], []
        for rank in range(1, world):
            parent_end, child_end = ctx.Pipe(duplex=False)
            args = RankArgs(resolved, rank, init_method, num_blocks, max_model_len, threads)
            proc = ctx.Process(
                target=rank_main, args=(args, child_end), name=f"batchgate-tp{rank}", daemon=True
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            pipes.append(parent_end)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device.index or 0)
            control, compute = _init_groups(config, 0, init_method, device)
            for rank, (proc, pipe) in enumerate(zip(procs, pipes, strict=True), start=1):
                status = _wait_ready(proc, pipe, rank)
                if status != "ready":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {status}")
        except BaseException:
            for proc in procs:
                proc.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        logger.info("tensor parallel: %d ranks (%s)", world, _backend(device))
        tp = TensorParallel.of(spec, 0, world, compute)
        return cls(procs, tp, control, config.parallel.collective_timeout_s)

    def run(self, forward: Callable[[Message], Result], message: Message) -> Result:
        """Send `message` (a step's `StepInputs`, or a `LoraSlotChange`) to every rank and run
        rank 0's part of it: a step's full logits."""
        if self.failure is not None:
            raise EngineDeadError(f"a tensor-parallel rank failed: {self.failure}")
        try:
            self._send(message)
            return forward(message)
        except Exception as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            raise EngineDeadError(f"a tensor-parallel step failed: {self.failure}") from exc

    def _send(self, message: Any) -> None:
        """Broadcast `message` to the other ranks; raise if it is not delivered within the
        collective timeout (gloo's root waits for every receiver, so a stopped rank blocks it)."""
        data = pickle.dumps(message)
        size = torch.tensor([len(data)], dtype=torch.long)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with self._lock:
            for tensor in (size, payload):
                work = dist.broadcast(tensor, src=0, group=self.control, async_op=True)
                if not work.wait(timeout=self.timeout):
                    raise TimeoutError(f"the step broadcast took over {self.timeout.total_seconds():g}s")
            self._last_send = time.monotonic()

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.error("tensor-parallel replica failed: %s", reason)

    def _watch(self) -> None:
        """Mark the replica failed once another rank's process exits; keep idle ranks' step
        broadcast from timing out."""
        while not self._closed.wait(WATCH_INTERVAL_S):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.exitcode is not None:
                    self._fail(f"rank {rank} exited with code {proc.exitcode}")
            if self.failure is not None:
                return
            if time.monotonic() - self._last_send > HEARTBEAT_S:
                try:
                    self._send(_HEARTBEAT)
                except Exception as exc:  # noqa: BLE001 - a rank is gone; the step path raises too
                    self._fail(f"heartbeat failed: {type(exc).__name__}: {exc}")

    def shutdown(self) -> None:
        """Stop the other ranks (politely, then by force) and leave the process group."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.failure is None:
            try:
                self._send(None)
            except Exception:  # noqa: BLE001 - they are killed below anyway
                pass
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        self._watcher.join(5.0)
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_ready(proc: Any, pipe: Connection, rank: int) -> str:
    """'ready', or why rank `rank` did not get there (its error, or its exit)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if pipe.poll(WATCH_INTERVAL_S):
            try:
                return str(pipe.recv())
            except EOFError:
                return f"exited with code {proc.exitcode}"
        if proc.exitcode is not None:
            return f"exited with code {proc.exitcode}"
    return f"not ready after {START_TIMEOUT_S:g}s"


def _receive(control: Any) -> Any:
    """The next message rank 0 broadcasts (`ParallelExecutor._send`); waits while the replica idles."""
    size = torch.empty(1, dtype=torch.long)
    dist.broadcast(size, src=0, group=control)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=control)
    return pickle.loads(payload.numpy().tobytes())


def _exit_with_parent(parent: int) -> None:
    """A rank whose rank 0 is gone has nothing to serve: exit at once, whatever it waits on."""
    while True:
        time.sleep(WATCH_INTERVAL_S)
        if os.getppid() != parent:
            os._exit(3)


class RankForward(Protocol):
    """What a rank > 0 runs for each message rank 0 broadcasts (engine/device/runner.py's ModelRunner)."""

    def forward_inputs(self, inputs: StepInputs) -> torch.Tensor: ...

    def install_lora(self, change: LoraSlotChange) -> None: ...


def serve_rank(
    args: RankArgs, ready: Connection, build: Callable[[RankArgs, torch.device, Any], RankForward]
) -> None:
    """A rank > 0: join, `build(args, device, group of the step's collectives)` its shard's runner,
    then run every step rank 0 broadcasts until told to stop."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    config, rank = args.resolved.config, args.rank
    torch.set_num_threads(args.num_threads)
    device = _rank_device(args.resolved.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    control, compute = _init_groups(config, rank, args.init_method, device)
    try:
        runner = build(args, device, compute)
    except BaseException as exc:
        ready.send(f"{type(exc).__name__}: {exc}")
        raise
    ready.send("ready")
    ready.close()
    while True:
        message = _receive(control)
        if message is None:
            break
        if isinstance(message, str):  # the heartbeat
            continue
        if isinstance(message, LoraSlotChange):
            runner.install_lora(message)
            continue
        runner.forward_inputs(message)
    dist.destroy_process_group()
