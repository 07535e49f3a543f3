"""Convert checkpoints: `python -m ladder_jax.convert --hf PATH --out DIR [...]`.

    python -m ladder_jax.convert --hf llama-1b/ --out runs/hyb --residual ladder --ladder-layers 8
    python -m ladder_jax.convert --checkpoint runs/tiny --out exported/ --to-hf
    python -m ladder_jax.convert --checkpoint runs/tiny --out runs/tiny-int8 --quantize int8
    python -m ladder_jax.convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smollm2

Every scheme reads the same weights. Output layouts: docs/training.md, 'Converting'."""

from __future__ import annotations

import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ladder_jax import atomic, runtime
from ladder_jax.cli.common import ArgumentParser, add_desync_flags, quantize_mode
from ladder_jax.config import (
    SCHEMES,
    ConfigError,
    UsageError,
    check_quantize,
    parse_ladder_layers,
    parse_reduce_pattern,
    scheme_overrides,
)
from ladder_jax.interop import gguf, hf
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.loading import check_tp, load_model, read_model_config, save_model
from ladder_jax.model import layout


def _check_param_dtype(name: str) -> None:
    """--param-dtype: a floating-point dtype name (an integer one would write zeros)."""
    try:
        dt = np.dtype(jnp.dtype(name))
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        why = "is not a dtype name" if dt is None else "is not a floating-point dtype"
        raise ConfigError(f"--param-dtype {name!r} {why}: choose float32, bfloat16 or float16")


