"""A pooling model served: loaded from an `EngineConfig`, its tokenizer, its prompts' checks
and its engine, with the synchronous run `LLM.embed` and `LLM.score` use (the server runs
the same engine on a thread: pooling/async_engine.py)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.layers.attention.selector import resolve_attention_backend
from tokenmill.models.bert import ENCODER_ARCHITECTURES
from tokenmill.models.loader import LoadSettings, checkpoint_dtype, load_tokenizer
from tokenmill.pooling.config import PoolingConfig, read_pooling_config
from tokenmill.pooling.engine import PoolingEngine, PoolingRequest, PoolingResult
from tokenmill.pooling.inputs import PoolingPrompts
from tokenmill.pooling.model_loading import PoolingModel, load_pooling_model, pooling_architecture
from tokenmill.pooling.runner import PoolingInput, PoolingRunner

logger = logging.getLogger("tokenmill.pooling")

# The longest sequence a decoder embedder serves by default (its RoPE tables cover it).
DEFAULT_DECODER_MAX_LEN = 32768


@dataclass
class PoolingService:
    task: str  # embed or score
    model_dir: Path
    model: PoolingModel
    config: PoolingConfig
    prompts: PoolingPrompts
    engine: PoolingEngine

    @property
    def max_model_len(self) -> int:
        return self.prompts.max_model_len

    @property
    def is_cross_encoder(self) -> bool:
        """Scores come from a classification head or a reranker's yes/no logits (else from
        embeddings' cosine)."""
        encoder = self.model.encoder
        has_head = encoder is not None and encoder.classifier is not None
        return has_head or self.config.yes_no_tokens is not None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.prompts.tokenizer

    def run(self, inputs: list[PoolingInput]) -> list[PoolingResult]:
        """Every input pooled, in order (the engine batches them under its budgets)."""
        ids = [f"offline-{next(_COUNTER)}" for _ in inputs]
        for request_id, item in zip(ids, inputs):
            self.engine.add(PoolingRequest(request_id, item))
        finished: dict[str, PoolingResult] = {}
        try:
            while len(finished) < len(ids):
                finished.update((r.request_id, r) for r in self.engine.step())
        except BaseException:
            self.engine.abort(set(ids))
            raise
        return [finished[i] for i in ids]


_COUNTER = itertools.count()


def build_pooling_service(config: EngineConfig, task: str) -> PoolingService:
    if config.model is None:
        raise ConfigError(f"--task {task} needs a model: give a checkpoint directory")
    model_dir = Path(config.model)
    device = config.torch_device()
    from transformers import AutoConfig  # the loader checks it again, with clear errors

    raw_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model_max = int(getattr(raw_config, "max_position_embeddings", 512))
    # An encoder's forward is all products over many rows: its dtype follows the CPU's
    # product speed rather than the bytes a weight read costs (EngineConfig.torch_dtype).
    is_encoder = pooling_architecture(model_dir) in ENCODER_ARCHITECTURES
    settings = LoadSettings(
        dtype=config.torch_dtype(checkpoint_dtype(raw_config), compute_bound=is_encoder),
        linear_backend=config.linear_backend_for(device),
        attention_backend=resolve_attention_backend(config.attention_backend, device),
        max_model_len=config.max_model_len or min(model_max, DEFAULT_DECODER_MAX_LEN),
    )
    torch.manual_seed(config.seed)
    model = load_pooling_model(model_dir, settings, device)
    pooling = read_pooling_config(model_dir, model.hf_config, model.is_decoder)
    max_model_len = config.max_model_len or model.max_tokens
    if max_model_len > model.max_tokens:
        raise ConfigError(
            f"max_model_len {max_model_len} is more than the model's {model.max_tokens} positions"
        )
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    if task == "score" and model.architecture.endswith("ForCausalLM"):
        pooling = replace(pooling, yes_no_tokens=yes_no_tokens(tokenizer))
    elif task == "score" and (model.encoder is None or model.encoder.classifier is None):
        logger.info("--task score with an embedding model: scores are cosine similarities")
    hidden = model.hf_config.hidden_size
    prompts = PoolingPrompts(tokenizer, pooling, model.hf_config.vocab_size, max_model_len, hidden)
    engine = PoolingEngine(
        PoolingRunner(model, pooling, device),
        max(config.max_num_batched_tokens, 1),
        config.max_num_seqs,
    )
    logger.info(
        "pooling model %s (%s, %s pooling%s), task %s, %s, max_model_len %d",
        model_dir,
        model.architecture,
        pooling.pooling_type,
        ", normalized" if pooling.normalize else "",
        task,
        settings.dtype,
        max_model_len,
    )
    return PoolingService(task, model_dir, model, pooling, prompts, engine)


def yes_no_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """A Qwen3-Reranker-style scorer's ("no", "yes") token ids; a clear error without them."""
    ids = tokenizer.convert_tokens_to_ids(["no", "yes"])
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ConfigError(
            "--task score with a causal LM scores by the logits of the tokens 'yes' and 'no' "
            "(Qwen3-Reranker); this tokenizer has no such single tokens"
        )
    return ids[0], ids[1]
