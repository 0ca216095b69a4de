"""Streaming detokenization: deltas add up to the full decode, multi-byte characters are never
split into U+FFFD, and stop strings are cut without ever being partially streamed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tokenmill.engine import detokenizer as detokenizer_module
from tokenmill.engine.detokenizer import IncrementalDetokenizer, decode_token

FFFD = "\ufffd"
PROMPTS = ["Hello there", "Café 你好 ", "x", "def f(x):\n    return 1\n"]
ALPHABET = [*"abc xyz.,!\n", *"éß你界ж∞", "😀", "🚀", "👍🏽", "the", " cat"]
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class SlowTokenizer:
    """A tokenizer without a Rust backend (forces the pure-Python stream); records decodes."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self._tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """As a slow Hugging Face tokenizer: added tokens are separate pieces of the text,
        joined by spaces unless `spaces_between_special_tokens` is False."""
        self.decoded_lengths.append(len(ids))
        special = set(self._tokenizer.all_special_ids)
        pieces, run = [], []
        for token_id in ids:
            if token_id in special and not skip_special_tokens:
                pieces += [self._tokenizer.decode(run), self._tokenizer.decode([token_id])]
                run = []
            elif token_id not in special:
                run.append(token_id)
        pieces = [p for p in [*pieces, self._tokenizer.decode(run)] if p]
        return (" " if spaces_between_special_tokens else "").join(pieces)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def fragment_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Tokens that are only part of a multi-byte character."""
    ids = [i for i in range(len(tokenizer)) if FFFD in tokenizer.decode([i])]
    assert len(ids) > 50
    return ids


def stream(
    detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int]
) -> tuple[list[str], list[str | None]]:
    """Feed token_ids in chunks; return the streamed deltas (last one at finish) and the
    update() results."""
    deltas: list[str] = []
    hits: list[str | None] = []
    start = 0
    for size in chunk_sizes:
        if start >= len(token_ids):
            break
        hits.append(detok.update(token_ids[start : start + size]))
        start += size
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        if hits[-1] is not None:
            break
    assert start >= len(token_ids) or hits[-1] is not None
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, hits


chunks = st.lists(st.integers(1, 4), min_size=60, max_size=60)
texts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=25).map("".join)


@HYPOTHESIS
@given(text=texts, prompt=st.sampled_from(PROMPTS), sizes=chunks)
def test_valid_text_streams_exactly_without_replacement_chars(
    tokenizer: PreTrainedTokenizerFast, text: str, prompt: str, sizes: list[int]
) -> None:
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, _ = stream(detok, output_ids, sizes)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == text == detok.output_text
    # Same as decoding prompt + output and removing the prompt's text.
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    assert full[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)) :] == text


@HYPOTHESIS
@given(data=st.data(), prompt=st.sampled_from(PROMPTS), sizes=chunks, skip=st.booleans())
def test_arbitrary_tokens_stream_to_full_decode(
    tokenizer: PreTrainedTokenizerFast,
    fragment_ids: list[int],
    data: st.DataObject,
    prompt: str,
    sizes: list[int],
    skip: bool,
) -> None:
    any_id = st.integers(0, len(tokenizer) - 1)
    output_ids = data.draw(st.lists(any_id | st.sampled_from(fragment_ids), max_size=40))
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), skip_special_tokens=skip)
    deltas, _ = stream(detok, output_ids, sizes)
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected == detok.output_text
    # Cumulative (non-delta) output agrees with the deltas.
    assert detok.get_next_output_text(finished=True, delta=False) == expected


@HYPOTHESIS
@given(data=st.data(), sizes=chunks)
def test_python_fallback_stream_matches(
    tokenizer: PreTrainedTokenizerFast,
    fragment_ids: list[int],
    data: st.DataObject,
    sizes: list[int],
) -> None:
    output_ids = data.draw(st.lists(st.sampled_from(fragment_ids) | st.integers(5, 1023)))
    slow = SlowTokenizer(tokenizer)
    detok = IncrementalDetokenizer(slow, tokenizer.encode("Hi"))  # type: ignore[arg-type]
    deltas, _ = stream(detok, output_ids, sizes)
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True)


