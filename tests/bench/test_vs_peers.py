"""benchmarks/peers at tiny sizes, so that the harness does not rot: tokenmill's offline
and online runs end to end on a tiny random checkpoint, the tables' arithmetic on canned
results, the machine probes, the peers' command lines; llama.cpp's runs where it is built
(skipped otherwise). vLLM is checked by its command line only: it takes minutes to start."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from benchmarks.peers import machine as peers_machine
from benchmarks.peers import vs_peers
from benchmarks.peers import worker as peers_worker
from benchmarks.peers.engines import Engine, engine_env, resolve_engines
from benchmarks.peers.offline import OfflineResult
from benchmarks.peers.online import engine_server
from tokenmill.bench import llamacpp

LLAMACPP = Path.home() / ".cache" / "tokenmill-anchors" / "llama.cpp"
NUMBER = r"\d+\.\d"


def row(text: str, *first_cells: str) -> list[str]:
    """The cells of the table row that starts with `first_cells`."""
    start = "| " + " | ".join(first_cells) + " |"
    lines = [line for line in text.splitlines() if line.startswith(start)]
    assert len(lines) == 1, f"no single row {start!r} in:\n{text}"
    return [c.strip() for c in lines[0].strip("|").split("|")]


def test_offline_tokenmill_runs_each_batch_and_decodes_at_a_measured_share_of_the_roof(
    tiny_checkpoint, monkeypatch
) -> None:
    checkpoint = tiny_checkpoint("llama")
    monkeypatch.setattr(vs_peers, "read_bandwidth_gbs", lambda: 10.0)  # probed on its own below
    text = vs_peers.main(["--engines", "tokenmill", "--model", str(checkpoint),
                          "--batches", "1,3", "--prompt-len", "5", "--gen-len", "32",
                          "--rounds", "1"])  # fmt: skip
    assert "family" in text and "UTC" in text and "--batches 1,3" in text  # lscpu, date, command
    rates, roofline = text.split("Roofline")
    cells = row(rates, "tokenmill")
    assert all(re.fullmatch(NUMBER, c) and float(c) > 0 for c in cells[1:3]), cells
    roof = row(roofline, "tokenmill")
    assert re.fullmatch(NUMBER, roof[2]) and roof[4].endswith("%")
    # weights a step: the checkpoint at the engine's float width (2 or 4 bytes), in MB
    step = {round(peers_machine.step_bytes(checkpoint, n) / 1e6): n for n in (2, 4)}
    step_bytes = peers_machine.step_bytes(checkpoint, step[int(roof[1])])
    assert float(roof[3]) == pytest.approx(step_bytes * float(roof[2]) / 1e9, abs=0.06)
    assert "Failures" not in text


def test_online_tokenmill_serves_one_token_a_chunk_at_the_concurrency_and_leaves_no_server(
    tiny_checkpoint, tmp_path
) -> None:
    checkpoint = tiny_checkpoint("llama")
    text = vs_peers.main(["--online", "--engines", "tokenmill", "--model", str(checkpoint),
                          "--concurrency", "2", "--prompt-len", "5", "--gen-len", "4",
                          "--prompts-per-concurrency", "1", "--rounds", "1",
                          "--log-dir", str(tmp_path)])  # fmt: skip
    cells = row(text, "tokenmill", "2")
    assert all(re.fullmatch(NUMBER, c) for c in cells[2:8]), cells
    assert cells[8] == "1.00"  # tokenmill streams a chunk per token
    result = json.loads((tmp_path / "tokenmill-round0-c2.json").read_text())
    assert result["completed"] == 8 and result["total_output_tokens"] == 8 * 4
    assert all(r["prompt_len"] == 5 for r in result["requests"])  # token ids, no BOS added
    assert result["max_concurrent_requests"] <= 2
    log = (tmp_path / "tokenmill-round0.log").read_text()  # the server's
    port = re.search(r"127\.0\.0\.1:(\d+)", log)
    assert port is not None
    with pytest.raises(OSError):  # the server is gone
        socket.create_connection(("127.0.0.1", int(port.group(1))), timeout=1)


def test_tables_take_medians_ratios_on_comparable_weights_and_name_failures(
    monkeypatch, tmp_path
) -> None:
    """Canned runs: two rounds of tokenmill, llama.cpp failing in one round, vLLM in both."""
    weights = tmp_path / "x.gguf"
    engines = [
        Engine("tokenmill", "tokenmill", weights),
        Engine("llamacpp", "llamacpp", weights, flags=("--no-repack",), note="it crashed"),
        Engine("vllm-w8a8", "vllm", tmp_path / "w8a8"),
    ]
    rounds = {"tokenmill": [10.0, 30.0], "llamacpp": [40.0, None], "vllm-w8a8": [None, None]}

    def offline_run(engine: Engine, args, seed: int) -> OfflineResult:
        rate = rounds[engine.name][seed]
        if rate is None:
            raise RuntimeError(f"{engine.name} broke\nin round {seed}")
        return OfflineResult({1: rate, 8: rate * 4}, decode_steps_s=rate / 2, float_bytes=2)

    monkeypatch.setattr(vs_peers, "offline_run", offline_run)
    monkeypatch.setattr(vs_peers, "read_bandwidth_gbs", lambda: 4.0)
    monkeypatch.setattr(vs_peers, "step_bytes", lambda path, float_bytes: 200e6)
    resident = vs_peers.Resident(process_bytes=150e6, weight_bytes=140e6)
    monkeypatch.setattr(vs_peers, "resident_after_load", lambda engine, args: resident)
    monkeypatch.setattr(vs_peers, "weight_files", lambda engines: ["- x.gguf: 160.0 MB"])
    args = vs_peers.parse_args(["--model", str(tmp_path), "--batches", "1,8", "--rounds", "2"])
    rates = vs_peers.offline(engines, args).split("Roofline")[0]
    assert row(rates, "tokenmill")[1:3] == ["20.0", "80.0"]  # medians of two rounds
    assert row(rates, "llamacpp")[1:3] == ["40.0", "160.0"]  # the round that ran
    assert row(rates, "vllm-w8a8")[1:3] == ["failed", "failed"]
    args.quantization = "q8_0"  # ratios only between engines on the same file
    text = vs_peers.offline(engines, args)
    assert "- tokenmill / llamacpp: 0.50x, 0.50x (B = 1, 8)" in text
    assert "tokenmill / vllm-w8a8" not in text
    # roofline: 200 MB a step x 10 decode steps/s = 2 GB/s = 50% of 4 GB/s
    assert row(text, "tokenmill", "200")[2:] == ["10.0", "2.0", "50%"]
    assert row(text.split("Roofline")[0], "tokenmill")[3:5] == ["150", "140"]  # after load
    assert "- x.gguf: 160.0 MB" in text
    assert "- llamacpp: it crashed" in text
    assert "- vllm-w8a8: vllm-w8a8 broke | in round 1" in text


def test_engine_names_resolve_per_mode_and_bad_ones_are_refused(tmp_path) -> None:
    args = vs_peers.parse_args(["--model", str(tmp_path), "--engines", "tokenmill,vllm"])
    tokenmill, vllm = resolve_engines(args)
    assert (tokenmill.runner, tokenmill.dtype, vllm.runner, vllm.dtype) == (
        "tokenmill", "auto", "vllm", "bfloat16"
    )  # fmt: skip
    args.engines = "tokenmill,vllm-w8a8"
    with pytest.raises(SystemExit, match="unknown engines \\['vllm-w8a8'\\] with float"):
        resolve_engines(args)
    args.engines = "tokenmill-base"
    with pytest.raises(SystemExit, match="--base-tree"):
        resolve_engines(args)


def test_peer_servers_command_lines_and_environments(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what importing tokenmill sets
    args = vs_peers.parse_args(["--online", "--model", str(tmp_path), "--concurrency", "1,8",
                                "--prompt-len", "100", "--gen-len", "20", "--threads", "3",
                                "--vllm-python", "/venv/bin/python",
                                "--llamacpp", "/llama"])  # fmt: skip
    vllm = engine_server(Engine("vllm", "vllm", tmp_path, "bfloat16"), args, tmp_path / "v.log")
    assert vllm.command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "127.0.0.1" in vllm.command and "--max-num-seqs" in vllm.command
    assert vllm.command[vllm.command.index("--dtype") + 1] == "bfloat16"
    assert vllm.env is not None and vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "OMP_WAIT_POLICY" not in vllm.env and "PYTHONPATH" not in vllm.env
    gguf = Engine("llamacpp-bf16", "llamacpp", tmp_path / "m.gguf", flags=("--no-repack",))
    server = engine_server(gguf, args, tmp_path / "l.log")
    command = server.command
    assert command[0] == "/llama/build/bin/llama-server"

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("-np") == "8" and value("-t") == "3" and value("-c") == str(8 * (120 + 16))
    assert "-cb" in command and command[-1] == "--no-repack"
    assert server.env is not None and "OMP_WAIT_POLICY" not in server.env
    env = engine_env(Engine("tokenmill-base", "tokenmill", tmp_path, tree=Path("/base")))
    assert env["PYTHONPATH"] == "/base" and "OMP_WAIT_POLICY" not in env


def test_weight_bytes_count_float_tensors_at_the_engines_width(tiny_checkpoint) -> None:
    checkpoint = tiny_checkpoint("llama")
    tensors = {k: v for f in checkpoint.glob("*.safetensors") for k, v in load_file(f).items()}
    elements = sum(t.numel() for t in tensors.values())
    assert peers_machine.weight_bytes(checkpoint, 2) == 2 * elements
    assert peers_machine.weight_bytes(checkpoint, 4) == 4 * elements


def test_tree_rss_counts_the_children_and_the_bandwidth_probe_measures(tmp_path) -> None:
    hold = "import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); "
    hold += "print('ok', flush=True); time.sleep(60)"
    before = peers_worker.tree_rss_bytes()
    child = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        assert peers_worker.tree_rss_bytes() - before > 60 << 20
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert 0.1 < peers_machine.read_bandwidth_gbs() < 10_000  # GB/s


@pytest.mark.skipif(
    not (LLAMACPP / "build" / "bin" / "llama-batched-bench").is_file(),
    reason=f"no llama.cpp build in {LLAMACPP} (../shared/anchors/build_llamacpp.sh)",
)
def test_llamacpp_converts_quantizes_and_times_the_same_checkpoint(
    tiny_checkpoint, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))  # not the shared GGUF cache
    # Sleeping OpenMP threads: with spinning ones (its default) llama.cpp exits without any
    # output now and then on runs as short as these (llamacpp.batched_bench).
    peer_env = llamacpp.peer_env
    monkeypatch.setattr(llamacpp, "peer_env", lambda: {**peer_env(), "OMP_WAIT_POLICY": "PASSIVE"})
    checkpoint = tiny_checkpoint("llama")
    q8 = llamacpp.gguf_file(checkpoint, LLAMACPP, "q8_0")
    assert (tmp_path / "gguf" / f"{checkpoint.name}-f32.gguf").is_file()  # its source
    _, types = peers_machine.gguf_tensor_types(q8)
    assert types.get("Q8_0", 0) > 0
    flags, note = llamacpp.working_flags(LLAMACPP / "build" / "bin", q8, 2)
    assert (flags, note is None) in (((), True), (("--no-repack",), False))
    run = llamacpp.batched_bench(LLAMACPP / "build" / "bin", q8, 2, 64, 64, 2, flags)
    assert run.output_tok_s > 0 and run.decode_steps_s > 0
    assert run.peak_rss_bytes > q8.stat().st_size  # the file is mapped and read


def test_a_preset_name_as_model_is_built_once_and_used(tmp_path, monkeypatch) -> None:
    """`--model 1b` / `3b` name random_model.py's presets: built into the cache on first
    use, then the run takes that directory (here a tiny preset of the same mechanism)."""
    from tokenmill.bench import random_model

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    tiny = random_model.Preset(
        "tiny-preset-v1",
        dict(
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=128,
        ),
    )
    monkeypatch.setitem(random_model.PRESETS, "tiny", tiny)
    args = vs_peers.parse_args(["--model", "tiny"])
    assert args.model == str(tmp_path / "tiny-preset-v1")
    assert (tmp_path / "tiny-preset-v1" / "config.json").is_file()
    assert vs_peers.parse_args(["--model", str(tmp_path)]).model == str(tmp_path)


def test_the_worker_counts_float_weights_at_the_engines_dtype(tiny_checkpoint) -> None:
    """The roofline's float bytes come from the engine's compute dtype (2 in bfloat16), not a
    default of 4 for an attribute tokenmill's engine does not have."""
    args = argparse.Namespace(
        runner="tokenmill", weights=str(tiny_checkpoint("llama")), dtype="bfloat16", tokenizer=None
    )
    engine = peers_worker._Engine(args)
    engine.load(max_num_seqs=2, max_model_len=64)
    assert engine.float_bytes() == 2
