"""What gets compiled: the model programs users run, built from shapes alone for an NVIDIA GPU
target on a machine with no GPU.

XLA's CUDA compiler runs on the CPU when given a description of the target chip
(`ladder_jax.hardware`, H100 / H200) through the CUDA PJRT plugin (`pip install -e ".[test]"`
brings it; no CUDA libraries, no GPU). The model is built from shapes only (`nnx.eval_shape`),
so `llama-3-70b` compiles on a laptop.

Phases are the programs users run. `prefill` and `decode` are
`ladder_jax.inference.generation.Decoder`'s jitted prefill (a prompt written into the KV cache,
then sampling of the first new token) and its one-token step (KV cache, attention over all its
slots, per-row sampling), with a cache sized for the prompt + new tokens as `decode` sizes it.
`train` is a full training step (forward,
backward, AdamW update).

Training configs: `compile_train_config` compiles the training step a TrainConfig runs (its
mesh, FSDP, dtypes, accumulation, remat and optimizer, through the same
`ladder_jax.train.step` functions the trainer uses) for N hosts of G GPUs: the plugin's
topology `1 x N x G`, the (data, tp) mesh filled row by row so that a tp group is one host.

The options the package compiles with (`ladder_jax.model.sharding.compiler_options("gpu")`) are
applied here exactly as in training and decoding.
"""


from __future__ import annotations

import dataclasses
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax import config as config_lib
from ladder_jax import hardware
from ladder_jax.inference import generation
from ladder_jax.model import sharding
from ladder_jax.model.transformer import abstract
from ladder_jax.train import step

PLUGIN_HINT = ('deviceless GPU compilation needs the CUDA PJRT plugin at the jax version in use: '
               'pip install "jax-cuda12-plugin=={v}" "jax-cuda12-pjrt=={v}"  '
               '(or: pip install -e ".[test]"); no GPU or CUDA libraries are needed')


class OverlapError(RuntimeError):
    pass


def gpu_devices(target: str, n: int, *, hosts: int = 1) -> list:
    """`n` abstract GPUs of `target` on `hosts` hosts (n / hosts each), process by process: the
    plugin's topology `1 x hosts x n/hosts` (one slice). No GPU needed."""

    if target not in hardware.TARGETS:
        raise OverlapError(f"unknown target {target!r}: choose one of "
                           f"{', '.join(hardware.TARGETS)}")
    if hosts <= 0 or n <= 0 or n % hosts:
        raise OverlapError(f"{n} GPUs cannot be spread evenly over {hosts} hosts")
    check_plugin()
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=hardware.gpu_target_config(target),
            topology=f"1x{hosts}x{n // hosts}")
    except Exception as e:  # the plugin's errors are plain RuntimeErrors
        raise OverlapError(f"could not describe {hosts} hosts x {n // hosts} {target}: {e}\n"
                           + PLUGIN_HINT.format(v=jax.__version__)) from None
    return list(topo.devices)


def gpu_mesh(target: str, tp: int, *, data: int = 1, hosts: int = 1):
    """A (data, tp) mesh of abstract GPUs of `target` on `hosts` hosts (no GPU needed). Devices
    fill the mesh row by row, so a tp group is tp consecutive GPUs: one host when tp <= the
    GPUs per host."""

    devices = gpu_devices(target, data * tp, hosts=hosts)
    return Mesh(np.array(devices).reshape(data, tp), ("data", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))


def check_plugin() -> None:
    """Raises OverlapError with the install line when the CUDA PJRT plugin is missing."""

    try:  # find_spec of a dotted name imports its parent: it raises when that is missing
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise OverlapError(PLUGIN_HINT.format(v=jax.__version__))


def lower_decoder(config, mesh, *, phase: str, batch: int, prompt_len: int, new_tokens: int,
                  quantize: str | None = None):
    """The lowered `Decoder` prefill or one-token step (KV cache, per-row sampling) of `config`
    on `mesh`, from shapes: the cache holds `prompt_len + new_tokens` (rounded as `decode`
    does). Sampling settings are runtime arrays, so one program serves greedy and sampled rows.
    `quantize="int8"`: int8 linear weights (`ladder_jax.model.quant`)."""
    if quantize is not None:
        config = dataclasses.replace(config, quantize=quantize)
    decoder = generation.Decoder(nnx.merge(*abstract(config, mesh)))
    state = decoder.state  # weights as ShapeDtypeStructs in their shardings
    S = generation.cache_length(config, prompt_len, new_tokens)
    cache = generation.KVCache.abstract(config, mesh, batch, S)

    def rows_of(dtype, *shape):
        return jax.ShapeDtypeStruct((batch, *shape), dtype, sharding=NamedSharding(
            mesh, P("data", *(None,) * len(shape))))

    rows = rows_of(jnp.int32)
    settings = generation.Rows(rows_of(jnp.uint32, 2), rows_of(jnp.float32),
                               rows_of(jnp.int32), rows_of(jnp.float32))
    if phase == "prefill":
        tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32,
                                      sharding=NamedSharding(mesh, P("data", None)))
        return decoder._prefill.lower(state, cache, tokens, rows, settings)
    return decoder._decode_step.lower(state, cache, rows, rows, settings, rows)


