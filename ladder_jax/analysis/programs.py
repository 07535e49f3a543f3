"""What gets compiled, from shapes alone, for an NVIDIA GPU target on a machine with no GPU: the
decoder's programs (`compile_program`) and the trainer's step (`train_program`;
`compile_train_config` for a whole TrainConfig on N hosts). Options and the on-disk cache
(`LADDER_JAX_CACHE`): docs/analysis.md, 'Predict the speed-up'.

    hlo_text, seconds = compile_program(config, phase="decode", tp=8, batch=1, seq=1024)"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import shutil
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax import hardware, runtime, train_config
from ladder_jax.inference import generation
from ladder_jax.model import compilation, layout, paged
from ladder_jax.model.transformer import abstract
from ladder_jax.train import step

PLUGIN_HINT = (
    "deviceless GPU compilation needs the CUDA PJRT plugin at the jax version in use: "
    'pip install "jax-cuda12-plugin=={v}" "jax-cuda12-pjrt=={v}"  '
    '(or: pip install -e ".[analysis]"); no GPU or CUDA libraries are needed'
)


class OverlapError(RuntimeError):
    pass


def gpu_devices(target: str, n: int, *, hosts: int = 1) -> list:
    """`n` abstract GPUs of `target` on `hosts` hosts (n / hosts each), process by process: the
    plugin's topology `1 x hosts x n/hosts` (one slice). No GPU needed."""

    if target not in hardware.TARGETS:
        raise OverlapError(
            f"unknown target {target!r}: choose one of {', '.join(hardware.TARGETS)}"
        )
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
        raise OverlapError(f"hosts={hosts!r} must be a positive integer")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise OverlapError(f"{n!r} GPUs: tp (and data) must be positive integers")
    if n % hosts:
        raise OverlapError(
            f"{n} GPUs cannot be spread evenly over {hosts} hosts: use a GPU "
            f"count that {hosts} divides (or other --hosts)"
        )
    check_plugin()
    try:
        with runtime.quiet():  # the plugin's start-up lines on a host without a GPU
            topo = topologies.get_topology_desc(
                platform="cuda",
                target_config=hardware.gpu_target_config(target),
                topology=f"1x{hosts}x{n // hosts}",
            )
    except Exception as e:  # the plugin's errors are plain RuntimeErrors
        raise OverlapError(
            f"could not describe {hosts} hosts x {n // hosts} {target}: {e}\n"
            + PLUGIN_HINT.format(v=jax.__version__)
        ) from None
    return list(topo.devices)


def gpu_mesh(target: str, tp: int, *, data: int = 1, hosts: int = 1):
    """A (data, tp) mesh of abstract GPUs of `target` on `hosts` hosts (no GPU needed). Devices
    fill the mesh row by row, so a tp group is tp consecutive GPUs: one host when tp <= the
    GPUs per host."""

    devices = gpu_devices(target, data * tp, hosts=hosts)
    return Mesh(
        np.array(devices).reshape(data, tp),
        ("data", "tp"),
        axis_types=(AxisType.Auto, AxisType.Auto),
    )


def check_plugin() -> None:
    """Raises OverlapError with the install line when the CUDA PJRT plugin is missing."""

    try:  # find_spec of a dotted name imports its parent: it raises when that is missing
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise OverlapError(PLUGIN_HINT.format(v=jax.__version__))


