"""Generate from the command line: `python -m ladder_jax.decode` (the library behind it:
`ladder_jax.inference.generation`). More: docs/inference.md, 'Decode'.

    python -m ladder_jax.decode --preset tiny --prompt "Once upon a time" --max-new-tokens 64
    python -m ladder_jax.decode --preset small --benchmark --residual all --batch 16"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from ladder_jax import processes, runtime
from ladder_jax.cli.common import (
    TP_HELP,
    ArgumentParser,
    add_program_flags,
    add_quantize,
    add_sampling,
    add_scheme,
    add_source,
    choose_tp,
    load_checkpoint,
    model_overrides,
    run_settings,
    setup_devices,
    without_tokenizer_json,  # noqa: F401 (importable from here, as before)
)
from ladder_jax.config import RESIDUALS, ConfigError, ModelConfig, UsageError, check_quantize
from ladder_jax.inference.generation import (
    Decoder,
    GenerationError,
    Sampling,
    benchmark,
    check_generation,
    generate,
)
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.model import compilation, sharding
from ladder_jax.model.transformer import Transformer

# ---------------------------------------------------------------------------------------------
# CLI.


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m ladder_jax.decode",
        description=__doc__.split("\n\n")[0],
        epilog="Multi-host: start one process per host with --coordinator HOST:PORT "
        "--num-processes N --process-id I (or JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES, JAX_PROCESS_ID); tensor parallelism then spans them and "
        "process 0 prints.",
    )
    add_source(p, preset_help="model preset, random weights")
    p.add_argument(
        "--prompt",
        action="append",
        help='a prompt (repeat for a batch; default: "Once upon a time")',
    )
    p.add_argument("--prompt-file", help="a file with one prompt per line")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="tokens to generate per prompt (and, with --benchmark, to time)",
    )
    add_sampling(p, seed_help="sampling seed (and, with --preset, the random weights' seed)")
    add_scheme(
        p,
        also=("all",),
        residual_help="residual scheme (default: the preset's / checkpoint's); 'all' "
        "benchmarks every scheme",
    )
    p.add_argument("--tp", type=int, default=None, help=TP_HELP)
    p.add_argument(
        "--benchmark",
        action="store_true",
        help="time prefill and decode with random weights (paper protocol)",
    )
    p.add_argument("--batch", type=int, default=1, help="--benchmark: sequences decoded together")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=1024,
        help="--benchmark: prompt length in tokens (random ids)",
    )
    p.add_argument("--json", action="store_true", help="benchmark: print JSON lines")
    add_quantize(p)
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message, rendered with the checkpoint's chat "
        "template (as the server's /v1/chat/completions does)",
    )
    add_program_flags(p)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        compilation.use_allreduce(args.allreduce)
        shape = setup_devices(args)
        processes.agree(run_settings(args), "model or decoding flags")  # many processes
        lead = jax.process_index() == 0

        def say(*a, **kw):
            if lead:
                print(*a, **kw, flush=True)

        return _run(args, shape, say)
    except UsageError as e:  # GenerationError and ShardingError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as e:  # several processes: a peer died, one line
        processes.collective_failed(e)
        raise


def _run(args, shape, say) -> int:
    tp, why = choose_tp(args.tp, shape)
    if not -(2**63) <= args.seed < 2**63:
        raise ConfigError(
            f"--seed {args.seed} does not fit in 64 bits: give an integer between "
            f"-2**63 and 2**63 - 1"
        )
    sharding.check_divisible(shape, tp, flag="--tp")  # the model's heads first: the fix
    idle = []  # the note when --tp leaves devices idle (the benchmark's header says it)
    mesh = sharding.tp_mesh(tp, say=None if why else idle.append)  # the first tp devices
    check_quantize(args.quantize, "--quantize")
    model, tokenizer, config = _load(args, mesh, say)
    if args.benchmark:
        return _benchmark(args, config, mesh, why, say)
    prompts = _prompts(args)
    if config.vocab_size < tokenizer.vocab_size:
        what = (
            f"--checkpoint {args.checkpoint!r}" if args.checkpoint else (f"preset {args.preset!r}")
        )
        raise ConfigError(
            f"{what} has vocab_size={config.vocab_size}, too small for its "
            f"tokenizer ({tokenizer.vocab_size} tokens)"
        )
    top_k = min(200, config.vocab_size) if args.top_k is None else args.top_k
    sampling = Sampling(args.temperature, top_k, args.top_p, args.seed).check(config.vocab_size)
    rows = _chat_rows(tokenizer, prompts) if args.chat else [tokenizer.encode(q) for q in prompts]
    check_generation(config, rows, args.max_new_tokens)
    for note in [f"note: {why}"] if why else idle:  # once the input is checked: a bad flag
        say(note, file=sys.stderr)  # stays one line
    if model is None:
        model = Transformer(config, mesh=mesh, rngs=nnx.Rngs(args.seed))
    summary = f"{model}\n(random weights: expect noise)" if not args.checkpoint else str(model)
    say(summary, file=sys.stderr)  # stdout is the generated text alone
    _decode(args, model, tokenizer, prompts, rows, sampling, say)
    return 0


def _load(args, mesh, say):
    """(model or None: random weights made later, tokenizer, config) of --checkpoint or
    --preset with --residual / --ladder-layers / --quantize / --decode-matmul."""
    overrides = model_overrides(args)
    if not args.checkpoint:
        config = ModelConfig.from_preset(args.preset, quantize=args.quantize, **overrides)
        runtime.check_host_memory(  # random weights, before allocating them (CPU hosts)
            config.num_params() * jnp.dtype(config.param_dtype).itemsize,
            f"preset {args.preset!r} ({config.num_params() / 1e9:.1f}B parameters in "
            f"{config.param_dtype})",
            "choose a smaller --preset (tiny, small, 1b) or a GPU",
        )
        return None, ByteTokenizer(), config
    if args.benchmark:
        raise ConfigError("--benchmark times random weights of a --preset; drop --checkpoint")
    model, tokenizer = load_checkpoint(args, mesh, say, quantize=args.quantize)
    return model, tokenizer, model.config


def _prompts(args) -> list[str]:
    """--prompt and --prompt-file's lines (default: "Once upon a time"), none empty."""
    prompts = list(args.prompt or [])
    if args.prompt_file:
        prompts += _prompt_file(args.prompt_file)
    if not prompts:
        prompts = ["Once upon a time"]
    for b, prompt in enumerate(prompts):
        if not prompt:
            raise GenerationError(f"prompt {b} is empty: give at least one character")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes from the command line that are not UTF-8
            raise GenerationError(
                f"prompt {b}: character {e.start} is not UTF-8 text ({prompt[e.start]!r}): "
                f"give UTF-8 text"
            ) from None
    return prompts


