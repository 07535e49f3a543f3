"""Train a Ladder Transformer: config -> mesh -> model -> step -> `runs/<name>/` (config.yaml,
metrics.jsonl, checkpoints/). The loop fetches the loss every step, so it never queues work
ahead (XLA:CPU's fake devices deadlock otherwise). Resume, faults, exit codes, many hosts:
docs/training.md.

    python -m ladder_jax.train configs/tiny.yaml model.residual=ladder name=tiny-ladder"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import time
import zlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax import atomic, hardware, processes, runtime
from ladder_jax.config import ConfigError
from ladder_jax.interop.tokenizer import make_tokenizer
from ladder_jax.loading import check_tp
from ladder_jax.model import compilation, layout
from ladder_jax.model.transformer import Transformer, abstract
from ladder_jax.train import data, distill, step
from ladder_jax.train.benchmark import benchmark
from ladder_jax.train.checkpoint import Checkpointer, SaveError, params_finite
from ladder_jax.train.evaluate import perplexity
from ladder_jax.train.report import Reporter, duration, flops_per_token, peak_flops, peak_text
from ladder_jax.train.rundir import RunDir, config_dict
from ladder_jax.train.step import TrainState
from ladder_jax.train_config import TrainConfig, check, model_config

__all__ = [
    "NonFiniteError",
    "SaveError",
    "Trainer",
    "benchmark",
    "run",
]


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row. The CLI exits 3."""


# Where the defaults of a CPU host change for a large model: a copy of the training state
# (weights, gradients, Adam's two moments) per data-parallel device, and one step's float32
# logits, above these sizes.
CPU_REPLICA_BYTES = 2**30
LOGITS_BYTES = 64 * 2**20
AUTO_LOSS_CHUNK = 64


def training_state_bytes(config) -> int:
    """Bytes of one copy of the training state of a ModelConfig: weights, gradients and Adam's
    two moments, in the weights' dtype."""
    return 4 * config.num_params() * np.dtype(config.param_dtype).itemsize