def lower_decoder(
    config,
    mesh,
    *,
    phase: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    quantize: str | None = None,
    slots: int | None = None,
    draft: int = 4,
):
    """The lowered `Decoder` program `phase` (KV cache, per-row sampling) of `config` on
    `mesh`, from shapes: `prefill`, the one-token `decode` step, or the server's step programs:
    `extend` (`batch` cache rows take a chunk of `prompt_len` tokens each, at offsets that are
    runtime arrays: chunked prefill, the rest of a prompt after a reused prefix) and `verify`
    (every row's newest token and `draft` drafted ones: speculative decoding), these two over
    the server's paged cache (`PagedKV`, pages for every row at full length). The cache holds
    `prompt_len + new_tokens` (rounded as `decode` does), or `slots` per row (a server's
    `--max-len`). Sampling settings are runtime arrays, so one program serves greedy and
    sampled rows. `quantize="int8"`: int8 linear weights (`ladder_jax.model.quant`)."""
    if quantize is not None:
        config = dataclasses.replace(config, quantize=quantize)
    decoder = generation.Decoder(nnx.merge(*abstract(config, mesh)))  # weights: shapes
    S = slots or generation.cache_length(config, prompt_len, new_tokens)
    if phase in ("extend", "verify"):  # the server's: over its paged cache, every row full
        pages = batch * -(-S // paged.PAGE) + 1
        cache = generation.PagedKV.abstract(config, mesh, batch, S, pages)
    else:
        cache = generation.KVCache.abstract(config, mesh, batch, S)

    def rows_of(dtype, *shape):
        return jax.ShapeDtypeStruct(
            (batch, *shape), dtype, sharding=NamedSharding(mesh, P("data", *(None,) * len(shape)))
        )

    rows = rows_of(jnp.int32)
    settings = generation.RowSampling(
        rows_of(jnp.uint32, 2), rows_of(jnp.float32), rows_of(jnp.int32), rows_of(jnp.float32)
    )
    if phase == "prefill":
        return decoder.lower_prefill(cache, rows_of(jnp.int32, prompt_len), rows, settings)
    if phase == "extend":  # slots, tokens, starts, lengths, rows, token index
        tokens = rows_of(jnp.int32, prompt_len)
        return decoder.lower_extend(cache, rows, tokens, rows, rows, settings, rows)
    if phase == "verify":
        return decoder.lower_verify(cache, rows_of(jnp.int32, draft + 1), rows, settings, rows)
    return decoder.lower_decode(cache, rows, rows, settings, rows)


class CompileError(OverlapError):
    """XLA's GPU compiler failed on a program: one line naming the phase, tp and target."""


def compile_program(
    config,
    *,
    phase: str,
    tp: int,
    batch: int,
    seq: int,
    target: str = "h100",
    new_tokens: int = 512,
    hosts: int = 1,
    cache: bool = True,
    quantize: str | None = None,
    slots: int | None = None,
    allreduce: str = "nccl",
    draft: int = 4,
) -> tuple:
    """Compiles `phase` of `config` for `tp` GPUs of `target` on `hosts` hosts, its
    all-reduces as `allreduce` says (`compilation.ALLREDUCES`); returns
    (scheduled hlo_text, seconds). `seq` is the prompt (prefill, decode), chunk (extend) or
    training length; `draft` the drafted tokens per row (verify: each row feeds draft + 1);
    `new_tokens` sizes the decode cache (`slots`: that many per row instead, as a server sized
    by `--max-len` holds them); `quantize="int8"`: int8 linear weights (the decoder's
    phases only). Read from / written to the persistent cache unless `cache=False` (module
    doc); `LAST` says whether the last call was a cache hit and which fallback, if any, it
    compiled with."""

    if quantize is not None:
        config = dataclasses.replace(config, quantize=quantize)
    if phase == "train" and config.quantize is not None:
        raise OverlapError(
            f"quantize={config.quantize!r} is for decoding: the train phase runs float weights"
        )
    if phase not in PHASES:
        raise OverlapError(f"unknown phase {phase!r}: choose one of {', '.join(PHASES)}")
    for name, v in (
        ("tp", tp),
        ("batch", batch),
        ("seq", seq),
        ("new_tokens", new_tokens),
        ("draft", draft),
        *((("slots", slots),) if slots is not None else ()),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise OverlapError(f"{name}={v!r} must be a positive integer")
    mesh = gpu_mesh(target, tp, hosts=hosts)
    layout.check_divisible(config, tp)
    try:
        options = compilation.compiler_options("gpu", allreduce=allreduce)
    except ValueError as e:
        raise OverlapError(str(e)) from None
    t0 = time.perf_counter()
    if phase != "train":
        lowered = lower_decoder(
            config,
            mesh,
            phase=phase,
            batch=batch,
            prompt_len=seq,
            new_tokens=new_tokens,
            slots=slots,
            draft=draft,
        )
    else:
        lowered = train_program(config, mesh, batch=batch, seq_len=seq)
    path = (
        _cache_path(program_key(lowered, target=target, hosts=hosts, options=options))
        if cache
        else None
    )
    if path and os.path.exists(path):
        with gzip.open(path, "rt") as f:
            fallback, _, hlo = f.read().partition("\n")
        LAST.update(hit=True, fallback=fallback or None)
        CACHE_STATS["hits"] += 1
        return hlo, time.perf_counter() - t0
    with _kernel_reuse(target) as reuse:
        hlo, fallback = compile_lowered(
            lowered, what=f"the {phase} program at tp={tp} on {target}", options=options | reuse
        )
    LAST.update(hit=False, fallback=fallback)
    CACHE_STATS["misses"] += 1
    if path:
        _write_cache(path, (fallback or "") + "\n" + hlo)
    return hlo, time.perf_counter() - t0


PHASES = ("prefill", "decode", "extend", "verify", "train")
LAST: dict = {"hit": False, "fallback": None}
CACHE_STATS = {"hits": 0, "misses": 0}
_TILING = "Couldn't find output tile sizes"


@contextlib.contextmanager
def _kernel_reuse(target: str):
    """Compiler options with XLA's kernel cache: a kernel an earlier compile of this process
    built (the same fusion at another depth or scheme) is reused rather than compiled to PTX and
    machine code again (about a quarter of a 70B grid's compile time). It changes no HLO, so
    the program key leaves it out. Each compile holds a file of its target that no other
    compile is using (concurrent compiles never write the same file); the folder is removed at
    exit."""
    with _KERNEL_LOCK:
        d = _scratch_dir()
        free = _KERNEL_FILES.setdefault(target, [])
        path = (
            free.pop()
            if free
            else os.path.join(  # a new name, whether XLA wrote it yet or not
                d, f"{target}-{next(_KERNEL_NAMES)}.kernels"
            )
        )
    try:
        yield {"xla_gpu_kernel_cache_file": path}
    finally:
        with _KERNEL_LOCK:
            _KERNEL_FILES[target].append(path)


_KERNEL_FILES: dict[str, list[str]] = {}  # target -> kernel cache files no compile is using
_KERNEL_NAMES = itertools.count()
_KERNEL_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _scratch_dir() -> str:
    """This process's folder for compile-time files (kernel caches, the stand-in CUDA folder),
    removed at exit. Call with `_KERNEL_LOCK` held."""
    d = tempfile.mkdtemp(prefix="ladder_jax_kernels_")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


_STUB_PTXAS = """#!/bin/sh
# ladder_jax: ptxas for compiles whose machine code is never run (ladder_jax.analysis.programs).
case "$1" in --version) exec '{real}' "$@";; esac
out=
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
[ -n "$out" ] && : > "$out"
exit 0
"""


def _cuda_roots() -> list[str]:
    """Folders that may hold a CUDA toolkit (bin/ptxas, nvvm/libdevice), in the order tried."""
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH", "CUDA_DIR")]
    found = shutil.which("ptxas")
    if found:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(found))))
    roots.append("/usr/local/cuda")
    spec = importlib.util.find_spec("nvidia")  # CUDA from pip (jax[cuda12])
    for base in (spec.submodule_search_locations or []) if spec else []:
        roots.append(os.path.join(base, "cuda_nvcc"))
    return [r for r in roots if r]


