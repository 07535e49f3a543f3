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


def setup_devices(args):
    """The preamble of decode and serve: the model config that splits over tp (the
    checkpoint's or the preset's), returned once `runtime.setup` made this host's devices
    (--cpu-devices, else --tp, else the default tp over this host's cores) and joined the
    processes (--coordinator ...).

        shape = setup_devices(args); tp, why = choose_tp(args.tp, shape)"""
    from ladder_jax import runtime
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
