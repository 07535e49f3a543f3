"""`python -m ladder_jax.train [config.yaml ...] [key=value ...]`: the command line of
`ladder_jax.train.trainer` (its docstring says what a run does and writes)."""

from __future__ import annotations

import sys
import textwrap

import jax

from ladder_jax import compile_cache, processes
from ladder_jax.config import UsageError
from ladder_jax.train.trainer import NonFiniteError, SaveError, init_runtime, run
from ladder_jax.train_config import check, help_rows, load_config

USAGE = """usage: python -m ladder_jax.train [CONFIG.yaml ...] [key=value ...]

YAML files merge left to right, then key=value overrides (dotted keys), e.g.
    python -m ladder_jax.train configs/tiny.yaml model.residual=ladder name=tiny-ladder
Every key, its default and what it sets (model.* null: the preset's value):
"""

NOTES = """
Writes <run_dir>/<name>/: config.yaml, metrics.jsonl, checkpoints/ (and tensorboard/ with the
tensorboard extra). Running the same command again resumes from the latest checkpoint (a
changed model, data or optimizer key is refused unless accept_changes=true); SIGTERM or Ctrl-C
saves and exits 0. Exit codes: 2 a bad config or data (one line), 3 too many non-finite steps.
benchmark=true times every residual scheme instead of training. Compiled programs are kept in
JAX's persistent compilation cache (the user cache directory, or $LADDER_COMPILE_CACHE; off
there or with --no-compile-cache). More: ladder_jax.train.trainer.
"""


def _default(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def help_text(columns: int = 100) -> str:
    """`--help`: every key of the schema with its default and description, then the notes."""
    rows = help_rows()
    width = max(len(k) for k, _, _, section in rows if not section) + 2
    indent = " " * (2 + width + 11)
    lines = []
    for key, default, text, section in rows:
        if section:
            lines.append(f"\n{key}: {text}")
            continue
        head = f"  {key:<{width}}{_default(default):<10} "
        lines.append(
            textwrap.fill(
                text,
                columns,
                initial_indent=head.ljust(len(indent)),
                subsequent_indent=indent,
                break_on_hyphens=False,
            )
        )
    return USAGE + "\n".join(lines) + "\n" + NOTES


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(), end="")
        return 0
    argv = ["benchmark=true" if a == "--benchmark" else a for a in argv]
    no_cache = "--no-compile-cache" in argv
    argv = [a for a in argv if a != "--no-compile-cache"]
    try:
        cfg = load_config(argv)
        check(cfg)
        init_runtime(cfg)
        compile_cache.enable(off=no_cache)
        result = run(cfg)
    except UsageError as e:  # ShardingError, DataError, RunBusy and tokenizer errors
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except SaveError as e:  # disk full: the last complete checkpoint is intact
        print(f"error: {e}", file=sys.stderr)
        return 1
    except jax.errors.JaxRuntimeError as e:  # several processes: a peer died, one line
        processes.collective_failed(e)
        raise
    return 0 if result.get("exit", "done") in ("done", "interrupted") else 1


if __name__ == "__main__":
    sys.exit(main())
