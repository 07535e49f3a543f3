"""Checkpoints with orbax: weights, optimizer state, step, data-iterator state and config; and
the one way to load a trained (or converted, or Hugging Face) model.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    ckpt.save(state, data_iter, meta)                           # asynchronous; state a TrainState
    for step in ckpt.steps(): ...                               # newest first
    state, meta = ckpt.restore(step, state_like, data_iter)     # or raises DamagedCheckpoint
    model, tokenizer = load_run("runs/tiny", mesh=mesh)        # decode, convert, lj.load

Layout of one checkpoint (`checkpoints/<step>/`): `params` (the model's weights as a nested dict
named like the model's attributes), `opt_state` (the optimizer's arrays keyed by their tree
path), `data` (grain iterator state, one file per process), `meta` (JSON: step, config, mesh).

Guarantees, from orbax: a checkpoint is written to a temporary directory and renamed into place
only once complete (and, with many processes, once every process has finished), so a crash or
kill mid-save leaves the previous checkpoints intact and the partial one is ignored. Saves are
asynchronous: arrays are copied off the devices, then written in a background thread while
training continues. `keep` bounds how many are kept. A save that fails in the background (a
full disk) is reported by the next `save`, `check` or `wait` as `SaveError`: the checkpoints
already written stay intact.

Checksums: once a save is complete, process 0 records the size and CRC-32 of every file of the
checkpoint in `<step>/checksums.json` (in a background thread; it reads the checkpoint once),
and `restore` verifies them before reading anything. A checkpoint without that file (killed
before it was written, or from an older version) is restored on orbax's own checks alone.

Damage (a file removed, truncated, bit-flipped, metadata garbled, a stray empty `<step>`
directory): `restore` raises `DamagedCheckpoint` saying what is wrong, never a traceback, and
deletes nothing; the trainer then tries the next older checkpoint (`move_aside` renames a
damaged one to `<step>.damaged` once a run goes on past it, so that orbax's bookkeeping of the
latest step and of `keep` never counts it).

Restoring onto another mesh (e.g. trained at tp=2, resumed at tp=4): the restore targets carry
concrete `NamedSharding`s of the *new* mesh (built from the model's partition specs by the
caller), and orbax reads each shard straight into place. Abstract shardings from
`nnx.eval_shape` under `jax.set_mesh` won't do: orbax needs concrete devices. Restoring with
another process count: the data iterator's files are per process; every process's position is
the number of batches taken (the global batch is fixed by the config), so the position is
carried over to the new process count ("re-sharded"): the batches are those an uninterrupted run
with the new count would have read.
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
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import nnx

from ladder_jax import config as config_lib
from ladder_jax.config import ConfigError
from ladder_jax.interop.gguf import load_gguf
from ladder_jax.interop.hf import load_hf
from ladder_jax.interop.tokenizer import make_tokenizer
from ladder_jax.model import quant
from ladder_jax.model.transformer import abstract
from ladder_jax.train.step import TrainState


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be trusted; `str(e)` says why (one line)."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the message is one line."""


CHECKSUMS = "checksums.json"


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
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited",
                            category=RuntimeWarning)


def _crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), directory)
                  for d, _, fs in os.walk(directory) for f in fs if f != CHECKSUMS)


