"""Serving benchmark of a real checkpoint (SmolLM2-135M-Instruct from its GGUF): start-up, memory,
shared system prompts, a mix of long and short prompts, and prompt-lookup on a code edit.

    python benchmarks/serve_real.py --checkpoint runs/smollm2 --out serve_real.json
    python benchmarks/serve_real.py --checkpoint runs/smollm2 --server-args "--max-len 4608"
    python benchmarks/serve_real.py --checkpoint runs/smollm2 --quick --scenarios shared

Starts `python -m ladder_jax.serve` twice on loopback with a fresh compilation cache
(LADDER_COMPILE_CACHE in a temporary directory): the first start fills it, the second loads
from it; each is timed from launch to the first answer. The second server then runs the
scenarios: "shared" (concurrent chat requests with one ~1,000-token system prompt and distinct
questions), "mix" (short streams decoding while a ~4,000-token prompt arrives: the short
streams' inter-token p99), "lookup" (a code-editing prompt, greedy: tokens/s and the draft
acceptance read from /metrics). Each scenario first runs unmeasured on other text of the
same shapes (what they compile on first use compiles there; "shared" keeps its system
prompt, as a server that has seen it before would). Every wait is bounded (per request and
per phase); the servers' output goes to files whose paths are printed. Prints a table
(markdown rows to paste into docs/results.md) and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

MODEL = "bench"
WARM_TOKENS = 4  # new tokens per request in a warm pass
CORPUS = os.path.join(os.path.dirname(__file__), "..", "ladder_jax", "corpus")
CODE = os.path.join(os.path.dirname(__file__), "serve_load.py"), "level"  # a 50-line function
SPEC = "ladder_spec_accepted_tokens_total", "ladder_spec_drafted_tokens_total"
PREFIX = "ladder_prefix_cache_hit_tokens_total", "ladder_prefix_cache_queried_tokens_total"

# (default, --quick) sizes of each scenario: fewer clients than 16 and one long prompt, so that
# the whole run stays near 10 minutes on a loaded 2-core CPU
SIZES = {
    "shared": {"clients": (8, 4), "system_tokens": (1000, 200), "max_tokens": (16, 8)},
    "mix": {"long": (1, 1), "long_tokens": (4000, 600), "short": (8, 4), "short_tokens": (50, 50),
            "short_max_tokens": (32, 16), "long_max_tokens": (8, 4)},
    "lookup": {"requests": (1, 1), "max_tokens": (128, 32)},
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tokens:
    """Counts and cuts text in the checkpoint's tokens (its tokenizer.json; bytes otherwise)."""

    def __init__(self, checkpoint: str):
        path = os.path.join(checkpoint, "tokenizer.json")
        self.tok = None
        if os.path.isfile(path):
            from tokenizers import Tokenizer  # optional: the [hf] extra

            self.tok = Tokenizer.from_file(path)

    def cut(self, text: str, n: int) -> str:
        """The longest start of `text` of at most `n` tokens (at a word boundary)."""
        if self.tok is None:
            return text.encode()[:n].decode(errors="ignore")
        enc = self.tok.encode(text, add_special_tokens=False)
        if len(enc.ids) <= n:
            return text
        end = enc.offsets[n - 1][1]
        return text[:end].rsplit(" ", 1)[0]


