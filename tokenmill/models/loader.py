"""Load a local Hugging Face checkpoint: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from tokenmill.config import ConfigError
from tokenmill.layers.linear import (
    Linear,
    WeightShapeError,
    check_shape,
    process_linears_after_loading,
    replace_linears,
)
from tokenmill.layers.parallel import SINGLE, TensorParallel
from tokenmill.models.config_checks import ModelLoadError, check_sizes, check_values, hf_sizing
from tokenmill.models.families import qwen3_5  # noqa: F401  (registers the hybrid families)
from tokenmill.models.family import Family
from tokenmill.models.freed_heap import return_freed_heap
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.llama_stack import build_decoder_stack
from tokenmill.models.mtp_names import own_tensor_shapes, without_mtp
from tokenmill.models.pipeline_split import WHOLE, PipelineStage, stage_holds
from tokenmill.models.registry import families, family_of, gguf_architectures, gguf_family
from tokenmill.models.safetensors_files import checkpoint_files, open_safetensors
from tokenmill.models.sharding import RankSlice, fused_part_sizes, rank_slice
from tokenmill.quantization.gguf_file import GGUFCheckpoint, is_gguf
from tokenmill.quantization.hf_quantized import detect as detect_quantized
from tokenmill.quantization.selection import LinearPlan, log_plan, use_quantized_embedding

# config.json `architectures` -> model class, from the families (models/families/).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    architecture: family.model_class or LlamaForCausalLM
    for family in families()
    for architecture in family.architectures
}

# Files that hold a tokenizer's vocabulary, in the formats transformers reads without extra
# packages (tokenizer.json) or with them (sentencepiece, tiktoken, BPE/WordPiece vocabularies).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# Checkpoint tensors stored fused in tokenmill: name pattern -> (fused name, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
# Reads a checkpoint tensor, or only the given slice of it.
TensorReader = Callable[[RankSlice | None], torch.Tensor]


def load_hf_config(model_dir: str | Path) -> tuple[Any, str]:
    """The checkpoint's transformers config and its (supported) architecture name, its sizes
    checked against each other and the tensors' shapes (`config_checks.py`) before anything
    is allocated from them."""
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist")
    if is_gguf(path):
        gguf = GGUFCheckpoint(path)
        family = _gguf_family(gguf)
        sizes = check_sizes(gguf.sizing_metadata(), gguf.tensor_shapes(), f"{path}'s metadata")
        config = gguf.hf_config(sizes)
        architecture = config.architectures[0]
        assert architecture in family.architectures, (architecture, family.name)
        return config, architecture
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory: no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file} could not be read: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} could not be read: not a JSON object")
    architecture = _supported_architecture(raw.get("architectures"), config_file)
    check_values(hf_sizing(raw), str(config_file))  # values transformers would choke on
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises several types for a bad config
        raise ModelLoadError(f"{config_file} could not be read: {e}") from e
    check_sizes(hf_sizing(hf_config), own_tensor_shapes(path, hf_config), str(config_file))
    return hf_config, architecture


def _gguf_family(gguf: GGUFCheckpoint) -> Family:
    """The registered family reading the GGUF file, or one line naming what the families read."""
    architecture, experts = gguf.architecture, gguf.expert_count
    family = gguf_family(architecture, experts > 0)
    if family is None:
        with_experts = f" with {architecture}.expert_count={experts}" if experts else ""
        raise ConfigError(
            f"unsupported GGUF architecture {architecture!r}{with_experts} (general.architecture)"
            f" in {gguf.path}; tokenmill reads GGUF files of: {', '.join(gguf_architectures())}"
        )
    return family


def _supported_architecture(architectures: Any, config_file: Path) -> str:
    listed = architectures if isinstance(architectures, list) else []
    supported = [a for a in listed if a in MODEL_REGISTRY]
    if not supported:
        raise ModelLoadError(
            f"unsupported architecture {architectures or '(none given)'} in {config_file}; "
            f"tokenmill supports {sorted(MODEL_REGISTRY)}"
        )
    return supported[0]


def load_tokenizer(tokenizer_dir: str | Path) -> PreTrainedTokenizerBase:
    """The directory's tokenizer; a one-line `ModelLoadError` when it has none or a broken one
    (transformers would suggest installing sentencepiece for a directory with no files)."""
    path = Path(tokenizer_dir)
    if is_gguf(path):
        return _gguf_tokenizer(path)
    has_vocabulary = any((path / name).is_file() for name in _TOKENIZER_FILES)
    if not has_vocabulary and not any(path.glob("*.tiktoken")):
        raise ModelLoadError(
            f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): copy them from "
            "the original checkpoint, or give --tokenizer DIR"
        )
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises several types, with multi-line messages
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {reason}") from e


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer in a GGUF file's metadata, which transformers reads (offline)."""
    if not GGUFCheckpoint(path).reader.tensors:  # a missing or truncated file: a clear error
        raise ModelLoadError(f"{path} holds no tensors")
    try:
        return AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
    except Exception as e:  # transformers raises several types, with multi-line messages
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"cannot read the tokenizer in {path}: {reason}; give --tokenizer DIR"
        ) from e


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype the checkpoint's config names, if any. transformers 4.56+ calls it `dtype`
    and warns on each read of `torch_dtype`, which only older versions need."""
    if hasattr(hf_config, "dtype"):
        dtype = hf_config.dtype
    else:
        dtype = getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def eos_token_ids(model_dir: str | Path, hf_config: Any) -> set[int]:
    """EOS ids from generation_config.json (which may list several), else from config.json."""
    if is_gguf(model_dir):
        eos = getattr(hf_config, "eos_token_id", None)
        return set() if eos is None else {eos}
    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


# generation_config.json fields that become default sampling parameters, as vLLM reads them.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# vLLM applies only the fields that differ from transformers' defaults. transformers 4 wrote
# `top_k: 50` into many files as its default, not as the model's wish; the other v4 defaults
# equal ours (temperature 1.0 etc.), so applying them changes nothing.
_TRANSFORMERS_V4_DEFAULTS = {"top_k": 50}


def sampling_defaults(config_dir: str | Path) -> dict[str, float]:
    """The sampling fields a generation_config.json sets explicitly (none when absent).

    Read as raw JSON: a `GenerationConfig` object fills in transformers' own defaults, which
    would override ours with values the model never asked for.
    """
    path = Path(config_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    defaults = {
        k: config[k]
        for k in SAMPLING_DEFAULT_FIELDS
        if config.get(k) is not None and config[k] != _TRANSFORMERS_V4_DEFAULTS.get(k)
    }
    if config.get("max_new_tokens") is not None:  # a cap for requests that set none
        defaults["max_tokens"] = config["max_new_tokens"]
    return defaults


@dataclass(frozen=True)
class LoadSettings:
    """How a checkpoint becomes a model in this engine, decided once (engine/assembly.py) and
    used for the target on every tensor-parallel rank and for a draft model."""

    dtype: torch.dtype  # the compute dtype
    linear_backend: str = "auto"  # EngineConfig.linear_backend (or "torch" for a captured step)
    attention_backend: str = "torch"  # resolved: torch, cpu or triton (attention/selector.py)
    quantization: str | None = None  # EngineConfig.quantization: int8, int4, int4-g128
    # The longest sequence served: the RoPE tables cover it (None: max_position_embeddings).
    max_model_len: int | None = None


def load_model(
    model_dir: str | Path,
    settings: LoadSettings,
    device: torch.device,
    tp: TensorParallel = SINGLE,
    stage: PipelineStage = WHOLE,
) -> LlamaForCausalLM:
    """The model, or under tensor parallelism this rank's shard of it (`tp`): the one way a
    model is loaded. Its attention layers get `settings.attention_backend` when built; each
    linear's method (how its weight is stored and multiplied) is chosen before the weights
    load (`quantization/selection.py`) and converted after."""
    hf_config, architecture = load_hf_config(model_dir)
    dtype, quantization = settings.dtype, settings.quantization
    staged = {"stage": stage} if stage.size > 1 else {}  # pipeline parallelism: its layers only
    args = (hf_config, architecture, dtype, tp, settings.attention_backend, settings.max_model_len)
    with torch.device(device):
        model = MODEL_REGISTRY[architecture](*args, **staged)
    model.to(dtype=dtype)
    plan = LinearPlan.online(dtype, device, settings.linear_backend, quantization, tp.size > 1)
    tensors = _checkpoint_tensors(Path(model_dir), model, plan, hf_config, quantization)
    linears = replace_linears(model, plan.choose)
    linears.update(use_quantized_embedding(model, plan))
    load_weights(model, tensors, linears, Path(model_dir))
    _load_tied_quantized_head(model)
    after_loading = getattr(model, "after_loading", None)
    if after_loading is not None:  # a model's own step on its loaded weights (hybrid.py)
        after_loading()  # before the linears are processed: it may merge some
    process_linears_after_loading(model)
    model.eval().requires_grad_(False)
    log_plan(plan, model)
    if settings.attention_backend == "cpu":
        model.decoder_stack = build_decoder_stack(model)
    return_freed_heap()
    return model


def _checkpoint_tensors(
    path: Path,
    model: LlamaForCausalLM,
    plan: LinearPlan,
    hf_config: Any,
    quantization: str | None,
) -> Iterator[tuple[str, TensorReader]]:
    """The checkpoint's tensors; for a pre-quantized one (a GGUF file, a quantization_config)
    also its linears' formats, into `plan`."""
    scheme = None if is_gguf(path) else detect_quantized(hf_config)
    if scheme is None and not is_gguf(path):
        return _family_tensors(_iter_checkpoint_tensors(path), model, hf_config)
    kind = "a GGUF file" if scheme is None else f"a {scheme.method} checkpoint"
    if quantization is not None:
        raise ConfigError(
            f"--quantization {quantization} is for float checkpoints; {path} is {kind}, "
            "whose own quantization is used"
        )
    if model.tp.size > 1 or getattr(model, "stage", WHOLE).size > 1:
        raise ConfigError(f"{kind} loads on one rank for now: no tensor or pipeline parallelism")
    if scheme is not None:
        plan.default = scheme.weight_format
        return scheme.gather(_family_tensors(_iter_checkpoint_tensors(path), model, hf_config))
    gguf = GGUFCheckpoint(path)
    plan.formats = gguf.linear_formats()
    return gguf.iter_tensors(plan.formats, model.shape.num_heads, model.shape.num_kv_heads)