def compile_program(config, *, phase: str, tp: int, batch: int, seq: int, target: str = "h100",
                    new_tokens: int = 512, quantize: str | None = None):
    """Compiles `phase` of `config` for `tp` GPUs of `target`; returns (hlo_text, seconds).
    `seq` is the prompt (prefill, decode) or training length; `new_tokens` sizes the decode
    cache; `quantize="int8"`: int8 linear weights (prefill and decode only)."""

    if quantize is not None:
        config = dataclasses.replace(config, quantize=quantize)
    if phase == "train" and config.quantize is not None:
        raise OverlapError(f"quantize={config.quantize!r} is for decoding: the train phase "
                           f"runs float weights")
    if phase not in PHASES:
        raise OverlapError(f"unknown phase {phase!r}: choose one of {', '.join(PHASES)}")
    mesh = gpu_mesh(target, tp)
    sharding.check_divisible(config, tp)
    options = sharding.compiler_options("gpu")
    t0 = time.perf_counter()
    if phase in ("prefill", "decode"):
        lowered = lower_decoder(config, mesh, phase=phase, batch=batch, prompt_len=seq,
                                new_tokens=new_tokens)
        hlo = lowered.compile(compiler_options=options).as_text()
        return hlo, time.perf_counter() - t0
    graphdef, params = abstract(config, mesh)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, P()))
    optimizer = step.make_optimizer()
    # moments stored like their params, counters replicated (`jax.eval_shape` drops the
    # shardings: moments left replicated would put the whole model's AdamW state on every GPU,
    # and past XLA's memory limit the scheduler stops overlapping collectives)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_state,
        step.opt_state_shardings(optimizer, opt_state, params, mesh))

    def train(params, opt_state, tokens):
        return step.train_step(graphdef, params, opt_state, tokens, tokens,
                               optimizer=optimizer)

    lowered = jax.jit(train, compiler_options=options, donate_argnums=(0, 1)).lower(
        params, opt_state, tokens)
    hlo = lowered.compile().as_text()
    return hlo, time.perf_counter() - t0


PHASES = ("prefill", "decode", "train")


def compile_train_config(cfg, *, hosts: int = 1, gpus_per_host: int = 8, target: str = "h100"):
    """Compiles the training step that `cfg` (a TrainConfig) runs, for `hosts` x
    `gpus_per_host` GPUs of `target`: its mesh (`mesh.data` x `mesh.tp`, data filling what tp
    leaves), its weights stored as the trainer stores them (FSDP
    included), its dtypes, optimizer, gradient accumulation (`data.grad_accum` micro-batches of
    `data.batch_size` x `data.seq_len`) and rematerialization, the step function the trainer
    jits (`step.make_train_step`) with the same options. Returns (compiled, mesh, seconds)."""


    model_config = config_lib.check(cfg)
    n = hosts * gpus_per_host
    tp = cfg.mesh.tp
    if cfg.mesh.data is not None and cfg.mesh.data * tp != n:
        raise OverlapError(f"mesh.data={cfg.mesh.data} x mesh.tp={tp} = {cfg.mesh.data * tp} "
                           f"GPUs, but {hosts} hosts x {gpus_per_host} = {n}: set --hosts or "
                           f"mesh.data")
    if n % tp:
        raise OverlapError(f"mesh.tp={tp} does not divide the {n} GPUs")
    data = n // tp
    mesh = gpu_mesh(target, tp, data=data, hosts=hosts)
    sharding.check_batch(cfg.data.batch_size, mesh)
    graphdef, params = abstract(model_config, mesh, fsdp=cfg.mesh.fsdp)  # stored as trained
    optimizer = step.make_optimizer(cfg.optim, total_steps=cfg.steps)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             opt_state, step.opt_state_shardings(optimizer, opt_state, params,
                                                                 mesh))
    batch = jax.ShapeDtypeStruct(
        (cfg.data.grad_accum, cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32,
        sharding=NamedSharding(mesh, P(None, sharding.DATA, None)))
    train_step = step.make_train_step(
        graphdef, optimizer=optimizer, grad_clip=cfg.optim.grad_clip,
        param_shardings=[x.sharding for x in jax.tree.leaves(params)],
        opt_shardings=[x.sharding for x in jax.tree.leaves(opt_state)])
    t0 = time.perf_counter()
    compiled = sharding.jit(train_step, platform="gpu", donate_argnums=(0, 1)).lower(
        params, opt_state, batch).compile()
    return compiled, mesh, time.perf_counter() - t0
