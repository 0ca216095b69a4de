"""Random-weight Llama checkpoints in the shapes benchmarks run (`tokenmill bench make-model`).

A benchmark of the engine's speed needs a model of a real model's shape, not its weights: no
download, the same files every time. Presets:
- `bench`: a 79M Llama (hidden 768, 12 layers, 12 / 4 heads): big enough that the forward
  pass, not HTTP streaming, dominates serving on a CPU; small enough to serve on two cores.
- `smollm`: HuggingFaceTB/SmolLM2-135M's shape (hidden 576, 30 layers, 9 / 3 heads, MLP 1536,
  vocabulary 49152, tied embeddings, RoPE theta 100000).
- `qwen3-moe`: Qwen3-30B-A3B's ratios scaled to one CPU (hidden 2048, 32 / 4 heads of 128,
  64 experts of width 768, 8 active, 6 layers, vocabulary 49152): 1.98B parameters, 0.35B
  active per token, saved in bfloat16 (4 GB); a Qwen3-MoE checkpoint (`architecture`).
- `1b`: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 / 8 heads, MLP 8192, vocabulary 49152,
  tied), saved in bfloat16 (2.5 GB); its widths are multiples of 256, so `llama-quantize`
  writes real K-quant blocks.
- `qwen35-0.8b`: Qwen3.5-0.8B's text shape (hidden 1024, 24 layers, three gated DeltaNet layers
  of 16 / 16 heads of 128 to one gated full-attention layer of 8 / 2 heads of 256, MLP 3584,
  its 248320-token vocabulary, tied, a quarter of each head rotated), saved in bfloat16; a
  `Qwen3_5ForCausalLM` checkpoint (llama.cpp converts it as `qwen35` with `--no-mtp`).
- `gemma3-1b`: Gemma-3-1B's shape (hidden 1152, 26 layers, 4 / 1 heads of 256, MLP 6912, every
  sixth layer global, the others within 512 tokens, tied), its 262144-token vocabulary cut to
  the demo tokenizer's 2048 (llama.cpp's Gemma 3 converter keeps only the tokenizer's rows, so
  both engines read the same LM head), saved in bfloat16.

The tokenizer is the demo model's (2048 tokens); token ids above it are valid inputs for the
larger vocabularies (benchmarks feed token ids). Weights are spread so that logits are not
near-uniform (greedy outputs without argmax ties: engines can be compared token for token).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LOGIT_STD = 4.0  # the spread weights' logits: std about this
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Preset:
    name: str  # the cache directory's name: bump its version when changing the recipe
    # Config fields (LlamaConfig's unless `architecture` names another; `config_class` where
    # its name is not the architecture's), `dtype` by name.
    shape: dict[str, Any] = field(default_factory=dict)

    def model_dir(self) -> Path:
        """The model's directory in the cache, built on first use."""
        return make_random_model(self.name, self.shape)


PRESETS = {
    "bench": Preset(
        "bench-random-llama-79m-v2",
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=2048,
        ),
    ),
    "smollm": Preset(
        "bench-smollm2-135m-shaped-v2",
        dict(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            tie_word_embeddings=True,
            rope_theta=100000.0,
        ),
    ),
    "1b": Preset(
        "bench-llama-1b-shaped-v2",
        dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=49152,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            dtype="bfloat16",
        ),
    ),
    # Llama-3.2-3B's shape (its 128256-token vocabulary cut to the demo tokenizer's 49152, as
    # the 1B preset's): widths multiples of 256, so llama-quantize writes real K-quants.
    "3b": Preset(
        "bench-llama-3b-shaped-v1",
        dict(
            hidden_size=3072,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=49152,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            dtype="bfloat16",
        ),
    ),
    "gemma3-1b": Preset(
        "bench-gemma3-1b-shaped-v1",
        dict(
            architecture="Gemma3ForCausalLM",
            config_class="Gemma3TextConfig",
            hidden_size=1152,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=6912,
            sliding_window=512,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
            ],
            query_pre_attn_scalar=256,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            tie_word_embeddings=True,
            dtype="bfloat16",
        ),
    ),
    # Phi-4-mini's shape (3.8B: fused qkv and gate_up, 3/4 of each head rotated; its 200k
    # vocabulary cut to the demo tokenizer's, as the 1B preset's).
    "phi4-mini": Preset(
        "bench-phi4-mini-shaped-v1",
        dict(
            architecture="Phi3ForCausalLM",
            hidden_size=3072,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=49152,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
            },
            dtype="bfloat16",
        ),
    ),
    "qwen35-0.8b": Preset(
        "bench-qwen35-0.8b-shaped-v1",
        dict(
            architecture="Qwen3_5ForCausalLM",
            config_class="Qwen3_5TextConfig",
            hidden_size=1024,
            num_hidden_layers=24,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)
            ],
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            intermediate_size=3584,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            vocab_size=248320,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
            },
            dtype="bfloat16",
        ),
    ),
    "qwen3-moe": Preset(
        "bench-qwen3-30b-a3b-ratio-moe-v1",
        dict(
            architecture="Qwen3MoeForCausalLM",
            hidden_size=2048,
            num_hidden_layers=6,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            num_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            vocab_size=49152,
            rope_theta=1000000.0,
            dtype="bfloat16",
        ),
    ),
}