def corpus_text(start_line: int) -> str:
    with open(os.path.join(CORPUS, "devils_dictionary.txt"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    return " ".join(line.strip() for line in lines[start_line:] if line.strip())


# -- the server -----------------------------------------------------------------------------


class Server:
    """`python -m ladder_jax.serve` in a subprocess on a free loopback port; stdout and stderr
    in files under `workdir`."""

    def __init__(self, args, cache_dir: str, workdir: str, tag: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(workdir, f"server_{tag}.log")
        cmd = [sys.executable, "-m", "ladder_jax.serve", "--checkpoint", args.checkpoint]
        cmd += ["--port", str(self.port), "--model-name", MODEL, "--max-queue", "256"]
        cmd += shlex.split(args.server_args)
        self.cmd = cmd
        env = {**os.environ, "LADDER_COMPILE_CACHE": cache_dir}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        self.t0 = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, bound_s: float) -> float:
        """Seconds from launch until /health answers 200; SystemExit if it exits or the bound
        passes (the server's log tail said)."""
        deadline = self.t0 + bound_s
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server not up in {bound_s:.0f} s:\n{self.tail()}")
            try:  # the poll interval: returns at once if the server exits
                self.proc.wait(0.25)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, n: int = 12) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def rss(self) -> dict:
        """VmRSS and VmHWM (MiB) of the server and its children, from /proc."""
        pids = [self.proc.pid, *children(self.proc.pid)]
        got = {"rss_mib": 0.0, "hwm_mib": 0.0}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        key, _, value = line.partition(":")
                        if key in ("VmRSS", "VmHWM"):
                            name = "rss_mib" if key == "VmRSS" else "hwm_mib"
                            got[name] += int(value.split()[0]) / 1024
            except OSError:
                pass
        return got

    def metrics(self) -> dict[str, float]:
        try:
            text = httpx.get(f"{self.base}/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc/*/stat)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


# -- requests -------------------------------------------------------------------------------


async def chat(client, messages, max_tokens: int, timeout: float) -> dict:
    """One streamed chat request: arrival-relative chunk times, usage, or the error."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, stamps, usage = time.perf_counter(), [], {}
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            stamps.append(time.perf_counter() - start)
    except (TimeoutError, httpx.HTTPError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"start": start, "stamps": stamps, "usage": usage}


def summary(results: list[dict], wall: float) -> dict:
    """TTFT p50/p99, inter-token p99 (gaps between a stream's chunks), output tokens/s."""
    ok = [r for r in results if "error" not in r and r["stamps"]]
    ttft = [r["stamps"][0] for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in ok)
    cached = sum(
        ((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for r in ok
    )
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else None  # noqa: E731
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "seconds": wall,
        "prompt_tokens": sum(r["usage"].get("prompt_tokens", 0) for r in ok),
        "cached_tokens": cached,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else None,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(gaps, 50),
        "itl_p99_ms": pct(gaps, 99),
    }


def client_for(server: Server, timeout: float):
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=server.base, timeout=timeout, limits=limits)


# -- scenarios ------------------------------------------------------------------------------


async def shared(server: Server, tokens: Tokens, size: dict, timeout: float, variant: int) -> dict:
    """`clients` concurrent chats with one system prompt and distinct questions. The warm pass
    sends the same system prompt (a server that has seen it before), other questions."""
    system = tokens.cut(corpus_text(200), size["system_tokens"])
    words = corpus_text(4000 + 1000 * variant).split()[::7][: size["clients"]]
    asks = [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"In a few words: what is '{w}'? ({i})"},
        ]
        for i, w in enumerate(words)
    ]
    t0 = time.perf_counter()
    async with client_for(server, timeout) as client:
        results = await asyncio.gather(
            *[chat(client, m, size["max_tokens"], timeout) for m in asks]
        )
    return summary(results, time.perf_counter() - t0)


async def mix(server: Server, tokens: Tokens, size: dict, timeout: float, variant: int) -> dict:
    """Short chats start; once each has its first token, the long prompts arrive. The short
    streams' figures (their inter-token p99 is what a long prefill stalls) and the longs'."""
    text = corpus_text(1000 + 500 * variant)
    shorts = [
        [{"role": "user", "content": tokens.cut(text[i * 997 :], size["short_tokens"])}]
        for i in range(size["short"])
    ]
    longs = [
        [{"role": "user", "content": tokens.cut(text[50_000 * (i + 1) :], size["long_tokens"])}]
        for i in range(size["long"])
    ]
    t0 = time.perf_counter()
    async with client_for(server, timeout) as client:
        short_tasks = [
            asyncio.create_task(chat(client, m, size["short_max_tokens"], timeout)) for m in shorts
        ]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(t.done() for t in short_tasks):
            if await server_busy(client) >= len(shorts):  # every short one is decoding
                break
            await asyncio.sleep(0.05)  # a poll interval of /health
        long_results = await asyncio.gather(
            *[chat(client, m, size["long_max_tokens"], timeout) for m in longs]
        )
        short_results = await asyncio.gather(*short_tasks)
    wall = time.perf_counter() - t0
    out = summary(short_results, wall)
    out["long"] = summary(long_results, wall)
    return out


async def server_busy(client) -> int:
    try:
        return (await client.get("/health")).json().get("busy", 0)
    except (httpx.HTTPError, ValueError):
        return 0


async def lookup(server: Server, tokens: Tokens, size: dict, timeout: float, variant: int) -> dict:
    """A code edit, greedy, one request at a time: tokens/s of a single stream."""
    code = function_source(*CODE)
    old, new = (("stamps", "chunk_times"), ("ttft", "first_token_s"))[variant]
    ask = [
        {
            "role": "user",
            "content": f"Rename the variable `{old}` to `{new}` everywhere in this Python "
            "function. Return the whole function, changed, and nothing else.\n\n" + code,
        }
    ]
    results, t0 = [], time.perf_counter()
    async with client_for(server, timeout) as client:
        for _ in range(size["requests"]):
            results.append(await chat(client, ask, size["max_tokens"], timeout))
    return summary(results, time.perf_counter() - t0)


def function_source(path: str, name: str) -> str:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    node = next(n for n in ast.walk(ast.parse(source)) if getattr(n, "name", None) == name)
    return ast.get_source_segment(source, node)


SCENARIOS = {"shared": shared, "mix": mix, "lookup": lookup}


def ratio(before: dict, after: dict, names) -> float | None:
    num, den = (after.get(n, 0) - before.get(n, 0) for n in names)
    if not any(n in after for n in names):
        return None
    return num / den if den else None


# -- main -----------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="runs/smollm2", help="a checkpoint with a chat template")
    p.add_argument("--server-args", default="", help='extra serve flags, e.g. "--max-len 4608"')
    p.add_argument("--scenarios", default="shared,mix,lookup", help="comma list of them")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--quick", action="store_true", help="small sizes, for a dry run")
    p.add_argument("--startup-seconds", type=float, default=900, help="bound on each start")
    p.add_argument("--request-seconds", type=float, default=300, help="bound on each request")
    p.add_argument("--phase-seconds", type=float, default=600, help="bound on each scenario")
    p.add_argument("--label", default="", help="a name for this run's rows (e.g. before)")
    p.add_argument("--table", default=None, help="only print the table of a saved --out file")
    args = p.parse_args()
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"--scenarios: unknown {', '.join(bad)} (known: {', '.join(SCENARIOS)})")
    if not args.table and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint}: no such directory")
    return args


