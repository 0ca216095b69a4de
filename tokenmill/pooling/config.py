"""What a pooling model does with its last hidden states, read from its checkpoint directory:
a sentence-transformers directory (modules.json, the pooling module's config.json, a Normalize
module) or a plain Hugging Face directory (vLLM's defaults: CLS for encoders, last token for
decoders, normalized embeddings). Which task a checkpoint serves under `--task auto`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("cls", "mean", "last")
# sentence-transformers' pooling_mode (or its pooling_mode_*_token flags) -> ours.
_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last", "mean_tokens": "mean"}
_ST_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
TASKS = ("auto", "generate", "embed", "score")


class PoolingConfigError(ValueError):
    """A checkpoint's pooling files say something tokenmill cannot do, or are unreadable."""


@dataclass(frozen=True)
class PoolingConfig:
    """How hidden states become a request's output.

    `pooling_type`: which tokens' states are pooled (cls, mean, last). `normalize`: whether an
    embedding is scaled to unit length (a sentence-transformers Normalize module).
    `matryoshka_dimensions`: the widths an embedding may be cut to (`dimensions`); None when the
    checkpoint names none (then any width up to the full one is refused, as vLLM does, unless
    `is_matryoshka`). `score_activation`: sigmoid or none, applied to a one-label classifier's
    logit (sentence-transformers CrossEncoder's default is sigmoid)."""

    pooling_type: str
    normalize: bool
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    score_activation: str = "sigmoid"
    # A decoder reranker's (no, yes) token ids (Qwen3-Reranker): its score is
    # sigmoid(logit(yes) - logit(no)) at the pair's last token, P(yes) of the two.
    yes_no_tokens: tuple[int, int] | None = None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PoolingConfigError(f"{path} could not be read: {e}") from e


def is_sentence_transformers_dir(model_dir: str | Path) -> bool:
    return (Path(model_dir) / "modules.json").is_file()


def _module_types(model_dir: Path) -> dict[str, str]:
    """modules.json's module kinds (`Pooling`, `Normalize`, ...) -> their paths."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        raise PoolingConfigError(f"{model_dir / 'modules.json'} is not a list of modules")
    kinds: dict[str, str] = {}
    for module in modules:
        if isinstance(module, dict) and isinstance(module.get("type"), str):
            kinds[module["type"].rsplit(".", 1)[-1]] = str(module.get("path", ""))
    unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise PoolingConfigError(
            f"{model_dir / 'modules.json'} has modules tokenmill does not run: {sorted(unknown)} "
            "(it runs Transformer, Pooling and Normalize)"
        )
    return kinds


def _st_pooling_type(config: dict[str, Any], path: Path) -> str:
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        if mode not in _ST_MODES:
            raise PoolingConfigError(f"{path}: pooling_mode {mode!r} is unsupported")
        return _ST_MODES[mode]
    chosen = [ours for flag, ours in _ST_FLAGS.items() if config.get(flag)]
    others = [
        k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in _ST_FLAGS
    ]
    if len(chosen) != 1 or others:
        raise PoolingConfigError(
            f"{path}: exactly one of cls, mean or last-token pooling is supported, got "
            f"{sorted(k for k, v in config.items() if k.startswith('pooling_mode') and v)}"
        )
    return chosen[0]


def read_pooling_config(model_dir: str | Path, hf_config: Any, is_decoder: bool) -> PoolingConfig:
    """The checkpoint's pooling: from sentence-transformers' files where there are some, else
    vLLM's defaults for the model kind (CLS for an encoder, the last token for a decoder,
    normalized)."""
    path = Path(model_dir)
    matryoshka = getattr(hf_config, "matryoshka_dimensions", None)
    dims = tuple(int(d) for d in matryoshka) if isinstance(matryoshka, list) else None
    is_matryoshka = bool(getattr(hf_config, "is_matryoshka", False)) or dims is not None
    activation = _score_activation(path)
    if not is_sentence_transformers_dir(path):
        pooling = "last" if is_decoder else "cls"
        return PoolingConfig(pooling, True, is_matryoshka, dims, activation)
    kinds = _module_types(path)
    if "Pooling" not in kinds:  # a CrossEncoder's directory: the classifier does the pooling
        pooling = "last" if is_decoder else "cls"
        return PoolingConfig(pooling, "Normalize" in kinds, is_matryoshka, dims, activation)
    config_file = path / kinds["Pooling"] / "config.json"
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise PoolingConfigError(f"{config_file} is not a JSON object")
    return PoolingConfig(
        _st_pooling_type(config, config_file),
        "Normalize" in kinds,
        is_matryoshka,
        dims,
        activation,
    )


def _score_activation(path: Path) -> str:
    """A CrossEncoder's `activation_fn` (config_sentence_transformers.json, or config.json's
    `sentence_transformers` entry): Sigmoid, or Identity for raw logits."""
    names = []
    st_file = path / "config_sentence_transformers.json"
    if st_file.is_file():
        names.append(_read_json(st_file).get("activation_fn"))
    config_file = path / "config.json"
    if config_file.is_file():
        st_entry = _read_json(config_file).get("sentence_transformers")
        if isinstance(st_entry, dict):
            names.append(st_entry.get("activation_fn"))
    for name in names:
        if isinstance(name, str):
            return "none" if name.endswith("Identity") else "sigmoid"
    return "sigmoid"


def task_of_architecture(architecture: str, sentence_transformers_dir: bool) -> str:
    """`--task auto` for a checkpoint: `*ForSequenceClassification` scores, a bare `*Model`
    or a sentence-transformers directory embeds, anything else generates."""
    if architecture.endswith("ForSequenceClassification"):
        return "score"
    if architecture.endswith("Model") or sentence_transformers_dir:
        return "embed"
    return "generate"


def resolve_task(task: str, model_dir: str | Path | None) -> str:
    """The task a model serves: the one asked for, or under `auto` the checkpoint's."""
    if task not in TASKS:
        raise PoolingConfigError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    if model_dir is None:
        return "generate"
    path = Path(model_dir)
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        return "generate"  # a GGUF file, or the loader's own clear error
    raw = _read_json(config_file)
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    first = architectures[0] if isinstance(architectures, list) and architectures else ""
    return task_of_architecture(str(first), is_sentence_transformers_dir(path))
