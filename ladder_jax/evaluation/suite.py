"""Evaluate a model on several tasks: tokenize, score (one `Scorer` for all), pick, count; one
row per task with every metric it supports, its standard error, and which one is primary.

    results = run(model, tokenizer, [load_task("piqa").subsample(100, seed=0)])
    print(results)                                       # the table"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import jax

from ladder_jax.config import ConfigError
from ladder_jax.evaluation.metrics import METRICS, accuracy, predictions
from ladder_jax.evaluation.scoring import Scorer, encode_pair
from ladder_jax.evaluation.tasks import DEFAULT_REGIME, DEFAULT_TASKS, Task, load_task
from ladder_jax.loading import load_model
from ladder_jax.model import layout


class EvalResults:
    """Per-task rows of an evaluation (`.rows`: dicts, also what --output writes); printed
    as a table with the primary metric marked."""

    columns = (
        "task",
        "regime",
        "docs",
        "primary",
        "acc_raw",
        "acc_per_token",
        "acc_per_char",
        "acc_uncond",
        "s",
    )

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __getitem__(self, task: str) -> dict:
        for r in self.rows:
            if r["task"] == task:
                return r
        raise KeyError(f"no task {task!r} here (these: {', '.join(r['task'] for r in self.rows)})")

    def table_rows(self) -> list[tuple]:
        out = []
        for r in self.rows:
            cells = []
            for m in METRICS:
                if r.get(m) is None:
                    cells.append("-")
                else:
                    mark = "*" if m == r["primary_metric"] else ""
                    cells.append(f"{100 * r[m]:.1f} ± {100 * r[m + '_stderr']:.1f}{mark}")
            out.append(
                (
                    r["task"],
                    r["regime"],
                    str(r["docs"]),
                    r["primary_metric"],
                    *cells,
                    f"{r['seconds']:.0f}",
                )
            )
        return out

    def __repr__(self):
        rows = [self.columns] + self.table_rows()
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.columns))]
        text = "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows
        )
        return text + "\naccuracy in % ± binomial standard error; * the regime's primary metric"

    def _repr_html_(self):
        head = "".join(f"<th>{c}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in self.table_rows()
        )
        return (
            f"<table><tr>{head}</tr>{body}</table><p>accuracy in % ± binomial standard "
            f"error; * the regime's primary metric</p>"
        )


def run(
    model,
    tokenizer,
    tasks: Sequence[Task],
    *,
    batch_size: int = 32,
    progress: Callable[[str, int, int], None] | None = None,
) -> EvalResults:
    """Scores every task's requests with `model` and returns the rows; `progress(task, done,
    total)` follows the requests of each task."""
    scorer = Scorer(model)
    rows = []
    for task in tasks:
        t0 = time.perf_counter()
        pairs, where = [], []  # where[k] = (doc index, "cond" / "uncond", choice)
        for d, doc in enumerate(task.docs):
            for kind, choices in (("cond", doc.choices), ("uncond", doc.uncond)):
                for i, (ctx, cont) in enumerate(choices or ()):
                    pairs.append(encode_pair(tokenizer, ctx, cont))
                    where.append((d, kind, i))
        done = 0

        def step(n, task=task, total=len(pairs)):
            nonlocal done
            done += n
            if progress is not None:
                progress(task.name, done, total)

        if progress is not None:
            progress(task.name, 0, len(pairs))
        scores = scorer.score(pairs, batch_size=batch_size, progress=step)
        ll = {key: s for key, s in zip(where, scores)}
        correct: dict[str, list[bool]] = {}
        for d, doc in enumerate(task.docs):
            n = len(doc.choices)
            picks = predictions(
                [ll[d, "cond", i].logprob for i in range(n)],
                [ll[d, "cond", i].tokens for i in range(n)],
                [len(cont) for _, cont in doc.choices],
                [ll[d, "uncond", i].logprob for i in range(n)] if doc.uncond else None,
            )
            for m, pick in picks.items():
                correct.setdefault(m, []).append(pick == doc.gold)
        row = {
            "task": task.name,
            "regime": task.regime,
            "docs": len(task.docs),
            "total_docs": task.total_docs,
            "requests": len(pairs),
            "primary_metric": task.primary_metric,
        }
        for m in METRICS:
            value, err = accuracy(correct[m]) if m in correct else (None, None)
            row[m], row[m + "_stderr"] = value, err
        row["primary"] = row[task.primary_metric]
        row["primary_stderr"] = row[task.primary_metric + "_stderr"]
        # per doc, in `task.docs` order: 1 where the primary metric picked the gold choice
        # (two models scored on the same docs compare paired, doc by doc)
        row["primary_correct"] = [int(c) for c in correct[task.primary_metric]]
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return EvalResults(rows)


def task_names(tasks) -> list[str]:
    """ "a,b" or a sequence of names -> a list of names (no duplicates, none empty)."""
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    if not names or any(not isinstance(t, str) or not t for t in names):
        raise ConfigError(f"tasks {tasks!r}: give task names, e.g. arc_easy,piqa")
    if len(set(names)) != len(names):
        raise ConfigError(f"tasks {tasks!r} names a task twice")
    return names


def load_tasks(
    tasks=DEFAULT_TASKS,
    regime: str = DEFAULT_REGIME,
    *,
    limit: int | None = None,
    seed: int = 0,
    tasks_dir: str | None = None,
) -> list[Task]:
    """The named tasks in `regime`, each subsampled to `limit` docs with `seed`."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit {limit!r}: give a number of docs, at least 1")
    return [load_task(t, regime, tasks_dir).subsample(limit, seed) for t in task_names(tasks)]


def eval_mesh(tp: int | None = None, *, flag: str = "tp", say=None):
    """A mesh of the first `tp` devices (data 1, `layout.tp_mesh`): default 1 on a CPU host,
    every device elsewhere. `say` gets a note when an explicit `tp` leaves devices idle."""
    devices = jax.devices()
    if tp is None:
        tp, say = (1 if devices[0].platform == "cpu" else len(devices)), None
    return layout.tp_mesh(tp, flag=flag, say=say)


def evaluate(
    model,
    tokenizer=None,
    *,
    tasks=DEFAULT_TASKS,
    regime: str = DEFAULT_REGIME,
    limit: int | None = None,
    seed: int = 0,
    batch_size: int = 32,
    tasks_dir: str | None = None,
    tp: int | None = None,
    quantize: str | None = None,
    progress=None,
    **overrides,
) -> EvalResults:
    """`model`: a Transformer (with its `tokenizer`) or a path `load_model` opens, loaded on
    `eval_mesh(tp)` with `quantize` and `overrides` (residual=, ladder_layers=). The tasks
    are read (and checked) before any model is loaded."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size {batch_size!r}: give at least 1")
    chosen = load_tasks(tasks, regime, limit=limit, seed=seed, tasks_dir=tasks_dir)
    if isinstance(model, (str, os.PathLike)):
        model, loaded = load_model(
            model, mesh=eval_mesh(tp), what="evaluate", quantize=quantize, **overrides
        )
        tokenizer = tokenizer or loaded
    elif quantize is not None or overrides or tp is not None:
        raise ConfigError(
            "quantize, tp, residual and ladder_layers apply to a model loaded "
            "from a path: give the path, or change the model yourself"
        )
    if tokenizer is None:
        raise ConfigError("this model has no tokenizer: pass tokenizer=")
    return run(model, tokenizer, chosen, batch_size=batch_size, progress=progress)
