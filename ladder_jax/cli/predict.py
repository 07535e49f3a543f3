"""Predict tokens/s of each residual scheme on GPUs you do not have, from the schedule XLA
compiles for them (deviceless, on this CPU) and public hardware figures (docs/analysis.md).

    python -m ladder_jax.predict --preset llama-3-70b --tp 2 4 8 --batch 1 4 16 --link nvlink pcie
    python -m ladder_jax.predict --phase train --config configs/tiny.yaml --tp 2"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import jax

from ladder_jax import hardware, runtime
from ladder_jax.analysis import roofline
from ladder_jax.analysis.perfmodel import (
    PredictError,
    Sweep,
    check_knobs,
    context_note,
    predict,
    predict_train,
)
from ladder_jax.analysis.programs import OverlapError
from ladder_jax.analysis.tables import (
    decision,
    desync_note,
    format_decision,
    format_table,
    format_train_table,
    memory_note,
    summary,
    with_ratios,
)
from ladder_jax.cli.common import ArgumentParser, EveryDefaultFormatter, quantize_mode, write_stderr
from ladder_jax.config import (
    REDUCE_PATTERNS,
    RESIDUALS,
    SCHEMES,
    ModelConfig,
    UsageError,
    check_quantize,
    parse_ladder_layers,
    parse_reduce_pattern,
)
from ladder_jax.model.compilation import check_allreduce
from ladder_jax.progress import ProgressLines
from ladder_jax.train_config import load_config, model_config


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m ladder_jax.predict",
        description=__doc__,
        formatter_class=EveryDefaultFormatter,
    )
    _model_flags(p)
    _shape_flags(p)
    _hardware_flags(p)
    _ablation_flags(p)
    _figure_flags(p)
    p.add_argument(
        "--jobs", type=int, default=None, help="programs compiled at a time, in threads (None: 1)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    return p


def _model_flags(p) -> None:
    """What is compiled: the model, its schemes and weights, the phase."""
    p.add_argument("--preset", default="llama-3-70b", help="model preset (ladder_jax.PRESETS)")
    p.add_argument(
        "--residual",
        nargs="+",
        default=["all"],
        help=f"schemes: {', '.join(SCHEMES)}, or all ({', '.join(RESIDUALS)})",
    )
    p.add_argument(
        "--reduce-pattern",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="desync's rows, one per pattern: every_layer, every_2_layers, final_only, or per "
        "layer two letters y/n (attention, mlp syncs), comma separated (None: the three "
        "named ones); desync_tp is each row's tp",
    )
    p.add_argument(
        "--ladder-layers",
        default=None,
        help="ladder only: N (upper N layers) or a comma list (compiled at full depth)",
    )
    p.add_argument(
        "--phase", default="generate", help="generate (prefill + decode) or train (needs --config)"
    )
    p.add_argument("--config", default=None, help="train: a training config (YAML)")
    p.add_argument(
        "--quantize",
        default=None,
        metavar="MODE",
        type=quantize_mode,
        help="int8: the programs with weight-only int8 linear weights (generate); none: float "
        "weights (the default)",
    )
    p.add_argument(
        "--decode-matmul",
        default="xla",
        metavar="KIND",
        help="xla | pallas: the linear layers' matmul at up to 16 rows (ModelConfig."
        "decode_matmul; pallas: a Triton kernel that reads each weight once)",
    )


def _shape_flags(p) -> None:
    """The grid of request shapes: tp, batch, prompt and new tokens, cache slots."""
    p.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=None,
        help="tensor-parallel sizes (None: 8; train: the config's mesh.tp)",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (generate)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (generate)")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=512,
        help="generated tokens; the KV cache holds prompt + new tokens",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        metavar="N",
        help="KV cache slots per row, as `serve --max-len N` holds them (None: sized "
        "for the prompt and new tokens); the decode step reads the filled ones",
    )


def _hardware_flags(p) -> None:
    """The GPUs and their links, hosts, and a calibration file."""
    p.add_argument(
        "--link",
        nargs="+",
        default=["nvlink"],
        help="intra-host interconnects: nvlink, pcie (P2P disabled); the target's "
        "generation (hardware.LINKS / A100_LINKS)",
    )
    p.add_argument("--target", default="h100", help=f"GPU: {', '.join(hardware.TARGETS)}")
    p.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="hosts each tp group spans (None: ceil(tp / gpus-per-host)); across "
        "hosts collectives are hierarchical over InfiniBand (hardware.INTER_HOST)",
    )
    p.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host")
    p.add_argument(
        "--hardware",
        default=None,
        metavar="FILE",
        help="calibration file (JSON) written by benchmarks/calibrate_gpu.py on a "
        "real GPU; replaces the public figures it names",
    )


def _ablation_flags(p) -> None:
    """The model's switches (each on by default), the launch mode, the collective algorithm."""
    p.add_argument(
        "--no-contention",
        action="store_true",
        help="collectives in flight take nothing from the kernels beside them",
    )
    p.add_argument(
        "--no-copy-contention",
        action="store_true",
        help="collectives beside a running kernel move their data at full speed "
        "(contention one way only, the ablation; hardware.CONTENTION.copy_rate)",
    )
    p.add_argument(
        "--no-stream-sync",
        action="store_true",
        help="asynchronous collectives start and are waited for with no cross-stream "
        "latency on the device (the ablation; hardware.LAUNCH.stream_sync_s)",
    )
    p.add_argument(
        "--no-nccl-in-host",
        action="store_true",
        help="collectives within one host as a ring at LL's latency, not NCCL's choice of "
        "ring/tree/NVLS and protocol by size (the ablation; hardware.NCCL)",
    )
    p.add_argument(
        "--no-nvls",
        action="store_true",
        help="leave NVLink SHARP out of NCCL's choices within a host (a system without "
        "it, or NCCL_NVLS_ENABLE=0)",
    )
    p.add_argument(
        "--no-waves",
        action="store_true",
        help="a GEMM beside a collective slowed by the share of SMs the collective takes, "
        "not by whole waves of its tiles on the SMs left (the ablation)",
    )
    p.add_argument(
        "--launch",
        default="graphs",
        help="how the host issues kernels: graphs (XLA's command buffers between "
        "collectives), streams (one launch each), off (host costs left out; "
        "hardware.LAUNCH)",
    )
    p.add_argument(
        "--allreduce",
        nargs="+",
        default=["nccl"],
        help="how the programs' all-reduces run, compiled each way: nccl (XLA's default), "
        "one_shot (XLA's one-shot / two-shot kernels over NVLink peer memory); several give "
        "the decision table",
    )
    p.add_argument(
        "--algorithm",
        default="nccl",
        help="collectives: nccl (NCCL's own choice of ring, tree or NVLS and protocol, "
        "hardware.NCCL), or ring or tree everywhere",
    )
    p.add_argument(
        "--layers-compiled",
        type=int,
        default=4,
        help="compile this many layers and one fewer, extend to full depth (0: compile all)",
    )


