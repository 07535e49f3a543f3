"""Load benchmark of `python -m ladder_jax.serve` on loopback, against the same prompts run one by
one through `lj.generate`.

    python benchmarks/serve_load.py --preset small --clients 1 4 16 64 --requests 64
    python benchmarks/serve_load.py --clients 16 --max-tokens 64 --max-len 512  # roomy slots

Starts the server (random weights of --preset, greedy requests, --slots rows), then for each
number of concurrent clients sends --requests streaming completions (each client sends its
next request when the previous one ends; bounded by --max-seconds per level) and prints
requests/s, output tokens/s, p50/p99 time to first token (first streamed chunk) and p50/p99
inter-token latency (the gaps between a request's tokens: (last - first chunk) / (tokens - 1),
since a chunk may carry several byte tokens when a UTF-8 character is cut). Then the
one-by-one baseline: the same prompts through `lj.generate` in this process, compiled first,
on the same number of devices. Everything stays on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import openai
from flax import nnx

import ladder_jax as lj
from ladder_jax.inference.generation import Decoder
from ladder_jax.interop.tokenizer import ByteTokenizer

MODEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts_for(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = "the a ladder of residual streams overlaps its all-reduce with the next module".split()
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 11)))) for _ in range(n)]


async def level(
    base: str, clients: int, prompts: list[str], max_tokens: int, max_seconds: float
) -> dict:
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    todo = list(prompts)
    ttft, itl, tokens, done = [], [], [0], [0]
    t0 = time.perf_counter()

    async def one(prompt):
        start = time.perf_counter()
        stamps, n = [], 0
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
            elif chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
        if stamps:
            ttft.append(stamps[0] - start)
            if n > 1:
                itl.append((stamps[-1] - stamps[0]) / (n - 1))
        tokens[0] += n
        done[0] += 1

    async def worker():
        while todo and time.perf_counter() - t0 < max_seconds:
            await one(todo.pop())

    await asyncio.gather(*[worker() for _ in range(clients)])
    wall = time.perf_counter() - t0
    await client.close()
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")  # noqa: E731
    return {
        "clients": clients,
        "requests": done[0],
        "seconds": wall,
        "requests_per_s": done[0] / wall,
        "tokens_per_s": tokens[0] / wall,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument(
        "--steps-per-plan",
        type=int,
        default=2,
        help="the server's decode steps per scheduling round",
    )
    p.add_argument(
        "--prefills-per-step",
        type=int,
        default=4,
        help="the server's admissions per decode step (prefilled together)",
    )
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="the server's slots per row (default: 128 + --max-tokens)",
    )
    p.add_argument("--max-seconds", type=float, default=120, help="bound per level")
    p.add_argument(
        "--startup-seconds",
        type=float,
        default=600,
        help="bound on the server's start (it compiles its programs first)",
    )
    p.add_argument(
        "--baseline-requests",
        type=int,
        default=16,
        help="prompts timed one by one through lj.generate",
    )
    args = p.parse_args()

    port = free_port()
    max_len = args.max_len or 128 + args.max_tokens
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ladder_jax.serve",
            "--preset",
            args.preset,
            "--tp",
            str(args.tp),
            "--slots",
            str(args.slots),
            "--steps-per-plan",
            str(args.steps_per_plan),
            "--prefills-per-step",
            str(args.prefills_per_step),
            "--max-queue",
            str(max(args.clients) * 2),
            "--port",
            str(port),
            "--model-name",
            MODEL,
            "--max-len",
            str(max_len),
        ],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.startup_seconds
        while True:
            if server.poll() is not None:
                print(server.stderr.read(), file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server not up in {args.startup_seconds:.0f} s")
            time.sleep(0.5)
        prompts = prompts_for(args.requests)
        asyncio.run(level(f"{base}/v1", 2, prompts[:4], args.max_tokens, 60))  # warm
        rows = [
            asyncio.run(level(f"{base}/v1", c, prompts, args.max_tokens, args.max_seconds))
            for c in args.clients
        ]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    base_prompts = prompts_for(args.baseline_requests)
    b = baseline(args, base_prompts)
    print(
        f"preset {args.preset}, tp={args.tp}, {args.slots} slots of {max_len}, "
        f"{args.steps_per_plan} "
        f"steps per plan, {args.prefills_per_step} prefills per step, greedy, max_tokens "
        f"{args.max_tokens}, loopback; load average {os.getloadavg()[0]:.1f} "
        f"({os.cpu_count()} CPUs)"
    )
    print(
        f"{'clients':>7} {'reqs':>5} {'req/s':>7} {'tok/s':>8} {'vs 1-by-1':>9} "
        f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}  (ms)"
    )
    for r in rows:
        print(
            f"{r['clients']:>7} {r['requests']:>5} {r['requests_per_s']:>7.2f} "
            f"{r['tokens_per_s']:>8.1f} {r['tokens_per_s'] / b['tokens_per_s']:>8.2f}x "
            f"{r['ttft_p50_ms']:>9.0f} {r['ttft_p99_ms']:>8.0f} {r['itl_p50_ms']:>8.1f} "
            f"{r['itl_p99_ms']:>8.1f}"
        )
    print(
        f"one by one through lj.generate: {b['requests']} requests, "
        f"{b['requests'] / b['seconds']:.2f} req/s, {b['tokens_per_s']:.1f} tok/s"
    )
    return 0


def baseline(args, prompts: list[str]) -> dict:
    """The same prompts through `lj.generate`, one at a time, after compiling their shapes."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.tp)
    mesh = lj.make_mesh(tp=args.tp, data=1)
    model = lj.Transformer(lj.ModelConfig.from_preset(args.preset), mesh=mesh, rngs=nnx.Rngs(0))
    decoder = Decoder(model)
    tokenizer = ByteTokenizer()
    rows = [tokenizer.encode(p) for p in prompts]
    for r in rows:  # compile every shape first (the server compiled at start-up too)
        lj.generate(
            model, [r], max_new_tokens=args.max_tokens, decoder=decoder, eos_id=tokenizer.eos_id
        )
    t0, n = time.perf_counter(), 0
    for r in rows:
        n += len(
            lj.generate(
                model, [r], max_new_tokens=args.max_tokens, decoder=decoder, eos_id=tokenizer.eos_id
            )[0]
        )
    wall = time.perf_counter() - t0
    return {"requests": len(rows), "seconds": wall, "tokens_per_s": n / wall}


if __name__ == "__main__":
    sys.exit(main())
