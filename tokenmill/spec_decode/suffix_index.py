"""A depth-bounded suffix trie with counts: every substring of up to `max_depth` tokens of the
sequences added, each node counting how often its substring occurs. Suffix decoding
(spec_decode/suffix.py) matches the end of a request against it and follows the most frequent
continuation, as Arctic Inference's SuffixTree does (https://arxiv.org/abs/2411.04975).

Sequences grow token by token (a request's output): each sequence keeps its open suffixes
(the nodes of the suffixes ending at its last token), so appending a token costs
O(max_depth). A whole sequence can be taken out again (cache eviction): its counts are
subtracted and nodes no longer seen are dropped.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the substring from the root to here
        self.children: dict[int, _Node] = {}


@dataclass
class SuffixDraft:
    """A chain of drafts, the probability estimate of each (its count over its parent's,
    multiplied along the path), and the length of the context match it followed."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected number of accepted drafts, as the estimates put it."""
        return sum(self.probs)


class SuffixIndex:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        # Per sequence: the nodes (with depths) of its suffixes shorter than max_depth.
        self._open: dict[Hashable, list[tuple[_Node, int]]] = {}
        self._lengths: dict[Hashable, int] = {}

    def __len__(self) -> int:
        """Tokens indexed, over all sequences."""
        return self.root.count

    def sequence_length(self, key: Hashable) -> int:
        return self._lengths.get(key, 0)

    def extend(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Append `token_ids` to sequence `key` (a new one if unseen)."""
        open_nodes = self._open.get(key, [])
        max_depth = self.max_depth
        root = self.root
        for token in token_ids:
            root.count += 1
            extended: list[tuple[_Node, int]] = []
            for node, depth in [(root, 0), *open_nodes]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                if depth + 1 < max_depth:
                    extended.append((child, depth + 1))
            open_nodes = extended
        self._open[key] = open_nodes
        self._lengths[key] = self._lengths.get(key, 0) + len(token_ids)

    def remove(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Take sequence `key`, whose tokens were `token_ids` (all of them, as extended), out."""
        if self._lengths.pop(key, None) != len(token_ids):
            raise ValueError(f"sequence {key!r} was not indexed with {len(token_ids)} tokens")
        del self._open[key]
        self.root.count -= len(token_ids)
        for start in range(len(token_ids)):
            node = self.root
            for token in token_ids[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break  # everything below it counted only this occurrence
                node = child

    def speculate(
        self,
        context: Sequence[int],
        max_tokens: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> SuffixDraft:
        """The best-scoring chain of up to `max_tokens` drafts to follow `context`.

        Every suffix of the context's last `max_depth` tokens that occurs in the index is a
        candidate; from its node the chain follows the most frequent child while the running
        probability stays >= `min_token_prob`, and is at most `match_len * max_spec_factor`
        long (a short match is weak evidence: it speculates less).
        """
        if max_tokens <= 0 or not self.root.children:
            return SuffixDraft()
        pattern = context[-self.max_depth :]
        # Every suffix of an indexed substring is indexed: the suffixes that occur are those
        # from some start on, found by bisection; then walked lazily, longest first.
        low, high = 0, len(pattern)  # pattern[high:] (empty) occurs; find the smallest start
        while low < high:
            middle = (low + high) // 2
            if self._walk(pattern, middle) is None:
                low = middle + 1
            else:
                high = middle
        matches = (
            (self._walk(pattern, start), len(pattern) - start)
            for start in range(high, len(pattern))
        )
        return self._best(matches, max_tokens, max_spec_factor, min_token_prob, 0)

    def speculate_own(
        self, key: Hashable, max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> SuffixDraft:
        """`speculate` with sequence `key`'s own tokens as the context (a request's trie):
        its open suffixes are the matches, no walk needed. Each matched substring's count
        includes the occurrence at the sequence's end, which has no continuation yet: it is
        left out of the probabilities."""
        if max_tokens <= 0:
            return SuffixDraft()
        matches = ((node, depth) for node, depth in reversed(self._open.get(key, [])))
        return self._best(matches, max_tokens, max_spec_factor, min_token_prob, 1)

    def _best(
        self,
        matches: Iterable[tuple[_Node | None, int]],
        max_tokens: int,
        max_spec_factor: float,
        min_token_prob: float,
        uncontinued: int,
    ) -> SuffixDraft:
        """The best chain from `matches` (node, match length), longest match first."""
        best = SuffixDraft()
        for node, match_len in matches:
            if node is None or node.count <= uncontinued or not node.children:
                continue  # seen only where it has no continuation yet
            limit = min(max_tokens, int(match_len * max_spec_factor + 1e-6))
            if limit <= best.score:
                break  # a score is at most its length, and shorter matches draft no more
            draft = self._follow(node, limit, min_token_prob, match_len, uncontinued)
            if draft.score > best.score:  # ties: the longer match (seen first) wins
                best = draft
        return best

    def _walk(self, pattern: Sequence[int], start: int) -> _Node | None:
        node = self.root
        for token in pattern[start:]:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    @staticmethod
    def _follow(
        node: _Node, limit: int, min_token_prob: float, match_len: int, uncontinued: int
    ) -> SuffixDraft:
        draft = SuffixDraft(match_len=match_len)
        prob = 1.0
        total = node.count - uncontinued
        while len(draft.token_ids) < limit and node.children and total > 0:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / total
            if prob < min_token_prob:
                break
            draft.token_ids.append(token)
            draft.probs.append(prob)
            node = child
            total = child.count
        return draft
