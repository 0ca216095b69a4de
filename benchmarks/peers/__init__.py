"""The peer harness: tokenmill against vLLM's CPU build and llama.cpp on the same weights.

    python -m benchmarks.peers [--online] [--quantization q8_0|q4_k_m] ...   # vs_peers.py
    python -m benchmarks.peers.perplexity                                    # vs llama-perplexity

`vs_peers` runs the comparison; `engines` names the engines and their weight files, `offline`
and `online` run them (`worker` is one engine's offline run, in a process of its own),
`machine` records the CPU and the weights; llama.cpp's GGUFs and processes come from
`tokenmill.bench.llamacpp`.
"""