def cache_dir() -> Path:
    """Where built models live: $TOKENMILL_CACHE, else ~/.cache/tokenmill."""
    return Path(os.environ.get("TOKENMILL_CACHE", "~/.cache/tokenmill")).expanduser()


def make_random_model(name: str, shape: dict[str, Any], out: Path | None = None) -> Path:
    """A random Llama of `shape` at `out` (default: the cache directory under `name`), built
    once: an existing checkpoint there is returned as it is."""
    final = Path(out) if out is not None else cache_dir() / name
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _write_checkpoint(tmp, dict(shape))
        if final.exists():
            final.rmdir()  # an empty directory given as `out`
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_checkpoint(directory: Path, shape: dict[str, Any]) -> None:
    import torch
    import transformers

    from tokenmill.demo import demo_model_path

    demo = demo_model_path("target")
    for file_name in _TOKENIZER_FILES:
        shutil.copyfile(demo / file_name, directory / file_name)
    demo_config = json.loads((demo / "config.json").read_text())
    tokens = {k: demo_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    dtype = shape.pop("dtype", "float32")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # a name, or a dtype
    architecture = shape.pop("architecture", "LlamaForCausalLM")
    shape.setdefault("vocab_size", demo_config["vocab_size"])
    shape.setdefault("max_position_embeddings", 2048)
    theta = shape.pop("rope_theta", 1e4)
    shape.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    config_name = shape.pop("config_class", architecture.replace("ForCausalLM", "Config"))
    config_class = getattr(transformers, config_name)
    config = config_class(**tokens, **shape)
    config.architectures = [architecture]
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)  # built in its dtype: a 2B model in float32 is 8 GB
        try:
            model = getattr(transformers, architecture)(config)
        finally:
            torch.set_default_dtype(default_dtype)
    spread_weights(model, 0, config.tie_word_embeddings)
    with no_progress_bars():
        model.to(dtype).eval().save_pretrained(str(directory))
        transformers.GenerationConfig(**tokens).save_pretrained(str(directory))


def spread_weights(model: torch.nn.Module, seed: int, tied: bool) -> None:
    """Re-initialise every parameter so the random model's logits are well spread.

    Hugging Face's default init (std 0.02) gives near-uniform logits, where greedy argmax ties
    make engine-vs-reference comparisons flaky. Linears get std 1/sqrt(fan_in) (activations
    keep unit scale), embeddings std 1, norms ~1 with noise, biases nonzero, and the LM head
    is scaled so the logits' std is about LOGIT_STD.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                std = LOGIT_STD / math.sqrt(hidden) if tied else 1.0
                value = noise * std
            elif name.endswith("lm_head.weight"):
                value = noise * (LOGIT_STD / math.sqrt(hidden))
            elif param.ndim == 1 and name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith((".A_log", ".dt_bias")):  # gated DeltaNet's decay (Qwen3.5)
                value = 0.5 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            elif name.endswith(".sinks"):  # gpt-oss's per-head attention-sink logits
                value = noise
            elif param.ndim in (2, 3):  # a linear, or a stack of experts' linears
                value = noise / math.sqrt(param.shape[-1])
            else:
                raise ValueError(f"no init rule for parameter {name} {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Silence transformers' "Writing model shards" bars (noise in CLI output and test logs)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def add_make_model_args(parser: Any) -> None:
    parser.add_argument("--preset", choices=PRESETS, default="bench", help="the model's shape")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"directory to write (default: {cache_dir()}/<the preset's name>)",
    )


def run_make_model(args: Any) -> int:
    preset = PRESETS[args.preset]
    print(make_random_model(preset.name, preset.shape, args.output))
    return 0
