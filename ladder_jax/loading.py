"""Opening a model, for every place that reads weights (the API, the commands, evaluation,
distillation, `init_from=`): a run or `convert` output, a Hugging Face directory or a GGUF
file, checksums verified, weights straight into their shardings; `save_model` writes the
`convert` layout.

    model, tokenizer = load_model("runs/tiny", mesh=mesh); save_model(model, "runs/copy")"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import zlib

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import nnx
from omegaconf import OmegaConf

from ladder_jax import atomic, train_config
from ladder_jax import config as config_lib
from ladder_jax.config import ConfigError
from ladder_jax.interop.gguf import MAGIC as GGUF_MAGIC
from ladder_jax.interop.gguf import gguf_config, load_gguf
from ladder_jax.interop.hf import TOKENIZER, config_from_hf, load_hf, read_config
from ladder_jax.interop.tokenizer import HFTokenizer, make_tokenizer
from ladder_jax.model import layout, quant
from ladder_jax.model.transformer import abstract


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be trusted; `str(e)` says why (one line)."""


CHECKSUMS = "checksums.json"
UNSOUND = "unsound.json"  # {"why": ...}: weights that gave non-finite losses (see mark_unsound)


def unsound_reason(directory: str) -> str | None:
    """Why checkpoint `directory` was marked unsound by `Checkpointer.mark_unsound`, or None."""
    try:
        with open(os.path.join(directory, UNSOUND)) as f:
            why = json.load(f).get("why")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        why = None
    return str(why or f"it is marked unsound ({UNSOUND})")


def first_line(e: BaseException) -> str:
    """The gist of an error from orbax / tensorstore: its first line, without the spec dump."""
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    for cut in (" [tensorstore_spec", " See full TensorStore", " [source locations"):
        line = line.split(cut)[0]
    return line if len(line) <= 200 else line[:197] + "..."


def crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def checked_files(directory: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), directory)
        for d, _, fs in os.walk(directory)
        for f in fs
        if f != CHECKSUMS
    )