def _figure_flags(p) -> None:
    """Figures that replace the calibration's: efficiencies, kernel overhead, link figures."""
    p.add_argument(
        "--gemm-efficiency",
        type=float,
        default=None,
        help=f"fraction of dense bf16 peak (None: the target's, h100 {hardware.EFFICIENCY.gemm})",
    )
    p.add_argument(
        "--memory-efficiency",
        type=float,
        default=None,
        help=f"fraction of HBM bandwidth (None: the target's, h100 {hardware.EFFICIENCY.memory})",
    )
    p.add_argument(
        "--kernel-overhead-us",
        type=float,
        default=None,
        help=f"fixed cost per kernel (None: the target's, h100 "
        f"{hardware.EFFICIENCY.kernel_overhead_s * 1e6:g})",
    )
    p.add_argument(
        "--link-latency-us",
        type=float,
        default=None,
        help="override the links' base latency per collective",
    )
    p.add_argument(
        "--link-hop-us", type=float, default=None, help="override the links' latency per ring step"
    )
    p.add_argument(
        "--link-busbw-gbs",
        type=float,
        default=None,
        help="override the links' bus bandwidth (nccl-tests busbw, GB/s)",
    )


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # compile for the GPU target, run nothing
    with runtime.quiet():  # the CUDA plugin's start-up lines
        jax.devices()
    t0 = time.perf_counter()
    show = _Progress(args.preset if args.phase != "train" else args.config)
    try:
        rows, name = _rows(args, show)
    except (UsageError, OverlapError, PredictError, ValueError) as e:
        show.clear()
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    show.clear()
    if args.json:
        for r in with_ratios(rows):
            print(json.dumps({"preset": name, **r}))
        if len(args.allreduce) > 1:
            for d in decision(rows):
                print(json.dumps({"preset": name, "decision": d}))
    elif args.phase == "train":
        print(f"{name}: training step, predicted in {time.perf_counter() - t0:.0f} s")
        print(format_train_table(rows))
        if desync_note(rows):
            print(desync_note(rows))
    else:
        hosts = sorted({r["hosts"] for r in rows})
        print(
            f"{args.preset}{f', {args.quantize} weights' if args.quantize else ''}, "
            f"prompt {args.prompt_len}, {args.new_tokens} new tokens, "
            f"{f'{args.max_len} slots per row, ' if args.max_len else ''}"
            f"{args.target}, hosts per tp group {'/'.join(map(str, hosts))}"
            f"{'' if args.no_contention else ', with contention'}, launch "
            f"{args.launch}; predicted in "
            f"{time.perf_counter() - t0:.0f} s"
        )
        print(format_table(rows))
        print(roofline.format_table(rows))
        for s in (
            context_note(rows),
            memory_note(rows),
            desync_note(rows),
            summary(rows),
            format_decision(decision(rows)),
            *sorted({r["above_upper_bound"] for r in rows if r.get("above_upper_bound")}),
        ):
            if s:
                print(s)
    return 0