@contextlib.contextmanager
def _progress_bar(transfer, verb: str):
    """A rich bar over the tensors of `transfer` (bytes and tensors), on a terminal only."""
    if not sys.stderr.isatty():
        yield
        return
    with Progress(
        TextColumn(f"{verb} {{task.fields[tensors]}}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
        console=Console(stderr=True),
    ) as bar:
        task = bar.add_task(verb, total=None, tensors="")

        def update(t):
            bar.update(
                task,
                total=t.total_bytes,
                completed=t.bytes,
                tensors=f"{t.tensors}/{t.total_tensors} tensors",
            )

        transfer.on_tensor = update
        yield


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m ladder_jax.convert",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--hf",
        help="a local Hugging Face Llama directory (config.json + "
        "safetensors; the authors' llamaLadder hybrids too)",
    )
    src.add_argument(
        "--gguf",
        help="a local GGUF Llama file (llama.cpp's format, quantized "
        "or not; its tokenizer and chat template too)",
    )
    src.add_argument("--checkpoint", help="a training run directory (its latest checkpoint)")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument(
        "--to-hf",
        action="store_true",
        help="write the Hugging Face layout instead of a training-run checkpoint",
    )
    p.add_argument(
        "--residual",
        choices=SCHEMES,
        help="residual scheme of the result (default: the source's)",
    )
    p.add_argument(
        "--ladder-layers",
        default=None,
        help="ladder only: N (upper N layers) or a comma list of layer indices",
    )
    add_desync_flags(p)
    p.add_argument(
        "--param-dtype", default="float32", help="the weights' dtype in the result, e.g. bfloat16"
    )
    p.add_argument(
        "--max-shard-bytes",
        type=int,
        default=5 * 2**30,
        help="--to-hf: largest safetensors file in bytes (default 5 GiB)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="devices to spread the weights over while converting (host memory: "
        "one tensor at a time either way)",
    )
    p.add_argument(
        "--quantize",
        default=None,
        metavar="MODE",
        type=quantize_mode,
        help="int8: store weight-only int8 linear weights, for decoding (not with --to-hf); "
        "none: as the source stores them (the default)",
    )
    return p


def _check(args) -> None:
    """Every check of the arguments that needs no device."""
    if not args.out.strip():
        raise ConfigError("--out '': give the directory to write the result in")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise ConfigError(
            f"--out {args.out!r} exists and is not an empty directory: choose a new directory"
        )
    if args.max_shard_bytes <= 0:
        raise ConfigError(
            f"--max-shard-bytes {args.max_shard_bytes} must be a positive "
            f"number of bytes (default {5 * 2**30}, 5 GiB)"
        )
    _check_param_dtype(args.param_dtype)
    atomic.check_writable(args.out, f"--out {args.out!r}")
    check_quantize(args.quantize, "--quantize")
    if args.quantize and args.to_hf:
        raise ConfigError(
            f"--quantize {args.quantize} with --to-hf: the Hugging Face "
            f"layout holds float Llama weights; drop one of them"
        )


def _load(args, mesh, ladder_layers):
    """(model, tokenizer) of the source on `mesh`, with the scheme the flags ask."""
    pattern = parse_reduce_pattern(args.reduce_pattern)
    scheme = scheme_overrides(args.residual, ladder_layers, pattern, args.desync_tp)
    if args.checkpoint:
        return load_model(
            args.checkpoint, mesh=mesh, what="--checkpoint", quantize=args.quantize, **scheme
        )
    kw = {} if ladder_layers is None else {"ladder_layers": ladder_layers}
    if scheme.get("residual") == "desync":  # the file's pattern and streams unless given
        kw.update(reduce_pattern=pattern, desync_tp=args.desync_tp)
    load, source = (hf.load_hf, args.hf) if args.hf else (gguf.load_gguf, args.gguf)
    transfer = hf.Transfer(kind="safetensors" if args.hf else "GGUF")
    with _progress_bar(transfer, "reading"):
        loaded = load(
            source,
            mesh=mesh,
            residual=scheme.get("residual", args.residual),
            param_dtype=args.param_dtype,
            transfer=transfer,
            quantize=args.quantize,
            **kw,
        )
    print(transfer.summary("read"), file=sys.stderr)
    return loaded


def _write_hf(args, model, tokenizer) -> None:
    written = hf.Transfer()
    with _progress_bar(written, "writing"):
        hf.save_hf(
            model,
            args.out,
            tokenizer=tokenizer,
            max_shard_bytes=args.max_shard_bytes,
            transfer=written,
        )
    print(written.summary("wrote"), file=sys.stderr)
    if isinstance(tokenizer, ByteTokenizer):
        print(
            f"note: a byte-level model: no tokenizer.json is written (there is no "
            f'such file for it); config.json records "{hf.BYTE_TOKENIZER_KEY}": '
            f'"byte", which load_hf and decode read back (ids 0-255 are the UTF-8 '
            f"bytes, BOS {tokenizer.bos_id}, EOS {tokenizer.eos_id})",
            file=sys.stderr,
        )


def _write_run(args, model, tokenizer) -> None:
    save_model(model, args.out, tokenizer=tokenizer, source=args.hf or args.gguf or args.checkpoint)


def _source_config(args):
    """The source's ModelConfig from its metadata alone (no weights, no devices)."""
    if args.hf:
        return hf.config_from_hf(hf.read_config(args.hf))
    if args.gguf:
        return gguf.gguf_config(args.gguf)
    return read_model_config(args.checkpoint)


def _write_error(args, e: OSError) -> str:
    reason = e.strerror or str(e) or type(e).__name__
    return (
        f"could not write --out {args.out!r} ({reason}): nothing was left there; free disk "
        f"space (or fix the permissions) and run the same command again"
    )


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check(args)
        check_tp(args.tp, _source_config(args))
        runtime.setup(cpu_devices=args.tp)
        if args.tp > len(jax.devices()):
            raise ConfigError(
                f"--tp {args.tp}: this host has {len(jax.devices())} devices; give at most that"
            )
        mesh = layout.make_mesh(tp=args.tp, devices=jax.devices()[: args.tp])
        model, tokenizer = _load(args, mesh, parse_ladder_layers(args.ladder_layers))
        if args.to_hf and model.config.quantize:
            raise ConfigError(
                f"--checkpoint {args.checkpoint!r} is quantized "
                f"({model.config.quantize}): --to-hf writes float Llama weights; "
                f"convert its float source"
            )
        (_write_hf if args.to_hf else _write_run)(args, model, tokenizer)
    except UsageError as e:  # HFError and ShardingError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only mount: nothing half-written is left
        print(f"error: {_write_error(args, e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"stopped: nothing was written to --out {args.out!r}", file=sys.stderr)
        return 130
    print(f"{model}\nwritten to {args.out}" + (" (Hugging Face layout)" if args.to_hf else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
