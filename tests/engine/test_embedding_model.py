"""The encoder against sentence-transformers' own `encode` on the bundled all-MiniLM-L6-v2, and
against transformers' BertModel on a small random BERT folder (other shapes, other pooling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.embeddings.model import EmbeddingModel, Pooling, bundled_embedding_path, read_pooling

TEXTS = [
    "Hello, world!",
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings turn text into vectors that can be compared with cosine similarity.",
    "Ünïcödé: café, naïve, façade, smörgåsbord",
    "日本語のテキストも埋め込めます。",
    "Привет, как дела? Всё хорошо.",
    "emoji 🚀🔥 and symbols ∑∫√ ≠ ≤",
    "   leading and trailing spaces   ",
    "UPPER CASE and lower case are the same to an uncased model",
    "numbers 1234567890 3.14159 and code: def f(x): return x ** 2",
    " ".join(["A long input that goes on and on."] * 40),  # > 256 tokens: both truncate to the window
    "word " * 250,
]


@pytest.fixture(scope="module")
def minilm() -> EmbeddingModel:
    return EmbeddingModel.load(None)


def test_bundled_folder_reads_the_sentence_transformers_config(minilm: EmbeddingModel) -> None:
    assert minilm.name == "all-MiniLM-L6-v2"
    assert minilm.dimensions == 384
    assert minilm.max_input_tokens == 256  # sentence_bert_config.json, not the 512 position table
    assert minilm.pooling == Pooling("mean", normalize=True)
    assert minilm.tokenize(["Hello"])[0][0] == 101 and minilm.tokenize(["Hello"])[0][-1] == 102


def test_tokenize_equals_the_transformers_tokenizer_untruncated(minilm: EmbeddingModel) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(bundled_embedding_path())
    # The saved tokenizer.json truncates at 128 tokens: tokenize must not (the window is checked,
    # and cut only on request, by the caller).
    long_text = " ".join(["the"] * 600)  # one token each
    texts = ["Hello", "Ünïcödé, punctuation!  and   spaces", long_text, *TEXTS]
    expected = reference(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    assert minilm.tokenize(texts) == [list(ids) for ids in expected]
    for text, ids in zip(texts, expected, strict=True):  # one text takes its own path
        assert minilm.tokenize([text]) == [list(ids)]
    assert len(minilm.tokenize([long_text])[0]) == 602
    # The wrapper's per-call settings do not reach tokenize's tokenizer.
    minilm.tokenizer(["x"], truncation=True, max_length=16)
    assert len(minilm.tokenize([long_text])[0]) == 602


def test_equals_sentence_transformers_encode(minilm: EmbeddingModel) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(bundled_embedding_path()), device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True, batch_size=4)
    ids = [minilm.truncate(t, minilm.max_input_tokens, text=True) for t in minilm.tokenize(TEXTS)]
    assert max(len(t) for t in ids) == 256
    # One batch with every length mixed (sorted and split inside embed), and each input alone.
    together = torch.tensor(minilm.embed(ids))
    alone = torch.tensor([minilm.embed([t])[0] for t in ids])
    for got in (together, alone):
        cosine = torch.nn.functional.cosine_similarity(got, expected.float(), dim=1)
        assert cosine.min().item() >= 0.9999, cosine
        assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_any_bert_folder_matches_transformers(tmp_path: Path) -> None:
    """A different BERT shape with CLS pooling and no normalisation: our forward equals
    transformers' BertModel on the same weights, padding included."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        hidden_act="gelu_new",
    )
    reference = BertModel(config, add_pooling_layer=False).eval()
    reference.save_pretrained(tmp_path)
    src = bundled_embedding_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    assert read_pooling(tmp_path) == Pooling("cls", normalize=False)
    model = EmbeddingModel.load(tmp_path)
    assert model.max_input_tokens == 64 and model.dimensions == 64
    inputs = [[101, 5, 6, 7, 102], [101, 9, 102], [101] + list(range(10, 60)) + [102]]
    got = torch.tensor(model.embed(inputs))
    for row, ids in enumerate(inputs):
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([ids])).last_hidden_state[0, 0]
        assert torch.allclose(got[row], expected, atol=1e-5)


def test_unsupported_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama' is not supported"):
        EmbeddingModel.load(tmp_path)
