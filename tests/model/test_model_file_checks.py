"""Absurd or malformed model files: one line naming what is wrong, before anything is
allocated from the bad value; and a config that claims absurdly many positions serves with
memory for the positions served (issue 40)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.assembly import DEFAULT_MAX_MODEL_LEN_CAP, _max_model_len
from tokenmill.models.loader import checkpoint_dtype, load_hf_config
from tokenmill_testing.gguf_checkpoint import save_gguf

HUGE = 2**31 - 1
# (format, config.json key -> value, what the error must name). The GGUF files are the same
# checkpoint with only the metadata changed (save_gguf writes each value as llama.cpp names it).
MALFORMED = [
    ("hf", {"num_hidden_layers": HUGE}, "num_hidden_layers is 2147483647"),
    ("hf", {"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ("hf", {"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_"),
    ("hf", {"vocab_size": 5000}, "vocab_size is 5000"),
    ("hf", {"hidden_size": 96}, "hidden_size is 96"),
    ("hf", {"head_dim": 7}, r"head_dim=7\) must be even"),
    ("hf", {"intermediate_size": 10**12}, "intermediate_size is 1000000000000"),
    ("hf", {"vocab_size": -1}, "vocab_size must be a positive integer, got -1"),
    ("gguf", {"num_hidden_layers": HUGE}, "llama.block_count is 2147483647"),
    ("gguf", {"intermediate_size": 2**31}, "llama.feed_forward_length is 2147483648"),
    ("gguf", {"intermediate_size": 10**12}, "llama.feed_forward_length is 1000000000000"),
    ("gguf", {"vocab_size": 2**31}, "llama.vocab_size is 2147483648"),
    ("gguf", {"vocab_size": -1}, "llama.vocab_size must be a positive integer, got -1"),
    ("gguf", {"hidden_size": 2**31}, "llama.embedding_length is 2147483648"),
    ("gguf", {"num_attention_heads": 0}, "llama.attention.head_count must be a positive"),
    ("gguf", {"num_key_value_heads": 3}, "head_count=4 is not a multiple of llama.attention."),
    ("gguf", {"head_dim": 24}, r"head_count x llama.attention.key_length is 4 x 24"),
]
# Loads every file in one fresh process, under an address-space limit (a load that still
# allocates from the bad value fails there instead of taking the machine's memory), and
# prints each error and the process's peak RSS growth over a good checkpoint's load.
_LOAD_ALL = """
import json, resource, sys, time
from tokenmill import LLM
from tokenmill.models.loader import load_hf_config

good, cases = sys.argv[1], json.loads(sys.argv[2])
load_hf_config(good)  # imports what every load imports
def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
limit = vm_bytes() + 2 * 1024**3
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
results = []
for path in cases:
    start = time.perf_counter()
    try:
        LLM(model=path, max_model_len=64)
        error = None
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
    results.append({"error": error, "seconds": time.perf_counter() - start})
growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"results": results, "rss_growth_kib": growth}))
"""


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


def malformed_copy(checkpoint: Path, fmt: str, overrides: dict, destination: Path) -> Path:
    if fmt == "gguf":
        return save_gguf(checkpoint, destination.with_suffix(".gguf"), config_overrides=overrides)
    shutil.copytree(checkpoint, destination)
    config = json.loads((destination / "config.json").read_text())
    (destination / "config.json").write_text(json.dumps({**config, **overrides}))
    return destination


def test_malformed_sizes_are_one_line_naming_the_key_before_any_allocation(
    checkpoint, tmp_path: Path
) -> None:
    paths = [
        str(malformed_copy(checkpoint, fmt, overrides, tmp_path / f"case{i}"))
        for i, (fmt, overrides, _) in enumerate(MALFORMED)
    ]
    run = subprocess.run(
        [sys.executable, "-c", _LOAD_ALL, str(checkpoint), json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for (fmt, overrides, expected), result in zip(MALFORMED, report["results"], strict=True):
        error = result["error"]
        assert error is not None and error.startswith(("ModelLoadError", "ConfigError")), (
            fmt,
            overrides,
            error,
        )
        assert "\n" not in error
        assert re.search(expected, error), (fmt, overrides, error)
        assert result["seconds"] < 10, (fmt, overrides, result)
    assert report["rss_growth_kib"] < 64 * 1024, report


def test_a_config_claiming_2_31_positions_serves_with_tables_for_max_model_len(
    checkpoint, tmp_path: Path
) -> None:
    model_dir = malformed_copy(checkpoint, "hf", {"max_position_embeddings": HUGE}, tmp_path / "m")
    llm = LLM(model=str(model_dir), max_model_len=2048, dtype="float32")
    rotary = llm.engine.runner.model.rotary
    assert rotary.cos.shape[0] == rotary.signed_sin.shape[0] == 2048
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    output = llm.generate([[5, 9, 13]], params, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 4


def test_the_default_max_model_len_follows_the_config_up_to_a_cap(caplog) -> None:
    config = EngineConfig(model="unused")
    assert _max_model_len(config, 32768) == 32768  # as vLLM: the config's value
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine.assembly"):
        assert _max_model_len(config, HUGE) == DEFAULT_MAX_MODEL_LEN_CAP
    assert "--max-model-len" in caplog.text
    assert _max_model_len(EngineConfig(model="unused", max_model_len=2048), HUGE) == 2048


def test_an_expert_count_without_experts_is_named(checkpoint, tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as `llama` with an expert count and a router per layer; a
    count without the tensors is named, not read as a dense model."""
    path = save_gguf(checkpoint, tmp_path / "m.gguf", config_overrides={"num_local_experts": 8})
    with pytest.raises(ConfigError, match=r"llama.expert_count=8 but no router tensor"):
        load_hf_config(path)


def test_bad_gguf_headers_say_what_the_file_is(checkpoint, tmp_path: Path) -> None:
    data = save_gguf(checkpoint, tmp_path / "good.gguf", Q.Q8_0).read_bytes()
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ConfigError, match=r"is not a GGUF file: it starts with b'GGML'"):
        load_hf_config(bad_magic)
    bad_version = tmp_path / "version.gguf"
    bad_version.write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    with pytest.raises(ConfigError, match=r"GGUF version 7 is not supported \(only 2, 3\)"):
        load_hf_config(bad_version)


@pytest.mark.parametrize(("kept", "part"), [(0.5, "tensor data"), (0.002, "metadata")])
def test_a_truncated_gguf_gives_its_sizes(checkpoint, tmp_path: Path, kept, part) -> None:
    data = save_gguf(checkpoint, tmp_path / "good.gguf", Q.Q8_0).read_bytes()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[: int(len(data) * kept)])
    with pytest.raises(ConfigError) as error:
        load_hf_config(truncated)
    message = str(error.value)
    assert f"is truncated: it is {int(len(data) * kept):,} bytes, but its {part}" in message
    assert "fetch it again" in message and "\n" not in message
    if part == "tensor data":
        assert f"needs at least {len(data):,}" in message


@pytest.mark.parametrize("name", ["missing", "missing.gguf"])
def test_a_missing_path_says_it_does_not_exist(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name} does not exist$"):
        LLM(model=str(tmp_path / name))


def test_a_gguf_load_reads_no_deprecated_config_key(checkpoint, tmp_path: Path) -> None:
    """transformers warns on each read of `torch_dtype` (printed on every GGUF load)."""
    path = save_gguf(checkpoint, tmp_path / "m.gguf", Q.Q8_0)
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = warnings.append  # type: ignore[method-assign]
    transformers_logger = logging.getLogger("transformers")  # its loggers' root
    transformers_logger.addHandler(handler)
    try:
        hf_config, _ = load_hf_config(path)
        assert checkpoint_dtype(hf_config) is None
    finally:
        transformers_logger.removeHandler(handler)
    assert not [r.getMessage() for r in warnings if "torch_dtype" in r.getMessage()]
