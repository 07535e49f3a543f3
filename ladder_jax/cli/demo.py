"""A first look on any machine: every residual scheme, sharded over all devices (8 fake devices
on a CPU), checked against an unsharded run of the same weights. `python -m ladder_jax.demo`."""

from __future__ import annotations

import sys
import time

import jax
import numpy as np
from flax import nnx

import ladder_jax as lj
from ladder_jax.cli.common import ArgumentParser


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m ladder_jax.demo", description=__doc__)
    p.add_argument("--preset", default="tiny", help="model preset (random weights, seed 0)")
    p.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel size (default: all devices)"
    )
    p.add_argument("--batch", type=int, default=2, help="sequences of random tokens")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="fake devices to split a CPU host into (default: 8; ignored on GPU)",
    )
    args = p.parse_args(argv)
    lj.sharding.setup_host(args.cpu_devices)
    try:
        tp = args.tp or len(jax.devices())
        mesh = lj.make_mesh(tp=tp, data=1, devices=jax.devices()[:tp])
        mesh1 = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
        base = lj.ModelConfig.from_preset(args.preset)
        if args.seq > base.max_seq_len:
            raise lj.ConfigError(
                f"--seq {args.seq} exceeds the preset's max_seq_len {base.max_seq_len}"
            )
        lj.sharding.WeightSpecs.for_model(base, mesh)
    except lj.UsageError as e:  # ShardingError included
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(
        f"{len(jax.devices())} {jax.default_backend()} devices; preset {args.preset!r} "
        f"({base.num_params() / 1e6:.2f}M params), tp={tp}; random weights, seed 0\n"
    )
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq), 0, base.vocab_size)

    def compiled(model):  # jitted with the package's compiler options
        graphdef, state = nnx.split(model)
        fn = lj.sharding.jit(lambda s, t: nnx.merge(graphdef, s)(t))
        return lambda tokens: fn(state, tokens)

    schemes = [
        ("standard", {}),
        ("parallel", {}),
        ("ladder", {}),
        ("hybrid", {"ladder_layers": max(1, base.n_layers // 2)}),
        ("upper_bound", {}),
    ]
    print(
        f"{'scheme':<12} {'psums/layer':>11} {'max |logit diff| tp=1 vs tp=' + str(tp):>32} "
        f"{'first run s':>12} {'next run ms':>12}"
    )
    for name, extra in schemes:
        residual = "ladder" if name == "hybrid" else name
        config = lj.ModelConfig.from_preset(args.preset, residual=residual, **extra)
        sharded = lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0))
        single = lj.Transformer(config, mesh=mesh1, rngs=nnx.Rngs(0))
        run = compiled(sharded)
        t0 = time.perf_counter()
        out = np.asarray(run(tokens))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        np.asarray(run(tokens))
        again = (time.perf_counter() - t0) * 1e3
        diff = np.abs(out - np.asarray(compiled(single)(tokens))).max()
        psums = {
            "standard": "2",
            "parallel": "1",
            "ladder": "2 (async)",
            "hybrid": "2",
            "upper_bound": "0",
        }[name]
        note = "  <- no all-reduce: a speed ceiling, not a model" if name == "upper_bound" else ""
        print(f"{name:<12} {psums:>11} {diff:>32.2e} {first:>12.2f} {again:>12.2f}{note}")
    print(
        "\nEvery valid scheme gives the same logits sharded or not (differences are float32 "
        "rounding)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
