"""Mesh, weight partition specs, the shard_map boundary, and the overlap-preserving reduce.

Tensor parallelism here is Megatron-style and spelled out by hand: every module (attention,
MLP) starts with column-parallel matmuls (heads N / kv heads K / MLP hidden F split over the
`tp` mesh axis) and ends with one row-parallel matmul whose result is a *partial sum* on each
rank. `reduce_tp` is the only place a module output is all-reduced; `tie` is how the ladder
keeps an all-reduce in flight across the next module's matmuls. Nothing is hidden in hooks.

Making the ladder's overlap real (measured on the compiled GPU schedule, see
`ladder_jax.overlap`): writing the psum of module i before module i+1 is not enough. XLA's
all-reduce combiner merges the two now-independent psums into one synchronous all-reduce, and
fusion pulls `x + psum_i` forward. Two things fix it, and both are applied by the package:
1. the model ties (`tie`) the in-flight result to the next module's output before adding it to
   the stream, so its only consumer comes after that module's matmuls (and the ladder's
   hand-written backward does the same with cotangents, see `ladder_jax.model.residual`);
2. `compiler_options("gpu")`, applied wherever the package compiles (`jit` below), turns the
   combiner off. If you jit the model yourself on GPUs, use `ladder_jax.model.sharding.jit`.
On CPU, `compiler_options("cpu")` keeps those ties through XLA:CPU's fusion, without which the
ladder's backward costs quadratically in depth (see `CPU_KEEP_BARRIERS_PASS`); training and
decoding compile with it, through `jit` below.

Mesh axes: `data` (batch) x `tp` (tensor parallel). Both are `AxisType.Auto`, so arrays need
not carry shardings before they enter the model; jit moves them.

How each weight is laid out (the `WeightSpecs` table below is the single source of truth):

| weight (einsum shape)    | spec              | why |
|--------------------------|-------------------|-----|
| q (D, N, H)              | (-, tp, -)        | column parallel over query heads |
| k, v (D, K, H)           | (-, tp, -)        | column parallel over kv heads ... |
|                          | (-, -, -) if K<tp | ... or replicated when fewer kv heads than ranks |
| o (N, H, D)              | (tp, -, -)        | row parallel: partial sums, one psum |
| gate, up (D, F)          | (-, tp)           | column parallel over the MLP hidden |
| down (F, D)              | (tp, -)           | row parallel |
| norm scales (D,)         | (-)               | tiny, replicated |
| embed (V, D)             | (-, -)            | replicated: the lookup needs no collective |
| head (D, V)              | (-, tp)           | vocab-parallel logits, returned sharded over V |
| cache keys (B, K', H, S) | (data, tp, -, -)  | K' = max(K, tp): see `CACHE_BKSH` |
| cache values (B,K',S,H)  | (data, tp, -, -)  | (keys keep their slots last) |
| fused input (D, C)       | (-, tp)           | decoding only (`transformer.FusedInput`): each |
|                          |                   | rank's columns of q, k, v (+ gate, up) or gate,up |

Memory costs of the replicated pieces, per rank:
- embed: V*D values (llama-3-70b: 128256*8192*2 B = 2.1 GB in bf16). The lookup then costs no
  communication and the first all-reduce of the network is a module's, which keeps the ladder's
  overlap pattern intact. With tied embeddings the head reads a V/tp slice of this same table.
- kv heads when K < tp: every rank holds all K heads of k and v (2*D*K*H values per layer,
  llama-3-70b at tp=16: 32 MB/layer in bf16) and uses the one its query heads belong to. Each
  kv head is computed by tp/K ranks; its gradient is summed over them by shard_map.

FSDP (`mesh.fsdp=true`, `Transformer(..., fsdp=True)`): every weight is also *stored* split over
`data` (`WeightSpecs.fsdp`), with its AdamW moments, and enters the shard_map that way; a module
all-gathers its weights over `data` where it reads them (`read_weight`), so a rank holds whole
only the weights of the modules at work, and each gradient leaves the backward reduce-scattered
over `data`. Without FSDP, weights are replicated over `data` and their gradients all-reduced.

Gradients of replicated weights are summed over `tp` by shard_map itself: we keep
`check_vma=True` everywhere so that this bookkeeping is done by JAX, not by hand.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax._src.lax.parallel import _psum_invariant_abstract_eval as _psum_typing
from jax._src.lax.parallel import _pvary_abstract_eval as _pvary_typing
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from ladder_jax import runtime
from ladder_jax.config import ConfigError

DATA = "data"
TP = "tp"


class ShardingError(ConfigError):
    """A model/mesh combination that cannot be sharded; the message says how to fix it."""


def make_mesh(tp: int | None = None, data: int | None = None, *, devices=None) -> Mesh:
    """A (data, tp) mesh over `devices` (default: all of them, on every process).

    With neither size given, all devices go to `tp`. With one given, the other takes the rest.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if tp is None and data is None:
        tp, data = n, 1
    elif tp is None:
        if data <= 0 or n % data:
            raise ShardingError(f"data={data} does not divide the {n} available devices")
        tp = n // data
    elif data is None:
        if tp <= 0 or n % tp:
            raise ShardingError(
                f"tp={tp} does not divide the {n} available devices: use a divisor of {n}")
        data = n // tp
    if tp <= 0 or data <= 0 or tp * data != n:
        raise ShardingError(
            f"data={data} x tp={tp} = {data * tp} devices, but {n} are available: "
            f"choose sizes whose product is {n}")
    grid = np.array(devices, dtype=object).reshape(data, tp)
    return Mesh(grid, (DATA, TP), axis_types=(AxisType.Auto, AxisType.Auto))