def _analysis_options() -> dict:
    """Compiler options that skip the work no reader of the scheduled HLO needs (module doc:
    compile time): LLVM at optimization level 0 and, where a real `ptxas` and libdevice are
    found, `xla_gpu_cuda_data_dir` at a folder whose `ptxas` assembles nothing."""
    with _KERNEL_LOCK:
        cuda = _stub_cuda(_scratch_dir())
    return {
        "xla_backend_optimization_level": 0,
        **({"xla_gpu_cuda_data_dir": cuda} if cuda else {}),
    }


@functools.lru_cache(maxsize=1)
def _stub_cuda(parent: str) -> str | None:
    """A CUDA folder under `parent` whose ptxas assembles nothing (`_STUB_PTXAS`), the rest
    linked to the real toolkit; None without one. Made once; call with `_KERNEL_LOCK` held."""
    roots = _cuda_roots()
    ptxas = shutil.which("ptxas") or next(
        (p for p in (os.path.join(r, "bin", "ptxas") for r in roots) if os.access(p, os.X_OK)), None
    )
    nvvm = next(
        (
            os.path.join(r, "nvvm")
            for r in roots
            if os.path.isdir(os.path.join(r, "nvvm", "libdevice"))
        ),
        None,
    )
    if not ptxas or not nvvm or "'" in ptxas:
        return None
    root = os.path.join(parent, "cuda")
    os.makedirs(os.path.join(root, "bin"), exist_ok=True)
    tools = os.path.join(os.path.dirname(nvvm), "bin")  # nvlink, fatbinary, ... stay the real ones
    for name in os.listdir(tools) if os.path.isdir(tools) else ():
        if name != "ptxas":
            os.symlink(os.path.join(tools, name), os.path.join(root, "bin", name))
    stub = os.path.join(root, "bin", "ptxas")
    with open(stub, "w") as f:
        f.write(_STUB_PTXAS.format(real=os.path.abspath(ptxas)))
    os.chmod(stub, 0o755)
    os.symlink(nvvm, os.path.join(root, "nvvm"))
    return root


