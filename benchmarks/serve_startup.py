"""Where a server start's seconds go: `python -m ladder_jax.serve` timed phase by phase, from
launch to the first answer, with an empty compilation cache and then with the one it filled.

    python benchmarks/serve_startup.py --checkpoint runs/smollm2 --server-args "--max-len 2048"
    python benchmarks/serve_startup.py --checkpoint runs/smollm2 --repeat 3 --out startup.json
    python benchmarks/serve_startup.py --checkpoint runs/smollm2 --compile-only  # prototype

Each start runs this script again as a child (`--child`), which wraps the serve command's
phases (imports, devices, checkpoint restore, tokenizer, KV cache, engine, each warm-up
program, the HTTP listener) with timers, listens to jax's compile events (tracing, lowering,
XLA compilation or cache load) and asks one short chat once /health says ok; then it stops.
A warm-up program's "run" is its time less tracing, lowering and compilation: executing it.
The compilation cache is a temporary directory (LADDER_COMPILE_CACHE), shared by the starts of
one repeat. Prints one table per start kind (the median over --repeat of each phase, seconds
since launch at its end) and writes JSON with --out."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

MODEL = "bench"
AOT_ENV = "SERVE_STARTUP_AOT"  # the child warms up with `compile_only`
LAUNCH_ENV = "SERVE_STARTUP_LAUNCH"  # the parent's time.time() at launch
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}


# -- the child: one timed start -------------------------------------------------------------


class Phases:
    """Named phases with their end time since launch and their own duration."""

    def __init__(self, launch: float):
        self.launch, self.rows = launch, []
        self.events = dict.fromkeys(COMPILE_EVENTS.values(), 0.0)

    def add(self, name: str, seconds: float, **extra) -> None:
        self.rows.append({"phase": name, "s": seconds, "at": time.time() - self.launch, **extra})

    def timed(self, name: str, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t)

        return wrapper

    def event(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.events[COMPILE_EVENTS[event]] += duration

    def take_events(self) -> dict:
        out = {k: round(v, 3) for k, v in self.events.items()}
        self.events = dict.fromkeys(COMPILE_EVENTS.values(), 0.0)
        return out


def child(serve_args: list[str], out: str) -> int:
    launch = float(os.environ[LAUNCH_ENV])
    ph = Phases(launch)
    ph.add("interpreter start", time.time() - launch)
    t = time.perf_counter()
    import jax

    from ladder_jax import loading
    from ladder_jax.cli import serve as cli

    ph.add("imports (ladder_jax.cli.serve)", time.perf_counter() - t)
    jax.monitoring.register_event_duration_secs_listener(ph.event)
    cli.setup_devices = ph.timed("devices (setup_devices)", cli.setup_devices)
    cli.sharding.tp_mesh = ph.timed("mesh", cli.sharding.tp_mesh)
    loading.load_params = ph.timed("weights (checksums, shapes, restore)", loading.load_params)
    loading.make_tokenizer = ph.timed("tokenizer", loading.make_tokenizer)
    cli._load = ph.timed("load (weights + tokenizer + model)", cli._load)
    cli._kv_plan = ph.timed("KV plan", cli._kv_plan)
    cli.Engine = ph.timed("engine (KV cache, fuse)", cli.Engine)
    _time_warmup(cli, ph)
    _time_http(cli, ph, out)
    try:
        return cli.main(serve_args)
    finally:
        _save(ph, out)


def _time_warmup(cli, ph: Phases) -> None:
    """Each warm-up program's compile events and run time (`Engine.warmup`'s progress)."""
    warm = cli._warmup

    def timed_warmup(engine):
        inner = engine.warmup
        programs = engine.warmup_programs()

        def warmup(progress=None):
            last = [time.perf_counter()]
            ph.take_events()

            def each(k, n):
                now = time.perf_counter()
                N, T = programs[k - 1]
                ev = ph.take_events()
                took = now - last[0]
                run = took - ev["trace"] - ev["lower"] - ev["compile"]
                what = f"warm-up {N} x {T}" if T else f"warm-up decode round ({N} slots)"
                ph.add(what, took, run=round(run, 3), **ev)
                last[0] = time.perf_counter()
                if progress is not None:
                    progress(k, n)

            return inner(each)

        engine.warmup = warmup
        if os.environ.get(AOT_ENV):
            with compile_only(engine.decoder, int(os.environ[AOT_ENV])):
                return warm(engine)
        return warm(engine)

    cli._warmup = ph.timed("warm-up (all programs)", timed_warmup)


@contextlib.contextmanager
def compile_only(decoder, threads: int = 0):
    """A prototype of an engine change: while the block runs, the decoder's programs are
    lowered and compiled (or loaded from the compilation cache) but not run; each returns
    zeros and the cache it was given. Later calls of the same shapes reuse what was compiled
    (jax's jit keeps the executable that `lower(...).compile()` made). `threads` > 0: the
    compiles (or cache loads) run in that many threads beside the next programs' tracing,
    all waited for when the block ends."""
    import concurrent.futures

    import jax.numpy as jnp

    saved = {k: getattr(decoder, k) for k in ("extend_slots", "decode_steps", "copy_prefix")}
    pool = concurrent.futures.ThreadPoolExecutor(threads) if threads else None
    pending = []

    def compile_(lowered):
        if pool is None:
            lowered.compile()
        else:
            pending.append(pool.submit(lowered.compile))

    def extend_slots(cache, slots_n, *rest):
        compile_(decoder.lower_extend(cache, slots_n, *rest))
        return jnp.zeros(slots_n.shape, jnp.int32), cache

    def decode_steps(cache, tokens_b, *rest):
        steps = rest[-1]
        compile_(decoder._decode_steps.lower(decoder.weights, cache, tokens_b, *rest))
        return jnp.zeros((steps, *tokens_b.shape), jnp.int32), cache

    def copy_prefix(cache, *rest):
        compile_(decoder._serving()[2].lower(cache, *rest))
        return cache

    decoder.extend_slots, decoder.decode_steps = extend_slots, decode_steps
    decoder.copy_prefix = copy_prefix
    try:
        yield
        for f in pending:
            f.result()
    finally:
        for k, v in saved.items():
            setattr(decoder, k, v)
        if pool is not None:
            pool.shutdown()


def _time_http(cli, ph: Phases, out: str) -> None:
    """The HTTP listener's start, /health ok, the first answer; then SIGTERM to ourselves."""
    import threading

    import httpx

    serve = cli._serve

    def timed_serve(args, engine, *rest):
        t0 = time.perf_counter()

        def probe():
            base = f"http://{args.host}:{args.port}"
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)  # the poll interval of /health
            ph.add("HTTP listener up (/health ok)", time.perf_counter() - t0)
            ph.take_events()  # from here: the first answer's, which should compile nothing
            t = time.perf_counter()
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}]}
            r = httpx.post(
                f"{base}/v1/chat/completions", json=body | {"max_tokens": 4}, timeout=300
            )
            took = time.perf_counter() - t
            ph.add("first answer", took, status=r.status_code, **ph.take_events())
            _save(ph, out)
            os.kill(os.getpid(), 15)

        threading.Thread(target=probe, daemon=True).start()
        return serve(args, engine, *rest)

    cli._serve = timed_serve