def test_decoding_cost_does_not_grow_with_output(tokenizer: PreTrainedTokenizerFast) -> None:
    slow = SlowTokenizer(tokenizer)
    output_ids = tokenizer.encode("The cat reads 😀 你好. " * 60, add_special_tokens=False)
    detok = IncrementalDetokenizer(slow, [1], skip_special_tokens=True)  # type: ignore[arg-type]
    for token_id in output_ids:
        detok.update([token_id])
    assert len(output_ids) > 500
    assert max(slow.decoded_lengths) < 12
    assert detok.output_text == "The cat reads 😀 你好. " * 60


def test_incomplete_character_waits_then_flushes_at_finish(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    emoji_ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) > 2
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    detok.update(emoji_ids[:1])
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update(emoji_ids[1:2])
    assert detok.output_text == ""
    # The generation ends mid-character: the final text is what a full decode gives.
    final = detok.get_next_output_text(finished=True, delta=True)
    assert final == tokenizer.decode(emoji_ids[:2]) and FFFD in final


def test_prompt_ending_mid_character_does_not_leak_into_output(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = tokenizer.encode("ab😀", add_special_tokens=False)
    prompt_ids, output_ids = ids[:-1], ids[-1:] + tokenizer.encode("!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, _ = stream(detok, output_ids, [1] * len(output_ids))
    assert "".join(deltas) == tokenizer.decode(output_ids)
    assert not detok.output_text.startswith("ab")


def test_context_keeps_leading_space_for_metaspace_tokenizers() -> None:
    # SentencePiece-style decoders drop the space of the first token of a decode; streaming
    # must decode output tokens in the prompt's context so " world" keeps its space.
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["hello world", "world hello", "hello there world"], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt_ids = tokenizer.encode("hello", add_special_tokens=False)
    output_ids = tokenizer.encode("hello world there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, _ = stream(detok, output_ids, [1] * len(output_ids))
    full = tokenizer.decode(prompt_ids + output_ids)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt_ids)) :] == " hello world there"


@HYPOTHESIS
@given(text=texts, data=st.data(), sizes=chunks, include=st.booleans())
def test_stop_string_is_cut_and_never_partially_streamed(
    tokenizer: PreTrainedTokenizerFast,
    text: str,
    data: st.DataObject,
    sizes: list[int],
    include: bool,
) -> None:
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, min(len(text), start + 6)))]
    decoy = "\x00never"  # a longer stop string that never occurs widens the held-back buffer
    index = text.find(stop)
    expected = text[: index + len(stop)] if include else text[:index]
    output_ids = tokenizer.encode(text + " tail", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, [1], stop=[decoy, stop], include_stop_str_in_output=include
    )
    deltas, hits = stream(detok, output_ids, sizes)
    assert hits[-1] == stop and hits[:-1] == [None] * (len(hits) - 1)
    assert detok.stop_reason == stop and detok.output_text == expected
    assert "".join(deltas) == expected
    # Text sent before the end was always a prefix of the final text: no partial stop string.
    streamed = ""
    for delta in deltas[:-1]:
        streamed += delta
        assert expected.startswith(streamed)
    assert detok.update(tokenizer.encode(" more", add_special_tokens=False)) is None
    assert detok.output_text == expected


def test_stop_string_spanning_tokens_and_updates(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "The cat reads a long letter in the morning."
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["morning", "g let"])
    seen, hits = "", []
    for token_id in output_ids:
        hits.append(detok.update([token_id]))
        seen += detok.get_next_output_text(finished=False, delta=True)
        assert "g l" not in seen and "g let" not in seen
        if hits[-1] is not None:
            break
    assert hits[-1] == "g let"
    # The stop string was not inside a single token: it completed on a later update.
    assert "g let" not in tokenizer.decode(output_ids[len(hits) - 1])
    assert detok.output_text == "The cat reads a lon"
    assert seen + detok.get_next_output_text(finished=True, delta=True) == detok.output_text


def test_earliest_stop_string_wins_within_one_update(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["four", "two"])
    assert detok.update(ids) == "two"
    assert detok.get_next_output_text(finished=True, delta=False) == "one "


def test_stop_buffer_holds_back_only_while_running(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["xyz!"])
    assert detok.update(ids) is None
    assert detok.get_next_output_text(finished=False, delta=False) == "hello wo"
    assert detok.get_next_output_text(finished=False, delta=True) == "hello wo"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "rld"
    included = IncrementalDetokenizer(
        tokenizer, [1], stop=["xyz!"], include_stop_str_in_output=True
    )
    included.update(ids)
    assert included.get_next_output_text(finished=False, delta=True) == "hello world"


