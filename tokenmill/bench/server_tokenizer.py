"""The served model's tokenizer over HTTP: vLLM's `POST /tokenize` and `/detokenize`.

`bench serve` sizes its prompts with the model's own tokenizer. Against a server on another
machine (or one serving a GGUF file the client does not have) there is no local copy, but a
tokenmill or vLLM server exposes its tokenizer: the counts it returns are the counts the
server will bill, which is what the dataset must match. Enough of a Hugging Face tokenizer's
surface for `bench.text` (counting, and cutting text at a token boundary via decode).
"""

from __future__ import annotations

import httpx

from tokenmill.bench.client import BenchError


class ServerTokenizer:
    """`tokenizer(text)["input_ids"]` and `tokenizer.decode(ids)`, answered by the server."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        # trust_env=False: a benchmark must not go through a proxy (as bench.client does)
        self._client = httpx.Client(headers=headers, timeout=60.0, trust_env=False)
        self._counted: dict[tuple[str, bool], list[int]] = {}

    @property
    def source(self) -> str:
        """How results name this tokenizer (their `tokenizer_id`)."""
        return f"{self.base_url}/tokenize"

    @classmethod
    def connect(cls, base_url: str, model: str, api_key: str | None = None) -> ServerTokenizer:
        """A tokenizer for `model` at `base_url`, or BenchError if the server has no /tokenize."""
        tokenizer = cls(base_url, model, api_key)
        tokenizer.encode("hello", add_special_tokens=False)  # fail now, before any dataset work
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        if key not in self._counted:  # fit_text re-counts the same head + tail text
            body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
            self._counted[key] = self._post("/tokenize", body)["tokens"]
        return self._counted[key]

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"]

    def __call__(
        self, text: str, add_special_tokens: bool = True, **ignored: object
    ) -> dict[str, list[int]]:
        """Only `input_ids`: no offsets (`bench.text` cuts with `decode` when they are absent)."""
        return {"input_ids": self.encode(text, add_special_tokens)}

    def _post(self, route: str, body: dict) -> dict:
        url = self.base_url + route
        try:
            response = self._client.post(url, json=body)
        except httpx.HTTPError as e:
            raise BenchError(f"could not reach {url}: {e}") from None
        if response.status_code in (404, 405):
            raise BenchError(
                f"{url} does not exist, and there is no local tokenizer for model "
                f"{self.model!r}: pass --tokenizer DIR or FILE.gguf (datasets are sized with "
                "the model's own tokenizer)"
            )
        if response.status_code != 200:
            raise BenchError(f"{url} answered {response.status_code}: {response.text[:300]}")
        return response.json()