def _family_tensors(
    tensors: Iterator[tuple[str, TensorReader]], model: LlamaForCausalLM, hf_config: Any
) -> Iterator[tuple[str, TensorReader]]:
    """The checkpoint's tensors as the shared loader reads them: a family that stores some
    differently (Phi-3's fused q/k/v) splits them here; MTP layers are an MTP draft's."""
    split = family_of(model.architecture).split_tensor
    if split is None:
        return without_mtp(tensors, hf_config)
    return (p for n, r in without_mtp(tensors, hf_config) for p in split(n, r, hf_config))


def load_weights(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, TensorReader]],
    linears: dict[str, Linear] | None = None,
    model_dir: Path | None = None,
) -> None:
    """Copy the checkpoint's tensors into the model: parameters directly, the weights of
    linears that hold their own storage (quantized ones) through their method."""
    params = dict(model.named_parameters())
    quantized = {
        f"{name}.weight": layer
        for name, layer in (linears or {}).items()
        if not layer.quant_method.holds_float_weight
    }
    loaded: set[tuple[str, int | None]] = set()
    for name, read in tensors:
        if _is_ignored(name, model):
            continue
        target, shard = _param_target(name)
        if target in quantized:
            _load_into_linear(model, quantized[target], target, shard, read, name)
        elif target in params:
            tensor = _as_float(read(rank_slice(model, target, shard)))
            _copy_into(model, params[target], target, shard, tensor, name)
        else:
            raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint at {model_dir}")
        loaded.add((target, shard))
    expected = _expected_parts([*params, *quantized])
    # A fused tensor a file stores whole (a Phi-3 GGUF's attn_qkv) loads every part at once.
    missing = {
        target
        for target, shard in expected
        if (target, shard) not in loaded and (target, None) not in loaded
    }
    if model.shape.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ModelLoadError(f"the checkpoint at {model_dir} lacks tensors for {sorted(missing)}")


