"""Checkpoints with orbax (weights, optimizer state, step, data-iterator state, config) and the
one way to load a trained, converted or Hugging Face model.

    ckpt.save(state, data_iter, meta); state, meta = ckpt.restore(step, state_like, data_iter)
    model, tokenizer = load_run("runs/tiny", mesh=mesh)        # decode, convert, lj.load

A checkpoint appears only once complete (orbax's rename); saves are asynchronous and a failed
one surfaces as `SaveError` at the next call. Process 0 records every file's size and CRC-32;
`restore` verifies them first and raises `DamagedCheckpoint` (deleting nothing). Restores go
onto any mesh (targets carry the new mesh's concrete shardings) and any process count (the
data position is re-sharded). Weights that are not finite are never restored, and a
checkpoint marked `<step>/unsound.json` (its weights gave non-finite losses) is skipped.
See docs/training.md#resume-one-writer-faults.
"""

from __future__ import annotations

import dataclasses
import functools
import glob as globlib
import json
import logging
import os
import re
import sys
import threading
import warnings
import zlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import nnx

from ladder_jax import config as config_lib
from ladder_jax.config import ConfigError
from ladder_jax.interop.gguf import MAGIC as GGUF_MAGIC
from ladder_jax.interop.gguf import gguf_config, load_gguf
from ladder_jax.interop.hf import config_from_hf, load_hf, read_config
from ladder_jax.interop.tokenizer import make_tokenizer
from ladder_jax.model import quant
from ladder_jax.model.transformer import abstract
from ladder_jax.train.step import TrainState


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be trusted; `str(e)` says why (one line)."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the message is one line."""


CHECKSUMS = "checksums.json"
UNSOUND = "unsound.json"  # {"why": ...}: weights that gave non-finite losses (see mark_unsound)


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


def _first_line(e: BaseException) -> str:
    """The gist of an error from orbax / tensorstore: its first line, without the spec dump."""
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    for cut in (" [tensorstore_spec", " See full TensorStore", " [source locations"):
        line = line.split(cut)[0]
    return line if len(line) <= 200 else line[:197] + "..."


class _OrbaxFailureFilter(logging.Filter):
    """Drops the tracebacks orbax's and asyncio's background tasks log for a failed write:
    `Checkpointer` reports that failure itself, in one line (`SaveError`)."""

    def filter(self, record):
        text = record.getMessage()
        if "exception was never retrieved" in text:  # asyncio: Task, Future, _GatheringFuture
            return not any(w in text for w in ("orbax", "OCDBT", "tensorstore"))
        return not ((record.exc_info or "exception" in text) and "orbax" in record.pathname)


@functools.cache
def _quiet_background_failures() -> None:
    """Once per process: the filter above, and no "Event loop is closed" tracebacks from
    tensorstore callbacks that outlive the event loop of a failed orbax write."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_OrbaxFailureFilter())
    hook = sys.unraisablehook

    def unraisable(u):
        if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
            return
        hook(u)

    sys.unraisablehook = unraisable


def _abandoned_writes_stay_quiet() -> None:
    """After a failed save, the write coroutines orbax had not started yet are dropped: Python
    warns about each ("coroutine ... was never awaited") when they are collected, often at exit.
    The failure is reported once, as SaveError, so those warnings are turned off."""
    warnings.filterwarnings(
        "ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning
    )


def _crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), directory)
        for d, _, fs in os.walk(directory)
        for f in fs
        if f != CHECKSUMS
    )


def write_checksums(directory: str) -> None:
    """`directory/checksums.json`: {file: [size, crc32]} of every file below it."""
    sums = {
        f: [os.path.getsize(os.path.join(directory, f)), _crc32(os.path.join(directory, f))]
        for f in _files(directory)
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
        raise DamagedCheckpoint(f"{CHECKSUMS} is unreadable ({_first_line(e)})") from None
    for name, (size, crc) in sums.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise DamagedCheckpoint(f"{name} is missing")
        have = os.path.getsize(path)
        if have != size:
            raise DamagedCheckpoint(
                f"{name} has {have} bytes, {size} when it was written (truncated or overwritten)"
            )
        if _crc32(path) != crc:
            raise DamagedCheckpoint(
                f"{name} is corrupt (its CRC-32 differs from the one recorded when it was written)"
            )
    return True


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
        _quiet_background_failures()

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
            f"({reason.group(1) if reason else _first_line(e)}): "
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
            raise DamagedCheckpoint(f"meta/metadata is unreadable ({_first_line(e)})") from None
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
        legacy = check_shapes(
            os.path.join(where, "params"), state.params, f"checkpoint {self.directory}/{step}"
        )
        data_state = _data_position(os.path.join(where, "data"))
        params_target = jax.tree.map(_abstract, nnx.to_pure_dict(state.params))
        opt_target = jax.tree.map(_abstract, _opt_dict(state.opt_state))
        if legacy:
            params_target = _to_legacy(params_target)
            opt_target = {_legacy_key(k): v for k, v in opt_target.items()}
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
            raise DamagedCheckpoint(f"it does not restore: {_first_line(e)}") from None
        if not params_finite(out["params"]):
            raise DamagedCheckpoint("its weights are not finite (NaN or infinite)")
        params = _replace(state.params, _from_legacy(out["params"]) if legacy else out["params"])
        treedef = jax.tree.structure(state.opt_state)
        opt_state = jax.tree.unflatten(
            treedef,
            [out["opt_state"][_legacy_key(k) if legacy else k] for k in _opt_dict(state.opt_state)],
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
                f"data/{os.path.basename(file)} is unreadable ({_first_line(e)})"
            ) from None
    if any(st != states[0] for st in states) or not isinstance(states[0], dict):
        raise DamagedCheckpoint(
            f"its {n} data iterator files disagree on the position, so it "
            f"cannot resume on {count} process(es): resume it on {n}"
        )
    return states[0]


def _replace(state: nnx.State, pure: dict) -> nnx.State:
    state = jax.tree.map(lambda v: v, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    nnx.replace_by_pure_dict(state, pure)
    return state


# Checkpoints written before each linear weight was a `Linear` hold it at the module's name
# (layers/0/attn/q, its int8 scale at q_scale) where the model now has q/weight and q/scale.
_LINEARS = ("q", "k", "v", "o", "gate", "up", "down", "head")
_LEGACY_KEY = re.compile(r"(^|/)(attn/[qkvo]|mlp/(gate|up|down)|head)$")


def _to_legacy(pure: dict) -> dict:
    """A params tree in that earlier layout."""
    out = {}
    for k, v in pure.items():
        if k in _LINEARS and isinstance(v, dict) and "weight" in v:
            out[k] = v["weight"]
            if "scale" in v:
                out[f"{k}_scale"] = v["scale"]
        else:
            out[k] = _to_legacy(v) if isinstance(v, dict) else v
    return out


def _from_legacy(pure: dict) -> dict:
    """`_to_legacy`'s inverse."""
    out = {}
    for k, v in pure.items():
        if k in _LINEARS and not isinstance(v, dict):
            out[k] = {
                "weight": v,
                **({"scale": pure[f"{k}_scale"]} if f"{k}_scale" in pure else {}),
            }
        elif not (isinstance(k, str) and k.endswith("_scale") and k[:-6] in _LINEARS):
            out[k] = _from_legacy(v) if isinstance(v, dict) else v
    return out


