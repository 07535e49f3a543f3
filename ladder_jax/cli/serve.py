"""Serve a model over an OpenAI-compatible HTTP API: `python -m ladder_jax.serve`.

    python -m ladder_jax.serve --checkpoint runs/tiny --port 8000
    python -m ladder_jax.serve --preset small --tp 2 --slots 16 --api-key secret

Continuous batching over the jitted decode step (`ladder_jax.inference.batching`), the HTTP
API of `ladder_jax.inference.server` on uvicorn (`pip install -e ".[serve]"`). Binds 127.0.0.1
unless --host says otherwise. SIGTERM (or Ctrl-C) stops admitting (503), lets running requests
finish for up to --drain-seconds, cancels the rest and exits 0. Bad input is one line and exit
code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import jax
from flax import nnx

from ladder_jax import runtime
from ladder_jax.cli.common import ArgumentParser
from ladder_jax.config import (
    RESIDUALS,
    ConfigError,
    ModelConfig,
    parse_ladder_layers,
    scheme_overrides,
)
from ladder_jax.inference.batching import Engine
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.model import sharding
from ladder_jax.model.transformer import Transformer
from ladder_jax.train import checkpoint

try:  # the serve extra; its absence is one line at start-up, not a traceback
    import uvicorn

    from ladder_jax.inference.server import create_app
    _MISSING = None
except ImportError as e:
    _MISSING = e.name

API_KEY_ENV = "LADDER_API_KEY"


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m ladder_jax.serve", description=__doc__.split("\n\n")[0],
        epilog="Multi-host: start one process per host with --coordinator HOST:PORT "
               "--num-processes N --process-id I (or JAX_COORDINATOR_ADDRESS, "
               "JAX_NUM_PROCESSES, JAX_PROCESS_ID); process 0 serves HTTP and broadcasts "
               "each step's plan, tensor parallelism spans all processes' devices.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny",
                     help="model preset with random weights, for benchmarks (default: tiny)")
    src.add_argument("--checkpoint", help="a training run, checkpoint or Hugging Face directory, "
                                           "or a .gguf file")
    p.add_argument("--seed", type=int, default=0, help="--preset: the weights' seed")
    p.add_argument("--residual", default=None, choices=list(RESIDUALS),
                   help="residual scheme (default: the preset's / checkpoint's)")
    p.add_argument("--ladder-layers", default=None, help="ladder only: N or a comma list")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: all devices)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    p.add_argument("--model-name", default=None,
                   help="the model id clients name (default: the checkpoint directory's name "
                        "or the preset)")
    p.add_argument("--slots", type=int, default=16,
                   help="requests decoded together (rows of the KV cache)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; more get 503")
    p.add_argument("--max-len", type=int, default=None,
                   help="positions per request, prompt + max_tokens (default: max_seq_len)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="largest max_tokens a request may ask (default: --max-len - 1)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body (default 1 MiB); more get 413")
    p.add_argument("--prefills-per-step", type=int, default=4,
                   help="new requests admitted between two decode steps, prefilled together "
                        "(those of one prompt-length bucket in one program)")
    p.add_argument("--steps-per-plan", type=int, default=2,
                   help="decode steps run as one program between two scheduling rounds "
                        "(multi-step scheduling: fewer host round trips per token; a new "
                        "request waits at most this many steps to start)")
    p.add_argument("--drain-seconds", type=float, default=10.0,
                   help="on SIGTERM, how long running requests may finish")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (default: the checkpoint's "
                        "tokenizer_config.json chat_template or a GGUF file's, if any)")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile programs on first use instead of before serving")
    runtime.add_arguments(p, cpu_devices_help="on a CPU host, fake devices to split it into "
                                              "(default: --tp, else 1)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return _run(args)
    except ConfigError as e:  # GenerationError and ShardingError included
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check(args) -> None:
    for flag, v, low in (("--slots", args.slots, 1), ("--max-queue", args.max_queue, 0),
                         ("--prefills-per-step", args.prefills_per_step, 1),
                         ("--steps-per-plan", args.steps_per_plan, 1),
                         ("--max-request-bytes", args.max_request_bytes, 1),
                         ("--port", args.port, 0)):
        if v < low:
            raise ConfigError(f"{flag} {v}: must be >= {low}")
    if args.drain_seconds < 0:
        raise ConfigError(f"--drain-seconds {args.drain_seconds}: must be >= 0")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise ConfigError(f"--chat-template {args.chat_template}: no such file")
    if _MISSING:
        raise ConfigError(f"the server needs {_MISSING}: pip install -e \".[serve]\"")


def _chat_template(args, tokenizer) -> str | None:
    """--chat-template's file, else the tokenizer's (tokenizer_config.json's chat_template or
    chat_template.jinja beside tokenizer.json, a GGUF file's tokenizer.chat_template)."""
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            return f.read()
    template = getattr(tokenizer, "chat_template", None)
    if template is None and args.checkpoint and os.path.isdir(args.checkpoint):
        path = os.path.join(args.checkpoint, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
    return template if isinstance(template, str) else None


def _run(args) -> int:
    _check(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    runtime.setup(cpu_devices=args.cpu_devices or args.tp or 1, coordinator=args.coordinator,
                  num_processes=args.num_processes, process_id=args.process_id)
    n = jax.device_count()
    tp = n if args.tp is None else args.tp
    if not 1 <= tp <= n:
        raise ConfigError(f"--tp {tp}: between 1 and the {n} devices")
    if jax.process_count() > 1 and tp != n:
        raise ConfigError(f"--tp {tp}: with {jax.process_count()} processes the model must "
                          f"span all {n} devices (--tp {n})")
    mesh = sharding.make_mesh(tp=tp, data=1, devices=jax.devices()[:tp])
    overrides = scheme_overrides(args.residual, parse_ladder_layers(args.ladder_layers))
    if args.checkpoint:
        model, tokenizer = checkpoint.load_run(args.checkpoint, mesh=mesh, **overrides)
        name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    else:
        config = ModelConfig.from_preset(args.preset, **overrides)
        sharding.check_divisible(config, tp)
        model = Transformer(config, mesh=mesh, rngs=nnx.Rngs(args.seed))
        tokenizer, name = ByteTokenizer(), args.model_name or args.preset
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"the model has vocab_size={model.config.vocab_size}, too small for "
                          f"its tokenizer ({tokenizer.vocab_size} tokens)")
    template = _chat_template(args, tokenizer)

    engine = Engine(model, slots=args.slots, max_len=args.max_len, max_queue=args.max_queue,
                    prefills_per_step=args.prefills_per_step, steps_per_plan=args.steps_per_plan,
                    consume=True)  # fused in place: nothing else uses the model
    if args.max_tokens is not None and not 1 <= args.max_tokens < engine.length:
        raise ConfigError(f"--max-tokens {args.max_tokens}: between 1 and {engine.length - 1} "
                          f"(--max-len)")
    if not args.no_warmup:
        engine.warmup()
    if jax.process_index() != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # process 0's stop plan ends us
        engine.follow()
        return 0
    return _serve(args, engine, tokenizer, name, api_key, template)


def _serve(args, engine, tokenizer, name, api_key, template) -> int:
    app = create_app(engine, tokenizer, model_name=name, api_key=api_key,
                     max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens,
                     chat_template=template)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    engine.start()
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()  # off the main thread: uvicorn leaves the signals to us
    announced = False
    while not (stop.wait(0.2) or not http.is_alive()):
        if server.started and not announced:
            announced = True
            print(f"serving {name!r} on http://{args.host}:{args.port} ({engine.slots} slots, "
                  f"{engine.length} positions each, tp={sharding.tp_size(engine.mesh)}, "
                  f"{jax.process_count()} process(es))", flush=True)
    if not http.is_alive() and not server.started:
        engine.drain(0)
        raise ConfigError(f"could not serve on {args.host}:{args.port} (is the port in use?)")
    print(f"draining: up to {args.drain_seconds:g} s for {engine.busy} running request(s)",
          file=sys.stderr, flush=True)
    app.state.drain()
    engine.drain(args.drain_seconds)
    server.should_exit = True
    http.join(timeout=10)
    return 0
