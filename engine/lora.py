"""LoRA adapters over the one base model: loading PEFT's format, the versions requests pin, and the
resident slots a batch can mix.

    load_adapter(path, spec)  --> LoraAdapter   one immutable version (weights, rank, content hash)
    LoraRegistry                                 name -> current version; pins; unload waits or 409s
    LoraSlots                                    up to `max_loras` versions a step can use (LRU)

A request resolves its adapter's name to a version when it is submitted and pins it: replacing
the adapter (loading the same name again) makes a new version for new requests, the running ones
keep computing with theirs, and an unloaded version's memory goes once its last user ended. The
model (engine/device/models/decoder.py) adds each row's low-rank delta after the base matmul, grouped by slot:
`y[rows] += (x[rows] @ A.T) @ (scale * B).T`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.model_spec import ModelSpec
from engine.types import LoraError, LoraInUseError, LoraNotFoundError

__all__ = ["LoraError", "LoraInUseError", "LoraNotFoundError"]

MAX_RANK = 64
# PEFT's module names, in the order the model fuses them: (fused linear, module).
TARGETS = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "down_proj": "down",
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """Each target's (in features, out features, offset of its output in the fused linear)."""
    h, q, kv, i = (
        spec.hidden_size,
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.intermediate_size,
    )
    return {
        "q_proj": (h, q, 0),
        "k_proj": (h, kv, q),
        "v_proj": (h, kv, q + kv),
        "o_proj": (q, h, 0),
        "gate_proj": (h, i, 0),
        "up_proj": (h, i, i),
        "down_proj": (i, h, 0),
    }


