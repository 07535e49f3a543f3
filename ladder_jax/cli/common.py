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


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every flag's default appended to its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or not action.option_strings):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".strip()


class EveryDefaultFormatter(argparse.ArgumentDefaultsHelpFormatter,
                            argparse.RawDescriptionHelpFormatter):
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
            action = next((a for a in self._actions if choice.group(1) in a.option_strings),
                          None)
            names = [str(c) for c in (action.choices or [])] if action else []
            close = difflib.get_close_matches(choice.group(2), names, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def write_stderr(text: str) -> None:
    """Writes `text` to the process's stderr now, also while `runtime.quiet()` holds it (a
    progress line from the main thread while other threads compile): it goes to the stderr
    `quiet()` saved, not into the capture it filters when the last compile ends. (Here, not in
    `runtime`: `runtime` is among the modules programs are built from, and editing those
    invalidates the program cache.)"""
    import os

    from ladder_jax import runtime

    with runtime._QUIET_LOCK:
        saved = runtime._QUIET["saved"] if runtime._QUIET["depth"] else None
        if saved is None:
            sys.stderr.write(text)
            sys.stderr.flush()
        else:
            os.write(saved, text.encode("utf-8", "replace"))
