"""Random-weight tiny Llama-family models with the real SmolLM2 tokenizer, for fast tests.

The folder is a plain Hugging Face checkpoint, so it goes through the same loader as a real model
and transformers can load it as the reference implementation.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from engine.resolve import resolve_model_dir

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def bundled_dir(cache_dir: Path) -> Path:
    """The bundled model converted to a Hugging Face folder (converted once, then cached)."""
    return resolve_model_dir(None, cache_dir)


def snap_to_q4_1(weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """`weight` [N, K] rounded onto a Q4_1 grid (per 32 along K: w = d * q + m, q in 0..15, d and m
    in fp16), as llama.cpp's quantizer would store it."""
    n, k = weight.shape
    g = weight.float().view(n, k // group, group)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((high - low) / 15).half().float()
    m = low.half().float()
    q = ((g - m) / d).round().clamp(0, 15)
    return (q * d + m).view(n, k)


def counting_batch(gen: torch.Generator, rows: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences that count from a random start by a step of 1, 2 or 3 (mod `vocab`): which step
    is told by the first two tokens, so a model that learns them attends to the previous token."""
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    step = torch.randint(1, 4, (rows, 1), generator=gen)
    return (start + step * torch.arange(length)) % vocab


def _train(model: Any, steps: int, vocab: int, seed: int) -> None:
    """A few hundred AdamW steps on `counting_batch` sequences of 64 tokens: enough for confident
    (peaked) predictions, as a trained model's are and random weights' are not."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        x = counting_batch(gen, 4, 64, vocab)
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def make_tiny_model(
    target: Path,
    tokenizer_dir: Path,
    model_type: str = "llama",
    seed: int = 0,
    q4_1: bool = False,
    train_steps: int = 0,
    **overrides: Any,
) -> Path:
    """A random-weight model of `model_type` (any transformers knows; `overrides` are its config's,
    the text config's for `gemma3`) with the real tokenizer; `q4_1` snaps every layer projection
    onto a Q4_1 grid, like the weights of a Q4_1 GGUF file; `train_steps` trains it that many
    steps on `counting_batch` sequences first (give it a small `vocab_size`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.2,  # wide logits: greedy choices are not near-ties
    )
    settings.update(overrides)
    if model_type == "gemma3":  # the multimodal checkpoint: its text model, and a small vision tower
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        text = {k: v for k, v in settings.items() if k != "tie_word_embeddings"}
        config = AutoConfig.for_model(
            model_type,
            text_config=text,
            vision_config=vision | dict(image_size=32, patch_size=16),
            mm_tokens_per_image=4,
            eos_token_id=settings["eos_token_id"],
        )
    else:
        config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    if model_type == "gemma3":
        from transformers import Gemma3ForConditionalGeneration

        model = Gemma3ForConditionalGeneration._from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if train_steps:
        _train(model, train_steps, config.get_text_config().vocab_size, seed)
    if q4_1:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".layers." in name and name.endswith("proj.weight"):
                    param.copy_(snap_to_q4_1(param))
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, target / name)
    return target


def ending_at_once(source: Path, target: Path, window: int) -> Path:
    """A copy of the tiny model at `source` whose most likely next token is always the end of
    sequence, with a `window`-token context (for protocol tests of clients that set no output
    limit, such as Codex CLI): its layers add nothing to the residual stream, whose first
    dimension is positive in every embedding and is the only one the final norm and the head's
    EOS row read."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = window
    (target / "config.json").write_text(json.dumps(config))
    weights = load_file(target / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["model.norm.weight"].zero_()
    weights["model.norm.weight"][0] = 1.0
    head = weights["lm_head.weight"]
    head.zero_()
    head[config["eos_token_id"], 0] = 20.0
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target
