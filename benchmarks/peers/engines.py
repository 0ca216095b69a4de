"""The engines benchmarks/peers compares, by the names `--engines` takes, and the weight
files each runs (converted or quantized once, then cached).

Float weights (no `--quantization`), the checkpoint as it is or as GGUF:
- `tokenmill`: tokenmill's defaults; `tokenmill-bf16`: dtype bfloat16; `tokenmill-base`: the
  defaults of another tokenmill tree (`--base-tree`, e.g. an export of the commit before a
  change);
- `vllm`: vLLM's CPU build, dtype bfloat16;
- `llamacpp-bf16`, `llamacpp-f32`: llama.cpp on the checkpoint converted to GGUF.

`--quantization q8_0|q4_k_m`: one GGUF file of that type (`llama-quantize` of the f32 file):
- `tokenmill` (and `tokenmill-base`): tokenmill loading that file (`LLM(model="x.gguf")`,
  the checkpoint's tokenizer directory beside it);
- `llamacpp`: llama.cpp reading the same file;
- `tokenmill-w8a8`, `vllm-w8a8`: both on one compressed-tensors W8A8 checkpoint (int8
  weights per channel, int8 activations per token) written from the float checkpoint by
  tokenmill's own writer (round to nearest), vLLM in bfloat16.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import REPO_ROOT
from tokenmill.bench.llamacpp import gguf_cache, gguf_file, peer_env, source_tree, working_flags

FLOAT_ENGINES = (
    "tokenmill", "tokenmill-bf16", "tokenmill-base", "vllm", "llamacpp-bf16", "llamacpp-f32",
)  # fmt: skip
QUANTIZED_ENGINES = ("tokenmill", "tokenmill-base", "llamacpp", "tokenmill-w8a8", "vllm-w8a8")
DEFAULT_ENGINES = {
    False: "tokenmill,tokenmill-bf16,vllm,llamacpp-bf16",
    True: "tokenmill,llamacpp",
}


@dataclass(frozen=True)
class Engine:
    name: str  # as given in --engines: the table's row
    runner: str  # "tokenmill", "vllm" or "llamacpp"
    weights: Path  # a Hugging Face checkpoint directory or a .gguf file
    dtype: str = "auto"  # tokenmill's or vLLM's compute dtype
    tree: Path | None = None  # tokenmill's source tree (None: this one)
    tokenizer: Path | None = None  # for a .gguf in tokenmill: the checkpoint's tokenizer
    flags: tuple[str, ...] = ()  # llama.cpp's, beyond its defaults
    note: str | None = None  # why it does not run with its defaults


def resolve_engines(args: argparse.Namespace) -> list[Engine]:
    """`args.engines` as Engines, preparing each one's weights (GGUF conversion,
    quantization, the W8A8 checkpoint) on first use."""
    names = args.engines.split(",")
    allowed = QUANTIZED_ENGINES if args.quantization else FLOAT_ENGINES
    unknown = [n for n in names if n not in allowed]
    if unknown:
        mode = f"--quantization {args.quantization}" if args.quantization else "float weights"
        raise SystemExit(f"unknown engines {unknown} with {mode}; choose from {list(allowed)}")
    if "tokenmill-base" in names and args.base_tree is None:
        raise SystemExit("tokenmill-base needs --base-tree DIR (another tokenmill source tree)")
    model = Path(args.model)
    return [_engine(name, model, args) for name in names]


def _engine(name: str, model: Path, args: argparse.Namespace) -> Engine:
    tree = args.base_tree if name == "tokenmill-base" else None
    if not args.quantization:
        if name.startswith("llamacpp-"):
            dtype = {"bf16": "bfloat16", "f32": "float32"}[name.removeprefix("llamacpp-")]
            return llamacpp_engine(name, gguf_file(model, llamacpp_tree(args), dtype), args)
        if name == "vllm":
            return Engine(name, "vllm", model, "bfloat16")
        dtype = "bfloat16" if name == "tokenmill-bf16" else "auto"
        return Engine(name, "tokenmill", model, dtype, tree)
    if name.endswith("-w8a8"):
        runner = name.removesuffix("-w8a8")
        dtype = "bfloat16" if runner == "vllm" else "auto"
        return Engine(name, runner, w8a8_checkpoint(model), dtype)
    gguf = gguf_file(model, llamacpp_tree(args), args.quantization)
    if name == "llamacpp":
        return llamacpp_engine(name, gguf, args)
    return Engine(name, "tokenmill", gguf, tree=tree, tokenizer=model)


def llamacpp_engine(name: str, gguf: Path, args: argparse.Namespace) -> Engine:
    flags, note = working_flags(args.llamacpp / "build" / "bin", gguf, args.threads)
    return Engine(name, "llamacpp", gguf, flags=flags, note=note)


def engine_env(engine: Engine) -> dict[str, str]:
    """The environment of an engine's process: the user's, without tokenmill's
    OMP_WAIT_POLICY (each engine keeps its own OpenMP default); tokenmill with its tree on
    PYTHONPATH, vLLM with a 4 GiB KV space unless VLLM_CPU_KVCACHE_SPACE says otherwise."""
    if engine.runner == "tokenmill":
        return tokenmill_env(engine.tree or REPO_ROOT)
    env = peer_env()
    env.pop("PYTHONPATH", None)
    if engine.runner == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def tokenmill_env(tree: Path = REPO_ROOT) -> dict[str, str]:
    """For a tokenmill process (an engine, or bench serve) of the source tree `tree`."""
    return {**peer_env(), "PYTHONPATH": str(tree)}


def llamacpp_tree(args: argparse.Namespace) -> Path:
    """The llama.cpp source tree of `--llamacpp`, checked to hold a build."""
    tree = source_tree(args.llamacpp)
    if not (tree / "build" / "bin" / "llama-batched-bench").is_file():
        raise SystemExit(f"no llama.cpp build in {tree}/build/bin (build_llamacpp.sh makes one)")
    return tree


def w8a8_checkpoint(model: Path) -> Path:
    """`model` as a compressed-tensors W8A8 checkpoint (made once, cached beside the GGUFs)."""
    out = gguf_cache().parent / f"{model.name}-ct-w8a8"
    if not out.is_dir():
        from tokenmill_testing.hf_quantized_checkpoints import save_quantized_checkpoint

        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            staged, reference = Path(tmp) / "w8a8", Path(tmp) / "reference"
            save_quantized_checkpoint(model, staged, reference, "ct-w8a8")
            shutil.move(staged, out)
    return out