def _finite(name: str, v, low: float | None = None, *, positive=False):
    """`v` (a flag's value) when finite and in range, else one line naming the flag."""
    if v is None:
        return None
    positive = positive or low is None
    if not math.isfinite(v) or (low is not None and v < low) or (positive and v <= 0):
        raise PredictError(
            f"{name} {v:g}: must be a finite number {'> 0' if positive else f'>= {low:g}'}"
        )
    return v


def _check_decode_flags(args) -> None:
    """--quantize, --allreduce and --max-len: for decoding, and a row holds the prompt and new
    tokens."""
    check_quantize(args.quantize, "--quantize")
    if args.phase == "train" and args.allreduce != ["nccl"]:
        raise PredictError("--allreduce is for decoding and prefill: drop it with --phase train")
    if args.quantize and args.phase == "train":
        raise PredictError(
            f"--quantize {args.quantize} is for decoding: drop it with --phase train"
        )
    if args.max_len is not None:
        if args.phase == "train":
            raise PredictError(
                f"--max-len {args.max_len} is for decoding: drop it with --phase train"
            )
        if args.max_len < args.prompt_len + args.new_tokens:
            raise PredictError(
                f"--max-len {args.max_len}: a row must hold the prompt and the "
                f"new tokens, at least {args.prompt_len + args.new_tokens} "
                f"(--prompt-len + --new-tokens)"
            )


def _schemes(args) -> tuple[tuple, tuple]:
    """(residual schemes, desync's reduce patterns) of --residual ("all": the four of
    RESIDUALS, desync beside them when named) and --reduce-pattern."""
    residuals = []
    for r in args.residual:
        residuals += [x for x in (RESIDUALS if r == "all" else (r,)) if x not in residuals]
    if args.reduce_pattern is None:
        return tuple(residuals), REDUCE_PATTERNS
    if "desync" not in residuals:
        raise PredictError("--reduce-pattern applies to desync: add desync to --residual")
    return tuple(residuals), tuple(parse_reduce_pattern(p) for p in args.reduce_pattern)


def _calibration(args) -> hardware.Calibration:
    """The target's figures (or --hardware's), with the command line's figures in place."""
    if args.target not in hardware.TARGETS:
        raise PredictError(
            f"unknown target {args.target!r}: choose one of {', '.join(hardware.TARGETS)}"
        )
    cal = (
        hardware.Calibration.load(args.hardware, args.target)
        if args.hardware
        else hardware.calibration(args.target)
    )
    eff = dataclasses.replace(
        cal.efficiency,
        **{
            k: v
            for k, v in (
                ("gemm", _finite("--gemm-efficiency", args.gemm_efficiency)),
                ("memory", _finite("--memory-efficiency", args.memory_efficiency)),
                ("kernel_overhead_s", _us("--kernel-overhead-us", args.kernel_overhead_us)),
            )
            if v is not None
        },
    )
    overrides = {
        k: v
        for k, v in (
            ("base_latency_s", _us("--link-latency-us", args.link_latency_us)),
            ("hop_latency_s", _us("--link-hop-us", args.link_hop_us)),
            (
                "bus_bytes_per_s",
                None
                if args.link_busbw_gbs is None
                else _finite("--link-busbw-gbs", args.link_busbw_gbs, positive=True) * 1e9,
            ),
        )
        if v is not None
    }
    check_knobs(eff, overrides)
    cal = dataclasses.replace(cal, efficiency=eff)
    return cal.replace(links={"*": overrides}) if overrides else cal


