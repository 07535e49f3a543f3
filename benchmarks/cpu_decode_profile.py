"""Where a CPU decode step and prefill spend their time: XLA:CPU's own trace of the programs
`python -m ladder_jax.decode --benchmark` runs, summed per kind of kernel (the fused
computation's root op and result shape), and the same programs with XLA:CPU's intra-op thread
pool at one thread (`PJRT_NPROC=1`, a separate process) beside the default (every core).

    python benchmarks/cpu_decode_profile.py [--preset small] [--batch 16] [--prompt-len 128]
        [--new-tokens 64] [--top 20] [--no-threads]

What it showed on a 2-core Intel Xeon (AVX-512, AMX), `small` preset, batch 16: a decode step
of 4.6-4.7 ms is 212 kernels (5.3 ms of kernel time), the YNNPACK matmuls 60-160 us each
whatever their FLOPs (gate/up [16,256]x[256,1536] 159 us; the attention matmuls per layer
~195 us); one intra-op thread runs the step about as fast (4.8 ms) while prefill needs both
(222 vs 122-128 ms; its gate/up matmul 5.5 ms per layer, 44 of its 142 ms of kernel time).
The rows are kernel time, not wall time: kernels XLA runs at once both count.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def kernel_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> 'kind root-op shape' for every fusion and plain instruction of a
    compiled HLO module (the names XLA:CPU's trace events carry)."""
    roots = {}
    for m in re.finditer(r"^%(\S+) \(.*?\n(.*?)^}", hlo_text, re.S | re.M):
        root = re.search(r"ROOT \S+ = (\S+?)(?:\{[^}]*\})? (\S+?)\(", m.group(2))
        if root:
            roots[m.group(1)] = f"{root.group(2)} {root.group(1)}"
    kinds = {}
    for name, rest in re.findall(r"^\s*(?:ROOT )?%(\S+) = (.*)$", hlo_text, re.M):
        call = re.search(r"calls=%([\w.\-]+)", rest)
        op = re.search(r"^\S+ ([a-z\-]+)\(", rest)
        if call and call.group(1) in roots and op and op.group(1) == "fusion":
            kinds[name] = f"{re.sub(r'[._]?[0-9]+$', '', name)}: {roots[call.group(1)]}"
        elif op:
            kinds[name] = op.group(1)
    return kinds