def setup_host(cpu_devices: int = 8) -> None:
    """For notebooks and scripts, before any jax work: on a host with no NVIDIA device use the
    CPU, split into `cpu_devices` fake devices so that tensor parallelism runs for real, only
    slower (`ladder_jax.runtime.setup`, which the command-line tools call)."""
    runtime.setup(cpu_devices=cpu_devices)


def tp_size(mesh: Mesh) -> int:
    return mesh.shape[TP]


def data_size(mesh: Mesh) -> int:
    return mesh.shape[DATA]


@dataclasses.dataclass(frozen=True)
class WeightSpecs:
    """Partition spec of every weight, by einsum shape (see the module docstring)."""

    embed_vd: P
    head_dv: P
    q_dnh: P
    kv_dkh: P
    o_nhd: P
    up_df: P  # gate and up
    down_fd: P
    norm_d: P
    kv_replicated: bool  # True when n_kv_heads < tp: each rank picks its head locally
    fsdp_data: int = 1  # FSDP: weights stored split over `data` too (its size; 1 = off)

    @classmethod
    def for_model(cls, config, mesh: Mesh, *, fsdp: bool = False) -> "WeightSpecs":
        """Validates that `config` can be split `tp` ways and returns its layout."""
        tp = tp_size(mesh)
        check_divisible(config, tp)
        kv_replicated = config.n_kv_heads < tp
        return cls(
            fsdp_data=data_size(mesh) if fsdp else 1,
            embed_vd=P(None, None),
            head_dv=P(None, TP),
            q_dnh=P(None, TP, None),
            kv_dkh=P(None, None, None) if kv_replicated else P(None, TP, None),
            o_nhd=P(TP, None, None),
            up_df=P(None, TP),
            down_fd=P(TP, None),
            norm_d=P(None),
            kv_replicated=kv_replicated,
        )


    @staticmethod
    def fsdp(spec: P, shape, n_data: int) -> P:
        """Where a weight is *stored* under FSDP (`mesh.fsdp`): its tp spec with the largest
        still-unsplit dimension that `n_data` divides also split over `data` (unchanged when
        none is). Its Adam moments follow it. The model's shard_map takes each weight in this
        layout and all-gathers it over `data` where a module reads it (`read_weight`), so only
        the weights of the module at work (and of the ones whose gathers are in flight) are
        whole on a rank; the gradient of the gather reduce-scatters the weight's gradient."""
        entries = list(spec) + [None] * (len(shape) - len(spec))
        free = [i for i, e in enumerate(entries) if e is None and shape[i] % n_data == 0]
        if n_data == 1 or not free:
            return spec
        entries[max(free, key=lambda i: shape[i])] = DATA
        return P(*entries)


