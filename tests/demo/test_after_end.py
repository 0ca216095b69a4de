"""Rows that go on past a document's end (`tokenmill/demo/after_end.py`): the continuation is
the target's greedy one, only the drawn share of documents gets it, within the row length, and
the trainer finds exactly the tokens past the end."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from demo_training import after_end
from demo_training.data import EncodedDoc, pack
from tokenmill.demo import demo_model_path

END = 5  # <|im_end|>
EOS = 2  # </s>


@pytest.fixture(scope="module")
def target() -> transformers.LlamaForCausalLM:
    path = demo_model_path("target")
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy_alone(target, sequence: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding from scratch: the whole sequence through the model at every token."""
    ids = list(sequence)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(sequence) :]


@pytest.mark.slow(reason="Hugging Face greedy decoding token by token")
def test_continuations_are_the_targets_greedy_tokens_past_the_end(target, monkeypatch) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_model_path("target"))
    chats = [
        ("Reverse this list: apple banana cherry dog", "dog cherry banana apple"),
        ("Reverse this list: one two three four", "four three two one"),
        ("Sort these numbers: 31 5 77 12", "5 12 31 77"),
        ("Repeat this text exactly:\nThe sun is warm.", "The sun is warm."),
    ]
    sequences = []
    for question, answer in chats:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        sequences.append(tokenizer.encode(text + answer + "<|im_end|>", add_special_tokens=False))
    sequences += [sequences[0][: len(sequences[2])], sequences[1][:-3]]  # lengths shared
    assert len({len(s) for s in sequences}) < len(sequences)
    monkeypatch.setattr(after_end, "_BATCH", 1 + len(sequences) // 3)  # batches split
    got = after_end.greedy_continuations(target, sequences, 6)
    assert got == [_greedy_alone(target, s, 6) for s in sequences]


def _docs(rng: random.Random, count: int) -> list[EncodedDoc]:
    out = []
    for i in range(count):
        length = rng.randrange(4, 30)
        out.append(EncodedDoc([rng.randrange(10, 100) for _ in range(length)], 2, i % 3))
    return out


def test_a_seeded_share_of_documents_is_continued_within_the_row_length(monkeypatch) -> None:
    def fake(target, sequences, num_tokens):  # a continuation that names its document
        return [[1000 + len(s) + k for k in range(num_tokens)] for s in sequences]

    monkeypatch.setattr(after_end, "greedy_continuations", fake)
    docs = _docs(random.Random(0), 400)
    out = after_end.continue_past_end(None, docs, random.Random(3), 0.25, 6, max_len=40)
    again = after_end.continue_past_end(None, docs, random.Random(3), 0.25, 6, max_len=40)
    other = after_end.continue_past_end(None, docs, random.Random(4), 0.25, 6, max_len=40)
    assert out == again and out != other
    extended = [i for i, (a, b) in enumerate(zip(docs, out)) if a != b]
    assert 0.18 < len(extended) / len(docs) < 0.32
    for i in extended:
        doc, new = docs[i], out[i]
        assert new.token_ids == doc.token_ids + fake(None, [doc.token_ids], 6)[0]
        assert (new.num_context, new.task_index) == (doc.num_context, doc.task_index)
    # Near the row length the continuation is cut; a document of the row length keeps none.
    long = [EncodedDoc(list(range(10, 38)), 2, 0), EncodedDoc(list(range(10, 40)), 2, 0)]
    cut = after_end.continue_past_end(None, long, random.Random(0), 1.0, 6, max_len=30)
    assert cut == [EncodedDoc([*long[0].token_ids, 1028, 1029], 2, 0), long[1]]


def test_the_trainer_marks_exactly_the_tokens_past_a_documents_end() -> None:
    # context (an unlearned <|im_end|> in it), reply ending in <|im_end|>, then what follows.
    first = EncodedDoc([1, 4, 50, END, 4, 60, 61, END, END, 70, END], 5, 0)  # 3 past the end
    story = EncodedDoc([1, 80, 81, EOS], 1, 1)  # ends at </s>: nothing after it
    plain = EncodedDoc([1, 4, 90, END, 4, 91, END], 5, 2)
    rows = pack([first, story, plain], seq_len=32, pad_id=3)
    mask = after_end.after_end_mask(rows.labels[0], rows.position_ids[0], [EOS, END])
    past = torch.zeros(32, dtype=torch.bool)
    past[8:11] = True  # after the first document's learned <|im_end|> at 7
    learned = rows.labels[0] != -100
    assert torch.equal(mask & learned, past)