def compile_lowered(lowered, *, what: str, options: dict | None = None) -> tuple:
    """(scheduled HLO text, fallback or None) of a program lowered for GPUs, compiled with the
    package's GPU options, the analysis options (module doc: compile time) and `options` over
    them; `CompileError` naming `what` if XLA fails.

        text, fallback = compile_lowered(lowered, what="the decode step", options={...})
    """
    options = {**compilation.compiler_options("gpu"), **_analysis_options(), **(options or {})}
    return _compile_text(lowered, options, what=what)


def _compile_text(lowered, options: dict, *, what: str) -> tuple[str, str | None]:
    """(scheduled HLO text, fallback or None) of a lowered program (module doc: fallback)."""
    try:
        with runtime.quiet():
            return lowered.compile(compiler_options=options).as_text(), None
    except Exception as e:  # XLA's errors are JaxRuntimeErrors with the whole message
        if _TILING not in str(e):
            raise CompileError(
                f"XLA's GPU compiler failed on {what}: {str(e).strip().splitlines()[0][:300]}"
            ) from None
    try:
        with runtime.quiet():
            text = lowered.compile(
                compiler_options={**options, "xla_gpu_enable_triton_gemm": False}
            )
            return text.as_text(), "cublas-gemm"
    except Exception as e:
        raise CompileError(
            f"XLA's GPU compiler failed on {what}, with Triton GEMMs and with "
            f"cuBLAS GEMMs: {str(e).strip().splitlines()[0][:300]}"
        ) from None


def cache_dir() -> str | None:
    """Where compiled programs are kept (module doc), or None when the cache is off."""
    env = os.environ.get("LADDER_JAX_CACHE")
    if env is not None and env.strip().lower() in ("", "0", "off", "false", "no"):
        return None
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ladder_jax", "programs")


def program_key(lowered, *, target: str, hosts: int, options: dict) -> str:
    """The cache key of a program: what XLA is given to compile (the lowered StableHLO, without
    source locations), the jax / jaxlib / plugin versions, the compiler options and the target
    (its description and the hosts its GPUs are spread over). Equal keys, equal programs.

        key = program_key(lowered, target="h100", hosts=1, options=options)"""
    blob = json.dumps(
        {
            "versions": _versions(),
            "options": options,
            "hosts": hosts,
            "target": target,
            "target_config": hardware.gpu_target_config(target),
        },
        sort_keys=True,
        default=str,
    )
    h = hashlib.sha256(blob.encode())
    h.update(lowered.as_text().encode())
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def _versions() -> tuple:
    found = [jax.__version__, jaxlib.__version__]
    for dist in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        try:
            found.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            found.append("-")
    return tuple(found)


