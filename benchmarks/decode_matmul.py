"""XLA's matmul against the Pallas small-M kernel (`ModelConfig.decode_matmul`) on one GPU.

    python benchmarks/decode_matmul.py --out decode_matmul.json          # a few minutes
    python benchmarks/decode_matmul.py --dry-run --out /tmp/dm.json      # CPU: checks the script

Two measurements, each for `--decode-matmul xla` and `pallas`, batch 1 and 16, bf16 and int8:
- per linear layer: the preset's q/k/v (fused), o, gate/up (fused) and down weights as one
  GPU holds them at each `--tp`, multiplied by 1 or 16 rows on this GPU, best of `--repeats`;
  achieved bandwidth = the weight's bytes / time (the kernel exists to stream W once);
- end to end at tp 1: `generation.benchmark` (random weights, prefill + decode), decode ms per
  token and its weight bandwidth (the layers' weights / step time).

What decides `decode_matmul`'s default: pallas is worth it where it is faster here at batch 16
and no slower at batch 1. `--dry-run` runs the kernel through Pallas's interpreter on CPU at
small sizes and the `tiny` preset's decode (figures meaningless; the file says so). Without a
GPU and without `--dry-run` it stops with one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _gpu


def linear_shapes(config, tp: int) -> dict:
    """(K, N) of each decode matmul's weight block on one of `tp` GPUs (fused as decoding
    fuses them)."""
    from ladder_jax.model.transformer import fused_input_columns

    n, kv, f = fused_input_columns(config, tp)
    D, H = config.d_model, config.head_dim
    return {
        "qkv": (D, (n + 2 * kv) * H),
        "o": (n * H, D),
        "gate_up": (D, 2 * f),
        "down": (f, D),
    }


def time_linears(config, *, tps, batches, quantize, repeats: int, interpret: bool) -> list:
    import jax
    import jax.numpy as jnp

    from ladder_jax.model import matvec

    rows = []
    key = jax.random.key(0)
    for tp in tps:
        for name, (k, n) in linear_shapes(config, tp).items():
            for q in quantize:
                w = jax.random.normal(key, (k, n), jnp.float32)
                scale = None
                if q == "int8":
                    w = jnp.clip(jnp.round(w * 40), -127, 127).astype(jnp.int8)
                    scale = jnp.full((n,), 0.01, jnp.float32)
                else:
                    w = w.astype(jnp.bfloat16)
                w_bytes = w.size * w.dtype.itemsize + (0 if scale is None else 4 * n)
                for b in batches:
                    x = jax.random.normal(key, (b, k), jnp.float32).astype(jnp.bfloat16)
                    plan = matvec.plan(b, k, n, x.dtype, w.dtype)

                    def xla(x, w, s):
                        y = x @ w.astype(x.dtype)
                        return y if s is None else (y.astype(jnp.float32) * s).astype(x.dtype)

                    fns = {"xla": jax.jit(xla)}
                    if plan is not None:
                        fns["pallas"] = jax.jit(
                            lambda x, w, s: matvec.small_m_matmul(x, w, s, interpret=interpret)
                        )
                    row = {"tp": tp, "linear": name, "quantize": q, "batch": b, "K": k, "N": n}
                    row["plan"] = None if plan is None else vars(plan)
                    outs = {}
                    for label, fn in fns.items():
                        outs[label] = fn(x, w, scale)
                        s = _gpu.best(lambda fn=fn: fn(x, w, scale), repeats)
                        row[f"{label}_us"] = s * 1e6
                        row[f"{label}_gb_per_s"] = w_bytes / s / 1e9
                    if "pallas" in outs:
                        a, b_ = (outs[k].astype(jnp.float32) for k in ("pallas", "xla"))
                        row["max_abs_diff"] = float(jnp.max(jnp.abs(a - b_)))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def time_decode(preset, *, batches, quantize, prompt_len, new_tokens, repeats, dry_run) -> list:
    import dataclasses

    import jax

    import ladder_jax as lj
    from ladder_jax.inference import generation

    mesh = lj.make_mesh(tp=1, devices=jax.devices()[:1])
    rows = []
    for q in quantize:
        for b in batches:
            for mm in ("xla", "pallas"):
                config = lj.ModelConfig.from_preset(preset)
                if not dry_run:
                    config = dataclasses.replace(config, dtype="bfloat16", param_dtype="bfloat16")
                config = dataclasses.replace(
                    config, quantize=None if q == "none" else q, decode_matmul=mm
                )
                m = generation.benchmark(
                    config,
                    mesh,
                    batch=b,
                    prompt_len=prompt_len,
                    new_tokens=new_tokens,
                    repeats=repeats,
                )
                row = {"preset": preset, "quantize": q, "batch": b, "decode_matmul": mm, **m}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--out", default="decode_matmul.json", help="JSON file to write")
    ap.add_argument("--preset", default=None, help="None: llama-3-8b (tiny in a dry run)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8], help="weight blocks of tp")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--quantize", nargs="+", default=["none", "int8"])
    ap.add_argument("--prompt-len", type=int, default=None, help="None: 1024 (dry run: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="None: 64 (dry run: 4)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="CPU, small sizes: checks the script")
    args = ap.parse_args(argv)

    dry = args.dry_run
    if not _gpu.ready(dry):
        return 2
    import jax

    import ladder_jax as lj

    preset = args.preset or ("tiny" if dry else "llama-3-8b")
    shapes_of = (
        lj.ModelConfig.from_preset("tiny", d_model=256, n_heads=8, n_kv_heads=8, d_ff=512)
        if dry
        else lj.ModelConfig.from_preset(preset)
    )
    t0 = time.perf_counter()
    out = {
        "device": jax.devices()[0].device_kind,
        "dry_run": dry,
        "note": "DRY RUN on a CPU: interpreted kernel, figures meaningless" if dry else "",
        "linears": time_linears(
            shapes_of,
            tps=args.tp,
            batches=args.batch,
            quantize=args.quantize,
            repeats=2 if dry else args.repeats,
            interpret=dry,
        ),
        "decode": time_decode(
            preset,
            batches=args.batch,
            quantize=args.quantize,
            prompt_len=args.prompt_len or (16 if dry else 1024),
            new_tokens=args.new_tokens or (4 if dry else 64),
            repeats=1 if dry else 2,
            dry_run=dry,
        ),
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"-> {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