@dataclass(frozen=True)
class LoraModule:
    """One target module's delta `x @ a.T @ b.T` (PEFT's layout), B already times the scale."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]

    @property
    def nbytes(self) -> int:
        return (self.a.numel() + self.b.numel()) * self.a.element_size()


LayerLora = dict[str, LoraModule]  # PEFT module name -> its delta (absent: not targeted)


@dataclass(eq=False)
class LoraAdapter:
    """One loaded version of an adapter; never changed after loading (a replace is a new one)."""

    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    content_hash: str  # of adapter_config.json and adapter_model.safetensors
    layers: list[LayerLora]  # one per base layer, on the CPU in float32
    nbytes: int
    version: int = 0  # set by the registry: 1, 2, ... per name
    released: bool = False  # unloaded and no user left: may no longer be pinned
    users: int = field(default=0, repr=False)

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    @property
    def id(self) -> str:
        """What a trace span and a log line name: `name@version:hash12`."""
        return f"{self.name}@{self.version}:{self.content_hash[:12]}"


def _config(path: Path, name: str) -> dict[str, Any]:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoraError(f"adapter {name!r}: {cfg_file} not found (expected PEFT's save_pretrained folder)")
    try:
        cfg: dict[str, Any] = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise LoraError(f"adapter {name!r}: adapter_config.json is not JSON: {exc}") from exc
    checks = [
        (cfg.get("peft_type", "LORA") == "LORA", f"peft_type {cfg.get('peft_type')!r} is not LORA"),
        (cfg.get("bias", "none") == "none", f"bias {cfg.get('bias')!r} is not supported (only 'none')"),
        (not cfg.get("use_dora"), "DoRA (use_dora) is not supported"),
        (not cfg.get("fan_in_fan_out"), "fan_in_fan_out is not supported"),
        (not cfg.get("modules_to_save"), "modules_to_save is not supported (only LoRA weights)"),
        (
            not cfg.get("rank_pattern") and not cfg.get("alpha_pattern"),
            "rank_pattern/alpha_pattern are not supported",
        ),
    ]
    for ok, problem in checks:
        if not ok:
            raise LoraError(f"adapter {name!r}: {problem}")
    return cfg


def _targets(cfg: dict[str, Any], name: str) -> tuple[str, ...]:
    raw = cfg.get("target_modules")
    if isinstance(raw, str):  # PEFT allows a regex over the full module name
        pattern = re.compile(raw)
        found = tuple(
            m
            for m in TARGETS
            if pattern.fullmatch(f"model.layers.0.self_attn.{m}")
            or pattern.fullmatch(f"model.layers.0.mlp.{m}")
        )
        return found
    targets = tuple(str(m).split(".")[-1] for m in raw or ())
    unsupported = sorted(set(targets) - set(TARGETS))
    if unsupported:
        raise LoraError(
            f"adapter {name!r}: unsupported target module(s) {', '.join(unsupported)}; "
            f"supported: {', '.join(TARGETS)}"
        )
    return targets


def content_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        h.update((path / file).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def load_adapter(path: str | Path, spec: ModelSpec, name: str = "") -> LoraAdapter:
    """Read and check a PEFT LoRA folder against the base model `spec`; LoraError names the problem."""
    from safetensors.torch import load_file

    folder = Path(path)
    name = name or folder.name
    cfg = _config(folder, name)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoraError(f"adapter {name!r}: {weights_file} not found")
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    if not 1 <= rank <= MAX_RANK:
        raise LoraError(f"adapter {name!r}: rank {rank} is not in [1, {MAX_RANK}]")
    targets = _targets(cfg, name)
    shapes = module_shapes(spec)
    # layer -> module -> {"A": tensor, "B": tensor}
    found: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(
                f"adapter {name!r}: unexpected tensor {key!r} (only LoRA A/B of the layers' projections)"
            )
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in TARGETS:
            raise LoraError(f"adapter {name!r}: unsupported target module {module} ({key})")
        if not 0 <= layer < spec.num_layers:
            raise LoraError(
                f"adapter {name!r}: layer {layer} does not exist in the base model ({spec.num_layers} layers)"
            )
        if TARGETS[module] in ("gate_up", "down") and spec.is_sparse(layer):
            raise LoraError(
                f"adapter {name!r}: layer {layer} of this base model has experts, not one {module} "
                f"(adapters of a mixture-of-experts model may target the attention projections only)"
            )
        found.setdefault(layer, {}).setdefault(module, {})[which] = tensor
    if not found:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    layers: list[LayerLora] = []
    for layer in range(spec.num_layers):
        modules: LayerLora = {}
        for module in TARGETS:
            ab = found.get(layer, {}).get(module)
            if ab is None:
                continue
            a, b = ab.get("A"), ab.get("B")
            if a is None or b is None:
                raise LoraError(
                    f"adapter {name!r}: layer {layer} {module} lacks lora_{'A' if a is None else 'B'}"
                )
            fan_in, fan_out, _ = shapes[module]
            if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
                raise LoraError(
                    f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)},"
                    f" but this base model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank}): "
                    f"it was trained for a different base model"
                )
            modules[module] = LoraModule(a.float().contiguous(), (b.float() * scale).contiguous())
        layers.append(modules)
    nbytes = sum(m.nbytes for layer_lora in layers for m in layer_lora.values())
    return LoraAdapter(
        name=name,
        path=str(folder),
        rank=rank,
        alpha=alpha,
        use_rslora=bool(cfg.get("use_rslora")),
        target_modules=targets or tuple(sorted({m for mods in found.values() for m in mods})),
        content_hash=content_hash(folder),
        layers=layers,
        nbytes=nbytes,
    )


class LoraRegistry:
    """Adapter names -> their current version, and the versions still pinned by requests.

    Thread-safe: the gateway loads, resolves and unloads from its threads; the engine thread pins
    and unpins as sequences start and end."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._current: dict[str, LoraAdapter] = {}
        self._held: dict[int, LoraAdapter] = {}  # id() -> every version not yet released
        self._versions: dict[str, int] = {}
        self._drained: dict[int, list[Future[None]]] = {}

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Load `path` as the new current version of `name` (blocking: reads the files). The version
        it replaces stays with the requests that pinned it and is released after the last."""
        adapter = load_adapter(path, self.spec, name)
        with self._lock:
            adapter.version = self._versions.get(name, 0) + 1
            self._versions[name] = adapter.version
            old = self._current.get(name)
            self._current[name] = adapter
            self._held[id(adapter)] = adapter
            if old is not None:
                self._release_if_unused(old)
        return adapter

    def get(self, name: str) -> LoraAdapter:
        """The current version of `name`; LoraNotFoundError if none is loaded."""
        with self._lock:
            adapter = self._current.get(name)
        if adapter is None:
            raise LoraNotFoundError(f"the adapter {name!r} is not loaded")
        return adapter

    def names(self) -> dict[str, LoraAdapter]:
        with self._lock:
            return dict(self._current)

    def pin(self, adapter: LoraAdapter) -> None:
        """One more sequence computes with `adapter`; LoraNotFoundError if it was released (it was
        unloaded after the request chose it and before the engine took it)."""
        with self._lock:
            if adapter.released:
                raise LoraNotFoundError(f"the adapter {adapter.name!r} was unloaded")
            adapter.users += 1

    def unpin(self, adapter: LoraAdapter) -> None:
        with self._lock:
            adapter.users -= 1
            assert adapter.users >= 0, adapter
            self._release_if_unused(adapter)

    def unload(self, name: str, wait: bool = True) -> Future[None]:
        """Take `name` away from new requests; the returned future is done once the last request
        using it ended and its memory is released. `wait=False`: LoraInUseError (and nothing
        changes) while requests use it."""
        with self._lock:
            adapter = self._current.get(name)
            if adapter is None:
                raise LoraNotFoundError(f"the adapter {name!r} is not loaded")
            if not wait and adapter.users:
                raise LoraInUseError(
                    f"the adapter {name!r} is in use by {adapter.users} running sequence(s); "
                    f"retry later, or unload with wait to let them finish first"
                )
            done: Future[None] = Future()
            self._drained.setdefault(id(adapter), []).append(done)
            del self._current[name]
            self._release_if_unused(adapter)
        return done

    def _release_if_unused(self, adapter: LoraAdapter) -> None:
        if adapter.users or self._current.get(adapter.name) is adapter or adapter.released:
            return
        adapter.released = True
        self._held.pop(id(adapter), None)
        for done in self._drained.pop(id(adapter), []):
            if not done.done():
                done.set_result(None)

    @property
    def nbytes(self) -> int:
        """Bytes of adapter weights held (current versions and those still pinned)."""
        with self._lock:
            return sum(a.nbytes for a in self._held.values())

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)


class LoraSlots:
    """The `max_loras` adapter versions a step may mix, by slot index (the rows' step input).

    Engine thread only. A slot in use by running sequences stays; an idle one is reused least
    recently used first. `install(slot, adapter)` puts a version's weights into the model's slot."""

    def __init__(self, max_loras: int, install: Any) -> None:
        self.max_loras = max_loras
        self._install = install
        self._slot_of: dict[int, int] = {}  # id(adapter) -> slot
        self._adapter: list[LoraAdapter | None] = [None] * max_loras
        self._users = [0] * max_loras
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.num_loads = 0

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """The slot `adapter` runs in (installed now if it was not resident), or None: every slot
        is in use by running sequences of other adapters."""
        slot = self._slot_of.get(id(adapter))
        if slot is None:
            if not self._idle:
                return None
            slot, _ = self._idle.popitem(last=False)
            old = self._adapter[slot]
            if old is not None:
                del self._slot_of[id(old)]
            self._adapter[slot] = adapter
            self._slot_of[id(adapter)] = slot
            self._install(slot, adapter)
            self.num_loads += 1
        self._users[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        self._users[slot] -= 1
        assert self._users[slot] >= 0
        if self._users[slot] == 0:
            self._idle[slot] = None  # most recently used last

    def drop_released(self) -> None:
        """Forget released versions (unloaded, unused), so their weights can be freed."""
        for slot, adapter in enumerate(self._adapter):
            if adapter is not None and adapter.released and not self._users[slot]:
                del self._slot_of[id(adapter)]
                self._adapter[slot] = None
                self._install(slot, None)

    def resident(self) -> list[LoraAdapter]:
        return [a for a in self._adapter if a is not None]
