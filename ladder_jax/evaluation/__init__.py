"""Multiple-choice loglikelihood evaluation on the OLMES task files (`python -m ladder_jax.eval`,
`lj.evaluate`): `tasks` reads them, `scoring` gives loglikelihoods, `metrics` accuracies,
`suite` one row per task. docs/evaluation.md."""

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
