"""`python -m ladder_jax.predict`: the command line of the performance model,
`ladder_jax.analysis.perfmodel` (its docstring is the method)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax

from ladder_jax import hardware
from ladder_jax.analysis import perfmodel
from ladder_jax.analysis.perfmodel import (
    PredictError,
    format_table,
    format_train_table,
    predict,
    predict_train,
    summary,
    with_ratios,
)
from ladder_jax.analysis.programs import OverlapError
from ladder_jax.cli.common import ArgumentParser
from ladder_jax.config import (
    RESIDUALS,
    ConfigError,
    ModelConfig,
    check_quantize,
    load_config,
    model_config,
    parse_ladder_layers,
)
from ladder_jax.model.sharding import ShardingError


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m ladder_jax.predict", description=perfmodel.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3-70b", help="model preset (default llama-3-70b)")
    p.add_argument("--residual", nargs="+", default=["all"],
                   help=f"schemes: {', '.join(RESIDUALS)}, or all (default)")
    p.add_argument("--ladder-layers", default=None,
                   help="ladder only: N (upper N layers) or a comma list (compiled at full depth)")
    p.add_argument("--phase", default="generate",
                   help="generate (prefill + decode, default) or train (needs --config)")
    p.add_argument("--config", default=None, help="train: a training config (YAML)")
    p.add_argument("--tp", type=int, nargs="+", default=None,
                   help="tensor-parallel sizes (default 8; train: the config's mesh.tp)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (generate)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--link", nargs="+", default=["nvlink"],
                   help=f"interconnects: {', '.join(hardware.LINKS)} (see hardware.LINKS)")
    p.add_argument("--target", default="h100", help=f"GPU: {', '.join(hardware.TARGETS)}")
    p.add_argument("--algorithm", default="ring", help="all-reduce algorithm: ring or tree")
    p.add_argument("--layers-compiled", type=int, default=4,
                   help="compile this many layers and one fewer, extend to full depth "
                        "(0: compile all)")
    p.add_argument("--gemm-efficiency", type=float, default=None,
                   help=f"fraction of dense bf16 peak (default {hardware.EFFICIENCY.gemm})")
    p.add_argument("--memory-efficiency", type=float, default=None,
                   help=f"fraction of HBM bandwidth (default {hardware.EFFICIENCY.memory})")
    p.add_argument("--kernel-overhead-us", type=float, default=None,
                   help=f"fixed cost per kernel (default "
                        f"{hardware.EFFICIENCY.kernel_overhead_s * 1e6:g})")
    p.add_argument("--link-latency-us", type=float, default=None,
                   help="override the links' base latency per collective")
    p.add_argument("--link-hop-us", type=float, default=None,
                   help="override the links' latency per ring step")
    p.add_argument("--link-busbw-gbs", type=float, default=None,
                   help="override the links' bus bandwidth (nccl-tests busbw, GB/s)")
    p.add_argument("--jobs", type=int, default=None,
                   help="programs compiled at a time, in threads (default 1)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--quantize", default=None, metavar="MODE",
                   help="int8: the programs with weight-only int8 linear weights (generate)")
    args = p.parse_args(argv)

    jax.config.update("jax_platforms", "cpu")  # compile for the GPU target, run nothing

    try:
        check_quantize(args.quantize, "--quantize")
        config = ModelConfig.from_preset(args.preset, quantize=args.quantize)
        if args.ladder_layers is not None:
            config = dataclasses.replace(config, residual="ladder",
                                         ladder_layers=parse_ladder_layers(args.ladder_layers))
        residuals = RESIDUALS if args.residual == ["all"] else tuple(args.residual)
        eff = hardware.EFFICIENCY
        eff = dataclasses.replace(eff, **{k: v for k, v in (
            ("gemm", args.gemm_efficiency), ("memory", args.memory_efficiency),
            ("kernel_overhead_s", None if args.kernel_overhead_us is None
             else args.kernel_overhead_us * 1e-6)) if v is not None})
        overrides = {k: v for k, v in (
            ("base_latency_s", None if args.link_latency_us is None
             else args.link_latency_us * 1e-6),
            ("hop_latency_s", None if args.link_hop_us is None else args.link_hop_us * 1e-6),
            ("bus_bytes_per_s", None if args.link_busbw_gbs is None
             else args.link_busbw_gbs * 1e9))
            if v is not None}
        perfmodel.check_knobs(eff, overrides)
        t0 = time.perf_counter()
        common = dict(links=args.link, target=args.target, residuals=residuals, efficiency=eff,
                      link_overrides=overrides, layers_compiled=args.layers_compiled,
                      algorithm=args.algorithm, jobs=args.jobs, progress=lambda s: print(
                          f"compiling {name} {s}", file=sys.stderr, flush=True))
        if args.phase == "train":
            if args.quantize:
                raise PredictError(f"--quantize {args.quantize} is for decoding: drop it with "
                                   f"--phase train")
            config, train_kw = _train_setup(args)
            name, tp = args.config, train_kw.pop("tp")
            rows = predict_train(config, tp=args.tp or tp, **train_kw, **common)
        elif args.phase == "generate":
            name = args.preset
            rows = predict(config, tp=args.tp or [8], batch=args.batch,
                           prompt_len=args.prompt_len, new_tokens=args.new_tokens, **common)
        else:
            raise PredictError(f"unknown phase {args.phase!r}: choose generate or train")
    except (ConfigError, ShardingError, OverlapError, PredictError, ValueError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    if args.json:
        for r in with_ratios(rows):
            print(json.dumps({"preset": name, **r}))
    elif args.phase == "train":
        print(f"{name}: training step, predicted in {time.perf_counter() - t0:.0f} s")
        print(format_train_table(rows))
    else:
        print(f"{args.preset}{f', {args.quantize} weights' if args.quantize else ''}, "
              f"prompt {args.prompt_len}, {args.new_tokens} new tokens, "
              f"{args.target}; predicted in {time.perf_counter() - t0:.0f} s")
        print(format_table(rows))
        s = summary(rows)
        if s:
            print(s)
    return 0


def _train_setup(args) -> tuple:
    """(model config, predict_train keywords) of a training config file."""

    if not args.config:
        raise PredictError("--phase train needs --config configs/X.yaml")
    cfg = load_config([args.config])
    data = cfg.mesh.data or 1
    if cfg.data.batch_size % data:
        raise PredictError(f"data.batch_size={cfg.data.batch_size} is not divisible by "
                           f"mesh.data={data}")
    config = model_config(cfg)
    if args.ladder_layers is not None:
        config = dataclasses.replace(config, residual="ladder",
                                     ladder_layers=parse_ladder_layers(args.ladder_layers))
    return config, dict(tp=[cfg.mesh.tp], batch=cfg.data.batch_size // data,
                        seq_len=cfg.data.seq_len, grad_accum=cfg.data.grad_accum)


if __name__ == "__main__":
    sys.exit(main())
