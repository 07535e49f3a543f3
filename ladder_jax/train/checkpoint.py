"""The trainer's checkpoints with orbax (weights, optimizer state, step, data-iterator state,
config): asynchronous saves, verified restores onto any mesh and process count
(docs/training.md, 'Resume, one writer, faults'). Weights alone: `ladder_jax.loading`.

    ckpt.save(state, data_iter, meta); state, meta = ckpt.restore(step, state_like, data_iter)"""

from __future__ import annotations

import glob as globlib
import json
import os
import re
import threading
import warnings

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from ladder_jax.loading import (
    UNSOUND,
    DamagedCheckpoint,
    abstract_like,
    check_shapes,
    first_line,
    quiet_orbax_failures,
    unsound_reason,
    verify_checksums,
    with_weights,
    write_checksums,
)
from ladder_jax.train.step import TrainState


class SaveError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the message is one line."""


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def params_finite(params) -> bool:
    """Whether every floating-point weight of `params` (an nnx.State or a pure dict of global
    arrays) is finite; every process gets the same answer."""
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    return bool(np.asarray(_all_finite(params).addressable_data(0)))


def _abandoned_writes_stay_quiet() -> None:
    """After a failed save, the write coroutines orbax had not started yet are dropped: Python
    warns about each ("coroutine ... was never awaited") when they are collected, often at exit.
    The failure is reported once, as SaveError, so those warnings are turned off."""
    warnings.filterwarnings(
        "ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning
    )


def _opt_dict(opt_state) -> dict:
    """The optimizer state's arrays keyed by tree path (independent of optax's classes)."""
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        # not created here: a run that fails its checks must leave no directory behind
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=False, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "params": ocp.StandardCheckpointHandler(),
                "opt_state": ocp.StandardCheckpointHandler(),
                "data": grain.checkpoint.CheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        self._unhashed, self._hasher, self._hash_error = [], None, None
        quiet_orbax_failures()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """Every checkpoint step on disk (complete or not yet verified), newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def save(self, state: TrainState, data_iter, meta: dict):
        """Starts writing `state` as checkpoint `state.step` (asynchronous). A failed earlier
        save is raised here as SaveError."""
        self.check()
        try:
            os.makedirs(self.directory, exist_ok=True)
            self.manager.save(
                state.step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(nnx.to_pure_dict(state.params)),
                    opt_state=ocp.args.StandardSave(_opt_dict(state.opt_state)),
                    data=grain.checkpoint.CheckpointSave(data_iter),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many kinds)
            raise self._save_error(state.step, e) from None
        self._unhashed.append(state.step)

    def check(self) -> None:
        """Raises SaveError if a background save has failed; starts recording the checksums of
        the saves that have completed."""
        try:
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            raise self._save_error(None, e) from None
        self._hash(block=False)

    def _hash(self, *, block: bool) -> None:
        """Checksums of completed saves (process 0, one background thread at a time)."""
        if self._hasher is not None and (block or not self._hasher.is_alive()):
            self._hasher.join()
            self._hasher = None
            if self._hash_error is not None:
                e, self._hash_error = self._hash_error, None
                raise self._save_error(None, e)
        if not self._unhashed or self._hasher is not None or self.manager.is_saving_in_progress():
            return
        steps, self._unhashed = self._unhashed, []
        if jax.process_index() != 0:
            return

        def work():
            try:
                for s in steps:
                    if os.path.isdir(os.path.join(self.directory, str(s))):
                        write_checksums(os.path.join(self.directory, str(s)))
            except FileNotFoundError:  # removed by `keep` meanwhile
                pass
            except OSError as e:
                self._hash_error = e

        self._hasher = threading.Thread(target=work, name="checkpoint-checksums", daemon=True)
        self._hasher.start()
        if block:
            self._hash(block=True)

    def _save_error(self, step, e) -> SaveError:
        good = [
            s
            for s in self.steps()
            if os.path.exists(os.path.join(self.directory, str(s), "meta", "metadata"))
        ]
        kept = (
            f"the last complete checkpoint, step {good[0]}, is intact"
            if good
            else "no checkpoint had been written yet"
        )
        failed = re.search(r"/(\d+)\.orbax-checkpoint-tmp", str(e))
        step = int(failed.group(1)) if failed else step  # the save that failed, if it says
        what = f"checkpoint {step}" if step is not None else "a checkpoint"
        reason = re.search(
            r"(No space left on device|File too large|Disk quota exceeded|"
            r"Permission denied|Read-only file system)",
            str(e),
        )
        _abandoned_writes_stay_quiet()
        return SaveError(
            f"could not write {what} in {self.directory} "
            f"({reason.group(1) if reason else first_line(e)}): "
            f"{kept}; free disk space (or fix the directory's permissions) and "
            f"run the same command again to resume"
        )

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with `step` (step, config, mesh), read without restoring.
        Raises DamagedCheckpoint when it is missing or not what a save writes."""
        file = os.path.join(self.directory, str(step), "meta", "metadata")
        unsound = unsound_reason(os.path.join(self.directory, str(step)))
        if unsound:
            raise DamagedCheckpoint(unsound)
        try:
            with open(file) as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise DamagedCheckpoint("no meta/metadata file: not a complete checkpoint") from None
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(f"meta/metadata is unreadable ({first_line(e)})") from None
        if (
            not isinstance(meta, dict)
            or meta.get("step") != step
            or not isinstance(meta.get("config"), dict)
        ):
            raise DamagedCheckpoint(
                "meta/metadata is not the metadata of this checkpoint (no step and config)"
            )
        return meta

    def restore(self, step: int, state: TrainState, data_iter):
        """Restores checkpoint `step` into the shapes, dtypes and shardings of `state`'s arrays
        (concrete arrays or ShapeDtypeStructs with NamedShardings); sets `data_iter`'s position.
        Returns (TrainState, meta). Raises DamagedCheckpoint (nothing restored into
        `data_iter` is then to be trusted) or ConfigError (another model's weights)."""
        meta = self.meta(step)
        where = os.path.join(self.directory, str(step))
        verify_checksums(where)
        for item in ("params", "opt_state", "data"):
            if not os.path.isdir(os.path.join(where, item)):
                raise DamagedCheckpoint(f"its {item}/ directory is missing")
        check_shapes(
            os.path.join(where, "params"), state.params, f"checkpoint {self.directory}/{step}"
        )
        data_state = _data_position(os.path.join(where, "data"))
        params_target = jax.tree.map(abstract_like, nnx.to_pure_dict(state.params))
        opt_target = jax.tree.map(abstract_like, _opt_dict(state.opt_state))
        items = dict(
            params=ocp.args.StandardRestore(params_target),
            opt_state=ocp.args.StandardRestore(opt_target),
            meta=ocp.args.JsonRestore(),
        )
        if data_state is None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
            if data_state is not None:
                data_iter.set_state(data_state)
        except Exception as e:  # noqa: BLE001 (tensorstore, zstd, orbax, grain, json)
            raise DamagedCheckpoint(f"it does not restore: {first_line(e)}") from None
        if not params_finite(out["params"]):
            raise DamagedCheckpoint("its weights are not finite (NaN or infinite)")
        params = with_weights(state.params, out["params"])
        treedef = jax.tree.structure(state.opt_state)
        opt_state = jax.tree.unflatten(
            treedef,
            [out["opt_state"][k] for k in _opt_dict(state.opt_state)],
        )
        meta = dict(out["meta"])
        if data_state is not None:
            meta["resharded"] = data_state
        return TrainState(params, opt_state, step), meta

    def mark_unsound(self, step: int, why: str) -> None:
        """Marks checkpoint `step` (complete, on disk) as not to be resumed from: `meta` and
        `restore` then raise DamagedCheckpoint(why), and `find_checkpoint` passes it over.
        Process 0 writes; the files of the checkpoint are left as they are."""
        if jax.process_index() == 0:
            with open(os.path.join(self.directory, str(step), UNSOUND), "w") as f:
                json.dump({"why": why}, f)

    def move_aside(self, step: int) -> str:
        """Renames damaged checkpoint `step` to `<step>.damaged` (never deletes it); returns the
        new path."""
        src = os.path.join(self.directory, str(step))
        dst, n = src + ".damaged", 1
        while os.path.exists(dst):
            n += 1
            dst = f"{src}.damaged{n}"
        os.rename(src, dst)
        self.manager.reload()
        return dst

    def wait(self):
        """Until every save is written (and its checksums recorded); SaveError if one failed."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            raise self._save_error(None, e) from None
        self._hash(block=True)

    def close(self):
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 (a failed save was reported by wait)
                pass


def _data_position(directory: str) -> dict | None:
    """None when `directory` holds this process count's iterator files (orbax restores them);
    else the position to carry over (re-sharding), read from the files another process count
    wrote. Raises DamagedCheckpoint when the files are missing, unreadable or disagree."""
    me, count = jax.process_index(), jax.process_count()
    if os.path.isfile(os.path.join(directory, f"process_{me}-of-{count}.json")):
        return None
    files = globlib.glob(os.path.join(directory, "process_*-of-*.json"))
    counts = {
        int(m.group(1)) for f in files if (m := re.search(r"-of-(\d+)\.json$", os.path.basename(f)))
    }
    if len(counts) != 1:
        raise DamagedCheckpoint(
            f"its data iterator file for process {me} of {count} "
            f"(data/process_{me}-of-{count}.json) is missing"
        )
    (n,) = counts
    states = []
    for i in range(n):
        file = os.path.join(directory, f"process_{i}-of-{n}.json")
        try:
            with open(file) as f:
                states.append(json.load(f))
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(
                f"data/{os.path.basename(file)} is unreadable ({first_line(e)})"
            ) from None
    if any(st != states[0] for st in states) or not isinstance(states[0], dict):
        raise DamagedCheckpoint(
            f"its {n} data iterator files disagree on the position, so it "
            f"cannot resume on {count} process(es): resume it on {n}"
        )
    return states[0]
