"""The paper's quality claims in miniature (arXiv 2501.06589, sections 4.1 and 4.3), rerunnable
on a CPU: `python benchmarks/paper_quality.py [--quick]`. The design, its controls and its
limits: docs/training.md, 'The paper's quality claims in miniature'.

    results = run(SETTINGS["quick"], "runs/paper_quality/quick")   # JSON-able dicts
    print(table(results)); plots(results, "runs/paper_quality/quick")"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time

import jax
import numpy as np
from matplotlib.figure import Figure

import ladder_jax as lj
from ladder_jax.config import ConfigError
from ladder_jax.experiments import corpora
from ladder_jax.interop.tokenizer import make_tokenizer
from ladder_jax.train import data
from ladder_jax.train.evaluate import held_out_loss, perplexity

SCHEMES = ("standard", "parallel", "ladder")

# The paper's figures (arXiv 2501.06589): Wikitext perplexity after 100B tokens (Table 3), and
# Llama-3.1-8B-Instruct's benchmark average before / after converting layers (Table 5).
PAPER = {
    "scratch_ppl": {
        "1.2B": {"standard": 18.54, "parallel": 18.95, "ladder": 18.42},
        "3.5B": {"standard": 14.48, "parallel": 14.96, "ladder": 14.90},
    },
    "adapt": {
        "original": 56.11,
        "16/32 zero-shot": 41.65,
        "16/32 retrained": 56.5,
        "20/32 retrained": 53.86,
        "gsm8k": (84.99, 10.54),
        "retrain_tokens": "3B",
    },
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One experiment's shapes and budgets (the model is the `tiny` preset, resized)."""

    name: str
    corpus: str = "devils"  # see ladder_jax.experiments.corpora.CORPORA
    n_layers: int = 8
    d_model: int = 64
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 128
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 300
    seeds: tuple = (0, 1, 2)
    peak_lr: float = 3e-3
    warmup_steps: int = 30
    finetune_fraction: float = 0.05  # of the pretraining tokens (the paper: 3B of 100B)
    finetune_lr: float = 1e-3
    adapt_layers: tuple = (0.5, 0.625)  # fractions of n_layers made ladder (upper ones)
    eval_records: int | None = 1024  # held-out records evaluated, evenly spaced (None: all)
    eval_batch: int = 64
    desync: tuple = ()  # reduce patterns of residual="desync" also trained from scratch
    desync_tp: int = 2  # their residual streams (all carried by the one device)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def finetune_steps(self) -> int:
        return max(1, round(self.steps * self.finetune_fraction))

    def variants(self) -> dict[str, dict]:
        """The from-scratch runs of each seed: name -> model overrides (SCHEMES, then a
        "desync-<pattern>" per `desync` pattern)."""
        out = {r: {"residual": r} for r in SCHEMES}
        for p in self.desync:
            out[f"desync-{p}"] = dict(residual="desync", reduce_pattern=p, desync_tp=self.desync_tp)
        return out

    def ladder_counts(self) -> list[int]:
        return sorted(
            {max(1, min(self.n_layers, round(f * self.n_layers))) for f in self.adapt_layers}
        )


SETTINGS = {
    # CI and the notebook: the embedded corpus, 2 seeds, a narrow model, a minute or two.
    "quick": Setting(
        "quick",
        corpus="devils",
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        seq_len=64,
        batch_size=16,
        steps=60,
        seeds=(0, 1),
        warmup_steps=6,
        finetune_fraction=0.1,
        eval_records=256,
    ),
    # docs/results.md's table: the King James Bible, 3 seeds, ~10 minutes on a quiet 2-core CPU
    # (9 runs of 100 steps, 3 fine-tunes of 10). `--set steps=300` for a longer look.
    "full": Setting(
        "full",
        corpus="kjv",
        d_model=64,
        seq_len=128,
        batch_size=16,
        steps=100,
        seeds=(0, 1, 2),
        warmup_steps=10,
        finetune_fraction=0.1,
        eval_records=256,
    ),
}


