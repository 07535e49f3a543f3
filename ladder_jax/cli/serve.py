"""Serve a model over an OpenAI-compatible HTTP API: `python -m ladder_jax.serve`.

    python -m ladder_jax.serve --checkpoint runs/tiny --port 8000
    python -m ladder_jax.serve --preset small --tp 2 --slots 16 --api-key secret

Batching, draining, several processes: docs/inference.md, 'Serve'."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx
from jax._src import distributed
from jax.experimental import multihost_utils

from ladder_jax import compile_cache, processes, runtime
from ladder_jax.cli.common import (
    ArgumentParser,
    add_program_flags,
    choose_tp,
    load_checkpoint,
    model_overrides,
    run_settings,
    setup_devices,
)
from ladder_jax.config import SCHEMES, ConfigError, ModelConfig, UsageError
from ladder_jax.inference import sizing
from ladder_jax.inference.batching import Engine
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.model import compilation, sharding
from ladder_jax.model.transformer import Transformer

try:  # the serve extra; its absence is one line at start-up, not a traceback
    import uvicorn

    from ladder_jax.inference.chat import ChatTemplateError, compile_chat_template
    from ladder_jax.inference.server import create_app, deadline_protocol

    _MISSING = None
except ImportError as e:
    _MISSING = e.name

API_KEY_ENV = "LADDER_API_KEY"
MAX_HEADER_BYTES = 16 * 1024  # a request's line and headers (h11's incomplete-event limit)
FD_RESERVE = 128  # file descriptors kept for the process when bounding the connections
STOP_KEY = "ladder_jax/serve/stop/"  # coordination-service keys: processes told to stop
STOP_MARGIN_S = 30.0  # a follower told to stop waits --drain-seconds plus this for process 0
WARMUPS = ("before", "background", "off")
DEFAULT_SLOTS = 16  # --slots: requests decoded together (they share the pages that fit)


def _distributed() -> bool:
    """Whether this process joined a `jax.distributed` job (without starting a backend)."""

    return distributed.global_state.client is not None


def exit_now(code: int) -> None:
    """Ends the process with `code` once its output is flushed, skipping the interpreter's
    teardown (XLA's client and the model's buffers take seconds to tear down, and a server
    told to stop should be gone at once). One process only: with several, jax's exit hook
    says goodbye to the coordinator, so they exit the ordinary way.

        exit_now(main())   # python -m ladder_jax.serve"""
    sys.stdout.flush()
    sys.stderr.flush()
    if _distributed():  # never asks jax for devices: a start-up error exits before any backend
        sys.exit(code)
    os._exit(code)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m ladder_jax.serve",
        description=__doc__.split("\n\n")[0],
        epilog="Multi-host: start one process per host with --coordinator HOST:PORT "
        "--num-processes N --process-id I (or JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES, JAX_PROCESS_ID); process 0 serves HTTP and broadcasts "
        "each step's plan, tensor parallelism spans all processes' devices.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--preset",
        default="tiny",
        help="model preset with random weights, for benchmarks (default: tiny)",
    )
    src.add_argument(
        "--checkpoint", help="a training run, checkpoint or Hugging Face directory, or a .gguf file"
    )
    p.add_argument("--seed", type=int, default=0, help="--preset: the weights' seed")
    p.add_argument(
        "--residual",
        default=None,
        choices=list(SCHEMES),
        help="residual scheme (default: the preset's / checkpoint's)",
    )
    p.add_argument("--ladder-layers", default=None, help="ladder only: N or a comma list")
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel size (default: the largest that divides the model's "
        "heads and the devices, on a CPU host also its cores; said on stderr)",
    )
    _add_serving_flags(p)
    add_program_flags(p)
    return p