def _prompt_file(file: str) -> list[str]:
    """The non-blank lines of a UTF-8 file; GenerationError naming the file otherwise."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")  # whole, so that the offset below is the file's
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise GenerationError(
            f"--prompt-file {file}: byte {e.start} (line {line}) is not "
            f"UTF-8 ({e.reason}): save the file as UTF-8 text"
        ) from None
    except OSError as e:
        raise GenerationError(f"--prompt-file {file}: cannot read it ({e.strerror or e})") from None
    lines = [ln for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n") if ln.strip()]
    if not lines:
        raise GenerationError(
            f"--prompt-file {file} has no prompts (it is empty or only "
            f"blank lines): write one prompt per line"
        )
    return lines


def _decode(args, model, tokenizer, prompts, rows, sampling, say) -> None:
    """`generate` with `sampling`: one prompt's new text printed on stdout as it arrives (the
    prompt on stderr), several each after its prompt once all are done; the speed on stderr."""
    single = len(prompts) == 1
    echo = _Echo(tokenizer, say if single else None)
    if single:  # the prompt on stderr: stdout is the answer alone, as it streams
        say(prompts[0], file=sys.stderr)
    t0 = time.perf_counter()
    out = generate(
        model,
        rows,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        eos_id=tokenizer.eos_id,
        stream=echo,
        decoder=Decoder(model, consume=True),
    )  # fused in place: used once
    texts = [tokenizer.decode(t) for t in out]  # the new tokens, EOS excluded
    if single:
        say(texts[0][len(echo.shown) :])
    else:
        for prompt, text in zip(prompts, texts):
            say(f"--- {prompt!r}\n{prompt}{chr(10) if args.chat else ''}{text}")
    say(_speed(t0, echo.times, sum(map(len, out)), len(prompts)), file=sys.stderr)


class _Echo:
    """generate's `stream` callback: records when each step's tokens arrive and, with `say`,
    prints the first row's new text (whole UTF-8 characters) up to its EOS."""

    def __init__(self, tokenizer, say=None):
        self.tokenizer, self.say = tokenizer, say
        self.tokens: list[int] = []
        self.ended = False
        self.shown = ""
        self.times: list[float] = []

    def __call__(self, step: int, tokens: list[int]) -> None:
        self.times.append(time.perf_counter())
        if self.say is None or self.ended:
            return
        if tokens[0] == self.tokenizer.eos_id:
            self.ended = True
            return
        self.tokens.append(tokens[0])
        text = self.tokenizer.decode(self.tokens)
        if not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
            self.say(text[len(self.shown) :], end="")
            self.shown = text