def cpu_data_parallel(cfg: TrainConfig) -> int:
    """`mesh.data` when it is null on a CPU host: the cores this process may run on over
    `mesh.tp`, lowered to the largest count that divides `data.batch_size` (at least 1); 1 when
    a copy of the training state is `CPU_REPLICA_BYTES` or more (each device holds one, and a
    large model's matmuls keep the cores busy on one device)."""
    if training_state_bytes(model_config(cfg)) >= CPU_REPLICA_BYTES:
        return 1
    n = max(1, runtime.cpu_cores() // max(1, cfg.mesh.tp))
    while cfg.data.batch_size % n:
        n -= 1
    return n


def data_parallel(cfg: TrainConfig, *, cpu: bool, devices: int | None = None) -> int | None:
    """`mesh.data` resolved: as configured; null on one CPU process: `cpu_data_parallel`, at
    most the `devices` there are over `mesh.tp`; null elsewhere: None (every device tp leaves).
    The one rule behind both the devices `init_runtime` makes and the mesh `train_mesh` takes."""
    if cfg.mesh.data or not cpu:
        return cfg.mesh.data
    n = cpu_data_parallel(cfg)
    return n if devices is None else min(n, max(1, devices // cfg.mesh.tp))


def loss_chunk(cfg: TrainConfig, config) -> int:
    """`loss_chunk` resolved: as configured; null: `AUTO_LOSS_CHUNK` positions when one step's
    float32 logits (batch x seq_len x vocabulary) would reach `LOGITS_BYTES`, else 0."""
    if cfg.loss_chunk is not None:
        return cfg.loss_chunk
    logits = cfg.data.batch_size * cfg.data.seq_len * config.vocab_size * 4
    return AUTO_LOSS_CHUNK if logits >= LOGITS_BYTES else 0


def init_runtime(cfg: TrainConfig) -> None:
    """`ladder_jax.runtime.setup` for this config: on a CPU host, as many fake devices as the
    mesh needs (or `mesh.cpu_devices`); `mesh.data: null` there is `data_parallel`'s."""
    check_tp(cfg.mesh.tp, check(cfg), flag="mesh.tp")  # before any device is made
    if cfg.mesh.data is not None and not 1 <= cfg.mesh.data <= cfg.data.batch_size:
        raise ConfigError(
            f"mesh.data={cfg.mesh.data}: between 1 and data.batch_size={cfg.data.batch_size} "
            f"(each data-parallel group takes whole sequences of the batch)"
        )
    d = cfg.dist
    nproc = d.num_processes or int(os.environ.get("JAX_NUM_PROCESSES") or 1)
    one_cpu_process = (
        runtime.cpu_only() and nproc == 1 and int(os.environ.get("SLURM_NTASKS", "1")) == 1
    )
    want = cfg.mesh.tp * (data_parallel(cfg, cpu=one_cpu_process) or 1)
    runtime.setup(
        cpu_devices=cfg.mesh.cpu_devices or max(1, -(-want // nproc)),
        coordinator=d.coordinator_address,
        num_processes=d.num_processes,
        process_id=d.process_id,
        flags=processes.TRAIN_KEYS,
    )


def train_mesh(cfg: TrainConfig, config, devices=None):
    """The run's (data, tp) mesh over `devices` (default: on one process, the first
    tp x `data_parallel` of them; else all), checked against the model `config` (a
    ModelConfig) and the batch."""
    if devices is None:
        devices = jax.devices()
        if jax.process_count() == 1:
            data = data_parallel(cfg, cpu=jax.default_backend() == "cpu", devices=len(devices))
            want = cfg.mesh.tp * (data or len(devices) // cfg.mesh.tp)
            devices = devices[:want] if 0 < want <= len(devices) else devices
    mesh = layout.make_mesh(tp=cfg.mesh.tp, data=cfg.mesh.data, devices=devices)
    layout.check_divisible(config, cfg.mesh.tp, flag="mesh.tp")
    layout.check_batch(cfg.data.batch_size, mesh)
    return mesh


def check_host_memory(config, mesh, fsdp: bool) -> None:
    """CPU backends: a one-line estimate before allocating. Weights, gradients and Adam's two
    moments (4 copies of the parameters, a lower bound) on this process's devices."""
    me = jax.process_index()
    local = sum(1 for d in mesh.devices.flat if d.process_index == me)
    shards = mesh.shape["tp"] * (mesh.shape["data"] if fsdp else 1)
    n = config.num_params()
    need = 4 * n * np.dtype(config.param_dtype).itemsize * local // shards
    runtime.check_host_memory(
        need,
        f"training the model ({n / 1e9:.2f}B parameters: weights, gradients and optimizer "
        f"state on {local} CPU device(s))",
        "use a smaller model (model.vocab_size, model.d_model, model.n_layers, ...) or a GPU",
    )


@dataclasses.dataclass
class _Tally:
    """The loop's running counts: losses by step, skipped steps, the current run of them."""

    losses: dict
    skipped: int = 0
    bad_in_row: int = 0
    exit: str = "done"


class Trainer:
    """Everything one run needs, built from the config in the order data flows."""

    def __init__(self, cfg: TrainConfig, *, devices=None):
        self.cfg = cfg
        processes.agree(
            {k: v for k, v in config_dict(cfg).items() if k != "dist"}, "training config"
        )  # many processes: all alike, or exit 2
        self.model_config = check(cfg)
        self.reporter = Reporter(cfg)
        self.run_dir = RunDir(cfg, self.log)
        atomic.check_writable(self.run_path, f"run_dir={cfg.run_dir!r}")
        self.tokenizer = make_tokenizer(cfg.data.tokenizer)
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but "
                f"model vocab_size={self.model_config.vocab_size}"
            )
        self.mesh = train_mesh(cfg, self.model_config, devices)
        self.loss_chunk = loss_chunk(cfg, self.model_config)
        self.is_main = jax.process_index() == 0
        check_host_memory(self.model_config, self.mesh, cfg.mesh.fsdp)
        self.batch_sharding = NamedSharding(self.mesh, P(None, layout.DATA, None))
        self.eval_sharding = NamedSharding(self.mesh, P(layout.DATA, None))
        self._load_data()
        self.lr_schedule = step.lr_schedule(cfg.optim, total_steps=cfg.steps)
        self.optimizer = step.make_optimizer(cfg.optim, total_steps=cfg.steps)
        # init_from or a checkpoint fills the weights: no random ones are made for them
        make = self.abstract_state if cfg.init_from and not cfg.benchmark else self.init_state
        self.graphdef, self.state = make(self.model_config)
        self.teacher = (
            distill.load_teacher(cfg.distill.teacher, self.mesh, self.model_config)
            if cfg.distill.teacher
            else None
        )  # (graphdef, params), frozen
        self._steps = {}

    def _load_data(self):
        cfg, mesh = self.cfg, self.mesh
        # Which rows of the global batch this process feeds: the data-axis rows of its devices.
        me = jax.process_index()
        rows = sorted(
            {i for i, row in enumerate(mesh.devices) for dv in row if dv.process_index == me}
        )
        per_proc = len(rows)
        shard = (rows[0] // per_proc, mesh.shape[layout.DATA] // per_proc)
        self.local_batch = cfg.data.batch_size // shard[1]
        tokens = data.load_tokens(cfg.data.path, self.tokenizer, self.model_config.vocab_size)
        train_records, eval_records = data.split(tokens, cfg.data.seq_len, cfg.data.eval_fraction)
        self.data_iter = data.train_iterator(
            train_records,
            batch=self.local_batch * cfg.data.grad_accum,
            seed=cfg.data.seed,
            shard=shard,
        )
        self.eval_data = (
            data.eval_batches(
                eval_records, batch=self.local_batch, max_batches=cfg.eval_batches, shard=shard
            )
            if len(eval_records)
            else []
        )

    # -- state and the compiled step ---------------------------------------------------------

    def init_state(self, config) -> tuple[nnx.GraphDef, TrainState]:
        """(graphdef, TrainState at step 0) of a freshly initialized `config` on this mesh."""
        model = Transformer(
            config, mesh=self.mesh, rngs=nnx.Rngs(self.cfg.seed), fsdp=self.cfg.mesh.fsdp
        )  # weights created where they are stored
        graphdef, params = nnx.split(model)
        opt_state = jax.jit(self.optimizer.init)(params)
        opt_state = jax.device_put(
            opt_state, step.opt_state_shardings(self.optimizer, opt_state, params, self.mesh)
        )
        return graphdef, TrainState(params, opt_state, 0)

    def abstract_state(self, config) -> tuple[nnx.GraphDef, TrainState]:
        """(graphdef, TrainState at step 0) of `config` on this mesh from shapes alone: every
        array a `jax.ShapeDtypeStruct` stored where `init_state` would put it; nothing is
        allocated or compiled. A checkpoint or `init_from` fills it (`filled`)."""
        graphdef, params = abstract(config, self.mesh, fsdp=self.cfg.mesh.fsdp)
        opt_state = jax.eval_shape(self.optimizer.init, params)
        opt_state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            opt_state,
            step.opt_state_shardings(self.optimizer, opt_state, params, self.mesh),
        )
        return graphdef, TrainState(params, opt_state, 0)

    def filled(self, state: TrainState) -> TrainState:
        """`state` with an optimizer state initialized for its weights where it still holds
        only shapes (weights loaded by `init_from` into `abstract_state`); else `state`."""
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state.opt_state)):
            return state
        init = jax.jit(self.optimizer.init, out_shardings=step.shardings_of(state.opt_state))
        return state.replace(opt_state=init(state.params))

    def compiled_step(self, graphdef, state: TrainState):
        """(train_step, eval_loss) for the model graph `graphdef` and arrays stored like
        `state`'s, jitted once per graph."""
        key = id(graphdef)
        if key in self._steps:
            return self._steps[key]
        kw = dict(
            optimizer=self.optimizer,
            grad_clip=self.cfg.optim.grad_clip,
            param_shardings=step.shardings_of(state.params),
            opt_shardings=step.shardings_of(state.opt_state),
        )
        if self.teacher is None:
            train = compilation.jit(
                step.make_train_step(graphdef, loss_chunk=self.loss_chunk, **kw),
                mesh=self.mesh,
                program="train",
                donate_argnums=(0, 1),
            )
        else:  # the teacher's params are the first argument, bound here
            d = self.cfg.distill
            fn = distill.make_train_step(
                graphdef, self.teacher[0], weight=d.weight, temperature=d.temperature, **kw
            )
            train = functools.partial(
                compilation.jit(fn, mesh=self.mesh, program="train", donate_argnums=(1, 2)),
                self.teacher[1],
            )

        def eval_loss(params, batch_bt):
            return step.loss_fn(
                graphdef, params, batch_bt[:, :-1], batch_bt[:, 1:], loss_chunk=self.loss_chunk
            )

        fns = (train, compilation.jit(eval_loss, mesh=self.mesh))
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
            (cfg.data.grad_accum, cfg.data.batch_size, cfg.data.seq_len + 1),
            np.int32,
            sharding=self.batch_sharding,
        )
        compiled = train_step.lower(self.state.params, self.state.opt_state, batch).compile()
        stats = (device.memory_stats() or {}) if hasattr(device, "memory_stats") else {}
        capacity = int(stats.get("bytes_limit") or chip.memory_bytes)
        use = step.memory_use(compiled)
        try:
            step.check_memory(use, capacity, cfg, where=f"per device ({chip.name})")
        except ConfigError as e:
            if use["peak"] <= 0.95 * chip.memory_bytes:  # jax's allocator holds less
                raise ConfigError(
                    f"{e}; or let jax's allocator take more of the device: "
                    f"XLA_PYTHON_CLIENT_MEM_FRACTION=0.95"
                ) from None
            raise
        return compiled

    def global_batch(self, local):
        A, T1 = self.cfg.data.grad_accum, self.cfg.data.seq_len + 1
        local = local.reshape(A, self.local_batch, T1)
        return jax.make_array_from_process_local_data(
            self.batch_sharding, local, (A, self.cfg.data.batch_size, T1)
        )

    def evaluate(self) -> float | None:
        if not self.eval_data:
            return None
        _, eval_loss = self.compiled_step(self.graphdef, self.state)
        losses = []
        for b in self.eval_data:
            g = jax.make_array_from_process_local_data(
                self.eval_sharding, b, (self.cfg.data.batch_size, b.shape[1])
            )
            losses.append(float(np.asarray(eval_loss(self.state.params, g).addressable_data(0))))
        return float(np.mean(losses))

    # -- the run -----------------------------------------------------------------------------

    @property
    def run_path(self):
        return self.run_dir.path

    def log(self, msg: str):
        self.reporter.log(msg)

    def train(self) -> dict:
        """Lock the run directory, resume or initialize, then step, evaluate, log and
        checkpoint until `steps`."""
        cfg = self.cfg
        with self.run_dir.lock():
            train_step, eval_loss = self.compiled_step(self.graphdef, self.state)
            self._steps[id(self.graphdef)] = (self.check_memory(train_step), eval_loss)
            ckpt = Checkpointer(
                os.path.join(self.run_path, "checkpoints"), keep=cfg.keep, async_save=cfg.async_ckpt
            )
            try:
                start, state, damaged, changes = self.run_dir.resume_or_init(
                    ckpt, self.state, self.data_iter
                )
                self.state = self.filled(state)
                if start >= cfg.steps:  # reads only: writes nothing, not even config.yaml
                    return self._nothing_to_do(start)
                self.run_dir.set_aside(ckpt, damaged)
                history, metrics = self.run_dir.open_files(start, changes)
                try:
                    return self._loop(ckpt, start, history, metrics)
                finally:
                    metrics.close()
            finally:
                ckpt.close()

    def _nothing_to_do(self, start: int) -> dict:
        self.log(f"already trained to step {start} (steps={self.cfg.steps}); nothing to do")
        history = self.run_dir.history(start)
        return {
            "exit": "done",
            "losses": {r["step"]: r["loss"] for r in history if "loss" in r},
            "step": start,
            "skipped": 0,
            "eval_loss": self.evaluate(),
        }

    def _loop(self, ckpt, start, history, metrics) -> dict:
        """Steps from `start` to `steps`: each one trained, counted, evaluated when due,
        written, shown, checkpointed when due; a signal saves and stops."""
        cfg = self.cfg
        self.log(
            f"{self.describe()}; steps {start}->{cfg.steps}, {self._tokens_per_step()} "
            f"tokens/step; run dir {self.run_path}"
        )
        tally = _Tally({r["step"]: r["loss"] for r in history if "loss" in r})
        s, rec, t_begin = start, {}, time.perf_counter()
        self._t_last = t_begin
        with _stop_signals() as stop, self.reporter.progress(start):
            for s in range(start + 1, cfg.steps + 1):
                rec = self._one_step(s, tally)
                self._count(rec, tally, ckpt, metrics)
                self._maybe_evaluate(rec)
                metrics.write(rec)
                self.reporter.row(rec, start)
                ckpt.check()  # a background save that failed stops the run here
                if self._stop_requested(stop):
                    self._interrupt(ckpt, s, stop)
                    tally.exit = "interrupted"
                    break
                # none in a run of non-finite steps: its weights are the last finite step's,
                # saved or not, and would push good checkpoints out of `keep`
                if s == cfg.steps or (
                    not tally.bad_in_row and cfg.ckpt_every and s % cfg.ckpt_every == 0
                ):
                    self._save(ckpt, s)
            ckpt.wait()  # the last save, before saying "done"
        return self._result(tally, s, rec, start, t_begin, metrics)

    def _tokens_per_step(self) -> int:
        d = self.cfg.data
        return d.grad_accum * d.batch_size * d.seq_len

    def _one_step(self, s: int, tally: _Tally) -> dict:
        """Trains step `s` on the next batch; returns its metrics row."""
        train_step, _ = self.compiled_step(self.graphdef, self.state)
        local = next(self.data_iter)
        lr = float(self.lr_schedule(s - 1 - tally.skipped))
        params, opt_state, m = train_step(
            self.state.params, self.state.opt_state, self.global_batch(local)
        )
        self.state = TrainState(params, opt_state, s)
        m = {k: float(np.asarray(v.addressable_data(0))) for k, v in m.items()}
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        tps = self._tokens_per_step() / dt
        peak = peak_flops(self.cfg, self.mesh.devices.flat[0])
        mfu = (
            (
                flops_per_token(self.model_config, self.cfg.data.seq_len)
                * tps
                / (peak * self.mesh.devices.size)
            )
            if peak
            else None
        )
        rec = {
            "step": s,
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "lr": lr,
            "tokens_per_s": tps,
            "mfu": mfu,
            "batch_crc": zlib.crc32(local.tobytes()),  # process 0's data, for tests
            "time": round(time.time(), 3),
        }  # wall clock, Unix seconds
        if m["skipped"]:
            rec["skipped"] = True
        return rec

    def _count(self, rec: dict, tally: _Tally, ckpt, metrics) -> None:
        """Counts a finite step's loss, or a skipped one (NonFiniteError after
        `max_bad_steps` in a row, its row written and the unsound checkpoints marked)."""
        s = rec["step"]
        if not rec.get("skipped"):
            tally.bad_in_row = 0
            tally.losses[s] = rec["loss"]
            return
        tally.skipped += 1
        tally.bad_in_row += 1
        self.log(
            f"step {s}: non-finite loss {rec['loss']} / grad norm {rec['grad_norm']}: "
            f"update skipped ({tally.bad_in_row} in a row, {tally.skipped} in all)"
        )
        if tally.bad_in_row >= self.cfg.max_bad_steps:
            metrics.write(rec)
            raise NonFiniteError(
                f"stopping at step {s}: {tally.bad_in_row} non-finite steps in a row "
                f"(max_bad_steps={self.cfg.max_bad_steps}); "
                f"{self.run_dir.mark_unsound(ckpt, s - tally.bad_in_row)}. Lower "
                f"optim.peak_lr or check the data."
            )

    def _maybe_evaluate(self, rec: dict) -> None:
        s, cfg = rec["step"], self.cfg
        if s == cfg.steps or (cfg.eval_every and s % cfg.eval_every == 0):
            rec["eval_loss"] = self.evaluate()
        if rec.get("eval_loss") is not None:
            rec["eval_ppl"] = perplexity(rec["eval_loss"])

    def _interrupt(self, ckpt, s: int, stop) -> None:
        self._save(ckpt, s)
        ckpt.wait()
        self.log(
            f"{stop['signal'] or 'stop'}: checkpoint saved at step {s}; run the same "
            f"command again to resume"
        )

    def _result(
        self, tally: _Tally, s: int, rec: dict, start: int, t_begin: float, metrics
    ) -> dict:
        """The run's summary (the `done:` line on a finished run)."""
        done = tally.exit == "done"
        eval_loss = rec.get("eval_loss") if done else None
        peak = runtime.peak_memory(
            [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        )
        if done and start < self.cfg.steps:  # with or without held-out data
            held_out = (
                f", held-out loss {eval_loss:.4f} (perplexity {perplexity(eval_loss):.2f})"
                if eval_loss is not None
                else ""
            )
            self.log(
                f"done: step {s} in {duration(time.perf_counter() - t_begin)}{held_out}; "
                f"{peak_text(peak)}; metrics {metrics.path}"
            )
        return {
            "exit": tally.exit,
            "losses": tally.losses,
            "step": s,
            "skipped": tally.skipped,
            "eval_loss": eval_loss,
            "peak_rss": peak["host"],
            "peak_device": peak["device"],
        }

    def _meta(self, s: int) -> dict:
        return {
            "step": s,
            "config": config_dict(self.cfg),
            "mesh": dict(self.mesh.shape),
            "processes": jax.process_count(),
        }

    def _save(self, ckpt, s: int) -> None:
        """Saves the state as checkpoint `s`, only if its weights are finite (NonFiniteError
        otherwise: a checkpoint is always one a run can resume from)."""
        if not params_finite(self.state.params):
            raise NonFiniteError(
                f"stopping at step {s}: the weights are NaN or infinite after its update, so "
                f"they were not saved; {self.run_dir.mark_unsound(ckpt, s)}. Lower "
                f"optim.peak_lr or check the data."
            )
        ckpt.save(self.state, self.data_iter, self._meta(s))

    def _stop_requested(self, stop) -> bool:
        flag = stop["signal"] is not None
        if jax.process_count() == 1:
            return flag
        return bool(multihost_utils.process_allgather(int(flag)).max())

    def describe(self) -> str:
        """The run's first line: the model, the mesh and, where a null key chose them on this
        host, why that data-parallel size and loss chunk."""
        c, cfg = self.model_config, self.cfg
        return (
            f"{c.residual} {c.n_layers}L d={c.d_model} ({c.num_params() / 1e6:.2f}M params,"
            f" {c.dtype} compute, {c.param_dtype} params) on {jax.process_count()} "
            f"process(es), mesh data={self.mesh.shape['data']} x tp={self.mesh.shape['tp']}"
            f"{' fsdp' if cfg.mesh.fsdp else ''} ({jax.default_backend()}){self._chosen()}"
        )

    def _chosen(self) -> str:
        c, cfg, notes = self.model_config, self.cfg, []
        if cfg.mesh.data is None and jax.process_count() == 1 and jax.default_backend() == "cpu":
            state = training_state_bytes(c)
            size = f"{state / 2**30:.2f} GiB" if state >= 2**30 else f"{state / 2**20:.1f} MiB"
            notes.append(
                f"mesh.data null: one device per CPU core (a copy of the training state is {size})"
                if state < CPU_REPLICA_BYTES
                else f"mesh.data null: 1, since a copy of the training state is {size}"
            )
        if cfg.loss_chunk is None and self.loss_chunk:
            mib = cfg.data.batch_size * cfg.data.seq_len * c.vocab_size * 4 / 2**20
            notes.append(
                f"loss_chunk null: {self.loss_chunk} positions at a time, since a step's "
                f"float32 logits would be {mib:.0f} MiB"
            )
        return "".join(f"; {n}" for n in notes)


@contextlib.contextmanager
def _stop_signals():
    """SIGTERM / Ctrl-C set `stop["signal"]`; the loop saves and exits. A second Ctrl-C
    aborts at once; a process that cannot reach its loop (blocked in a collective) is ended by
    `processes.stop_watchdog`."""
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with processes.stop_watchdog("training"):  # a process blocked in a collective
            yield stop
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def run(cfg: TrainConfig, *, devices=None) -> dict:
    """Train (or benchmark) as configured, in this process; jax must already be set up."""
    trainer = Trainer(cfg, devices=devices)
    if cfg.benchmark:
        return {"benchmark": benchmark(trainer)}
    return trainer.train()
