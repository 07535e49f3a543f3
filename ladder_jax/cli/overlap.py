"""Prove the overlap: compile a model program for an NVIDIA GPU target on a machine with no GPU
and report every all-reduce of its schedule (`ladder_jax.analysis.overlap`).

    python -m ladder_jax.overlap --preset llama-3-8b --tp 8 --phase decode
    python -m ladder_jax.overlap --preset llama-3-8b --tp 8 --phase verify --draft 4
    python -m ladder_jax.overlap --config configs/llama-3-70b.yaml --hosts 8
    python -m ladder_jax.overlap --preset tiny --tp 2 --residual desync --reduce-pattern every_layer
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from ladder_jax import hardware, runtime
from ladder_jax.analysis.overlap import (
    format_collectives,
    format_memory,
    format_table,
    report,
    report_config,
    verdict,
)
from ladder_jax.analysis.programs import PHASES, CompileError, OverlapError
from ladder_jax.cli.common import (
    ArgumentParser,
    EveryDefaultFormatter,
    add_desync_flags,
    quantize_mode,
)
from ladder_jax.config import (
    SCHEMES,
    ConfigError,
    ModelConfig,
    UsageError,
    check_quantize,
    parse_ladder_layers,
    parse_reduce_pattern,
    scheme_overrides,
)
from ladder_jax.model.compilation import check_allreduce
from ladder_jax.train import step
from ladder_jax.train_config import load_config


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m ladder_jax.overlap",
        description=__doc__,
        formatter_class=EveryDefaultFormatter,
    )
    p.add_argument("--preset", default="llama-3-8b", help="model preset (ladder_jax.PRESETS)")
    p.add_argument(
        "--residual",
        default=None,
        choices=SCHEMES,
        help="scheme (None: ladder, desync with --reduce-pattern / --desync-tp; with "
        "--config: the config's)",
    )
    p.add_argument(
        "--ladder-layers",
        default=None,
        help="ladder only: N (upper N layers) or a comma list of layer indices",
    )
    add_desync_flags(p)
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size (GPUs per program)")
    p.add_argument("--batch", type=int, default=1, help="sequences per program")
    p.add_argument("--seq", type=int, default=1024, help="prompt / extend chunk / training length")
    p.add_argument(
        "--new-tokens", type=int, default=512, help="decode: new tokens the KV cache has room for"
    )
    p.add_argument(
        "--phase",
        default="decode",
        choices=PHASES,
        help="prefill / decode: the decoder's programs; extend / verify: the server's chunked "
        "prefill (--batch rows x --seq tokens at runtime offsets) and speculative step "
        "(--batch rows x 1 + --draft tokens); train: a training step",
    )
    p.add_argument(
        "--draft",
        type=int,
        default=4,
        help="verify: drafted tokens per row (each row feeds its newest token and these)",
    )
    p.add_argument(
        "--target",
        default="h100",
        choices=hardware.TARGETS,
        help="GPU the program is compiled for (deviceless)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--quantize",
        default=None,
        metavar="MODE",
        type=quantize_mode,
        help="int8: the program with weight-only int8 linear weights; none: float weights "
        "(the default)",
    )
    p.add_argument(
        "--dump-hlo",
        default=None,
        metavar="FILE",
        help="write the scheduled HLO text of the compiled program to FILE",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a training config (YAML): compile the training step it runs, with its "
        "mesh, FSDP, dtypes, accumulation and remat; report memory too",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="with --config: overrides, as for python -m ladder_jax.train",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="hosts: with --config, the processes of the run; else the hosts the tp "
        "group spans (tp / hosts GPUs each)",
    )
    p.add_argument("--gpus-per-host", type=int, default=8, help="with --config: GPUs per host")
    p.add_argument(
        "--allreduce",
        default="nccl",
        help="how the all-reduces run: nccl (XLA's default) or one_shot (XLA's one-shot / "
        "two-shot kernels over NVLink peer memory); each all-reduce's kernel is reported",
    )
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # compile for the GPU target, run nothing
    with runtime.quiet():  # the CUDA plugin's start-up lines
        jax.devices()
    if args.config or args.overrides:
        if args.allreduce != "nccl":
            print(
                f"error: --allreduce {args.allreduce} is for decode and prefill programs: drop "
                f"it with --config (a training step)",
                file=sys.stderr,
            )
            return 2
        if args.quantize:
            print(
                f"error: --quantize {args.quantize} is for decoding: drop it with --config "
                f"(a training step)",
                file=sys.stderr,
            )
            return 2
        return _main_config(args)
    try:
        check_quantize(args.quantize, "--quantize")
        check_allreduce(args.allreduce)
        config = ModelConfig.from_preset(args.preset, **_scheme(args), quantize=args.quantize)
        rep = report(
            config,
            phase=args.phase,
            tp=args.tp,
            batch=args.batch,
            seq=args.seq,
            target=args.target,
            new_tokens=args.new_tokens,
            hosts=args.hosts,
            hlo_file=args.dump_hlo,
            allreduce=args.allreduce,
            draft=args.draft,
        )
    except CompileError as e:
        print(f"error: --preset {args.preset}: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except (UsageError, OverlapError, ValueError) as e:  # ShardingError is a UsageError
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    if args.json:
        rep.pop("preset_config")
        print(json.dumps({"preset": args.preset, **rep}))
    else:
        print(format_table(rep))
        print(verdict(rep))
    _dumped(args.dump_hlo)
    return 0


def _scheme(args) -> dict:
    """The ModelConfig scheme keys of --residual (None: ladder, or desync with its flags),
    --ladder-layers, --reduce-pattern and --desync-tp."""
    over = scheme_overrides(
        args.residual,
        parse_ladder_layers(args.ladder_layers),
        parse_reduce_pattern(args.reduce_pattern),
        args.desync_tp,
    )
    return over or {"residual": "ladder", "ladder_layers": None}


def _dumped(path) -> None:
    if path:  # relative to where the command ran; say where that is
        print(f"scheduled HLO written to {os.path.abspath(path)}", file=sys.stderr)


def _main_config(args) -> int:
    """`--config`: the training step of a config, its memory and its collectives. Exit 2 (one
    line) when the config is invalid or its step does not fit on the target."""

    try:
        if not args.config:
            raise ConfigError("key=value overrides need --config")
        over = list(args.overrides)
        if args.residual:
            over.append(f"model.residual={args.residual}")
        if args.ladder_layers is not None:
            over.append(f"model.ladder_layers={args.ladder_layers}")
        desync = {k: getattr(args, k) for k in ("reduce_pattern", "desync_tp")}
        desync = [f"model.{k}={v}" for k, v in desync.items() if v is not None]
        if desync and not args.residual:
            desync.insert(0, "model.residual=desync")
        over += desync
        cfg = load_config([args.config, *over])
        rep = report_config(
            cfg,
            hosts=args.hosts,
            gpus_per_host=args.gpus_per_host,
            target=args.target,
            hlo_file=args.dump_hlo,
        )
    except (UsageError, OverlapError, ValueError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep))
    else:
        print(format_table(rep))
        print(format_collectives(rep))
        print(format_memory(rep))
        print(
            f"{rep['gpus']} GPUs on {rep['hosts']} host(s), mesh data={rep['data']} x "
            f"tp={rep['tp']}{' fsdp' if rep['fsdp'] else ''}, {rep['tokens_per_step']:,} "
            f"tokens/step ({rep['grad_accum']} x {rep['batch']} x {rep['seq']}), remat="
            f"{rep['remat']}"
        )
        print(verdict(rep))
    try:
        step.check_memory(
            rep["memory"], rep["device_memory_bytes"], cfg, where=f"per device ({rep['target']})"
        )
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _dumped(args.dump_hlo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