def with_changes(setting: Setting, **changes) -> Setting:
    """`setting` with fields replaced; unknown fields are a ConfigError naming them."""
    new = replace_fields(setting, **changes)
    if new.corpus not in corpora.CORPORA:
        raise ConfigError(
            f"unknown corpus {new.corpus!r}: choose one of {', '.join(corpora.CORPORA)}"
        )
    if new.steps <= 0 or new.batch_size <= 0 or new.seq_len <= 0 or not new.seeds:
        raise ConfigError("steps, batch_size and seq_len must be positive and seeds not empty")
    return new


def parse_set(items: list[str], example: str) -> dict:
    """{field: YAML value} from a runner's `--set FIELD=VALUE` flags; a malformed one is a
    ConfigError that shows `example`.

        with_changes(setting, **parse_set(args.set, "steps=8"))"""
    import yaml

    changes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: write FIELD=VALUE, e.g. {example}")
        changes[key] = yaml.safe_load(value)
    return changes


def replace_fields(setting, **changes):
    """The frozen dataclass `setting` with fields replaced, each of its default's type (a
    list for a tuple, an int for a float; None only where the default is None or for
    `eval_records`); an unknown field or a wrong type is a ConfigError naming it."""
    fields = {f.name for f in dataclasses.fields(setting)} - {"name"}
    bad = sorted(set(changes) - fields)
    if bad:
        raise ConfigError(
            f"unknown setting field {bad[0]!r}: choose from {', '.join(sorted(fields))}"
        )
    for key, value in changes.items():
        default = getattr(setting, key)
        if isinstance(default, tuple) and isinstance(value, (list, tuple)):
            changes[key] = tuple(value)
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            changes[key] = float(value)
        elif isinstance(value, bool) != isinstance(default, bool) or not (
            isinstance(value, type(default)) or (key == "eval_records" and value is None)
        ):
            raise ConfigError(
                f"setting field {key}={value!r} must be {type(default).__name__}, like {default!r}"
            )
    return dataclasses.replace(setting, **changes)


