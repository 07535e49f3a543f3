"""`python -m ladder_jax.train [config.yaml ...] [key=value ...]`: the command line of
`ladder_jax.train.trainer` (its docstring says what a run does and writes)."""

from __future__ import annotations

import sys

from ladder_jax.config import ConfigError, TrainConfig, check, load_config, to_yaml
from ladder_jax.train import trainer
from ladder_jax.train.trainer import NonFiniteError, SaveError, init_runtime, run

HELP = """usage: python -m ladder_jax.train [CONFIG.yaml ...] [key=value ...]

YAML files merge left to right, then key=value overrides (dotted keys). Every key and its
default:

"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(HELP + to_yaml(TrainConfig()) + "\n" + trainer.__doc__)
        return 0
    argv = ["benchmark=true" if a == "--benchmark" else a for a in argv]
    try:
        cfg = load_config(argv)
        check(cfg)
        init_runtime(cfg)
        result = run(cfg)
    except ConfigError as e:  # ShardingError, DataError and tokenizer errors included
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except SaveError as e:  # disk full: the last complete checkpoint is intact
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if result.get("exit", "done") in ("done", "interrupted") else 1


if __name__ == "__main__":
    sys.exit(main())
