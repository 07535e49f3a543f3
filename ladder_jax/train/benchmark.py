"""Tokens/s and MFU of every residual scheme on one trainer's model, mesh and data
(`benchmark=true`); the schemes' steps are interleaved so that load drift slows them alike.

    rows = benchmark(Trainer(cfg))      # also writes <run>/benchmark.json (process 0)"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from ladder_jax import hardware
from ladder_jax.config import RESIDUALS
from ladder_jax.model import compilation
from ladder_jax.train.report import flops_per_token, peak_flops
from ladder_jax.train.rundir import config_dict
from ladder_jax.train.step import TrainState


def benchmark(trainer) -> list[dict]:
    """Times `bench_steps` interleaved rounds of every scheme's step after one warm-up step
    each (which compiles) on `trainer` (a `Trainer`); returns one row per scheme."""
    cfg = trainer.cfg
    tokens_per_step = cfg.data.grad_accum * cfg.data.batch_size * cfg.data.seq_len
    batches = [trainer.global_batch(next(trainer.data_iter)) for _ in range(2)]
    trainer.log(
        f"benchmark: {trainer.describe()}; {tokens_per_step} tokens/step, "
        f"{cfg.bench_steps} interleaved rounds after 1 warm-up step per scheme"
    )
    if jax.default_backend() == "cpu":  # CPU figures compare only beside the CPU and flags
        trainer.log(
            f"  cpu: {hardware.cpu_description()}; XLA_FLAGS="
            f"{os.environ.get('XLA_FLAGS', '')!r}; compiler options "
            f"{compilation.compiler_options('cpu', 'train')}"
        )
    runs, states = {}, {}
    for residual in RESIDUALS:
        mc = dataclasses.replace(trainer.model_config, residual=residual, ladder_layers=None)
        graphdef, states[residual] = trainer.init_state(mc)
        runs[residual] = (mc, trainer.compiled_step(graphdef, states[residual])[0], [])

    def one(residual, i):
        _, train_step, times = runs[residual]
        state = states[residual]
        t0 = time.perf_counter()
        params, opt_state, m = train_step(state.params, state.opt_state, batches[i % 2])
        states[residual] = TrainState(params, opt_state, state.step + 1)
        float(np.asarray(m["loss"].addressable_data(0)))  # one step in flight at most
        times.append(time.perf_counter() - t0)

    for residual in runs:
        one(residual, 0)  # compiles
    for i in range(cfg.bench_steps):
        for residual in runs:
            one(residual, i + 1)
    rows = [
        _row(trainer, residual, mc, times, tokens_per_step)
        for residual, (mc, _, times) in runs.items()
    ]
    _summary(trainer, rows)
    if trainer.is_main:
        os.makedirs(trainer.run_path, exist_ok=True)
        with open(os.path.join(trainer.run_path, "benchmark.json"), "w") as f:
            json.dump(
                {
                    "config": config_dict(cfg),
                    "mesh": dict(trainer.mesh.shape),
                    "backend": jax.default_backend(),
                    "results": rows,
                },
                f,
                indent=1,
            )
    return rows


def _row(trainer, residual: str, mc, times: list[float], tokens_per_step: int) -> dict:
    """One scheme's figures from its step times (the first one compiled), logged."""
    cfg = trainer.cfg
    peak = peak_flops(cfg, trainer.mesh.devices.flat[0])
    dt = float(np.median(times[1:]))
    spread = (max(times[1:]) - min(times[1:])) / dt  # run to run, over the median
    tps = tokens_per_step / dt
    mfu = (
        flops_per_token(mc, cfg.data.seq_len) * tps / (peak * trainer.mesh.devices.size)
        if peak
        else None
    )
    trainer.log(
        f"  {residual:<12} {tps:>12,.0f} tokens/s  {dt * 1e3:>9.1f} ms/step "
        f"(spread {spread:4.0%})  "
        f"MFU {f'{mfu:.1%}' if peak else 'n/a (set peak_tflops)'}"
        + ("   (not a valid model: speed ceiling)" if residual == "upper_bound" else "")
    )
    return {
        "residual": residual,
        "tokens_per_s": tps,
        "step_ms": dt * 1e3,
        "spread": spread,
        "mfu": mfu,
        "first_step_s": times[0],
    }


def _summary(trainer, rows: list[dict]) -> None:
    by = {r["residual"]: r["tokens_per_s"] for r in rows}
    trainer.log(
        "  vs standard: "
        + ", ".join(f"{k} {v / by['standard']:.2f}x" for k, v in by.items() if k != "standard")
    )
    if trainer.mesh.shape["tp"] == 1:
        trainer.log(
            "  note: tp=1 has no all-reduce to overlap: ladder and upper_bound compute "
            "what standard does, so their ratios are run-to-run noise (see the spread); "
            "use mesh.tp > 1 on GPUs"
        )
    elif jax.default_backend() == "cpu":
        trainer.log(
            "  note: XLA:CPU runs all-reduces synchronously, so nothing overlaps on "
            "CPU: the ladder's speed-up needs GPUs"
        )