def profile(fn, hlo_text: str, runs: int) -> list[tuple[float, float, str]]:
    """(ms per run, kernels per run, kind) of `runs` calls of `fn`, largest first."""
    import jax

    d = tempfile.mkdtemp(prefix="ladder_jax_profile_")
    jax.profiler.start_trace(d)
    for _ in range(runs):
        fn()
    jax.profiler.stop_trace()
    trace = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))[-1]
    kinds = kernel_kinds(hlo_text)
    ms, n = collections.defaultdict(float), collections.Counter()
    with gzip.open(trace) as f:
        for e in json.load(f)["traceEvents"]:
            if e.get("ph") == "X" and e["name"] in kinds:
                ms[kinds[e["name"]]] += e["dur"] / 1e3 / runs
                n[kinds[e["name"]]] += 1
    return sorted(((v, n[k] / runs, k) for k, v in ms.items()), reverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64, help="sets the cache length")
    ap.add_argument("--top", type=int, default=20, help="kernel kinds listed per program")
    ap.add_argument(
        "--no-threads",
        action="store_true",
        help="skip the one-thread comparison (two more processes)",
    )
    ap.add_argument("--times-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag, value, low in (
        ("--batch", args.batch, 1),
        ("--prompt-len", args.prompt_len, 1),
        ("--new-tokens", args.new_tokens, 1),
        ("--top", args.top, 1),
    ):
        if value < low:
            ap.error(f"{flag} {value}: must be at least {low}")

    import ladder_jax as lj  # first: it imports jax without the CUDA plugin's start-up lines

    lj.runtime.setup(cpu_devices=1)
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from ladder_jax.inference import generation as gen
    from ladder_jax.inference.cache import KVCache, cache_length
    from ladder_jax.model import sharding

    config = lj.ModelConfig.from_preset(args.preset)
    mesh = sharding.make_mesh(tp=1, data=1)
    B, T = args.batch, args.prompt_len
    gen.check_generation(config, [[0] * T], args.new_tokens)
    decoder = gen.Decoder(lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)), consume=True)
    S = cache_length(config, T, args.new_tokens)
    rows = gen.rows_to_device(gen.RowSampling.of([gen.Sampling()] * B), mesh)
    tokens = gen.to_device(
        np.random.default_rng(0).integers(0, min(256, config.vocab_size), (B, T), dtype=np.int32),
        mesh,
        P("data", None),
    )
    lengths = gen.to_device(np.full(B, T, np.int32), mesh, P("data"))
    position = gen.to_device(np.full(B, T, np.int32), mesh, P("data"))
    index = gen.to_device(np.full(B, 1, np.int32), mesh, P("data"))
    state = {"cache": KVCache.init(config, mesh, B, S)}
    state["tok"], state["cache"] = decoder.prefill(state["cache"], tokens, lengths, rows)

    def prefill():
        cache = KVCache.init(config, mesh, B, S)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        decoder.prefill(cache, tokens, lengths, rows)[0].block_until_ready()
        return time.perf_counter() - t0

    def step():  # the same slot each time: the work of one step, not a generation
        t0 = time.perf_counter()
        state["tok"], state["cache"] = decoder.decode_step(
            state["cache"], state["tok"], position, rows, index
        )
        state["tok"].block_until_ready()
        return time.perf_counter() - t0

    for _ in range(3):
        step(), prefill()
    step_ms = 1e3 * float(np.median([step() for _ in range(32)]))
    prefill_ms = 1e3 * float(np.median([prefill() for _ in range(3)]))
    threads = os.environ.get("PJRT_NPROC") or f"{os.cpu_count()} (every core)"
    print(
        f"intra-op threads {threads}: decode step {step_ms:.2f} ms, prefill {prefill_ms:.1f} ms",
        flush=True,
    )
    if args.times_only:
        return 0
    print(
        f"cpu: {lj.hardware.cpu_description()}; jax {jax.__version__}; preset "
        f"{args.preset}, batch {B}, prompt {T}, cache {S} slots, float32"
    )
    programs = (
        (
            "decode step",
            step,
            decoder.lower_decode(state["cache"], state["tok"], position, rows, index),
            8,
        ),
        (
            "prefill",
            prefill,
            decoder.lower_prefill(KVCache.init(config, mesh, B, S), tokens, lengths, rows),
            2,
        ),
    )
    for name, fn, lowered, runs in programs:
        kernels = profile(fn, lowered.compile().as_text(), runs)
        total = sum(k[0] for k in kernels)
        print(
            f"\n{name}: {total:.2f} ms of kernel time per run, "
            f"{sum(k[1] for k in kernels):.0f} kernels"
        )
        for ms, n, kind in kernels[: args.top]:
            print(f"  {ms:8.3f} ms {n:5.0f}x  {ms / n * 1e3:7.1f} us each  {kind}")
    if not args.no_threads:
        print()
        base = [
            sys.executable,
            os.path.abspath(__file__),
            "--times-only",
            "--preset",
            args.preset,
            "--batch",
            str(B),
            "--prompt-len",
            str(T),
            "--new-tokens",
            str(args.new_tokens),
        ]
        for nproc in ("1", None):
            env = dict(os.environ)
            env.pop("PJRT_NPROC", None)
            if nproc:
                env["PJRT_NPROC"] = nproc
            out = subprocess.run(base, env=env, capture_output=True, text=True)
            print(out.stdout.strip() or out.stderr.strip()[-300:], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
