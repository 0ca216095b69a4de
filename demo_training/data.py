"""Documents -> packed training rows with a loss mask.

A chat document is learned only where the model must produce text (the assistant's reply
and its `<|im_end|>`): the user's random numbers and names are unpredictable, and spending
capacity on them would slow down learning the tasks. Plain stories are learned in full.

Whole documents are packed into fixed-length rows (never split, so a reply always sees its
question); the few tokens left at a row's end are padding without loss. Positions restart at
0 for every document, which makes transformers' Llama mask attention per document: each
document is trained exactly as the engine will run it, alone from position 0. (Without the
mask, the many word lists in a row made copying ambiguous and the model failed to learn it.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast

from tokenmill.demo.corpus import render
from tokenmill.demo.tasks import Example

IGNORE_INDEX = -100  # transformers' label value for "no loss here"
_OPEN_ROWS = 8  # first-fit packing looks at this many unfinished rows


@dataclass(frozen=True)
class EncodedDoc:
    token_ids: list[int]
    num_context: int  # the first num_context tokens carry no loss
    task_index: int


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [num_rows, seq_len]
    labels: torch.Tensor  # [num_rows, seq_len]: the token where it is learned, else IGNORE_INDEX
    task_ids: torch.Tensor  # [num_rows, seq_len]: the task of each learned token, else -1
    position_ids: torch.Tensor  # [num_rows, seq_len]: 0, 1, ... from each document's start

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.labels, self.task_ids, self.position_ids)

    def head(self, num_rows: int) -> PackedRows:
        return PackedRows(*(t[:num_rows] for t in self.tensors()))

    @classmethod
    def concat(cls, parts: Sequence[PackedRows]) -> PackedRows:
        return cls(*(torch.cat(ts) for ts in zip(*(p.tensors() for p in parts))))

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def encode(
    tokenizer: PreTrainedTokenizerFast, examples: Sequence[Example], task_names: Sequence[str]
) -> list[EncodedDoc]:
    """Tokenize context and context+target; the context's tokens must be a prefix of the whole
    (true when the target starts a new pre-token, as after the template's newline)."""
    rendered = [render(e) for e in examples]
    backend = tokenizer.backend_tokenizer
    contexts = backend.encode_batch([c for c, _ in rendered], add_special_tokens=False)
    wholes = backend.encode_batch([c + t for c, t in rendered], add_special_tokens=False)
    docs = []
    for example, context, whole in zip(examples, contexts, wholes):
        if whole.ids[: len(context.ids)] != context.ids:
            raise ValueError(f"the reply changes the prompt's tokenization: {example!r}")
        docs.append(EncodedDoc(whole.ids, len(context.ids), task_names.index(example.task)))
    return docs


def pack(docs: Iterable[EncodedDoc], seq_len: int, pad_id: int) -> PackedRows:
    """First-fit packing over a window of open rows (deterministic, a few % padding)."""
    finished: list[list[EncodedDoc]] = []
    open_rows: list[tuple[int, list[EncodedDoc]]] = []  # (tokens used, docs)
    for doc in docs:
        if len(doc.token_ids) > seq_len:
            raise ValueError(f"a document of {len(doc.token_ids)} tokens exceeds {seq_len}")
        for i, (used, row) in enumerate(open_rows):
            if used + len(doc.token_ids) <= seq_len:
                row.append(doc)
                open_rows[i] = (used + len(doc.token_ids), row)
                break
        else:
            open_rows.append((len(doc.token_ids), [doc]))
            if len(open_rows) > _OPEN_ROWS:
                finished.append(open_rows.pop(0)[1])
    finished.extend(row for _, row in open_rows)
    return _to_tensors(finished, seq_len, pad_id)


def _to_tensors(rows: list[list[EncodedDoc]], seq_len: int, pad_id: int) -> PackedRows:
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    task_ids = torch.full((len(rows), seq_len), -1, dtype=torch.long)
    position_ids = torch.arange(seq_len).repeat(len(rows), 1)  # padding continues the last doc
    for r, row in enumerate(rows):
        start = 0
        for doc in row:
            end = start + len(doc.token_ids)
            ids = torch.tensor(doc.token_ids)
            input_ids[r, start:end] = ids
            position_ids[r, start:] = torch.arange(seq_len - start)
            learned = slice(start + doc.num_context, end)
            labels[r, learned] = ids[doc.num_context :]
            task_ids[r, learned] = doc.task_index
            start = end
    return PackedRows(input_ids, labels, task_ids, position_ids)
