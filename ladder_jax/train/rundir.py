"""A training run's directory, `<run_dir>/<name>/`: its lock, resume-or-init, and its files
(config.yaml, changes.jsonl, metrics.jsonl, tensorboard/, checkpoints/); process 0 alone writes.

    run = RunDir(cfg, log=print); with run.lock(): start, state, damaged, changes = ..."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from omegaconf import OmegaConf

from ladder_jax.config import ConfigError
from ladder_jax.loading import DamagedCheckpoint, load_params
from ladder_jax.train.checkpoint import SaveError
from ladder_jax.train.lock import RunBusy, RunLock
from ladder_jax.train_config import TrainConfig, to_yaml

# Keys whose change makes a resumed run a different experiment.
RESUME_KEYS = (
    "seed",
    "model",
    "optim",
    "data.path",
    "data.tokenizer",
    "data.seq_len",
    "data.batch_size",
    "data.grad_accum",
    "data.eval_fraction",
    "data.seed",
)


def changed_keys(old: dict, new: dict) -> dict:
    """{dotted key: (old value, new value)} over `RESUME_KEYS`, from two config dicts."""

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[prefix + k] = v
        return out

    a, b = flat(old), flat(new)
    keys = [
        k
        for k in sorted(set(a) | set(b))
        if any(k == r or k.startswith(r + ".") for r in RESUME_KEYS)
    ]
    return {k: (a.get(k), b.get(k)) for k in keys if not _same(k, a.get(k), b.get(k))}


def _same(key: str, a, b) -> bool:
    """Equal values; for data.tokenizer, two spellings of one file (relative ones against the
    working directory): a run resumed from its own config.yaml reads the path stored there."""
    if a == b:
        return True
    files = key == "data.tokenizer" and isinstance(a, str) and isinstance(b, str)
    return files and "byte" not in (a, b) and os.path.realpath(a) == os.path.realpath(b)


def stored_tokenizer(name: str, run_path: str) -> str:
    """`data.tokenizer` as a run's config.yaml stores it, so the run loads from anywhere after
    `mv`: relative to the run directory when the file lies inside it, else absolute (`byte`
    as it is). Reading resolves it against the file's directory first
    (`ladder_jax.config.load_config`).

        stored_tokenizer("tok/tokenizer.json", "runs/tiny")  # '/home/me/tok/tokenizer.json'"""
    if name == "byte" or "${" in name:
        return name
    path, run = os.path.abspath(name), os.path.abspath(run_path)
    return os.path.relpath(path, run) if os.path.commonpath([path, run]) == run else path


def config_dict(cfg: TrainConfig) -> dict:
    """`cfg` as plain dicts (what checkpoints record and resume compares)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def read_metrics(path: str, upto: int, log) -> list[dict]:
    """The rows of metrics.jsonl up to step `upto`. A torn last line (a write cut short by a
    crash) is dropped with a note; damage elsewhere is an error naming the line."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a metrics row")
        except ValueError:
            if i == len(lines) - 1:
                log(f"{path}: dropped a torn last line (a write cut short)")
                continue
            raise ConfigError(
                f"{path}, line {i + 1}: not a metrics row; fix or delete that line to resume"
            ) from None
        if row["step"] <= upto:
            rows.append(row)
    return rows


class MetricsLog:
    """metrics.jsonl, and the same scalars as TensorBoard events (`tensorboard=true`, or null
    with the `tensorboardX` package installed: `pip install -e ".[tensorboard]"`). Process 0
    alone writes. On resume, rows after the checkpoint are dropped from both (they are
    replayed)."""

    SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "eval_loss", "eval_ppl")

    def __init__(self, run_path: str, start: int, history: list[dict], *, tensorboard, active):
        self.path = os.path.join(run_path, "metrics.jsonl")
        self.active, self.events = active, None
        if not active:
            return
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in history)
        if tensorboard is None:
            tensorboard = importlib.util.find_spec("tensorboardX") is not None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "tensorboard=true needs the tensorboardX package: "
                    'pip install -e ".[tensorboard]"'
                ) from None
            self.events = SummaryWriter(os.path.join(run_path, "tensorboard"), purge_step=start + 1)

    def write(self, rec: dict) -> None:
        if not self.active:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            raise SaveError(
                f"could not write {self.path} ({e.strerror}): free disk space and "
                f"run the same command again to resume from the last "
                f"checkpoint"
            ) from None
        if self.events is not None:
            for k in self.SCALARS:
                if rec.get(k) is not None:
                    self.events.add_scalar(f"train/{k}", rec[k], rec["step"])
            self.events.add_scalar("train/skipped", float(rec.get("skipped", False)), rec["step"])

    def close(self) -> None:
        if self.events is not None:
            self.events.close()