def _cache_path(key: str) -> str | None:
    d = cache_dir()
    return os.path.join(d, key + ".hlo.gz") if d else None


def _write_cache(path: str, text: str) -> None:
    """Atomic (a rename); a cache that cannot be written is skipped, never an error."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with (
            os.fdopen(fd, "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=3) as f,
        ):
            f.write(text.encode())
        os.replace(tmp, path)
    except OSError:
        pass


def train_program(
    config,
    mesh,
    *,
    batch: int,
    seq_len: int,
    grad_accum: int = 1,
    optim=None,
    total_steps: int = 10_000,
    fsdp: bool = False,
):
    """The lowered training step the trainer runs (`ladder_jax.train.step.make_train_step`,
    jitted with the package's options): weights stored as trained (`fsdp`), AdamW moments
    stored like their params, a batch of `grad_accum` x `batch` sequences of `seq_len` + 1
    tokens split over `data`. `optim` is an OptimizerConfig (default: its defaults)."""
    optim = optim or train_config.OptimizerConfig()
    graphdef, params = abstract(config, mesh, fsdp=fsdp)  # stored as trained
    optimizer = step.make_optimizer(optim, total_steps=total_steps)
    # moments stored like their params, counters replicated (`jax.eval_shape` drops the
    # shardings: moments left replicated would put the whole model's AdamW state on every GPU,
    # and past XLA's memory limit the scheduler stops overlapping collectives)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        opt_state,
        step.opt_state_shardings(optimizer, opt_state, params, mesh),
    )
    tokens = jax.ShapeDtypeStruct(
        (grad_accum, batch, seq_len + 1),
        jnp.int32,
        sharding=NamedSharding(mesh, P(None, layout.DATA, None)),
    )
    train_step = step.make_train_step(
        graphdef,
        optimizer=optimizer,
        grad_clip=optim.grad_clip,
        param_shardings=[x.sharding for x in jax.tree.leaves(params)],
        opt_shardings=[x.sharding for x in jax.tree.leaves(opt_state)],
    )
    return compilation.jit(train_step, platform="gpu", donate_argnums=(0, 1)).lower(
        params, opt_state, tokens
    )


def compile_train_config(cfg, *, hosts: int = 1, gpus_per_host: int = 8, target: str = "h100"):
    """Compiles the training step that `cfg` (a TrainConfig) runs, for `hosts` x
    `gpus_per_host` GPUs of `target`: its mesh (`mesh.data` x `mesh.tp`, data filling what tp
    leaves), its weights stored as the trainer stores them (FSDP
    included), its dtypes, optimizer, gradient accumulation (`data.grad_accum` micro-batches of
    `data.batch_size` x `data.seq_len`) and rematerialization, the step function the trainer
    jits (`step.make_train_step`) with the same options. Returns (compiled, mesh, seconds)."""

    model_config = train_config.check(cfg)
    n = hosts * gpus_per_host
    tp = cfg.mesh.tp
    if cfg.mesh.data is not None and cfg.mesh.data * tp != n:
        raise OverlapError(
            f"mesh.data={cfg.mesh.data} x mesh.tp={tp} = {cfg.mesh.data * tp} "
            f"GPUs, but {hosts} hosts x {gpus_per_host} = {n}: set --hosts or "
            f"mesh.data"
        )
    if n % tp:
        raise OverlapError(f"mesh.tp={tp} does not divide the {n} GPUs")
    data = n // tp
    mesh = gpu_mesh(target, tp, data=data, hosts=hosts)
    layout.check_batch(cfg.data.batch_size, mesh)
    t0 = time.perf_counter()
    lowered = train_program(
        model_config,
        mesh,
        batch=cfg.data.batch_size,
        seq_len=cfg.data.seq_len,
        grad_accum=cfg.data.grad_accum,
        optim=cfg.optim,
        total_steps=cfg.steps,
        fsdp=cfg.mesh.fsdp,
    )
    with runtime.quiet():  # the lean backend (module doc: compile time); nothing runs it
        compiled = lowered.compile(
            compiler_options={**compilation.compiler_options("gpu"), **_analysis_options()}
        )
    return compiled, mesh, time.perf_counter() - t0