def _load_tied_quantized_head(model: LlamaForCausalLM) -> None:
    """A quantized LM head tied to a float embedding (an embedding that could not be a lookup
    into the head's rows) is quantized from the embedding's weight."""
    head = model.lm_head
    embedding = getattr(model.embed_tokens, "weight", None)
    tied = model.shape.tie_word_embeddings and isinstance(head, Linear)
    if tied and embedding is not None and not head.quant_method.holds_float_weight:
        head.quant_method.load_weight(head, embedding.detach(), 0)


def _load_into_linear(
    model: LlamaForCausalLM,
    layer: Linear,
    target: str,
    shard: int | None,
    read: TensorReader,
    name: str,
) -> None:
    sizes = [layer.out_features] if shard is None else fused_part_sizes(model, target)
    part = 0 if shard is None else shard
    tensor = read(rank_slice(model, target, shard))
    expected = (sizes[part], layer.in_features)
    try:
        check_shape(tensor.shape, expected)
        layer.quant_method.load_weight(layer, tensor, sum(sizes[:part]))
    except WeightShapeError as e:
        raise ModelLoadError(f"tensor {name!r} has {e}") from e


def _as_float(tensor: Any) -> torch.Tensor:
    """A quantized tensor (an LM head a checkpoint quantized) for a float parameter."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()


def _expected_parts(targets: list[str]) -> Iterator[tuple[str, int | None]]:
    for target in targets:
        if ".qkv_proj." in target:
            yield from ((target, shard) for shard in range(3))
        elif ".gate_up_proj." in target:
            yield from ((target, shard) for shard in range(2))
        else:
            yield target, None


def _iter_checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, TensorReader]]:
    for path in checkpoint_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
                yield name, _reader(f, name)


def _reader(f: Any, name: str) -> TensorReader:
    def read(part: RankSlice | None) -> torch.Tensor:
        if part is None:
            return f.get_tensor(name)
        index = (slice(None),) * part.dim + (slice(part.start, part.start + part.length),)
        return f.get_slice(name)[index]

    return read


def _is_ignored(name: str, model: LlamaForCausalLM) -> bool:
    if "rotary_emb.inv_freq" in name:
        return True
    if not stage_holds(model, name):
        return True  # another pipeline stage's
    if model.tp.rank > 0 and name.endswith((".o_proj.bias", ".down_proj.bias")):
        return True  # row-parallel biases live on rank 0 (added once, after the all-reduce)
    return name == "lm_head.weight" and model.shape.tie_word_embeddings


def _param_target(name: str) -> tuple[str, int | None]:
    """Checkpoint name -> (tokenmill parameter name, shard of a fused parameter or None)."""
    name = name.removeprefix("model.")
    match = _FUSED_NAME.search(name)
    if match is None:
        return name, None
    fused, shard = _FUSED[match.group(1)]
    return name.replace(f".{match.group(1)}.", f".{fused}."), shard


def _copy_into(
    model: LlamaForCausalLM,
    param: torch.nn.Parameter,
    target: str,
    shard: int | None,
    tensor: torch.Tensor,
    name: str,
) -> None:
    if shard is None:
        destination = param.data
    else:
        sizes = fused_part_sizes(model, target)
        destination = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
    if model.tp.size > 1 and target in ("embed_tokens.weight", "lm_head.weight"):
        destination.zero_()  # the last rank's rows past the vocabulary are padding
        destination = destination.narrow(0, 0, min(tensor.shape[0], destination.shape[0]))
    if destination.shape != tensor.shape:
        raise ModelLoadError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(destination.shape)}"
        )
    destination.copy_(tensor)