def first_answer(server: Server, bound_s: float, timeout: float) -> dict:
    """Seconds from launch to /health and to the first answer of a short chat."""
    up = server.wait_healthy(bound_s)

    async def ask():
        async with client_for(server, timeout) as client:
            return await chat(client, [{"role": "user", "content": "Hi!"}], 4, timeout)

    r = asyncio.run(ask())
    if "error" in r:
        raise SystemExit(f"first request failed: {r['error']}\n{server.tail()}")
    return {"health_s": up, "first_answer_s": time.monotonic() - server.t0}


def scenario(args, server: Server, tokens: Tokens, name: str, size: dict, variant: int) -> dict:
    """One scenario's figures, bounded by --phase-seconds. Variant 1 is the unmeasured warm
    pass (other text, the same shapes: the programs a shape needs compile there)."""
    print(f"scenario {name}{' (warm pass)' if variant else ''} ...", file=sys.stderr, flush=True)
    if variant:  # the prompts' shapes, few new tokens: the decode programs are warm already
        size = {k: min(v, WARM_TOKENS) if "max_tokens" in k else v for k, v in size.items()}
    coro = SCENARIOS[name](server, tokens, size, args.request_seconds, variant)
    try:
        return asyncio.run(asyncio.wait_for(coro, args.phase_seconds))
    except TimeoutError:
        return {"error": f"over --phase-seconds {args.phase_seconds:g}"}