def write_checksums(directory: str) -> None:
    """`directory/checksums.json`: {file: [size, crc32]} of every file below it."""
    sums = {
        f: [os.path.getsize(os.path.join(directory, f)), crc32(os.path.join(directory, f))]
        for f in checked_files(directory)
    }
    tmp = os.path.join(directory, CHECKSUMS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(sums, f)
    os.replace(tmp, os.path.join(directory, CHECKSUMS))


def verify_checksums(directory: str) -> bool:
    """Raises DamagedCheckpoint naming the first file missing, cut short or changed since the
    checkpoint was written; False when there are no checksums to verify, True when they hold."""
    file = os.path.join(directory, CHECKSUMS)
    if not os.path.exists(file):
        return False
    try:
        with open(file) as f:
            sums = json.load(f)
        sums = {str(k): (int(v[0]), int(v[1])) for k, v in sums.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError) as e:
        raise DamagedCheckpoint(f"{CHECKSUMS} is unreadable ({first_line(e)})") from None
    for name, (size, crc) in sums.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise DamagedCheckpoint(f"{name} is missing")
        have = os.path.getsize(path)
        if have != size:
            raise DamagedCheckpoint(
                f"{name} has {have} bytes, {size} when it was written (truncated or overwritten)"
            )
        if crc32(path) != crc:
            raise DamagedCheckpoint(
                f"{name} is corrupt (its CRC-32 differs from the one recorded when it was written)"
            )
    return True


def abstract_like(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def with_weights(state: nnx.State, pure: dict) -> nnx.State:
    state = jax.tree.map(lambda v: v, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    nnx.replace_by_pure_dict(state, pure)
    return state


def check_shapes(directory: str, params: nnx.State, what: str) -> None:
    """Refuses, naming the first weight that differs, a checkpoint whose weights do not have
    the shapes of `params` (a changed model): orbax would fail deep inside with a traceback."""

    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax warns about optional files
    try:
        with ocp.StandardCheckpointer() as ckptr:
            saved = ckptr.metadata(directory)
    except Exception:  # unreadable metadata: let the restore itself report it
        return
    finally:
        absl_logging.set_verbosity(level)
    saved = getattr(saved, "item_metadata", saved)

    def flat(tree):
        return {
            "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(
                getattr(v, "shape", ())
            )
            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]
        }

    have = flat(saved)
    want = flat(nnx.to_pure_dict(params))
    if not have:
        return
    scales = sorted(  # a Linear's int8 scale sits beside its weight (a norm's has none)
        k
        for k in set(have) - set(want)
        if k.rsplit("/", 1)[-1] == quant.SCALE and f"{k.rsplit('/', 1)[0]}/weight" in have
    )
    if scales:
        raise ConfigError(
            f"{what} is quantized (int8 weights with scales such as {scales[0]}, "
            f"made by convert --quantize): it loads for decoding only (decode "
            f"--checkpoint, lj.load); this path needs float weights, so give "
            f"it the float model it was made from"
        )
    fix = "start a new run (a new name=) or load a checkpoint of this model"
    for key, shape in want.items():
        if key not in have:
            raise ConfigError(
                f"{what} has no weight {key} (it holds {len(have)} weights, this "
                f"model {len(want)}): it was saved from another model; {fix}"
            )
        if have[key] != shape:
            raise ConfigError(
                f"{what} holds weight {key} of shape {have[key]}, but this "
                f"model's is {shape}: it was saved from another model; {fix}"
            )
    extra = sorted(set(have) - set(want))
    if extra:
        raise ConfigError(
            f"{what} holds weights this model does not have ({extra[0]}, ...): "
            f"it was saved from another model; {fix}"
        )


def find_checkpoint(path: str, what: str) -> str:
    """The `params` directory of a run directory, its `checkpoints/` directory, or one
    checkpoint `checkpoints/<step>`: the latest step not marked unsound unless one is named."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{what}: {path} does not exist")
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isdir(
        os.path.join(path, "checkpoints")
    ):
        raise ConfigError(
            f"{what}: {path} is a Hugging Face model directory: convert it "
            f"first (python -m ladder_jax.convert --hf {path} --out DIR), then "
            f"give DIR"
        )
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if os.path.isdir(os.path.join(path, "params")):
        return os.path.join(path, "params")
    steps = [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []
    sound = [s for s in steps if not unsound_reason(os.path.join(path, str(s)))]
    if steps and not sound:
        raise ConfigError(
            f"{what}: every checkpoint in {path} is marked unsound "
            f"({unsound_reason(os.path.join(path, str(max(steps))))})"
        )
    steps = sound
    if not steps:
        if not os.path.exists(path):
            raise ConfigError(f"{what}: {path} does not exist")
        raise ConfigError(
            f"{what}: no checkpoint in {path} (give a run directory, its "
            f"checkpoints/ directory or one checkpoints/<step>)"
        )
    return os.path.join(path, str(max(steps)), "params")


def weights_identity(path: str) -> dict:
    """Which weights files `path` resolves to (a run's latest sound checkpoint, a Hugging Face
    directory): their paths and sizes and the recorded checksums, without reading the weights;
    two processes that would load different weights get different identities."""
    try:
        found = (
            path
            if os.path.isfile(os.path.join(path, "config.json"))
            and not os.path.isdir(os.path.join(path, "checkpoints"))
            else os.path.dirname(find_checkpoint(path, "--checkpoint"))
        )
    except ConfigError as e:
        return {"error": str(e)}
    files = {
        f: os.path.getsize(os.path.join(found, f))
        for f in checked_files(found)
        if not f.startswith(("data", UNSOUND))
    }
    sums = os.path.join(found, CHECKSUMS)
    return {
        "directory": os.path.basename(os.path.normpath(found)),
        "files": files,
        CHECKSUMS: crc32(sums) if os.path.isfile(sums) else None,
    }


def load_params(path: str, params: nnx.State, *, what: str = "init_from") -> nnx.State:
    """Weights only (`init_from=`, `--checkpoint`) from `find_checkpoint(path)`, into the
    shapes, dtypes and shardings of `params`, once the checkpoint's checksums hold. `what`
    names the source in error messages; a damaged checkpoint is a one-line ConfigError naming
    the file."""
    directory = find_checkpoint(path, what)
    step = os.path.dirname(directory)
    try:
        verify_checksums(step)
    except DamagedCheckpoint as e:
        raise ConfigError(f"{what} {path!r}: checkpoint {step} is damaged: {e}") from None
    check_shapes(directory, params, f"{what} {path!r}")
    target = jax.tree.map(abstract_like, nnx.to_pure_dict(params))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            pure = ckptr.restore(directory, target)
    except Exception as e:  # noqa: BLE001 (orbax, tensorstore, zstd, json alike)
        raise ConfigError(
            f"{what} {path!r}: checkpoint {step} does not restore ({first_line(e)}): it is "
            f"damaged or incomplete"
        ) from None
    return with_weights(params, pure)


def _run_root(path: str) -> str:
    """The run directory of `path`: itself, or the run holding it when `path` is a run's
    `checkpoints/` directory or one `checkpoints/<step>`."""
    p = os.path.abspath(path)
    up = os.path.dirname(p)
    if os.path.basename(p) == "checkpoints" and os.path.isfile(os.path.join(up, "config.yaml")):
        return up
    if os.path.basename(up) == "checkpoints" and os.path.isfile(
        os.path.join(os.path.dirname(up), "config.yaml")
    ):
        return os.path.dirname(up)
    return path


def _config_file(path: str, what: str) -> str | None:
    """The config.yaml of the run or `convert` output at `path`, or None for a Hugging Face
    directory (config.json); a ConfigError for anything else."""
    if not os.path.exists(path):
        raise ConfigError(
            f"{what} {path!r} does not exist: give a training run directory "
            f"(runs/NAME), the output of ladder_jax.convert, a Hugging Face "
            f"model directory or a GGUF file (llama.cpp)"
        )
    if os.path.isfile(path):
        raise ConfigError(
            f"{what} {path!r} is a file, not a directory: give the directory holding the "
            f"model (a training run or ladder_jax.convert output: config.yaml and "
            f"checkpoints/; a Hugging Face model: config.json and *.safetensors), or a "
            f"GGUF file (llama.cpp)"
        )
    cfg_file = os.path.join(_run_root(path), "config.yaml")
    if os.path.isfile(cfg_file):
        return cfg_file
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    raise ConfigError(
        f"{what} {path!r}: no config.yaml there: give a training run directory "
        f"(runs/NAME), the output of ladder_jax.convert, a Hugging Face model "
        f"directory or a GGUF file (llama.cpp)"
    )


def _is_gguf(path: str) -> bool:
    """Whether `path` is a GGUF file: by its first four bytes (the magic), whatever its name;
    only a regular file (or a link to one) is opened, and only those bytes are read. A file
    named *.gguf counts too, so that the GGUF reader says what is wrong with a damaged one."""
    if not os.path.isfile(path):
        return False
    if path.endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_model_config(path: str, *, what: str = "--checkpoint") -> config_lib.ModelConfig:
    """The model config of what `load_model` would load from `path` (as stored: no overrides),
    read without touching the weights: what a caller needs to choose a mesh first.

        config = read_model_config("runs/tiny")"""
    path = os.fspath(path)
    if _is_gguf(path):
        return gguf_config(path)
    cfg_file = _config_file(path, what)
    if cfg_file is None:
        return config_from_hf(read_config(path))
    try:
        return train_config.model_config(train_config.load_config([cfg_file]))
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{what} {path!r}: {e}") from None


def check_tp(tp: int | None, config: config_lib.ModelConfig, flag: str = "--tp") -> None:
    """A tensor-parallel size against what can exist, before any device is made (fake CPU
    devices cost memory and time each): at least 1, at most the model's query heads (each
    device holds whole heads), and one its heads, kv heads, MLP and vocabulary split over
    evenly (`layout.check_divisible` names the largest that does). None (the default chosen
    later) passes."""
    if tp is None:
        return
    given = f"{flag} {tp}" if flag.startswith("-") else f"{flag}={tp}"
    if tp < 1:
        raise ConfigError(f"{given}: give the number of devices to spread over, at least 1")
    if tp > config.n_heads:
        raise ConfigError(
            f"{given}: the model has {config.n_heads} query heads and each device holds "
            f"whole heads, so {flag} can be at most {config.n_heads}"
        )
    layout.check_divisible(config, tp, flag=flag)


def load_model(
    path: str, *, mesh, what: str = "--checkpoint", quantize: str | None = None, **overrides
):
    """(model, tokenizer) from a training run or a `python -m ladder_jax.convert` output (a
    directory with config.yaml and checkpoints/), a Hugging Face Llama directory
    (config.json, see `ladder_jax.interop.hf.load_hf`) or a GGUF file (known by its
    magic, whatever its name: `ladder_jax.interop.gguf.load_gguf`). The model is built from
    shapes and its weights restored straight into their shardings on `mesh`; no random weights
    are made. `overrides` change the model config, e.g. residual="ladder", ladder_layers=2
    (any scheme reads any weights). `quantize="int8"` quantizes float weights once loaded
    (`ladder_jax.model.quant`); a checkpoint stored quantized (`convert --quantize`) loads as it
    is, with or without it."""

    config_lib.check_quantize(quantize)
    path = os.fspath(path)
    if _is_gguf(path):
        return load_gguf(path, mesh=mesh, quantize=quantize, **overrides)
    cfg_file = _config_file(path, what)
    if cfg_file is None:
        return load_hf(path, mesh=mesh, quantize=quantize, **overrides)
    try:
        run = train_config.load_config([cfg_file])
        model_config = dataclasses.replace(train_config.model_config(run), **overrides)
        tokenizer = make_tokenizer(run.data.tokenizer)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{what} {path!r}: {e}") from None
    graphdef, state = abstract(model_config, mesh)
    model = nnx.merge(graphdef, load_params(path, state, what=what))
    if quantize is not None and model.config.quantize is None:
        model = quant.quantize(model, quantize)
    return model, tokenizer


class _OrbaxFailureFilter(logging.Filter):
    """Drops the tracebacks orbax's and asyncio's background tasks log for a failed write:
    the writer reports that failure itself, in one line."""

    def filter(self, record):
        text = record.getMessage()
        if "exception was never retrieved" in text:  # asyncio: Task, Future, _GatheringFuture
            return not any(w in text for w in ("orbax", "OCDBT", "tensorstore"))
        return not ((record.exc_info or "exception" in text) and "orbax" in record.pathname)


@functools.cache
def quiet_orbax_failures() -> None:
    """Once per process: no tracebacks logged by orbax's background tasks for a failed write
    (the writer reports it in one line), and none from tensorstore callbacks that outlive the
    event loop of a failed write ("Event loop is closed")."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_OrbaxFailureFilter())
    hook = sys.unraisablehook

    def unraisable(u):
        if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
            return
        hook(u)

    sys.unraisablehook = unraisable


