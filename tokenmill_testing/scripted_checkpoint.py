"""A checkpoint whose greedy reply to any chat prompt is a given text: a model that writes what
a test needs (a `<think>` block, say) without training one.

It is a bigram model in Llama's shape: each layer's attention and MLP write nothing to the
residual stream (their output projections are zero), so the final hidden state is the
current token's embedding and the LM head alone picks the next token. Its rows are set so
that after the chat template's last token comes the reply's first, then each reply token's
successor, then `<|im_end|>`. A grammar may still steer it anywhere: masked tokens are
skipped and the argmax of the rest is taken.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from tokenmill.bench.random_model import no_progress_bars
from tokenmill.demo.special_tokens import EOS_TOKEN, IM_END_TOKEN

_HIDDEN = 64
_SCRIPT_LOGIT = 12.0  # a scripted successor's logit; other tokens' are ~N(0, 1)
# (rows ~N(0, 1/hidden) against the final RMS-normed state, whose norm is sqrt(hidden))


def save_scripted_checkpoint(
    save_dir: str | Path,
    reply: str,
    tokenizer_dir: str | Path,
    added_tokens: Sequence[str] = (),
    seed: int = 0,
) -> Path:
    """Write a Llama checkpoint (the tokenizer of `tokenizer_dir` plus `added_tokens`, as
    Qwen3 adds `<think>` and `</think>`) that greedily answers every chat with `reply`.
    The reply's tokens must be distinct, and differ from the prompt's last token."""
    save_dir = Path(save_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    end_id = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    script = [
        tokenizer.encode(prompt, add_special_tokens=False)[-1],
        *tokenizer.encode(reply, add_special_tokens=False),
        end_id,
    ]
    if len(set(script)) != len(script):
        raise ValueError(f"a bigram model cannot write {reply!r}: a token repeats in {script}")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=_HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=_HIDDEN,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()  # the layer adds nothing: the state stays the token's embedding
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                fan_in = 1 if "embed" in name else param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
        embeddings = model.model.embed_tokens.weight
        head = model.lm_head.weight
        for current, following in itertools.pairwise(script):
            direction = embeddings[current] / embeddings[current].norm()
            head[following] = direction * (_SCRIPT_LOGIT / math.sqrt(_HIDDEN))
    with no_progress_bars():
        model.save_pretrained(str(save_dir))
    tokenizer.save_pretrained(str(save_dir), save_jinja_files=False)
    transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[end_id, tokenizer.convert_tokens_to_ids(EOS_TOKEN)],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(save_dir))
    return save_dir
