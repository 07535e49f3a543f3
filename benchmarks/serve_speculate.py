"""Prompt-lookup speculation on the engine in-process (no HTTP): tokens/s and acceptance with and
without drafting, on prompts whose continuation repeats them and on prompts that do not.

    python benchmarks/serve_speculate.py --preset tiny --speculate 0 4

Random weights of --preset, greedy, 4 requests at once of --new tokens each. A random model
copies nothing by itself, so the "repetitive" case is the model's own greedy output fed back:
each prompt is a first run's prompt + output + prompt + output (what a code edit or a quoted
document gives a real model); "fresh" prompts are random. Outputs are checked equal across
--speculate values.
"""

import argparse
import os
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import ladder_jax as lj  # noqa: E402
from ladder_jax.inference.batching import Engine, Request  # noqa: E402


def serve(model, prompts, new, speculate):
    """-> (each prompt's tokens, seconds, engine) of one batch through a fresh engine."""
    engine = Engine(model, slots=len(prompts), max_len=256, speculate=speculate)
    engine.warmup()
    engine.start()
    outs, done = [[] for _ in prompts], threading.Semaphore(0)
    start = time.perf_counter()
    try:
        for p, out in zip(prompts, outs):
            engine.submit(Request(p, new, on_token=out.append, on_finish=lambda w: done.release()))
        for _ in prompts:
            assert done.acquire(timeout=600), engine.error
        seconds = time.perf_counter() - start
    finally:
        engine.drain(5)
    return outs, seconds, engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--speculate", type=int, nargs="+", default=[0, 4])
    p.add_argument("--new", type=int, default=48)
    args = p.parse_args()
    config = lj.ModelConfig.from_preset(args.preset)
    mesh = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    model = lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    fresh = [[256] + rng.integers(0, 250, 31).tolist() for _ in range(4)]
    first, _, _ = serve(model, fresh, args.new, 0)
    cases = {
        "fresh": fresh,
        "repetitive": [(q + o) * 2 for q, o in zip(fresh, first)],
    }
    for name, prompts in cases.items():
        ref = None
        for k in args.speculate:
            outs, seconds, e = serve(model, prompts, args.new, k)
            assert ref is None or outs == ref, "speculation changed the output"
            ref = outs
            rate = e.accepted_tokens / e.drafted_tokens if e.drafted_tokens else 0.0
            print(
                f"{name} --speculate {k}: {sum(map(len, outs)) / seconds:.0f} tokens/s, "
                f"{e.steps} steps, drafted {e.drafted_tokens}, accepted {e.accepted_tokens} "
                f"({rate:.0%})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