def test_special_tokens_follow_skip_flag(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    shown = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    shown.update(ids)
    hidden = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True)
    hidden.update(ids)
    assert (shown.output_text, hidden.output_text) == ("hi<|im_end|>", "hi")


def test_decode_token(tokenizer: PreTrainedTokenizerFast) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert decode_token(tokenizer, im_end) == "<|im_end|>"
    the_id = tokenizer.encode(" the", add_special_tokens=False)
    assert len(the_id) == 1 and decode_token(tokenizer, the_id[0]) == " the"
    slow = SlowTokenizer(tokenizer)
    assert decode_token(slow, im_end) == decode_token(slow, im_end) == "<|im_end|>"  # type: ignore[arg-type]
    assert slow.decoded_lengths == [1]  # cached after the first call


def test_recovers_from_decode_stream_invalid_prefix(
    tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DecodeStream raises "Invalid prefix" on rare non-monotonic decodes; the detokenizer must
    # carry on from its last emitted tokens without losing or repeating text, even when the
    # error hits while a character is incomplete.
    text = "The cat 😀 reads 你好 a letter."
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    first_fragment = next(i for i, t in enumerate(output_ids) if FFFD in tokenizer.decode([t]))
    failing_token = output_ids[first_fragment + 1]
    real_step = detokenizer_module._FastStream.step
    raised: list[int] = []

    def flaky_step(self: object, token_ids: list[int]) -> str | None:
        if token_ids == [failing_token] and not raised:
            raised.append(failing_token)
            raise Exception("Invalid prefix encountered")
        return real_step(self, token_ids)  # type: ignore[arg-type]

    monkeypatch.setattr(detokenizer_module._FastStream, "step", flaky_step)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi there"))
    deltas, _ = stream(detok, output_ids, [1] * len(output_ids))
    assert raised
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize(("spaces", "expected"), [(True, "Hi <s> there"), (False, "Hi<s>there")])
def test_slow_tokenizers_get_spaces_between_special_tokens(
    tokenizer: PreTrainedTokenizerFast, spaces: bool, expected: str
) -> None:
    """As in vLLM, the option reaches a slow tokenizer's decode (a fast one has no such option)."""
    bos = tokenizer.convert_tokens_to_ids("<s>")
    output_ids = [*tokenizer.encode("Hi", add_special_tokens=False), bos]
    output_ids += tokenizer.encode("there", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        SlowTokenizer(tokenizer),  # type: ignore[arg-type]
        tokenizer.encode("Well", add_special_tokens=False),
        skip_special_tokens=False,
        spaces_between_special_tokens=spaces,
    )
    deltas, _ = stream(detok, output_ids, [1] * len(output_ids))
    assert "".join(deltas) == expected


def test_without_stop_strings_text_is_decoded_when_read_and_is_the_same(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """Updates without stop strings only queue tokens (a final-only request decodes once, at
    the end); the text, read at any point, is what decoding each update at once gives."""
    slow = SlowTokenizer(tokenizer)
    output_ids = tokenizer.encode("Café 😀 你好 the cat. " * 4, add_special_tokens=False)
    lazy = IncrementalDetokenizer(slow, [1])  # type: ignore[arg-type]
    eager = IncrementalDetokenizer(slow, [1], stop=["\x00never"])  # type: ignore[arg-type]
    primed = len(slow.decoded_lengths)
    for start in range(0, len(output_ids), 3):
        assert lazy.update(output_ids[start : start + 3]) is None
    assert len(slow.decoded_lengths) == primed  # nothing decoded yet
    halfway = len(output_ids) // 2
    deltas = []
    for start in range(0, len(output_ids), 3):
        eager.update(output_ids[start : start + 3])
        if start == halfway - halfway % 3:
            deltas.append(eager.get_next_output_text(finished=False, delta=True))
    assert lazy.get_next_output_text(finished=True, delta=False) == "".join(
        [*deltas, eager.get_next_output_text(finished=True, delta=True)]
    )
    assert lazy.output_text == eager.output_text == tokenizer.decode(output_ids)