def _save(ph: Phases, out: str) -> None:
    with open(out, "w") as f:
        json.dump(ph.rows, f, indent=1)


# -- the parent: starts and tables ----------------------------------------------------------


def start(args, cache: str, tag: str, workdir: str) -> list[dict]:
    out = os.path.join(workdir, f"{tag}.json")
    log = os.path.join(workdir, f"{tag}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", out, "--"]
    port = args.port or free_port()
    cmd += ["--checkpoint", args.checkpoint, "--port", str(port), "--model-name", MODEL]
    cmd += shlex.split(args.server_args)
    env = {**os.environ, "LADDER_COMPILE_CACHE": cache, LAUNCH_ENV: repr(time.time())}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if args.compile_only:
        env[AOT_ENV] = str(args.compile_threads)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0 or not os.path.isfile(out):
        raise SystemExit(f"{tag}: exit {proc.returncode}, see {log}")
    with open(out) as f:
        rows = json.load(f)
    if not any(r["phase"] == "first answer" and r.get("status") == 200 for r in rows):
        raise SystemExit(f"{tag}: no answer, see {log}")
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_table(runs: list[list[dict]], title: str) -> str:
    """The median of each phase's seconds and end time over `runs` (phases in run order)."""
    import numpy as np

    names = [r["phase"] for r in runs[0]]
    lines = [f"### {title} (median of {len(runs)})", "", "| phase | s | at (s since launch) |"]
    lines.append("|---|---|---|")
    for i, name in enumerate(names):
        got = [run[i] for run in runs if len(run) > i and run[i]["phase"] == name]
        s = float(np.median([g["s"] for g in got]))
        at = float(np.median([g["at"] for g in got]))
        extra = ""
        if "run" in got[0]:
            keys = ("trace", "lower", "compile", "cache_read", "run")
            parts = {k: float(np.median([g[k] for g in got])) for k in keys}
            extra = " (" + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + ")"
        lines.append(f"| {name}{extra} | {s:.2f} | {at:.1f} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[4:], sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--server-args", default="", help='extra serve flags, e.g. "--max-len 2048"')
    p.add_argument("--repeat", type=int, default=1, help="first + second starts, this many times")
    p.add_argument("--port", type=int, default=0, help="the servers' port (default: a free one)")
    p.add_argument("--out", default=None, help="write every run's phases as JSON here")
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="warm up by compiling the programs without running them (a prototype of an "
        "engine change: `compile_only`)",
    )
    p.add_argument(
        "--compile-threads",
        type=int,
        default=0,
        help="--compile-only: compile (or load) in this many threads beside the tracing",
    )
    args = p.parse_args()
    report = {"server_args": args.server_args, "first": [], "second": []}
    workdir = tempfile.mkdtemp(prefix="serve_startup_")
    print(f"logs: {workdir}", file=sys.stderr, flush=True)
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="serve_startup_cache_") as tmp:
            for kind in ("first", "second"):
                report[kind].append(start(args, tmp, f"{kind}{i}", workdir))
                total = report[kind][-1][-1]["at"]
                print(f"{kind} start {i + 1}: {total:.1f} s", file=sys.stderr, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"# load average {os.getloadavg()[0]:.1f}; server args: {args.server_args}")
    for kind in ("first", "second"):
        print(median_table(report[kind], f"{kind} start"))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
