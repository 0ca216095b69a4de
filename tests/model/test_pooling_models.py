"""Pooling models against sentence-transformers itself: embeddings within cosine 0.9999,
cross-encoder scores within 1e-4, on tiny random checkpoints it saved."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tokenmill import LLM
from tokenmill.engine.intake import PromptTooLongError
from tokenmill.sampling_params import InvalidRequestError
from tokenmill_testing.pooling_checkpoints import SAMPLE_TEXTS

st = pytest.importorskip("sentence_transformers")


def _cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return (
        (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    )


def _embed(path: Path, texts: list[str], **kwargs: object) -> np.ndarray:
    llm = LLM(str(path), dtype="float32")
    return np.array([o.outputs.embedding for o in llm.embed(texts, **kwargs)])


@pytest.mark.parametrize(
    "kind, pooling, normalize",
    [
        ("bert", "mean", True),
        ("bert", "cls", False),
        ("xlm-roberta", "mean", True),
        ("qwen3", "lasttoken", True),
    ],
)
def test_embeddings_equal_sentence_transformers(
    pooling_checkpoint: Callable[..., Path], kind: str, pooling: str, normalize: bool
) -> None:
    path = pooling_checkpoint(
        "sentence_transformer", kind=kind, pooling=pooling, normalize=normalize
    )
    ours = _embed(path, SAMPLE_TEXTS)
    reference = st.SentenceTransformer(str(path), device="cpu").encode(SAMPLE_TEXTS)
    assert ours.shape == reference.shape
    assert _cosines(ours, reference).min() > 0.9999
    np.testing.assert_allclose(
        np.linalg.norm(ours, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-4
    )
    # The texts' embeddings differ: the check above is not one of equal constant vectors.
    assert _cosines(ours[:1], ours[1:2]).max() < 0.999


def test_matryoshka_dimensions_cut_then_normalize(pooling_checkpoint: Callable[..., Path]) -> None:
    path = pooling_checkpoint("sentence_transformer", matryoshka_dimensions=[64, 32, 16])
    ours = _embed(path, SAMPLE_TEXTS, dimensions=16)
    model = st.SentenceTransformer(str(path), device="cpu", truncate_dim=16)
    reference = model.encode(SAMPLE_TEXTS, normalize_embeddings=True)
    assert ours.shape == (len(SAMPLE_TEXTS), 16)
    assert _cosines(ours, reference).min() > 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)
    llm = LLM(str(path), dtype="float32")
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.embed("a red apple", dimensions=24)  # not one of the model's widths


def test_dimensions_refused_without_matryoshka(pooling_checkpoint: Callable[..., Path]) -> None:
    llm = LLM(str(pooling_checkpoint("sentence_transformer")), dtype="float32")
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        llm.embed("a red apple", dimensions=16)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_equal_sentence_transformers(
    pooling_checkpoint: Callable[..., Path], kind: str
) -> None:
    path = pooling_checkpoint("cross_encoder", kind=kind)
    query = "what is the capital of france"
    ours = np.array(
        [o.outputs.score for o in LLM(str(path), dtype="float32").score(query, SAMPLE_TEXTS)]
    )
    reference = st.CrossEncoder(str(path), device="cpu").predict([(query, t) for t in SAMPLE_TEXTS])
    np.testing.assert_allclose(ours, reference, atol=1e-4)
    assert np.ptp(ours) > 1e-3  # the documents score differently


def test_score_with_an_embedding_model_is_cosine(pooling_checkpoint: Callable[..., Path]) -> None:
    path = pooling_checkpoint("sentence_transformer")
    llm = LLM(str(path), dtype="float32")
    scores = [o.outputs.score for o in llm.score(SAMPLE_TEXTS[:2], SAMPLE_TEXTS[2:4])]
    vectors = np.array([o.outputs.embedding for o in llm.embed(SAMPLE_TEXTS[:4])])
    expected = _cosines(vectors[:2], vectors[2:4])
    np.testing.assert_allclose(scores, expected, atol=1e-5)


def test_token_ids_and_batching_give_the_same_embedding(
    pooling_checkpoint: Callable[..., Path],
) -> None:
    """A text alone, in a batch of others (padded beside longer ones) and as token ids: one
    embedding; the engine's budget splits the batch into several steps."""
    path = pooling_checkpoint("sentence_transformer")
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16)
    alone = np.array(llm.embed(SAMPLE_TEXTS[0])[0].outputs.embedding)
    batch = llm.embed(SAMPLE_TEXTS)
    ids = batch[0].prompt_token_ids
    from_ids = np.array(llm.embed([ids])[0].outputs.embedding)
    np.testing.assert_allclose(np.array(batch[0].outputs.embedding), alone, atol=1e-5)
    np.testing.assert_allclose(from_ids, alone, atol=1e-6)
    assert llm.pooling is not None and llm.pooling.engine.stats.num_steps > 3


def test_too_long_input_and_truncation(pooling_checkpoint: Callable[..., Path]) -> None:
    path = pooling_checkpoint("sentence_transformer")
    llm = LLM(str(path), dtype="float32", max_model_len=8)
    long_text = "the cat sat on the mat and the dog ran in the park"
    with pytest.raises(PromptTooLongError, match="max_model_len=8"):
        llm.embed(long_text)
    [out] = llm.embed(long_text, truncate_prompt_tokens=8)
    assert len(out.prompt_token_ids) == 8
    assert out.prompt_token_ids[-1] == llm.pooling.tokenizer.sep_token_id  # type: ignore[union-attr]
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        llm.embed(long_text, truncate_prompt_tokens=9)


def test_generate_model_refuses_embed(random_llm: LLM) -> None:
    with pytest.raises(ValueError, match="pooling model"):
        random_llm.embed("hello")


def test_yes_no_reranker_equals_transformers(pooling_checkpoint: Callable[..., Path]) -> None:
    """Qwen3-Reranker's scoring: P(yes) against P(no) at the pair's last token, the texts
    read one after the other."""
    import torch
    import transformers

    path = pooling_checkpoint("yes_no_reranker")
    query = "query: what is the capital of france? document: "
    llm = LLM(str(path), dtype="float32", task="score")
    outputs = llm.score(query, SAMPLE_TEXTS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    expected = []
    for text, output in zip(SAMPLE_TEXTS, outputs):
        ids = tokenizer(query)["input_ids"] + tokenizer(text, add_special_tokens=False)["input_ids"]
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        expected.append(torch.softmax(logits[[no, yes]], 0)[1].item())
    ours = [o.outputs.score for o in outputs]
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    assert np.ptp(ours) > 1e-3
    with pytest.raises(ValueError, match="pooling model"):
        LLM(str(path), dtype="float32").embed("x")  # auto: a causal LM generates


def test_pooling_model_refuses_generate(pooling_checkpoint: Callable[..., Path]) -> None:
    llm = LLM(str(pooling_checkpoint("sentence_transformer")), dtype="float32")
    assert llm.get_tokenizer().sep_token_id is not None
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")
