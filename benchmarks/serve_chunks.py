"""Inter-token latency of short streams while long prompts arrive, with chunked prefill and with
each prompt prefilled whole (a chunk as long as the slot), on the engine in-process (no HTTP).

    python benchmarks/serve_chunks.py --preset tiny --max-len 256 --chunks 32 256

Random weights of --preset, greedy; 4 short prompts (16 tokens) generate --new tokens each
while --longs prompts of nearly --max-len tokens arrive --gap seconds apart. Prints, per chunk
size, the warm-up's programs and time and the short streams' gaps between rounds (tokens come
--steps-per-plan per round: gaps under 0.5 ms are within a round) p50 / p99 / max.
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


def run(model, args, chunk: int) -> str:
    rng = np.random.default_rng(0)
    engine = Engine(model, slots=8, max_len=args.max_len, chunk=chunk, prefix_block=None)
    start = time.perf_counter()
    engine.warmup()
    warm = time.perf_counter() - start
    engine.start()
    done, stamps = threading.Semaphore(0), [[] for _ in range(4)]
    try:
        for ts in stamps:
            prompt = [256] + rng.integers(0, 250, 15).tolist()
            engine.submit(
                Request(
                    prompt,
                    args.new,
                    on_token=lambda t, ts=ts: ts.append(time.perf_counter()),
                    on_finish=lambda why: done.release(),
                )
            )
        while min(map(len, stamps)) < 5:  # the short streams run, then the long prompts come
            time.sleep(0.01)
        for _ in range(args.longs):
            prompt = [256] + rng.integers(0, 250, args.max_len - 17).tolist()
            engine.submit(Request(prompt, 4, on_finish=lambda why: done.release()))
            time.sleep(args.gap)
        for _ in range(4 + args.longs):
            assert done.acquire(timeout=600), engine.error
    finally:
        engine.drain(5)
    gaps = np.concatenate([np.diff(ts) for ts in stamps]) * 1e3
    rounds = gaps[gaps > 0.5]
    return (
        f"chunk {chunk}: warm-up {len(engine.warmup_programs())} programs in {warm:.1f} s; "
        f"short streams' gaps between rounds p50 {np.percentile(rounds, 50):.1f} ms, "
        f"p99 {np.percentile(rounds, 99):.1f} ms, max {rounds.max():.1f} ms"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 256])
    p.add_argument("--new", type=int, default=200, help="tokens each short stream generates")
    p.add_argument("--longs", type=int, default=12, help="long prompts arriving")
    p.add_argument("--gap", type=float, default=0.03, help="seconds between long prompts")
    args = p.parse_args()
    config = lj.ModelConfig.from_preset(args.preset)
    mesh = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    model = lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0))
    for chunk in args.chunks:
        print(run(model, args, chunk), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
