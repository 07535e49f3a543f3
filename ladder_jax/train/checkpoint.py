"""Checkpoints with orbax: weights, optimizer state, step, data-iterator state and config; and
the one way to load a trained (or converted, or Hugging Face) model.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    ckpt.save(step, params, opt_state, data_iter, meta)        # asynchronous
    step = ckpt.latest_step()
    params, opt_state, meta = ckpt.restore(step, params_like, opt_state_like, data_iter)
    model, tokenizer = load_run("runs/tiny", mesh=mesh)        # decode, convert, lj.load

Layout of one checkpoint (`checkpoints/<step>/`): `params` (the model's weights as a nested dict
named like the model's attributes), `opt_state` (the optimizer's arrays keyed by their tree
path), `data` (grain iterator state, one file per process), `meta` (JSON: step, config, mesh).

Guarantees, from orbax: a checkpoint is written to a temporary directory and renamed into place
only once complete (and, with many processes, once every process has finished), so a crash or
kill mid-save leaves the previous checkpoints intact and the partial one is ignored. Saves are
asynchronous: arrays are copied off the devices, then written in a background thread while
training continues. `keep` bounds how many are kept.

Restoring onto another mesh (e.g. trained at tp=2, resumed at tp=4): the restore targets carry
concrete `NamedSharding`s of the *new* mesh (built from the model's partition specs by the
caller), and orbax reads each shard straight into place. Abstract shardings from
`nnx.eval_shape` under `jax.set_mesh` won't do: orbax needs concrete devices.
"""

from __future__ import annotations

import dataclasses
import json
import os

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import nnx

from ladder_jax import config as config_lib
from ladder_jax.config import ConfigError
from ladder_jax.interop.hf import load_hf
from ladder_jax.interop.tokenizer import make_tokenizer
from ladder_jax.model import quant
from ladder_jax.model.transformer import abstract


def _opt_dict(opt_state) -> dict:
    """The optimizer state's arrays keyed by tree path (independent of optax's classes)."""
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        # not created here: a run that fails its checks must leave no directory behind
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=False, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"params": ocp.StandardCheckpointHandler(),
                           "opt_state": ocp.StandardCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: nnx.State, opt_state, data_iter, meta: dict):
        os.makedirs(self.directory, exist_ok=True)
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
            opt_state=ocp.args.StandardSave(_opt_dict(opt_state)),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave(meta)), force=True)

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with `step` (step, config, mesh), read without restoring."""
        file = os.path.join(self.directory, str(step), "meta", "metadata")
        try:
            with open(file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def restore(self, step: int, params: nnx.State, opt_state, data_iter):
        """Restores into the shapes, dtypes and shardings of `params` / `opt_state` (concrete
        arrays or ShapeDtypeStructs with NamedShardings); sets `data_iter`'s position."""
        check_shapes(os.path.join(self.directory, str(step), "params"), params,
                     f"checkpoint {self.directory}/{step}")
        params_target = jax.tree.map(_abstract, nnx.to_pure_dict(params))
        opt_target = jax.tree.map(_abstract, _opt_dict(opt_state))
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(params_target),
            opt_state=ocp.args.StandardRestore(opt_target),
            data=grain.checkpoint.CheckpointRestore(data_iter),
            meta=ocp.args.JsonRestore()))
        params = _replace(params, out["params"])
        treedef = jax.tree.structure(opt_state)
        opt_state = jax.tree.unflatten(treedef, [out["opt_state"][k] for k in _opt_dict(opt_state)])
        return params, opt_state, out["meta"]

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def _replace(state: nnx.State, pure: dict) -> nnx.State:
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
        return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path):
                tuple(getattr(v, "shape", ()))
                for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}

    have, want = flat(saved), flat(nnx.to_pure_dict(params))
    if not have:
        return
    scales = sorted(k for k in set(have) - set(want) if k.endswith(quant.SCALE))
    if scales:
        raise ConfigError(f"{what} is quantized (int8 weights with scales such as {scales[0]}, "
                          f"made by convert --quantize): it loads for decoding only (decode "
                          f"--checkpoint, lj.load); this path needs float weights, so give "
                          f"it the float model it was made from")
    fix = "start a new run (a new name=) or load a checkpoint of this model"
    for key, shape in want.items():
        if key not in have:
            raise ConfigError(f"{what} has no weight {key} (it holds {len(have)} weights, this "
                              f"model {len(want)}): it was saved from another model; {fix}")
        if have[key] != shape:
            raise ConfigError(f"{what} holds weight {key} of shape {have[key]}, but this "
                              f"model's is {shape}: it was saved from another model; {fix}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ConfigError(f"{what} holds weights this model does not have ({extra[0]}, ...): "
                          f"it was saved from another model; {fix}")


def find_checkpoint(path: str, what: str) -> str:
    """The `params` directory of a run directory, its `checkpoints/` directory, or one
    checkpoint `checkpoints/<step>`: the latest step unless one is named."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if os.path.isdir(os.path.join(path, "params")):
        return os.path.join(path, "params")
    steps = [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []
    if not steps:
        if not os.path.exists(path):
            raise ConfigError(f"{what}: {path} does not exist")
        raise ConfigError(f"{what}: no checkpoint in {path} (give a run directory, its "
                          f"checkpoints/ directory or one checkpoints/<step>)")
    return os.path.join(path, str(max(steps)), "params")


def load_params(path: str, params: nnx.State, *, what: str = "init_from") -> nnx.State:
    """Weights only (`init_from=`, `--checkpoint`) from `find_checkpoint(path)`, into the
    shapes, dtypes and shardings of `params`. `what` names the source in error messages."""
    directory = find_checkpoint(path, what)
    check_shapes(directory, params, f"{what} {path!r}")
    target = jax.tree.map(_abstract, nnx.to_pure_dict(params))
    with ocp.StandardCheckpointer() as ckptr:
        pure = ckptr.restore(directory, target)
    return _replace(params, pure)


def load_run(path: str, *, mesh, what: str = "--checkpoint", quantize: str | None = None,
             **overrides):
    """(model, tokenizer) from a training run or a `python -m ladder_jax.convert` output (a
    directory with config.yaml and checkpoints/), or a Hugging Face Llama directory
    (config.json, see `ladder_jax.interop.hf.load_hf`). The model is built from shapes and its weights
    restored straight into their shardings on `mesh`; no random weights are made. `overrides`
    change the model config, e.g. residual="ladder", ladder_layers=2 (any scheme reads any
    weights). `quantize="int8"` quantizes float weights once loaded (`ladder_jax.model.quant`);
    a checkpoint stored quantized (`convert --quantize`) loads as it is, with or without it."""

    config_lib.check_quantize(quantize)
    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.yaml")
    if not os.path.isfile(cfg_file):
        if os.path.isfile(os.path.join(path, "config.json")):
            return load_hf(path, mesh=mesh, quantize=quantize, **overrides)
        raise ConfigError(f"{what} {path!r}: no config.yaml there: give a training run "
                          f"directory (runs/NAME), the output of ladder_jax.convert, or a Hugging "
                          f"Face model directory")
    try:
        run = config_lib.load_config([cfg_file])
        model_config = dataclasses.replace(config_lib.model_config(run), **overrides)
        tokenizer = make_tokenizer(run.data.tokenizer)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{what} {path!r}: {e}") from None
    graphdef, state = abstract(model_config, mesh)
    model = nnx.merge(graphdef, load_params(path, state, what=what))
    if quantize is not None and model.config.quantize is None:
        model = quant.quantize(model, quantize)
    return model, tokenizer
