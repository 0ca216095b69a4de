"""`tokenmill serve` with pooling models: `/v1/embeddings` through the official `openai`
client and LangChain's `OpenAIEmbeddings`, rerank through the `cohere` client, vLLM's
`/v1/score`, errors as for chat, pooling metrics; outputs against sentence-transformers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_utils import API_KEY, MODEL, Server, scrape, start_server, stop_server

from tokenmill_testing.pooling_checkpoints import SAMPLE_TEXTS

st = pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")

QUERY = "what is the capital of france"


@pytest.fixture(scope="module")
def embed_dir(pooling_checkpoint: Callable[..., Path]) -> Path:
    return pooling_checkpoint("sentence_transformer", matryoshka_dimensions=[64, 32])


@pytest.fixture(scope="module")
def rerank_dir(pooling_checkpoint: Callable[..., Path]) -> Path:
    return pooling_checkpoint("cross_encoder")


def _serve(model: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> Server:
    log = tmp_path_factory.mktemp(name) / "server.log"
    return start_server(model, log, "--max-model-len", "64", "--dtype", "float32")


@pytest.fixture(scope="module")
def embed_server(embed_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = _serve(embed_dir, tmp_path_factory, "embed")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def rerank_server(rerank_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = _serve(rerank_dir, tmp_path_factory, "rerank")
    yield server
    stop_server(server)


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return (
        (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    )


def test_openai_client_embeddings_equal_sentence_transformers(
    embed_server: Server, embed_dir: Path
) -> None:
    """The client asks for base64 by default and decodes it itself."""
    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key=API_KEY)
    reply = client.embeddings.create(model=MODEL, input=SAMPLE_TEXTS)
    ours = np.array([d.embedding for d in reply.data])
    reference = st.SentenceTransformer(str(embed_dir), device="cpu").encode(SAMPLE_TEXTS)
    assert _cosines(ours, reference).min() > 0.9999
    assert [d.index for d in reply.data] == list(range(len(SAMPLE_TEXTS)))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(SAMPLE_TEXTS)
    floats = client.embeddings.create(model=MODEL, input=SAMPLE_TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, ours[0], atol=1e-6)
    cut = client.embeddings.create(model=MODEL, input=SAMPLE_TEXTS[:2], dimensions=32)
    assert [len(d.embedding) for d in cut.data] == [32, 32]
    assert np.linalg.norm(cut.data[0].embedding) == pytest.approx(1.0, abs=1e-5)


def test_token_id_input(embed_server: Server, embed_dir: Path) -> None:
    from transformers import AutoTokenizer

    by_text = _post(embed_server, "/v1/embeddings", {"input": "a red apple"}).json()
    tokens = AutoTokenizer.from_pretrained(embed_dir)("a red apple")["input_ids"]
    by_ids = _post(embed_server, "/v1/embeddings", {"input": [tokens, tokens]}).json()
    assert len(by_ids["data"]) == 2
    np.testing.assert_allclose(
        by_ids["data"][1]["embedding"], by_text["data"][0]["embedding"], atol=1e-6
    )
    one = _post(embed_server, "/v1/embeddings", {"input": tokens}).json()
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(tokens)


def test_langchain_openai_embeddings(embed_server: Server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(
        model=MODEL,
        base_url=f"{embed_server.url}/v1",
        api_key=API_KEY,
        check_embedding_ctx_length=False,  # no tiktoken: the server tokenizes
    )
    documents = embeddings.embed_documents(SAMPLE_TEXTS[:3])
    query = embeddings.embed_query(SAMPLE_TEXTS[0])
    assert len(documents) == 3 and len(documents[0]) == 64
    np.testing.assert_allclose(query, documents[0], atol=1e-6)


def test_errors_as_for_chat(embed_server: Server) -> None:
    long_text = " ".join(["the cat sat on the mat"] * 20)
    reply = _post(embed_server, "/v1/embeddings", {"input": long_text})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "maximum context length is 64 tokens" in error["message"]
    assert error["code"] == "context_length_exceeded"
    truncated = _post(
        embed_server, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 16}
    )
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 16
    for body, param in [
        ({"input": []}, "input"),
        ({"input": "x", "dimensions": 48}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, None),
        ({"input": "x", "model": "other"}, None),
    ]:
        reply = _post(embed_server, "/v1/embeddings", body)
        assert reply.status_code in (400, 404), body
        if param is not None:
            assert reply.json()["error"]["param"] == param


def test_cohere_client_rerank_equals_cross_encoder(rerank_server: Server, rerank_dir: Path) -> None:
    cohere = pytest.importorskip("cohere")
    client = cohere.ClientV2(api_key=API_KEY, base_url=rerank_server.url)
    reply = client.rerank(model=MODEL, query=QUERY, documents=SAMPLE_TEXTS, top_n=3)
    reference = st.CrossEncoder(str(rerank_dir), device="cpu").predict(
        [(QUERY, t) for t in SAMPLE_TEXTS]
    )
    best = np.argsort(-reference)[:3]
    assert [r.index for r in reply.results] == best.tolist()
    np.testing.assert_allclose(
        [r.relevance_score for r in reply.results], reference[best], atol=1e-4
    )


def test_rerank_and_score_shapes(rerank_server: Server) -> None:
    documents = SAMPLE_TEXTS[:4]
    rerank = _post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": documents}).json()
    assert sorted(r["index"] for r in rerank["results"]) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in rerank["results"]]
    assert scores == sorted(scores, reverse=True)
    assert rerank["results"][0]["document"]["text"] == documents[rerank["results"][0]["index"]]
    assert rerank["usage"]["total_tokens"] > 0
    bare = _post(
        rerank_server,
        "/rerank",
        {"query": QUERY, "documents": documents, "return_documents": False},
    )
    assert "document" not in bare.json()["results"][0]
    score = _post(rerank_server, "/v1/score", {"text_1": QUERY, "text_2": documents}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2, 3]
    by_index = {r["index"]: r["relevance_score"] for r in rerank["results"]}
    np.testing.assert_allclose(
        [d["score"] for d in score["data"]], [by_index[i] for i in range(4)], atol=1e-6
    )
    mismatched = _post(rerank_server, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": documents})
    assert mismatched.status_code == 400
    refused = _post(rerank_server, "/v1/embeddings", {"input": "x"})
    assert refused.status_code == 400 and "cross-encoder" in refused.json()["error"]["message"]


def test_pooling_metrics(rerank_server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=rerank_server.url, headers=headers) as http:
        before = scrape(http)
        _post(rerank_server, "/v1/score", {"text_1": QUERY, "text_2": SAMPLE_TEXTS[:2]})
        after = scrape(http)
    success = 'tokenmill:request_success_total{finished_reason="stop"}'
    assert after[success] - before.get(success, 0) == 2
    assert after["tokenmill:prompt_tokens_total"] > before.get("tokenmill:prompt_tokens_total", 0)
    assert after["tokenmill:e2e_request_latency_seconds_count"] >= 2
    assert after["tokenmill:num_requests_waiting"] == 0
