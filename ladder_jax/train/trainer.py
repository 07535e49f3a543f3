"""Train a Ladder Transformer: `python -m ladder_jax.train [config.yaml ...] [key=value ...]`.

    python -m ladder_jax.train configs/tiny.yaml model.residual=ladder name=tiny-ladder

config -> mesh -> model -> step -> `runs/<name>/` (config.yaml, metrics.jsonl, checkpoints/).
Invariants: a resumed run's losses equal an uninterrupted run's, bit for bit; one writer per run
directory (`ladder_jax.train.lock`); bad input is one line and exit 2 before anything is
written; a non-finite step is skipped (after `max_bad_steps` in a row: exit 3, the checkpoints
holding those weights marked unsound); a signal saves and exits 0. The loop fetches the loss
every step, so it never queues work ahead (XLA:CPU's fake devices deadlock otherwise). The
schema is `ladder_jax.config`, the step `ladder_jax.train.step`, checkpoints
`ladder_jax.train.checkpoint`. Resume, faults, exit codes, many hosts: docs/training.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import signal
import sys
import tempfile
import time
import zlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from omegaconf import OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ladder_jax import hardware, runtime
from ladder_jax.config import (  # noqa: F401  (load_config, model_config: the train API)
    RESIDUALS,
    ConfigError,
    TrainConfig,
    check,
    load_config,
    model_config,
    to_yaml,
)
from ladder_jax.interop.tokenizer import make_tokenizer
from ladder_jax.model import sharding
from ladder_jax.model.transformer import Transformer
from ladder_jax.train import data, distill, step
from ladder_jax.train.checkpoint import (
    Checkpointer,
    DamagedCheckpoint,
    SaveError,
    load_params,
    params_finite,
)
from ladder_jax.train.lock import RunBusy, RunLock
from ladder_jax.train.step import TrainState

__all__ = ["NonFiniteError", "SaveError", "Trainer", "benchmark", "run"]


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row. The CLI exits 3."""


