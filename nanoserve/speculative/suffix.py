"""Suffix decoding (vLLM's `suffix` method, after SuffixDecoding, arXiv 2411.04975): drafts from the most frequent
continuation of the sequence's latest tokens, in the request's own tokens and in the outputs of recent requests.

Where prompt lookup copies the one latest occurrence, suffix decoding counts every occurrence of a matched suffix
and follows the continuation most of them take, token by token, while its estimated probability (the share of the
matched occurrences that continue that way, multiplied along the path) stays at or above `min_token_prob`. A match
of m tokens may draft at most `max_spec_factor * m` tokens, and match plus draft at most `max_tree_depth`: a long
match earns a long draft. Every match length is a candidate; the path with the highest score (the sum of its
tokens' probabilities) wins. Past requests' outputs are kept in a cache of the latest `max_cached_requests`, so a
workload that repeats itself across requests (agents calling the same tools, the same template filled again)
drafts from the first token.

Instead of a suffix tree, each source is a token array searched with numpy: the occurrences of the sequence's last
token, narrowed one token further back per match length, are exactly the tree's node for that suffix, and the
counts of the tokens after them its children's counts. A cache's occurrences are found through an index of token
pairs and at most LATEST_OCCURRENCES of them are used, so a very common pair costs no more than a rare one.
"""

from __future__ import annotations

from collections import deque

import numpy as np

END = -1  # after a cached output, and after the sequence: an occurrence here has no continuation
LATEST_OCCURRENCES = 1024  # a cache's occurrences of a token pair that are searched (the latest)


class Draft:
    """The best path found so far: its tokens and score (the sum of its tokens' estimated probabilities)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.score = 0.0

    def offer(self, tokens: list[int], score: float) -> None:
        if score > self.score:
            self.tokens, self.score = tokens, score


class SuffixSearch:
    """The limits a search follows (vLLM's suffix_decoding_* keys)."""

    def __init__(self, max_tree_depth: int, max_spec_factor: float, min_token_prob: float):
        self.max_tree_depth, self.max_spec_factor, self.min_token_prob = max_tree_depth, max_spec_factor, min_token_prob

    def limit(self, match: int, k: int) -> int:
        """Tokens a match of `match` tokens may draft."""
        return max(0, min(k, int(match * self.max_spec_factor + 1e-6), self.max_tree_depth - match))

    def search(self, corpus: np.ndarray, ends: np.ndarray, first: int, seq: np.ndarray, k: int, best: Draft) -> None:
        """Offer `best` the path of every match length from `first` on: `ends` are the corpus positions where an
        occurrence of the sequence's last `first` tokens ends (`corpus` ends with END, so a position after an
        occurrence is always inside it). Lengths are tried longest first, each pruned when even a path of
        probability 1 could not beat the best."""
        matches = [(first, ends)]
        m = first
        while m < min(self.max_tree_depth, seq.shape[0]):
            back = ends[ends >= m]  # an occurrence one token longer: the token before it matches too
            back = back[corpus[back - m] == seq[-m - 1]]
            if back.size == 0:
                break
            m, ends = m + 1, back
            matches.append((m, ends))
        for m, ends in reversed(matches):
            if self.limit(m, k) > best.score:
                best.offer(*self._path(corpus, ends + 1, self.limit(m, k)))

    def _path(self, corpus: np.ndarray, nxt: np.ndarray, limit: int) -> tuple[list[int], float]:
        """The most frequent continuation from positions `nxt` (each the token after an occurrence), up to `limit`
        tokens while its probability holds; and its score. Ties go to the latest occurrence's token."""
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < limit and nxt.size > 1:
            values = corpus[nxt]
            kinds, counts = np.unique(values, return_counts=True)
            top = counts.max()
            token = int(values[::-1][np.isin(values[::-1], kinds[counts == top])][0])
            if token == END or prob * top / nxt.size < self.min_token_prob:
                return tokens, score
            prob *= top / nxt.size
            tokens.append(token)
            score += prob
            nxt = nxt[values == token] + 1
        if nxt.size == 1 and len(tokens) < limit:  # one occurrence left: its continuation, up to the end marker
            run = corpus[nxt[0]:nxt[0] + limit - len(tokens)]
            stop = np.flatnonzero(run == END)
            run = run[:stop[0]] if stop.size else run
            if prob >= self.min_token_prob:
                tokens.extend(run.tolist())
                score += prob * run.shape[0]
        return tokens, score


class OutputCache:
    """The outputs of the latest `max_requests` finished requests, one token array with END after each, and an
    index from each token pair to where it ends. Evicted outputs stay in the array, unreachable through the index
    (positions below `start`), until they are half of it and the array is rebuilt."""

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self.outputs: deque[np.ndarray] = deque()
        self._rebuild()

    def _rebuild(self) -> None:
        self.corpus = np.concatenate([*(np.append(o, END) for o in self.outputs), np.array([END], dtype=np.int64)])
        self.start, self.pairs = 0, {}
        for at in range(1, self.corpus.shape[0]):
            self._index(at)

    def _index(self, at: int) -> None:
        a, b = int(self.corpus[at - 1]), int(self.corpus[at])
        if a != END and b != END:
            self.pairs.setdefault((a, b), []).append(at)

    def __len__(self) -> int:
        return len(self.outputs)

    def add(self, output: list[int]) -> None:
        """Keep a finished request's output (its first token on: what it generated), evicting the oldest."""
        if self.max_requests <= 0 or len(output) < 2:
            return
        tokens = np.asarray(output, dtype=np.int64)
        self.outputs.append(tokens)
        base = self.corpus.shape[0]  # the corpus ends with END: the new output follows it
        self.corpus = np.concatenate([self.corpus, tokens, np.array([END], dtype=np.int64)])
        for at in range(base + 1, base + tokens.shape[0]):
            self._index(at)
        if len(self.outputs) > self.max_requests:
            self.start += self.outputs.popleft().shape[0] + 1
            if self.start * 2 > self.corpus.shape[0]:
                self._rebuild()

    def occurrences(self, a: int, b: int) -> np.ndarray:
        """Where the pair (a, b) ends in a kept output, the latest LATEST_OCCURRENCES at most."""
        found = self.pairs.get((a, b))
        if not found:
            return np.empty(0, dtype=np.int64)
        ends = np.asarray(found[-LATEST_OCCURRENCES:], dtype=np.int64)
        return ends[ends >= self.start + 1]  # the first kept token is at start + 1 (after the END before it)


class SuffixProposer:
    """Drafts for a request from its own tokens and from the cache of recent outputs."""

    def __init__(self, search: SuffixSearch, max_cached_requests: int):
        self.search = search
        self.cache = OutputCache(max_cached_requests)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k drafted next tokens for a sequence `tokens` (prompt and output so far)."""
        if len(tokens) < 2:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        best = Draft()
        own = np.append(seq, END)  # the request's tokens; the last occurrence (the suffix itself) is excluded
        self.search.search(own, np.flatnonzero(seq[:-1] == seq[-1]), 1, seq, k, best)
        if len(self.cache):
            ends = self.cache.occurrences(int(seq[-2]), int(seq[-1]))
            if ends.size:
                self.search.search(self.cache.corpus, ends, 2, seq, k, best)
        return best.tokens[:k]

    def finished(self, output: list[int]) -> None:
        self.cache.add(output)
