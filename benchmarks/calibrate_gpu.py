"""Calibrate `python -m ladder_jax.predict` on the GPU you have, then check it on a real program.

Measures three micro-benchmarks on device 0 (no model involved):
- GEMM rate: a bf16 N x N x N matmul (default 8192), best of `--repeats`;
- HBM bandwidth: `x + 1` over a large bf16 array (one read and one write per element);
- kernel overhead: a chain of `--chain` tiny dependent matmuls in one program (one kernel each,
  nothing to fuse), time per kernel;
writes them in the form `predict --hardware FILE` reads (`ladder_jax.hardware.Calibration`:
efficiencies = measured / the chip's spec-sheet rate), then runs the real decoder at tp=1
(`ladder_jax.inference.generation.benchmark`: random weights, prefill + decode) and prints
predicted against measured prefill time, decode step time and decode tokens/s.

    python benchmarks/calibrate_gpu.py --out h100.json                     # a few minutes
    python -m ladder_jax.predict --hardware h100.json --preset llama-3-70b --tp 8
    python benchmarks/calibrate_gpu.py --dry-run --out /tmp/cpu.json       # CPU: checks the script

The calibration never sees the model's tokens/s: those are measured after the file is written,
only to compare. `--dry-run` runs every step on this CPU with small sizes and the `tiny` preset
(figures meaningless for a GPU; the file says so) so that the script is known to work end to end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _gpu


def measure(*, gemm_n: int, hbm_bytes: int, chain: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    a = jax.random.normal(key, (gemm_n, gemm_n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (gemm_n, gemm_n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    gemm_s = _gpu.best(lambda: matmul(a, b), repeats)

    x = jnp.zeros((hbm_bytes // 2,), jnp.bfloat16)
    stream = jax.jit(lambda x: x + 1)
    hbm_s = _gpu.best(lambda: stream(x), repeats)

    w = jnp.eye(8, dtype=jnp.float32) * 0.5
    v = jnp.ones((8, 8), jnp.float32)

    def chained(v, w):
        for _ in range(chain):  # dependent matmuls: one kernel each
            v = v @ w
        return v

    chain_fn = jax.jit(chained)
    chain_s = _gpu.best(lambda: chain_fn(v, w), repeats)
    return {
        "gemm_flops_per_s": 2.0 * gemm_n**3 / gemm_s,
        "gemm_n": gemm_n,
        "hbm_bytes_per_s": 2.0 * (hbm_bytes // 2) * 2 / hbm_s,
        "hbm_array_bytes": hbm_bytes,
        "kernel_s": chain_s / chain,
        "chain": chain,
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
    }


def calibration_file(m: dict, target: str, dry_run: bool) -> dict:
    from ladder_jax import hardware

    chip = hardware.CHIPS[target]

    def clamp(v):  # a CPU dry run is far below peak
        return min(max(v, 1e-6), 1.0)

    return {
        "target": target,
        "efficiency": {
            "gemm": clamp(m["gemm_flops_per_s"] / chip.bf16_flops),
            "memory": clamp(m["hbm_bytes_per_s"] / chip.hbm_bytes_per_s),
            "kernel_overhead_s": m["kernel_s"],
            "sources": f"benchmarks/calibrate_gpu.py on {m['device_kind']}",
        },
        "measured": m,
        "note": (
            "DRY RUN on a CPU: not a GPU calibration"
            if dry_run
            else f"measured on {m['device_kind']}; links and contention keep hardware.py's "
            f"public figures (measure links with nccl-tests)"
        ),
    }


def compare(
    path: str,
    *,
    target: str,
    preset: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    layers_compiled: int,
    dry_run: bool,
) -> dict:
    """Measured (this device, tp=1) against predicted (deviceless, `path`'s calibration)."""
    import jax

    import ladder_jax as lj
    from ladder_jax import hardware
    from ladder_jax.analysis import perfmodel
    from ladder_jax.inference import generation

    config = lj.ModelConfig.from_preset(preset)
    mesh = lj.make_mesh(tp=1, devices=jax.devices()[:1])
    measured = generation.benchmark(
        config, mesh, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, repeats=2
    )
    cal = hardware.Calibration.load(path, target)
    sweep = perfmodel.Sweep(
        tp=(1,),
        batch=(batch,),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        residuals=(config.residual,),
        target=target,
        layers_compiled=layers_compiled,
        calibration=cal,
    )
    (row,) = perfmodel.predict(config, sweep, name=preset)
    steps = new_tokens - 1
    measured_tps = (
        batch
        * new_tokens
        / (measured["prefill_ms"] / 1e3 + steps * measured["decode_ms_per_token"] / 1e3)
    )
    out = {
        "preset": preset,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "target": target,
        "dry_run": dry_run,
        "prefill_ms": {"measured": measured["prefill_ms"], "predicted": row["prefill_s"] * 1e3},
        "decode_ms_per_token": {
            "measured": measured["decode_ms_per_token"],
            "predicted": row["decode_step_s"] * 1e3,
        },
        "tokens_per_s": {"measured": measured_tps, "predicted": row["tokens_per_s"]},
    }
    for k in ("prefill_ms", "decode_ms_per_token", "tokens_per_s"):
        out[k]["predicted/measured"] = out[k]["predicted"] / out[k]["measured"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--out", default="gpu_calibration.json", help="calibration file to write")
    ap.add_argument(
        "--target",
        default=None,
        help="hardware.TARGETS entry the figures are for (None: this GPU's kind; "
        "h100 in a dry run)",
    )
    ap.add_argument(
        "--preset", default=None, help="model for the check (None: llama-3-8b; tiny in a dry run)"
    )
    ap.add_argument("--batch", type=int, default=1, help="decode batch of the check")
    ap.add_argument("--prompt-len", type=int, default=None, help="None: 1024 (dry run: 32)")
    ap.add_argument("--new-tokens", type=int, default=None, help="None: 128 (dry run: 8)")
    ap.add_argument(
        "--layers-compiled",
        type=int,
        default=4,
        help="predict's few-layer extension (0: compile all layers)",
    )
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per micro-benchmark")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="run every step on the CPU with small sizes (checks the script)",
    )
    args = ap.parse_args(argv)

    dry = args.dry_run
    if not _gpu.ready(dry):
        return 2
    import jax

    from ladder_jax import hardware

    chip = None if dry else hardware.chip_of(jax.devices()[0])
    target = args.target or (
        "h100" if dry or chip is None else next(k for k, c in hardware.CHIPS.items() if c == chip)
    )
    if target not in hardware.TARGETS:
        print(
            f"error: --target {target!r}: choose one of {', '.join(hardware.TARGETS)} "
            f"(the deviceless compile targets)",
            file=sys.stderr,
        )
        return 2
    sizes = (
        dict(gemm_n=256, hbm_bytes=32 << 20, chain=50, repeats=3)
        if dry
        else dict(gemm_n=8192, hbm_bytes=4 << 30, chain=400, repeats=args.repeats)
    )
    t0 = time.perf_counter()
    m = measure(**sizes)
    data = calibration_file(m, target, dry)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    eff = data["efficiency"]
    print(
        f"{m['device_kind']}: GEMM {m['gemm_flops_per_s'] / 1e12:.3g} TFLOP/s "
        f"(gemm efficiency {eff['gemm']:.3g}), HBM {m['hbm_bytes_per_s'] / 1e9:.3g} GB/s "
        f"(memory efficiency {eff['memory']:.3g}), {m['kernel_s'] * 1e6:.2f} us per kernel "
        f"-> {args.out} ({time.perf_counter() - t0:.0f} s)"
    )
    result = compare(
        args.out,
        target=target,
        preset=args.preset or ("tiny" if dry else "llama-3-8b"),
        batch=args.batch,
        prompt_len=args.prompt_len or (32 if dry else 1024),
        new_tokens=args.new_tokens or (8 if dry else 128),
        layers_compiled=args.layers_compiled,
        dry_run=dry,
    )
    for k in ("prefill_ms", "decode_ms_per_token", "tokens_per_s"):
        r = result[k]
        print(
            f"{k:>20}: measured {r['measured']:10.3f}  predicted {r['predicted']:10.3f}  "
            f"predicted/measured {r['predicted/measured']:.3f}"
        )
    data["check"] = result
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    if dry:
        print("dry run: CPU figures against an H100 prediction; only the plumbing is checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
