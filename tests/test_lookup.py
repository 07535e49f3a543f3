"""Prompt-lookup drafting against a brute-force scan of every earlier position."""

import random

import numpy as np
import pytest

from ladder_jax.inference.lookup import draft


def brute_draft(history, k, max_ngram=3, min_ngram=1):
    """For n from max_ngram down: the latest start i with history[i:i+n] equal to the last n
    tokens and at least one token after it; the k tokens after it."""
    if k == 0:
        return []
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = history[len(history) - n :] if n <= len(history) else None
        for i in range(len(history) - n - 1, -1, -1):
            if suffix is not None and history[i : i + n] == suffix:
                return history[i + n : i + n + k]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_random_histories_match_brute_force(seed):
    rng = random.Random(seed)
    found = 0
    for _ in range(600):
        vocab = rng.choice([2, 3, 5, 50])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(0, 6)
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        want = brute_draft(history, k, hi, lo)
        assert draft(history, k, hi, lo) == want, (history, k, hi, lo)
        assert draft(np.array(history, dtype=np.int32), k, hi, lo) == want
        found += bool(want)
    assert found > 100


def test_examples():
    assert draft([5, 6, 7, 1, 5, 6], k=2) == [7, 1]
    # the longer n-gram wins over a more recent shorter one
    assert draft([1, 2, 3, 9, 2, 3, 8, 0, 3, 1, 2, 3], k=2) == [9, 2]
    # the latest occurrence wins; it may overlap the suffix
    assert draft([4, 4, 4, 4], k=3, max_ngram=2) == [4]
    assert draft([1, 2, 3], k=3) == []
    assert draft([1, 2, 1], k=0) == []
    assert draft([], k=3) == [] and draft([7], k=3) == []
    assert draft([1, 2, 1], k=3, min_ngram=2) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="k must be"):
        draft([1, 2], -1)
    with pytest.raises(ValueError, match="min_ngram"):
        draft([1, 2], 1, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="min_ngram"):
        draft([1, 2], 1, min_ngram=0)
