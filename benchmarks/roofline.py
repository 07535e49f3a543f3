"""The decode step's bytes and kernels per layer against the minimum (the roofline report),
over tp, batch and int8, from deviceless H100 compiles (no GPU needed).

    python benchmarks/roofline.py --preset llama-3-8b --tp 1 2 4 8 --batch 1
    python benchmarks/roofline.py --preset llama-3-8b --tp 8 --quantize int8 --kernels
    python benchmarks/roofline.py --tp 1 8 --batch 1 16 --decode-matmul xla pallas

One line per (precision, tp, batch, residual, decode matmul): MB per layer per GPU, the
minimum (weight blocks once + KV cache once), their ratio, compute kernels and collectives per
layer.
`--kernels` lists the last layer's kernels with their bytes (what to fuse or fix).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--quantize", nargs="+", default=["none", "int8"], help="none and/or int8")
    p.add_argument("--residual", nargs="+", default=["standard"])
    p.add_argument(
        "--decode-matmul",
        nargs="+",
        default=["xla"],
        help="xla and/or pallas: the linear layers' matmul (ModelConfig.decode_matmul)",
    )
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--target", default="h100")
    p.add_argument("--kernels", action="store_true", help="list the last layer's kernels")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")

    from ladder_jax.analysis import roofline
    from ladder_jax.analysis.compiled import Workload
    from ladder_jax.config import ModelConfig

    print(
        f"{'quant':<5} {'tp':>3} {'batch':>5} {'residual':<10} {'matmul':<6} {'MB/layer':>9} "
        f"{'min MB':>8} {'x min':>6} {'kernels':>7} {'colls':>5}"
    )
    for q in args.quantize:
        for tp in args.tp:
            for b in args.batch:
                for res, mm in itertools.product(args.residual, args.decode_matmul):
                    cfg = ModelConfig.from_preset(
                        args.preset,
                        residual=res,
                        quantize=None if q == "none" else q,
                        decode_matmul=mm,
                    )
                    w = Workload(tp, b, args.prompt_len, args.new_tokens, target=args.target)
                    r = roofline.layer_report(cfg, w)
                    if args.json:
                        print(
                            json.dumps(
                                {
                                    "quantize": q,
                                    "tp": tp,
                                    "batch": b,
                                    "residual": res,
                                    "decode_matmul": mm,
                                    **{k: v for k, v in r.items() if k != "layer_kernels"},
                                }
                            )
                        )
                    else:
                        print(
                            f"{q:<5} {tp:>3} {b:>5} {res:<10} {mm:<6} "
                            f"{r['layer_bytes'] / 1e6:>9.2f}"
                            f" {r['layer_min_bytes'] / 1e6:>8.2f} "
                            f"{r['bytes_vs_minimum']:>5.2f}x {r['kernels_per_layer']:>7} "
                            f"{r['collectives_per_layer']:>5}",
                            flush=True,
                        )
                    if args.kernels:
                        for name, nb in r["layer_kernels"]:
                            print(f"      {name:<40} {nb / 1e6:>10.3f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
