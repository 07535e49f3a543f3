"""Convert checkpoints: `python -m ladder_jax.convert --hf PATH --out DIR [...]`.

    # a Hugging Face Llama -> a ladder_jax checkpoint, upper 8 layers converted to ladder
    python -m ladder_jax.convert --hf Llama-3.2-1B/ --out runs/llama-hybrid \\
        --residual ladder --ladder-layers 8
    python -m ladder_jax.train runs/llama-hybrid/config.yaml init_from=runs/llama-hybrid ...
    # a trained run (or a Hugging Face directory) -> the Hugging Face layout
    python -m ladder_jax.convert --checkpoint runs/tiny --out exported/ --to-hf
    # int8 weights for decoding, stored quantized (loaded without re-quantizing)
    python -m ladder_jax.convert --checkpoint runs/tiny --out runs/tiny-int8 --quantize int8
    # a llama.cpp GGUF file (quantized blocks dequantized; its tokenizer and chat template)
    python -m ladder_jax.convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smollm2

Sources: `--hf` a local Hugging Face Llama directory (see `ladder_jax.interop.hf`); `--gguf` a
GGUF Llama file (see `ladder_jax.interop.gguf`); `--checkpoint` a training run (its
`config.yaml` and `checkpoints/<step>/params`, latest step).

Output without `--to-hf`: a directory laid out like a training run, which `train`'s
`init_from=` reads (weights only):
    DIR/config.yaml             the model section of a train config (+ data.tokenizer:
                                tokenizer.json, relative: DIR may be moved or copied)
    DIR/tokenizer.json          the source's tokenizer, when it has one
    DIR/tokenizer_config.json   its BOS convention (add_bos_token), specials, chat template
    DIR/checkpoints/0/params    the weights (orbax, the layout of `ladder_jax.train.checkpoint`)
    DIR/checkpoints/0/meta      {"step": 0, "config": ..., "model_config": ..., "source": ...}
With `--to-hf`: config.json + safetensors (+ index when over --max-shard-bytes) +
tokenizer.json, the residual scheme recorded in config.json (see `ladder_jax.interop.hf`).

The residual scheme is free: every scheme reads the same weights, so `--residual ladder
--ladder-layers N` is the paper's post-training conversion of the upper N layers (quality drops
until it is fine-tuned). Bad input: a one-line error and exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ladder_jax import runtime
from ladder_jax.cli.common import ArgumentParser, quantize_mode
from ladder_jax.config import (
    RESIDUALS,
    ConfigError,
    UsageError,
    check_quantize,
    parse_ladder_layers,
    scheme_overrides,
)
from ladder_jax.interop import gguf, hf
from ladder_jax.interop.tokenizer import ByteTokenizer, HFTokenizer
from ladder_jax.model import sharding
from ladder_jax.train.checkpoint import load_run
from ladder_jax.train.trainer import check_writable


def train_config(config, tokenizer_path: str | None) -> dict:
    """The model section (+ data.tokenizer) of a train config for `config` (a ModelConfig):
    every field, as the schema's model section is ModelConfig's fields."""
    mc = dataclasses.asdict(config)
    ll = mc["ladder_layers"]
    mc["ladder_layers"] = list(ll) if isinstance(ll, (tuple, list)) else ll
    if mc.get("rope_scaling") is not None:
        mc["rope_scaling"] = dict(mc["rope_scaling"])
    doc = {"model": {"preset": "tiny", **mc}}
    if tokenizer_path:
        doc["data"] = {"tokenizer": tokenizer_path}
    return doc


def _check_param_dtype(name: str) -> None:
    """--param-dtype: a floating-point dtype name (an integer one would write zeros)."""
    try:
        dt = np.dtype(jnp.dtype(name))
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        why = "is not a dtype name" if dt is None else "is not a floating-point dtype"
        raise ConfigError(f"--param-dtype {name!r} {why}: choose float32, bfloat16 or float16")


def _save_checkpoint(model, out: str, meta: dict) -> None:

    directory = os.path.abspath(os.path.join(out, "checkpoints"))
    manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(create=True),
        item_handlers={
            "params": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )
    manager.save(
        0,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model))),
            meta=ocp.args.JsonSave(meta),
        ),
        force=True,
    )
    manager.wait_until_finished()
    manager.close()


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


def main(argv=None) -> int:
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
        choices=RESIDUALS,
        help="residual scheme of the result (default: the source's)",
    )
    p.add_argument(
        "--ladder-layers",
        default=None,
        help="ladder only: N (upper N layers) or a comma list of layer indices",
    )
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
    args = p.parse_args(argv)
    transfer = hf.Transfer()
    try:
        runtime.setup(cpu_devices=max(args.tp, 1))
        if args.tp <= 0 or args.tp > len(jax.devices()):
            raise ConfigError(f"--tp {args.tp}: between 1 and {len(jax.devices())}")
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
        check_writable(args.out, f"--out {args.out!r}")
        check_quantize(args.quantize, "--quantize")
        if args.quantize and args.to_hf:
            raise ConfigError(
                f"--quantize {args.quantize} with --to-hf: the Hugging Face "
                f"layout holds float Llama weights; drop one of them"
            )
        mesh = sharding.make_mesh(tp=args.tp, devices=jax.devices()[: args.tp])
        ladder_layers = parse_ladder_layers(args.ladder_layers)
        if args.hf or args.gguf:
            kw = {} if ladder_layers is None else {"ladder_layers": ladder_layers}
            load, source = (hf.load_hf, args.hf) if args.hf else (gguf.load_gguf, args.gguf)
            transfer.kind = "safetensors" if args.hf else "GGUF"
            with _progress_bar(transfer, "reading"):
                model, tokenizer = load(
                    source,
                    mesh=mesh,
                    residual=args.residual,
                    param_dtype=args.param_dtype,
                    transfer=transfer,
                    quantize=args.quantize,
                    **kw,
                )
            print(transfer.summary("read"), file=sys.stderr)
        else:
            model, tokenizer = load_run(
                args.checkpoint,
                mesh=mesh,
                what="--checkpoint",
                quantize=args.quantize,
                **scheme_overrides(args.residual, ladder_layers),
            )
        if args.to_hf and model.config.quantize:
            raise ConfigError(
                f"--checkpoint {args.checkpoint!r} is quantized "
                f"({model.config.quantize}): --to-hf writes float Llama weights; "
                f"convert its float source"
            )
        os.makedirs(args.out, exist_ok=True)
        if args.to_hf:
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
        else:
            tok_path = None
            if isinstance(tokenizer, HFTokenizer):  # the byte one has no file
                tok_path = hf.TOKENIZER  # beside config.yaml: the directory can move
                tokenizer.save(args.out)  # + tokenizer_config.json: BOS, chat template
            doc = train_config(model.config, tok_path)
            with open(os.path.join(args.out, "config.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml(OmegaConf.create(doc)))
            _save_checkpoint(
                model,
                args.out,
                {
                    "step": 0,
                    "config": doc,
                    "model_config": dataclasses.asdict(model.config),
                    "source": os.path.abspath(args.hf or args.gguf or args.checkpoint),
                },
            )
    except UsageError as e:  # HFError and ShardingError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{model}\nwritten to {args.out}" + (" (Hugging Face layout)" if args.to_hf else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
