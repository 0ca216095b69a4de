"""The speculative-decoding parts of an engine: the draft (model, EAGLE/MTP layer, Medusa
heads) a config names, loaded beside its target, and the proposer over it."""

from __future__ import annotations

from dataclasses import replace

import torch

from tokenmill.config import ConfigError, EngineConfig, SpeculativeConfig
from tokenmill.config.speculative import MODEL_FREE_METHODS
from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import LoadSettings, load_model
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.spec_decode.eagle import EagleDraft, EagleProposer
from tokenmill.spec_decode.head_checkpoint import load_eagle, load_medusa
from tokenmill.spec_decode.medusa import MedusaHeads, MedusaProposer
from tokenmill.spec_decode.mtp import MtpDraft
from tokenmill.spec_decode.mtp_checkpoint import load_mtp
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.proposer import Proposer
from tokenmill.spec_decode.suffix import SuffixDecodingProposer

Draft = LlamaForCausalLM | EagleDraft | MtpDraft | MedusaHeads


def load_draft(
    config: EngineConfig,
    target: LlamaForCausalLM,
    settings: LoadSettings,
    device: torch.device,
    max_model_len: int,
) -> Draft | None:
    """The draft model or heads `speculative_config` names (None: a model-free method)."""
    spec = config.speculative_config
    assert spec is not None
    if spec.method in MODEL_FREE_METHODS:
        return None
    if spec.method == "mtp":  # the target's own checkpoint unless told otherwise
        mtp_dir = spec.model or config.model
        assert mtp_dir is not None
        return load_mtp(mtp_dir, target, settings.dtype, device, spec.draft_weights)
    if spec.model is None:
        raise ConfigError(
            f"speculative_config method {spec.method} needs a model path (only the "
            "built-in demo target has a default draft and heads)"
        )
    if spec.method == "eagle":
        return load_eagle(spec.model, target, settings.dtype, device, spec.draft_weights)
    if spec.method == "medusa":
        return load_medusa(spec.model, target, settings.dtype, device)
    # A draft model runs eagerly (oneDNN linears unless asked otherwise) and unquantized.
    draft_settings = replace(settings, linear_backend=config.linear_backend, quantization=None)
    draft = load_model(spec.model, draft_settings, device)
    if draft.shape.vocab_size != target.shape.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.shape.vocab_size}) differs from the "
            f"target's ({target.shape.vocab_size}); they must share a tokenizer"
        )
    if draft.shape.max_position < max_model_len:
        raise ConfigError(
            f"the draft model's max_position_embeddings ({draft.shape.max_position}) is "
            f"shorter than max_model_len={max_model_len}"
        )
    return draft


def make_proposer(
    spec: SpeculativeConfig | None,
    draft: Draft | None,
    draft_spec: KVCacheSpec | None,
    num_blocks: int,
    device: torch.device,
) -> Proposer | None:
    """The proposer of the configured method over its draft (None: no speculation)."""
    if spec is None:
        return None
    if isinstance(draft, MedusaHeads):
        return MedusaProposer(draft)
    if isinstance(draft, EagleDraft | MtpDraft) and draft_spec is not None:
        return EagleProposer(draft, draft_spec, num_blocks, device)
    if draft is not None and draft_spec is not None:
        return DraftModelProposer(draft, draft_spec, num_blocks, device)
    if spec.method == "suffix":
        return SuffixDecodingProposer(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
        )
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