def run_config_doc(config, tokenizer_path: str | None) -> dict:
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


def _save_weights(model, directory: str, meta: dict) -> None:
    """`directory/0`: the weights and `meta` as a training run's checkpoint holds them, then
    their checksums."""
    quiet_orbax_failures()
    manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
        item_handlers={
            "params": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )
    try:  # synchronous: a failure is raised here, not logged by background threads
        manager.save(
            0,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model))),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many kinds)
        raise atomic.as_os_error(e, directory) from None
    finally:
        with contextlib.suppress(Exception):  # a failed save was raised above
            manager.close()
    write_checksums(os.path.join(directory, "0"))


def save_model(model, out: str, *, tokenizer=None, source: str | None = None) -> None:
    """Writes `model` as a directory that `load_model` (and `init_from=`) reads: config.yaml,
    the tokenizer's files (an `HFTokenizer`'s; the byte tokenizer has none), checkpoints/0
    (params, meta with `source`, checksums.json). `out` must not exist or be empty. Written
    into a temporary sibling and renamed into place once complete (`ladder_jax.atomic`), so a
    failure (a full disk) leaves no `out`; OSError then says why."""
    with atomic.directory(out) as tmp:
        tok_path = None
        if isinstance(tokenizer, HFTokenizer):
            tok_path = TOKENIZER  # beside config.yaml: the directory can move
            tokenizer.save(tmp)  # + tokenizer_config.json: BOS, chat template
        doc = run_config_doc(model.config, tok_path)
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.create(doc)))
        meta = {"step": 0, "config": doc, "model_config": dataclasses.asdict(model.config)}
        if source is not None:
            meta["source"] = os.path.abspath(source)
        _save_weights(model, os.path.join(tmp, "checkpoints"), meta)