# KV cache, per layer keys of global shape (B, K', H, S) and values (B, K', S, H), K' = max(K,
# tp): batch over `data`, kv heads over `tp`. With K < tp each rank caches the one kv head its
# query heads use, so ranks that share a head hold identical copies (the cache then costs tp/K
# times the unsharded size). Heads before slots, and keys with slots last: the decode step's
# two attention products are then plain matmuls batched over (B, K) that read each head's
# block as it lies: q (G, H) x keys (H, S), probabilities (G, S) x values (S, H). Stored
# (B, S, K, H), XLA copied the whole cache into that order and back in every layer of every
# step wherever a rank holds several kv heads (a deviceless H100 compile of llama-3-8b at tp 2:
# four cache-sized transposes per layer), and XLA:CPU spent ~3 ms of a 5 ms step (`small`,
# batch 16) in those copies.
CACHE_BKSH = P(DATA, TP, None, None)
CACHE_BSKH = CACHE_BKSH  # the name of earlier versions, kept for callers


def cache_kv_heads(config, tp: int) -> int:
    return max(config.n_kv_heads, tp)


def check_divisible(config, tp: int, flag: str | None = None) -> None:
    """Every count split over `tp` must divide evenly; fail early, naming numbers and fixes.
    `flag` is what sets tp where the caller reads it (`--tp`, `mesh.tp`): the message then
    names it, with the largest tp below this one that fits."""
    try:
        _check_divisible(config, tp)
    except ShardingError as e:
        if flag is None:
            raise
        fit = largest_tp(config, tp)
        use = f"{flag} {fit}" if flag.startswith("-") else f"{flag}={fit}"
        raise ShardingError(f"{e} (set by {flag}; e.g. {use})") from None


def fits(config, tp: int) -> bool:
    """Whether `config` splits evenly over `tp` (`check_divisible` passes)."""
    try:
        _check_divisible(config, tp)
    except ShardingError:
        return False
    return True


def largest_tp(config, limit: int) -> int:
    """The largest tp <= `limit` that `config` splits over evenly; 1 always does."""
    return max(t for t in range(1, max(1, limit) + 1) if fits(config, t))


