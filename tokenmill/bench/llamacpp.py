"""llama.cpp for the benchmarks that compare against it: the same weights as GGUF, a
`llama-batched-bench` run, and a `llama-server` process (benchmarks/peers, tokenmill bench itl).

A llama.cpp build is a source tree (with `convert_hf_to_gguf.py` and `gguf-py`) whose binaries
lie somewhere below it, e.g. `build/bin` (../shared/anchors/build_llamacpp.sh makes one).
llama.cpp runs in a child process; tokenmill's OMP_WAIT_POLICY must not reach it (it made
llama.cpp 2-2.7x slower): pass `peer_env()` or call `tokenmill.openmp.forget_openmp_wait_policy`
once torch is loaded.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.server_process import HOST, ServerProcess

# GGUF types by the name vs_peers.py uses: converted from the checkpoint directly, or
# quantized by `llama-quantize` from the checkpoint's own precision (f32, or bf16 for a bf16
# checkpoint: lossless either way), llama.cpp's usual recipe.
CONVERTED = {"float32": "f32", "bfloat16": "bf16"}
QUANTIZED = {
    "q8_0": "Q8_0",
    "q6_k": "Q6_K",
    "q5_k_m": "Q5_K_M",
    "q4_k_m": "Q4_K_M",
    "q4_0": "Q4_0",
    "iq4_xs": "IQ4_XS",
    "iq4_nl": "IQ4_NL",
    "q3_k_m": "Q3_K_M",
    "q2_k": "Q2_K",
}

# convert_hf_to_gguf.py refuses a BPE tokenizer whose pre-tokenizer it does not know (the
# random model's own small one) and tries sentencepiece first (not installed, and there is no
# tokenizer.model); the benchmarks feed random token ids, so the GGUF only needs some valid
# tokenizer entry: the BPE vocabulary with GPT-2's pre-tokenizer declared. (So llama.cpp
# would split *text* differently from the checkpoint's tokenizer: send token ids.)
_CONVERT = """
import runpy, sys
source = sys.argv.pop(1)
sys.path[:0] = [source, source + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self):
    raise FileNotFoundError("tokenizer.model")
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
try:  # Phi-3's converter reads tokenizer.model unless the config names GPT-2's (Phi-4's) class
    from conversion import phi
    phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
except (ImportError, AttributeError):
    pass