def _add_serving_flags(p) -> None:
    """The HTTP, batching and start-up flags of `parser`."""
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="the model id clients name (default: the checkpoint directory's name or the preset)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help=f"requests decoded together (default {DEFAULT_SLOTS}); they share the KV cache's "
        "pages, each growing into them, the newest preempted when none are left",
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 503"
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="positions per request, prompt + max_tokens (default: the model's max_seq_len, "
        "or the multiple of 64 of which one request fits --memory-fraction)",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="share of the memory free once the weights are loaded that the KV cache may take "
        "(GPU: the device's, CPU: the host's available memory), 0 < F <= 1 (default "
        + ", ".join(f"{v:g} on {k.upper()}" for k, v in sizing.DEFAULT_FRACTION.items())
        + "); the KV cache's pages are what fits (every slot at full length at most), said "
        "at start",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="largest max_tokens a request may ask (default: --max-len - 1)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="largest request body (default 1 MiB); more get 413",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a connection has to send a whole request (line, headers, "
        "body) once open or after its previous response; then it is closed",
    )
    p.add_argument(
        "--prefills-per-step",
        type=int,
        default=4,
        help="new requests admitted between two decode steps, prefilled together "
        "(those of one prompt-length bucket in one program)",
    )
    p.add_argument(
        "--steps-per-plan",
        type=int,
        default=2,
        help="decode steps run as one program between two scheduling rounds "
        "(multi-step scheduling: fewer host round trips per token; a new "
        "request waits at most this many steps to start)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt tokens a request prefills per round, beside the running streams "
        "(chunked prefill: a long prompt never stalls the others for its whole length)",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="never reuse the KV of a prompt prefix an earlier request left in its row "
        "(default: reused in blocks of 16 tokens)",
    )
    p.add_argument(
        "--speculate",
        type=int,
        default=0,
        help="tokens drafted per step by prompt lookup and verified in one step "
        "(speculative decoding without a draft model; default 0: off)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM, how long running requests may finish",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (default: the checkpoint's "
        "tokenizer_config.json chat_template or a GGUF file's, if any)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="compile programs on first use instead of before serving (--warmup off)",
    )
    p.add_argument(
        "--warmup",
        choices=WARMUPS,
        default="before",
        help="before (default): compile the serving programs, then listen; background: "
        "listen at once and compile them on a thread meanwhile (answers within seconds; a "
        "request may wait for its program); off: each on first use",
    )


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        compilation.use_allreduce(args.allreduce)
        return _run(args)
    except UsageError as e:  # GenerationError and ShardingError included
        print(f"error: {e}", file=sys.stderr)
        return 2


def _note(*a, **kw) -> None:
    if jax.process_index() == 0:
        print(*a, **kw, flush=True)


def _check(args) -> None:
    if args.memory_fraction is not None:
        sizing.check_fraction(args.memory_fraction)
    for flag, v, low in (
        ("--slots", DEFAULT_SLOTS if args.slots is None else args.slots, 1),
        ("--max-queue", args.max_queue, 0),
        ("--prefills-per-step", args.prefills_per_step, 1),
        ("--steps-per-plan", args.steps_per_plan, 1),
        ("--prefill-chunk", args.prefill_chunk, 1),
        ("--speculate", args.speculate, 0),
        ("--max-request-bytes", args.max_request_bytes, 1),
    ):
        if v < low:
            raise ConfigError(f"{flag} {v}: must be >= {low}")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is from 1 to 65535")
    if args.max_len is not None and args.max_len < 2:
        raise ConfigError(f"--max-len {args.max_len}: must be >= 2 (a prompt token and a new one)")
    if not args.request_timeout > 0:
        raise ConfigError(f"--request-timeout {args.request_timeout}: must be > 0 seconds")
    if args.drain_seconds < 0:
        raise ConfigError(f"--drain-seconds {args.drain_seconds}: must be >= 0")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise ConfigError(f"--chat-template {args.chat_template}: no such file")
    if _MISSING:
        raise ConfigError(f'the server needs {_MISSING}: pip install -e ".[serve]"')


def _chat_template(args) -> str | None:
    """The chat template's source (--chat-template, else the checkpoint's
    tokenizer_config.json), checked to compile; ConfigError naming the file otherwise. A GGUF
    file's or chat_template.jinja's comes with the tokenizer (`_tokenizer_template`)."""
    if args.chat_template:
        path = args.chat_template
        template = _read_text(path, "--chat-template")
    elif args.checkpoint and os.path.isfile(
        path := os.path.join(args.checkpoint, "tokenizer_config.json")
    ):
        try:
            doc = json.loads(_read_text(path, "the checkpoint's"))
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}): fix or remove it") from None
        template = doc.get("chat_template") if isinstance(doc, dict) else None
        if not isinstance(template, str):
            return None
    else:
        return None
    return _compiled(template, path)