def start_line(server: Server) -> str:
    with open(server.log, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.startswith(("serving ", "KV cache: ", "note: "))]
    return " | ".join(lines)


def run(args) -> dict:
    sel = 1 if args.quick else 0
    sizes = {s: {k: v[sel] for k, v in SIZES[s].items()} for s in args.scenarios}
    tokens = Tokens(args.checkpoint)
    report = {"server_args": args.server_args, "quick": args.quick, "sizes": sizes}
    report["load_average"] = os.getloadavg()[0]
    logs = tempfile.mkdtemp(prefix="serve_real_logs_")  # kept: the servers' output
    print(f"server logs: {logs}/server_{{first,second}}.log", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="serve_real_cache_") as tmp:
        cache = os.path.join(tmp, "xla")
        first = Server(args, cache, logs, "first")
        try:
            report["first_start"] = first_answer(first, args.startup_seconds, args.request_seconds)
        finally:
            first.stop()
        report["cache_files"] = len(os.listdir(cache)) if os.path.isdir(cache) else 0
        second = Server(args, cache, logs, "second")
        report["command"] = " ".join(shlex.quote(c) for c in second.cmd)
        try:
            report["second_start"] = first_answer(
                second, args.startup_seconds, args.request_seconds
            )
            report["idle_memory"] = second.rss()
            report["start_line"] = start_line(second)
            save(args, report)
            for name in args.scenarios:
                report[f"{name}_warm"] = scenario(args, second, tokens, name, sizes[name], 1)
                before = second.metrics()
                fig = scenario(args, second, tokens, name, sizes[name], 0)
                after = second.metrics()
                fig["spec_acceptance"] = ratio(before, after, SPEC)
                fig["prefix_hit_rate"] = ratio(before, after, PREFIX)
                report[name] = fig
                save(args, report)
            report["peak_memory"] = second.rss()
        finally:
            second.stop()
    return report


def save(args, report: dict) -> None:
    """--out after each phase: an interrupted run keeps what it measured."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def fmt(v, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(report: dict, label: str) -> str:
    f, s, m = report["first_start"], report["second_start"], report["idle_memory"]
    lines = [
        "| run | first start to answer (s) | second start (s) | idle RSS (MiB) | server args |",
        "|---|---|---|---|---|",
        f"| {label} | {f['first_answer_s']:.1f} | {s['first_answer_s']:.1f} | "
        f"{m['rss_mib']:,.0f} | `{report['server_args'] or '(defaults)'}` |",
        "",
        "| run | scenario | requests (failed) | prompt tok (cached) | TTFT p50 / p99 (ms) | "
        "ITL p99 (ms) | output tok/s | prefix hits | draft acceptance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SCENARIOS:
        r = report.get(name)
        if not r or "requests" not in r:
            continue
        rows = [(name, r)]
        if name == "mix":
            rows = [(f"{name} (short streams)", r), (f"{name} (long prompt)", r["long"])]
        for what, r in rows:
            lines.append(
                f"| {label} | {what} | {r['requests']} ({r['failed']}) | {r['prompt_tokens']:,} "
                f"({r['cached_tokens']:,}) | {fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p99_ms'])} "
                f"| {fmt(r['itl_p99_ms'])} | {fmt(r['tokens_per_s'], '.1f')} | "
                f"{fmt(r.get('prefix_hit_rate'), '.0%')} | {fmt(r.get('spec_acceptance'), '.0%')} |"
            )
    return "\n".join(lines)


def main() -> int:
    args = parse()
    if args.table:  # print a saved run's table again
        with open(args.table) as f:
            print(table(json.load(f), args.label or "run"))
        return 0
    t0 = time.monotonic()
    report = run(args)
    report["wall_s"] = time.monotonic() - t0
    print(f"# {report['command']}")
    print(f"# {report['start_line']}")
    print(f"# load average at start {report['load_average']:.1f} ({os.cpu_count()} CPUs); "
          f"benchmark wall {report['wall_s']:.0f} s")  # fmt: skip
    print(table(report, args.label or "run"))
    save(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