def write_checksums(directory: str) -> None:
    """`directory/checksums.json`: {file: [size, crc32]} of every file below it."""
    sums = {f: [os.path.getsize(os.path.join(directory, f)), _crc32(os.path.join(directory, f))]
            for f in _files(directory)}
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
            raise DamagedCheckpoint(f"{name} has {have} bytes, {size} when it was written "
                                    f"(truncated or overwritten)")
        if _crc32(path) != crc:
            raise DamagedCheckpoint(f"{name} is corrupt (its CRC-32 differs from the one "
                                    f"recorded when it was written)")
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
            max_to_keep=keep, create=False, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"params": ocp.StandardCheckpointHandler(),
                           "opt_state": ocp.StandardCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})
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
            self.manager.save(state.step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(nnx.to_pure_dict(state.params)),
                opt_state=ocp.args.StandardSave(_opt_dict(state.opt_state)),
                data=grain.checkpoint.CheckpointSave(data_iter),
                meta=ocp.args.JsonSave(meta)), force=True)
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
        if (not self._unhashed or self._hasher is not None
                or self.manager.is_saving_in_progress()):
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
        good = [s for s in self.steps() if os.path.exists(
            os.path.join(self.directory, str(s), "meta", "metadata"))]
        kept = (f"the last complete checkpoint, step {good[0]}, is intact" if good else
                "no checkpoint had been written yet")
        failed = re.search(r"/(\d+)\.orbax-checkpoint-tmp", str(e))
        step = int(failed.group(1)) if failed else step  # the save that failed, if it says
        what = f"checkpoint {step}" if step is not None else "a checkpoint"
        reason = re.search(r"(No space left on device|File too large|Disk quota exceeded|"
                           r"Permission denied|Read-only file system)", str(e))
        _abandoned_writes_stay_quiet()
        return SaveError(f"could not write {what} in {self.directory} "
                         f"({reason.group(1) if reason else _first_line(e)}): "
                         f"{kept}; free disk space (or fix the directory's permissions) and "
                         f"run the same command again to resume")

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with `step` (step, config, mesh), read without restoring.
        Raises DamagedCheckpoint when it is missing or not what a save writes."""
        file = os.path.join(self.directory, str(step), "meta", "metadata")
        try:
            with open(file) as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise DamagedCheckpoint("no meta/metadata file: not a complete checkpoint") from None
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(f"meta/metadata is unreadable ({_first_line(e)})") from None
        if (not isinstance(meta, dict) or meta.get("step") != step
                or not isinstance(meta.get("config"), dict)):
            raise DamagedCheckpoint("meta/metadata is not the metadata of this checkpoint "
                                    "(no step and config)")
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
        check_shapes(os.path.join(where, "params"), state.params,
                     f"checkpoint {self.directory}/{step}")
        data_state = _data_position(os.path.join(where, "data"))
        params_target = jax.tree.map(_abstract, nnx.to_pure_dict(state.params))
        opt_target = jax.tree.map(_abstract, _opt_dict(state.opt_state))
        items = dict(params=ocp.args.StandardRestore(params_target),
                     opt_state=ocp.args.StandardRestore(opt_target),
                     meta=ocp.args.JsonRestore())
        if data_state is None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
            if data_state is not None:
                data_iter.set_state(data_state)
        except Exception as e:  # noqa: BLE001 (tensorstore, zstd, orbax, grain, json)
            raise DamagedCheckpoint(f"it does not restore: {_first_line(e)}") from None
        params = _replace(state.params, out["params"])
        treedef = jax.tree.structure(state.opt_state)
        opt_state = jax.tree.unflatten(treedef, [out["opt_state"][k]
                                                 for k in _opt_dict(state.opt_state)])
        meta = dict(out["meta"])
        if data_state is not None:
            meta["resharded"] = data_state
        return TrainState(params, opt_state, step), meta

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
    counts = {int(m.group(1)) for f in files
              if (m := re.search(r"-of-(\d+)\.json$", os.path.basename(f)))}
    if len(counts) != 1:
        raise DamagedCheckpoint(f"its data iterator file for process {me} of {count} "
                                f"(data/process_{me}-of-{count}.json) is missing")
    (n,) = counts
    states = []
    for i in range(n):
        file = os.path.join(directory, f"process_{i}-of-{n}.json")
        try:
            with open(file) as f:
                states.append(json.load(f))
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(f"data/{os.path.basename(file)} is unreadable "
                                    f"({_first_line(e)})") from None
    if any(st != states[0] for st in states) or not isinstance(states[0], dict):
        raise DamagedCheckpoint(f"its {n} data iterator files disagree on the position, so it "
                                f"cannot resume on {count} process(es): resume it on {n}")
    return states[0]


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
    if not os.path.exists(path):
        raise ConfigError(f"{what}: {path} does not exist")
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isdir(
            os.path.join(path, "checkpoints")):
        raise ConfigError(f"{what}: {path} is a Hugging Face model directory: convert it "
                          f"first (python -m ladder_jax.convert --hf {path} --out DIR), then "
                          f"give DIR")
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


def _run_root(path: str) -> str:
    """The run directory of `path`: itself, or the run holding it when `path` is a run's
    `checkpoints/` directory or one `checkpoints/<step>`."""
    p = os.path.abspath(path)
    up = os.path.dirname(p)
    if os.path.basename(p) == "checkpoints" and os.path.isfile(os.path.join(up, "config.yaml")):
        return up
    if os.path.basename(up) == "checkpoints" and os.path.isfile(
            os.path.join(os.path.dirname(up), "config.yaml")):
        return os.path.dirname(up)
    return path


def load_run(path: str, *, mesh, what: str = "--checkpoint", quantize: str | None = None,
             **overrides):
    """(model, tokenizer) from a training run or a `python -m ladder_jax.convert` output (a
    directory with config.yaml and checkpoints/), a Hugging Face Llama directory
    (config.json, see `ladder_jax.interop.hf.load_hf`) or a GGUF file (`.gguf`, see
    `ladder_jax.interop.gguf.load_gguf`). The model is built from shapes and its weights
    restored straight into their shardings on `mesh`; no random weights are made. `overrides`
    change the model config, e.g. residual="ladder", ladder_layers=2 (any scheme reads any
    weights). `quantize="int8"` quantizes float weights once loaded (`ladder_jax.model.quant`);
    a checkpoint stored quantized (`convert --quantize`) loads as it is, with or without it."""

    config_lib.check_quantize(quantize)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{what} {path!r} does not exist: give a training run directory "
                          f"(runs/NAME), the output of ladder_jax.convert, a Hugging Face "
                          f"model directory or a .gguf file")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf(path, mesh=mesh, quantize=quantize, **overrides)
    cfg_file = os.path.join(_run_root(path), "config.yaml")
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
