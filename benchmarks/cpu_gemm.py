"""Float32 matmul rates on this CPU at the shapes of SmolLM2-135M's training step (batch 8 x 256
= 2048 rows, d_model 576, SwiGLU 1536, vocabulary 49152 in chunks of 512 rows): XLA:CPU with
the options the package's training steps compile with, XLA:CPU's defaults, and PyTorch (its
BLAS), same threads. What bounds a CPU training step once its other costs are gone: the step
is ~3/4 matmul time (`jax.profiler` trace of the SmolLM2 step on a 2-core Xeon).

    python benchmarks/cpu_gemm.py [--threads N] [--repeats 7]

Each figure is 2 M K N / the median time of `--repeats` calls after one warm-up, on random
data; one row per shape and form (NN: x @ w; NT: x @ w.T; TN: x.T @ w, a weight gradient).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# (name, M, K, N, form)
SHAPES = [
    ("q/o projection", 2048, 576, 576, "NN"),
    ("k or v projection", 2048, 576, 192, "NN"),
    ("gate or up", 2048, 576, 1536, "NN"),
    ("down", 2048, 1536, 576, "NN"),
    ("gate/up input grad", 2048, 1536, 576, "NT"),
    ("gate/up weight grad", 576, 2048, 1536, "TN"),
    ("head logits (chunk)", 512, 576, 49152, "NT"),
    ("head input grad", 512, 49152, 576, "NN"),
    ("head weight grad", 49152, 512, 576, "TN"),
]


def _operands(rng, m, k, n, form):
    import numpy as np

    a = rng.standard_normal((k, m) if form == "TN" else (m, k), np.float32)
    b = rng.standard_normal((n, k) if form == "NT" else (k, n), np.float32)
    return a, b


def _median(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    import torch

    import ladder_jax
    from ladder_jax.model import compilation

    torch.set_num_threads(args.threads)
    options = {
        "xla (train options)": compilation.compiler_options("cpu", "train"),
        "xla (defaults)": {},
    }
    forms = {
        "NN": lambda a, b: a @ b,
        "NT": lambda a, b: a @ b.T,
        "TN": lambda a, b: a.T @ b,
    }
    print(f"cpu: {ladder_jax.hardware.cpu_description()}; torch threads {args.threads}")
    print(
        f"{'shape':<22} {'M x K x N':>18} form  "
        + "  ".join(f"{k:>19}" for k in options)
        + f"  {'torch':>8}  GFLOP/s"
    )
    rng = np.random.default_rng(0)
    for name, m, k, n, form in SHAPES:
        a, b = _operands(rng, m, k, n, form)
        flops = 2.0 * m * k * n
        rates = []
        for opts in options.values():
            ja, jb = jax.numpy.asarray(a), jax.numpy.asarray(b)
            c = jax.jit(forms[form]).lower(ja, jb).compile(compiler_options=opts)
            rates.append(flops / _median(lambda: c(ja, jb).block_until_ready(), args.repeats))
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        rates.append(flops / _median(lambda: forms[form](ta, tb), args.repeats))
        print(
            f"{name:<22} {f'{m} x {k} x {n}':>18} {form:>4}  "
            + "  ".join(f"{r / 1e9:>19.0f}" for r in rates[:-1])
            + f"  {rates[-1] / 1e9:>8.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