def default_tp(config, devices: int, *, backend: str | None = None,
               cores: int | None = None, flag: str = "--tp") -> tuple[int, str]:
    """(tp, why) when the user named none: the largest tp that `config` splits over and that
    does not exceed `devices`, nor on a CPU backend half this host's cores (fake devices share
    the cores, and XLA:CPU runs each device's matmuls on several threads: a tp of all the
    cores only adds collectives). `why` is one line for stderr.

        tp, why = default_tp(config, len(jax.devices()))   # 1 on a 2-core host"""
    backend = backend or jax.default_backend()
    limit, over = devices, f"the {devices} device(s)"
    if backend == "cpu":
        cores = runtime.cpu_cores() if cores is None else cores
        if max(1, cores // 2) <= devices:
            limit, over = max(1, cores // 2), f"half this host's {cores} CPU core(s)"
    tp = largest_tp(config, limit)
    return tp, (f"tp={tp}: the largest that splits the model's {config.n_heads} heads "
                f"({config.n_kv_heads} kv heads) and fits {over} ({flag} to choose)")


def _check_divisible(config, tp: int) -> None:
    if config.n_heads % tp:
        raise ShardingError(
            f"n_heads={config.n_heads} is not divisible by tp={tp}: use a tp that divides "
            f"{config.n_heads}")
    n, k = config.n_heads, config.n_kv_heads
    if k >= tp and k % tp:
        raise ShardingError(
            f"n_kv_heads={k} is not divisible by tp={tp}: use a tp that divides {k}, or a "
            f"multiple of {k} (kv heads are then replicated)")
    if k < tp and tp % k:
        raise ShardingError(
            f"n_kv_heads={k} < tp={tp} and {k} does not divide {tp}: kv heads can only be "
            f"replicated when tp is a multiple of n_kv_heads; use tp in "
            f"{[d for d in range(1, n + 1) if n % d == 0 and (d % k == 0 or k % d == 0)]}")
    if config.d_ff % tp:
        raise ShardingError(
            f"d_ff={config.d_ff} is not divisible by tp={tp}: use a tp that divides {config.d_ff}")
    if config.vocab_size % tp:
        pad = -(-config.vocab_size // tp) * tp
        raise ShardingError(
            f"vocab_size={config.vocab_size} is not divisible by tp={tp} (the LM head is split "
            f"over the vocabulary): pad vocab_size to {pad}")


def check_batch(batch: int, mesh: Mesh) -> None:
    d = data_size(mesh)
    if batch % d:
        raise ShardingError(
            f"batch size {batch} is not divisible by the data axis ({d}): use a multiple of {d}")


# ---------------------------------------------------------------------------------------------
# Collectives of the tensor-parallel forward: every module output is reduced by `reduce_tp`, and
# `tie` orders it in the ladder. (FSDP gathers are `read_weight` / `embed_lookup` below; the
# gradient norm is `global_norm`.)


def reduce_tp(partial_sum: jax.Array) -> jax.Array:
    """All-reduce a module's row-parallel output over `tp` (issued here, consumed later).

    A tp axis of one device has nothing to add: the partial sum is the sum, so it passes
    through unchanged (typed tp-invariant, as psum's result is: `sum_of_one`). XLA keeps a
    psum over one device as an all-reduce, which XLA:CPU runs as a copy and a rendezvous: 33 of
    them (2 MB each) in the `small` preset's training step at tp=1."""
    if jax.lax.axis_size(TP) == 1:
        return sum_of_one(partial_sum, TP)
    return jax.lax.psum(partial_sum, TP)


def vary_tp(x: jax.Array) -> jax.Array:
    """`x` (tp-invariant: the residual stream) cast to tp-varying, as a module's input is before
    it meets the rank's weights; the transpose of that cast is the all-reduce of the input's
    cotangent (autodiff issues it). At tp=1 the cast is `vary_of_one`, whose transpose adds
    nothing either: no all-reduce in the backward."""
    if jax.lax.axis_size(TP) == 1:
        return _vary_of_one_p.bind(x, axes=(TP,))
    return jax.lax.pcast(x, TP, to="varying")


def _vary_over_one_data_rank(w: jax.Array) -> jax.Array:
    """A weight read inside shard_map, replicated over a `data` axis of one device: cast to
    data-varying here, as jax would cast it where it meets the rank's batch rows, but with a
    transpose that adds nothing. jax's cast transposes to an all-reduce of the weight's
    gradient over `data`, which over one device XLA:CPU runs as a copy of every gradient per
    step. With more data ranks jax's cast stays, and its real gradient all-reduce."""
    if DATA in jax.typeof(w).manual_axis_type.varying or jax.lax.axis_size(DATA) != 1:
        return w
    return _vary_of_one_p.bind(w, axes=(DATA,))


# psum and its transpose (pvary) over an axis of size 1, without a collective: the same type
# rules as jax's (varying over the axis in, invariant out; and back), each the other's
# transpose, lowered to nothing. They reach into jax's own typing rules of the pinned jax
# version (`_psum_invariant_abstract_eval`, `_pvary_abstract_eval`), so the types cannot
# disagree with psum's.

_sum_of_one_p = jax.extend.core.Primitive("ladder_sum_of_one")
_vary_of_one_p = jax.extend.core.Primitive("ladder_vary_of_one")
for _p in (_sum_of_one_p, _vary_of_one_p):
    _p.def_impl(lambda x, *, axes: x)
    mlir.register_lowering(_p, lambda ctx, x, *, axes: [x])
    batching.primitive_batchers[_p] = (
        lambda args, dims, *, axes, _p=_p: (_p.bind(args[0], axes=axes), dims[0]))
_sum_of_one_p.def_effectful_abstract_eval(
    lambda aval, *, axes: _psum_typing(_sum_of_one_p.name, aval, axes=axes))
_vary_of_one_p.def_abstract_eval(_pvary_typing)
ad.deflinear2(_sum_of_one_p, lambda ct, x, *, axes: (_vary_of_one_p.bind(ct, axes=axes),))
ad.deflinear2(_vary_of_one_p, lambda ct, x, *, axes: (_sum_of_one_p.bind(ct, axes=axes),))


def sum_of_one(x: jax.Array, axis: str) -> jax.Array:
    """`jax.lax.psum(x, axis)` for an `axis` of size 1 (checked), with no collective."""
    if jax.lax.axis_size(axis) != 1:
        raise ValueError(f"sum_of_one over axis {axis!r} of size {jax.lax.axis_size(axis)}")
    if axis not in jax.typeof(x).manual_axis_type.varying:
        return x  # psum of an invariant value over one device: x itself
    return _sum_of_one_p.bind(x, axes=(axis,))


# ---------------------------------------------------------------------------------------------
# `tie`: an optimization barrier that keeps each operand's type.
#
# jax.lax.optimization_barrier joins the varying-manual-axes (vma) types of its operands, so
# tying an all-reduced (tp-invariant) value to a partial sum (tp-varying) would make the
# residual stream varying from there on. `tie` lowers to the same XLA optimization barrier
# but gives every output exactly its input's type: sound, since the barrier is an identity.
# Its transpose is a tie of the cotangents.

_tie_p = jax.extend.core.Primitive("ladder_tie")
_tie_p.multiple_results = True
_tie_p.def_impl(lambda *xs: xs)
_tie_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(
    _tie_p, mlir.lower_fun(lambda *xs: jax.lax.optimization_barrier(xs), multiple_results=True))


def _tie_jvp(primals, tangents):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return _tie_p.bind(*primals), _tie_p.bind(*tangents)


def _tie_transpose(cts, *primals):
    return _tie_p.bind(*[ad.instantiate_zeros(c) for c in cts])


ad.primitive_jvps[_tie_p] = _tie_jvp
ad.primitive_transposes[_tie_p] = _tie_transpose
batching.primitive_batchers[_tie_p] = lambda args, dims, **_: (_tie_p.bind(*args), dims)


def tie(*xs):
    """Identity on `xs` that XLA must compute as one value: no consumer of any output can be
    scheduled before every input is ready. Keeps each operand's vma type."""
    return tuple(_tie_p.bind(*xs))


def compiler_options(platform: str, program: str = "any") -> dict[str, Any]:
    """XLA options ladder_jax compiles its programs with, per platform (and, on CPU, per kind
    of program: `program="train"` for training steps). One place, documented.

    GPU:
    - `xla_gpu_enable_latency_hiding_scheduler`: schedule async collectives early and their
      `done` late, around independent work (off by default in XLA:GPU).
    - `xla_gpu_all_reduce_combine_threshold_bytes=0`: never merge independent all-reduces;
      merging the ladder's psum of module i with module i+1's makes both synchronous. Cost:
      the optimizer's per-weight gradient-norm reductions (a few bytes each) stay separate.
    - `xla_gpu_experimental_parallel_collective_overlap_limit=8`: let up to eight collectives
      be in flight at once. In a training step the loss's vocab reduction is scheduled late,
      and with one slot it blocks a backward all-reduce from overlapping; under FSDP each
      module's weight all-gathers (and, in the backward, gradient reduce-scatters) run beside
      the previous module's all-reduce and take slots: with two, half of llama-3-70b's forward
      module all-reduces (8 x 8 GPUs) lost their overlap; with four, those of layers 76-78
      (the last layers' weight gathers fill the slots); with eight, all but the last.
      Decode and prefill programs hold fewer collectives at once and compile the same at 4
      and 8.
    CPU (XLA:CPU runs collectives synchronously: CPU runs prove numerics, never overlap):
    - `xla_disable_hlo_passes=CPU_KEEP_BARRIERS_PASS`: keep `tie`'s optimization barriers
      through fusion, as XLA:GPU does. See `CPU_KEEP_BARRIERS_PASS` for why the ladder's
      backward costs quadratically in depth without it.
    - training steps only (`program="train"`): `CPU_TRAIN_OPTIONS`, XLA:CPU's library path
      that wins for them on the CPUs measured (see there). A user's own XLA_FLAGS setting of
      the same option wins over the package's.
    `python -m ladder_jax.overlap` compiles with exactly the GPU ones and shows the schedule.
    """
    if program not in ("any", "train"):
        raise ValueError(f"program={program!r}: choose 'any' or 'train'")
    if platform in ("gpu", "cuda", "rocm"):
        return {
            "xla_gpu_enable_latency_hiding_scheduler": True,
            "xla_gpu_all_reduce_combine_threshold_bytes": 0,
            "xla_gpu_experimental_parallel_collective_overlap_limit": 8,
        }
    if platform == "cpu":
        opts = {"xla_disable_hlo_passes": CPU_KEEP_BARRIERS_PASS}
        if program == "train":
            flags = os.environ.get("XLA_FLAGS", "")
            opts.update({k: v for k, v in CPU_TRAIN_OPTIONS.items() if f"--{k}" not in flags})
        return opts
    return {}


# XLA:CPU's options for training steps. This jaxlib hands dots, elementwise ops and reductions
# to its YNNPACK library fusions by default; restricted to dots, with elementwise work and
# reductions left to XLA's own fused kernels, the `small` preset's training step (batch 16 x
# 128, float32, `benchmarks/cpu_flags.py`) ran 1.31-1.42x faster on a 2-core AVX-512 EPYC and
# 1.10-1.18x on a 2-core AVX2 EPYC, the best of every XLA:CPU option tried on both (the
# benchmark lists them). Decode and prefill programs keep XLA's defaults: there the prefill
# ran slower with it (104-108 -> 158-174 ms, batch 16 x 128) and the decode step the same.
CPU_TRAIN_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


# XLA:CPU's pass that strips optimization barriers early in its pipeline, before fusion (its
# registered name; an unknown name is silently ignored, tests/test_cpu_program.py notices).
#
# Why the ladder needs the barriers kept on CPU. The ladder's backward carries a running sum
# of stream cotangents: c_k = c_{k+1} + n_k, n_k being module k's norm input cotangent, and
# module k-2 reads c_k. Since each module reads the stream without its predecessor's output,
# n_k comes (through module k's matmuls) from c_{k+2}, not from c_{k+1}: c_k is linked to
# c_{k+1} by an addition only. XLA's fusion duplicates a multi-user producer into its
# consumers whenever it can fuse it into every one of them along every path; the additions and
# the bitcasts/transposes feeding the next matmuls all fuse, so no c is materialized and every
# consumer fusion recomputes the whole chain above it, RMSNorm backwards included: quadratic in
# depth, 2-2.7x standard's step time at 8 layers. (In standard, n_k comes from c_{k+1} through
# matmuls, which fusion cannot cross, so each c is computed once.) The ladder's backward already
# has such a path: it ties module k+1's in-flight cotangent to module k's matmul output (which
# comes from c_{k+2}) before n_{k+1} joins the sum. XLA:GPU keeps that barrier through fusion;
# XLA:CPU strips it first, and the path with it. Keeping it restores the path, and each c is
# materialized once. Exact: barriers are identities and the arithmetic is unchanged, only
# fusion boundaries move (gradients came out bit-identical at tp 1 and 2).
CPU_KEEP_BARRIERS_PASS = "cse_barrier_expander"


def jit(fn: Callable, *, platform: str | None = None, mesh: Mesh | None = None,
        program: str = "any", **jit_kwargs) -> Callable:
    """`jax.jit` with ladder_jax's compiler options for `platform`: given, else that of `mesh`'s
    devices (a deviceless GPU mesh on a CPU host compiles for the GPU), else the backend's;
    `program="train"` for a training step (`compiler_options`)."""
    if platform is None and mesh is not None:
        platform = mesh.devices.flat[0].platform
    platform = platform or jax.default_backend()
    opts = compiler_options(platform, program)
    if opts:
        jit_kwargs.setdefault("compiler_options", opts)
    return jax.jit(fn, **jit_kwargs)


def shard(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """The one shard_map boundary of the model (check_vma stays on)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def global_norm(tree, specs, mesh: Mesh) -> jax.Array:
    """The L2 norm of all arrays in `tree`, laid out as `specs` (one PartitionSpec per leaf:
    where each array is stored, e.g. the FSDP layout, so that nothing moves) on `mesh`, with
    ONE scalar all-reduce over the whole mesh: each rank sums the squares of its own blocks,
    counting a block that is replicated over some mesh axes only on the ranks at index 0 of
    those axes, and one psum adds the ranks' sums. Left to XLA, every sharded leaf would be
    reduced on its own: one small synchronous all-reduce per weight (the all-reduce combiner is
    off, see `compiler_options`)."""

    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    axes = tuple(mesh.axis_names)

    def split_over(spec) -> set:
        out = set()
        for entry in spec:
            out.update(entry if isinstance(entry, tuple) else (entry,))
        return out

    def local(*blocks):
        total = jnp.zeros((), jnp.float32)
        for block, spec in zip(blocks, spec_leaves):
            sq = jnp.sum(jnp.square(block.astype(jnp.float32)))
            owner = [jax.lax.axis_index(a) == 0 for a in axes if a not in split_over(spec)]
            for first in owner:
                sq = jnp.where(first, sq, 0.0)
            total = total + sq
        return jnp.sqrt(jax.lax.psum(total, axes))

    return shard(local, mesh, in_specs=tuple(spec_leaves), out_specs=P())(*leaves)


def read_weight(weight, dtype=None) -> jax.Array:
    """Inside shard_map: this rank's tp block of `weight` (an nnx Param of the model), cast to
    `dtype` if given. A weight stored split over `data` too (FSDP: its `stored` spec, see
    `WeightSpecs.fsdp`) is cast first, then all-gathered over `data` here, where it is used:
    gathered in the compute dtype (half the bytes of fp32 weights) and, under
    `model.remat=module`, gathered again for the backward instead of kept. The gather's
    transpose reduce-scatters the weight's gradient over `data`, in that dtype too."""
    w = weight[...]
    if dtype is not None:
        w = w.astype(dtype)
    stored = getattr(weight, "stored", None)
    split = [] if stored is None else [
        i for i, entry in enumerate(stored)
        if DATA in (entry if isinstance(entry, tuple) else (entry,))]
    if not split:
        return _vary_over_one_data_rank(w)
    return jax.lax.all_gather(w, DATA, axis=split[0], tiled=True)


def embed_lookup(embed, tokens_bt) -> jax.Array:
    """Inside shard_map: the rows (B, T, D) of the embedding table `embed` (an nnx Param, tp
    layout (V, D) replicated) for this rank's tokens. A table stored split over `data` along V
    (FSDP) is not gathered (V x D is the largest weight of a Llama): the data ranks' tokens are
    all-gathered instead, each rank looks up those that fall in its V / data rows (zeros for
    the others), and a reduce-scatter over `data` sums and returns each rank its own batch rows.
    The backward all-gathers the rows' cotangent and adds it into the rank's own table rows."""
    stored = getattr(embed, "stored", None)
    table_vd = embed[...]
    if stored is None or tuple(stored)[:1] != (DATA,):
        return jnp.take(read_weight(embed), tokens_bt, axis=0)
    v_local = table_vd.shape[0]
    tokens_all = jax.lax.all_gather(tokens_bt, DATA, axis=0, tiled=True)
    local = tokens_all - jax.lax.axis_index(DATA) * v_local
    mine = (local >= 0) & (local < v_local)
    rows_btd = jnp.take(table_vd, jnp.where(mine, local, 0), axis=0)
    rows_btd = jnp.where(mine[..., None], rows_btd, 0).astype(table_vd.dtype)
    return jax.lax.psum_scatter(rows_btd, DATA, scatter_dimension=0, tiled=True)


def varies_over(x: jax.Array, axis: str) -> bool:
    """Inside shard_map: whether `x`'s type says it may differ across `axis` (its vma)."""
    return axis in jax.typeof(x).manual_axis_type.varying


def axis_index_tp() -> jax.Array:
    return jax.lax.axis_index(TP)


def local_kv_head(w_dkh: jax.Array, n_kv_heads: int, tp: int) -> jax.Array:
    """With replicated kv weights (K < tp), the (D, 1, H) slice this rank's query heads use.

    Rank r holds query heads [r*N/tp, (r+1)*N/tp); they all belong to kv head r // (tp/K).
    """
    head = axis_index_tp() // (tp // n_kv_heads)
    return jax.lax.dynamic_slice_in_dim(w_dkh, head, 1, axis=1)


def local_vocab_rows(embed_vd: jax.Array, tp: int) -> jax.Array:
    """This rank's V/tp rows of a replicated (V, D) table (tied LM head)."""
    v_local = embed_vd.shape[0] // tp
    return jax.lax.dynamic_slice_in_dim(embed_vd, axis_index_tp() * v_local, v_local, axis=0)
