"""Train a Ladder Transformer: `python -m ladder_jax.train [config.yaml ...] [key=value ...]`.

    python -m ladder_jax.train configs/tiny.yaml                      # CPU, embedded corpus
    python -m ladder_jax.train configs/tiny.yaml model.residual=ladder steps=500
    python -m ladder_jax.train configs/tiny.yaml benchmark=true       # tokens/s per scheme
    python -m ladder_jax.train --help                                 # every key, its default

Data flows one way: config -> mesh -> model -> step -> outputs (`runs/<name>/`: the resolved
`config.yaml`, `metrics.jsonl`, `checkpoints/<step>/`).

Config: the `TrainConfig` dataclasses below are the schema (OmegaConf structured configs).
YAML files merge left to right, then dotted `key=value` overrides. An unknown key or a value of
the wrong type is an error naming the key (and the closest valid one); exit code 2.

Each step: A = `data.grad_accum` micro-batches of `data.batch_size` sequences (global, over all
processes) of `data.seq_len` tokens; fp32 cross-entropy, gradient mean, global-norm clipping,
AdamW on warmup + cosine; one jitted program (`sharding.jit`) with donated params and
optimizer state. Mesh `mesh.data` x `mesh.tp`; `mesh.fsdp=true` also splits every weight and its
optimizer state over `data` (XLA gathers them at the model's shard_map boundary).

Faults and exit codes: SIGTERM or Ctrl-C saves a checkpoint and exits 0 (a second Ctrl-C
aborts). Re-running the same command resumes from the latest checkpoint, bit for bit. A step
whose loss or gradient is not finite is skipped (params unchanged) and logged; after
`max_bad_steps` in a row the run stops with exit code 3 and the last good checkpoint intact.
Bad configuration: exit code 2.

Multi-host: with `dist.coordinator_address`/`dist.num_processes`/`dist.process_id` (or the
environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; or under
SLURM) `jax.distributed.initialize` runs before anything else touches jax. Every process runs
the same command; each reads only its shard of the data; process 0 alone logs and writes
files other than checkpoints (which every process writes its part of).

Footgun (XLA:CPU with fake devices): queueing ~100 collective-bearing steps without waiting
deadlocks; this loop fetches the loss every step, so it never runs ahead.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import signal
import sys
import time
import zlib
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf  # noqa: F401
from omegaconf import errors as oc_errors

from ladder_jax.step import OptimizerConfig


# ---------------------------------------------------------------------------------------------
# Config schema.


@dataclasses.dataclass
class ModelSection:
    """A `ModelConfig` preset with fields overridden (null = the preset's value)."""

    preset: str = "tiny"
    residual: str = "standard"  # standard | parallel | ladder | upper_bound
    ladder_layers: Optional[Any] = None  # ladder only: int (upper N layers) or list of indices
    n_layers: Optional[int] = None
    d_model: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    d_ff: Optional[int] = None
    head_dim: Optional[int] = None
    vocab_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Any] = None  # llama-3 scaling: {factor, low_freq_factor, ...}
    norm_eps: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    dtype: Optional[str] = None  # matmul compute dtype, e.g. bfloat16
    param_dtype: str = "float32"  # params and optimizer state


@dataclasses.dataclass
class DataSection:
    path: Optional[str] = None  # file, glob, directory or .npy files; null = embedded corpus
    tokenizer: str = "byte"  # or a local tokenizer.json
    seq_len: int = 256
    batch_size: int = 16  # sequences per micro-batch, global (all processes)
    grad_accum: int = 1  # micro-batches per step
    eval_fraction: float = 0.05  # held-out share of the records
    seed: int = 0  # shuffle seed


@dataclasses.dataclass
class MeshSection:
    tp: int = 1
    data: Optional[int] = None  # null = the devices left over
    fsdp: bool = False  # also shard params and optimizer state over `data`
    cpu_devices: int = 8  # fake devices a CPU host is split into (CLI only; ignored on GPU)