class Experiment:
    """The runs of one setting under `out`; `emit` receives every result dict as it comes."""

    def __init__(
        self, setting: Setting, out: str, *, emit=None, log=None, fresh=False, trainer_out=None
    ):
        self.s, self.out = setting, out
        self.emit = emit or (lambda r: None)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.trainer_out = trainer_out  # where the trainer's lines go (None: stderr)
        if setting.corpus not in corpora.CORPORA:
            raise ConfigError(
                f"unknown corpus {setting.corpus!r}: choose one of {', '.join(corpora.CORPORA)}"
            )
        for k in setting.ladder_counts():
            lj.ModelConfig.from_preset(
                "tiny", **self.model_fields(), residual="ladder", ladder_layers=k
            )  # bad shapes fail before any work
        for fields in setting.variants().values():
            lj.ModelConfig.from_preset("tiny", **self.model_fields(), **fields)
        docs = corpora.documents(setting.corpus)
        if fresh and os.path.isdir(os.path.join(out, "runs")):
            shutil.rmtree(os.path.join(out, "runs"))
        self.corpus = corpora.write(docs, os.path.join(out, "data", setting.corpus))
        self.held_out = data.load_tokens(self.corpus["held_out"], make_tokenizer("byte"))
        self.mesh = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])

    def model_fields(self) -> dict:
        return self.model_fields_of(self.s)

    @staticmethod
    def model_fields_of(s: Setting) -> dict:
        return dict(
            n_layers=s.n_layers,
            d_model=s.d_model,
            n_heads=s.n_heads,
            n_kv_heads=s.n_kv_heads,
            d_ff=s.d_ff,
            max_seq_len=max(256, s.seq_len),
        )

    def fit(
        self,
        name: str,
        *,
        steps: int,
        seed: int,
        data_seed: int,
        peak_lr: float,
        warmup: int,
        **overrides,
    ) -> lj.Run:
        """One training run through `ladder_jax.fit`; the trainer's lines go to the log."""
        s = self.s
        model = {f"model__{k}": v for k, v in self.model_fields().items()}
        with contextlib.redirect_stdout(self.trainer_out or sys.stderr):
            run = lj.fit(
                None,
                name=name,
                run_dir=os.path.join(self.out, "runs"),
                steps=steps,
                seed=seed,
                log_every=10**9,
                eval_every=0,
                ckpt_every=0,
                keep=1,
                async_ckpt=False,
                progress="none",
                tensorboard=False,
                model__preset="tiny",
                model__dtype="float32",
                **model,
                data__path=self.corpus["train"],
                data__seq_len=s.seq_len,
                data__batch_size=s.batch_size,
                data__eval_fraction=0.0,
                data__seed=data_seed,
                optim__peak_lr=peak_lr,
                optim__warmup_steps=warmup,
                mesh__tp=1,
                mesh__data=1,
                **overrides,
            )
        if run.result.get("exit") != "done":  # SIGTERM / Ctrl-C: the trainer saved and returned
            raise KeyboardInterrupt(f"{run.path} stopped at step {run.result.get('step')}")
        return run

    def loss(self, model, run_path: str, tag: str = "") -> float:
        """Held-out loss of `model`, cached in `run_path` (a rerun, or another process
        sharing `out`, reuses it; the cache is keyed by the evaluation's settings and the
        run's latest checkpoint, so a run trained further is evaluated again)."""
        s = self.s
        ckpts = os.path.join(run_path, "checkpoints")
        step = (
            max((int(d) for d in os.listdir(ckpts) if d.isdigit()), default=0)
            if (os.path.isdir(ckpts))
            else 0
        )
        key = f"held_out{tag}_{s.corpus}_T{s.seq_len}_n{s.eval_records}_step{step}.json"
        cache = os.path.join(run_path, key)
        if os.path.isfile(cache):
            with open(cache) as f:
                return json.load(f)["loss"]
        loss = held_out_loss(
            model, self.held_out, seq_len=s.seq_len, batch=s.eval_batch, max_records=s.eval_records
        )
        with open(cache, "w") as f:
            json.dump({"loss": loss}, f)
        return loss

    def scratch(self, seeds) -> list[dict]:
        """Every scheme x seed from scratch (schemes interleaved within a seed)."""
        s, rows = self.s, []
        for seed in seeds:
            for residual, fields in s.variants().items():
                t0 = time.perf_counter()
                run = self.fit(
                    f"{residual}-seed{seed}",
                    steps=s.steps,
                    seed=seed,
                    data_seed=seed,
                    peak_lr=s.peak_lr,
                    warmup=s.warmup_steps,
                    **{f"model__{k}": v for k, v in fields.items()},
                )
                model, _ = lj.load(run.path, mesh=self.mesh)
                loss = self.loss(model, run.path)
                curve = [r["loss"] for r in run.metrics if "loss" in r]
                row = {
                    "kind": "scratch",
                    "setting": s.name,
                    "corpus": s.corpus,
                    "residual": residual,
                    "seed": seed,
                    "steps": s.steps,
                    "tokens": s.steps * s.tokens_per_step,
                    "params": model.config.num_params(),
                    "held_out_loss": loss,
                    "held_out_ppl": perplexity(loss),
                    "train_loss_last": curve[-1],
                    "curve": curve,
                    "run": run.path,
                    "wall_s": round(time.perf_counter() - t0, 1),
                    **({"desync_tp": s.desync_tp} if fields["residual"] == "desync" else {}),
                }
                self.log(
                    f"scratch {residual:<9} seed {seed}: held-out loss {loss:.4f} "
                    f"(ppl {perplexity(loss):.3f}), {row['wall_s']} s"
                )
                self.emit(row)
                rows.append(row)
        return rows

    def adapt(self, base: dict) -> list[dict]:
        """Upper layers of the standard run `base` made ladder: zero-shot, then fine-tuned;
        and the control, the standard model fine-tuned on the same tokens."""
        s, rows = self.s, []
        model, _ = lj.load(base["run"], mesh=self.mesh)
        steps, seed = s.finetune_steps, base["seed"]
        tune = dict(
            steps=steps,
            seed=seed,
            data_seed=1000 + seed,
            peak_lr=s.finetune_lr,
            warmup=max(1, steps // 10),
            init_from=base["run"],
        )
        t0 = time.perf_counter()
        control_run = self.fit("adapt-standard", model__residual="standard", **tune)
        control = self.loss(lj.load(control_run.path, mesh=self.mesh)[0], control_run.path)
        self.log(f"adapt control (standard fine-tuned {steps} steps): {control:.4f}")
        for k in s.ladder_counts():
            zero_shot = self.loss(
                lj.with_config(model, residual="ladder", ladder_layers=k),
                base["run"],
                tag=f"_ladder{k}",
            )
            run = self.fit(
                f"adapt-ladder{k}", model__residual="ladder", model__ladder_layers=k, **tune
            )
            tuned_model, _ = lj.load(run.path, mesh=self.mesh)
            assert tuned_model.config.ladder_layers == k
            tuned = self.loss(tuned_model, run.path)
            row = {
                "kind": "adapt",
                "setting": s.name,
                "corpus": s.corpus,
                "seed": seed,
                "ladder_layers": k,
                "n_layers": s.n_layers,
                "base_loss": base["held_out_loss"],
                "zero_shot_loss": zero_shot,
                "finetuned_loss": tuned,
                "control_loss": control,
                "finetune_steps": steps,
                "finetune_tokens": steps * s.tokens_per_step,
                "pretrain_tokens": base["tokens"],
                "finetune_share": steps / s.steps,
                "curve": [r["loss"] for r in run.metrics if "loss" in r],
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            self.log(
                f"adapt ladder {k}/{s.n_layers}: original {row['base_loss']:.4f}, "
                f"zero-shot {zero_shot:.4f}, fine-tuned {tuned:.4f} (control "
                f"{control:.4f})"
            )
            self.emit(row)
            rows.append(row)
            t0 = time.perf_counter()
        return rows


def run(
    setting: Setting,
    out: str,
    *,
    emit=None,
    log=None,
    fresh: bool = False,
    adapt: bool = True,
    trainer_out=None,
) -> list[dict]:
    """The whole experiment: every result dict (kinds "corpus", "scratch", "adapt", "summary",
    "claim", "done"); `emit` gets each as soon as it is known. The first seed's runs come
    first, then the adaptation of its standard model, then the other seeds. `adapt=False`
    skips the adaptation (e.g. one process per seed sharing `out`: a last full run then finds
    every run done and every loss cached). `log` gets the progress lines (default: stderr),
    `trainer_out` (a stream) the trainer's."""
    emit = emit or (lambda r: None)
    t0 = time.perf_counter()
    exp = Experiment(setting, out, emit=emit, log=log, fresh=fresh, trainer_out=trainer_out)
    results = [
        {
            "kind": "corpus",
            "setting": setting.name,
            "corpus": setting.corpus,
            "setup": dataclasses.asdict(setting),
            **{k: v for k, v in exp.corpus.items() if k not in ("train", "held_out")},
            "held_out_tokens": int(len(exp.held_out)),
        }
    ]
    emit(results[0])
    scratch = exp.scratch(setting.seeds[:1])
    results += scratch
    if adapt:
        results += exp.adapt(next(r for r in scratch if r["residual"] == "standard"))
    rest = exp.scratch(setting.seeds[1:])
    results += rest
    scratch += rest
    for row in summarize(scratch):
        emit(row)
        results.append(row)
    for row in claims(results):
        emit(row)
        results.append(row)
    done = {"kind": "done", "setting": setting.name, "wall_s": round(time.perf_counter() - t0, 1)}
    emit(done)
    results.append(done)
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    return results


def collect(setting: Setting, out: str) -> list[dict]:
    """The results of the runs under `out` that are finished and evaluated, read from disk
    (metrics.jsonl, the cached held-out losses): no training, no jax work. For a report while
    runs are still going, or after they ran in several processes; a scheme may then have fewer
    seeds (its "summary" says how many)."""
    s = setting
    runs = os.path.join(out, "runs")

    def cached(path, tag=""):
        ckpts = os.path.join(path, "checkpoints")
        if not os.path.isdir(ckpts):
            return None
        step = max((int(d) for d in os.listdir(ckpts) if d.isdigit()), default=0)
        f = os.path.join(
            path, f"held_out{tag}_{s.corpus}_T{s.seq_len}_n{s.eval_records}_step{step}.json"
        )
        if not os.path.isfile(f):
            return None
        with open(f) as fh:
            return json.load(fh)["loss"]

    def curve(path):
        return [r["loss"] for r in lj.Run(path, {}).metrics if "loss" in r]

    params = lj.ModelConfig.from_preset("tiny", **Experiment.model_fields_of(s)).num_params()
    results, scratch = (
        [{"kind": "corpus", "setting": s.name, "corpus": s.corpus, "setup": dataclasses.asdict(s)}],
        [],
    )
    for seed in s.seeds:
        for residual in s.variants():
            path = os.path.join(runs, f"{residual}-seed{seed}")
            loss = cached(path)
            if loss is None:
                continue
            c = curve(path)
            scratch.append(
                {
                    "kind": "scratch",
                    "setting": s.name,
                    "corpus": s.corpus,
                    "residual": residual,
                    "seed": seed,
                    "steps": len(c),
                    "tokens": len(c) * s.tokens_per_step,
                    "params": params,
                    "held_out_loss": loss,
                    "held_out_ppl": perplexity(loss),
                    "train_loss_last": c[-1],
                    "curve": c,
                    "run": path,
                }
            )
    base = os.path.join(runs, f"standard-seed{s.seeds[0]}")
    control = cached(os.path.join(runs, "adapt-standard"))
    for k in s.ladder_counts():
        path = os.path.join(runs, f"adapt-ladder{k}")
        zero, tuned, b = cached(base, f"_ladder{k}"), cached(path), cached(base)
        if None in (zero, tuned, b, control):
            continue
        c = curve(path)
        results.append(
            {
                "kind": "adapt",
                "setting": s.name,
                "corpus": s.corpus,
                "seed": s.seeds[0],
                "ladder_layers": k,
                "n_layers": s.n_layers,
                "base_loss": b,
                "zero_shot_loss": zero,
                "finetuned_loss": tuned,
                "control_loss": control,
                "finetune_steps": len(c),
                "finetune_tokens": len(c) * s.tokens_per_step,
                "pretrain_tokens": s.steps * s.tokens_per_step,
                "finetune_share": len(c) / s.steps,
                "curve": c,
            }
        )
    results += scratch
    results += summarize(scratch)
    results += claims(results)
    return results


def _spread(values) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def summarize(scratch: list[dict]) -> list[dict]:
    """One "summary" row per scheme (or desync variant): mean and spread over seeds, and the
    paired difference from standard (same seed: same init and data order)."""
    names = list(dict.fromkeys([*SCHEMES, *(x["residual"] for x in scratch)]))
    by = {r: {x["seed"]: x["held_out_loss"] for x in scratch if x["residual"] == r} for r in names}
    rows = []
    for r in names:
        losses = list(by[r].values())
        if not losses:
            continue
        diffs = [by[r][k] - by["standard"][k] for k in by[r] if k in by["standard"]]
        paper = {size: v.get(r, "-") for size, v in PAPER["scratch_ppl"].items()}
        rows.append(
            {
                "kind": "summary",
                "residual": r,
                "seeds": len(losses),
                "loss_mean": float(np.mean(losses)),
                "loss_std": _spread(losses),
                "loss_min": float(np.min(losses)),
                "loss_max": float(np.max(losses)),
                "ppl_mean": perplexity(float(np.mean(losses))),
                "vs_standard_loss": float(np.mean(diffs)),
                "vs_standard_loss_std": _spread(diffs),
                "vs_standard_ppl_ratio": float(np.exp(np.mean(diffs))),
                "paper_wikitext_ppl": paper,
            }
        )
    return rows


def verdict(difference: float, margin: float, *, within: float | None = None) -> str:
    """ "yes", "no" or "inconclusive" for a measured `difference` whose uncertainty is `margin`
    (the seeds' spread). A claim that something is larger (`within=None`): "yes" only when
    the difference exceeds its margin, "no" when it is below minus the margin. A claim that
    two things match to within `within`: "yes" only when the whole interval difference +-
    margin lies inside +-within, "no" when it lies wholly outside. Never "yes" on a
    difference the spread covers.

        verdict(0.0004, 0.01)   # 'inconclusive'"""
    if within is None:
        return "yes" if difference > margin else "no" if difference < -margin else ("inconclusive")
    if abs(difference) + margin <= within:
        return "yes"
    return "no" if abs(difference) - margin > within else "inconclusive"


def claims(results: list[dict]) -> list[dict]:
    """Each of the paper's claims beside the measured figure; "reproduces" is `verdict`'s
    "yes", "no" or "inconclusive" (a difference within the seeds' spread). The margin is that
    spread: 2 x the standard deviation of the paired (same-seed) loss differences, at least
    0.005 nats (one seed has no spread to measure)."""
    summ = {r["residual"]: r for r in results if r["kind"] == "summary"}
    adapt = sorted((r for r in results if r["kind"] == "adapt"), key=lambda r: r["ladder_layers"])
    if not set(SCHEMES) <= set(summ):
        return []
    st, pa, la = summ["standard"], summ["parallel"], summ["ladder"]
    margin = max(2 * la["vs_standard_loss_std"], 2 * pa["vs_standard_loss_std"], 0.005)
    out = []

    def claim(name, paper, measured, holds):
        out.append(
            {
                "kind": "claim",
                "claim": name,
                "paper": paper,
                "measured": f"{measured}; margin {margin:.4f}",
                "reproduces": holds,
            }
        )

    p1, p3 = PAPER["scratch_ppl"]["1.2B"], PAPER["scratch_ppl"]["3.5B"]
    d = la["vs_standard_loss"]
    claim(
        "ladder matches standard from scratch",
        f"ladder / standard Wikitext ppl {p1['ladder']} / {p1['standard']} (1.2B), "
        f"{p3['ladder']} / {p3['standard']} (3.5B): within 3%",
        f"ladder - standard held-out loss {d:+.4f} nats (ppl x{np.exp(d):.3f}) over "
        f"{la['seeds']} seeds, paired spread {la['vs_standard_loss_std']:.4f}",
        verdict(d, margin, within=float(np.log(1.03))),
    )
    worse = [
        verdict(pa["loss_mean"] - st["loss_mean"], margin),
        verdict(pa["loss_mean"] - la["loss_mean"], margin),
    ]
    claim(
        "parallel is worse than both",
        f"parallel {p1['parallel']} vs {p1['standard']} / {p1['ladder']} (1.2B), "
        f"{p3['parallel']} vs {p3['standard']} / {p3['ladder']} (3.5B)",
        f"parallel - standard {pa['vs_standard_loss']:+.4f}, parallel - ladder "
        f"{pa['loss_mean'] - la['loss_mean']:+.4f} nats",
        "no" if "no" in worse else "inconclusive" if "inconclusive" in worse else "yes",
    )
    a = PAPER["adapt"]
    if adapt:
        half = adapt[0]
        claim(
            "converting the upper half zero-shot hurts",
            f"benchmark average {a['original']} -> {a['16/32 zero-shot']} (GSM8K "
            f"{a['gsm8k'][0]} -> {a['gsm8k'][1]}), upper 16 of 32 layers",
            f"held-out loss {half['base_loss']:.4f} -> {half['zero_shot_loss']:.4f} "
            f"({half['zero_shot_loss'] - half['base_loss']:+.4f} nats), upper "
            f"{half['ladder_layers']} of {half['n_layers']}",
            verdict(half["zero_shot_loss"] - half["base_loss"], margin),
        )
        gap = half["finetuned_loss"] - half["base_loss"]
        recovered = verdict(half["zero_shot_loss"] - half["finetuned_loss"], margin)
        claim(
            "a few % of the tokens recover it",
            f"{a['retrain_tokens']} tokens (3% of pretraining): back to ~{a['16/32 retrained']}"
            f" (original {a['original']})",
            f"after {half['finetune_share']:.0%} of the tokens: {half['finetuned_loss']:.4f} "
            f"vs original {half['base_loss']:.4f} ({gap:+.4f}); standard fine-tuned alike: "
            f"{half['control_loss']:.4f}",
            "no" if gap > margin else recovered,
        )
    if len(adapt) > 1:
        more = adapt[-1]
        claim(
            "more converted layers recover less",
            f"20 of 32 layers retrained: {a['20/32 retrained']} vs ~{a['16/32 retrained']} "
            f"for 16 of 32",
            f"{more['ladder_layers']} of {more['n_layers']}: {more['finetuned_loss']:.4f} vs "
            f"{half['ladder_layers']} of {half['n_layers']}: {half['finetuned_loss']:.4f} "
            f"(zero-shot {more['zero_shot_loss']:.4f} vs {half['zero_shot_loss']:.4f})",
            verdict(more["finetuned_loss"] - half["finetuned_loss"], margin),
        )
    return out


def table(results: list[dict]) -> str:
    """The results as Markdown: held-out loss per scheme, adaptation, claims."""
    summ = [r for r in results if r["kind"] == "summary"]
    adapt = [r for r in results if r["kind"] == "adapt"]
    lines = [
        "| scheme | held-out loss (mean ± sd) | per-byte ppl | vs standard (paired) | "
        "paper Wikitext ppl 1.2B / 3.5B |",
        "|---|---|---|---|---|",
    ]
    for r in summ:
        p = r["paper_wikitext_ppl"]
        lines.append(
            f"| {r['residual']} | {r['loss_mean']:.4f} ± {r['loss_std']:.4f} "
            f"(n={r['seeds']}) | {r['ppl_mean']:.3f} | {r['vs_standard_loss']:+.4f} ± "
            f"{r['vs_standard_loss_std']:.4f} | {p['1.2B']} / {p['3.5B']} |"
        )
    if adapt:
        lines += [
            "",
            "| converted (upper) | original | zero-shot | fine-tuned | standard "
            "fine-tuned alike | fine-tune tokens |",
            "|---|---|---|---|---|---|",
        ]
        for r in adapt:
            lines.append(
                f"| {r['ladder_layers']} of {r['n_layers']} | {r['base_loss']:.4f} | "
                f"{r['zero_shot_loss']:.4f} | {r['finetuned_loss']:.4f} | "
                f"{r['control_loss']:.4f} | {r['finetune_tokens']:,} "
                f"({r['finetune_share']:.0%}) |"
            )
    cl = [r for r in results if r["kind"] == "claim"]
    if cl:
        lines += [
            "",
            "| the paper's claim | paper | measured here | reproduces |",
            "|---|---|---|---|",
        ]
        for r in cl:
            lines.append(f"| {r['claim']} | {r['paper']} | {r['measured']} | {r['reproduces']} |")
    return "\n".join(lines)


def smooth(y, k):
    """`y`'s running mean over `k` points (as it is when k <= 1 or `y` is shorter)."""
    y = np.asarray(y, float)
    if k <= 1 or len(y) < k:
        return y
    return np.convolve(y, np.ones(k) / k, mode="valid")


def plots(results: list[dict], out: str) -> list[str]:
    """curves.png (training loss per scheme, mean over seeds with its min-max band) and
    held_out.png (held-out loss per scheme and seed; adaptation). Returns the paths."""
    scratch = [r for r in results if r["kind"] == "scratch"]
    adapt = [r for r in results if r["kind"] == "adapt"]
    names = list(dict.fromkeys([*SCHEMES, *(r["residual"] for r in scratch)]))
    colors = dict(zip(names, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    colors = {r: colors.get(r, "tab:gray") for r in names}
    steps = max(len(r["curve"]) for r in scratch)
    k = max(1, steps // 20)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for residual in names:
        curves = np.array([smooth(r["curve"], k) for r in scratch if r["residual"] == residual])
        if not len(curves):
            continue
        x = np.arange(curves.shape[1]) + k
        ax.plot(x, curves.mean(0), label=residual, color=colors[residual])
        ax.fill_between(x, curves.min(0), curves.max(0), color=colors[residual], alpha=0.2)
    n = sorted({sum(r["residual"] == x for r in scratch) for x in names})
    ax.set(
        xlabel="step",
        ylabel=f"training loss (nats/byte, mean of {k} steps)",
        title=f"From scratch: {'-'.join(map(str, n))} seeds per scheme",
    )
    lo = min(float(np.min(smooth(r["curve"], k))) for r in scratch)
    ax.set_ylim(lo - 0.05, lo + 1.0)
    ax.legend()
    fig.tight_layout()
    paths = [os.path.join(out, "curves.png")]
    fig.savefig(paths[0], dpi=100)

    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    for i, residual in enumerate(names):
        ys = [r["held_out_loss"] for r in scratch if r["residual"] == residual] or [np.nan]
        ax1.bar(i, np.mean(ys), color=colors[residual], alpha=0.5)
        ax1.scatter([i] * len(ys), ys, color="k", s=12, zorder=3)
    ys = [r["held_out_loss"] for r in scratch]
    ax1.set_ylim(min(ys) - 0.05, max(ys) + 0.05)
    ax1.set_xticks(range(len(names)), names)
    if len(names) > len(SCHEMES):
        ax1.tick_params(axis="x", labelrotation=15, labelsize=8)
    ax1.set(ylabel="held-out loss (nats/byte)", title="From scratch (dots: seeds)")
    if adapt:
        labels = ["original", "zero-shot", "fine-tuned", "standard\nfine-tuned"]
        w = 0.8 / len(adapt)
        for j, r in enumerate(adapt):
            vals = [r["base_loss"], r["zero_shot_loss"], r["finetuned_loss"], r["control_loss"]]
            ax2.bar(
                np.arange(4) + j * w,
                vals,
                w,
                label=f"upper {r['ladder_layers']} of {r['n_layers']} ladder",
            )
        allv = [
            v
            for r in adapt
            for v in (r["base_loss"], r["finetuned_loss"], r["control_loss"], r["zero_shot_loss"])
        ]
        ax2.set_ylim(min(allv) - 0.1, max(allv) + 0.1)
        ax2.set_xticks(np.arange(4) + w * (len(adapt) - 1) / 2, labels)
        ax2.set(ylabel="held-out loss (nats/byte)", title="Adapting the standard model")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "held_out.png"))
    fig.savefig(paths[1], dpi=100)
    return paths
