"""Multiple-choice accuracies as OLMES defines them, with binomial standard errors.

    preds = predictions(loglik, tokens, chars, uncond_loglik)   # {metric: chosen index}
    value, stderr = accuracy([pred == gold for ...])

A doc's choice i has a summed loglikelihood ll_i of its continuation given its context, the
continuation's token count and its character count (the continuation string as the request
gives it, leading space included). The choice picked is the argmax (the first on ties) of:

    acc_raw        ll_i                      the plain sum
    acc_per_token  ll_i / tokens_i           per token (depends on the tokenizer)
    acc_per_char   ll_i / chars_i            per character (OLMES' usual length normalization)
    acc_uncond     ll_i - ll_uncond_i        minus the continuation's loglikelihood after the
                                             bare answer prompt (pointwise mutual information)

acc_uncond exists only where the task has unconditional requests (its config's
`uncond_docid_offset`). A task's accuracy is the mean over docs of (pick == gold); its
standard error the binomial sqrt(p (1 - p) / n).
"""

from __future__ import annotations

import math

import numpy as np

METRICS = ("acc_raw", "acc_per_token", "acc_per_char", "acc_uncond")


def predictions(loglik, tokens, chars, uncond_loglik=None) -> dict[str, int]:
    """The index each metric picks among one doc's choices (module docstring)."""
    ll = np.asarray(loglik, np.float64)
    scores = {
        "acc_raw": ll,
        "acc_per_token": ll / np.asarray(tokens, np.float64),
        "acc_per_char": ll / np.asarray(chars, np.float64),
    }
    if uncond_loglik is not None:
        scores["acc_uncond"] = ll - np.asarray(uncond_loglik, np.float64)
    return {m: int(np.argmax(s)) for m, s in scores.items()}


def accuracy(correct) -> tuple[float, float]:
    """(mean, binomial standard error sqrt(p (1 - p) / n)) of a list of booleans."""
    n = len(correct)
    if n == 0:
        return float("nan"), float("nan")
    p = sum(bool(c) for c in correct) / n
    return p, math.sqrt(p * (1 - p) / n)
