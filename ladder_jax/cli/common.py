"""What every command line shares: `ArgumentParser`, argparse whose bad flags are one line on
stderr and exit code 2 (with a "did you mean" hint), never the usage dump, and whose help adds
"(default: X)" where a flag's help does not name its default.

    p = ArgumentParser(prog="python -m ladder_jax.decode", description=...)"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

import jax

from ladder_jax import compile_cache, loading, runtime
from ladder_jax.config import (
    DECODE_MATMULS,
    SCHEMES,
    ConfigError,
    ModelConfig,
    parse_ladder_layers,
    parse_reduce_pattern,
    scheme_overrides,
)
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.model import layout
from ladder_jax.model.transformer import with_config
from ladder_jax.runtime import write_stderr  # noqa: F401 (the commands' progress lines)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every flag's default appended to its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or not action.option_strings
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".strip()


class EveryDefaultFormatter(
    argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """Every flag's default in its help, None included (the flag's text says what None means):
    overlap's and predict's many optional knobs."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`error: ...`, exit 2) and whose help shows defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        message = re.sub(r"\bargument (-[\w-]+)(?:/-[\w-]+)*:", r"\1:", message)
        message = re.sub(r"with argument (-[\w-]+)", r"with \1", message)
        message = re.sub(r"value: '", "value '", message)
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        choice = re.match(r"(-[\w-]+): invalid choice: '([^']*)'", message)
        if unknown:
            options = [o for a in self._actions for o in a.option_strings]
            close = difflib.get_close_matches(unknown.group(1).split("=")[0], options, n=1)
            message += f" (did you mean {close[0]}?)" if close else " (see --help)"
        elif choice:
            action = next((a for a in self._actions if choice.group(1) in a.option_strings), None)
            names = [str(c) for c in (action.choices or [])] if action else []
            close = difflib.get_close_matches(choice.group(2), names, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


# The flag groups several commands share, each said once (a command adds the ones it takes).
CHECKPOINT_HELP = (
    "a training run, `convert` output, Hugging Face directory or .gguf file (its weights and "
    "tokenizer)"
)
TP_HELP = (
    "tensor-parallel size (default: the largest that divides the model's heads and the "
    "devices, on a CPU host also its cores; said on stderr)"
)


def add_source(p: argparse.ArgumentParser, *, preset_help: str) -> None:
    """--preset (random weights) or --checkpoint, one of the two."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny", help=preset_help)
    src.add_argument("--checkpoint", help=CHECKPOINT_HELP)


def add_scheme(p: argparse.ArgumentParser, *, also: tuple = (), residual_help: str = "") -> None:
    """--residual (every scheme and `also`) and --ladder-layers: the wiring a model is run with."""
    p.add_argument(
        "--residual",
        default=None,
        choices=[*SCHEMES, *also],
        help=residual_help or "residual scheme (default: the preset's / checkpoint's)",
    )
    p.add_argument(
        "--ladder-layers",
        default=None,
        help="ladder only: N (the upper N layers) or a comma list of layer indices "
        "(default: every layer)",
    )


def add_quantize(p: argparse.ArgumentParser) -> None:
    """--quantize MODE (`quantize_mode`: none is float weights)."""
    p.add_argument(
        "--quantize",
        default=None,
        metavar="MODE",
        type=quantize_mode,
        help="int8: weight-only int8 linear weights (ladder_jax.model.quant); none: float "
        "weights (the default: as the checkpoint stores them)",
    )


def add_sampling(p: argparse.ArgumentParser, *, seed_help: str) -> None:
    """--temperature, --top-k, --top-p and --seed, as `Sampling` takes them."""
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 is greedy (always the most likely token)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="sample among the k most likely tokens (default: 200, or the whole "
        "vocabulary when it is smaller)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample among the most likely tokens whose probabilities sum to p, "
        "e.g. 0.9 (default: off)",
    )
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def add_decode_matmul(p: argparse.ArgumentParser) -> None:
    """--decode-matmul, as decode and serve take it (None: the checkpoint's or preset's)."""
    p.add_argument(
        "--decode-matmul",
        default=None,
        choices=DECODE_MATMULS,
        help="the linear layers' matmul over at most 16 rows (decode steps) on GPU meshes: "
        "xla, or pallas (a Triton kernel that reads each weight once); CPU meshes always "
        "run XLA's, whatever this says (default: the checkpoint's or preset's, xla)",
    )


def add_program_flags(p: argparse.ArgumentParser) -> None:
    """decode's and serve's flags for the programs they compile: --decode-matmul, --allreduce,
    desync's (`add_desync_flags`), --no-compile-cache and the process flags
    (`runtime.add_arguments`)."""
    add_decode_matmul(p)
    p.add_argument(
        "--allreduce",
        default="nccl",
        help="how the GPU programs' all-reduces run: nccl, or one_shot (XLA's one-shot / "
        "two-shot kernels over NVLink peer memory; CPU programs ignore it)",
    )
    add_desync_flags(p)
    add_compile_cache_flag(p)
    runtime.add_arguments(
        p,
        cpu_devices_help="on a CPU host, fake devices to split it into "
        "(default: --tp, else the default tp)",
    )


def add_compile_cache_flag(p: argparse.ArgumentParser) -> None:
    """--no-compile-cache (`ladder_jax.compile_cache`): decode, serve and eval's."""
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile every program afresh (default: JAX's persistent compilation cache "
        f"in the user cache directory, or ${compile_cache.ENV}; off there too)",
    )


def add_desync_flags(p: argparse.ArgumentParser) -> None:
    """--reduce-pattern and --desync-tp, desync's keys (either alone implies --residual
    desync; `ladder_jax.config.scheme_overrides`)."""
    p.add_argument(
        "--reduce-pattern",
        default=None,
        help="desync only: every_layer, every_2_layers, final_only, or per layer two letters "
        "y/n (attention, mlp syncs), comma separated (default: the model's, every_layer)",
    )
    p.add_argument(
        "--desync-tp",
        type=int,
        default=None,
        help="desync only: the residual streams the model carries (default: the model's, "
        "else the mesh's tp)",
    )


def quantize_mode(value: str) -> str | None:
    """--quantize's argparse type: `none` is float weights (None), as the config's null; any
    other mode is kept for `ladder_jax.config.check_quantize` to check."""
    return None if value.strip().lower() == "none" else value


PER_PROCESS = ("coordinator", "num_processes", "process_id", "cpu_devices")  # each host's own


def run_settings(args, per_process=()) -> dict:
    """What every process of a multi-process decode or serve must agree on: the flags but
    each host's own (`PER_PROCESS` and `per_process`), and which weights files were found.

        processes.agree(run_settings(args), "model or decoding flags")"""

    own = {*PER_PROCESS, *per_process}
    return {
        "flags": {k: v for k, v in vars(args).items() if k not in own},
        "weights": loading.weights_identity(args.checkpoint) if args.checkpoint else None,
    }


def model_overrides(args) -> dict:
    """The ModelConfig changes that decode's and serve's flags ask: --residual (not "all"),
    --ladder-layers, --reduce-pattern, --desync-tp, --decode-matmul; none for a flag left out.

        ModelConfig.from_preset(args.preset, **model_overrides(args))"""

    residual = None if args.residual == "all" else args.residual
    overrides = scheme_overrides(
        residual,
        parse_ladder_layers(args.ladder_layers),
        parse_reduce_pattern(getattr(args, "reduce_pattern", None)),
        getattr(args, "desync_tp", None),
    )
    if args.decode_matmul is not None:
        overrides["decode_matmul"] = args.decode_matmul
    return overrides


def load_checkpoint(args, mesh, say, *, quantize: str | None = None):
    """(model, tokenizer) of --checkpoint on `mesh` under `model_overrides(args)`, the byte
    tokenizer for a byte-level Hugging Face directory without tokenizer.json
    (`without_tokenizer_json`). decode_matmul is set once loaded, so that it reaches a GGUF
    file or Hugging Face directory too (their loaders take the scheme only)."""

    overrides = model_overrides(args)
    matmul = overrides.pop("decode_matmul", None)
    model, tokenizer = loading.load_model(
        args.checkpoint, mesh=mesh, quantize=quantize, **overrides
    )
    if matmul is not None and matmul != model.config.decode_matmul:
        model = with_config(model, decode_matmul=matmul)
    if tokenizer is None:
        tokenizer = without_tokenizer_json(args.checkpoint, model.config, say)
    return model, tokenizer


def without_tokenizer_json(path: str, config, say):
    """A Hugging Face directory without tokenizer.json: the byte tokenizer when the vocabulary
    is byte-level (said on stderr), else a ConfigError (decoding text with the wrong
    tokenizer would print garbage)."""

    byte = ByteTokenizer()
    if byte.vocab_size <= config.vocab_size <= 320:  # the byte presets' padded vocabulary
        say(
            f"note: {path} has no tokenizer.json; its vocabulary ({config.vocab_size}) is "
            f"byte-level, so the byte tokenizer is used",
            file=sys.stderr,
        )
        return byte
    raise ConfigError(
        f"--checkpoint {path!r} has no tokenizer.json and its vocabulary "
        f"({config.vocab_size} tokens) is not byte-level: copy the model's "
        f"tokenizer.json into that directory"
    )


def setup_devices(args):
    """The preamble of decode and serve: the model config that splits over tp (the
    checkpoint's or the preset's), returned once `runtime.setup` made this host's devices
    (--cpu-devices, else --tp, else the default tp over this host's cores) and joined the
    processes (--coordinator ...).

        shape = setup_devices(args); tp, why = choose_tp(args.tp, shape)"""

    shape = (
        loading.read_model_config(args.checkpoint)
        if args.checkpoint
        else ModelConfig.from_preset(args.preset)
    )
    loading.check_tp(args.tp, shape)  # before any device is made
    runtime.setup(
        cpu_devices=args.cpu_devices
        or args.tp
        or layout.default_tp(shape, runtime.cpu_cores(), backend="cpu")[0],
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    compile_cache.enable(off=getattr(args, "no_compile_cache", False))
    return shape


def choose_tp(tp: int | None, shape) -> tuple[int, str | None]:
    """(tensor-parallel size, why: the note to print once the input is checked, or None):
    --tp if given, every device with several processes, else `layout.default_tp`; a
    ConfigError unless it is between 1 and the devices."""

    n = jax.device_count()
    if tp is not None or jax.process_count() > 1:  # several: the model spans them all
        tp, why = (n if tp is None else tp), None
    else:
        tp, why = layout.default_tp(shape, n)
    if not 1 <= tp <= n:
        raise ConfigError(f"--tp {tp}: between 1 and the {n} devices")
    return tp, why