@dataclasses.dataclass
class DistSection:
    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None


@dataclasses.dataclass
class TrainConfig:
    name: str = "run"  # run directory: <run_dir>/<name>
    run_dir: str = "runs"
    steps: int = 1000
    seed: int = 0  # weight init
    log_every: int = 10
    eval_every: int = 200  # 0: only at the end
    eval_batches: int = 8
    ckpt_every: int = 200  # 0: only at the end (and on SIGTERM)
    keep: int = 3  # checkpoints kept
    async_ckpt: bool = True
    max_bad_steps: int = 5  # consecutive non-finite steps before stopping
    init_from: Optional[str] = None  # weights only, from a run or checkpoint directory
    progress: str = "auto"  # auto | bar | lines | none
    benchmark: bool = False  # time every residual scheme instead of training
    bench_steps: int = 5
    peak_tflops: Optional[float] = None  # per device, for MFU; null = known GPUs only
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    dist: DistSection = dataclasses.field(default_factory=DistSection)


class ConfigError(ValueError):
    """A bad configuration: the message names the key and the fix. The CLI exits 2."""


def _keys(node=TrainConfig, prefix="") -> list[str]:
    out = []
    for f in dataclasses.fields(node):
        t = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if t is not None and dataclasses.is_dataclass(t):
            out += _keys(t, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _closest(key: str) -> str:
    keys = _keys()
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:  # a key put in the wrong section: compare the last part only
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1] or [
            k for k in keys if k.rsplit(".", 1)[-1] in difflib.get_close_matches(
                leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1)][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_config(args: list[str]) -> TrainConfig:
    """YAML files and `key=value` overrides, merged in order onto the schema's defaults."""
    cfg = OmegaConf.structured(TrainConfig)
    try:
        for a in args:
            if "=" in a:
                key, value = a.split("=", 1)
                if not key or key.startswith("-"):
                    raise ConfigError(f"bad override {a!r}: write key=value, e.g. steps=100")
                cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([a]))
            else:
                if not os.path.isfile(a):
                    raise ConfigError(f"config file {a!r} not found (overrides are key=value)")
                cfg = OmegaConf.merge(cfg, OmegaConf.load(a))
        return OmegaConf.to_object(cfg)
    except oc_errors.ConfigKeyError as e:
        key = e.full_key or str(e.key)
        raise ConfigError(f"unknown config key {key!r}{_closest(key)}") from None
    except oc_errors.ValidationError as e:
        field = _field(e.full_key)
        want = getattr(field, "type", None)
        want = getattr(want, "__name__", None) or str(want).replace("typing.", "")
        raise ConfigError(f"config key {e.full_key!r} must be {want}, got {e.value!r}") from None
    except oc_errors.OmegaConfBaseException as e:
        raise ConfigError(f"bad config: {str(e).splitlines()[0]}") from None
    except Exception as e:  # YAML syntax errors and the like
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"cannot read the config: {str(e).splitlines()[0]}") from None


def _field(full_key: str):
    node = TrainConfig
    field = None
    for part in (full_key or "").split("."):
        field = {f.name: f for f in dataclasses.fields(node)}.get(part) if node else None
        if field is None:
            return None
        node = field.default_factory if dataclasses.is_dataclass(
            getattr(field, "default_factory", None)) else None
    return field


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def model_config(cfg: TrainConfig):
    from ladder_jax.model import ModelConfig
    m = dataclasses.asdict(cfg.model)
    preset = m.pop("preset")
    over = {k: v for k, v in m.items() if v is not None}
    if isinstance(over.get("ladder_layers"), list):
        over["ladder_layers"] = tuple(over["ladder_layers"])
    return ModelConfig.from_preset(preset, **over)


# ---------------------------------------------------------------------------------------------
# Start-up: distributed init and devices, before anything else touches a jax backend.