def _compiled(template: str, where: str) -> str:
    """`template` once it compiles; a ConfigError naming `where` and the line otherwise."""
    try:
        compile_chat_template(template)
    except ChatTemplateError as e:
        raise ConfigError(f"{where}: {e}") from None
    return template


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} {path}: byte {e.start} is not UTF-8: a chat template is a text file"
        ) from None
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    if "\x00" in text:
        raise ConfigError(f"{what} {path} holds NUL bytes: a chat template is a text file")
    return text


_PER_PROCESS = (  # process 0's (HTTP); `common.PER_PROCESS`: each host's own
    "host",
    "port",
    "api_key",
    "model_name",
    "max_request_bytes",
    "request_timeout",
    "drain_seconds",
    "chat_template",
    "max_tokens",
    "no_compile_cache",  # each host's own cache directory
)


def _kv_plan(args, model) -> sizing.KVPlan:
    """The KV cache's pages and positions (`sizing.plan_kv`) from the memory left once the
    weights are loaded: on a GPU its pool's `bytes_limit - bytes_in_use`, on CPU the host's
    available memory (its devices share it); with several processes the least of theirs, so
    every process builds the same cache."""
    c, mesh = model.config, model.mesh
    device = mesh.devices.flat[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        where, devices, platform = "on each device", 1, "gpu"
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:  # CPU devices share the host's memory
        where, platform = "of host memory", "cpu"
        devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        free = runtime.available_memory()
    if jax.process_count() > 1:  # in MiB: int32 without jax's x64
        mib = np.int32(-1 if free is None else free >> 20)
        least = int(np.min(multihost_utils.process_allgather(mib)))
        free = None if least < 0 else least << 20
    fraction = args.memory_fraction or sizing.DEFAULT_FRACTION[platform]
    return sizing.plan_kv(
        c,
        sharding.tp_size(mesh),
        slots=DEFAULT_SLOTS if args.slots is None else args.slots,
        max_len=args.max_len,
        free=free,
        fraction=fraction,
        devices=devices,
        where=where,
    )


def _api_key(args) -> str | None:
    """--api-key, else $LADDER_API_KEY; one given but empty, or that no client could send
    (whitespace, control or non-ASCII characters), is a ConfigError, never "no key"."""
    for what, key in (("--api-key", args.api_key), (API_KEY_ENV, os.environ.get(API_KEY_ENV))):
        if key is None:
            continue
        if not key:
            raise ConfigError(
                f"{what} is empty (an unset variable?): give a key, or leave "
                f"{what} out to serve without one"
            )
        bad = next((c for c in key if not (c.isascii() and c.isprintable()) or c.isspace()), None)
        if bad is not None:
            raise ConfigError(
                f"{what} holds {bad!r}: a key is printable ASCII without spaces "
                f"(what an Authorization header can carry)"
            )
        return key
    return None


def _tokenizer_template(tokenizer) -> str | None:
    """The template the loaded tokenizer carries (a GGUF file's tokenizer.chat_template, a
    chat_template.jinja beside tokenizer.json), checked to compile."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    return _compiled(template, "the checkpoint's tokenizer (give --chat-template)")


def _run(args) -> int:
    _check(args)
    api_key, template = _api_key(args), _chat_template(args)  # before anything loads
    shape = setup_devices(args)
    if jax.process_count() > 1:  # from now on: jax's preemption notifier would swallow them
        _collect_signals()
    processes.agree(run_settings(args, _PER_PROCESS), "model or serving flags")  # many processes
    tp, why = choose_tp(args.tp, shape)
    n = jax.device_count()
    if jax.process_count() > 1 and tp != n:
        raise ConfigError(
            f"--tp {tp}: with {jax.process_count()} processes the model must "
            f"span all {n} devices (--tp {n})"
        )
    sharding.check_divisible(shape, tp, flag="--tp")
    idle = []  # the note when --tp leaves devices idle
    mesh = sharding.tp_mesh(tp, say=None if why else idle.append)  # the first tp devices
    model, tokenizer, name = _load(args, mesh)
    template = template or _tokenizer_template(tokenizer)

    if args.max_len is not None and args.max_len > model.config.max_seq_len:
        raise ConfigError(
            f"--max-len {args.max_len}: more than the model's context of "
            f"{model.config.max_seq_len} positions (max_seq_len); give at most that"
        )
    plan = _kv_plan(args, model)
    engine = Engine(
        model,
        slots=plan.slots,
        max_len=plan.positions,
        pages=plan.pages,
        max_queue=args.max_queue,
        prefills_per_step=args.prefills_per_step,
        steps_per_plan=args.steps_per_plan,
        chunk=args.prefill_chunk,
        prefix_block=None if args.no_prefix_cache else 16,
        speculate=args.speculate,
        consume=True,
    )  # fused in place: nothing else uses the model
    if args.max_tokens is not None and not 1 <= args.max_tokens < engine.length:
        raise ConfigError(
            f"--max-tokens {args.max_tokens}: between 1 and {engine.length - 1} (--max-len)"
        )
    if jax.process_index() == 0:  # once the input is checked: a bad flag is one line
        for note in ([f"note: {why}"] if why else idle) + [plan.line()]:
            print(note, file=sys.stderr, flush=True)
    warm = "off" if args.no_warmup else args.warmup
    if warm == "before":
        _warmup(engine)
    elif warm == "background":
        engine.warming = threading.Thread(
            target=_warmup, args=(engine, True), name="ladder-warmup", daemon=True
        )
        engine.warming.start()
    try:
        if jax.process_index() != 0:
            return _follow(engine, args.drain_seconds + STOP_MARGIN_S)
        return _serve(args, engine, tokenizer, name, api_key, template)
    finally:
        if warm == "background":  # not torn down mid-compile
            engine.warming.join()


def _load(args, mesh):
    """(model, tokenizer, the model's name for clients) of --checkpoint, or random weights of
    --preset, with --residual / --ladder-layers / --decode-matmul."""
    if args.checkpoint:
        model, tokenizer = load_checkpoint(args, mesh, _note)
        name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    else:
        config = ModelConfig.from_preset(args.preset, **model_overrides(args))
        model = Transformer(config, mesh=mesh, rngs=nnx.Rngs(args.seed))
        tokenizer, name = ByteTokenizer(), args.model_name or args.preset
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"the model has vocab_size={model.config.vocab_size}, too small for "
            f"its tokenizer ({tokenizer.vocab_size} tokens)"
        )
    return model, tokenizer, name


_SIGNALS: list[int] = []  # SIGTERM / SIGINT received by a process of several


def _collect_signals() -> None:
    """Records SIGTERM and SIGINT in `_SIGNALS` instead of their default action (a process of
    several: it stops with the others, `_follow` / `_serve`)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: _SIGNALS.append(signum))


def _stop_requests() -> list[str]:
    """The processes that asked process 0 to stop the server (`_ask_stop`), as "process I
    (SIGTERM)"; none with one process."""
    if not _distributed():
        return []

    try:
        asked = distributed.global_state.client.key_value_dir_get(STOP_KEY)
    except jax.errors.JaxRuntimeError:  # the coordination service is gone: the engine says so
        return []
    return [f"process {k.rsplit('/', 1)[-1]} ({v})" for k, v in asked]


def _ask_stop(signum: int) -> None:
    """Tells process 0, through jax's coordination service, that this process was told to
    stop: process 0 then drains and stops every process (`_stop_requests`)."""

    try:
        distributed.global_state.client.key_value_set(
            f"{STOP_KEY}{jax.process_index()}", signal.Signals(signum).name
        )
    except jax.errors.JaxRuntimeError:  # process 0 is gone: the bound in `_follow` ends us
        pass


def _follow(engine, bound_s: float) -> int:
    """A process other than 0: runs process 0's plans until its stop plan (exit 0). SIGTERM
    or SIGINT here asks process 0 to drain and stop the whole server; if its stop plan has not
    come `bound_s` seconds later (or on a second signal) the process ends itself with one line
    on stderr and exit code 1."""
    got = _SIGNALS  # collected since start-up (`_collect_signals`)
    failure: list[BaseException] = []

    def follow():
        try:
            engine.follow()
        except BaseException as e:  # noqa: BLE001 (raised again on the main thread)
            failure.append(e)

    worker = threading.Thread(target=follow, name="follow", daemon=True)
    worker.start()  # off the main thread: signals reach us while it waits in a collective
    while worker.is_alive() and not got:
        worker.join(0.2)
    if got:
        _ask_stop(got[0])
        deadline = time.monotonic() + bound_s
        while worker.is_alive() and len(got) < 2 and time.monotonic() < deadline:
            worker.join(0.2)
        if worker.is_alive():
            why = "a second signal" if len(got) > 1 else f"no stop from process 0 in {bound_s:g} s"
            print(
                f"error: process {jax.process_index()} stopped by "
                f"{signal.Signals(got[0]).name} ({why}): process 0 may still be serving; "
                f"stop it too",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(1)  # the follower thread is blocked in a collective: no clean exit
    if failure:
        if isinstance(failure[0], jax.errors.JaxRuntimeError):  # process 0 died: one line
            processes.collective_failed(failure[0])
        raise failure[0]
    return 0


def _warmup(engine, background: bool = False) -> None:
    """`engine.warmup()` with its progress on stderr (process 0): what it will compile before
    the first program starts, then each program's k/N as it is done, whether it came from the
    compilation cache, and the time the rest should take (those left x the mean so far).
    `background`: on a thread while the server runs; a failure is one line, not a crash."""
    programs = engine.warmup_programs()
    shapes = ", ".join(f"{N} x {T}" for N, T in programs if T)
    when = (
        "while serving (--warmup before: first)"
        if background
        else "before serving (--warmup background: while serving; off: each on first use)"
    )
    _note(
        f"warm-up: compiling {len(programs)} programs {when}: prefill of prompts x tokens "
        f"{shapes}, then the decode round ({engine.slots} slots, {engine.steps_per_plan} "
        f"step(s)); other prompt shapes compile on first use",
        file=sys.stderr,
    )
    try:
        _warm_programs(engine, programs)
    except Exception as e:  # noqa: BLE001  (background: the server goes on, compiling on use)
        if not background:
            raise
        _note(
            f"warm-up: stopped ({type(e).__name__}: {e}); the rest compile on first use",
            file=sys.stderr,
        )


def _warm_programs(engine, programs) -> None:
    """`engine.warmup()`, a line after each program."""
    start, hits = time.perf_counter(), [0]

    with compile_cache.Counts() as counts:

        def progress(k, n):
            N, T = programs[k - 1]
            what = f"prefill {N} x {T} tokens" if T else "decode round"
            cached = " from the compilation cache" if counts.hits > hits[0] else ""
            hits[0] = counts.hits
            took = time.perf_counter() - start
            left = f", about {took / k * (n - k):.0f} s to go" if k < n else ""
            _note(f"warm-up {k}/{n}: {what}{cached} ({took:.1f} s{left})", file=sys.stderr)

        engine.warmup(progress)
    if getattr(engine, "warming", None) is not None:
        _note("warm-up: done, every warm-up program is compiled", file=sys.stderr)


def _cache_bytes(engine) -> int:
    """The bytes of the engine's KV cache, all devices together."""
    return sum(x.nbytes for x in (*engine.cache.k, *engine.cache.v))


def _max_connections() -> int:
    """Open connections the server keeps: its file descriptors but a reserve for the rest of
    the process (the runtime's files and sockets)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(16, soft - FD_RESERVE)


def _serve(args, engine, tokenizer, name, api_key, template) -> int:
    app = create_app(
        engine,
        tokenizer,
        model_name=name,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        max_tokens_limit=args.max_tokens,
        chat_template=template,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            # partial requests: closed in time, and never more connections than descriptors
            http=deadline_protocol(args.request_timeout, _max_connections()),
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
    )  # a longer head: 400
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if _SIGNALS:  # told to stop while loading
        stop.set()
    engine.start()
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()  # off the main thread: uvicorn leaves the signals to us
    announced, asked = False, []
    while not (stop.wait(0.2) or not http.is_alive() or (asked := _stop_requests())):
        if server.started and not announced:
            announced = True
            print(
                f"serving {name!r} on http://{args.host}:{args.port} ({engine.slots} slots, "
                f"up to {engine.length} positions each, KV cache "
                f"{_cache_bytes(engine) / 2**20:,.1f} MiB, tp={sharding.tp_size(engine.mesh)}, "
                f"{jax.process_count()} process(es))",
                flush=True,
            )
    if not http.is_alive() and not server.started:
        engine.drain(0)
        raise ConfigError(f"could not serve on {args.host}:{args.port} (is the port in use?)")
    print(
        f"draining: up to {args.drain_seconds:g} s for {engine.busy} running request(s)"
        + (f" (asked by {', '.join(asked)})" if asked else ""),
        file=sys.stderr,
        flush=True,
    )
    app.state.drain()
    engine.drain(args.drain_seconds)
    server.should_exit = True
    http.join(timeout=10)
    return 0