def flops_per_token(c, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul params) + causal attention (PaLM's estimate)."""
    matmul_params = c.num_params() - c.vocab_size * c.d_model * (0 if c.tie_embeddings else 1)
    return 6 * matmul_params + 6 * c.n_layers * c.n_heads * c.head_dim * seq_len


def peak_flops(cfg: TrainConfig, device) -> float | None:
    """Dense bf16 FLOP/s of one device (`peak_tflops`, else the hardware table), for MFU."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    chip = hardware.chip_of(device)
    return chip.bf16_flops if chip else None


def cpu_data_parallel(cfg: TrainConfig) -> int:
    """`mesh.data` when it is null on a CPU host: the cores this process may run on over
    `mesh.tp`, lowered to the largest count that divides `data.batch_size` (at least 1)."""
    n = max(1, runtime.cpu_cores() // max(1, cfg.mesh.tp))
    while cfg.data.batch_size % n:
        n -= 1
    return n


def init_runtime(cfg: TrainConfig) -> None:
    """`ladder_jax.runtime.setup` for this config: on a CPU host, as many fake devices as the
    mesh needs (or `mesh.cpu_devices`); `mesh.data: null` there is `cpu_data_parallel`."""
    d = cfg.dist
    nproc = d.num_processes or int(os.environ.get("JAX_NUM_PROCESSES") or 1)
    one_cpu_process = (runtime.cpu_only() and nproc == 1
                       and int(os.environ.get("SLURM_NTASKS", "1")) == 1)
    data = cfg.mesh.data or (cpu_data_parallel(cfg) if one_cpu_process else 1)
    want = cfg.mesh.tp * data
    runtime.setup(cpu_devices=cfg.mesh.cpu_devices or max(1, -(-want // nproc)),
                  coordinator=d.coordinator_address, num_processes=d.num_processes,
                  process_id=d.process_id)


# Keys whose change makes a resumed run a different experiment (see the module docstring).
_RESUME_KEYS = ("seed", "model", "optim", "data.path", "data.tokenizer", "data.seq_len",
                "data.batch_size", "data.grad_accum", "data.eval_fraction", "data.seed")


def changed_keys(old: dict, new: dict) -> dict:
    """{dotted key: (old value, new value)} over `_RESUME_KEYS`, from two config dicts."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[prefix + k] = v
        return out
    a, b = flat(old), flat(new)
    keys = [k for k in sorted(set(a) | set(b))
            if any(k == r or k.startswith(r + ".") for r in _RESUME_KEYS)]
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


def check_writable(path: str, what: str) -> None:
    """A one-line ConfigError (naming `what`, e.g. "run_dir='runs'") unless files can be
    created in `path` (or, where it does not exist yet, in its nearest existing parent): said
    before data is loaded or anything is compiled. Probes with a temporary file (removed at
    once), which catches read-only mounts and permissions, the superuser's included."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise ConfigError(f"{what}: {p} is a file, not a directory: give a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=p, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write in {p} ({e.strerror}): give a writable "
                          f"directory or fix its permissions") from None


def check_host_memory(config, mesh, fsdp: bool) -> None:
    """CPU backends: a one-line estimate before allocating. Weights, gradients and Adam's two
    moments (4 copies of the parameters, a lower bound) on this process's devices."""
    me = jax.process_index()
    local = sum(1 for d in mesh.devices.flat if d.process_index == me)
    shards = mesh.shape["tp"] * (mesh.shape["data"] if fsdp else 1)
    n = config.num_params()
    need = 4 * n * np.dtype(config.param_dtype).itemsize * local // shards
    runtime.check_host_memory(
        need, f"training the model ({n / 1e9:.2f}B parameters: weights, gradients and optimizer "
              f"state on {local} CPU device(s))",
        "use a smaller model (model.vocab_size, model.d_model, model.n_layers, ...) or a GPU")


class Trainer:
    """Everything one run needs, built from the config in the order data flows."""

    def __init__(self, cfg: TrainConfig, *, devices=None):
        self.cfg = cfg
        runtime.agree({k: v for k, v in self._config_dict().items() if k != "dist"},
                      "training config")  # many processes: all alike, or exit 2
        self.model_config = check(cfg)
        check_writable(self.run_path, f"run_dir={cfg.run_dir!r}")
        self.tokenizer = make_tokenizer(cfg.data.tokenizer)
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but "
                              f"model vocab_size={self.model_config.vocab_size}")
        self.mesh = self._mesh(devices)
        self.is_main = jax.process_index() == 0
        check_host_memory(self.model_config, self.mesh, cfg.mesh.fsdp)
        self._load_data()
        self.lr_schedule = step.lr_schedule(cfg.optim, total_steps=cfg.steps)
        self.optimizer = step.make_optimizer(cfg.optim, total_steps=cfg.steps)
        self.graphdef, self.state = self.init_state(self.model_config)
        self.teacher = distill.load_teacher(cfg.distill.teacher, self.mesh, self.model_config) \
            if cfg.distill.teacher else None  # (graphdef, params), frozen
        self.batch_sharding = NamedSharding(self.mesh, P(None, sharding.DATA, None))
        self.eval_sharding = NamedSharding(self.mesh, P(sharding.DATA, None))
        self._steps = {}
        self._bar = None

    def _mesh(self, devices):
        cfg = self.cfg
        if devices is None:
            devices = jax.devices()
            if jax.process_count() == 1:
                data = cfg.mesh.data
                if data is None and jax.default_backend() == "cpu":
                    data = min(cpu_data_parallel(cfg), max(1, len(devices) // cfg.mesh.tp))
                want = cfg.mesh.tp * (data or len(devices) // cfg.mesh.tp)
                devices = devices[:want] if 0 < want <= len(devices) else devices
        mesh = sharding.make_mesh(tp=cfg.mesh.tp, data=cfg.mesh.data, devices=devices)
        sharding.check_divisible(self.model_config, cfg.mesh.tp, flag="mesh.tp")
        sharding.WeightSpecs.for_model(self.model_config, mesh)
        sharding.check_batch(cfg.data.batch_size, mesh)
        return mesh

    def _load_data(self):
        cfg, mesh = self.cfg, self.mesh
        # Which rows of the global batch this process feeds: the data-axis rows of its devices.
        me = jax.process_index()
        rows = sorted({i for i, row in enumerate(mesh.devices) for dv in row
                       if dv.process_index == me})
        per_proc = len(rows)
        shard = (rows[0] // per_proc, mesh.shape[sharding.DATA] // per_proc)
        self.local_batch = cfg.data.batch_size // shard[1]
        tokens = data.load_tokens(cfg.data.path, self.tokenizer, self.model_config.vocab_size)
        train_records, eval_records = data.split(tokens, cfg.data.seq_len,
                                                 cfg.data.eval_fraction)
        self.data_iter = data.train_iterator(
            train_records, batch=self.local_batch * cfg.data.grad_accum, seed=cfg.data.seed,
            shard=shard)
        self.eval_data = data.eval_batches(
            eval_records, batch=self.local_batch, max_batches=cfg.eval_batches,
            shard=shard) if len(eval_records) else []

    # -- state and the compiled step ---------------------------------------------------------

    def init_state(self, config) -> tuple[nnx.GraphDef, TrainState]:
        """(graphdef, TrainState at step 0) of a freshly initialized `config` on this mesh."""
        model = Transformer(config, mesh=self.mesh, rngs=nnx.Rngs(self.cfg.seed),
                            fsdp=self.cfg.mesh.fsdp)  # weights created where they are stored
        graphdef, params = nnx.split(model)
        opt_state = jax.jit(self.optimizer.init)(params)
        opt_state = jax.device_put(
            opt_state, step.opt_state_shardings(self.optimizer, opt_state, params, self.mesh))
        return graphdef, TrainState(params, opt_state, 0)

    def compiled_step(self, graphdef, state: TrainState):
        """(train_step, eval_loss) for the model graph `graphdef` and arrays stored like
        `state`'s, jitted once per graph."""
        key = id(graphdef)
        if key in self._steps:
            return self._steps[key]
        kw = dict(optimizer=self.optimizer, grad_clip=self.cfg.optim.grad_clip,
                  param_shardings=[x.sharding for x in jax.tree.leaves(state.params)],
                  opt_shardings=[x.sharding for x in jax.tree.leaves(state.opt_state)])
        if self.teacher is None:
            train = sharding.jit(step.make_train_step(graphdef, loss_chunk=self.cfg.loss_chunk,
                                                      **kw), mesh=self.mesh,
                                 program="train", donate_argnums=(0, 1))
        else:  # the teacher's params are the first argument, bound here
            d = self.cfg.distill
            fn = distill.make_train_step(graphdef, self.teacher[0], weight=d.weight,
                                         temperature=d.temperature, **kw)
            train = functools.partial(sharding.jit(fn, mesh=self.mesh, program="train",
                                                   donate_argnums=(1, 2)), self.teacher[1])

        def eval_loss(params, batch_bt):
            return step.loss_fn(graphdef, params, batch_bt[:, :-1], batch_bt[:, 1:],
                                loss_chunk=self.cfg.loss_chunk)

        fns = (train, sharding.jit(eval_loss, mesh=self.mesh))
        self._steps[key] = fns
        return fns

    def check_memory(self, train_step):
        """On a known GPU, before the first step (and before the run directory is touched):
        compile `train_step` for this run's arrays and refuse (ConfigError naming the fix) a
        program that will not fit in the device's memory (`step.check_memory`, the check
        `python -m ladder_jax.overlap --config` makes deviceless). Returns the step to call
        (on GPUs the compiled one, so nothing compiles twice)."""
        device = self.mesh.devices.flat[0]
        chip = hardware.chip_of(device)
        if jax.default_backend() != "gpu" or chip is None or self.teacher is not None:
            return train_step
        cfg = self.cfg
        batch = jax.ShapeDtypeStruct(
            (cfg.data.grad_accum, cfg.data.batch_size, cfg.data.seq_len + 1), np.int32,
            sharding=self.batch_sharding)
        compiled = train_step.lower(self.state.params, self.state.opt_state, batch).compile()
        stats = (device.memory_stats() or {}) if hasattr(device, "memory_stats") else {}
        capacity = int(stats.get("bytes_limit") or chip.memory_bytes)
        use = step.memory_use(compiled)
        try:
            step.check_memory(use, capacity, cfg, where=f"per device ({chip.name})")
        except ConfigError as e:
            if use["peak"] <= 0.95 * chip.memory_bytes:  # jax's allocator holds less
                raise ConfigError(f"{e}; or let jax's allocator take more of the device: "
                                  f"XLA_PYTHON_CLIENT_MEM_FRACTION=0.95") from None
            raise
        return compiled

    def global_batch(self, local):
        A, T1 = self.cfg.data.grad_accum, self.cfg.data.seq_len + 1
        local = local.reshape(A, self.local_batch, T1)
        return jax.make_array_from_process_local_data(
            self.batch_sharding, local, (A, self.cfg.data.batch_size, T1))

    def evaluate(self) -> float | None:
        if not self.eval_data:
            return None
        _, eval_loss = self.compiled_step(self.graphdef, self.state)
        losses = []
        for b in self.eval_data:
            g = jax.make_array_from_process_local_data(
                self.eval_sharding, b, (self.cfg.data.batch_size, b.shape[1]))
            losses.append(float(np.asarray(
                eval_loss(self.state.params, g).addressable_data(0))))
        return float(np.mean(losses))

    # -- the run -----------------------------------------------------------------------------

    @property
    def run_path(self):
        return os.path.join(self.cfg.run_dir, self.cfg.name)

    def log(self, msg: str):
        if self.is_main:
            if self._bar is not None:
                self._bar.console.print(msg)
            else:
                print(msg, flush=True)

    def train(self) -> dict:
        """Lock the run directory, resume or initialize, then step, evaluate, log and
        checkpoint until `steps`."""
        cfg = self.cfg
        with self._run_lock():
            train_step, eval_loss = self.compiled_step(self.graphdef, self.state)
            self._steps[id(self.graphdef)] = (self.check_memory(train_step), eval_loss)
            ckpt = Checkpointer(os.path.join(self.run_path, "checkpoints"), keep=cfg.keep,
                                async_save=cfg.async_ckpt)
            try:
                start, damaged = self._resume_or_init(ckpt)
                if start >= cfg.steps:  # reads only: writes nothing, not even config.yaml
                    return self._nothing_to_do(start)
                if damaged:  # out of orbax's sight (latest step, `keep`), never deleted
                    if self.is_main:
                        for s, why in damaged:
                            self.log(f"checkpoint {s} kept as {ckpt.move_aside(s)} ({why})")
                    if jax.process_count() > 1:
                        multihost_utils.sync_global_devices("damaged checkpoints moved")
                        ckpt.manager.reload()
                history, metrics = self._open_files(start)
                try:
                    return self._loop(ckpt, start, history, metrics)
                finally:
                    metrics.close()
            finally:
                ckpt.close()

    @contextlib.contextmanager
    def _run_lock(self):
        """Holds `<run>/.lock` (process 0; the others learn whether it was granted)."""
        lock, refused = RunLock(self.run_path), None
        if self.is_main:
            try:
                lock.acquire()
            except RunBusy as e:
                refused = str(e)
        if jax.process_count() > 1:
            if multihost_utils.process_allgather(np.int32(refused is not None)).max() and (
                    refused is None):
                refused = f"{self.run_path}: process 0 could not lock it (see its output)"
        if refused:
            raise RunBusy(refused)
        if lock.stale:
            h = lock.stale
            self.log(f"{lock.file}: taking over the lock of pid {h.get('pid')} on host "
                     f"{h.get('host')} (it is not running any more)")
        try:
            yield
        finally:
            lock.release()

    def _config_dict(self) -> dict:
        return OmegaConf.to_container(OmegaConf.structured(self.cfg))

    def _resume_or_init(self, ckpt) -> tuple[int, list[tuple[int, str]]]:
        """(the step to start from, the damaged checkpoints skipped: [(step, why)]). Restores
        the newest checkpoint that verifies (after checking that the config still describes
        the same experiment) or loads `init_from`. Writes nothing."""
        damaged = []
        for s in ckpt.steps():
            try:
                saved = ckpt.meta(s)["config"]
            except DamagedCheckpoint as e:
                damaged.append((s, str(e)))
                continue
            changes = changed_keys(saved, self._config_dict())
            if changes and not self.cfg.accept_changes:
                listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in
                                   list(changes.items())[:4])
                more = f" and {len(changes) - 4} more" if len(changes) > 4 else ""
                raise ConfigError(
                    f"{self.run_path} was trained to step {s} with another config "
                    f"({listed}{more}): resuming would mix two experiments. Use a new name= for "
                    f"a new run, init_from={self.run_path} to start from its weights, or "
                    f"accept_changes=true to resume anyway")
            try:
                self.state, meta = ckpt.restore(s, self.state, self.data_iter)
            except DamagedCheckpoint as e:
                damaged.append((s, str(e)))
                continue
            for d, why in damaged:
                self.log(f"skipped damaged checkpoint {ckpt.directory}/{d}: {why}")
            self._changes = changes
            self.log(f"resumed from {ckpt.directory}/{s} (trained on mesh "
                     f"{meta.get('mesh')})")
            if "resharded" in meta:
                self.log(f"data iterator re-sharded onto {jax.process_count()} process(es) at "
                         f"its saved position {meta['resharded']}")
            return s, damaged
        if damaged:
            listed = "; ".join(f"{d}: {why}" for d, why in damaged[:3])
            more = f"; and {len(damaged) - 3} more" if len(damaged) > 3 else ""
            raise ConfigError(
                f"no checkpoint in {ckpt.directory} can be restored ({listed}{more}); nothing "
                f"was changed: move the damaged ones out of the way to start this run afresh, "
                f"or train under a new name=")
        if self.cfg.init_from:
            self.state = dataclasses.replace(
                self.state, params=load_params(self.cfg.init_from, self.state.params))
            self.log(f"initialized weights from {self.cfg.init_from}")
        return 0, damaged

    def _nothing_to_do(self, start: int) -> dict:
        self.log(f"already trained to step {start} (steps={self.cfg.steps}); nothing to do")
        path = os.path.join(self.run_path, "metrics.jsonl")
        history = _read_metrics(path, start, self.log)
        return {"exit": "done", "losses": {r["step"]: r["loss"] for r in history if "loss" in r},
                "step": start, "skipped": 0, "eval_loss": self.evaluate()}

    def _open_files(self, start):
        """config.yaml, changes.jsonl and the metrics log (`MetricsLog`). Returns (metrics
        rows kept from before `start`, the log)."""
        history = _read_metrics(os.path.join(self.run_path, "metrics.jsonl"), start, self.log)
        if self.is_main:
            os.makedirs(self.run_path, exist_ok=True)
            with open(os.path.join(self.run_path, "config.yaml"), "w") as f:
                f.write(to_yaml(self.cfg))
            if getattr(self, "_changes", None):
                with open(os.path.join(self.run_path, "changes.jsonl"), "a") as f:
                    f.write(json.dumps({"step": start, "changed": self._changes}) + "\n")
                self.log("accept_changes: " + ", ".join(
                    f"{k}: {a!r} -> {b!r}" for k, (a, b) in self._changes.items()))
        metrics = MetricsLog(self.run_path, start, history, tensorboard=self.cfg.tensorboard,
                             active=self.is_main)
        return history, metrics

    def _loop(self, ckpt, start, history, metrics) -> dict:
        cfg, c = self.cfg, self.model_config
        tokens_per_step = cfg.data.grad_accum * cfg.data.batch_size * cfg.data.seq_len
        fpt = flops_per_token(c, cfg.data.seq_len)
        peak = peak_flops(cfg, self.mesh.devices.flat[0])
        n_dev = self.mesh.devices.size
        self.log(f"{self.describe()}; steps {start}->{cfg.steps}, {tokens_per_step} tokens/step"
                 f"; run dir {self.run_path}")
        train_step, _ = self.compiled_step(self.graphdef, self.state)
        meta = lambda s: {"step": s, "config": self._config_dict(),  # noqa: E731
                          "mesh": dict(self.mesh.shape), "processes": jax.process_count()}
        bad_in_row = skipped = 0
        result = {"exit": "done", "losses": {r["step"]: r["loss"] for r in history if "loss" in r}}
        t_last, s, rec = time.perf_counter(), start, {}
        t_begin = t_last
        with _stop_signals() as stop, self._progress(start):
            for s in range(start + 1, cfg.steps + 1):
                local = next(self.data_iter)
                batch = self.global_batch(local)
                lr = float(self.lr_schedule(s - 1 - skipped))
                params, opt_state, m = train_step(self.state.params, self.state.opt_state, batch)
                self.state = TrainState(params, opt_state, s)
                m = {k: float(np.asarray(v.addressable_data(0))) for k, v in m.items()}
                now = time.perf_counter()
                dt, t_last = now - t_last, now
                rec = {"step": s, "loss": m["loss"], "grad_norm": m["grad_norm"], "lr": lr,
                       "tokens_per_s": tokens_per_step / dt,
                       "mfu": (fpt * tokens_per_step / dt / (peak * n_dev)) if peak else None,
                       "batch_crc": zlib.crc32(local.tobytes()),  # process 0's data, for tests
                       "time": round(time.time(), 3)}  # wall clock, Unix seconds
                if m["skipped"]:
                    skipped += 1
                    bad_in_row += 1
                    rec["skipped"] = True
                    self.log(f"step {s}: non-finite loss {m['loss']} / grad norm "
                             f"{m['grad_norm']}: update skipped ({bad_in_row} in a row, "
                             f"{skipped} in all)")
                    if bad_in_row >= cfg.max_bad_steps:
                        metrics.write(rec)
                        raise NonFiniteError(
                            f"stopping at step {s}: {bad_in_row} non-finite steps in a row "
                            f"(max_bad_steps={cfg.max_bad_steps}); "
                            f"{self._mark_unsound(ckpt, s - bad_in_row)}. Lower "
                            f"optim.peak_lr or check the data.")
                else:
                    bad_in_row = 0
                    result["losses"][s] = m["loss"]
                if s == cfg.steps or (cfg.eval_every and s % cfg.eval_every == 0):
                    rec["eval_loss"] = self.evaluate()
                if rec.get("eval_loss") is not None:
                    rec["eval_ppl"] = _perplexity(rec["eval_loss"])
                metrics.write(rec)
                self._report(rec, start)
                ckpt.check()  # a background save that failed stops the run here
                if self._stop_requested(stop):
                    self._save(ckpt, meta(s))
                    ckpt.wait()
                    self.log(f"{stop['signal'] or 'stop'}: checkpoint saved at step {s}; run "
                             f"the same command again to resume")
                    result["exit"] = "interrupted"
                    break
                # none in a run of non-finite steps: its weights are the last finite step's,
                # saved or not, and would push good checkpoints out of `keep`
                if s == cfg.steps or (not bad_in_row and cfg.ckpt_every
                                      and s % cfg.ckpt_every == 0):
                    self._save(ckpt, meta(s))
            ckpt.wait()  # the last save, before saying "done"
        result["step"] = s
        result["skipped"] = skipped
        done = result["exit"] == "done"
        result["eval_loss"] = rec.get("eval_loss") if done else None
        peak = runtime.peak_memory([d for d in self.mesh.devices.flat
                                    if d.process_index == jax.process_index()])
        result["peak_rss"], result["peak_device"] = peak["host"], peak["device"]
        if done and start < cfg.steps and result["eval_loss"] is not None:
            self.log(f"done: step {s} in {_duration(time.perf_counter() - t_begin)}, held-out "
                     f"loss {result['eval_loss']:.4f} (perplexity "
                     f"{_perplexity(result['eval_loss']):.2f}); {_peak_text(peak)}; metrics "
                     f"{metrics.path}")
        return result

    def _save(self, ckpt, meta: dict) -> None:
        """Saves the state as checkpoint `meta["step"]`, only if its weights are finite
        (NonFiniteError otherwise: a checkpoint is always one a run can resume from)."""
        s = meta["step"]
        if not params_finite(self.state.params):
            raise NonFiniteError(
                f"stopping at step {s}: the weights are NaN or infinite after its update, so "
                f"they were not saved; {self._mark_unsound(ckpt, s)}. Lower optim.peak_lr or "
                f"check the data.")
        ckpt.save(self.state, self.data_iter, meta)

    def _mark_unsound(self, ckpt, last_good: int) -> str:
        """After non-finite steps from `last_good + 1` on: marks unsound every checkpoint
        holding the weights that gave them (step `last_good` and later: a skipped step leaves
        the weights as they were), so that resume passes them over; says which checkpoint a
        resume would start from."""
        ckpt.wait()
        why = (f"its weights gave non-finite losses from step {last_good + 1} on (the run "
               f"stopped with exit 3)")
        marked = [c for c in ckpt.steps() if c >= last_good]
        for c in marked:
            ckpt.mark_unsound(c, why)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("unsound checkpoints marked")
        before = [c for c in ckpt.steps() if c < last_good]
        said = (f"checkpoint(s) {', '.join(map(str, sorted(marked)))} marked unsound "
                f"(resume skips them); " if marked else "")
        return said + (f"a resume starts from checkpoint {before[0]}, the last before the "
                       f"weights went bad" if before else "none was saved before the weights "
                       "went bad: start again under a new name=")

    def _stop_requested(self, stop) -> bool:
        flag = stop["signal"] is not None
        if jax.process_count() == 1:
            return flag
        return bool(multihost_utils.process_allgather(int(flag)).max())

    def describe(self) -> str:
        c = self.model_config
        return (f"{c.residual} {c.n_layers}L d={c.d_model} ({c.num_params() / 1e6:.2f}M params,"
                f" {c.dtype} compute, {c.param_dtype} params) on {jax.process_count()} "
                f"process(es), mesh data={self.mesh.shape['data']} x tp={self.mesh.shape['tp']}"
                f"{' fsdp' if self.cfg.mesh.fsdp else ''} ({jax.default_backend()})")

    @contextlib.contextmanager
    def _progress(self, start):
        """A rich progress bar on a terminal (process 0), plain lines otherwise."""
        mode = self.cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self._mode = mode
        if mode != "bar" or not self.is_main:
            yield
            return
        self._bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                             TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self._task = self._bar.add_task("train", total=self.cfg.steps, completed=start, info="")
        self._bar.start()
        try:
            yield
        finally:
            self._bar.stop()
            self._bar = None

    def _report(self, rec, start):
        if not self.is_main or self._mode == "none":
            return
        info = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s"
        if rec.get("eval_loss") is not None:
            info += f"  held-out {rec['eval_loss']:.4f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=rec["step"], info=info)
            if "eval_loss" in rec:
                self._bar.console.print(f"step {rec['step']}: {info}")
        elif (rec["step"] % self.cfg.log_every == 0 or "eval_loss" in rec
              or rec["step"] == start + 1):
            lr, mfu = rec["lr"], rec["mfu"]
            print(f"step {rec['step']}/{self.cfg.steps}  {info}  lr {lr:.2e}  grad "
                  f"{rec['grad_norm']:.3f}" + (f"  mfu {mfu:.1%}" if mfu else ""), flush=True)


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
                raise ConfigError('tensorboard=true needs the tensorboardX package: '
                                  'pip install -e ".[tensorboard]"') from None
            self.events = SummaryWriter(os.path.join(run_path, "tensorboard"),
                                        purge_step=start + 1)

    def write(self, rec: dict) -> None:
        if not self.active:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            raise SaveError(f"could not write {self.path} ({e.strerror}): free disk space and "
                            f"run the same command again to resume from the last "
                            f"checkpoint") from None
        if self.events is not None:
            for k in self.SCALARS:
                if rec.get(k) is not None:
                    self.events.add_scalar(f"train/{k}", rec[k], rec["step"])
            self.events.add_scalar("train/skipped", float(rec.get("skipped", False)),
                                   rec["step"])

    def close(self) -> None:
        if self.events is not None:
            self.events.close()


def _duration(seconds: float) -> str:
    """'42.0 s', '4 min 05 s', '2 h 03 min': a wall time for a person."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _peak_text(peak: dict) -> str:
    """'peak memory 3.21 GB RSS, 1.50 GB per device' (`runtime.peak_memory`'s figures)."""
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    text = f"peak memory {gb(peak['host'])} RSS" if peak["host"] else "peak memory: RSS n/a"
    return text + (f", {gb(peak['device'])} per device" if peak["device"] else "")


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan")


def _read_metrics(path: str, upto: int, log) -> list[dict]:
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
            raise ConfigError(f"{path}, line {i + 1}: not a metrics row; fix or delete that "
                              f"line to resume") from None
        if row["step"] <= upto:
            rows.append(row)
    return rows


@contextlib.contextmanager
def _stop_signals():
    """SIGTERM / Ctrl-C set `stop["signal"]`; the loop saves and exits. A second Ctrl-C
    aborts at once; a process that cannot reach its loop (blocked in a collective) is ended by
    `runtime.stop_watchdog`."""
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with runtime.stop_watchdog("training"):  # a process blocked in a collective
            yield stop
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def benchmark(trainer: Trainer) -> list[dict]:
    """Tokens/s and MFU of every residual scheme on the trainer's model, mesh and data. The
    schemes' steps are interleaved (one step of each in turn, `bench_steps` rounds, after one
    warm-up step that compiles), so that a machine whose load drifts slows them alike and
    their ratios hold; the median step time is reported."""
    cfg = trainer.cfg
    tokens_per_step = cfg.data.grad_accum * cfg.data.batch_size * cfg.data.seq_len
    peak = peak_flops(cfg, trainer.mesh.devices.flat[0])
    n_dev = trainer.mesh.devices.size
    batches = [trainer.global_batch(next(trainer.data_iter)) for _ in range(2)]
    trainer.log(f"benchmark: {trainer.describe()}; {tokens_per_step} tokens/step, "
                f"{cfg.bench_steps} interleaved rounds after 1 warm-up step per scheme")
    if jax.default_backend() == "cpu":  # CPU figures compare only beside the CPU and flags
        trainer.log(f"  cpu: {hardware.cpu_description()}; XLA_FLAGS="
                    f"{os.environ.get('XLA_FLAGS', '')!r}; compiler options "
                    f"{sharding.compiler_options('cpu', 'train')}")
    runs, states = {}, {}
    for residual in RESIDUALS:
        mc = dataclasses.replace(trainer.model_config, residual=residual, ladder_layers=None)
        graphdef, states[residual] = trainer.init_state(mc)
        runs[residual] = (mc, trainer.compiled_step(graphdef, states[residual])[0], [])

    def one(residual, i):
        _, train_step, times = runs[residual]
        state = states[residual]
        t0 = time.perf_counter()
        params, opt_state, m = train_step(state.params, state.opt_state, batches[i % 2])
        states[residual] = TrainState(params, opt_state, state.step + 1)
        float(np.asarray(m["loss"].addressable_data(0)))  # one step in flight at most
        times.append(time.perf_counter() - t0)

    for residual in runs:
        one(residual, 0)  # compiles
    for i in range(cfg.bench_steps):
        for residual in runs:
            one(residual, i + 1)
    rows = []
    for residual, (mc, _, times) in runs.items():
        dt = float(np.median(times[1:]))
        spread = (max(times[1:]) - min(times[1:])) / dt  # run to run, over the median
        tps = tokens_per_step / dt
        mfu = flops_per_token(mc, cfg.data.seq_len) * tps / (peak * n_dev) if peak else None
        rows.append({"residual": residual, "tokens_per_s": tps, "step_ms": dt * 1e3,
                     "spread": spread, "mfu": mfu, "first_step_s": times[0]})
        trainer.log(f"  {residual:<12} {tps:>12,.0f} tokens/s  {dt * 1e3:>9.1f} ms/step "
                    f"(spread {spread:4.0%})  "
                    f"MFU {f'{mfu:.1%}' if peak else 'n/a (set peak_tflops)'}"
                    + ("   (not a valid model: speed ceiling)" if residual == "upper_bound"
                       else ""))
    by = {r["residual"]: r["tokens_per_s"] for r in rows}
    trainer.log("  vs standard: " + ", ".join(f"{k} {v / by['standard']:.2f}x"
                                             for k, v in by.items() if k != "standard"))
    if trainer.mesh.shape["tp"] == 1:
        trainer.log("  note: tp=1 has no all-reduce to overlap: ladder and upper_bound compute "
                    "what standard does, so their ratios are run-to-run noise (see the spread); "
                    "use mesh.tp > 1 on GPUs")
    elif jax.default_backend() == "cpu":
        trainer.log("  note: XLA:CPU runs all-reduces synchronously, so nothing overlaps on "
                    "CPU: the ladder's speed-up needs GPUs")
    if trainer.is_main:
        os.makedirs(trainer.run_path, exist_ok=True)
        with open(os.path.join(trainer.run_path, "benchmark.json"), "w") as f:
            json.dump({"config": trainer._config_dict(), "mesh": dict(trainer.mesh.shape),
                       "backend": jax.default_backend(), "results": rows}, f, indent=1)
    return rows


def run(cfg: TrainConfig, *, devices=None) -> dict:
    """Train (or benchmark) as configured, in this process; jax must already be set up."""
    trainer = Trainer(cfg, devices=devices)
    if cfg.benchmark:
        return {"benchmark": benchmark(trainer)}
    return trainer.train()
