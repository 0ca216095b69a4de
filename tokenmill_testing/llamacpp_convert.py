"""Test checkpoints converted to GGUF by llama.cpp's own `convert_hf_to_gguf.py` (and
`llama-quantize`), from the llama.cpp tree at ~/.cache/tokenmill-anchors/llama.cpp; tests
skip where it is absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenmill.bench.llamacpp import _CONVERT, peer_env

LLAMACPP = Path.home() / ".cache" / "tokenmill-anchors" / "llama.cpp"
QUANTIZE = LLAMACPP / "build" / "bin" / "llama-quantize"


def llama_cpp_available() -> bool:
    return (LLAMACPP / "convert_hf_to_gguf.py").is_file()


def convert(
    checkpoint: Path, out: Path, outtype: str = "f32", extra_args: tuple[str, ...] = ()
) -> Path:
    """`checkpoint` as llama.cpp converts it (`outtype` f32, f16, bf16 or q8_0; `extra_args`
    more of the converter's flags, e.g. `--no-mtp`)."""
    command = [sys.executable, "-c", _CONVERT, str(LLAMACPP), str(checkpoint)]
    command += ["--outtype", outtype, "--outfile", str(out), *extra_args]
    run = subprocess.run(command, capture_output=True, text=True, env=peer_env(), timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {run.stderr[-2000:]}")
    return out


def quantize(source: Path, out: Path, qtype: str) -> Path:
    """`source` quantized by `llama-quantize` to `qtype` (e.g. Q8_0, Q4_K_M)."""
    command = [str(QUANTIZE), str(source), str(out), qtype]
    run = subprocess.run(command, capture_output=True, text=True, env=peer_env(), timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"llama-quantize failed: {run.stderr[-2000:]}")
    return out
