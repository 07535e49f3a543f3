"""Multiple-choice accuracies as OLMES defines them (acc_raw, acc_per_token, acc_per_char,
acc_uncond), with binomial standard errors. docs/evaluation.md, 'What the metrics mean'.

    preds = predictions(loglik, tokens, chars, uncond_loglik)   # {metric: chosen index}
    value, stderr = accuracy([pred == gold for ...])"""

from __future__ import annotations

import math

import numpy as np

METRICS = ("acc_raw", "acc_per_token", "acc_per_char", "acc_uncond")


def predictions(loglik, tokens, chars, uncond_loglik=None) -> dict[str, int]:
    """The index each metric picks among one doc's choices (docs/evaluation.md, 'What the
    metrics mean')."""
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