def _legacy_key(key: str) -> str:
    """An optimizer-state key (`_opt_dict`) in that earlier layout."""
    return re.sub(r"\['(" + "|".join(_LINEARS) + r")'\]\['weight'\]", r"['\1']", key)


def check_shapes(directory: str, params: nnx.State, what: str) -> bool:
    """Refuses, naming the first weight that differs, a checkpoint whose weights do not have
    the shapes of `params` (a changed model): orbax would fail deep inside with a traceback.
    Returns whether the checkpoint holds the layout before `Linear` (`_to_legacy`)."""

    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax warns about optional files
    try:
        with ocp.StandardCheckpointer() as ckptr:
            saved = ckptr.metadata(directory)
    except Exception:  # unreadable metadata: let the restore itself report it
        return False
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
    legacy = any(_LEGACY_KEY.search(k) for k in have)
    want = flat(_to_legacy(nnx.to_pure_dict(params)) if legacy else nnx.to_pure_dict(params))
    if not have:
        return False
    scales = sorted(
        k
        for k in set(have) - set(want)
        if k.rsplit("/", 1)[-1] in (quant.SCALE, *(f"{n}_scale" for n in _LINEARS))
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
    return legacy


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
        for f in _files(found)
        if not f.startswith(("data", UNSOUND))
    }
    sums = os.path.join(found, CHECKSUMS)
    return {
        "directory": os.path.basename(os.path.normpath(found)),
        "files": files,
        CHECKSUMS: _crc32(sums) if os.path.isfile(sums) else None,
    }


def load_params(path: str, params: nnx.State, *, what: str = "init_from") -> nnx.State:
    """Weights only (`init_from=`, `--checkpoint`) from `find_checkpoint(path)`, into the
    shapes, dtypes and shardings of `params`. `what` names the source in error messages."""
    directory = find_checkpoint(path, what)
    legacy = check_shapes(directory, params, f"{what} {path!r}")
    target = jax.tree.map(_abstract, nnx.to_pure_dict(params))
    with ocp.StandardCheckpointer() as ckptr:
        pure = ckptr.restore(directory, _to_legacy(target) if legacy else target)
    return _replace(params, _from_legacy(pure) if legacy else pure)


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


def run_model_config(path: str, *, what: str = "--checkpoint") -> config_lib.ModelConfig:
    """The model config of what `load_run` would load from `path` (as stored: no overrides),
    read without touching the weights: what a caller needs to choose a mesh first.

        config = run_model_config("runs/tiny")"""
    path = os.fspath(path)
    if _is_gguf(path):
        return gguf_config(path)
    cfg_file = _config_file(path, what)
    if cfg_file is None:
        return config_from_hf(read_config(path))
    try:
        return config_lib.model_config(config_lib.load_config([cfg_file]))
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{what} {path!r}: {e}") from None


def load_run(
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
