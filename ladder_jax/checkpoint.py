"""Checkpoints with orbax: weights, optimizer state, step, data-iterator state and config.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    ckpt.save(step, params, opt_state, data_iter, meta)        # asynchronous
    step = ckpt.latest_step()
    params, opt_state, meta = ckpt.restore(step, params_like, opt_state_like, data_iter)

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

import os

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx


def _opt_dict(opt_state) -> dict:
    """The optimizer state's arrays keyed by tree path (independent of optax's classes)."""
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"params": ocp.StandardCheckpointHandler(),
                           "opt_state": ocp.StandardCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: nnx.State, opt_state, data_iter, meta: dict):
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
            opt_state=ocp.args.StandardSave(_opt_dict(opt_state)),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, params: nnx.State, opt_state, data_iter):
        """Restores into the shapes, dtypes and shardings of `params` / `opt_state` (concrete
        arrays or ShapeDtypeStructs with NamedShardings); sets `data_iter`'s position."""
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


def load_params(path: str, params: nnx.State) -> nnx.State:
    """Weights only (`init_from`): from a run directory, its `checkpoints/` directory, or one
    checkpoint `checkpoints/<step>`; latest step unless one is named. Shapes must match."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if not os.path.isdir(os.path.join(path, "params")):
        steps = [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []
        if not steps:
            raise FileNotFoundError(f"init_from={path!r}: no checkpoint there")
        path = os.path.join(path, str(max(steps)))
    target = jax.tree.map(_abstract, nnx.to_pure_dict(params))
    with ocp.StandardCheckpointer() as ckptr:
        pure = ckptr.restore(os.path.join(path, "params"), target)
    return _replace(params, pure)
