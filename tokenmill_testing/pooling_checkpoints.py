"""Small random pooling checkpoints, saved by sentence-transformers itself: BERT and XLM-R
embedders (CLS / mean pooling, Normalize), a Qwen3 last-token embedder, BERT and XLM-R
cross-encoders. Everything is generated locally: a WordPiece vocabulary of the corpus's words
and random weights (std 0.2, so that pooled outputs differ clearly between texts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import BertTokenizerFast

from tokenmill.bench.random_model import no_progress_bars
from tokenmill_testing.random_checkpoint import build_corpus, save_random_checkpoint

_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SAMPLE_TEXTS = [
    "the cat sat on the mat",
    "a red apple",
    "what is the capital of france",
    "paris is the capital of france and a large city",
    "dogs like to run in the park with their friends",
    "x",
]


def _wordpiece_tokenizer(
    save_dir: Path, model_max_length: int, segment_ids: bool = True
) -> BertTokenizerFast:
    """A WordPiece tokenizer; without `segment_ids` it returns no token_type_ids, as
    XLM-RoBERTa's (whose one token type cannot tell a pair's halves apart)."""
    words: dict[str, None] = {}
    for sentence in build_corpus(400):
        for word in sentence.lower().replace(".", " ").replace(",", " ").split():
            if word.isalpha():
                words.setdefault(word)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789.,?!'"
    vocab = [*_SPECIALS, *letters, *(f"##{c}" for c in letters), *list(words)[:400]]
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    names = ["input_ids", "token_type_ids", "attention_mask"]
    tokenizer = BertTokenizerFast(
        str(save_dir / "vocab.txt"),
        model_max_length=model_max_length,
        model_input_names=names if segment_ids else [names[0], names[2]],
    )
    tokenizer.save_pretrained(save_dir)
    return tokenizer


def _random_weights(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name or name.endswith("norm.weight"):
                param.normal_(1.0, 0.1, generator=generator)
            else:
                param.normal_(0.0, 0.2, generator=generator)


def _encoder_config(kind: str, vocab_size: int, **extra: Any) -> Any:
    sizes = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        **extra,
    )
    if kind == "bert":
        return transformers.BertConfig(type_vocab_size=2, **sizes)
    if kind == "xlm-roberta":
        return transformers.XLMRobertaConfig(type_vocab_size=1, pad_token_id=0, **sizes)
    raise ValueError(kind)


def save_encoder(save_dir: Path, kind: str = "bert", seed: int = 0) -> Path:
    """A plain Hugging Face encoder directory (`BertModel` / `XLMRobertaModel`)."""
    tokenizer = _wordpiece_tokenizer(save_dir, 128, segment_ids=kind == "bert")
    config = _encoder_config(kind, len(tokenizer))
    model = transformers.AutoModel.from_config(config)
    _random_weights(model, seed)
    model.save_pretrained(save_dir)
    return save_dir


def save_sentence_transformer(
    save_dir: Path,
    kind: str = "bert",
    pooling: str = "mean",
    normalize: bool = True,
    seed: int = 0,
    matryoshka_dimensions: list[int] | None = None,
    tokenizer_dir: Path | None = None,
) -> Path:
    """An encoder (or with kind "qwen3", a Qwen3 decoder) saved as a sentence-transformers
    directory: modules.json, the Transformer module at the root, 1_Pooling, 2_Normalize."""
    from sentence_transformers import SentenceTransformer, models

    base = save_dir.with_name(save_dir.name + "-base")
    if kind == "qwen3":
        save_random_checkpoint(base, architecture="qwen3", tokenizer_dir=tokenizer_dir)
        # With a chat template, sentence-transformers 6 wraps plain texts in it (its
        # "message" modality); Qwen3-Embedding embeds raw text, so the test model has none.
        (base / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((base / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (base / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        save_encoder(base, kind, seed)
    with no_progress_bars():
        transformer = models.Transformer(str(base))
        modules: list[torch.nn.Module] = [transformer]
        dim = transformer.get_word_embedding_dimension()
        modules.append(models.Pooling(dim, pooling_mode=pooling))
        if normalize:
            modules.append(models.Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(str(save_dir))
    if matryoshka_dimensions is not None:
        config = read_json(save_dir / "config.json")
        config["matryoshka_dimensions"] = matryoshka_dimensions
        (save_dir / "config.json").write_text(json.dumps(config, indent=2))
    return save_dir


def save_cross_encoder(
    save_dir: Path, kind: str = "bert", num_labels: int = 1, seed: int = 0
) -> Path:
    """A `*ForSequenceClassification` reranker, saved by sentence-transformers' CrossEncoder."""
    from sentence_transformers import CrossEncoder

    tokenizer = _wordpiece_tokenizer(save_dir, 128, segment_ids=kind == "bert")
    config = _encoder_config(kind, len(tokenizer), num_labels=num_labels)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    _random_weights(model, seed)
    model.save_pretrained(save_dir)
    with no_progress_bars():
        CrossEncoder(str(save_dir), device="cpu").save(str(save_dir))
    return save_dir


def save_yes_no_reranker(save_dir: Path, tokenizer_dir: Path) -> Path:
    """A Qwen3-Reranker-style checkpoint: a Qwen3 causal LM whose tokenizer has the single
    tokens "yes" and "no" (the score is P(yes) against P(no) after the pair)."""
    from transformers import AutoTokenizer

    words = save_dir.with_name(save_dir.name + "-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["yes", "no"])
    tokenizer.save_pretrained(words)
    return save_random_checkpoint(save_dir, architecture="qwen3", tokenizer_dir=words)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
