"""The demo models' byte-level BPE, trained on the demo corpus.

Same pipeline and special tokens as the random test checkpoints (Qwen2-style split with one
digit per token, which makes arithmetic learnable; ChatML chat template), but the merges come
from the demo corpus, so the task words and story words are mostly single tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from tokenmill_testing.random_checkpoint import train_bpe, wrap_tokenizer


def train_tokenizer(
    texts: Iterable[str], save_dir: str | Path, vocab_size: int, model_max_length: int
) -> PreTrainedTokenizerFast:
    """Train on `texts` and save tokenizer.json + tokenizer_config.json (with chat template).

    Plain prompts get a BOS from the post-processor (the models were trained on stories that
    start with one); the chat template writes its own BOS, so rendered chats are encoded with
    `add_special_tokens=False`, as the engine does.
    """
    wrapped = wrap_tokenizer(train_bpe(texts, vocab_size), model_max_length)
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    # The chat template goes into tokenizer_config.json, where every HF loader looks for it.
    wrapped.save_pretrained(str(save_dir), save_jinja_files=False)
    return wrapped