def _benchmark(args, config, mesh, why, say) -> int:
    """--benchmark: `benchmark` of each scheme asked (random weights), a line or JSON each."""
    schemes = list(RESIDUALS) if args.residual == "all" else [config.residual]
    config = dataclasses.replace(
        config, max_seq_len=max(config.max_seq_len, args.prompt_len + args.max_new_tokens)
    )
    if not args.json:
        kind = mesh.devices.flat[0].device_kind
        what = f"preset {args.preset}" + (f", {config.quantize} weights" if config.quantize else "")
        say(
            f"decode benchmark, random weights of {what}: "
            f"residual {', '.join(schemes)}; tp={sharding.tp_size(mesh)} on {mesh.size} "
            f"{jax.default_backend()} device(s) ({kind}); batch {args.batch}, prompt "
            f"{args.prompt_len} tokens, {args.max_new_tokens} new tokens; per scheme a "
            f"first run that compiles, then the best of 3" + (f"; {why}" if why else "")
        )
    results = []
    for scheme in schemes:
        cfg = dataclasses.replace(
            config,
            residual=scheme,
            ladder_layers=(config.ladder_layers if scheme == "ladder" else None),
        )
        r = benchmark(
            cfg, mesh, batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.max_new_tokens
        )
        results.append(r)
        say(json.dumps({"preset": args.preset, **r}) if args.json else _benchmark_line(r))
    if not args.json and len(results) > 1 and any(r["residual"] == "standard" for r in results):
        _compare(results, mesh, say)
    return 0


def _benchmark_line(r: dict) -> str:
    return (
        f"{r['residual']:<12} prefill {r['prefill_ms']:8.1f} ms   decode "
        f"{r['decode_ms_per_token']:7.2f} ms/token   "
        f"{r['decode_tokens_per_s_per_user']:8.1f} tok/s/user  "
        f"{r['decode_tokens_per_s']:9.1f} tok/s total   end-to-end "
        f"{r['tokens_per_s']:9.1f} tok/s   roofline "
        f"{100 * r['roofline_fraction']:5.1f}%   (first run incl. compile "
        f"{r['first_run_s_incl_compile']:.1f} s)"
    )


def _compare(results: list[dict], mesh, say) -> None:
    """--residual all: each scheme's decode speed over standard's, and why it means little
    where nothing overlaps."""
    by = {r["residual"]: r["decode_tokens_per_s"] for r in results}
    say(
        "decode speed vs standard: "
        + ", ".join(f"{k} {v / by['standard']:.2f}x" for k, v in by.items() if k != "standard")
    )
    if sharding.tp_size(mesh) == 1:
        say(
            "note: tp=1 has no all-reduce to overlap: every scheme computes what "
            "standard does, so these ratios are run-to-run noise; use --tp > 1 on GPUs"
        )
    elif jax.default_backend() == "cpu":
        say(
            "note: XLA:CPU runs all-reduces synchronously, so nothing overlaps on CPU: "
            "these ratios are noise, not the ladder's speed-up (that needs GPUs; "
            "`python -m ladder_jax.predict` models it without one)"
        )
    say(
        f"bandwidth: {results[0]['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
        f"({results[0]['bandwidth_source']})"
    )


def _chat_rows(tokenizer, prompts: list[str]) -> list[list[int]]:
    """--chat: each prompt as one user message through the tokenizer's chat template."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ConfigError(
            "--chat: the checkpoint has no chat template (tokenizer_config.json's "
            "chat_template, chat_template.jinja or a GGUF file's "
            "tokenizer.chat_template); drop --chat"
        )
    try:
        from ladder_jax.inference.chat import ChatTemplateError, compile_chat_template, render_chat
    except ImportError:
        raise ConfigError('--chat needs jinja2: pip install -e ".[serve]"') from None
    try:
        compiled = compile_chat_template(template)
        return [render_chat(compiled, [{"role": "user", "content": p}], tokenizer) for p in prompts]
    except ChatTemplateError as e:
        raise ConfigError(f"--chat: {e}") from None


def _speed(t0: float, times: list[float], generated: int, batch: int) -> str:
    """The figures after a decode (stderr, as gpt-fast prints them): wall time, time to the
    first token (prefill, and compiling both programs on a first call) and the decode rate
    after it, one step per token for the whole batch."""
    end = times[-1] if times else time.perf_counter()
    line = f"{generated} tokens in {end - t0:.2f} s"
    if len(times) > 1:
        rate = (len(times) - 1) / (end - times[0])
        line += (
            f"; first token after {times[0] - t0:.2f} s (prefill, and compiling), then "
            f"{rate:.1f} tokens/s"
            + (f" per sequence, {rate * batch:.1f} in total" if batch > 1 else "")
        )
    return line


if __name__ == "__main__":
    sys.exit(main())
