"""tokenmill's perplexity on a GGUF file within 1% of `llama-perplexity`'s on the same file and
text (the demo target quantized by llama.cpp's own `llama-quantize`), where llama.cpp is built
(benchmarks/peers/perplexity.py; measured within 0.1% for every type here, 16 chunks of 128).
The demo target's widths (256, 768) are multiples of 256, so the K- and i-quants are real."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peers.perplexity import LLAMACPP, bin_dir, compare

NEEDED = ("llama-perplexity", "llama-quantize", "llama-server")
missing = [name for name in NEEDED if not (bin_dir(LLAMACPP) / name).is_file()]
if not (LLAMACPP / "convert_hf_to_gguf.py").is_file():
    missing.append("convert_hf_to_gguf.py")


@pytest.mark.skipif(bool(missing), reason=f"llama.cpp is not built here ({', '.join(missing)})")
@pytest.mark.parametrize(
    "qtype", ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K_M", "Q2_K"]
)
def test_perplexity_matches_llama_cpp_on_the_same_file(qtype: str, tmp_path: Path) -> None:
    ours, theirs, weights = compare(LLAMACPP, qtype, tmp_path, ctx=128, chunks=8)
    print(f"{qtype}: tokenmill {ours:.4f}, llama-perplexity {theirs:.4f} ({weights})")
    assert "float" not in weights  # every tensor kept quantized
    assert abs(ours - theirs) / theirs < 0.01
