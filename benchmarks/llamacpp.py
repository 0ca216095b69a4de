"""llama.cpp for the benchmarks that compare against it: the same weights as GGUF, and a
`llama-server` process (vs_llamacpp.py, itl_under_prefill.py).

A llama.cpp build is a source tree (with `convert_hf_to_gguf.py` and `gguf-py`) whose binaries
lie somewhere below it, e.g. `build/bin`. llama.cpp runs in a child process with the caller's
environment; tokenmill's OMP_WAIT_POLICY must be gone from it by then (call
`tokenmill.openmp.forget_openmp_wait_policy` once torch is loaded), since it made llama.cpp
2-2.7x slower.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import repo_root  # noqa: F401 (tokenmill_testing/, demo_training/ on sys.path)

from tokenmill.bench.server_process import HOST, ServerProcess
from tokenmill_testing.random_checkpoint import cache_dir

GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}

# convert_hf_to_gguf.py refuses a BPE tokenizer whose pre-tokenizer it does not know (the
# random model's own small one) and tries sentencepiece first (not installed, and there is no
# tokenizer.model); the benchmarks feed random token ids, so the GGUF only needs some valid
# tokenizer entry: the BPE vocabulary with GPT-2's pre-tokenizer declared.
_CONVERT = """
import runpy, sys
source = sys.argv.pop(1)
sys.path[:0] = [source, source + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self):
    raise FileNotFoundError("tokenizer.model")
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
runpy.run_path(source + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def source_tree(bin_dir: Path) -> Path:
    """The llama.cpp source tree a build directory (e.g. `llama.cpp/build/bin`) lies in."""
    for directory in [bin_dir, *bin_dir.resolve().parents]:
        if (directory / "convert_hf_to_gguf.py").is_file():
            return directory
    raise FileNotFoundError(f"no llama.cpp source tree (convert_hf_to_gguf.py) above {bin_dir}")


def gguf_file(model: Path, llamacpp: Path, dtype: str) -> Path:
    """The model converted to GGUF in `dtype` by the llama.cpp source tree `llamacpp` (once;
    cached by model directory name under ~/.cache/tokenmill/gguf)."""
    out = cache_dir() / "gguf" / f"{model.name}-{GGUF_TYPES[dtype]}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        command = [sys.executable, "-c", _CONVERT, str(llamacpp), str(model)]
        command += ["--outtype", GGUF_TYPES[dtype], "--outfile", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-4000:]}")
        partial.rename(out)
    return out


class LlamaServerProcess(ServerProcess):
    """`with LlamaServerProcess(bin_dir, ["-m", gguf, ...], log) as server: server.base_url`;
    healthy once the model is loaded (`/health` answers 503 until then)."""

    name = "llama-server"

    def __init__(self, bin_dir: Path, server_args: list[str], log_path: str | Path) -> None:
        super().__init__(server_args, log_path)
        self.binary = bin_dir / "llama-server"

    @property
    def command(self) -> list[str]:
        return [str(self.binary), "--host", HOST, "--port", str(self.port), *self.server_args]