def init_runtime(cfg: TrainConfig) -> None:
    import jax

    d = cfg.dist
    addr = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    nproc = d.num_processes or _env_int("JAX_NUM_PROCESSES")
    pid = d.process_id if d.process_id is not None else _env_int("JAX_PROCESS_ID")
    on_gpu = os.path.exists("/dev/nvidiactl") or os.environ.get("JAX_PLATFORMS", "") not in (
        "", "cpu")
    if not os.environ.get("JAX_PLATFORMS") and not on_gpu:
        jax.config.update("jax_platforms", "cpu")  # skip probing for GPUs that aren't there
    if not on_gpu and "xla_force_host_platform_device_count" not in os.environ.get(
            "XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", cfg.mesh.cpu_devices)
    if addr or (nproc or 1) > 1:
        if not addr or nproc is None or pid is None:
            raise ConfigError(
                "multi-process training needs dist.coordinator_address, dist.num_processes and "
                "dist.process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
        jax.distributed.initialize(addr, nproc, pid)
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()  # SLURM: everything comes from the environment


def _env_int(name):
    v = os.environ.get(name)
    return int(v) if v else None


# ---------------------------------------------------------------------------------------------
# The run.


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row. The CLI exits 3."""


def flops_per_token(c, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul params) + causal attention (PaLM's estimate)."""
    matmul_params = c.num_params() - c.vocab_size * c.d_model * (0 if c.tie_embeddings else 1)
    return 6 * matmul_params + 6 * c.n_layers * c.n_heads * c.head_dim * seq_len


def peak_flops(cfg: TrainConfig, device) -> float | None:
    from ladder_jax import hardware
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    chip = hardware.chip_of(device)
    return chip.bf16_flops if chip else None


def _fsdp_spec(spec, shape, n_data):
    from jax.sharding import PartitionSpec as P
    from ladder_jax.sharding import DATA
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = [i for i, e in enumerate(entries) if e is None and shape[i] % n_data == 0]
    if n_data == 1 or not free:
        return spec
    entries[max(free, key=lambda i: shape[i])] = DATA
    return P(*entries)


class Trainer:
    """Everything one run needs, built from the config in the order data flows."""

    def __init__(self, cfg: TrainConfig, *, devices=None):
        import jax
        from flax import nnx
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from ladder_jax import data, sharding, step
        from ladder_jax.model import ConfigError as ModelConfigError
        from ladder_jax.model import Transformer

        self.cfg = cfg
        try:
            self.model_config = model_config(cfg)
        except ModelConfigError as e:
            raise ConfigError(f"model: {e}") from None
        for key in ("steps", "log_every", "bench_steps", "eval_batches", "keep",
                    "max_bad_steps", "data.seq_len", "data.batch_size", "data.grad_accum",
                    "mesh.tp", "mesh.cpu_devices"):
            v = OmegaConf.select(OmegaConf.structured(cfg), key)
            if v <= 0:
                raise ConfigError(f"{key}={v} must be positive")
        if cfg.data.seq_len > self.model_config.max_seq_len:
            raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len="
                              f"{self.model_config.max_seq_len}: set model.max_seq_len")
        if cfg.progress not in ("auto", "bar", "lines", "none"):
            raise ConfigError(f"progress={cfg.progress!r}: choose auto, bar, lines or none")
        self.tokenizer = data.make_tokenizer(cfg.data.tokenizer)
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but "
                              f"model vocab_size={self.model_config.vocab_size}")

        # mesh
        n_proc = jax.process_count()
        if devices is None:
            devices = jax.devices()
            if n_proc == 1:
                want = cfg.mesh.tp * (cfg.mesh.data or len(devices) // cfg.mesh.tp)
                devices = devices[:want] if 0 < want <= len(devices) else devices
        self.mesh = sharding.make_mesh(tp=cfg.mesh.tp, data=cfg.mesh.data, devices=devices)
        sharding.WeightSpecs.for_model(self.model_config, self.mesh)
        sharding.check_batch(cfg.data.batch_size, self.mesh)
        self.process = jax.process_index()
        self.is_main = self.process == 0
        # Which rows of the global batch this process feeds: the data-axis rows of its devices.
        rows = sorted({i for i, row in enumerate(self.mesh.devices) for dv in row
                       if dv.process_index == self.process})
        n_data = self.mesh.shape[sharding.DATA]
        per_proc = len(rows)
        self.shard = (rows[0] // per_proc, n_data // per_proc)
        self.local_batch = cfg.data.batch_size // self.shard[1]

        # data
        tokens = data.load_tokens(cfg.data.path, self.tokenizer,
                                 self.model_config.vocab_size)
        self.train_records, self.eval_records = data.split(
            tokens, cfg.data.seq_len, cfg.data.eval_fraction)
        self.data_iter = data.train_iterator(
            self.train_records, batch=self.local_batch * cfg.data.grad_accum,
            seed=cfg.data.seed, shard=self.shard)
        self.eval_data = data.eval_batches(
            self.eval_records, batch=self.local_batch, max_batches=cfg.eval_batches,
            shard=self.shard) if len(self.eval_records) else []

        # model, optimizer, step
        self.schedule = step.make_schedule(cfg.optim, total_steps=cfg.steps)
        self.optimizer = step.make_optimizer(cfg.optim, total_steps=cfg.steps)
        self.params, self.opt_state = self.init_state(self.model_config)
        self.batch_sharding = NamedSharding(self.mesh, P(None, sharding.DATA, None))
        self.eval_sharding = NamedSharding(self.mesh, P(sharding.DATA, None))
        self._steps = {}
        self._nnx, self._Transformer, self._stepmod = nnx, Transformer, step

    # -- state -------------------------------------------------------------------------------

    def init_state(self, model_config):
        import jax
        from flax import nnx
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from ladder_jax.model import Transformer
        from ladder_jax.sharding import DATA

        model = Transformer(model_config, mesh=self.mesh, rngs=nnx.Rngs(self.cfg.seed))
        self.graphdef, params = nnx.split(model)
        n_data = self.mesh.shape[DATA] if self.cfg.mesh.fsdp else 1

        def place(v):
            spec = _fsdp_spec(v.spec, v.shape, n_data)
            return v.replace(jax.device_put(v[...], NamedSharding(self.mesh, spec)))

        params = jax.tree.map(place, params, is_leaf=lambda v: isinstance(v, nnx.Variable))
        replicated = NamedSharding(self.mesh, P())
        opt_state = jax.tree.map(  # moments follow the params; counters replicated on the mesh
            lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(
                x, replicated), jax.jit(self.optimizer.init)(params))
        return params, opt_state

    def compiled_step(self, graphdef):
        import jax

        from ladder_jax import sharding, step

        key = id(graphdef)
        if key in self._steps:
            return self._steps[key]
        p_sh = [x.sharding for x in jax.tree.leaves(self.params)]
        o_sh = [x.sharding for x in jax.tree.leaves(self.opt_state)]

        def constrain(tree, shardings):
            leaves, treedef = jax.tree.flatten(tree)
            return treedef.unflatten([jax.lax.with_sharding_constraint(x, s)
                                      for x, s in zip(leaves, shardings)])

        optimizer, clip = self.optimizer, self.cfg.optim.grad_clip

        def train_step(params, opt_state, batch_abt):
            tokens, targets = batch_abt[..., :-1], batch_abt[..., 1:]
            if tokens.shape[0] == 1:
                tokens, targets = tokens[0], targets[0]
            params, opt_state, metrics = step.train_step(
                graphdef, params, opt_state, tokens, targets, optimizer=optimizer, grad_clip=clip)
            return constrain(params, p_sh), constrain(opt_state, o_sh), metrics

        def eval_loss(params, batch_bt):
            return step.loss_fn(graphdef, params, batch_bt[:, :-1], batch_bt[:, 1:])

        fns = (sharding.jit(train_step, donate_argnums=(0, 1)), sharding.jit(eval_loss))
        self._steps[key] = fns
        return fns

    def global_batch(self, local):
        import jax
        A, T1 = self.cfg.data.grad_accum, self.cfg.data.seq_len + 1
        local = local.reshape(A, self.local_batch, T1)
        return jax.make_array_from_process_local_data(
            self.batch_sharding, local, (A, self.cfg.data.batch_size, T1))

    def evaluate(self, graphdef=None) -> float | None:
        import jax
        import numpy as np
        if not self.eval_data:
            return None
        _, eval_loss = self.compiled_step(graphdef or self.graphdef)
        losses = []
        for b in self.eval_data:
            g = jax.make_array_from_process_local_data(
                self.eval_sharding, b, (self.cfg.data.batch_size, b.shape[1]))
            losses.append(float(np.asarray(eval_loss(self.params, g).addressable_data(0))))
        return float(np.mean(losses))

    # -- files -------------------------------------------------------------------------------

    @property
    def run_path(self):
        return os.path.join(self.cfg.run_dir, self.cfg.name)

    def log(self, msg: str):
        if self.is_main:
            if self._bar is not None:
                self._bar.console.print(msg)
            else:
                print(msg, flush=True)

    _bar = None

    # -- training ----------------------------------------------------------------------------

    def train(self) -> dict:
        import numpy as np

        from ladder_jax.checkpoint import Checkpointer, load_params

        cfg = self.cfg
        os.makedirs(self.run_path, exist_ok=True)
        ckpt = Checkpointer(os.path.join(self.run_path, "checkpoints"), keep=cfg.keep,
                            async_save=cfg.async_ckpt)
        metrics_path = os.path.join(self.run_path, "metrics.jsonl")
        start = ckpt.latest_step() or 0
        if start:
            self.params, self.opt_state, meta = ckpt.restore(
                start, self.params, self.opt_state, self.data_iter)
            self.log(f"resumed from {ckpt.directory}/{start} (trained on mesh "
                     f"{meta.get('mesh')})")
        elif cfg.init_from:
            self.params = load_params(cfg.init_from, self.params)
            self.log(f"initialized weights from {cfg.init_from}")
        history = []
        if self.is_main:
            with open(os.path.join(self.run_path, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))
            if os.path.exists(metrics_path):  # drop what came after the checkpoint
                with open(metrics_path) as f:
                    history = [r for r in map(json.loads, f) if r["step"] <= start]
            with open(metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in history)
        c = self.model_config
        tokens_per_step = cfg.data.grad_accum * cfg.data.batch_size * cfg.data.seq_len
        fpt = flops_per_token(c, cfg.data.seq_len)
        peak = peak_flops(cfg, self.mesh.devices.flat[0])
        n_dev = self.mesh.devices.size
        self.log(f"{self._describe()}; steps {start}->{cfg.steps}, {tokens_per_step} tokens/step"
                 f"; run dir {self.run_path}")
        train_step, _ = self.compiled_step(self.graphdef)

        stop = {"signal": None}

        def on_signal(signum, _frame):
            stop["signal"] = signal.Signals(signum).name
            if signum == signal.SIGINT:  # a second Ctrl-C aborts at once
                signal.signal(signal.SIGINT, signal.default_int_handler)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        bad_in_row = skipped = 0
        result = {"exit": "done", "losses": {r["step"]: r["loss"] for r in history if "loss" in r}}
        self._bar = self._progress(start)
        meta = lambda s: {"step": s, "config": OmegaConf.to_container(  # noqa: E731
            OmegaConf.structured(cfg)), "mesh": dict(self.mesh.shape)}
        t_last, s, rec = time.perf_counter(), start, {}
        try:
            for s in range(start + 1, cfg.steps + 1):
                local = next(self.data_iter)
                batch = self.global_batch(local)
                lr = float(self.schedule(s - 1 - skipped))
                self.params, self.opt_state, m = train_step(self.params, self.opt_state, batch)
                m = {k: float(np.asarray(v.addressable_data(0))) for k, v in m.items()}
                now = time.perf_counter()
                dt, t_last = now - t_last, now
                rec = {"step": s, "loss": m["loss"], "grad_norm": m["grad_norm"], "lr": lr,
                       "tokens_per_s": tokens_per_step / dt,
                       "mfu": (fpt * tokens_per_step / dt / (peak * n_dev)) if peak else None,
                       "batch_crc": zlib.crc32(local.tobytes())}  # process 0's data, for tests
                if m["skipped"]:
                    skipped += 1
                    bad_in_row += 1
                    rec["skipped"] = True
                    self.log(f"step {s}: non-finite loss {m['loss']} / grad norm "
                             f"{m['grad_norm']}: update skipped ({bad_in_row} in a row, "
                             f"{skipped} in all)")
                    if bad_in_row >= cfg.max_bad_steps:
                        self._write(metrics_path, rec)
                        last = ckpt.latest_step()
                        raise NonFiniteError(
                            f"stopping: {bad_in_row} non-finite steps in a row (max_bad_steps="
                            f"{cfg.max_bad_steps}); the last good checkpoint "
                            f"{'is step ' + str(last) if last else 'does not exist'}, intact. "
                            f"Lower optim.peak_lr or check the data.")
                else:
                    bad_in_row = 0
                    result["losses"][s] = m["loss"]
                if cfg.eval_every and s % cfg.eval_every == 0 and s != cfg.steps:
                    rec["eval_loss"] = self.evaluate()
                if s == cfg.steps:
                    rec["eval_loss"] = self.evaluate()
                if rec.get("eval_loss") is not None:
                    rec["eval_ppl"] = math.exp(min(rec["eval_loss"], 50))
                self._write(metrics_path, rec)
                self._report(rec, start)
                if self._stop_requested(stop):
                    ckpt.save(s, self.params, self.opt_state, self.data_iter, meta(s))
                    ckpt.wait()
                    self.log(f"{stop['signal'] or 'stop'}: checkpoint saved at step {s}; run "
                             f"the same command again to resume")
                    result["exit"] = "interrupted"
                    break
                if s == cfg.steps or (cfg.ckpt_every and s % cfg.ckpt_every == 0):
                    ckpt.save(s, self.params, self.opt_state, self.data_iter, meta(s))
            else:
                if start >= cfg.steps:
                    self.log(f"already trained to step {start} (steps={cfg.steps}); nothing "
                             f"to do")
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
            ckpt.close()
        result["step"] = s
        result["skipped"] = skipped
        result["eval_loss"] = (rec.get("eval_loss") if start < s else self.evaluate()) if (
            result["exit"] == "done") else None
        if result["exit"] == "done" and start < cfg.steps:
            self.log(f"done: step {s}, held-out loss {result['eval_loss']:.4f} (perplexity "
                     f"{math.exp(result['eval_loss']):.2f}); metrics {metrics_path}")
        return result

    def _stop_requested(self, stop) -> bool:
        import jax
        flag = stop["signal"] is not None
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils
        return bool(multihost_utils.process_allgather(int(flag)).max())

    def _write(self, path, rec):
        if self.is_main:
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def _describe(self) -> str:
        import jax
        c = self.model_config
        return (f"{c.residual} {c.n_layers}L d={c.d_model} ({c.num_params() / 1e6:.2f}M params,"
                f" {c.dtype} compute, {c.param_dtype} params) on {jax.process_count()} "
                f"process(es), mesh data={self.mesh.shape['data']} x tp={self.mesh.shape['tp']}"
                f"{' fsdp' if self.cfg.mesh.fsdp else ''} ({jax.default_backend()})")

    def _progress(self, start):
        mode = self.cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self._mode = mode
        if mode != "bar" or not self.is_main:
            return None
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeRemainingColumn)
        bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                       TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                       transient=False)
        self._task = bar.add_task("train", total=self.cfg.steps, completed=start, info="")
        bar.start()
        return bar

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
        elif rec["step"] % self.cfg.log_every == 0 or "eval_loss" in rec or rec["step"] == start + 1:
            lr, mfu = rec["lr"], rec["mfu"]
            print(f"step {rec['step']}/{self.cfg.steps}  {info}  lr {lr:.2e}  grad "
                  f"{rec['grad_norm']:.3f}" + (f"  mfu {mfu:.1%}" if mfu else ""), flush=True)

    # -- benchmark ---------------------------------------------------------------------------

    def benchmark(self) -> list[dict]:
        """Tokens/s and MFU of every residual scheme on this config's model and mesh."""
        import jax
        import numpy as np

        from ladder_jax.model import RESIDUALS

        cfg = self.cfg
        tokens_per_step = cfg.data.grad_accum * cfg.data.batch_size * cfg.data.seq_len
        peak = peak_flops(cfg, self.mesh.devices.flat[0])
        n_dev = self.mesh.devices.size
        batches = [self.global_batch(next(self.data_iter)) for _ in range(2)]
        self.log(f"benchmark: {self._describe()}; {tokens_per_step} tokens/step, "
                 f"{cfg.bench_steps} timed steps after 1 warm-up")
        rows = []
        for residual in RESIDUALS:
            mc = dataclasses.replace(self.model_config, residual=residual, ladder_layers=None)
            self.params, self.opt_state = self.init_state(mc)
            train_step, _ = self.compiled_step(self.graphdef)
            t0 = time.perf_counter()
            self.params, self.opt_state, m = train_step(self.params, self.opt_state, batches[0])
            float(np.asarray(m["loss"].addressable_data(0)))
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(cfg.bench_steps):
                self.params, self.opt_state, m = train_step(
                    self.params, self.opt_state, batches[(i + 1) % 2])
                float(np.asarray(m["loss"].addressable_data(0)))  # one step in flight at most
            dt = (time.perf_counter() - t0) / cfg.bench_steps
            tps = tokens_per_step / dt
            fpt = flops_per_token(mc, cfg.data.seq_len)
            rows.append({"residual": residual, "tokens_per_s": tps, "step_ms": dt * 1e3,
                         "mfu": fpt * tps / (peak * n_dev) if peak else None,
                         "first_step_s": compile_s})
            mfu = f"{rows[-1]['mfu']:.1%}" if peak else "n/a (set peak_tflops)"
            self.log(f"  {residual:<12} {tps:>12,.0f} tokens/s  {dt * 1e3:>9.1f} ms/step  "
                     f"MFU {mfu}" + ("   (not a valid model: speed ceiling)"
                                    if residual == "upper_bound" else ""))
            jax.clear_caches()
        if self.is_main:
            os.makedirs(self.run_path, exist_ok=True)
            with open(os.path.join(self.run_path, "benchmark.json"), "w") as f:
                json.dump({"config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                           "mesh": dict(self.mesh.shape), "backend": jax.default_backend(),
                           "results": rows}, f, indent=1)
        return rows


def run(cfg: TrainConfig, *, devices=None) -> dict:
    """Train (or benchmark) as configured, in this process; jax must already be set up."""
    trainer = Trainer(cfg, devices=devices)
    if cfg.benchmark:
        return {"benchmark": trainer.benchmark()}
    return trainer.train()


HELP = """usage: python -m ladder_jax.train [CONFIG.yaml ...] [key=value ...]

YAML files merge left to right, then key=value overrides (dotted keys). Every key and its
default:

"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(HELP + to_yaml(TrainConfig()) + "\n" + __doc__)
        return 0
    argv = ["benchmark=true" if a == "--benchmark" else a for a in argv]
    from ladder_jax.data import DataError
    from ladder_jax.sharding import ShardingError
    try:
        cfg = load_config(argv)
        init_runtime(cfg)
        result = run(cfg)
    except (ConfigError, ShardingError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0 if result.get("exit", "done") in ("done", "interrupted") else 1


if __name__ == "__main__":
    sys.exit(main())