def _us(name: str, v) -> float | None:
    """A flag in microseconds, finite and >= 0, in seconds (None stays None)."""
    return None if v is None else _finite(name, v, 0) * 1e-6


def _rows(args, show) -> tuple[list[dict], str]:
    _check_decode_flags(args)
    config = ModelConfig.from_preset(
        args.preset, quantize=args.quantize, decode_matmul=args.decode_matmul
    )
    if args.ladder_layers is not None:
        config = dataclasses.replace(
            config, residual="ladder", ladder_layers=parse_ladder_layers(args.ladder_layers)
        )
    residuals, patterns = _schemes(args)
    cal = _calibration(args)
    sweep = Sweep(
        links=tuple(args.link),
        target=args.target,
        residuals=residuals,
        hosts=args.hosts,
        gpus_per_host=args.gpus_per_host,
        layers_compiled=args.layers_compiled,
        algorithm=args.algorithm,
        contention=not args.no_contention,
        calibration=cal,
        launch=args.launch,
        copy_contention=not args.no_copy_contention,
        stream_sync=not args.no_stream_sync,
        nccl_in_host=not args.no_nccl_in_host,
        nvls=not args.no_nvls,
        waves=not args.no_waves,
        allreduces=tuple(check_allreduce(a) for a in args.allreduce),
        reduce_patterns=patterns,
    )
    common = dict(jobs=args.jobs, progress=show)
    if args.phase == "train":
        config, train_kw = _train_setup(args)
        tp = train_kw.pop("tp")
        return predict_train(
            config,
            dataclasses.replace(sweep, tp=tuple(args.tp or tp)),
            name=args.config,
            **train_kw,
            **common,
        ), args.config
    if args.phase == "generate":
        sweep = dataclasses.replace(
            sweep,
            tp=tuple(args.tp or [8]),
            batch=tuple(args.batch),
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            slots=args.max_len,
        )
        return predict(config, sweep, name=args.preset, **common), args.preset
    raise PredictError(f"unknown phase {args.phase!r}: choose generate or train")


class _Progress:
    """Programs compiled n/N (then rows costed n/N) and the time left, on stderr: one line
    rewritten in place on a terminal, else (a log file) `ProgressLines`: a line at least every
    `every_s` seconds, and at the end of each stage."""

    def __init__(self, name: str, every_s: float = 10.0):
        self.name, self.live = name, sys.stderr.isatty()
        self.width, self.lines = 0, None if self.live else ProgressLines(every_s)

    def __call__(
        self, done: int, total: int, eta_s: float | None, stage: str = "compiling"
    ) -> None:
        eta = "" if eta_s is None or done == total else f", about {_duration(eta_s)} left"
        what = "programs" if stage == "compiling" else "rows (reading the compiled programs)"
        line = f"{stage} {self.name}: {done}/{total} {what}{eta}"
        if self.live:  # write_stderr: shown while other threads compile, too
            write_stderr("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.lines.show(line, now=done in (0, total))

    def clear(self) -> None:
        if self.lines is not None:
            self.lines.close()
        if self.live and self.width:
            write_stderr("\r" + " " * self.width + "\r")
            self.width = 0


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"


def _train_setup(args) -> tuple:
    """(model config, predict_train keywords) of a training config file."""

    if not args.config:
        raise PredictError("--phase train needs --config configs/X.yaml")
    cfg = load_config([args.config])
    data = cfg.mesh.data or 1
    if cfg.data.batch_size % data:
        raise PredictError(
            f"data.batch_size={cfg.data.batch_size} is not divisible by mesh.data={data}"
        )
    config = model_config(cfg)
    if args.ladder_layers is not None:
        config = dataclasses.replace(
            config, residual="ladder", ladder_layers=parse_ladder_layers(args.ladder_layers)
        )
    return config, dict(
        tp=[cfg.mesh.tp],
        batch=cfg.data.batch_size // data,
        seq_len=cfg.data.seq_len,
        grad_accum=cfg.data.grad_accum,
    )


if __name__ == "__main__":
    sys.exit(main())
