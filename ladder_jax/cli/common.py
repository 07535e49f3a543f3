"""What every command line shares: `ArgumentParser`, argparse with one-line errors and help
that shows each flag's default.

    p = ArgumentParser(prog="python -m ladder_jax.decode", description=...)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")   # "(default: 0)"

A bad flag is one line on stderr and exit code 2, like every other bad input of the package:
`error: --seed: invalid int value '1.5'`, `error: unrecognized arguments: --sed (did you mean
--seed?)`; never argparse's usage dump. Help adds "(default: X)" to a flag whose help text
does not already name its default (not for flags without a value, nor for a None default).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

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


def add_decode_matmul(p: argparse.ArgumentParser) -> None:
    """--decode-matmul, as decode and serve take it (None: the checkpoint's or preset's)."""
    from ladder_jax.config import DECODE_MATMULS

    p.add_argument(
        "--decode-matmul",
        default=None,
        choices=DECODE_MATMULS,
        help="the linear layers' matmul over at most 16 rows (decode steps) on GPU meshes: "
        "xla, or pallas (a Triton kernel that reads each weight once); CPU meshes always "
        "run XLA's, whatever this says (default: the checkpoint's or preset's, xla)",
    )


def quantize_mode(value: str) -> str | None:
    """--quantize's argparse type: `none` is float weights (None), as the config's null; any
    other mode is kept for `ladder_jax.config.check_quantize` to check."""
    return None if value.strip().lower() == "none" else value


PER_PROCESS = ("coordinator", "num_processes", "process_id", "cpu_devices")  # each host's own


def run_settings(args, per_process=()) -> dict:
    """What every process of a multi-process decode or serve must agree on: the flags but
    each host's own (`PER_PROCESS` and `per_process`), and which weights files were found.

        runtime.agree(run_settings(args), "model or decoding flags")"""
    from ladder_jax.train import checkpoint

    own = {*PER_PROCESS, *per_process}
    return {
        "flags": {k: v for k, v in vars(args).items() if k not in own},
        "weights": checkpoint.weights_identity(args.checkpoint) if args.checkpoint else None,
    }


def model_overrides(args) -> dict:
    """The ModelConfig changes that decode's and serve's flags ask: --residual (not "all"),
    --ladder-layers, --decode-matmul; none for a flag left out.

        ModelConfig.from_preset(args.preset, **model_overrides(args))"""
    from ladder_jax.config import parse_ladder_layers, scheme_overrides

    residual = None if args.residual == "all" else args.residual
    overrides = scheme_overrides(residual, parse_ladder_layers(args.ladder_layers))
    if args.decode_matmul is not None:
        overrides["decode_matmul"] = args.decode_matmul
    return overrides


def load_checkpoint(args, mesh, say, *, quantize: str | None = None):
    """(model, tokenizer) of --checkpoint on `mesh` under `model_overrides(args)`, the byte
    tokenizer for a byte-level Hugging Face directory without tokenizer.json
    (`without_tokenizer_json`). decode_matmul is set once loaded, so that it reaches a GGUF
    file or Hugging Face directory too (their loaders take the scheme only)."""
    from ladder_jax.model.transformer import with_config
    from ladder_jax.train import checkpoint

    overrides = model_overrides(args)
    matmul = overrides.pop("decode_matmul", None)
    model, tokenizer = checkpoint.load_run(
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
    from ladder_jax.config import ConfigError
    from ladder_jax.interop.tokenizer import ByteTokenizer

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
    from ladder_jax import compile_cache, runtime
    from ladder_jax.config import ModelConfig
    from ladder_jax.model import sharding
    from ladder_jax.train import checkpoint

    shape = (
        checkpoint.run_model_config(args.checkpoint)
        if args.checkpoint
        else ModelConfig.from_preset(args.preset)
    )
    runtime.setup(
        cpu_devices=args.cpu_devices
        or args.tp
        or sharding.default_tp(shape, runtime.cpu_cores(), backend="cpu")[0],
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    compile_cache.enable(off=getattr(args, "no_compile_cache", False))
    return shape


def choose_tp(tp: int | None, shape) -> tuple[int, str | None]:
    """(tensor-parallel size, why: the note to print once the input is checked, or None):
    --tp if given, every device with several processes, else `sharding.default_tp`; a
    ConfigError unless it is between 1 and the devices."""
    import jax

    from ladder_jax.config import ConfigError
    from ladder_jax.model import sharding

    n = jax.device_count()
    if tp is not None or jax.process_count() > 1:  # several: the model spans them all
        tp, why = (n if tp is None else tp), None
    else:
        tp, why = sharding.default_tp(shape, n)
    if not 1 <= tp <= n:
        raise ConfigError(f"--tp {tp}: between 1 and the {n} devices")
    return tp, why