runpy.run_path(source + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def peer_env(**extra: str) -> dict[str, str]:
    """This process's environment without OMP_WAIT_POLICY (which importing tokenmill sets for
    its own threads), plus `extra`: what a peer engine's process runs with."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return {**env, **extra}


def source_tree(bin_dir: Path) -> Path:
    """The llama.cpp source tree a build directory (e.g. `llama.cpp/build/bin`) lies in."""
    for directory in [bin_dir, *bin_dir.resolve().parents]:
        if (directory / "convert_hf_to_gguf.py").is_file():
            return directory
    raise FileNotFoundError(f"no llama.cpp source tree (convert_hf_to_gguf.py) above {bin_dir}")


def gguf_cache() -> Path:
    """Where converted files live: $TOKENMILL_CACHE/gguf, else ~/.cache/tokenmill/gguf."""
    return Path(os.environ.get("TOKENMILL_CACHE", "~/.cache/tokenmill")).expanduser() / "gguf"


def gguf_file(model: Path, llamacpp: Path, kind: str) -> Path:
    """`model` as GGUF of `kind` (a CONVERTED dtype name or a QUANTIZED type name), made
    once by the llama.cpp source tree `llamacpp` and cached by model directory name."""
    if kind in CONVERTED:
        out = gguf_cache() / f"{model.name}-{CONVERTED[kind]}.gguf"
        command = [sys.executable, "-c", _CONVERT, str(llamacpp), str(model)]
        command += ["--outtype", CONVERTED[kind], *_converter_flags(model), "--outfile"]
    elif kind in QUANTIZED:
        out = gguf_cache() / f"{model.name}-{kind}.gguf"
        source = gguf_file(model, llamacpp, _source_kind(model))
        command = [str(llamacpp / "build" / "bin" / "llama-quantize"), str(source)]
    else:
        raise ValueError(f"unknown GGUF kind {kind!r}; one of {[*CONVERTED, *QUANTIZED]}")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(f".partial{os.getpid()}")
        command = [*command, str(partial)]
        if kind in QUANTIZED:
            command.append(QUANTIZED[kind])
        result = subprocess.run(command, capture_output=True, text=True, env=peer_env())
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"{Path(command[0]).name} failed:\n{result.stderr[-4000:]}")
        partial.rename(out)
    return out


def _converter_flags(model: Path) -> list[str]:
    """Qwen3.5 checkpoints without MTP layers (the random ones): the converter asserts on
    them unless told `--no-mtp`."""
    config = json.loads((model / "config.json").read_text())
    return ["--no-mtp"] if "Qwen3_5ForCausalLM" in config.get("architectures", []) else []


def _source_kind(model: Path) -> str:
    """The float GGUF a quantized one is made from: the checkpoint's own dtype."""
    config = json.loads((model / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype")
    return "bfloat16" if dtype == "bfloat16" else "float32"


@dataclass
class BatchedBenchRun:
    """One `llama-batched-bench` run at one batch size."""

    output_tok_s: float  # B x gen_len over prefill + decode
    decode_steps_s: float  # decode steps per second (its TG phase; B tokens a step)
    peak_rss_bytes: int  # of the whole run: weights (mmapped), KV cache, buffers


class LlamaCrash(RuntimeError):
    """llama.cpp died of a signal (not an error it reported)."""


def batched_bench(
    bin_dir: Path,
    gguf: Path,
    batch: int,
    prompt_len: int,
    gen_len: int,
    threads: int,
    flags: tuple[str, ...] = (),
    attempts: int = 6,
) -> BatchedBenchRun:
    """`llama-batched-bench -npp P -ntg G -npl B -t THREADS [flags]`, llama.cpp's defaults
    otherwise, with a context of exactly B x (P + G). A run that exits 0 having printed
    no result (its warnings only) is run again, up to `attempts` times: with OpenMP's threads
    spinning (no OMP_WAIT_POLICY, its default) it lost its whole output, results included, in about
    half the runs of a tiny model (well under a second); never seen on the 135M model."""
    context = batch * (prompt_len + gen_len)
    command = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(context)]
    command += ["-t", str(threads), "-npp", str(prompt_len), "-ntg", str(gen_len)]
    command += ["-npl", str(batch), "--output-format", "jsonl", *flags]
    for _ in range(attempts):
        code, out, err, peak_rss = _run_measured(command)
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if code < 0:
            name = signal.Signals(-code).name
            raise LlamaCrash(f"llama-batched-bench died of {name}: {shlex.join(command)}\n{err}")
        if code != 0 or rows:
            break
    if code != 0 or not rows:
        raise RuntimeError(f"llama-batched-bench failed ({code}): {shlex.join(command)}\n{err}")
    return BatchedBenchRun(
        output_tok_s=batch * gen_len / rows[-1]["t"],
        decode_steps_s=rows[-1]["speed_tg"] / batch,
        peak_rss_bytes=peak_rss,
    )


def _run_measured(command: list[str]) -> tuple[int, str, str, int]:
    """(exit code or -signal, stdout, stderr's tail, peak resident bytes) of `command`."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=peer_env())
        try:
            _, status, usage = os.wait4(process.pid, 0)  # this child's own peak RSS
        except BaseException:
            process.kill()
            process.wait()
            raise
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return process.returncode, out.read(), err.read()[-2000:], usage.ru_maxrss * 1024


def working_flags(bin_dir: Path, gguf: Path, threads: int) -> tuple[tuple[str, ...], str | None]:
    """llama.cpp's defaults for `gguf`, or `--no-repack` if a tiny run with them dies of a
    signal: (flags, a note saying why, or what failed). Its AMX kernels (Q8_0, K-quants:
    weights repacked for AMX at load) died of SIGILL at their first tile instruction in a
    Firecracker VM whose CPU reports AMX; `--no-repack` keeps the weights as the file has
    them."""
    try:
        batched_bench(bin_dir, gguf, 1, 8, 8, threads)
        return (), None
    except LlamaCrash as crash:
        died = str(crash).splitlines()[0]
    except RuntimeError as error:
        return (), f"its 8 + 8-token probe failed: {str(error).splitlines()[0]}"
    try:
        batched_bench(bin_dir, gguf, 1, 8, 8, threads, ("--no-repack",))
    except RuntimeError as error:
        return (), f"{died}; with --no-repack: {str(error).splitlines()[0]}"
    return ("--no-repack",), f"ran with --no-repack: with its defaults {died}"


def whole_character_bias(model: Path) -> dict[str, int]:
    """A `logit_bias` that bans every token whose text alone is not whole UTF-8 characters.

    llama-server streams no chunk while a stream's text ends mid-character (it holds the
    bytes back until the character completes), and a random model's text often does: its
    tokens past the tokenizer's vocabulary have no text at all, so a lone lead byte is
    followed by many tokens that send nothing, a chunk that merges them all, or (a greedy
    loop) no chunk ever again. With these tokens banned, every token makes one chunk, for the
    cost of a ~165-entry bias list in the sampler. (tokenmill and vLLM send a chunk per token.)
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    partial = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    return {str(i): -100 for i in partial}


class LlamaServerProcess(ServerProcess):
    """`with LlamaServerProcess(bin_dir, ["-m", gguf, ...], log) as server: server.base_url`;
    healthy once the model is loaded (`/health` answers 503 until then)."""

    name = "llama-server"

    def __init__(self, bin_dir: Path, server_args: list[str], log_path: str | Path) -> None:
        super().__init__(server_args, log_path, env=peer_env())
        self.binary = bin_dir / "llama-server"

    @property
    def command(self) -> list[str]:
        return [str(self.binary), "--host", HOST, "--port", str(self.port), *self.server_args]
