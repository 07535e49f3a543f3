"""Prompt-lookup drafting for speculative decoding without a draft model: the tokens that followed
the most recent earlier occurrence of the history's last n tokens are proposed as the next ones,
for the model to verify in one step. Pays where outputs copy their inputs (code edits,
retrieval, quoting); costs nothing but the verification where they do not.

    draft([5, 6, 7, 1, 5, 6], k=2)   # -> [7, 1]: "5 6" occurred before, followed by 7 1

Pure numpy on the host, O(len(history) * max_ngram) per call."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def draft(history: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens of
    `history`, for n from `max_ngram` down to `min_ngram` (the first n that occurs wins); []
    when none occurs or k == 0. The occurrence may overlap the suffix itself."""
    if k < 0:
        raise ValueError(f"draft: k must be >= 0, got {k}")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"draft: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    h = np.asarray(history, dtype=np.int64)
    size = len(h)
    if k == 0 or size < 2:
        return []
    # the end positions of earlier occurrences of the last token (at least one token after)
    last = np.flatnonzero(h[:-1] == h[-1])
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        ends = last[last >= n - 1]
        for j in range(1, n):
            ends = ends[h[ends - j] == h[size - 1 - j]]
        if len(ends):
            end = int(ends[-1])
            return [int(t) for t in h[end + 1 : end + 1 + k]]
    return []