class RunDir:
    """The directory of the run `cfg` names; `log` prints on process 0."""

    def __init__(self, cfg: TrainConfig, log):
        self.cfg, self.log = cfg, log
        self.path = os.path.join(cfg.run_dir, cfg.name)
        self.is_main = jax.process_index() == 0

    @contextlib.contextmanager
    def lock(self):
        """Holds `<run>/.lock` (process 0; the others learn whether it was granted)."""
        lock, refused = RunLock(self.path), None
        if self.is_main:
            try:
                lock.acquire()
            except RunBusy as e:
                refused = str(e)
        if jax.process_count() > 1:
            if multihost_utils.process_allgather(np.int32(refused is not None)).max() and (
                refused is None
            ):
                refused = f"{self.path}: process 0 could not lock it (see its output)"
        if refused:
            raise RunBusy(refused)
        if lock.stale:
            h = lock.stale
            self.log(
                f"{lock.file}: taking over the lock of pid {h.get('pid')} on host "
                f"{h.get('host')} (it is not running any more)"
            )
        try:
            yield
        finally:
            lock.release()

    def resume_or_init(self, ckpt, state, data_iter):
        """(step to start from, state, damaged checkpoints skipped [(step, why)], changed
        keys). Restores the newest checkpoint that verifies (after checking that the config
        still describes the same experiment; `data_iter` is restored in place) or loads
        `init_from` into `state`. Writes nothing."""
        damaged, mine = [], config_dict(self.cfg)
        for s in ckpt.steps():
            try:
                saved = ckpt.meta(s)["config"]
            except DamagedCheckpoint as e:
                damaged.append((s, str(e)))
                continue
            changes = changed_keys(saved, mine)
            if changes and not self.cfg.accept_changes:
                self._refuse_changes(s, changes)
            try:
                state, meta = ckpt.restore(s, state, data_iter)
            except DamagedCheckpoint as e:
                damaged.append((s, str(e)))
                continue
            for d, why in damaged:
                self.log(f"skipped damaged checkpoint {ckpt.directory}/{d}: {why}")
            self.log(f"resumed from {ckpt.directory}/{s} (trained on mesh {meta.get('mesh')})")
            if "resharded" in meta:
                self.log(
                    f"data iterator re-sharded onto {jax.process_count()} process(es) at "
                    f"its saved position {meta['resharded']}"
                )
            return s, state, damaged, changes
        if damaged:
            listed = "; ".join(f"{d}: {why}" for d, why in damaged[:3])
            more = f"; and {len(damaged) - 3} more" if len(damaged) > 3 else ""
            raise ConfigError(
                f"no checkpoint in {ckpt.directory} can be restored ({listed}{more}); nothing "
                f"was changed: move the damaged ones out of the way to start this run afresh, "
                f"or train under a new name="
            )
        if self.cfg.init_from:
            state = state.replace(params=load_params(self.cfg.init_from, state.params))
            self.log(f"initialized weights from {self.cfg.init_from}")
        return 0, state, damaged, {}

    def _refuse_changes(self, step: int, changes: dict):
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:4])
        more = f" and {len(changes) - 4} more" if len(changes) > 4 else ""
        raise ConfigError(
            f"{self.path} was trained to step {step} with another config ({listed}{more}): "
            f"resuming would mix two experiments. Use a new name= for a new run, "
            f"init_from={self.path} to start from its weights, or accept_changes=true to "
            f"resume anyway"
        )

    def set_aside(self, ckpt, damaged: list[tuple[int, str]]) -> None:
        """Moves the damaged checkpoints out of orbax's sight (latest step, `keep`), never
        deleting them."""
        if not damaged:
            return
        if self.is_main:
            for s, why in damaged:
                self.log(f"checkpoint {s} kept as {ckpt.move_aside(s)} ({why})")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("damaged checkpoints moved")
            ckpt.manager.reload()

    def history(self, upto: int) -> list[dict]:
        """metrics.jsonl's rows up to step `upto` (`read_metrics`)."""
        return read_metrics(os.path.join(self.path, "metrics.jsonl"), upto, self.log)

    def open_files(self, start: int, changes: dict) -> tuple[list[dict], MetricsLog]:
        """Writes config.yaml (the tokenizer path `stored_tokenizer`'s), appends `changes` to
        changes.jsonl, opens the metrics log. Returns (metrics rows kept from before `start`,
        the log)."""
        history = self.history(start)
        if self.is_main:
            os.makedirs(self.path, exist_ok=True)
            d = self.cfg.data
            movable = dataclasses.replace(
                self.cfg,
                data=dataclasses.replace(d, tokenizer=stored_tokenizer(d.tokenizer, self.path)),
            )
            with open(os.path.join(self.path, "config.yaml"), "w") as f:
                f.write(to_yaml(movable))
            if changes:
                with open(os.path.join(self.path, "changes.jsonl"), "a") as f:
                    f.write(json.dumps({"step": start, "changed": changes}) + "\n")
                self.log(
                    "accept_changes: "
                    + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
                )
        metrics = MetricsLog(
            self.path, start, history, tensorboard=self.cfg.tensorboard, active=self.is_main
        )
        return history, metrics

    def mark_unsound(self, ckpt, last_good: int) -> str:
        """After non-finite steps from `last_good + 1` on: marks unsound every checkpoint
        holding the weights that gave them (step `last_good` and later: a skipped step leaves
        the weights as they were), so that resume passes them over; says which checkpoint a
        resume would start from."""
        ckpt.wait()
        why = (
            f"its weights gave non-finite losses from step {last_good + 1} on (the run "
            f"stopped with exit 3)"
        )
        marked = [c for c in ckpt.steps() if c >= last_good]
        for c in marked:
            ckpt.mark_unsound(c, why)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("unsound checkpoints marked")
        before = [c for c in ckpt.steps() if c < last_good]
        said = (
            f"checkpoint(s) {', '.join(map(str, sorted(marked)))} marked unsound "
            f"(resume skips them); "
            if marked
            else ""
        )
        return said + (
            f"a resume starts from checkpoint {before[0]}, the last before the weights went bad"
            if before
            else "none was saved before the weights went bad: start again under a new name="
        )
