"""llama.cpp's `llama-server --embedding` as a peer of `tokenmill bench embed`: the same
weights as GGUF (f32 or bf16, converted once), fed the same texts as token ids (the GGUF's
tokenizer is a stand-in; tokenmill_testing's random models have no llama.cpp tokenizer), one
`/v1/embeddings` request per chunk of texts, a few in flight, so its slots batch them."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tokenmill.bench.llamacpp import LlamaServerProcess, gguf_file, source_tree

# tokenmill's pooling names -> llama-server's --pooling.
_POOLING = {"cls": "cls", "mean": "mean", "last": "last"}
SLOTS = 16  # parallel sequences the server batches into one ubatch
CHUNK = 32  # texts per request
IN_FLIGHT = 4  # requests at once


class LlamaCppEmbedder:
    """`with LlamaCppEmbedder(bin_dir, model, "float32", "cls", 256, log) as embed:
    embed(token_id_lists)` -> one normalized embedding per list."""

    def __init__(
        self,
        bin_dir: Path,
        model: Path,
        dtype: str,
        pooling: str,
        max_tokens: int,
        log_path: Path,
    ) -> None:
        if pooling not in _POOLING:
            raise ValueError(f"pooling {pooling!r}: llama-server pools {sorted(_POOLING)}")
        gguf = gguf_file(model, source_tree(bin_dir), dtype)
        context = SLOTS * max_tokens
        threads = str(len(os.sched_getaffinity(0)))
        args = ["-m", str(gguf), "--embedding", "--pooling", _POOLING[pooling]]
        args += ["-np", str(SLOTS), "-c", str(context), "-b", str(context), "-ub", str(context)]
        args += ["-t", threads, "-tb", threads, "--no-webui"]
        self.server = LlamaServerProcess(bin_dir, args, log_path)
        self.client: httpx.Client | None = None

    def __enter__(self) -> LlamaCppEmbedder:
        self.server.__enter__()
        self.client = httpx.Client(base_url=self.server.base_url, timeout=600, trust_env=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.client is not None:
            self.client.close()
        self.server.__exit__(None, None, None)

    def _request(self, chunk: list[list[int]]) -> list[list[float]]:
        assert self.client is not None
        reply = self.client.post("/v1/embeddings", json={"input": chunk})
        if reply.status_code != 200:
            raise RuntimeError(f"llama-server answered {reply.status_code}: {reply.text[:400]}")
        return [d["embedding"] for d in sorted(reply.json()["data"], key=lambda d: d["index"])]

    def __call__(self, token_lists: list[list[int]]) -> list[list[float]]:
        chunks = [token_lists[i : i + CHUNK] for i in range(0, len(token_lists), CHUNK)]
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            return [e for part in pool.map(self._request, chunks) for e in part]
